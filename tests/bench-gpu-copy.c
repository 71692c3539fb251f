/*
 * gpx-bench-gpu's copy modes: contiguous copies between GPU buffers, done in this process
 * against the same copies through gpxd.
 *
 *   gpu-import   a control for gpu-copy: the same copies in this process, through its own
 *                mappings and through mappings imported from exported fds, as gpxd maps them
 *   gpu-copy     contiguous copies 4 KiB .. 1 GiB, GPU0 -> GPU1 (or within GPU0 on one GPU)
 *   gpu-bidir    GPU0 -> GPU1 and GPU1 -> GPU0 at once
 *   gpu-latency  one 4 KiB copy, submit to completion seen by the client: p50 and p99
 *   gpu-small    4 KiB copies, --depth of them in flight (64): copies per second
 */
#include "config.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <cuda.h>

#include "tests/bench.h"
#include "tests/bench-gpu.h"

static int broker_copy(const struct gbuf *a, const struct gbuf *z, uint64_t len, uint64_t iters, int runs,
    double *sec, char *why, size_t whylen);

static int
mode_copy(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-copy", 1);
	struct gbuf a, z;
	uint64_t max = b->max_size < (1ull << 30) ? b->max_size : (1ull << 30);
	char sz[32];

	if (r)
		return r;
	int dd = bench_gpu_count() > 1 ? 1 : 0;
	if (gbuf_new(b, 0, max, &a) < 0 || gbuf_new(b, dd, max, &z) < 0)
		return -1;
	char floor[512] = "", why[160] = "";
	size_t at = 0;
	bench_table_begin(b, "gpu-copy", dd ? "contiguous copies GPU0 -> GPU1: cuMemcpyPeerAsync vs gpx"
	    : "contiguous copies within GPU0: cuMemcpyAsync vs gpx");
	for (uint64_t len = 4096; len <= max; len *= (len < (1 << 20) ? 16 : 4)) {
		struct gcopy o = { .b = b, .dev = 0, .dst = z.d, .src = a.d, .len = len, .rdst = z.region, .rsrc = a.region };
		struct bench_pair p;
		if (bench_pair_measure(b, gcopy_direct, gcopy_spin, &o, &p) < 0)
			return -1;
		const char *t = len >= (64u << 20) ? "gpu.copy.large" : NULL;
		if (dd && len >= (16u << 20))
			t = "gpu.p2p.16m";
		else if (dd && len >= (1u << 20))
			t = "gpu.p2p.1m";
		bench_gpu_row_t(b, bench_size_str(len, sz, sizeof(sz)), "GB/s", len / p.direct / 1e9, len / p.gpx / 1e9,
		    false, len, t);
		double bt;
		if (len >= (1u << 20) && why[0] == '\0' && at < sizeof(floor) &&
		    broker_copy(&a, &z, len, p.direct_iters, b->runs, &bt, why, sizeof(why)) == 0)
			at += (size_t)snprintf(floor + at, sizeof(floor) - at, "%s%s %.2fx (gpx %.2fx of it)", at ? ", " : "",
			    sz, p.direct / bt, bt / p.gpx);
		bench_pair_free(&p);
	}
	char note[1024];
	snprintf(note, sizeof(note), "one copy at a time, submit to completion; direct: %s, synchronized; the "
	    "leanest broker (gpu-latency's, copying each size), of direct: %s%s", dd ? "cuMemcpyAsync between UVA "
	    "pointers on GPU0's stream (a peer copy, as cuMemcpyPeerAsync)" : "cuMemcpyAsync on the program's own stream",
	    at ? floor : why[0] ? "not measured: " : "not measured", at ? "" : why);
	bench_table_end(b, note);
	gbuf_free(b, &a);
	gbuf_free(b, &z);
	return 0;
}

struct bidir {
	struct bench_ctx *b;
	struct gbuf *x0, *x1, *y0, *y1;   /* x0 (GPU0) -> x1 (GPU1); y1 (GPU1) -> y0 (GPU0) */
	uint64_t len, tag;
};

static int
bidir_direct(void *arg)
{
	struct bidir *o = arg;

	cuCtxSetCurrent(bench_gpu_ctx(0));
	cuMemcpyAsync(o->x1->d, o->x0->d, o->len, bench_gpu_stream(0));
	cuCtxSetCurrent(bench_gpu_ctx(1));
	cuMemcpyAsync(o->y0->d, o->y1->d, o->len, bench_gpu_stream(1));
	if (cuStreamSynchronize(bench_gpu_stream(1)) != CUDA_SUCCESS)
		return -GPX_EIO;
	cuCtxSetCurrent(bench_gpu_ctx(0));
	return cuStreamSynchronize(bench_gpu_stream(0)) == CUDA_SUCCESS ? 0 : -GPX_EIO;
}

static int
bidir_gpx(void *arg)
{
	struct bidir *o = arg;
	struct gpx_completion c[2];
	int got = 0, r;

	if ((r = gpx_copy(o->b->conn, o->x0->region, 0, o->x1->region, 0, o->len, ++o->tag)) < 0 ||
	    (r = gpx_copy(o->b->conn, o->y1->region, 0, o->y0->region, 0, o->len, ++o->tag)) < 0)
		return r;
	while (got < 2) {
		if ((r = gpx_poll(o->b->conn, c + got, 2 - got)) < 0)
			return r;
		got += r;
	}
	return c[0].status ? c[0].status : c[1].status;
}

static int
mode_bidir(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-bidir", 2);
	struct gbuf x0, x1, y0, y1;
	uint64_t len = b->max_size < (256ull << 20) ? b->max_size : (256ull << 20);
	char sz[32];

	if (r)
		return r;
	if (gbuf_new(b, 0, len, &x0) < 0 || gbuf_new(b, 1, len, &x1) < 0 ||
	    gbuf_new(b, 0, len, &y0) < 0 || gbuf_new(b, 1, len, &y1) < 0)
		return -1;
	struct bidir o = { .b = b, .x0 = &x0, .x1 = &x1, .y0 = &y0, .y1 = &y1, .len = len };
	struct bench_pair p;
	bench_table_begin(b, "gpu-bidir", "GPU0 -> GPU1 and GPU1 -> GPU0 at once (total of both directions)");
	if (bench_pair_measure(b, bidir_direct, bidir_gpx, &o, &p) < 0)
		return -1;
	bench_gpu_row_t(b, bench_size_str(len, sz, sizeof(sz)), "GB/s", 2 * len / p.direct / 1e9, 2 * len / p.gpx / 1e9,
	    false, 2 * len, "gpu.bidir");
	bench_pair_free(&p);
	bench_table_end(b, "direct: one cuMemcpyAsync each way, on each GPU's own stream, at once");
	gbuf_free(b, &x0);
	gbuf_free(b, &x1);
	gbuf_free(b, &y0);
	gbuf_free(b, &y1);
	return 0;
}

/*
 * The leanest broker there could be, for gpu-latency and gpu-copy: a second process (this
 * program run again with GPX_BENCH_BROKER set, once for each size it copies) maps the two
 * buffers from their exported fds and, for each request a word in shared memory raises, does
 * what the direct column does (cuMemcpyAsync on its own stream of the same device, then
 * cuStreamSynchronize) and raises a second word; both sides spin.  What any daemon pays at the
 * least for doing a copy on a client's behalf: a second context and the hand-off between two
 * processes' cores, with no socket, no check, no queue and no other client.
 */
struct broker_shm {
	_Alignas(64) volatile uint64_t req;      /* the client's request number; UINT64_MAX: quit */
	_Alignas(64) volatile uint64_t resp;     /* the last one done; 1 once ready */
};

/* The broker: runs before main when this program is started as one, and never returns. */
__attribute__((constructor)) static void
broker_main(void)
{
	const char *env = getenv("GPX_BENCH_BROKER");
	int shm_fd, src_fd, dst_fd, dev;
	unsigned long long src_len, dst_len, len;
	CUdeviceptr src, dst;
	CUmemGenericAllocationHandle hs, hd;
	CUcontext c;
	CUdevice d;
	CUstream st;

	if (env == NULL)
		return;
	if (sscanf(env, "%d %d %d %d %llu %llu %llu", &shm_fd, &src_fd, &dst_fd, &dev, &src_len, &dst_len, &len) != 7)
		_exit(2);
	struct broker_shm *m = mmap(NULL, sizeof(*m), PROT_READ | PROT_WRITE, MAP_SHARED, shm_fd, 0);
	if (m == MAP_FAILED || !CK(cuInit(0)) || !CK(cuDeviceGet(&d, dev)) || !CK(cuDevicePrimaryCtxRetain(&c, d)) ||
	    !CK(cuCtxSetCurrent(c)) || gbuf_import(src_fd, src_len, dev, &src, &hs) < 0 ||
	    gbuf_import(dst_fd, dst_len, dev, &dst, &hd) < 0 || !CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING)))
		_exit(3);
	uint64_t seen = 0;
	__atomic_store_n(&m->resp, 1, __ATOMIC_RELEASE);
	for (;;) {
		uint64_t r;
		while ((r = __atomic_load_n(&m->req, __ATOMIC_ACQUIRE)) == seen)
			;
		if (r == UINT64_MAX)
			_exit(0);
		if (cuMemcpyAsync(dst, src, len, st) != CUDA_SUCCESS || cuStreamSynchronize(st) != CUDA_SUCCESS)
			_exit(4);
		__atomic_store_n(&m->resp, seen = r, __ATOMIC_RELEASE);
	}
}

/*
 * n submit-to-completion times (us) of copies of len bytes from a to z through the broker, in
 * their order; -1 with why said where it cannot run.
 */
static int
broker_times(const struct gbuf *a, const struct gbuf *z, uint64_t len, double *t, int n, int warm, char *why,
    size_t whylen)
{
	extern char **environ;
	int shm = -1, fa = -1, fz = -1, r = -1, status;
	struct broker_shm *m = MAP_FAILED;
	pid_t pid = -1;

	if (a->h == 0 || z->h == 0) {
		snprintf(why, whylen, "legacy IPC memory (GPX_BENCH_GPU_MEM=ipc): no fd to hand over");
		return -1;
	}
	if ((shm = memfd_create("gpx-bench-broker", 0)) < 0 || ftruncate(shm, sizeof(*m)) < 0 ||
	    (m = mmap(NULL, sizeof(*m), PROT_READ | PROT_WRITE, MAP_SHARED, shm, 0)) == MAP_FAILED ||
	    !CK(cuMemExportToShareableHandle(&fa, a->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) ||
	    !CK(cuMemExportToShareableHandle(&fz, z->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) ||
	    fcntl(fa, F_SETFD, 0) < 0 || fcntl(fz, F_SETFD, 0) < 0) {
		snprintf(why, whylen, "its shared memory or the buffers' export failed");
		goto out;
	}
	char role[160], *argv[] = { "gpx-bench-gpu", NULL };
	snprintf(role, sizeof(role), "%d %d %d %d %llu %llu %llu", shm, fa, fz, 0, (unsigned long long)a->len,
	    (unsigned long long)z->len, (unsigned long long)len);
	setenv("GPX_BENCH_BROKER", role, 1);
	int e = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ);
	unsetenv("GPX_BENCH_BROKER");
	if (e != 0) {
		snprintf(why, whylen, "posix_spawn: %s", strerror(e));
		pid = -1;
		goto out;
	}
	for (double until = bench_now() + 30; __atomic_load_n(&m->resp, __ATOMIC_ACQUIRE) != 1;)
		if (bench_now() > until || waitpid(pid, &status, WNOHANG) == pid) {
			snprintf(why, whylen, "the broker process did not start");
			if (waitpid(pid, &status, WNOHANG) != 0)
				pid = -1;      /* ended (and reaped): not to be signalled */
			goto out;
		}
	uint64_t seq = 1;
	for (int i = -warm; i < n; i++) {
		double t0 = bench_now();
		__atomic_store_n(&m->req, ++seq, __ATOMIC_RELEASE);
		while (__atomic_load_n(&m->resp, __ATOMIC_ACQUIRE) != seq)
			if (bench_now() - t0 > 5) {
				snprintf(why, whylen, "the broker process stopped answering");
				goto out;
			}
		if (i >= 0)
			t[i] = (bench_now() - t0) * 1e6;
	}
	r = 0;
out:
	if (pid > 0) {
		__atomic_store_n(&m->req, UINT64_MAX, __ATOMIC_RELEASE);
		if (r != 0)
			kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
	}
	if (m != MAP_FAILED)
		munmap(m, sizeof(*m));
	if (shm >= 0)
		close(shm);
	if (fa >= 0)
		close(fa);
	if (fz >= 0)
		close(fz);
	return r;
}

/*
 * The broker's time per copy of len bytes, as bench_pair_measure times a side: runs of iters
 * copies each, the median of their means (*sec, seconds).  0, or -1 with why said.
 */
static int
broker_copy(const struct gbuf *a, const struct gbuf *z, uint64_t len, uint64_t iters, int runs, double *sec,
    char *why, size_t whylen)
{
	const int n = (int)(iters * (uint64_t)runs), warm = n / runs;
	double *t = calloc((size_t)n, sizeof(double)), *mean = calloc((size_t)runs, sizeof(double));
	int r = -1;

	if (t == NULL || mean == NULL || n <= 0)
		snprintf(why, whylen, "no memory for its times");
	else if ((r = broker_times(a, z, len, t, n, warm, why, whylen)) == 0) {
		for (int k = 0; k < runs; k++) {
			for (uint64_t i = 0; i < iters; i++)
				mean[k] += t[(uint64_t)k * iters + i];
			mean[k] /= (double)iters * 1e6;
		}
		qsort(mean, (size_t)runs, sizeof(double), bench_cmp_double);
		*sec = mean[runs / 2];
	}
	free(t);
	free(mean);
	return r;
}

static int
mode_latency(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-latency", 1);
	struct gbuf a, z;
	enum { N = 20000 };
	static double dl[N], gl[N], bl[N];

	if (r)
		return r;
	int dd = bench_gpu_count() > 1 ? 1 : 0;
	if (gbuf_new(b, 0, 1 << 21, &a) < 0 || gbuf_new(b, dd, 1 << 21, &z) < 0)
		return -1;
	struct gcopy o = { .b = b, .dev = 0, .dst = z.d, .src = a.d, .len = 4096, .rdst = z.region, .rsrc = a.region };
	for (int i = 0; i < 2000; i++) {
		gcopy_direct(&o);
		gcopy_spin(&o);
	}
	/* Each side in a block of its own: interleaving them would make the GPU switch between
	 * this process's context and the daemon's for every copy, and time that instead. */
	for (int i = 0; i < N; i++) {
		double t0 = bench_now();
		gcopy_direct(&o);
		dl[i] = (bench_now() - t0) * 1e6;
	}
	for (int i = 0; i < 2000; i++)
		gcopy_spin(&o);
	for (int i = 0; i < N; i++) {
		double t0 = bench_now();
		if ((r = gcopy_spin(&o)) < 0)
			return bench_fail(b, r, "gpx_copy");
		gl[i] = (bench_now() - t0) * 1e6;
	}
	qsort(dl, N, sizeof(double), bench_cmp_double);
	qsort(gl, N, sizeof(double), bench_cmp_double);
	char why[160], floor[256];
	if (broker_times(&a, &z, 4096, bl, N, 2000, why, sizeof(why)) == 0 &&
	    (qsort(bl, N, sizeof(double), bench_cmp_double), true))
		snprintf(floor, sizeof(floor), "; the leanest broker (a second process that maps the same buffers and "
		    "spins on shared memory for each request, then does what direct does): p50 %.2f us, p99 %.2f us, "
		    "gpx %+.2f us on its p50", bl[N / 2], bl[N * 99 / 100], gl[N / 2] - bl[N / 2]);
	else
		snprintf(floor, sizeof(floor), "; the leanest broker not measured: %s", why);
	bench_table_begin(b, "gpu-latency", dd ? "one 4 KiB copy GPU0 -> GPU1, submit to completion seen by the client"
	    : "one 4 KiB copy within GPU0, submit to completion seen by the client");
	bench_gpu_row_t(b, "p50", "us", dl[N / 2], gl[N / 2], true, 4096, dd ? NULL : "gpu.latency.p50");
	bench_gpu_row(b, "p99", "us", dl[N * 99 / 100], gl[N * 99 / 100], true, 4096);
	char note[640], gap[128] = "";
	if (dd)
		bench_verdict("gpu.latency.p2p_gap", gl[N / 2] - dl[N / 2], gap, sizeof(gap));
	snprintf(note, sizeof(note), "direct: cuMemcpyAsync + cuStreamSynchronize, measured in this run; gpx: "
	    "gpx_copy + spinning gpx_poll%s%s%s", dd ? "; p50 gap " : "", gap, floor);
	bench_table_end(b, note);
	gbuf_free(b, &a);
	gbuf_free(b, &z);
	return 0;
}

/* ---- gpu-small: many 4 KiB copies in flight (--depth, 64 by default) ---- */

struct small {
	struct bench_ctx *b;
	struct gbuf *src, *dst;
	unsigned depth;
	uint64_t tag;
};

/* depth 4 KiB copies to distinct places on the program's own stream, then one synchronize. */
static int
small_direct(void *arg)
{
	struct small *o = arg;
	CUstream st = bench_gpu_stream(o->src->dev);

	cuCtxSetCurrent(bench_gpu_ctx(o->src->dev));
	for (unsigned i = 0; i < o->depth; i++)
		if (cuMemcpyAsync(o->dst->d + i * 4096ull, o->src->d + i * 4096ull, 4096, st) != CUDA_SUCCESS)
			return -GPX_EIO;
	return cuStreamSynchronize(st) == CUDA_SUCCESS ? 0 : -GPX_EIO;
}

/* The same depth copies through gpxd, all submitted before any completion is awaited. */
static int
small_gpx(void *arg)
{
	struct small *o = arg;
	struct gpx_completion c[64];
	unsigned got = 0;
	int r;

	for (unsigned i = 0; i < o->depth; i++)
		if ((r = gpx_copy(o->b->conn, o->src->region, i * 4096ull, o->dst->region, i * 4096ull, 4096,
		    ++o->tag)) < 0)
			return r;
	while (got < o->depth) {
		if ((r = gpx_poll(o->b->conn, c, o->depth - got < 64 ? o->depth - got : 64)) < 0)
			return r;
		for (int i = 0; i < r; i++)
			if (c[i].status != 0)
				return c[i].status;
		got += r;
	}
	return 0;
}

static int
mode_small(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-small", 1);
	struct gbuf a, z;
	char what[64], note[200];

	if (r)
		return r;
	int dd = bench_gpu_count() > 1 ? 1 : 0;
	unsigned depth = b->depth < 1024 ? b->depth : 1024;
	if (gbuf_new(b, 0, depth * 4096ull, &a) < 0 || gbuf_new(b, dd, depth * 4096ull, &z) < 0)
		return -1;
	struct small o = { .b = b, .src = &a, .dst = &z, .depth = depth };
	struct bench_pair p;
	bench_table_begin(b, "gpu-small", dd ? "4 KiB copies GPU0 -> GPU1, many in flight" :
	    "4 KiB copies within GPU0, many in flight");
	if ((r = bench_pair_measure(b, small_direct, small_gpx, &o, &p)) < 0)
		return bench_fail(b, r, "4 KiB copies");
	snprintf(what, sizeof(what), "%u in flight", depth);
	bench_gpu_row_t(b, what, "copies/s", depth / p.direct, depth / p.gpx, false, 4096,
	    depth == 64 ? "gpu.small.rate" : NULL);
	bench_pair_free(&p);
	snprintf(note, sizeof(note), "direct: %u cuMemcpyAsync on the program's own stream, then "
	    "cuStreamSynchronize; gpx: %u gpx_copy, then gpx_poll until all completed", depth, depth);
	bench_table_end(b, note);
	gbuf_free(b, &a);
	gbuf_free(b, &z);
	return 0;
}

/*
 * A control for gpu-copy: the same copies done in this process twice, through its own mappings
 * and through mappings of the same allocations imported from their exported fds, as gpxd maps
 * them.  It tells what part of a gap between direct and gpx comes from imported mappings.
 */
static int
mode_import(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-import", 1);
	uint64_t len = b->max_size < (1ull << 30) ? b->max_size : (1ull << 30);
	struct gbuf a, z;
	CUdeviceptr ia = 0, iz = 0;
	char what[64], sz[32];

	if (r)
		return r;
	int dd = bench_gpu_count() > 1 ? 1 : 0;
	if (gbuf_alloc(0, len, &a) < 0 || gbuf_alloc(dd, len, &z) < 0 || a.h == 0) {
		bench_skip(b, "gpu-import", "needs VMM buffers");
		return BENCH_SKIP;
	}
	struct gbuf *g[2] = { &a, &z };
	CUdeviceptr *im[2] = { &ia, &iz };
	for (int i = 0; i < 2; i++) {
		CUmemGenericAllocationHandle h;
		int fd = -1;
		if (!CK(cuMemExportToShareableHandle(&fd, g[i]->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) ||
		    gbuf_import(fd, g[i]->len, -1, im[i], &h) < 0)
			return -1;
		close(fd);
	}
	bench_table_begin(b, "gpu-import", "control: the same copies in this process, own mappings (direct) vs "
	    "imported mappings (in the gpx column)");
	for (uint64_t n = 64ull << 20; n <= len; n *= 4) {
		struct gcopy own = { .b = b, .dev = 0, .dst = z.d, .src = a.d, .len = n };
		struct gcopy imp = { .b = b, .dev = 0, .dst = iz, .src = ia, .len = n };
		struct bench_pair p1, p2;
		if (bench_pair_measure(b, gcopy_direct, gcopy_direct, &own, &p1) < 0 ||
		    bench_pair_measure(b, gcopy_direct, gcopy_direct, &imp, &p2) < 0)
			return -1;
		snprintf(what, sizeof(what), "%s", bench_size_str(n, sz, sizeof(sz)));
		bench_gpu_row(b, what, "GB/s", n / p1.direct / 1e9, n / p2.direct / 1e9, false, n);
		bench_pair_free(&p1);
		bench_pair_free(&p2);
	}
	bench_table_end(b, "no daemon involved in either column");
	return 0;
}

static const struct bench_mode copy_modes[] = {
	{ "gpu-import", "control: own vs imported mappings in one process", mode_import },
	{ "gpu-copy", "contiguous GPU copies 4 KiB..1 GiB: cuMemcpyPeerAsync vs gpx", mode_copy },
	{ "gpu-bidir", "GPU0<->GPU1 both directions at once", mode_bidir },
	{ "gpu-latency", "4 KiB copy latency p50/p99: direct vs gpx", mode_latency },
	{ "gpu-small", "4 KiB copies, --depth in flight: cuMemcpyAsync vs gpx copies/s", mode_small },
};
BENCH_MODES(copy_modes)
