/*
 * gpx-bench's host mode: large contiguous copies between buffers of host memory.
 *
 *   host   contiguous copies between two registered memfd buffers, 4 KiB to 1 GiB: gpx GB/s
 *          (submit to completion seen here) against memcpy on as many threads as gpxd has
 *          copy workers (the strongest baseline: the ratio and the target are against it),
 *          and against memcpy on one thread
 *
 * Every size is first copied once through gpxd into a cleared buffer and compared byte for
 * byte with its source, before anything is timed.
 */
#include "config.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/bench.h"

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)
#define GiB (1ULL << 30)

/* Keeps the compiler from treating a copy nobody reads as dead. */
#define BARRIER() __asm__ __volatile__("" ::: "memory")

/* Below this many bytes a thread of the pool is not worth waking: fewer threads copy. */
#define PIECE_MIN (64 * KiB)

/*
 * memcpy on n threads, what a program without gpx would do with as many cores as gpxd's
 * workers: the caller and n - 1 threads that stay parked on a barrier between copies, each
 * copying one contiguous piece (4 KiB aligned) of the job.
 */
struct mcpool {
	pthread_t *tid;
	unsigned n;
	pthread_barrier_t go, done;
	unsigned char *dst;
	const unsigned char *src;
	uint64_t len;
	unsigned used;           /* threads with a piece of the current copy */
	bool quit;
};

static void
mcpool_piece(struct mcpool *m, unsigned i)
{
	uint64_t per = (m->len / m->used + 4095) & ~4095ULL;
	uint64_t off = per * i;

	if (i < m->used && off < m->len)
		memcpy(m->dst + off, m->src + off, m->len - off < per ? m->len - off : per);
	BARRIER();
}

struct mcthread {
	struct mcpool *m;
	unsigned i;
};

static void *
mcthread_main(void *arg)
{
	struct mcthread *t = arg;

	for (;;) {
		pthread_barrier_wait(&t->m->go);
		if (t->m->quit)
			break;
		mcpool_piece(t->m, t->i);
		pthread_barrier_wait(&t->m->done);
	}
	return NULL;
}

static struct mcthread mcthreads[256];

static int
mcpool_start(struct mcpool *m, unsigned n)
{
	memset(m, 0, sizeof(*m));
	m->n = n < 1 ? 1 : n > 256 ? 256 : n;
	if ((m->tid = calloc(m->n, sizeof(*m->tid))) == NULL ||
	    pthread_barrier_init(&m->go, NULL, m->n) != 0 || pthread_barrier_init(&m->done, NULL, m->n) != 0)
		return -1;
	for (unsigned i = 1; i < m->n; i++) {
		mcthreads[i] = (struct mcthread){ m, i };
		if (pthread_create(&m->tid[i], NULL, mcthread_main, &mcthreads[i]) != 0)
			return -1;
	}
	return 0;
}

/* One copy of len bytes on the pool; the caller copies the first piece. */
static void
mcpool_copy(struct mcpool *m, void *dst, const void *src, uint64_t len)
{
	m->dst = dst;
	m->src = src;
	m->len = len;
	m->used = len / PIECE_MIN < m->n ? (unsigned)(len / PIECE_MIN) : m->n;
	if (m->used <= 1) {
		memcpy(dst, src, len);
		BARRIER();
		return;
	}
	if (m->n > 1)
		pthread_barrier_wait(&m->go);
	mcpool_piece(m, 0);
	if (m->n > 1)
		pthread_barrier_wait(&m->done);
}

static void
mcpool_stop(struct mcpool *m)
{
	if (m->n > 1) {
		m->quit = true;
		pthread_barrier_wait(&m->go);
		for (unsigned i = 1; i < m->n; i++)
			pthread_join(m->tid[i], NULL);
	}
	pthread_barrier_destroy(&m->go);
	pthread_barrier_destroy(&m->done);
	free(m->tid);
}

struct host_arg {
	struct bench_ctx *b;
	struct bench_buf *src, *dst;
	uint64_t len;
	struct mcpool *pool;
};

static int
host_threads(void *p)
{
	struct host_arg *a = p;

	mcpool_copy(a->pool, a->dst->ptr, a->src->ptr, a->len);
	return 0;
}

static int
host_direct(void *p)
{
	struct host_arg *a = p;

	memcpy(a->dst->ptr, a->src->ptr, a->len);
	BARRIER();
	return 0;
}

static int
host_gpx(void *p)
{
	struct host_arg *a = p;

	return gpx_copy_sync(a->b->conn, a->src->region, 0, a->dst->region, 0, a->len);
}

/* One brokered copy into a cleared destination, compared byte for byte with the source. */
static int
host_verify(struct host_arg *a)
{
	char s[32];
	int r;

	memset(a->dst->ptr, 0, a->len);
	if ((r = host_gpx(a)) < 0)
		return bench_fail(a->b, r, "gpx_copy_sync");
	if (memcmp(a->dst->ptr, a->src->ptr, a->len) != 0) {
		fprintf(stderr, "gpx-bench: host: a %s copy through gpxd did not arrive intact\n",
		    bench_size_str(a->len, s, sizeof(s)));
		return -1;
	}
	return 0;
}

static void
to_gbps(const double *secs, double *out, int n, uint64_t bytes)
{
	for (int i = 0; i < n; i++)
		out[i] = bytes / secs[i] / 1e9;
}

static int
mode_host(struct bench_ctx *b)
{
	static const uint64_t sizes[] = { 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB };
	struct bench_buf src = { .fd = -1 }, dst = { .fd = -1 };
	struct mcpool pool;
	uint64_t max = 0;
	double worst = INFINITY;
	unsigned n = b->workers > 0 ? b->workers : 1;
	char s[32], title[320], note[200], mn[32], m1[32];
	int ret = 0, r;

	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		if (sizes[i] <= b->max_size)
			max = sizes[i];
	if (max == 0) {
		bench_skip(b, "host", "--max-size is below 4 KiB");
		return BENCH_SKIP;
	}
	if (bench_buf_new(b, max, &src) < 0 || bench_buf_new(b, max, &dst) < 0) {
		bench_buf_free(b, &src);
		return -1;
	}
	if (mcpool_start(&pool, n) < 0) {
		bench_buf_free(b, &dst);
		bench_buf_free(b, &src);
		return bench_fail(b, -GPX_ENOMEM, "memcpy threads");
	}
	bench_fill(src.ptr, max, 1);
	snprintf(title, sizeof(title), "contiguous copies between two registered memfd buffers of %s "
	    "(GB/s = 10^9 B/s); direct = memcpy on %u thread%s, as many as gpxd's copy workers (each a "
	    "contiguous piece of >= %llu KiB), and on 1 thread", bench_size_str(max, s, sizeof(s)), n,
	    n == 1 ? "" : "s", PIECE_MIN / KiB);
	snprintf(mn, sizeof(mn), "GB/s, %u thr", n);
	snprintf(m1, sizeof(m1), "GB/s, 1 thr");
	bench_table_begin(b, "host", title);
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && sizes[i] <= max; i++) {
		struct host_arg a = { b, &src, &dst, sizes[i], &pool };
		struct bench_pair p, q;
		double dr[b->runs], gr[b->runs];

		if ((ret = host_verify(&a)) < 0)
			break;
		if ((r = bench_pair_measure(b, host_threads, host_gpx, &a, &p)) < 0) {
			ret = bench_fail(b, r, "host copy");
			break;
		}
		if ((r = bench_pair_measure(b, host_direct, host_threads, &a, &q)) < 0) {
			bench_pair_free(&p);
			ret = bench_fail(b, r, "memcpy");
			break;
		}
		to_gbps(p.direct_runs, dr, b->runs, sizes[i]);
		to_gbps(p.gpx_runs, gr, b->runs, sizes[i]);
		struct bench_row row = {
			.what = bench_size_str(sizes[i], s, sizeof(s)), .metric = mn,
			.direct = sizes[i] / p.direct / 1e9, .gpx = sizes[i] / p.gpx / 1e9,
			.bytes = sizes[i], .direct_runs = dr, .gpx_runs = gr, .nruns = b->runs,
			.target = sizes[i] >= 64 * MiB ? "host.large" : NULL,
		};
		bench_table_row(b, &row);
		if (sizes[i] >= 64 * MiB && row.gpx / row.direct < worst)
			worst = row.gpx / row.direct;
		struct bench_row one = {
			.what = row.what, .metric = m1, .direct = sizes[i] / q.direct / 1e9, .gpx = row.gpx,
			.bytes = sizes[i],
		};
		bench_table_row(b, &one);
		bench_pair_free(&p);
		bench_pair_free(&q);
	}
	bench_verdict("host.large", ret == 0 ? worst : NAN, note, sizeof(note));
	bench_table_end(b, note);
	mcpool_stop(&pool);
	bench_buf_free(b, &dst);
	bench_buf_free(b, &src);
	return ret;
}

static const struct bench_mode host_modes[] = {
	{ "host", "contiguous host copies 4 KiB .. 1 GiB: gpx vs memcpy on gpxd's thread count and on one", mode_host },
};
BENCH_MODES(host_modes)
