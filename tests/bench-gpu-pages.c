/*
 * gpx-bench-gpu's page modes: many scattered pages in one request, as segments (gpx_copyv) or
 * as page numbers (gpx_copy_pages), back to back or between the client's own GPU work.
 *
 *   gpu-pages    65,536 scattered 4 KiB and 16 KiB pages in one vectored request
 *   gpu-idle     the same page requests between the client's own GPU work: after 1 ms of
 *                it, after 1 ms of nothing, and while it runs, against back to back; and
 *                what gpxd's threads cost in CPU meanwhile and once idle
 */
#include "config.h"

#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <cuda.h>

#include "proto/gpx.pb-c.h"
#include "tests/bench.h"
#include "tests/bench-gpu.h"

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

	cuCtxSetCurrent(bench_gpu_ctx(o->src->dev));
	for (size_t i = 0; i < o->n; i++)
		if (cuMemcpyAsync(o->dst->d + o->segs[i].dst_offset, o->src->d + o->segs[i].src_offset,
		    o->segs[i].length, bench_gpu_stream(o->src->dev)) != CUDA_SUCCESS)
			return -GPX_EIO;
	return cuStreamSynchronize(bench_gpu_stream(o->src->dev)) == CUDA_SUCCESS ? 0 : -GPX_EIO;
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
	int r = bench_gpu_setup(b, "gpu-pages", 1);
	const size_t n = 65536;
	struct gbuf a, z;
	char what[64];

	if (r)
		return r;
	int dd = bench_gpu_count() > 1 ? 1 : 0;
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
			bench_gpu_row(b, what, "GB/s", n * page / p.direct / 1e9, n * page / p.gpx / 1e9, false, n * page);
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
	cuCtxSetCurrent(bench_gpu_ctx(o->work->dev));
	cuMemsetD32Async(o->work->d, (unsigned)o->tag, o->work_words, bench_gpu_stream(o->work->dev));
	if (sync)
		cuStreamSynchronize(bench_gpu_stream(o->work->dev));
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
			cuStreamSynchronize(bench_gpu_stream(o->work->dev));
	}
	if (cpu)
		*cpu = (daemon_cpu(o->b) - c0) / (bench_now() - w0);
	return bench_median(t, iters);
}

static int
mode_idle(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-idle", 1);
	static const size_t pages[][2] = { { 65536, 4096 }, { 8192, 32768 } };
	struct gbuf a, z, w;
	char what[96];

	if (r)
		return r;
	int dd = bench_gpu_count() > 1 ? 1 : 0;
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
			bench_gpu_row(b, what, "GB/s", o.n * o.page / back / 1e9, o.n * o.page / t / 1e9, false, o.n * o.page);
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

static const struct bench_mode pages_modes[] = {
	{ "gpu-pages", "65,536 scattered 4/16 KiB pages in one request", mode_pages },
	{ "gpu-idle", "page requests between the client's own GPU work vs back to back", mode_idle },
};
BENCH_MODES(pages_modes)
