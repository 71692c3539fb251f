/*
 * GPU tests against a real gpxd: every memory kind (host memfd, cuda-ipc from cuMemAlloc,
 * cuda-vmm from cuMemCreate with POSIX-fd handles) on every device, copied over every path
 * (same GPU, GPU to GPU, host to GPU and back, host to host) with random sizes, offsets and
 * data, verified byte for byte together with guard bytes around each destination range.  Then
 * vectored copies of scattered pages (the SM kernel path), an interior pointer of a larger
 * allocation (as PyTorch's caching allocator hands out), the refusal of legacy handles on a
 * multi-tenant node, two client processes where one copies into the other's exported buffer,
 * a client that dies mid-copy and an owner that frees its buffer mid-copy, and the latency of
 * one client's 4 KiB copies while another (of another uid when run as root) keeps a GPU's copy
 * worker full of 1 GiB copies, host to GPU and within the GPU.  Stream-ordered
 * pool memory (cuda-pool) has a daemon of its own, whose log counts the mappings it opens.
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
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/gpu/gpu-util.h"

#define BUF (16u << 20)
#define GUARD 64

static CUcontext ctx[GPU_MAX];
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
	} else {
		CK(cuCtxSetCurrent(ctx[dev]));
		if (vmm)
			vmm_alloc(dev, BUF, &b->d, &b->h, &b->alloc);
		else
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

/* 0..n-1 in a random order, allocated. */
static uint32_t *
shuffled(size_t n)
{
	uint32_t *p = malloc(n * sizeof(*p));

	if (p == NULL)
		tap_bail("out of memory");
	for (size_t i = 0; i < n; i++)
		p[i] = i;
	for (size_t i = n - 1; i > 0; i--) {
		size_t k = rnd() % (i + 1);
		uint32_t t = p[i];
		p[i] = p[k];
		p[k] = t;
	}
	return p;
}

/* Scattered pages in one vectored request: the SM kernel between GPUs, copy engines otherwise. */
static void
test_vectored(gpx_conn *c, struct buf *a, struct buf *b, size_t page, int n, bool odd)
{
	struct gpx_seg *s = calloc(n, sizeof(*s));
	size_t slots = BUF / page;
	uint32_t *perm = shuffled(slots);
	struct gpx_completion done;

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

/*
 * Pages by number (gpx_copy_pages): the copy kernel reads gpxd's checked list in place where it
 * runs the copy; pages above 256 KiB go to copy engines as plain segments.
 */
static void
test_pages(gpx_conn *c, struct buf *a, struct buf *b, size_t page, uint32_t n, size_t so, size_t dof)
{
	size_t slots = (BUF - (so > dof ? so : dof)) / page;
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(n * sizeof(*dp));
	struct gpx_completion done;

	if (n > slots)
		tap_bail("test_pages: %u pages of %zu do not fit", n, page);
	uint32_t *perm = shuffled(slots);
	for (uint32_t i = 0; i < n; i++) {
		dp[i] = perm[i];       /* distinct destinations, in a random order */
		sp[i] = rnd() % slots;
	}
	free(perm);
	int r = gpx_copy_pages(c, a->region, so, b->region, dof, page, sp, dp, n, 78);
	if (r == 0)
		r = gpx_wait_tag(c, 78, &done, 30000);
	if (r == 0)
		r = done.status;
	for (uint32_t i = 0; i < n && r == 0; i++)
		memmove(b->mirror + dof + dp[i] * page, a->mirror + so + sp[i] * page, page);
	unsigned char *got = malloc(BUF);
	buf_read(b, 0, got, BUF);
	ok(r == 0 && memcmp(got, b->mirror, BUF) == 0, "pages %u x %zu (bases %zu -> %zu) %s -> %s verified", n,
	    page, so, dof, a->name, b->name);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	free(got);
	free(sp);
	free(dp);
}

/*
 * A page transfer past the GPU worker's largest chunk (1 GiB), so the kernel gets it in two
 * launches cut inside a page: 131,072 pages (the harness's max_segments) of 9,000 bytes into
 * the last GPU.
 */
static void
test_pages_big(gpx_conn *c)
{
	const uint32_t n = 131072, page = 9000;
	const size_t len = (size_t)n * page;
	int dd = ndev > 1 ? 1 : 0;
	uint64_t *src = malloc(len), *got = malloc(len);
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(n * sizeof(*dp));
	CUdeviceptr a, b;
	gpx_region ra, rb;
	struct gpx_completion done;

	for (size_t i = 0; i < len / 8; i++)
		src[i] = rnd();
	for (uint32_t i = 0; i < n; i++) {
		dp[i] = (uint32_t)((i * 7919ull) % n);      /* a permutation: n is a power of two */
		sp[i] = rnd() % n;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&a, len));
	CK(cuMemcpyHtoD(a, src, len));
	CK(cuCtxSetCurrent(ctx[dd]));
	CK(cuMemAlloc(&b, len));
	CK(cuMemsetD8(b, 0, len));
	int r = gpx_register_cuda(c, (void *)a, len, 0, &ra);
	r = r ? r : gpx_register_cuda(c, (void *)b, len, 0, &rb);
	/* One page out, in the list's first and in its second half (checked on two cores). */
	for (int k = 0; k < 2 && r == 0; k++) {
		uint32_t at = k ? n - 1 : 5, keep = sp[at];
		sp[at] = n;
		int e = gpx_copy_pages(c, ra, 0, rb, 0, page, sp, dp, n, 80 + k);
		e = e ? e : gpx_wait_tag(c, 80 + k, &done, 60000);
		e = e ? e : done.status;
		ok(e == -GPX_ERANGE, "pages past one chunk, page %u out of its region: refused (%s)", at, gpx_strerror(e));
		sp[at] = keep;
	}
	CK(cuMemcpyDtoH(got, b, len));
	bool zero = true;
	for (size_t i = 0; i < len / 8 && zero; i++)
		zero = got[i] == 0;
	ok(zero, "no byte of either reached the destination");
	r = r ? r : gpx_copy_pages(c, ra, 0, rb, 0, page, sp, dp, n, 79);
	r = r ? r : gpx_wait_tag(c, 79, &done, 60000);
	r = r ? r : done.status;
	CK(cuMemcpyDtoH(got, b, len));
	bool same = r == 0 && done.bytes == len;
	for (uint32_t i = 0; i < n && same; i++)
		same = memcmp((char *)got + (size_t)dp[i] * page, (char *)src + (size_t)sp[i] * page, page) == 0;
	ok(same, "pages past one chunk: %u x %u bytes (%.2f GiB) GPU0 -> GPU%d, cut inside a page, verified",
	    n, page, len / 1073741824.0, dd);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	gpx_deregister(c, ra);
	gpx_deregister(c, rb);
	cuMemFree(a);
	cuMemFree(b);
	free(src);
	free(got);
	free(sp);
	free(dp);
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
	ndev = gpu_contexts(ctx);
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

/*
 * Keeps 16 copies of 1 GiB in flight on GPU dev, from host memory ("h2d") or within the GPU
 * ("d2d"), until killed.  As root it runs as another uid first.
 */
static int
child_hog(const char *sock, int dev, const char *mode)
{
	const size_t len = 1ull << 30;
	struct gpx_completion d[16];
	gpx_conn *c;
	CUdeviceptr a = 0, b;
	gpx_region ra, rb;
	unsigned char *hp;
	int hfd;

	if (geteuid() == 0 && (setgid(1010) < 0 || setuid(1010) < 0))
		return 9;
	init_cuda();
	if (gpx_connect(sock, "hog", &c) < 0)
		return 10;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemAlloc(&b, len));
	if (strcmp(mode, "h2d") == 0) {
		if (gpx_host_alloc(len, &hfd, (void **)&hp) < 0 || gpx_register_host(c, hfd, 0, len, 0, &ra) < 0)
			return 11;
	} else {
		CK(cuMemAlloc(&a, len));
		if (gpx_register_cuda(c, (void *)a, len, 0, &ra) < 0)
			return 11;
	}
	if (gpx_register_cuda(c, (void *)b, len, 0, &rb) < 0)
		return 12;
	uint64_t tag = 0;
	for (int i = 0; i < 16; i++)
		if (gpx_copy(c, ra, 0, rb, 0, len, tag++) < 0)
			return 13;
	printf("READY %s\n", geteuid() != 0 ? "other-uid" : "same-uid");
	fflush(stdout);
	for (;;) {
		int n = gpx_wait(c, d, 16, 1000);
		for (int i = 0; i < n; i++)
			gpx_copy(c, ra, 0, rb, 0, len, tag++);
	}
	return 0;
}

static pid_t spawn(const char *self, char *const argv[], FILE **out, FILE **in);

static int
cmp_double(const void *x, const void *y)
{
	double a = *(const double *)x, b = *(const double *)y;

	return a < b ? -1 : a > b;
}

/* n 4 KiB copies a -> b one at a time, 2 ms apart: p50, p99 and max in microseconds. */
static bool
small_latency(gpx_conn *c, struct buf *a, struct buf *b, int n, double *p50, double *p99, double *max)
{
	double *t = calloc(n, sizeof(double));
	int done = 0;

	for (int i = 0; i < n; i++) {
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		int r = gpx_copy_sync(c, a->region, 4096 * (i % 16), b->region, 4096 * (i % 16), 4096);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		if (r == 0)
			t[done++] = (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3;
		usleep(2000);
	}
	qsort(t, done, sizeof(double), cmp_double);
	*p50 = done ? t[done / 2] : 1e9;
	*p99 = done ? t[done * 99 / 100] : 1e9;
	*max = done ? t[done - 1] : 1e9;
	free(t);
	if (done == n) {
		/* what the copies wrote is what the mirror says */
		memmove(b->mirror, a->mirror, 16 * 4096);
		unsigned char *got = malloc(16 * 4096);
		buf_read(b, 0, got, 16 * 4096);
		done = memcmp(got, b->mirror, 16 * 4096) == 0 ? n : -1;
		free(got);
	}
	return done == n;
}

/*
 * Another client keeps GPU dev's copy worker full: 16 copies of 1 GiB, up to its bulk
 * stream's depth.  This client's 4 KiB copies on the same GPU must not wait for a whole bulk
 * chunk (about 20 ms from host memory on PCIe 5): the worker takes its chunk onto the quick
 * stream behind at most QUICK_SHARE pieces of 1 MiB of the other's.
 */
static void
test_small_under_load(const char *self, const char *sock, gpx_conn *c, struct buf *a, struct buf *b, int dev)
{
	static const char *modes[] = { "h2d", "d2d" };
	double p50, p99, max;
	char devs[8];

	snprintf(devs, sizeof(devs), "%d", dev);
	bool good = small_latency(c, a, b, 300, &p50, &p99, &max);
	diag("4 KiB %s -> %s alone: p50 %.1f us, p99 %.1f us, max %.1f us", a->name, b->name, p50, p99, max);
	for (int m = 0; m < 2; m++) {
		char *argv[] = { (char *)self, "hog", (char *)sock, devs, (char *)modes[m], NULL };
		char line[64] = "";
		FILE *out, *in;
		pid_t pid = spawn(self, argv, &out, &in);
		bool ready = pid > 0 && fgets(line, sizeof(line), out) != NULL && strncmp(line, "READY", 5) == 0;
		line[strcspn(line, "\n")] = '\0';
		if (!ok(ready, "another client keeps 16 copies of 1 GiB %s on GPU%d in flight (%s)", modes[m], dev,
		    ready ? line + 6 : "did not start")) {
			if (pid > 0)
				kill(pid, SIGKILL);
			continue;
		}
		usleep(300000);
		good = small_latency(c, a, b, 300, &p50, &p99, &max);
		ok(good, "meanwhile 300 copies of 4 KiB %s -> %s completed and verify", a->name, b->name);
		ok(p99 < 2000, "their p99 latency is under 2 ms: p50 %.1f us, p99 %.1f us, max %.1f us", p50, p99, max);
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		fclose(out);
		fclose(in);
	}
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

/* Sends a Register (and fd, if >= 0); returns the reply's status (-1: none). */
static int
raw_send_register(int sock, Gpx__Register *reg, int fd)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	int st = -1;

	m.seq = 7;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = reg;
	if (harness_send(sock, &m, fd >= 0 ? &fd : NULL, fd >= 0) < 0)
		return -1;
	Gpx__DaemonMsg *r = harness_recv(sock, 10000, NULL, NULL, NULL);
	if (r != NULL) {
		st = r->reply->status;
		gpx__daemon_msg__free_unpacked(r, NULL);
	}
	return st;
}

/* Sends a Register the library would never send; returns the reply's status (-1: none). */
static int
raw_register(int sock, Gpx__MemKind kind, const uint8_t *handle, const uint8_t uuid[16], uint64_t size, int fd)
{
	Gpx__Register reg = GPX__REGISTER__INIT;

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
	return raw_send_register(sock, &reg, fd);
}

/* Lines of a daemon's log that contain `what`. */
static int
log_count(const struct harness *h, const char *what)
{
	FILE *f = fopen(h->log, "re");
	char line[512];
	int n = 0;

	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		n += strstr(line, what) != NULL;
	if (f != NULL)
		fclose(f);
	return n;
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
	int st = raw_register(sock, GPX__MEM_KIND__MEM_CUDA_IPC, (uint8_t *)ih.reserved, (uint8_t *)uuid.bytes, 1 << 20, -1);
	ok(st == 0, "the real handle registers (status %d)", st);
	int held0 = log_count(h, "already open under another handle");
	for (int i = 0; i < 64; i++) {
		memcpy(hb, ih.reserved, 64);
		hb[i] ^= 0x01;               /* one bit changed, in each byte in turn */
		st = raw_register(sock, GPX__MEM_KIND__MEM_CUDA_IPC, hb, (uint8_t *)uuid.bytes, 1 << 20, -1);
		opened += st == 0;
	}
	diag("a real handle with one bit changed: %d of 64 variants opened something (legacy handles are "
	    "bearer tokens; this is why a multi-tenant node refuses them)", opened);
	/*
	 * Most variants map the real handle's allocation again; the driver corrupts its heap
	 * when such a mapping is closed, so gpxd refuses them and never closes them.  Whether it
	 * got that right shows at the end, when gpxd stops cleanly (or aborts).
	 */
	int held = log_count(h, "already open under another handle") - held0;
	ok(held > 0, "64 altered real handles: %d refused as mapping the open allocation", held);
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

/* ---- stream-ordered pool memory (cuda-pool) ---- */

/* Waits up to timeout_ms for `want` such lines (closes run after the reply); the last count. */
static int
log_wait(const struct harness *h, const char *what, int want, int timeout_ms)
{
	int n;

	for (int t = 0; (n = log_count(h, what)) < want && t < timeout_ms; t += 10)
		usleep(10000);
	return n;
}

/* A driver call of the pool tests: on failure a failed check naming the CUDA error. */
static bool
cu_ok(CUresult r, const char *what)
{
	const char *n = "?";

	if (r == CUDA_SUCCESS)
		return true;
	cuGetErrorName(r, &n);
	ok(0, "%s: %s", what, n);
	return false;
}

static double
us_since(const struct timespec *t0)
{
	struct timespec t1;

	clock_gettime(CLOCK_MONOTONIC, &t1);
	return (t1.tv_sec - t0->tv_sec) * 1e6 + (t1.tv_nsec - t0->tv_nsec) / 1e3;
}

/* Device memory [d, d+n) equals want[0, n)? */
static bool
dev_equals(CUdeviceptr d, const unsigned char *want, size_t n)
{
	unsigned char *got = malloc(n);
	bool same;

	CK(cuMemcpyDtoH(got, d, n));
	same = memcmp(got, want, n) == 0;
	for (size_t i = 0; !same && i < n; i++)
		if (got[i] != want[i]) {
			diag("first difference at byte %zu: %#x, want %#x", i, got[i], want[i]);
			break;
		}
	free(got);
	return same;
}

/* Requests no library sends, on a connection of their own: refused, nothing left behind. */
static void
test_pool_forged(struct harness *h, CUmemoryPool pool, CUdeviceptr p, const uint8_t uuid[16])
{
	CUmemPoolPtrExportData x;
	uint8_t junk[64];
	int fds0 = harness_fds(h), efd = eventfd(0, EFD_CLOEXEC), ring = -1, pfd = -1, st;
	int sock = harness_connect(h);
	Gpx__Register reg = GPX__REGISTER__INIT;
	struct harness_status s0 = { 0 }, s1 = { 0 };

	harness_status(h, &s0);
	Gpx__DaemonMsg *w = harness_hello(sock, GPX_PROTO_VERSION, efd, &ring);
	if (w != NULL)
		gpx__daemon_msg__free_unpacked(w, NULL);
	CK(cuMemPoolExportPointer(&x, p));
	reg.kind = GPX__MEM_KIND__MEM_CUDA_POOL;
	reg.length = 4096;
	reg.alloc_size = 4096;
	reg.alloc_id = (uint64_t)(uintptr_t)pool;
	reg.device_uuid.data = (uint8_t *)uuid;
	reg.device_uuid.len = 16;
	reg.handle.data = x.reserved;
	reg.handle.len = 64;
	/* The other connection's allocation, named exactly, but without the fd. */
	reg.cached_only = 1;
	st = raw_send_register(sock, &reg, -1);
	ok(st == GPX__STATUS__ENOENT, "another connection naming the held allocation without the fd: "
	    "ENOENT, not the cached mapping (status %d)", st);
	reg.cached_only = 0;
	int mfd = memfd_create("not-a-pool", MFD_CLOEXEC);
	st = raw_send_register(sock, &reg, mfd);
	ok(st == GPX__STATUS__EBADFD, "a memfd as the pool's fd: EBADFD (status %d)", st);
	close(mfd);
	if (cu_ok(cuMemPoolExportToShareableHandle(&pfd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	    "cuMemPoolExportToShareableHandle")) {
		reg.handle.len = 32;
		st = raw_send_register(sock, &reg, pfd);
		ok(st == GPX__STATUS__EINVAL, "32 bytes of export data: EINVAL (status %d)", st);
		reg.handle.len = 64;
		fill(junk, sizeof(junk));
		reg.handle.data = junk;
		st = raw_send_register(sock, &reg, pfd);
		ok(st > 0, "the real pool fd with random export data: an error (status %d)", st);
		close(pfd);
	}
	close(sock);
	close(efd);
	if (ring >= 0)
		close(ring);
	int k = harness_wait_fds(h, fds0, 5000);
	ok(k == fds0, "gpxd's descriptors back to %d (%d)", fds0, k);
	ok(harness_status(h, &s1) == 0 && s1.regions == s0.regions, "no region left behind (%d, before %d)",
	    s1.regions, s0.regions);
}

/*
 * Stream-ordered pool memory, on a daemon of its own whose log counts the mappings the GPU
 * back end opens and closes.  An allocation of a pool created exportable as POSIX fds
 * registers as cuda-pool, whole and through an interior pointer; copies to and from it verify
 * byte for byte; registering it again is served from the cache; a second allocation of the
 * same pool is a mapping of its own; withdrawing the regions frees the daemon's imports, which
 * this process waits for before it frees the memory, as CUDA requires of an exporter; plain
 * cudaMallocAsync memory (the device's default pool) is refused with advice.
 */
static void
test_pool(void)
{
	const size_t n = 4 << 20, off = (1 << 20) + 4096 * 3 + 256, len = 1 << 20;
	CUmemPoolProps props = {
		.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
		.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, 0 },
	};
	unsigned char *want = malloc(n), *want2 = malloc(len), *hp = NULL;
	CUmemoryPool pool = NULL;
	CUdeviceptr p = 0, p2 = 0, d = 0;
	CUstream s = NULL;
	CUdevice d0;
	CUuuid uuid;
	struct harness h;
	struct timespec t0;
	struct stat st;
	gpx_conn *c = NULL;
	gpx_region r = 0, ri = 0, r2 = 0, rp2 = 0, hr = 0;
	int supported = 0, types = 0, hfd = -1, pfd = -1, e;
	const char *opened = "opened cuda-pool mapping", *closed = "closed cuda-pool mapping";

	CK(cuDeviceGet(&d0, 0));
	CK(cuDeviceGetUuid(&uuid, d0));
	CK(cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, d0));
	if (supported)
		CK(cuDeviceGetAttribute(&types, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, d0));
	if (!supported || !(types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
		tap_skip(1, "GPU0 has no stream-ordered pools exportable as POSIX fds");
		goto out;
	}
	if (harness_start(&h, "[daemon]\nlog_level = debug gpu\n") < 0) {
		ok(0, "a daemon for the pool tests started");
		goto out;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	if (gpx_connect(h.sock, "gpu-test-pool", &c) < 0 || gpx_host_alloc(n, &hfd, (void **)&hp) < 0 ||
	    gpx_register_host(c, hfd, 0, n, 0, &hr) < 0) {
		ok(0, "connect and register a host buffer");
		goto stop;
	}
	CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
	if (!cu_ok(cuMemPoolCreate(&pool, &props), "cuMemPoolCreate with POSIX-fd handles") ||
	    !cu_ok(cuMemAllocFromPoolAsync(&p, n, pool, s), "cuMemAllocFromPoolAsync") ||
	    !cu_ok(cuMemAllocFromPoolAsync(&p2, len, pool, s), "cuMemAllocFromPoolAsync (second)"))
		goto stop;
	fill(want, n);
	fill(want2, len);
	CK(cuMemcpyHtoDAsync(p, want, n, s));
	CK(cuMemcpyHtoDAsync(p2, want2, len, s));
	/* The daemon may touch the memory only once its allocation has completed. */
	CK(cuStreamSynchronize(s));

	/* What gpxd checks a pool's fd against, seen from here. */
	if (cu_ok(cuMemPoolExportToShareableHandle(&pfd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	    "cuMemPoolExportToShareableHandle") && fstat(pfd, &st) == 0) {
		ok(S_ISCHR(st.st_mode) && major(st.st_rdev) == 195 && minor(st.st_rdev) == 255,
		    "a pool's POSIX fd is an open of /dev/nvidiactl, as gpxd requires (mode %o, device %u:%u)",
		    (unsigned)(st.st_mode & S_IFMT), major(st.st_rdev), minor(st.st_rdev));
		close(pfd);
	}

	e = gpx_register_cuda(c, (void *)p, n, 0, &r);
	if (!ok(e == 0, "register cudaMallocFromPoolAsync memory of an exportable pool")) {
		diag("%s: %s", gpx_strerror(e), gpx_last_error(c));
		harness_dump_log(&h);
		goto stop;
	}
	ok(log_count(&h, opened) == 1, "gpxd opened it as cuda-pool (%d such lines in its log)",
	    log_count(&h, opened));
	/* host -> pool, a window in the middle: the bytes around it must not move */
	fill(hp, len);
	e = gpx_copy_sync(c, hr, 0, r, 4096, len);
	memcpy(want + 4096, hp, len);
	ok(e == 0 && dev_equals(p, want, n), "host -> pool memory verified, neighbours untouched (%s)",
	    gpx_strerror(e));
	e = gpx_copy_sync(c, r, 0, hr, 0, n);
	ok(e == 0 && memcmp(hp, want, n) == 0, "pool memory -> host verified (%s)", gpx_strerror(e));

	e = gpx_register_cuda(c, (void *)(p + off), len, 0, &ri);
	if (!ok(e == 0, "register an interior pointer of pool memory"))
		diag("%s: %s", gpx_strerror(e), gpx_last_error(c));
	fill(hp, len);
	e = e ? e : gpx_copy_sync(c, hr, 0, ri, 0, len);
	memcpy(want + off, hp, len);
	ok(e == 0 && dev_equals(p, want, n), "a copy into the interior pointer lands at its offset (%s)",
	    gpx_strerror(e));
	e = e ? e : gpx_copy_sync(c, ri, 0, r, 0, len);
	memcpy(want, want + off, len);
	ok(e == 0 && dev_equals(p, want, n), "pool -> pool on GPU0 verified (%s)", gpx_strerror(e));

	clock_gettime(CLOCK_MONOTONIC, &t0);
	e = gpx_register_cuda(c, (void *)p, n, 0, &r2);
	double us = us_since(&t0);
	ok(e == 0 && r2 != r && log_count(&h, opened) == 1, "three registrations of one pool allocation "
	    "opened it once (%d open(s) in gpxd's log; the third took %.1f us)", log_count(&h, opened), us);

	e = gpx_register_cuda(c, (void *)p2, len, 0, &rp2);
	e = e ? e : gpx_copy_sync(c, rp2, 0, r, 0, len);
	memcpy(want, want2, len);
	ok(e == 0 && log_count(&h, opened) == 2 && dev_equals(p, want, n),
	    "a second allocation of the pool is a mapping of its own, copies from it verify (%s, %d opens)",
	    gpx_strerror(e), log_count(&h, opened));

	if (ndev > 1) {
		/* GPU1 reaches the pool only through the access gpxd granted on its import. */
		CUdeviceptr v;
		CUmemGenericAllocationHandle vh;
		size_t valloc;
		gpx_region rv = 0;
		unsigned char *vwant = malloc(n);
		struct gpx_seg segs[256];
		struct gpx_completion done;

		vmm_alloc(1, n, &v, &vh, &valloc);
		fill(vwant, n);
		CK(cuMemcpyHtoD(v, vwant, n));
		e = gpx_register_cuda(c, (void *)v, n, 0, &rv);
		e = e ? e : gpx_copy_sync(c, r, 0, rv, 0, n);
		memcpy(vwant, want, n);
		CK(cuCtxSetCurrent(ctx[1]));
		ok(e == 0 && dev_equals(v, vwant, n), "pool memory on GPU0 -> GPU1 verified (%s)", gpx_strerror(e));
		for (int i = 0; i < 256; i++) {
			segs[i].src_offset = (uint64_t)i * 4096;
			segs[i].dst_offset = (uint64_t)(255 - i) * 4096;
			segs[i].length = 4096;
			memcpy(want + segs[i].dst_offset, vwant + segs[i].src_offset, 4096);
		}
		e = e ? e : gpx_copyv(c, rv, r, segs, 256, 4711);
		e = e ? e : gpx_wait_tag(c, 4711, &done, 30000);
		e = e ? e : done.status;
		CK(cuCtxSetCurrent(ctx[0]));
		ok(e == 0 && dev_equals(p, want, n), "256 pages GPU1 -> pool memory on GPU0 in one request "
		    "(GPU1's SM kernel writes the pool) verified (%s)", gpx_strerror(e));
		if (e != 0)
			harness_dump_log(&h);
		gpx_deregister(c, rv);
		CK(cuCtxSetCurrent(ctx[1]));
		cuMemUnmap(v, valloc);
		cuMemAddressFree(v, valloc);
		cuMemRelease(vh);
		CK(cuCtxSetCurrent(ctx[0]));
		free(vwant);
	}

	/* Another client imports the pool region by export and lets go: nothing of the driver's
	 * is held for it, so its gpx_deregister answers at once (the owner still holds the region). */
	{
		gpx_conn *ci = NULL;
		gpx_region rim = 0;
		uint64_t il = 0;
		e = gpx_export(c, r, "pool", NULL);
		e = e ? e : gpx_connect(h.sock, "gpu-test-pool-importer", &ci);
		e = e ? e : gpx_import(ci, "pool", &rim, &il);
		clock_gettime(CLOCK_MONOTONIC, &t0);
		e = e ? e : gpx_deregister(ci, rim);
		double dt = us_since(&t0) / 1e6;
		ok(e == 0 && il == n && dt < 1, "an importer's deregister of pool memory answers at once "
		    "(%s, %.3f s)", gpx_strerror(e), dt);
		gpx_close(ci);
		gpx_unexport(c, "pool");
	}

	/* CUDA wants the importer's free before the exporter's: the last gpx_deregister of an
	 * allocation returns once gpxd's is done. */
	int dr = gpx_deregister(c, r);
	dr = dr ? dr : gpx_deregister(c, ri);
	dr = dr ? dr : gpx_deregister(c, r2);
	dr = dr ? dr : gpx_deregister(c, rp2);
	r = ri = r2 = rp2 = 0;
	int k = log_wait(&h, closed, 2, 0);
	ok(dr == 0 && k == 2, "gpxd freed both imports before the last gpx_deregister of each returned "
	    "(%s; %d close(s) in its log)", gpx_strerror(dr), k);
	cu_ok(cuMemFreeAsync(p, s), "cuMemFreeAsync");
	cu_ok(cuMemFreeAsync(p2, s), "cuMemFreeAsync (second)");
	cu_ok(cuStreamSynchronize(s), "cuStreamSynchronize after the frees");
	p = p2 = 0;

	/* Plain cudaMallocAsync: the device's default pool, never exportable. */
	if (cu_ok(cuMemAllocAsync(&d, len, s), "cuMemAllocAsync from the default pool") &&
	    cu_ok(cuStreamSynchronize(s), "cuStreamSynchronize")) {
		gpx_region rd = 0;
		e = gpx_register_cuda(c, (void *)d, len, 0, &rd);
		ok(e == -GPX_ENOTSUP && strstr(gpx_last_error(c), "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR") != NULL,
		    "memory of the default pool refused, saying what to do (%s: %s)", gpx_strerror(e),
		    gpx_last_error(c));
		if (e == 0)
			gpx_deregister(c, rd);
		cuMemFreeAsync(d, s);
		cuStreamSynchronize(s);
	}

	/* A fresh allocation for the forged requests: the pool must hold something. */
	if (cu_ok(cuMemAllocFromPoolAsync(&p, len, pool, s), "cuMemAllocFromPoolAsync (third)") &&
	    cu_ok(cuStreamSynchronize(s), "cuStreamSynchronize")) {
		gpx_region rf = 0;
		if (ok(gpx_register_cuda(c, (void *)p, len, 0, &rf) == 0, "register a third allocation")) {
			test_pool_forged(&h, pool, p, (uint8_t *)uuid.bytes);
			gpx_deregister(c, rf);
			log_wait(&h, closed, 3, 5000);
		}
		cuMemFreeAsync(p, s);
		cuStreamSynchronize(s);
		p = 0;
	}
stop:
	if (c != NULL)
		gpx_close(c);
	if (s != NULL)
		cuStreamSynchronize(s);
	if (pool != NULL)
		cuMemPoolDestroy(pool);
	if (s != NULL)
		cuStreamDestroy(s);
	ok(harness_stop(&h) == 0, "the pool tests' gpxd stopped cleanly");
	harness_cleanup(&h);
	if (hp != NULL)
		gpx_host_free(hfd, hp, n);
out:
	free(want);
	free(want2);
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
	if (argc >= 5 && strcmp(argv[1], "hog") == 0)
		return child_hog(argv[2], atoi(argv[3]), argv[4]);

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
	test_pages(c, &bufs[2], &bufs[1], 4096, 4096, 0, 0);
	test_pages(c, &bufs[1], &bufs[2], 1000, 8000, 13, 5);          /* unaligned steps */
	test_pages(c, &bufs[0], &bufs[1], 16384, 1000, 4096, 0);       /* pinned host -> GPU */
	test_pages(c, &bufs[1], &bufs[0], 4096, 2048, 0, 64);          /* GPU -> pinned host */
	test_pages(c, &bufs[1], &bufs[2], 1 << 20, 8, 0, 0);           /* copy engines */
	if (ndev > 1) {
		test_pages(c, &bufs[2], &bufs[4], 4096, 4096, 0, 0);
		test_pages(c, &bufs[1], &bufs[3], 4096, 4000, 0, 4096);     /* ipc -> peer's ipc */
		test_pages(c, &bufs[4], &bufs[1], 1000, 4000, 3, 0);
	}
	test_pages_big(c);
	test_interior(c, &bufs[0]);
	test_cached_registration(c, &bufs[1]);
	test_two_processes(argv[0], h.sock, c, ndev > 1 ? 1 : 0);
	test_client_dies(argv[0], h.sock, c, &bufs[1], &bufs[2], 0);
	test_owner_frees(argv[0], h.sock, c, &bufs[2], 0);
	test_small_under_load(argv[0], h.sock, c, &bufs[1], &bufs[2], 0);
	test_matrix(c, bufs, nb > 3 ? 3 : nb);
	test_forged(&h);
	test_pool();
	test_multitenant();
	test_sticky();

	gpx_close(c);
	int st = harness_stop(&h);
	if (!ok(st == 0, "gpxd stopped cleanly (exit %d)", st))
		harness_dump_log(&h);
	harness_cleanup(&h);
	return tap_done();
}
