/*
 * VMM ranges of many pieces against a real gpxd: one address reservation onto which pieces
 * created with POSIX-fd handles are mapped back to back, as PyTorch's expandable segments
 * map them.  Ranges inside one piece, exactly one, across two, across many with unaligned
 * starts and ends, the whole: each registered as one region, copied out to host memory and
 * written from it, verified byte for byte with the bytes around it.  Then what a cache held
 * by gpxd saves (no driver import for pieces it holds, counted in its debug log, and the
 * cost of such a registration by pieces), growth of the reservation under a live region, the
 * owner freeing and remapping a piece a region still uses, refusals of bad pieces on the
 * wire, two processes, and the GPU memory given back once everything is let go.
 *
 * Run by tests/gpu-vmm.test, which skips without a GPU.  The child role re-executes this
 * program, because a process that initialised CUDA must not fork.
 */
#include "config.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "proto/ring.h"
#include "tests/gpu/gpu-util.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/util.h"

#define GUARD 64
#define MAXP 64

static CUcontext ctx[GPU_MAX];
static struct harness h;
static uint64_t seed = 12345;

/* A reservation and its pieces, with a host copy of what the mapped part should hold. */
struct resv {
	int dev;
	CUdeviceptr va;
	size_t size, gran;
	CUmemGenericAllocationHandle hd[MAXP];
	size_t off[MAXP], len[MAXP];
	bool mapped[MAXP];
	int n;
	unsigned char *mirror;
};

static void
resv_new(struct resv *r, int dev, size_t granules)
{
	memset(r, 0, sizeof(*r));
	r->dev = dev;
	r->gran = vmm_granularity(dev);
	r->size = granules * r->gran;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemAddressReserve(&r->va, r->size, 0, 0, 0));
	if ((r->mirror = calloc(1, r->size)) == NULL)
		tap_bail("out of memory");
}

/* Maps piece i (its place and size set) anew, filled with random bytes. */
static void
resv_fill(struct resv *r, int i)
{
	uint64_t *w = (uint64_t *)(r->mirror + r->off[i]);

	r->hd[i] = vmm_piece(r->dev, r->va + r->off[i], r->len[i]);
	r->mapped[i] = true;
	for (size_t k = 0; k < r->len[i] / 8; k++)
		w[k] = xorshift(&seed);
	CK(cuMemcpyHtoD(r->va + r->off[i], r->mirror + r->off[i], r->len[i]));
}

/* Maps a piece of `granules` granules at granule `at`; its index. */
static int
resv_map(struct resv *r, size_t at, size_t granules)
{
	int i = r->n++;

	r->off[i] = at * r->gran;
	r->len[i] = granules * r->gran;
	resv_fill(r, i);
	return i;
}

/* The owner lets go of piece i: unmapped, its handle released (PyTorch's empty_cache). */
static void
resv_unmap(struct resv *r, int i)
{
	CK(cuMemUnmap(r->va + r->off[i], r->len[i]));
	CK(cuMemRelease(r->hd[i]));
	r->mapped[i] = false;
}

/* Lines of gpxd's log that name a VMM piece imported. */
static int
imports(void)
{
	char line[512];
	int n = 0;
	FILE *f = fopen(h.log, "r");

	if (f == NULL)
		return -1;
	while (fgets(line, sizeof(line), f) != NULL)
		n += strstr(line, "imported a VMM piece") != NULL;
	fclose(f);
	return n;
}

static int
copy_wait(gpx_conn *c, gpx_region src, uint64_t so, gpx_region dst, uint64_t dof, uint64_t len)
{
	static uint64_t tag = 1;
	struct gpx_completion e;
	int r = gpx_copy(c, src, so, dst, dof, len, ++tag);

	r = r < 0 ? r : gpx_wait_tag(c, tag, &e, 60000);
	return r < 0 ? r : e.status;
}

/*
 * Registers [off, off + len) of the reservation as one region, copies it out to host memory
 * and checks it against the mirror, writes random bytes into it from host memory and checks
 * them (and the bytes around it, where mapped) on the GPU.  The region, or 0 after a failure.
 */
static gpx_region
check_range(gpx_conn *c, struct resv *r, size_t off, size_t len, const char *what, bool keep)
{
	unsigned char *host, *got = malloc(len + 2 * GUARD), *want = malloc(len);
	gpx_region reg = 0, hr;
	int fd, e;

	if (got == NULL || want == NULL || gpx_host_alloc(len + 2 * GUARD, &fd, (void **)&host) < 0 ||
	    gpx_register_host(c, fd, 0, len + 2 * GUARD, 0, &hr) < 0)
		tap_bail("cannot set up host memory");
	memset(host, 0xa5, len + 2 * GUARD);
	e = gpx_register_cuda(c, (void *)(r->va + off), len, 0, &reg);
	e = e < 0 ? e : copy_wait(c, reg, 0, hr, GUARD, len);
	bool same = e == 0 && memcmp(host + GUARD, r->mirror + off, len) == 0;
	for (int i = 0; i < GUARD && same; i++)
		same = host[i] == 0xa5 && host[GUARD + len + i] == 0xa5;
	ok(same, "%s (%zu+%zu): out of the region, byte for byte, nothing around it touched", what, off, len);
	if (e < 0)
		diag("%s: %s", gpx_strerror(e), gpx_last_error(c));
	/* In: new bytes, and the mapped bytes on either side must not change. */
	for (size_t i = 0; i < len; i++)
		want[i] = (unsigned char)xorshift(&seed);
	memcpy(host + GUARD, want, len);
	e = e < 0 ? e : copy_wait(c, hr, GUARD, reg, 0, len);
	size_t lo = off >= GUARD ? off - GUARD : 0, hi = off + len + GUARD <= r->size ? off + len + GUARD : r->size;
	bool mapped = true;
	for (size_t at = lo; at < hi && mapped; at += r->gran / 4) {
		bool in = false;
		for (int i = 0; i < r->n; i++)
			in |= r->mapped[i] && at >= r->off[i] && at < r->off[i] + r->len[i];
		mapped = in;
	}
	if (!mapped)
		lo = off, hi = off + len;
	CK(cuMemcpyDtoH(got, r->va + lo, hi - lo));
	memcpy(r->mirror + off, want, len);
	ok(e == 0 && memcmp(got, r->mirror + lo, hi - lo) == 0, "%s: into the region, byte for byte%s", what,
	    mapped ? ", and the bytes around it as they were" : "");
	gpx_deregister(c, hr);
	gpx_host_free(fd, host, len + 2 * GUARD);
	free(got);
	free(want);
	if (!keep && reg != 0) {
		gpx_deregister(c, reg);
		reg = 0;
	}
	return e == 0 ? reg : 0;
}

static double
us_since(const struct timespec *t0)
{
	struct timespec t1;

	clock_gettime(CLOCK_MONOTONIC, &t1);
	return (t1.tv_sec - t0->tv_sec) * 1e6 + (t1.tv_nsec - t0->tv_nsec) / 1e3;
}

/* p50 of n registrations of [off, off + len) over pieces gpxd holds, in us. */
static double
cached_p50(gpx_conn *c, struct resv *r, size_t off, size_t len, int n)
{
	double t[200];
	gpx_region reg;

	for (int i = 0; i < n; i++) {
		struct timespec t0;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		int e = gpx_register_cuda(c, (void *)(r->va + off), len, 0, &reg);
		t[i] = us_since(&t0);
		if (e < 0)
			return -1;
		gpx_deregister(c, reg);
	}
	qsort(t, n, sizeof(t[0]), cmp_double);
	return t[n / 2];
}

static void
test_ranges(gpx_conn *c)
{
	struct resv r;
	const size_t G = vmm_granularity(0);

	/* 64 granules of addresses; pieces of 1, 1, 1, 3, 1, 2, 1, 1 granules from 0 on. */
	resv_new(&r, 0, 64);
	static const size_t sizes[] = { 1, 1, 1, 3, 1, 2, 1, 1 };
	size_t at = 0;
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		resv_map(&r, at, sizes[i]);
		at += sizes[i];
	}
	const size_t end = at * G;
	diag("a reservation of %zu MiB, %d pieces mapped over its first %zu MiB", r.size >> 20, r.n, end >> 20);
	check_range(c, &r, 100, 1000, "inside one piece", false);
	check_range(c, &r, G, G, "exactly one piece", false);
	check_range(c, &r, G - 777, 5000, "across two pieces", false);
	check_range(c, &r, 3, end - 3 - 5, "across all pieces, unaligned at both ends", false);
	check_range(c, &r, 3 * G + 12345, 3 * G, "inside the 3-granule piece and into the next", false);
	gpx_region reg;
	int e = gpx_register_cuda(c, (void *)(r.va + end - 10), 100, 0, &reg);
	ok(e == -GPX_ERANGE, "a range running past the mapped pieces: %s (%s)", gpx_strerror(e), gpx_last_error(c));

	/* gpxd holds every piece while one region spans them: no import for what lies under it. */
	int i0 = imports();
	gpx_region all = check_range(c, &r, 0, end, "the whole mapped part, kept", true);
	int i1 = imports();
	ok(all != 0 && i1 - i0 == r.n, "registering it imported each of the %d pieces once (%d)", r.n, i1 - i0);
	double one = cached_p50(c, &r, 5 * G + 64, 4096, 101);
	double two = cached_p50(c, &r, G - 64, 4096, 101);
	double many = cached_p50(c, &r, 0, end, 101);
	ok(imports() == i1 && one > 0 && two > 0 && many > 0, "303 registrations over held pieces imported nothing");
	diag("registration over held pieces, p50: 1 piece %.1f us, 2 pieces %.1f us, %d pieces %.1f us "
	    "(%.2f us per extra piece)", one, two, r.n, many, (many - one) / (r.n - 1));

	/* The reservation grows under the live region: a new piece at the end. */
	resv_map(&r, end / G, 2);
	check_range(c, &r, end - 100, 300, "across the newest piece and the one before", false);
	ok(imports() == i1 + 1, "growing imported only the new piece");
	check_range(c, &r, 0, end, "the region from before the growth, still whole", false);

	/* The owner frees piece 1 while the kept region uses it, then maps a new one there. */
	unsigned char *old = malloc(G);
	int fd;
	unsigned char *host;
	gpx_region hr;
	memcpy(old, r.mirror + G, G);
	resv_unmap(&r, 1);
	e = gpx_register_cuda(c, (void *)(r.va + G - 10), 20, 0, &reg);
	ok(e == -GPX_ERANGE, "a range over the hole the owner left: %s", gpx_strerror(e));
	if (gpx_host_alloc(G, &fd, (void **)&host) < 0 || gpx_register_host(c, fd, 0, G, 0, &hr) < 0)
		tap_bail("host memory");
	e = copy_wait(c, all, G, hr, 0, G);
	ok(e == 0 && memcmp(host, old, G) == 0, "the kept region still reads the freed piece's bytes: gpxd's "
	    "mapping keeps that memory");
	resv_fill(&r, 1);      /* a new piece where the owner freed one */
	check_range(c, &r, G - 50, 100, "across the remapped piece (a new generation of the mirror)", false);
	e = copy_wait(c, all, G, hr, 0, G);
	ok(e == 0 && memcmp(host, old, G) == 0, "the kept region still reads the old bytes, not the new piece's");
	gpx_deregister(c, all);
	gpx_deregister(c, hr);
	gpx_host_free(fd, host, G);
	free(old);
	for (int i = 0; i < r.n; i++)
		if (r.mapped[i])
			resv_unmap(&r, i);
	CK(cuMemAddressFree(r.va, r.size));
	free(r.mirror);
}

/* ---- bad pieces on the wire ---- */

static int
send_pieces(int s, const uint8_t uuid[16], uint64_t res, uint64_t rsize, const struct gpx_wire_piece *p,
    const int *fds, int n)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Pieces ps = GPX__PIECES__INIT;
	Gpx__Piece one[4], *ptr[4];

	for (int i = 0; i < n; i++) {
		gpx__piece__init(&one[i]);
		one[i].id = p[i].id;
		one[i].offset = p[i].offset;
		one[i].size = p[i].size;
		ptr[i] = &one[i];
	}
	ps.device_uuid.data = (uint8_t *)uuid;
	ps.device_uuid.len = 16;
	ps.reservation = res;
	ps.reservation_size = rsize;
	ps.n_pieces = n;
	ps.pieces = ptr;
	m.seq = 7;
	m.body_case = GPX__CLIENT_MSG__BODY_PIECES;
	m.pieces = &ps;
	return harness_request(s, &m, fds, n, 30000, NULL);
}

static int
register_pieces(int s, unsigned char *area, const uint8_t uuid[16], uint64_t res, uint64_t rsize, uint64_t off,
    uint64_t len, const struct gpx_wire_piece *p, int n, Gpx__DaemonMsg **reply)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Register reg = GPX__REGISTER__INIT;

	memcpy(area, p, n * sizeof(*p));
	reg.kind = GPX__MEM_KIND__MEM_CUDA_VMM;
	reg.offset = off;
	reg.length = len;
	reg.device_uuid.data = (uint8_t *)uuid;
	reg.device_uuid.len = 16;
	reg.alloc_id = res;
	reg.alloc_size = rsize;
	reg.piece_count = n;
	reg.area_offset = 0;
	m.seq = 8;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = &reg;
	return harness_request(s, &m, NULL, 0, 30000, reply);
}

static void
test_wire(void)
{
	const size_t G = vmm_granularity(0);
	unsigned char *area;
	int s = harness_area_client(&h, GPX_PROTO_VERSION, &area, 1 << 20);
	CUdeviceptr va;
	CUmemGenericAllocationHandle hd[2];
	CUuuid u;
	CUdevice d;
	int fd[2];

	if (s < 0)
		tap_bail("cannot set up a raw client");
	CK(cuDeviceGet(&d, 0));
	CK(cuDeviceGetUuid(&u, d));
	const uint8_t *uuid = (const uint8_t *)u.bytes;
	CK(cuMemAddressReserve(&va, 4 * G, 0, 0, 0));
	for (int i = 0; i < 2; i++) {
		hd[i] = vmm_piece(0, va + i * G, G);
		CK(cuMemExportToShareableHandle(&fd[i], hd[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	}
	struct gpx_wire_piece p[2] = { { 1, 0, G }, { 2, G, G } };
	int mfd = memfd_create("not-a-piece", MFD_CLOEXEC);
	ok(send_pieces(s, uuid, va, 4 * G, p, &mfd, 1) == GPX__STATUS__EBADFD, "a memfd as a piece: EBADFD");
	close(mfd);
	ok(send_pieces(s, uuid, va, 4 * G, p, fd, 1) == 0 && send_pieces(s, uuid, va, 4 * G, p, fd, 1) == 0,
	    "a piece sent twice: both accepted (the second is known)");
	struct gpx_wire_piece wrong = { 2, G, 2 * G };
	ok(send_pieces(s, uuid, va, 4 * G, &wrong, &fd[1], 1) == GPX__STATUS__EINVAL,
	    "a piece claimed twice its size: the driver will not map it, EINVAL");
	struct gpx_wire_piece out = { 2, 3 * G, 2 * G };
	ok(send_pieces(s, uuid, va, 4 * G, &out, &fd[1], 1) == GPX__STATUS__EINVAL,
	    "a piece leaving the reservation: EINVAL");
	Gpx__DaemonMsg *rep;
	int st = register_pieces(s, area, uuid, va, 4 * G, 10, G + 10, p, 2, &rep);
	ok(st == GPX__STATUS__ENOENT && rep != NULL && rep->reply->n_missing == 1 && rep->reply->missing[0] == 1,
	    "a range over a held piece and one never sent: ENOENT naming the second (%s)",
	    rep ? rep->reply->message : "no reply");
	if (rep != NULL)
		gpx__daemon_msg__free_unpacked(rep, NULL);
	struct gpx_wire_piece gap[2] = { { 1, 0, G }, { 2, 2 * G, G } };
	ok(register_pieces(s, area, uuid, va, 4 * G, 10, 100, gap, 2, NULL) == GPX__STATUS__EINVAL,
	    "pieces that do not follow one another: EINVAL");
	ok(register_pieces(s, area, uuid, va, 4 * G, G - 10, 100, p, 1, NULL) == GPX__STATUS__ERANGE,
	    "a range leaving its pieces: ERANGE");
	ok(send_pieces(s, uuid, va, 4 * G, &p[1], &fd[1], 1) == 0 &&
	    register_pieces(s, area, uuid, va, 4 * G, 10, G + 10, p, 2, NULL) == 0,
	    "once the missing piece is sent, the range registers");
	close(s);
	munmap(area, 1 << 20);
	for (int i = 0; i < 2; i++) {
		close(fd[i]);
		CK(cuMemUnmap(va + i * G, G));
		CK(cuMemRelease(hd[i]));
	}
	CK(cuMemAddressFree(va, 4 * G));
}

/* ---- two processes: one exports a range of three pieces, the other writes into it ---- */

static int
child_owner(const char *sock)
{
	struct gpx_export_opts o = { .rule = GPX_EXPORT_UID, .notify = 1, .notify_tag = 99 };
	struct gpx_completion done;
	struct resv r;
	gpx_conn *c;
	gpx_region reg;

	gpu_contexts(ctx);
	resv_new(&r, 0, 8);
	for (int i = 0; i < 3; i++)
		resv_map(&r, i, 1);
	CK(cuMemsetD8(r.va, 0, 3 * r.gran));
	if (gpx_connect(sock, "vmm-owner", &c) < 0 ||
	    gpx_register_cuda(c, (void *)(r.va + 1000), 3 * r.gran - 2000, 0, &reg) < 0 ||
	    gpx_export(c, reg, "vmm.three", &o) < 0)
		return 10;
	printf("ready\n");
	fflush(stdout);
	if (gpx_wait(c, &done, 1, 60000) != 1 || !(done.flags & GPX_COMP_NOTIFY))
		return 11;
	unsigned char *got = malloc(3 * r.gran);
	CK(cuMemcpyDtoH(got, r.va, 3 * r.gran));
	uint64_t x = 777;
	for (size_t i = 0; i < 3 * r.gran; i++) {
		unsigned char want = i >= 1000 && i < 3 * r.gran - 1000 ? (unsigned char)xorshift(&x) : 0;
		if (got[i] != want)
			return 12;
	}
	gpx_close(c);
	return 0;
}

static void
test_two_processes(const char *self, gpx_conn *c)
{
	int pfd[2];
	char line[16] = "";

	if (pipe(pfd) < 0)
		tap_bail("pipe");
	pid_t pid = fork();
	if (pid == 0) {
		dup2(pfd[1], 1);
		execl(self, self, "owner", h.sock, (char *)NULL);
		_exit(127);
	}
	close(pfd[1]);
	FILE *f = fdopen(pfd[0], "r");
	bool ready = fgets(line, sizeof(line), f) != NULL && strcmp(line, "ready\n") == 0;
	gpx_region imp, hr;
	uint64_t len = 0;
	int fd, e = ready ? gpx_import(c, "vmm.three", &imp, &len) : -1;
	unsigned char *host;
	size_t g = vmm_granularity(0);
	if (e < 0 || gpx_host_alloc(len, &fd, (void **)&host) < 0 || gpx_register_host(c, fd, 0, len, 0, &hr) < 0) {
		ok(0, "the owner's range of three pieces is imported (%s)", gpx_strerror(e));
		kill(pid, SIGKILL);
	} else {
		uint64_t x = 777;
		for (size_t i = 0; i < len; i++)
			host[i] = (unsigned char)xorshift(&x);
		e = copy_wait(c, hr, 0, imp, 0, len);
		ok(e == 0 && len == 3 * g - 2000, "another process's range of three pieces, imported, written whole");
		gpx_deregister(c, hr);
		gpx_host_free(fd, host, len);
	}
	int st;
	waitpid(pid, &st, 0);
	ok(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the owner saw the notification and every byte in its pieces "
	    "(exit %d)", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	fclose(f);
}

int
main(int argc, char **argv)
{
	gpx_conn *c;
	size_t free0, free1, total;

	if (argc >= 3 && strcmp(argv[1], "owner") == 0)
		return child_owner(argv[2]);
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	int ndev = gpu_contexts(ctx);
	diag("%d GPU(s)", ndev);
	if (harness_start(&h, "[daemon]\nlog_level = debug gpu\n") < 0)
		tap_bail("cannot start gpxd");
	CK(cuMemGetInfo(&free0, &total));
	int base = h.baseline;
	if (gpx_connect(h.sock, "gpu-vmm", &c) < 0)
		tap_bail("cannot connect");
	test_ranges(c);
	test_wire();
	test_two_processes("/proc/self/exe", c);   /* this program again, however it was started */
	gpx_close(c);
	ok(harness_wait_fds(&h, base, 10000) == base, "gpxd is back to its baseline descriptors");
	/* Every piece is freed by its owner and let go by gpxd: the memory comes back. */
	double t0 = now();
	do {
		CK(cuMemGetInfo(&free1, &total));
	} while (free1 + (8u << 20) < free0 && now() - t0 < 10 && usleep(20000) == 0);
	ok(free1 + (8u << 20) >= free0, "the GPU's free memory is back (%zu MiB then, %zu MiB now)", free0 >> 20,
	    free1 >> 20);
	int st = harness_stop(&h);
	ok(st == 0, "gpxd stopped cleanly (exit %d)", st);
	if (tap_failed)
		harness_dump_log(&h);
	harness_cleanup(&h);
	return tap_done();
}
