/*
 * GPU tests against a real gpxd: every memory kind (host memfd, cuda-ipc from cuMemAlloc,
 * cuda-vmm from cuMemCreate with POSIX-fd handles) on every device, copied over every path
 * (same GPU, GPU to GPU, host to GPU and back, host to host) with random sizes, offsets and
 * data, verified byte for byte together with guard bytes around each destination range.  Then
 * vectored copies of scattered pages (the SM kernel path), an interior pointer of a larger
 * allocation (as PyTorch's caching allocator hands out), the refusal of legacy handles on a
 * multi-tenant node, two client processes where one copies into the other's exported buffer,
 * a client that dies mid-copy and an owner that frees its buffer mid-copy.
 *
 * Run by tests/gpu.test, which skips (77) on a machine without a GPU.  Child roles re-execute
 * this program, because a process that initialised CUDA must not fork.
 */
#include "config.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/tap.h"

#define BUF (16u << 20)
#define GUARD 64

static CUcontext ctx[8];
static struct harness *the_harness;
static int ndev;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t
rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static void
fill(unsigned char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)rnd();
}

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *n_ = "?"; \
	cuGetErrorName(r_, &n_); tap_bail("%s: %s", #x, n_); } } while (0)

/* A buffer of one kind, with a host mirror of what it should hold. */
struct buf {
	const char *name;
	int dev;                  /* -1: host memfd */
	int vmm;
	CUdeviceptr d;
	CUmemGenericAllocationHandle h;
	size_t alloc;
	int fd;
	unsigned char *host;      /* host kind: the mapping */
	unsigned char *mirror;
	gpx_region region;
};

static void
buf_write(struct buf *b, size_t off, const void *src, size_t n)
{
	if (b->dev < 0)
		memcpy(b->host + off, src, n);
	else {
		CK(cuCtxSetCurrent(ctx[b->dev]));
		CK(cuMemcpyHtoD(b->d + off, src, n));
	}
}

static void
buf_read(struct buf *b, size_t off, void *dst, size_t n)
{
	if (b->dev < 0)
		memcpy(dst, b->host + off, n);
	else {
		CK(cuCtxSetCurrent(ctx[b->dev]));
		CK(cuMemcpyDtoH(dst, b->d + off, n));
	}
}

static void
vmm_alloc(int dev, size_t size, CUdeviceptr *d, CUmemGenericAllocationHandle *h, size_t *alloc)
{
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, dev },
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
	};
	size_t gran;
	CUmemAccessDesc a = { { CU_MEM_LOCATION_TYPE_DEVICE, dev }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };

	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	*alloc = (size + gran - 1) / gran * gran;
	CK(cuMemCreate(h, *alloc, &prop, 0));
	CK(cuMemAddressReserve(d, *alloc, 0, 0, 0));
	CK(cuMemMap(*d, *alloc, 0, *h, 0));
	CK(cuMemSetAccess(*d, *alloc, &a, 1));
}

static void
buf_init(struct buf *b, const char *name, int dev, int vmm, gpx_conn *c)
{
	int r;

	memset(b, 0, sizeof(*b));
	b->name = name;
	b->dev = dev;
	b->vmm = vmm;
	b->fd = -1;
	b->mirror = malloc(BUF);
	fill(b->mirror, BUF);
	if (dev < 0) {
		if (gpx_host_alloc(BUF, &b->fd, (void **)&b->host) < 0)
			tap_bail("gpx_host_alloc");
	} else if (vmm)
		vmm_alloc(dev, BUF, &b->d, &b->h, &b->alloc);
	else {
		CK(cuCtxSetCurrent(ctx[dev]));
		CK(cuMemAlloc(&b->d, BUF));
	}
	buf_write(b, 0, b->mirror, BUF);
	if (dev < 0)
		r = gpx_register_host(c, b->fd, 0, BUF, 0, &b->region);
	else
		r = gpx_register_cuda(c, (void *)b->d, BUF, 0, &b->region);
	if (!ok(r == 0, "register %s", name)) {
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
		if (the_harness != NULL)
			harness_dump_log(the_harness);
	}
}

/* One random copy a -> b through the daemon, checked with guard bytes on both sides. */
static bool
random_copy(gpx_conn *c, struct buf *a, struct buf *b)
{
	size_t len = 1 + rnd() % (rnd() % 4 == 0 ? BUF / 2 : 65536);
	size_t so = rnd() % (BUF - len + 1), d0 = GUARD + rnd() % (BUF - len - 2 * GUARD + 1);
	static unsigned char got[BUF / 2 + 2 * GUARD];
	int r;

	if (a == b && (so < d0 + len && d0 < so + len))
		return true;   /* overlapping ranges of one buffer are undefined */
	r = gpx_copy_sync(c, a->region, so, b->region, d0, len);
	if (r != 0) {
		diag("copy %s -> %s of %zu: %s (%s)", a->name, b->name, len, gpx_strerror(r), gpx_last_error(c));
		return false;
	}
	memmove(b->mirror + d0, a->mirror + so, len);
	buf_read(b, d0 - GUARD, got, len + 2 * GUARD);
	if (memcmp(got, b->mirror + d0 - GUARD, len + 2 * GUARD) != 0) {
		diag("copy %s -> %s of %zu at %zu -> %zu: bytes differ", a->name, b->name, len, so, d0);
		return false;
	}
	return true;
}

static void
test_matrix(gpx_conn *c, struct buf *bufs, int nb)
{
	for (int i = 0; i < nb; i++)
		for (int j = 0; j < nb; j++) {
			bool good = true;
			for (int k = 0; k < 6 && good; k++)
				good = random_copy(c, &bufs[i], &bufs[j]);
			ok(good, "random copies %s -> %s verified", bufs[i].name, bufs[j].name);
		}
}

/* Scattered pages in one vectored request: the SM kernel between GPUs, copy engines otherwise. */
static void
test_vectored(gpx_conn *c, struct buf *a, struct buf *b, size_t page, int n, bool odd)
{
	struct gpx_seg *s = calloc(n, sizeof(*s));
	size_t slots = BUF / page;
	int *perm = malloc(slots * sizeof(int));
	struct gpx_completion done;

	for (size_t i = 0; i < slots; i++)
		perm[i] = i;
	for (size_t i = slots - 1; i > 0; i--) {
		size_t k = rnd() % (i + 1);
		int t = perm[i];
		perm[i] = perm[k];
		perm[k] = t;
	}
	for (int i = 0; i < n; i++) {
		s[i].src_offset = (rnd() % slots) * page + (odd ? rnd() % 16 : 0);
		s[i].dst_offset = (size_t)perm[i] * page + (odd ? rnd() % 16 : 0);
		s[i].length = odd ? page - 16 - rnd() % 100 : page;
	}
	int r = gpx_copyv(c, a->region, b->region, s, n, 77);
	if (r == 0)
		r = gpx_wait_tag(c, 77, &done, 30000);
	if (r == 0)
		r = done.status;
	for (int i = 0; i < n && r == 0; i++)
		memmove(b->mirror + s[i].dst_offset, a->mirror + s[i].src_offset, s[i].length);
	unsigned char *got = malloc(BUF);
	buf_read(b, 0, got, BUF);
	ok(r == 0 && memcmp(got, b->mirror, BUF) == 0, "vectored %d x %zu%s %s -> %s verified", n, page,
	    odd ? " (unaligned)" : "", a->name, b->name);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	free(got);
	free(perm);
	free(s);
}

/* An interior pointer of a larger cuMemAlloc, as PyTorch's caching allocator hands out. */
static void
test_interior(gpx_conn *c, struct buf *src)
{
	CUdeviceptr big;
	size_t off = (1 << 20) + 4096 * 3 + 256, len = 1 << 20;
	unsigned char *before = malloc(4 << 20), *after = malloc(4 << 20), *want = malloc(len);
	gpx_region r;

	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&big, 4 << 20));
	fill(before, 4 << 20);
	CK(cuMemcpyHtoD(big, before, 4 << 20));
	int e = gpx_register_cuda(c, (void *)(big + off), len, 0, &r);
	ok(e == 0, "register an interior pointer of a larger allocation");
	e = e ? e : gpx_copy_sync(c, src->region, 0, r, 0, len);
	CK(cuMemcpyDtoH(after, big, 4 << 20));
	memcpy(before + off, src->mirror, len);
	ok(e == 0 && memcmp(before, after, 4 << 20) == 0, "copy into it lands at the offset, neighbours untouched");
	gpx_deregister(c, r);
	cuMemFree(big);
	free(before);
	free(after);
	free(want);
}

static void
test_cached_registration(gpx_conn *c, struct buf *b)
{
	struct timespec t0, t1, t2;
	gpx_region r1, r2;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	int e1 = gpx_register_cuda(c, (void *)b->d, BUF, 0, &r1);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	int e2 = gpx_register_cuda(c, (void *)(b->d + 4096), 4096, 0, &r2);
	clock_gettime(CLOCK_MONOTONIC, &t2);
	ok(e1 == 0 && e2 == 0 && r1 != r2, "registering %s again gives new region ids", b->name);
	diag("re-registration of %s: %.1f us and %.1f us (both served from the mapping cache)", b->name,
	    (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3,
	    (t2.tv_sec - t1.tv_sec) * 1e6 + (t2.tv_nsec - t1.tv_nsec) / 1e3);
	gpx_deregister(c, r1);
	gpx_deregister(c, r2);
}

/* ---- child roles (separate processes) ---- */

static void
init_cuda(void)
{
	CUdevice d;

	CK(cuInit(0));
	CK(cuDeviceGetCount(&ndev));
	if (ndev > 8)
		ndev = 8;
	for (int i = 0; i < ndev; i++) {
		CK(cuDeviceGet(&d, i));
		CK(cuDevicePrimaryCtxRetain(&ctx[i], d));
	}
	CK(cuCtxSetCurrent(ctx[0]));
}

/* Exports a VMM buffer filled with zeros, waits for a notification, checks the pattern. */
static int
child_owner(const char *sock, const char *name, int dev)
{
	gpx_conn *c;
	struct buf b;
	struct gpx_export_opts o = { .rule = GPX_EXPORT_UID, .notify = 1, .notify_tag = 4242 };
	struct gpx_completion done;

	init_cuda();
	if (gpx_connect(sock, "owner", &c) < 0)
		return 10;
	buf_init(&b, "owner-vmm", dev, 1, c);
	if (gpx_export(c, b.region, name, &o) < 0)
		return 11;
	printf("READY\n");
	fflush(stdout);
	if (gpx_wait(c, &done, 1, 20000) != 1 || !(done.flags & GPX_COMP_NOTIFY) || done.tag != 4242)
		return 12;
	unsigned char *got = malloc(BUF);
	buf_read(&b, 0, got, BUF);
	for (size_t i = 0; i < BUF; i++)
		if (got[i] != (unsigned char)(i * 7 + 3))
			return 13;
	return 0;
}

/* Registers a buffer, queues a big copy and is killed by the parent mid-copy. */
static int
child_victim(const char *sock, int dev)
{
	gpx_conn *c;
	CUdeviceptr a, b;
	gpx_region ra, rb;

	init_cuda();
	if (gpx_connect(sock, "victim", &c) < 0)
		return 10;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemAlloc(&a, 1ull << 30));
	CK(cuMemAlloc(&b, 1ull << 30));
	if (gpx_register_cuda(c, (void *)a, 1ull << 30, 0, &ra) < 0 ||
	    gpx_register_cuda(c, (void *)b, 1ull << 30, 0, &rb) < 0)
		return 11;
	for (int i = 0; i < 64; i++)
		gpx_copy(c, ra, 0, rb, 0, 1ull << 30, i);
	printf("READY\n");
	fflush(stdout);
	pause();
	return 0;
}

/* Exports a buffer; once told to, frees it while the parent copies out of it. */
static int
child_freer(const char *sock, const char *name, int dev)
{
	gpx_conn *c;
	CUdeviceptr a;
	gpx_region ra;
	char line[16];

	init_cuda();
	if (gpx_connect(sock, "freer", &c) < 0)
		return 10;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemAlloc(&a, 1ull << 30));
	if (gpx_register_cuda(c, (void *)a, 1ull << 30, 0, &ra) < 0 || gpx_export(c, ra, name, NULL) < 0)
		return 11;
	printf("READY\n");
	fflush(stdout);
	if (fgets(line, sizeof(line), stdin) == NULL)
		return 12;
	CK(cuMemFree(a));
	printf("FREED\n");
	fflush(stdout);
	return 0;
}

static pid_t
spawn(const char *self, char *const argv[], FILE **out, FILE **in)
{
	int o[2], i[2];
	pid_t pid;

	if (pipe(o) < 0 || pipe(i) < 0)
		return -1;
	if ((pid = fork()) == 0) {
		dup2(o[1], 1);
		dup2(i[0], 0);
		execv(self, argv);
		_exit(127);
	}
	close(o[1]);
	close(i[0]);
	*out = fdopen(o[0], "r");
	*in = fdopen(i[1], "w");
	return pid;
}

static bool
wait_line(FILE *f, const char *want)
{
	char line[64];

	while (fgets(line, sizeof(line), f) != NULL)
		if (strncmp(line, want, strlen(want)) == 0)
			return true;
	return false;
}

/* Regions the test's daemon holds (over a connection of its own), or -1. */
static int
regions_now(void)
{
	struct harness_status st;

	return harness_status(the_harness, &st) == 0 ? st.regions : -1;
}

static void
test_two_processes(const char *self, const char *sock, gpx_conn *c, int dev)
{
	char devs[8];
	snprintf(devs, sizeof(devs), "%d", dev);
	char *argv[] = { (char *)self, "owner", (char *)sock, "gpu-test-shared", devs, NULL };
	FILE *out, *in;
	pid_t pid = spawn(self, argv, &out, &in);
	gpx_region r;
	uint64_t len = 0;
	int st = -1;

	if (!ok(pid > 0 && wait_line(out, "READY"), "owner process exported a VMM buffer on GPU%d", dev)) {
		kill(pid, SIGKILL);
		return;
	}
	int e = gpx_import(c, "gpu-test-shared", &r, &len);
	ok(e == 0 && len >= BUF, "import the other process's buffer");
	/* Our data: a host buffer with a pattern, copied into the owner's GPU memory. */
	int fd;
	unsigned char *p;
	gpx_region hr;
	gpx_host_alloc(BUF, &fd, (void **)&p);
	for (size_t i = 0; i < BUF; i++)
		p[i] = (unsigned char)(i * 7 + 3);
	gpx_register_host(c, fd, 0, BUF, 0, &hr);
	e = e ? e : gpx_copy_sync(c, hr, 0, r, 0, BUF);
	ok(e == 0, "copy into the other process's GPU buffer");
	waitpid(pid, &st, 0);
	ok(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the owner was notified and found the bytes (status %d)",
	    WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	gpx_deregister(c, r);
	gpx_deregister(c, hr);
	gpx_host_free(fd, p, BUF);
	fclose(out);
	fclose(in);
}

static void
test_client_dies(const char *self, const char *sock, gpx_conn *c, struct buf *a, struct buf *b, int dev)
{
	char devs[8];
	snprintf(devs, sizeof(devs), "%d", dev);
	char *argv[] = { (char *)self, "victim", (char *)sock, devs, NULL };
	FILE *out, *in;
	int before = regions_now();
	size_t free0, free1, total;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemGetInfo(&free0, &total));
	pid_t pid = spawn(self, argv, &out, &in);
	struct timespec t0, t1;

	if (!ok(pid > 0 && wait_line(out, "READY"), "victim registered 2 GiB and queued 64 GiB of copies")) {
		kill(pid, SIGKILL);
		return;
	}
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int n;
	do {
		n = regions_now();
		clock_gettime(CLOCK_MONOTONIC, &t1);
	} while (n != before && (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000 < 3000);
	double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
	ok(n == before && ms < 1000, "its regions released %.0f ms after SIGKILL (%d regions, baseline %d)",
	    ms, n, before);
	/* The daemon's mappings kept the victim's 2 GiB alive; with them closed, it is free again. */
	for (int i = 0; i < 100; i++) {
		CK(cuMemGetInfo(&free1, &total));
		if (free1 + (64u << 20) >= free0)
			break;
		usleep(10000);
	}
	ok(free1 + (64u << 20) >= free0, "GPU%d memory back to its baseline (%zu MiB free before, %zu MiB after)",
	    dev, free0 >> 20, free1 >> 20);
	bool good = true;
	for (int k = 0; k < 4 && good; k++)
		good = random_copy(c, a, b);
	ok(good, "another client's copies still verify afterwards");
	fclose(out);
	fclose(in);
}

static void
test_owner_frees(const char *self, const char *sock, gpx_conn *c, struct buf *dst, int dev)
{
	char devs[8];
	snprintf(devs, sizeof(devs), "%d", dev);
	char *argv[] = { (char *)self, "freer", (char *)sock, "gpu-test-freed", devs, NULL };
	FILE *out, *in;
	pid_t pid = spawn(self, argv, &out, &in);
	gpx_region r;
	uint64_t len;
	struct gpx_completion done[64];
	int st, got = 0, bad = 0;

	if (!ok(pid > 0 && wait_line(out, "READY"), "owner exported 1 GiB") || gpx_import(c, "gpu-test-freed", &r, &len) < 0) {
		kill(pid, SIGKILL);
		return;
	}
	for (int i = 0; i < 32; i++)
		gpx_copy(c, r, (uint64_t)i << 20, dst->region, 0, BUF, 1000 + i);
	fprintf(in, "free\n");
	fflush(in);
	ok(wait_line(out, "FREED"), "owner freed its buffer while copies from it run");
	while (got < 32) {
		int n = gpx_wait(c, done, 64, 10000);
		if (n <= 0)
			break;
		for (int i = 0; i < n; i++)
			if (done[i].status != 0 && done[i].status != -GPX_EREVOKED && done[i].status != -GPX_ECANCELED)
				bad++;
		got += n;
	}
	waitpid(pid, &st, 0);
	ok(got == 32 && bad == 0, "every copy ended with a defined status (%d of 32, %d bad)", got, bad);
	unsigned char *tmp = malloc(BUF);
	buf_read(dst, 0, tmp, BUF);
	memcpy(dst->mirror, tmp, BUF);    /* whatever arrived is now the expected content */
	free(tmp);
	gpx_deregister(c, r);
	fclose(out);
	fclose(in);
}

/* Sends a Register the library would never send; returns the reply's status (-1: none). */
static int
raw_register(int sock, Gpx__MemKind kind, const uint8_t *handle, const uint8_t uuid[16], uint64_t size, int fd)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Register reg = GPX__REGISTER__INIT;
	int st = -1;

	reg.kind = kind;
	reg.length = 4096;
	reg.alloc_size = size;
	reg.alloc_id = 99;
	reg.device_uuid.data = (uint8_t *)uuid;
	reg.device_uuid.len = 16;
	if (handle != NULL) {
		reg.handle.data = (uint8_t *)handle;
		reg.handle.len = 64;
	}
	m.seq = 7;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = &reg;
	if (harness_send(sock, &m, fd >= 0 ? &fd : NULL, fd >= 0) < 0)
		return -1;
	Gpx__DaemonMsg *r = harness_recv(sock, 10000, NULL, NULL, NULL);
	if (r != NULL) {
		st = r->reply->status;
		gpx__daemon_msg__free_unpacked(r, NULL);
	}
	return st;
}

/* Forged legacy handles and fds that are not VMM exports: an error each, nothing leaked. */
static void
test_forged(struct harness *h)
{
	CUdevice d0;
	CUuuid uuid;
	CUdeviceptr real;
	CUipcMemHandle ih;
	uint8_t hb[64];
	int fds0 = harness_fds(h), before = regions_now(), errors = 0, opened = 0;
	int sock = harness_connect(h), efd = eventfd(0, EFD_CLOEXEC), ring = -1;

	CK(cuDeviceGet(&d0, 0));
	CK(cuDeviceGetUuid(&uuid, d0));
	Gpx__DaemonMsg *w = harness_hello(sock, GPX_PROTO_VERSION, efd, &ring);
	if (w != NULL)
		gpx__daemon_msg__free_unpacked(w, NULL);
	for (int i = 0; i < 32; i++) {
		fill(hb, sizeof(hb));
		int st = raw_register(sock, GPX__MEM_KIND__MEM_CUDA_IPC, hb, (uint8_t *)uuid.bytes, 1 << 20, -1);
		errors += st > 0;
	}
	ok(errors == 32, "32 random legacy handles: an error each (%d)", errors);
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&real, 1 << 20));
	CK(cuIpcGetMemHandle(&ih, real));
	for (int i = 0; i < 64; i++) {
		memcpy(hb, ih.reserved, 64);
		hb[i] ^= 0x01;               /* one bit changed, in each byte in turn */
		int st = raw_register(sock, GPX__MEM_KIND__MEM_CUDA_IPC, hb, (uint8_t *)uuid.bytes, 1 << 20, -1);
		opened += st == 0;
	}
	diag("a real handle with one bit changed: %d of 64 variants opened something (legacy handles are "
	    "bearer tokens; this is why a multi-tenant node refuses them)", opened);
	ok(1, "64 altered real handles: no crash");
	static const char *paths[] = { "/dev/null", "/etc/hostname" };
	int bad = 0, n = 0;
	for (int i = 0; i < 5; i++) {
		int fd = -1, p[2] = { -1, -1 };
		if (i < 2)
			fd = open(paths[i], O_RDONLY | O_CLOEXEC);
		else if (i == 2 && pipe(p) == 0)
			fd = p[0];
		else if (i == 3)
			fd = eventfd(0, EFD_CLOEXEC);
		else
			fd = memfd_create("not-vmm", MFD_CLOEXEC);
		if (fd < 0)
			continue;
		n++;
		bad += raw_register(sock, GPX__MEM_KIND__MEM_CUDA_VMM, NULL, (uint8_t *)uuid.bytes, 2 << 20, fd) ==
		    GPX__STATUS__EBADFD;
		close(fd);
		if (p[1] >= 0)
			close(p[1]);
	}
	ok(bad == n, "/dev/null, a file, a pipe, an eventfd, a memfd as a VMM handle: EBADFD each (%d of %d)", bad, n);
	close(sock);
	close(efd);
	if (ring >= 0)
		close(ring);
	cuMemFree(real);
	int k = regions_now();
	ok(k == before, "no region left behind (%d, before %d)", k, before);
	ok(harness_wait_fds(h, fds0, 5000) == fds0, "gpxd's descriptors back to %d", fds0);
}

/* A sticky CUDA error in the daemon's context: gpxd exits non-zero with a clear line. */
static void
test_sticky(void)
{
	struct harness h;
	gpx_conn *c = NULL;
	CUdeviceptr a, b;
	gpx_region ra, rb;
	struct gpx_completion d;

	setenv("GPXD_FAULT_INJECT", "sticky", 1);
	int e = harness_start(&h, "[cuda]\ntrust_legacy_ipc = yes\n");
	unsetenv("GPXD_FAULT_INJECT");
	if (e < 0) {
		ok(0, "daemon with fault injection started");
		return;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&a, 1 << 20));
	CK(cuMemAlloc(&b, 1 << 20));
	int r = gpx_connect(h.sock, "sticky", &c);
	if (r == 0 && (r = gpx_register_cuda(c, (void *)a, 1 << 20, 0, &ra)) == 0 &&
	    (r = gpx_register_cuda(c, (void *)b, 1 << 20, 0, &rb)) == 0) {
		gpx_copy(c, ra, 0, rb, 0, 4096, 1);
		r = gpx_wait(c, &d, 1, 10000);
	}
	ok(r == -GPX_ECONN, "after a sticky error the client's wait ends with ECONN (%s)", gpx_strerror(r));
	int st = harness_stop(&h);
	FILE *f = fopen(h.log, "re");
	char line[512];
	bool said = false;
	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		said |= strstr(line, "sticky error") != NULL;
	if (f != NULL)
		fclose(f);
	ok(st != 0 && said, "gpxd exited non-zero (%d) with a line naming the sticky error", st);
	if (r != -GPX_ECONN)
		harness_dump_log(&h);
	gpx_close(c);
	harness_cleanup(&h);
	cuMemFree(a);
	cuMemFree(b);
}

static void
test_multitenant(void)
{
	struct harness h;
	gpx_conn *c;
	CUdeviceptr d;
	gpx_region r;

	if (harness_start(&h, NULL) < 0) {
		ok(0, "second daemon (multi-tenant) started");
		return;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&d, 1 << 20));
	if (gpx_connect(h.sock, "mt", &c) == 0) {
		int e = gpx_register_cuda(c, (void *)d, 1 << 20, 0, &r);
		ok(e == -GPX_EACCES && strstr(gpx_last_error(c), "trust") != NULL,
		    "legacy IPC memory refused on a multi-tenant node: %s", gpx_last_error(c));
		gpx_close(c);
	} else
		ok(0, "connect to the multi-tenant daemon");
	cuMemFree(d);
	harness_stop(&h);
	harness_cleanup(&h);
}

int
main(int argc, char **argv)
{
	struct harness h;
	gpx_conn *c;
	struct buf bufs[8];
	int nb = 0;

	if (argc >= 4 && strcmp(argv[1], "owner") == 0)
		return child_owner(argv[2], argv[3], atoi(argv[4]));
	if (argc >= 4 && strcmp(argv[1], "victim") == 0)
		return child_victim(argv[2], atoi(argv[3]));
	if (argc >= 5 && strcmp(argv[1], "freer") == 0)
		return child_freer(argv[2], argv[3], atoi(argv[4]));

	if (harness_start(&h, "[cuda]\ntrust_legacy_ipc = yes\n") < 0)
		tap_bail("cannot start gpxd");
	the_harness = &h;
	init_cuda();
	diag("%d GPU(s)", ndev);
	if (gpx_connect(h.sock, "gpu-test", &c) < 0)
		tap_bail("cannot connect");

	buf_init(&bufs[nb++], "host", -1, 0, c);
	static const char *names[] = { "gpu0-ipc", "gpu0-vmm", "gpu1-ipc", "gpu1-vmm" };
	for (int d = 0; d < ndev && d < 2; d++) {
		buf_init(&bufs[nb++], names[2 * d], d, 0, c);
		buf_init(&bufs[nb++], names[2 * d + 1], d, 1, c);
	}
	test_matrix(c, bufs, nb);
	test_vectored(c, &bufs[1], &bufs[2], 4096, 4096, false);
	test_vectored(c, &bufs[1], &bufs[2], 16384, 1000, true);
	test_vectored(c, &bufs[0], &bufs[1], 4096, 2048, false);
	test_vectored(c, &bufs[1], &bufs[0], 4096, 2048, false);
	if (ndev > 1) {
		test_vectored(c, &bufs[1], &bufs[4], 4096, 4096, false);
		test_vectored(c, &bufs[3], &bufs[2], 65536, 200, true);
		test_vectored(c, &bufs[1], &bufs[3], 4096, 4096, false);   /* ipc -> peer's ipc */
		test_vectored(c, &bufs[4], &bufs[1], 4096, 1024, true);
	}
	test_interior(c, &bufs[0]);
	test_cached_registration(c, &bufs[1]);
	test_two_processes(argv[0], h.sock, c, ndev > 1 ? 1 : 0);
	test_client_dies(argv[0], h.sock, c, &bufs[1], &bufs[2], 0);
	test_owner_frees(argv[0], h.sock, c, &bufs[2], 0);
	test_matrix(c, bufs, nb > 3 ? 3 : nb);
	test_forged(&h);
	test_multitenant();
	test_sticky();

	gpx_close(c);
	ok(harness_stop(&h) == 0, "gpxd stopped cleanly");
	harness_cleanup(&h);
	return tap_done();
}
