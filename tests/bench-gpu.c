/*
 * gpx-bench-gpu: the GPU modes of gpx-bench.  Each prints the direct figure (the CUDA driver
 * API called in this process: cuMemcpyAsync between UVA pointers, which is cuMemcpyPeerAsync
 * between devices) next to the same work brokered by gpxd, measured in the same run, and
 * their ratio.  Buffers are cuMemCreate allocations exported as POSIX fds (the `cuda-vmm` kind,
 * accepted on every node), so direct and brokered copies touch the very same memory.
 *
 *   gpu-copy     contiguous copies 4 KiB .. 1 GiB, GPU0 -> GPU1 (or within GPU0 on one GPU)
 *   gpu-bidir    GPU0 -> GPU1 and GPU1 -> GPU0 at once
 *   gpu-latency  one 4 KiB copy, submit to completion seen by the client: p50 and p99
 *   gpu-pages    65,536 scattered 4 KiB and 16 KiB pages in one vectored request
 *   gpu-idle     the same page requests between the client's own GPU work: after 1 ms of
 *                it, after 1 ms of nothing, and while it runs, against back to back; and
 *                what gpxd's threads cost in CPU meanwhile and once idle
 *   gpu-host     pinned host <-> GPU0, >= 64 MiB
 *   gpu-register registering a buffer: the first time (driver import) and again (cached)
 *   gpu-remote   GPU memory to and from a peer daemon's GPU memory (GPX_BENCH_PEER, as for
 *                gpx-bench remote), against host memory over the same two daemons: what
 *                GPU memory costs between nodes when it is staged (no GPUDirect NIC)
 */
#include "config.h"

#include <math.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cuda.h>

#include "proto/gpx.pb-c.h"
#include "tests/bench.h"
#include "tests/bench-gpu.h"

static CUcontext ctx[BENCH_GPUS];
static CUstream stream[BENCH_GPUS];
static int ndev = -1;

#define CK(x) cuda_ok((x), #x)

static bool
cuda_ok(CUresult r, const char *what)
{
	const char *n = "?";

	if (r == CUDA_SUCCESS)
		return true;
	cuGetErrorName(r, &n);
	fprintf(stderr, "gpx-bench-gpu: %s: %s\n", what, n);
	return false;
}

int
bench_gpu_open(void)
{
	if (ndev < 0) {
		CUdevice d;
		ndev = 0;
		if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&ndev) != CUDA_SUCCESS)
			ndev = 0;
		if (ndev > BENCH_GPUS)
			ndev = BENCH_GPUS;
		for (int i = 0; i < ndev; i++)
			if (!CK(cuDeviceGet(&d, i)) || !CK(cuDevicePrimaryCtxRetain(&ctx[i], d)) ||
			    !CK(cuCtxSetCurrent(ctx[i])) || !CK(cuStreamCreate(&stream[i], CU_STREAM_NON_BLOCKING)))
				ndev = 0;
		for (int i = 0; i < ndev; i++)
			for (int j = 0; j < ndev; j++)
				if (i != j) {
					cuCtxSetCurrent(ctx[i]);
					cuCtxEnablePeerAccess(ctx[j], 0);
				}
	}
	return ndev;
}

CUcontext
bench_gpu_ctx(int dev)
{
	return ctx[dev];
}

void
bench_gpu_adopt(int dev, CUcontext c, int n)
{
	ctx[dev] = c;
	ndev = n;
}

static int
cuda_setup(struct bench_ctx *b, const char *mode, int need)
{
	if (bench_gpu_open() < need) {
		char why[96];
		snprintf(why, sizeof(why), "needs %d GPU%s, this machine has %d", need, need > 1 ? "s" : "", ndev);
		bench_skip(b, mode, why);
		return BENCH_SKIP;
	}
	return 0;
}

int
gbuf_alloc(int dev, size_t len, struct gbuf *g)
{
	const char *kind = getenv("GPX_BENCH_GPU_MEM");

	if (kind != NULL && strcmp(kind, "ipc") == 0) {
		/* cudaMalloc-style memory, registered as a legacy IPC handle (trusted nodes only). */
		memset(g, 0, sizeof(*g));
		g->dev = dev;
		g->len = len;
		cuCtxSetCurrent(ctx[dev]);
		return CK(cuMemAlloc(&g->d, len)) && CK(cuMemsetD8(g->d, 0x5a, len)) ? 0 : -1;
	}
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, dev },
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
	};
	CUmemAccessDesc acc[BENCH_GPUS];
	size_t gran;

	memset(g, 0, sizeof(*g));
	g->dev = dev;
	if (ctx[dev] != NULL)
		cuCtxSetCurrent(ctx[dev]);
	if (!CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
		return -1;
	g->len = (len + gran - 1) / gran * gran;
	for (int i = 0; i < ndev; i++)
		acc[i] = (CUmemAccessDesc){ { CU_MEM_LOCATION_TYPE_DEVICE, i }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	if (!CK(cuMemCreate(&g->h, g->len, &prop, 0)) || !CK(cuMemAddressReserve(&g->d, g->len, 0, 0, 0)) ||
	    !CK(cuMemMap(g->d, g->len, 0, g->h, 0)) || !CK(cuMemSetAccess(g->d, g->len, acc, ndev)) ||
	    !CK(cuMemsetD8(g->d, 0x5a, g->len)))
		return -1;
	return 0;
}

void
gbuf_release(struct gbuf *g)
{
	if (g->h == 0) {
		cuMemFree(g->d);
		return;
	}
	cuMemUnmap(g->d, g->len);
	cuMemAddressFree(g->d, g->len);
	cuMemRelease(g->h);
}

static int
gbuf_new(struct bench_ctx *b, int dev, size_t len, struct gbuf *g)
{
	int r;

	if (gbuf_alloc(dev, len, g) < 0)
		return -1;
	if ((r = gpx_register_cuda(b->conn, (void *)g->d, g->len, 0, &g->region)) < 0)
		return bench_fail(b, r, "gpx_register_cuda");
	return 0;
}

static void
gbuf_free(struct bench_ctx *b, struct gbuf *g)
{
	gpx_deregister(b->conn, g->region);
	gbuf_release(g);
}

/* ---- one copy, direct and brokered ---- */

struct op {
	struct bench_ctx *b;
	int dev;                 /* whose stream runs the direct copy */
	uint64_t dst, src, len;
	gpx_region rdst, rsrc;
	uint64_t dst_off, src_off;
	uint64_t tag;
};

static int
direct_copy(void *arg)
{
	struct op *o = arg;

	cuCtxSetCurrent(ctx[o->dev]);
	if (cuMemcpyAsync(o->dst, o->src, o->len, stream[o->dev]) != CUDA_SUCCESS ||
	    cuStreamSynchronize(stream[o->dev]) != CUDA_SUCCESS)
		return -GPX_EIO;
	return 0;
}

/* Submits and spins on the completion queue: the lowest-latency way to use gpx. */
static int
gpx_copy_spin(void *arg)
{
	struct op *o = arg;
	struct gpx_completion c;
	int r = gpx_copy(o->b->conn, o->rsrc, o->src_off, o->rdst, o->dst_off, o->len, ++o->tag);

	if (r < 0)
		return r;
	while ((r = gpx_poll(o->b->conn, &c, 1)) == 0)
		;
	return r < 0 ? r : c.status;
}

static void
row(struct bench_ctx *b, const char *what, const char *metric, double direct, double gpx, bool lower, uint64_t bytes)
{
	struct bench_row r = { .what = what, .metric = metric, .direct = direct, .gpx = gpx,
		.lower_is_better = lower, .bytes = bytes };
	bench_table_row(b, &r);
}

static int
mode_copy(struct bench_ctx *b)
{
	int r = cuda_setup(b, "gpu-copy", 1);
	struct gbuf a, z;
	uint64_t max = b->max_size < (1ull << 30) ? b->max_size : (1ull << 30);
	char sz[32];

	if (r)
		return r;
	int dd = ndev > 1 ? 1 : 0;
	if (gbuf_new(b, 0, max, &a) < 0 || gbuf_new(b, dd, max, &z) < 0)
		return -1;
	bench_table_begin(b, "gpu-copy", dd ? "contiguous copies GPU0 -> GPU1: cuMemcpyPeerAsync vs gpx"
	    : "contiguous copies within GPU0: cuMemcpyAsync vs gpx");
	for (uint64_t len = 4096; len <= max; len *= (len < (1 << 20) ? 16 : 4)) {
		struct op o = { .b = b, .dev = 0, .dst = z.d, .src = a.d, .len = len, .rdst = z.region, .rsrc = a.region };
		struct bench_pair p;
		if (bench_pair_measure(b, direct_copy, gpx_copy_spin, &o, &p) < 0)
			return -1;
		row(b, bench_size_str(len, sz, sizeof(sz)), "GB/s", len / p.direct / 1e9, len / p.gpx / 1e9, false, len);
		bench_pair_free(&p);
	}
	bench_table_end(b, "one copy at a time, submit to completion; DESIGN target >= 0.97x at >= 64 MiB");
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

	cuCtxSetCurrent(ctx[0]);
	cuMemcpyAsync(o->x1->d, o->x0->d, o->len, stream[0]);
	cuCtxSetCurrent(ctx[1]);
	cuMemcpyAsync(o->y0->d, o->y1->d, o->len, stream[1]);
	if (cuStreamSynchronize(stream[1]) != CUDA_SUCCESS)
		return -GPX_EIO;
	cuCtxSetCurrent(ctx[0]);
	return cuStreamSynchronize(stream[0]) == CUDA_SUCCESS ? 0 : -GPX_EIO;
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
	int r = cuda_setup(b, "gpu-bidir", 2);
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
	row(b, bench_size_str(len, sz, sizeof(sz)), "GB/s", 2 * len / p.direct / 1e9, 2 * len / p.gpx / 1e9, false, 2 * len);
	bench_pair_free(&p);
	bench_table_end(b, "DESIGN target >= 0.97x direct");
	gbuf_free(b, &x0);
	gbuf_free(b, &x1);
	gbuf_free(b, &y0);
	gbuf_free(b, &y1);
	return 0;
}

static int
cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static int
mode_latency(struct bench_ctx *b)
{
	int r = cuda_setup(b, "gpu-latency", 1);
	struct gbuf a, z;
	enum { N = 20000 };
	static double dl[N], gl[N];

	if (r)
		return r;
	int dd = ndev > 1 ? 1 : 0;
	if (gbuf_new(b, 0, 1 << 21, &a) < 0 || gbuf_new(b, dd, 1 << 21, &z) < 0)
		return -1;
	struct op o = { .b = b, .dev = 0, .dst = z.d, .src = a.d, .len = 4096, .rdst = z.region, .rsrc = a.region };
	for (int i = 0; i < 2000; i++) {
		direct_copy(&o);
		gpx_copy_spin(&o);
	}
	/* Each side in a block of its own: interleaving them would make the GPU switch between
	 * this process's context and the daemon's for every copy, and time that instead. */
	for (int i = 0; i < N; i++) {
		double t0 = bench_now();
		direct_copy(&o);
		dl[i] = (bench_now() - t0) * 1e6;
	}
	for (int i = 0; i < 2000; i++)
		gpx_copy_spin(&o);
	for (int i = 0; i < N; i++) {
		double t0 = bench_now();
		if ((r = gpx_copy_spin(&o)) < 0)
			return bench_fail(b, r, "gpx_copy");
		gl[i] = (bench_now() - t0) * 1e6;
	}
	qsort(dl, N, sizeof(double), cmp_d);
	qsort(gl, N, sizeof(double), cmp_d);
	bench_table_begin(b, "gpu-latency", dd ? "one 4 KiB copy GPU0 -> GPU1, submit to completion seen by the client"
	    : "one 4 KiB copy within GPU0, submit to completion seen by the client");
	row(b, "p50", "us", dl[N / 2], gl[N / 2], true, 4096);
	row(b, "p99", "us", dl[N * 99 / 100], gl[N * 99 / 100], true, 4096);
	bench_table_end(b, "direct: cuMemcpyAsync + cuStreamSynchronize; gpx: gpx_copy + spinning gpx_poll; "
	    "DESIGN target p50 <= 10 us");
	gbuf_free(b, &a);
	gbuf_free(b, &z);
	return 0;
}

struct pages {
	struct bench_ctx *b;
	struct gbuf *src, *dst;
	struct gpx_seg *segs;
	uint32_t *sp, *dp;          /* the same pages by number */
	size_t n, page;
	uint64_t tag;
};

static int
pages_direct(void *arg)
{
	struct pages *o = arg;

	cuCtxSetCurrent(ctx[o->src->dev]);
	for (size_t i = 0; i < o->n; i++)
		if (cuMemcpyAsync(o->dst->d + o->segs[i].dst_offset, o->src->d + o->segs[i].src_offset,
		    o->segs[i].length, stream[o->src->dev]) != CUDA_SUCCESS)
			return -GPX_EIO;
	return cuStreamSynchronize(stream[o->src->dev]) == CUDA_SUCCESS ? 0 : -GPX_EIO;
}

static int
pages_gpx(void *arg)
{
	struct pages *o = arg;
	struct gpx_completion c;
	int r = gpx_copyv(o->b->conn, o->src->region, o->dst->region, o->segs, o->n, ++o->tag);

	if (r < 0)
		return r;
	while ((r = gpx_poll(o->b->conn, &c, 1)) == 0)
		;
	return r < 0 ? r : c.status;
}

static int
pages_gpx_numbers(void *arg)
{
	struct pages *o = arg;
	struct gpx_completion c;
	int r = gpx_copy_pages(o->b->conn, o->src->region, 0, o->dst->region, 0, o->page, o->sp, o->dp, o->n,
	    ++o->tag);

	if (r < 0)
		return r;
	while ((r = gpx_poll(o->b->conn, &c, 1)) == 0)
		;
	return r < 0 ? r : c.status;
}

static int
mode_pages(struct bench_ctx *b)
{
	int r = cuda_setup(b, "gpu-pages", 1);
	const size_t n = 65536;
	struct gbuf a, z;
	char what[64];

	if (r)
		return r;
	int dd = ndev > 1 ? 1 : 0;
	if (gbuf_new(b, 0, n * 16384 * 2, &a) < 0 || gbuf_new(b, dd, n * 16384 * 2, &z) < 0)
		return -1;
	bench_table_begin(b, "gpu-pages", dd ? "65,536 scattered pages GPU0 -> GPU1 in one request: "
	    "one cuMemcpyAsync per page vs one gpx request" : "65,536 scattered pages within GPU0 in one request");
	struct gpx_seg *s = malloc(n * sizeof(*s));
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(n * sizeof(*dp));
	for (size_t page = 4096; page <= 16384; page *= 4) {
		size_t slots = a.len / page;
		for (size_t i = 0; i < n; i++) {
			/* A stride that visits pages out of order, never the same destination twice. */
			sp[i] = i * 7919 % slots;
			dp[i] = i * 104729 % slots;
			s[i] = (struct gpx_seg){ sp[i] * page, dp[i] * page, page };
		}
		struct pages o = { .b = b, .src = &a, .dst = &z, .segs = s, .sp = sp, .dp = dp, .n = n, .page = page };
		for (int numbers = 0; numbers < 2; numbers++) {
			struct bench_pair p;
			if (bench_pair_measure(b, pages_direct, numbers ? pages_gpx_numbers : pages_gpx, &o, &p) < 0)
				return -1;
			snprintf(what, sizeof(what), "65536 x %zu KiB, %s", page / 1024,
			    numbers ? "gpx_copy_pages" : "gpx_copyv");
			row(b, what, "GB/s", n * page / p.direct / 1e9, n * page / p.gpx / 1e9, false, n * page);
			bench_pair_free(&p);
		}
	}
	bench_table_end(b, "gpx runs them on the SM copy kernel: gpx_copyv as segments (24 bytes each, a list "
	    "staged per launch), gpx_copy_pages as page numbers (8 bytes, read by the kernel in place); "
	    "DESIGN target >= 330 GB/s for 4 KiB pages");
	free(s);
	free(sp);
	free(dp);
	gbuf_free(b, &a);
	gbuf_free(b, &z);
	return 0;
}

/* ---- requests between the client's own GPU work (gpu-idle) ---- */

struct idle {
	struct bench_ctx *b;
	struct gbuf *src, *dst, *work;
	uint32_t *sp, *dp;
	size_t n, page;
	size_t work_words;           /* 32-bit words of a memset that keeps the GPU ~1 ms busy */
	uint64_t tag;
};

/* One page request, submit to completion seen: seconds, or a negative number. */
static double
idle_request(struct idle *o)
{
	struct gpx_completion c;
	double t0 = bench_now();
	int r = gpx_copy_pages(o->b->conn, o->src->region, 0, o->dst->region, 0, o->page, o->sp, o->dp, o->n,
	    ++o->tag);

	while (r == 0 && (r = gpx_poll(o->b->conn, &c, 1)) == 0)
		;
	return r < 0 || c.status != 0 ? -1 : bench_now() - t0;
}

/* The client's own work on its own stream: memsets of the work buffer, about a millisecond. */
static void
idle_work(struct idle *o, bool sync)
{
	cuCtxSetCurrent(ctx[o->work->dev]);
	cuMemsetD32Async(o->work->d, (unsigned)o->tag, o->work_words, stream[o->work->dev]);
	if (sync)
		cuStreamSynchronize(stream[o->work->dev]);
}

/* gpxd's CPU time so far, seconds (its pid from the status query), or -1. */
static double
daemon_cpu(struct bench_ctx *b)
{
	Gpx__QueryReply *q;
	unsigned long ut, st;
	char path[64];
	void *buf;
	size_t len;
	FILE *f;
	int pid = -1;

	if (gpx_query(b->conn, GPX_Q_STATUS, &buf, &len) < 0)
		return -1;
	if ((q = gpx__query_reply__unpack(NULL, len, buf)) != NULL && q->status != NULL)
		pid = q->status->pid;
	free(buf);
	if (q != NULL)
		gpx__query_reply__free_unpacked(q, NULL);
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	if (pid <= 0 || (f = fopen(path, "r")) == NULL)
		return -1;
	int k = fscanf(f, "%*d %*s %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st);
	fclose(f);
	return k == 2 ? (double)(ut + st) / sysconf(_SC_CLK_TCK) : -1;
}

enum { IDLE_BACK, IDLE_AFTER_WORK, IDLE_AFTER_SLEEP, IDLE_DURING_WORK };

/* Median of `iters` requests, each after `how`; with cpu, gpxd's CPU share meanwhile. */
static double
idle_measure(struct idle *o, int how, int iters, double *cpu)
{
	static double t[200];
	struct timespec ms = { 0, 1000000 };
	double c0 = cpu ? daemon_cpu(o->b) : 0, w0 = bench_now();

	for (int i = 0; i < iters; i++) {
		if (how == IDLE_AFTER_WORK || how == IDLE_DURING_WORK)
			idle_work(o, how == IDLE_AFTER_WORK);
		else if (how == IDLE_AFTER_SLEEP)
			nanosleep(&ms, NULL);
		if ((t[i] = idle_request(o)) < 0)
			return -1;
		if (how == IDLE_DURING_WORK)
			cuStreamSynchronize(stream[o->work->dev]);
	}
	if (cpu)
		*cpu = (daemon_cpu(o->b) - c0) / (bench_now() - w0);
	return bench_median(t, iters);
}

static int
mode_idle(struct bench_ctx *b)
{
	int r = cuda_setup(b, "gpu-idle", 1);
	static const size_t pages[][2] = { { 65536, 4096 }, { 8192, 32768 } };
	struct gbuf a, z, w;
	char what[96];

	if (r)
		return r;
	int dd = ndev > 1 ? 1 : 0;
	if (gbuf_new(b, 0, 512u << 20, &a) < 0 || gbuf_new(b, dd, 512u << 20, &z) < 0 ||
	    gbuf_alloc(0, 4ull << 30, &w) < 0)
		return -1;
	uint32_t *sp = malloc(65536 * sizeof(*sp)), *dp = malloc(65536 * sizeof(*dp));
	struct idle o = { .b = b, .src = &a, .dst = &z, .work = &w, .sp = sp, .dp = dp };
	/* Calibrate the client's work to about a millisecond. */
	o.work_words = w.len / 4;
	double t0 = bench_now();
	for (int i = 0; i < 5; i++)
		idle_work(&o, true);
	double per = (bench_now() - t0) / 5;
	o.work_words = (size_t)(o.work_words * (1e-3 / per)) & ~(size_t)63;
	if (o.work_words > w.len / 4)
		o.work_words = w.len / 4;
	bench_table_begin(b, "gpu-idle", dd ? "page requests GPU0 -> GPU1 between the client's own GPU work: "
	    "direct = the same requests back to back" : "page requests within GPU0 between the client's own GPU "
	    "work: direct = the same requests back to back");
	double cpu_busy = -1;
	for (size_t k = 0; k < 2; k++) {
		o.n = pages[k][0];
		o.page = pages[k][1];
		size_t slots = a.len / o.page;
		for (size_t i = 0; i < o.n; i++) {
			sp[i] = i * 7919 % slots;
			dp[i] = i * 104729 % slots;
		}
		for (int i = 0; i < 20; i++)
			idle_request(&o);
		double back = idle_measure(&o, IDLE_BACK, 60, NULL);
		static const char *names[] = { "", "after 1 ms of its GPU work", "after 1 ms of nothing",
			"while 1 ms of its GPU work runs" };
		for (int how = IDLE_AFTER_WORK; how <= IDLE_DURING_WORK; how++) {
			double t = idle_measure(&o, how, 60, how == IDLE_AFTER_WORK && k == 0 ? &cpu_busy : NULL);
			if (back < 0 || t < 0)
				return bench_fail(b, -GPX_EIO, "a page request");
			snprintf(what, sizeof(what), "%zu x %zu KiB, %s", o.n, o.page / 1024, names[how]);
			row(b, what, "GB/s", o.n * o.page / back / 1e9, o.n * o.page / t / 1e9, false, o.n * o.page);
		}
	}
	/* And once nothing comes any more: what gpxd costs idle. */
	struct timespec settle = { 0, 100000000 };
	nanosleep(&settle, NULL);
	double c0 = daemon_cpu(b);
	sleep(1);
	double idle = daemon_cpu(b) - c0;
	char note[256];
	snprintf(note, sizeof(note), "gpxd's CPU: %.2f cores while a request came every ~1 ms, %.3f cores idle "
	    "(client work: %.2f ms of memset); target >= 0.95x of back to back", cpu_busy, idle, per * 1e3 *
	    o.work_words / (w.len / 4.0));
	bench_table_end(b, note);
	free(sp);
	free(dp);
	gbuf_free(b, &a);
	gbuf_free(b, &z);
	cuMemUnmap(w.d, w.len);
	cuMemAddressFree(w.d, w.len);
	cuMemRelease(w.h);
	return 0;
}

static int
mode_host(struct bench_ctx *b)
{
	int r = cuda_setup(b, "gpu-host", 1);
	uint64_t len = b->max_size < (256ull << 20) ? b->max_size : (256ull << 20);
	struct bench_buf h;
	struct gbuf g;
	char what[64], sz[32];

	if (r)
		return r;
	if (bench_buf_new(b, len, &h) < 0 || gbuf_new(b, 0, len, &g) < 0)
		return -1;
	cuCtxSetCurrent(ctx[0]);
	if (!CK(cuMemHostRegister(h.ptr, h.len, CU_MEMHOSTREGISTER_PORTABLE)))
		return -1;
	bench_table_begin(b, "gpu-host", "pinned host memory <-> GPU0: cuMemcpyAsync vs gpx");
	for (int dir = 0; dir < 2; dir++)
		for (uint64_t n = 64ull << 20; n <= len; n *= 4) {
			struct op o = { .b = b, .dev = 0, .len = n };
			if (dir == 0) {
				o.src = (uint64_t)(uintptr_t)h.ptr, o.dst = g.d, o.rsrc = h.region, o.rdst = g.region;
			} else {
				o.src = g.d, o.dst = (uint64_t)(uintptr_t)h.ptr, o.rsrc = g.region, o.rdst = h.region;
			}
			struct bench_pair p;
			if (bench_pair_measure(b, direct_copy, gpx_copy_spin, &o, &p) < 0)
				return -1;
			snprintf(what, sizeof(what), "%s %s", dir == 0 ? "host->GPU" : "GPU->host",
			    bench_size_str(n, sz, sizeof(sz)));
			row(b, what, "GB/s", n / p.direct / 1e9, n / p.gpx / 1e9, false, n);
			bench_pair_free(&p);
		}
	bench_table_end(b, "the daemon pins the client's memfd at registration; DESIGN target >= 0.97x");
	cuMemHostUnregister(h.ptr);
	gbuf_free(b, &g);
	bench_buf_free(b, &h);
	return 0;
}

static int
mode_register(struct bench_ctx *b)
{
	int r = cuda_setup(b, "gpu-register", 1);
	enum { N = 200 };
	double first[N], again[N];

	if (r)
		return r;
	for (int i = 0; i < N; i++) {
		struct gbuf g;
		gpx_region r2;
		if (gbuf_alloc(0, 2 << 20, &g) < 0)
			return -1;
		double t0 = bench_now();
		if ((r = gpx_register_cuda(b->conn, (void *)g.d, g.len, 0, &g.region)) < 0)
			return bench_fail(b, r, "gpx_register_cuda");
		double t1 = bench_now();
		if ((r = gpx_register_cuda(b->conn, (void *)g.d, g.len, 0, &r2)) < 0)
			return bench_fail(b, r, "gpx_register_cuda");
		double t2 = bench_now();
		gpx_deregister(b->conn, r2);
		gbuf_free(b, &g);
		first[i] = (t1 - t0) * 1e6;
		again[i] = (t2 - t1) * 1e6;
	}
	qsort(first, N, sizeof(double), cmp_d);
	qsort(again, N, sizeof(double), cmp_d);
	bench_table_begin(b, "gpu-register", "registering a 2 MiB VMM buffer: first time vs already held by gpxd");
	row(b, "first (export + daemon import and map), p50", "us", NAN, first[N / 2], true, 0);
	row(b, "again (served from the mapping cache), p50", "us", NAN, again[N / 2], true, 0);
	row(b, "again, p99", "us", NAN, again[N * 99 / 100], true, 0);
	bench_table_end(b, "anchor: cuIpcOpenMemHandle 120 us, VMM import+map 131 us; DESIGN target cached <= 10 us");
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
	int r = cuda_setup(b, "gpu-import", 1);
	uint64_t len = b->max_size < (1ull << 30) ? b->max_size : (1ull << 30);
	struct gbuf a, z;
	CUdeviceptr ia = 0, iz = 0;
	char what[64], sz[32];

	if (r)
		return r;
	int dd = ndev > 1 ? 1 : 0;
	if (gbuf_alloc(0, len, &a) < 0 || gbuf_alloc(dd, len, &z) < 0 || a.h == 0) {
		bench_skip(b, "gpu-import", "needs VMM buffers");
		return BENCH_SKIP;
	}
	struct gbuf *g[2] = { &a, &z };
	CUdeviceptr *im[2] = { &ia, &iz };
	for (int i = 0; i < 2; i++) {
		int fd = -1;
		CUmemGenericAllocationHandle h;
		CUmemAccessDesc acc[BENCH_GPUS];
		for (int k = 0; k < ndev; k++)
			acc[k] = (CUmemAccessDesc){ { CU_MEM_LOCATION_TYPE_DEVICE, k }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
		if (!CK(cuMemExportToShareableHandle(&fd, g[i]->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) ||
		    !CK(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) ||
		    !CK(cuMemAddressReserve(im[i], g[i]->len, 0, 0, 0)) || !CK(cuMemMap(*im[i], g[i]->len, 0, h, 0)) ||
		    !CK(cuMemSetAccess(*im[i], g[i]->len, acc, ndev)))
			return -1;
		close(fd);
	}
	bench_table_begin(b, "gpu-import", "control: the same copies in this process, own mappings (direct) vs "
	    "imported mappings (in the gpx column)");
	for (uint64_t n = 64ull << 20; n <= len; n *= 4) {
		struct op own = { .b = b, .dev = 0, .dst = z.d, .src = a.d, .len = n };
		struct op imp = { .b = b, .dev = 0, .dst = iz, .src = ia, .len = n };
		struct bench_pair p1, p2;
		if (bench_pair_measure(b, direct_copy, direct_copy, &own, &p1) < 0 ||
		    bench_pair_measure(b, direct_copy, direct_copy, &imp, &p2) < 0)
			return -1;
		snprintf(what, sizeof(what), "%s", bench_size_str(n, sz, sizeof(sz)));
		row(b, what, "GB/s", n / p1.direct / 1e9, n / p2.direct / 1e9, false, n);
		bench_pair_free(&p1);
		bench_pair_free(&p2);
	}
	bench_table_end(b, "no daemon involved in either column");
	return 0;
}

/* A copy between two regions of this client, waited for. */
struct rop {
	gpx_conn *c;
	gpx_region src, dst;
	uint64_t len;
};

static int
rop_copy(void *arg)
{
	struct rop *o = arg;

	return gpx_copy_sync(o->c, o->src, 0, o->dst, 0, o->len);
}

/* Exports r, a region of the peer daemon's client, to peers and imports it here. */
static int
remote_pair(struct bench_ctx *b, gpx_conn *peer, const char *node, const char *tag, gpx_region r,
    gpx_region *imported)
{
	char name[96];
	int e;

	snprintf(name, sizeof(name), "gpx-bench-%s-%d", tag, (int)getpid());
	if ((e = gpx_export_remote(peer, r, name, NULL, NULL)) < 0)
		return bench_fail(b, e, "exporting to peers");
	snprintf(name, sizeof(name), "%s:gpx-bench-%s-%d", node, tag, (int)getpid());
	if ((e = gpx_import(b->conn, name, imported, NULL)) < 0)
		return bench_fail(b, e, "importing through the daemon under test");
	return 0;
}

static int
mode_remote(struct bench_ctx *b)
{
	const char *sock = getenv("GPX_BENCH_PEER"), *node = getenv("GPX_BENCH_PEER_NODE");
	uint64_t cap = b->max_size < (64ull << 20) ? b->max_size : (64ull << 20);
	struct gbuf lg, pg;
	struct bench_buf lh;
	int pfd, r = cuda_setup(b, "gpu-remote", 1);
	void *pptr;
	gpx_conn *peer;
	gpx_region ph, rg, rh;
	char what[64], sz[32];

	if (r)
		return r;
	if (sock == NULL || node == NULL) {
		bench_skip(b, "gpu-remote", "needs a peered second gpxd: GPX_BENCH_PEER=SOCKET GPX_BENCH_PEER_NODE=NODE");
		return BENCH_SKIP;
	}
	if ((r = gpx_connect(sock, "gpx-bench-peer", &peer)) < 0)
		return bench_fail(b, r, "connecting to the peer daemon");
	if (gbuf_new(b, 0, cap, &lg) < 0 || bench_buf_new(b, cap, &lh) < 0 || gbuf_alloc(0, cap, &pg) < 0)
		return -1;
	if ((r = gpx_register_cuda(peer, (void *)pg.d, pg.len, 0, &pg.region)) < 0 ||
	    (r = gpx_host_alloc(cap, &pfd, &pptr)) < 0 || (r = gpx_register_host(peer, pfd, 0, cap, 0, &ph)) < 0)
		return bench_fail(b, r, "registering memory with the peer daemon");
	if (remote_pair(b, peer, node, "g", pg.region, &rg) < 0 || remote_pair(b, peer, node, "h", ph, &rh) < 0)
		return -1;
	bench_table_begin(b, "gpu-remote", "to and from a peer daemon: host memory vs GPU memory (staged)");
	for (int dir = 0; dir < 2; dir++)
		for (uint64_t n = 1ull << 20; n <= cap; n *= 8) {
			struct rop h = { b->conn, dir ? rh : lh.region, dir ? lh.region : rh, n };
			struct rop g = { b->conn, dir ? rg : lg.region, dir ? lg.region : rg, n };
			struct bench_pair p;
			double th, tg;
			/* Two pairs so that each side is timed against itself: host, then GPU. */
			if (bench_pair_measure(b, rop_copy, rop_copy, &h, &p) < 0)
				return -1;
			th = p.gpx;
			bench_pair_free(&p);
			if (bench_pair_measure(b, rop_copy, rop_copy, &g, &p) < 0)
				return -1;
			tg = p.gpx;
			bench_pair_free(&p);
			snprintf(what, sizeof(what), "%s %s", dir == 0 ? "write" : "read", bench_size_str(n, sz, sizeof(sz)));
			row(b, what, "GB/s", n / th / 1e9, n / tg / 1e9, false, n);
		}
	bench_table_end(b, "direct: host memory on both sides through the same two daemons; gpx: GPU memory "
	    "on both sides, staged through host buffers by both daemons");
	gpx_close(peer);
	gbuf_free(b, &lg);
	bench_buf_free(b, &lh);
	cuMemUnmap(pg.d, pg.len);
	cuMemAddressFree(pg.d, pg.len);
	cuMemRelease(pg.h);
	gpx_host_free(pfd, pptr, cap);
	return 0;
}

static const struct bench_mode gpu_modes[] = {
	{ "gpu-import", "control: own vs imported mappings in one process", mode_import },
	{ "gpu-copy", "contiguous GPU copies 4 KiB..1 GiB: cuMemcpyPeerAsync vs gpx", mode_copy },
	{ "gpu-bidir", "GPU0<->GPU1 both directions at once", mode_bidir },
	{ "gpu-latency", "4 KiB copy latency p50/p99: direct vs gpx", mode_latency },
	{ "gpu-pages", "65,536 scattered 4/16 KiB pages in one request", mode_pages },
	{ "gpu-idle", "page requests between the client's own GPU work vs back to back", mode_idle },
	{ "gpu-host", "pinned host <-> GPU copies >= 64 MiB", mode_host },
	{ "gpu-register", "registration cost, first and cached", mode_register },
	{ "gpu-remote", "GPU memory to a peer gpxd (GPX_BENCH_PEER): host vs GPU memory GB/s", mode_remote },
};
BENCH_MODES(gpu_modes)
