/*
 * gpx-bench-gpu's page modes: many scattered pages in one request, as segments (gpx_copyv) or
 * as page numbers (gpx_copy_pages), back to back or between the client's own GPU work.
 *
 *   gpu-pages    65,536 scattered 4 KiB and 16 KiB pages in one request, against what a
 *                program does without gpx: its own gather-scatter kernel over all pages in
 *                one launch (tests/bench-gather.cu; the strongest, and the target's baseline),
 *                cuMemcpyBatchAsync of all pages, and one cuMemcpyAsync per page; and
 *                gpxd's own page kernel launched here, once, as gpxd launches it, which
 *                tells the kernel's speed from what a request costs around it
 *   gpu-idle     the same page requests between the client's own GPU work: after 1 ms of
 *                it, after 1 ms of nothing, and while it runs, against back to back; and
 *                what gpxd's threads cost in CPU meanwhile and once idle
 */
#include "config.h"

#include <dirent.h>
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
#include "tests/util.h"

extern const unsigned char bench_gather_fatbin[];
extern const unsigned char gpx_copy_fatbin[];      /* gpxd's kernels (daemon/gpu/copy-kernel.cu) */

struct pages {
	struct bench_ctx *b;
	struct gbuf *src, *dst;
	struct gpx_seg *segs;
	uint32_t *sp, *dp;          /* the same pages by number */
	size_t n, page;
	uint64_t tag;
	CUdeviceptr dsp, ddp;       /* the page numbers in GPU0's memory, for the program's kernel */
	CUdeviceptr *bsrc, *bdst;   /* the pages as cuMemcpyBatchAsync takes them */
	size_t *blen;
	CUdeviceptr klist, kpair;   /* gpxd's kernel's list and pair, in pinned host memory */
	gpx_region table;           /* the page numbers in GPU0's memory, registered (gpx_copy_pages_table) */
};

/* The program's own gather-scatter kernel on the source's GPU, and its grid; gpxd's page kernel. */
static CUfunction gather_fn, kpages_fn;
static unsigned gather_blocks;

/* Whether cuMemcpyBatchAsync runs here (the batch column), and else why not. */
static bool batch_ok = true;
static char batch_why[128];

static int
pages_baselines_load(int dev)
{
	CUmodule m;
	CUdevice d;
	int sms = 0;

	cuCtxSetCurrent(bench_gpu_ctx(dev));
	if (!CK(cuModuleLoadData(&m, bench_gather_fatbin)) || !CK(cuModuleGetFunction(&gather_fn, m, "bench_gather")) ||
	    !CK(cuModuleLoadData(&m, gpx_copy_fatbin)) || !CK(cuModuleGetFunction(&kpages_fn, m, "gpx_copy_pages")) ||
	    !CK(cuCtxGetDevice(&d)) || !CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d)))
		return -1;
	/* Eight blocks of 256 threads per SM: every SM full, as a program launches it on an idle GPU. */
	gather_blocks = (unsigned)sms * 8;
	return 0;
}

/* The strongest baseline: one launch of the program's own kernel over all pages. */
static int
pages_fused(void *arg)
{
	struct pages *o = arg;
	CUstream st = bench_gpu_stream(o->src->dev);
	uint32_t n = (uint32_t)o->n, size = (uint32_t)o->page;
	void *args[] = { &o->src->d, &o->dst->d, &o->dsp, &o->ddp, &n, &size };
	unsigned blocks = (n + 7) / 8 < gather_blocks ? (n + 7) / 8 : gather_blocks;

	cuCtxSetCurrent(bench_gpu_ctx(o->src->dev));
	if (cuLaunchKernel(gather_fn, blocks, 1, 1, 256, 1, 1, 0, st, args, NULL) != CUDA_SUCCESS)
		return -GPX_EIO;
	return cuStreamSynchronize(st) == CUDA_SUCCESS ? 0 : -GPX_EIO;
}

/* A request just submitted (r, what its submission returned), spun on until it completes: its status. */
static int
pages_wait(struct pages *o, int r)
{
	struct gpx_completion c;

	if (r < 0)
		return r;
	while ((r = gpx_poll(o->b->conn, &c, 1)) == 0)
		;
	return r < 0 ? r : c.status;
}

/* The same pages with their numbers in GPU memory, as the program's kernel has them. */
static int
pages_gpx_table(void *arg)
{
	struct pages *o = arg;

	return pages_wait(o, gpx_copy_pages_table(o->b->conn, o->src->region, 0, o->dst->region, 0, o->page, o->table,
	    0, o->n, ++o->tag));
}

/*
 * gpxd's page kernel, launched here once over all pages as gpxd launches it (a block of 256
 * for every 8 pages, the default of cuda.sm_copy_blocks), its list read in place from pinned
 * host memory as gpxd's checked copy is: the kernel's own speed, without what a request
 * costs around it (the client's writing of the list, gpxd's check of it, the hand-offs).
 */
static int
pages_kernel_here(void *arg)
{
	struct pages *o = arg;
	CUstream st = bench_gpu_stream(o->src->dev);
	uint32_t n = (uint32_t)o->n, item0 = 0, stride = 2, lim = UINT32_MAX;
	uint64_t size = o->page, head = 0, bytes = o->n * o->page, sp = o->klist, dp = o->klist + 4, oob = 0;
	void *args[] = { &sp, &dp, &stride, &n, &o->kpair, &item0, &n, &size, &head, &bytes, &lim, &lim, &oob };

	cuCtxSetCurrent(bench_gpu_ctx(o->src->dev));
	if (cuLaunchKernel(kpages_fn, (n + 7) / 8, 1, 1, 256, 1, 1, 0, st, args, NULL) != CUDA_SUCCESS)
		return -GPX_EIO;
	return cuStreamSynchronize(st) == CUDA_SUCCESS ? 0 : -GPX_EIO;
}

/* All pages in one cuMemcpyBatchAsync: the driver's own way of many copies in one call. */
static int
pages_batch(void *arg)
{
	struct pages *o = arg;

	return bench_gpu_batch(o->src->dev, o->dst->dev, o->bdst, o->bsrc, o->blen, o->n, batch_why, sizeof(batch_why));
}

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

	return pages_wait(o, gpx_copyv(o->b->conn, o->src->region, o->dst->region, o->segs, o->n, ++o->tag));
}

static int
pages_gpx_numbers(void *arg)
{
	struct pages *o = arg;

	return pages_wait(o, gpx_copy_pages(o->b->conn, o->src->region, 0, o->dst->region, 0, o->page, o->sp, o->dp,
	    o->n, ++o->tag));
}

/*
 * The destination after the op, compared page for page with the source: the baselines are
 * checked like gpx, so a fast kernel that copies the wrong bytes cannot win.
 */
static int
pages_check(struct pages *o, bench_op op, const char *name)
{
	unsigned char *s = malloc(o->src->len), *d = malloc(o->dst->len);
	int r = -1;

	/* Each buffer through its own GPU's context: the driver may refuse a synchronous copy of
	 * another GPU's VMM memory from the current one. */
	if (s == NULL || d == NULL)
		goto out;
	cuCtxSetCurrent(bench_gpu_ctx(o->dst->dev));
	/* cuMemsetD8 of device memory may return before it is done: on two GPUs the clearing could
	 * land after the copy under test, on pages it already wrote. */
	if (!CK(cuMemsetD8(o->dst->d, 0, o->dst->len)) || !CK(cuCtxSynchronize()) || op(o) < 0)
		goto out;
	cuCtxSetCurrent(bench_gpu_ctx(o->src->dev));
	if (!CK(cuMemcpyDtoH(s, o->src->d, o->src->len)))
		goto out;
	cuCtxSetCurrent(bench_gpu_ctx(o->dst->dev));
	if (!CK(cuMemcpyDtoH(d, o->dst->d, o->dst->len)))
		goto out;
	for (size_t i = 0; i < o->n; i++)
		if (memcmp(d + (size_t)o->dp[i] * o->page, s + (size_t)o->sp[i] * o->page, o->page) != 0) {
			fprintf(stderr, "gpx-bench-gpu: gpu-pages: %s: page %zu of %zu KiB did not arrive intact\n",
			    name, i, o->page / 1024);
			goto out;
		}
	r = 0;
out:
	free(s);
	free(d);
	return r;
}

static int
mode_pages(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-pages", 1);
	const size_t n = 65536;
	struct gbuf a, z;
	char what[64], title[800];

	if (r)
		return r;
	int dd = bench_gpu_count() > 1 ? 1 : 0;
	if (pages_baselines_load(0) < 0 || gbuf_new(b, 0, n * 16384 * 2, &a) < 0 ||
	    gbuf_new(b, dd, n * 16384 * 2, &z) < 0)
		return -1;
	/* A source that differs at every 8-byte word, so a page copied to the wrong place shows. */
	unsigned char *fill = malloc(a.len);
	cuCtxSetCurrent(bench_gpu_ctx(0));
	if (fill == NULL)
		return bench_fail(b, -GPX_ENOMEM, "the source's pattern");
	bench_fill(fill, a.len, 11);
	if (!CK(cuMemcpyHtoD(a.d, fill, a.len))) {
		free(fill);
		return -1;
	}
	free(fill);
	snprintf(title, sizeof(title), "65,536 scattered pages %s in one request: the program's own kernel, "
	    "cuMemcpyBatchAsync and one cuMemcpyAsync per page (direct) vs gpx", dd ? "GPU0 -> GPU1" : "within GPU0");
	bench_table_begin(b, "gpu-pages", title);
	struct gpx_seg *s = malloc(n * sizeof(*s));
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(n * sizeof(*dp));
	CUdeviceptr *bs = malloc(n * sizeof(*bs)), *bd = malloc(n * sizeof(*bd));
	size_t *bl = malloc(n * sizeof(*bl));
	CUdeviceptr dsp, ddp, klist, kpair;
	struct gbuf tab;             /* the page numbers again in GPU0's memory, for gpx_copy_pages_table */
	uint32_t *hlist;             /* gpxd's kernel's list: (source, destination) page numbers */
	uint64_t *hpair;             /* and its one pair's bases */
	char beyond[160] = "";       /* a request's time beyond gpxd's kernel alone, each page size */
	if (s == NULL || sp == NULL || dp == NULL || bs == NULL || bd == NULL || bl == NULL ||
	    !CK(cuMemAlloc(&dsp, n * sizeof(*sp))) || !CK(cuMemAlloc(&ddp, n * sizeof(*dp))) ||
	    !CK(cuMemHostAlloc((void **)&hlist, n * 2 * sizeof(*hlist), CU_MEMHOSTALLOC_DEVICEMAP)) ||
	    !CK(cuMemHostAlloc((void **)&hpair, 2 * sizeof(*hpair), CU_MEMHOSTALLOC_DEVICEMAP)) ||
	    !CK(cuMemHostGetDevicePointer(&klist, hlist, 0)) || !CK(cuMemHostGetDevicePointer(&kpair, hpair, 0)))
		return -1;
	hpair[0] = a.d;
	hpair[1] = z.d;
	if (gbuf_new(b, 0, 2 * n * sizeof(*sp), &tab) < 0)
		return -1;
	for (size_t page = 4096; page <= 16384; page *= 4) {
		size_t slots = a.len / page;
		for (size_t i = 0; i < n; i++) {
			/* A stride that visits pages out of order, never the same destination twice. */
			sp[i] = i * 7919 % slots;
			dp[i] = i * 104729 % slots;
			s[i] = (struct gpx_seg){ sp[i] * page, dp[i] * page, page };
			bs[i] = a.d + (CUdeviceptr)sp[i] * page;
			bd[i] = z.d + (CUdeviceptr)dp[i] * page;
			bl[i] = page;
			hlist[2 * i] = sp[i];
			hlist[2 * i + 1] = dp[i];
		}
		cuCtxSetCurrent(bench_gpu_ctx(0));
		if (!CK(cuMemcpyHtoD(dsp, sp, n * sizeof(*sp))) || !CK(cuMemcpyHtoD(ddp, dp, n * sizeof(*dp))) ||
		    !CK(cuMemcpyHtoD(tab.d, sp, n * sizeof(*sp))) || !CK(cuMemcpyHtoD(tab.d + n * sizeof(*sp), dp, n * sizeof(*dp))))
			return -1;
		struct pages o = { .b = b, .src = &a, .dst = &z, .segs = s, .sp = sp, .dp = dp, .n = n, .page = page,
			.dsp = dsp, .ddp = ddp, .bsrc = bs, .bdst = bd, .blen = bl, .klist = klist, .kpair = kpair,
			.table = tab.region };
		static const struct {
			const char *metric;
			bench_op direct, gpx;
			const char *gpx_name;
			const char *target;
		} rows[] = {
			{ "GB/s kernel", pages_fused, pages_gpx_numbers, "gpx_copy_pages", "gpu.pages.fused" },
			{ "GB/s kernel", pages_fused, pages_gpx_table, "gpx_copy_pages_table", "gpu.pages.fused" },
			{ "GB/s kernel", pages_fused, pages_gpx, "gpx_copyv", "gpu.pages.fused" },
			{ "GB/s batch", NULL, pages_gpx_numbers, "gpx_copy_pages", NULL },
			{ "GB/s per page", pages_direct, pages_gpx_numbers, "gpx_copy_pages", NULL },
			{ "GB/s kernel", pages_fused, pages_kernel_here, "gpxd's kernel alone", NULL },
		};
		double t_request = NAN;
		/* A driver that refuses a batch this long leaves the column out, saying why. */
		if (batch_ok && pages_batch(&o) < 0) {
			fprintf(stderr, "gpx-bench-gpu: gpu-pages: %s\n", batch_why);
			batch_ok = false;
		}
		if (pages_check(&o, pages_fused, "the program's kernel") < 0 ||
		    (batch_ok && pages_check(&o, pages_batch, "cuMemcpyBatchAsync") < 0) ||
		    pages_check(&o, pages_gpx_numbers, "gpx_copy_pages") < 0 || pages_check(&o, pages_gpx, "gpx_copyv") < 0 ||
		    pages_check(&o, pages_kernel_here, "gpxd's kernel alone") < 0 ||
		    pages_check(&o, pages_gpx_table, "gpx_copy_pages_table") < 0)
			return -1;
		for (size_t k = 0; k < sizeof(rows) / sizeof(rows[0]); k++) {
			bench_op direct = rows[k].direct != NULL ? rows[k].direct : batch_ok ? pages_batch : NULL;
			struct bench_pair p;
			snprintf(what, sizeof(what), "65536 x %zu KiB, %s", page / 1024, rows[k].gpx_name);
			if (direct == NULL) {
				bench_gpu_row(b, what, rows[k].metric, NAN, NAN, false, n * page);
				continue;
			}
			if (bench_pair_measure(b, direct, rows[k].gpx, &o, &p) < 0)
				return -1;
			bench_gpu_row_t(b, what, rows[k].metric, n * page / p.direct / 1e9, n * page / p.gpx / 1e9, false,
			    n * page, rows[k].target);
			if (k == 0)
				t_request = p.gpx;
			else if (rows[k].gpx == pages_kernel_here)
				snprintf(beyond + strlen(beyond), sizeof(beyond) - strlen(beyond), "%s%zu KiB %.1f us",
				    beyond[0] ? ", " : "", page / 1024, (t_request - p.gpx) * 1e6);
			bench_pair_free(&p);
		}
	}
	snprintf(title, sizeof(title), "direct: kernel = one launch of the program's own gather-scatter kernel "
	    "(tests/bench-gather.cu, %u blocks of 256), batch = cuMemcpyBatchAsync%s%s, per page = one "
	    "cuMemcpyAsync each; gpx_copy_pages_table = the page numbers in GPU0's memory, as the program's "
	    "kernel has them; gpxd's kernel alone = gpxd's gpx_copy_pages launched here once as gpxd "
	    "launches it, its list in pinned host memory (a gpx_copy_pages request took longer by %s: the "
	    "client's writing of the list, gpxd's check of it, the hand-offs and launch); every way checked "
	    "byte for byte first", gather_blocks, !batch_ok ? ": " : "", !batch_ok ? batch_why : "", beyond);
	bench_table_end(b, title);
	cuMemFree(dsp);
	cuMemFree(ddp);
	gbuf_free(b, &tab);
	cuMemFreeHost(hlist);
	cuMemFreeHost(hpair);
	free(s);
	free(sp);
	free(dp);
	free(bs);
	free(bd);
	free(bl);
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
	int pid;                     /* gpxd's */
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

/*
 * gpxd's CPU time so far, seconds, of the threads it has now: in all (-1 when unknown), and by
 * thread name (its main thread, the event loop, as "loop" whatever its binary is called;
 * gpxd-gpuN is GPU N's copy worker, and so on), threads of one name summed.
 */
#define CPU_NAMES 24
struct dcpu {
	double all;
	int n;
	char name[CPU_NAMES][16];
	double s[CPU_NAMES];
};

/*
 * A thread's CPU time so far, seconds, and its name (comm); -1 if unreadable.  From schedstat
 * (nanoseconds) where the kernel keeps it, else from stat's utime + stime (clock ticks: 10 ms,
 * too coarse for a window of a tenth of a second).
 */
static double
thread_cpu(int pid, const char *tid, char name[16])
{
	char path[300];
	unsigned long long ns;
	double t = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/task/%s/stat", pid, tid);
	long ticks = proc_stat_ticks(path, name);
	if (ticks < 0)
		return -1;
	snprintf(path, sizeof(path), "/proc/%d/task/%s/schedstat", pid, tid);
	if ((f = fopen(path, "re")) != NULL) {
		if (fscanf(f, "%llu", &ns) == 1)
			t = ns / 1e9;
		fclose(f);
	}
	return t >= 0 ? t : (double)ticks / sysconf(_SC_CLK_TCK);
}

/* gpxd's pid, from the status query: asked once, before anything is measured (a request
 * sets the loop polling for busy_poll_us, which a measure of idle would count). */
static int
daemon_pid(struct bench_ctx *b)
{
	Gpx__QueryReply *q;
	void *buf;
	size_t len;
	int pid = -1;

	if (gpx_query(b->conn, GPX_Q_STATUS, &buf, &len) < 0)
		return -1;
	if ((q = gpx__query_reply__unpack(NULL, len, buf)) != NULL && q->status != NULL)
		pid = q->status->pid;
	free(buf);
	if (q != NULL)
		gpx__query_reply__free_unpacked(q, NULL);
	return pid;
}

static void
daemon_cpu(int pid, struct dcpu *c)
{
	char path[64], name[16];

	memset(c, 0, sizeof(*c));
	c->all = -1;
	snprintf(path, sizeof(path), "/proc/%d/task", pid);
	DIR *d = pid > 0 ? opendir(path) : NULL;
	if (d == NULL)
		return;
	c->all = 0;
	for (struct dirent *e; (e = readdir(d)) != NULL;) {
		if (e->d_name[0] == '.')
			continue;
		double t = thread_cpu(pid, e->d_name, name);
		if (t < 0)
			continue;
		if (atoi(e->d_name) == pid)
			snprintf(name, sizeof(name), "loop");
		c->all += t;
		int i = 0;
		while (i < c->n && strcmp(c->name[i], name) != 0)
			i++;
		if (i == c->n && c->n == CPU_NAMES)
			continue;
		if (i == c->n)
			snprintf(c->name[c->n++], 16, "%s", name);
		c->s[i] += t;
	}
	closedir(d);
}

/* The cores each of gpxd's threads took between a and z, secs apart: "loop 0.70, gpu0 0.21". */
static void
cpu_split(const struct dcpu *a, const struct dcpu *z, double secs, char *out, size_t len)
{
	size_t at = 0;

	out[0] = '\0';
	for (int i = 0; i < z->n && at < len; i++) {
		double was = 0;
		for (int k = 0; k < a->n; k++)
			if (strcmp(a->name[k], z->name[i]) == 0)
				was = a->s[k];
		double cores = (z->s[i] - was) / secs;
		if (cores < 0.005)
			continue;
		const char *n = strncmp(z->name[i], "gpxd-", 5) == 0 ? z->name[i] + 5 : z->name[i];
		at += snprintf(out + at, len - at, "%s%s %.2f", at ? ", " : "", n, cores);
	}
	if (at == 0)
		snprintf(out, len, "none over 0.005");
}

enum { IDLE_BACK, IDLE_AFTER_WORK, IDLE_AFTER_SLEEP, IDLE_DURING_WORK };

/* Median of `iters` requests, each after `how`; with cpu, gpxd's CPU share meanwhile (and by thread). */
static double
idle_measure(struct idle *o, int how, int iters, double *cpu, char *split, size_t splitlen)
{
	static double t[200];
	struct timespec ms = { 0, 1000000 };
	struct dcpu c0, c1;
	double w0;

	if (cpu)
		daemon_cpu(o->pid, &c0);
	w0 = bench_now();

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
	if (cpu) {
		const double w = bench_now() - w0;
		daemon_cpu(o->pid, &c1);
		*cpu = c0.all < 0 || c1.all < 0 ? -1 : (c1.all - c0.all) / w;
		cpu_split(&c0, &c1, w, split, splitlen);
	}
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
	struct idle o = { .b = b, .src = &a, .dst = &z, .work = &w, .sp = sp, .dp = dp, .pid = daemon_pid(b) };
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
	char busy_split[256] = "", idle_split[256] = "";
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
		double back = idle_measure(&o, IDLE_BACK, 60, NULL, NULL, 0);
		static const char *names[] = { "", "after 1 ms of its GPU work", "after 1 ms of nothing",
			"while 1 ms of its GPU work runs" };
		for (int how = IDLE_AFTER_WORK; how <= IDLE_DURING_WORK; how++) {
			double t = idle_measure(&o, how, 60, NULL, NULL, 0);
			if (back < 0 || t < 0)
				return bench_fail(b, -GPX_EIO, "a page request");
			snprintf(what, sizeof(what), "%zu x %zu KiB, %s", o.n, o.page / 1024, names[how]);
			bench_gpu_row_t(b, what, "GB/s", o.n * o.page / back / 1e9, o.n * o.page / t / 1e9, false,
			    o.n * o.page, how == IDLE_AFTER_WORK ? "gpu.idle.after_work" : NULL);
		}
		/* gpxd's CPU while the first kind of request comes after each 1 ms of work: 200 of them,
		 * some 0.3 s, so that the clock's grain does not show */
		if (k == 0 && idle_measure(&o, IDLE_AFTER_WORK, 200, &cpu_busy, busy_split, sizeof(busy_split)) < 0)
			return bench_fail(b, -GPX_EIO, "a page request");
	}
	/* And once nothing comes any more: what gpxd costs idle. */
	struct timespec settle = { 0, 100000000 };
	nanosleep(&settle, NULL);
	struct dcpu c0, c1;
	daemon_cpu(o.pid, &c0);
	const double i0 = bench_now();
	sleep(1);
	daemon_cpu(o.pid, &c1);
	const double iw = bench_now() - i0, idle = c0.all < 0 || c1.all < 0 ? -1 : (c1.all - c0.all) / iw;
	cpu_split(&c0, &c1, iw, idle_split, sizeof(idle_split));
	char note[1024], vb[128], vi[128];
	bench_verdict("gpxd.cpu_busy", cpu_busy / (dd ? 2 : 1), vb, sizeof(vb));
	bench_verdict("gpxd.cpu_idle", idle, vi, sizeof(vi));
	snprintf(note, sizeof(note), "gpxd's CPU: %.2f cores while a request came every ~1 ms (%d GPU%s), %.3f "
	    "cores idle (client work: %.2f ms of memset)\n  by thread, busy: %s; idle: %s\n  %s\n  %s", cpu_busy,
	    dd ? 2 : 1, dd ? "s" : "", idle, per * 1e3 * o.work_words / (w.len / 4.0), busy_split, idle_split, vb, vi);
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
