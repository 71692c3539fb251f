/*
 * gpx-bench's small-transfer modes: host memory moved 4 KiB at a time, one copy after another,
 * pipelined, or many scattered pages in one vectored request, and the CPU work such a request
 * costs before its first byte moves.
 *
 *   small  4 KiB transfers: rate and p50/p99 latency one at a time (blocking on the eventfd,
 *          and polling the completion ring) and pipelined; vectored requests of 1,024 and
 *          65,536 scattered 4 KiB segments
 *   segs   the CPU work of one vectored request of 1,024 and 65,536 scattered 4 KiB segments,
 *          before its first byte moves and until it completes
 */
#include "config.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/bench.h"

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)

/* Keeps the compiler from treating a copy nobody reads as dead. */
#define BARRIER() __asm__ __volatile__("" ::: "memory")

/* ==== small: 4 KiB transfers, one at a time, pipelined, vectored ==== */

#define PAGE (4 * KiB)
#define WINDOW (16 * MiB)       /* single copies cycle through this many bytes of the buffers */

struct small_arg {
	struct bench_ctx *b;
	struct bench_buf *src, *dst;
	uint64_t slots;             /* 4 KiB slots in the window */
	uint64_t next;              /* slot of the next single copy */
	struct gpx_seg *segs;       /* vectored requests */
	size_t nseg;
};

static int
one_direct(void *p)
{
	struct small_arg *a = p;
	uint64_t off = (a->next++ % a->slots) * PAGE;

	memcpy(a->dst->ptr + off, a->src->ptr + off, PAGE);
	BARRIER();
	return 0;
}

static int
one_blocking(void *p)
{
	struct small_arg *a = p;
	uint64_t off = (a->next++ % a->slots) * PAGE;

	return gpx_copy_sync(a->b->conn, a->src->region, off, a->dst->region, off, PAGE);
}

/* Submits, then spins on the completion ring instead of sleeping on the eventfd. */
static int
one_polling(void *p)
{
	struct small_arg *a = p;
	uint64_t off = (a->next++ % a->slots) * PAGE;
	struct gpx_completion c;
	int r;

	if ((r = gpx_copy(a->b->conn, a->src->region, off, a->dst->region, off, PAGE, 1)) < 0)
		return r;
	while ((r = gpx_poll(a->b->conn, &c, 1)) == 0)
		;
	if (r < 0)
		return r;
	return c.status;
}

static int
vec_direct(void *p)
{
	struct small_arg *a = p;

	for (size_t i = 0; i < a->nseg; i++)
		memcpy(a->dst->ptr + a->segs[i].dst_offset, a->src->ptr + a->segs[i].src_offset,
		    a->segs[i].length);
	BARRIER();
	return 0;
}

static int
vec_gpx(void *p)
{
	struct small_arg *a = p;
	struct gpx_completion c;
	int r;

	if ((r = gpx_copyv(a->b->conn, a->src->region, a->dst->region, a->segs, a->nseg, 2)) < 0 ||
	    (r = gpx_wait_tag(a->b->conn, 2, &c, -1)) < 0)
		return r;
	return c.status;
}

/* Latency samples of one kind of operation, pooled over the runs, and its rate per run. */
struct lat {
	double *v;
	size_t n, cap;
	double *rate;
};

static int
lat_init(struct lat *l, size_t cap, int runs)
{
	l->n = 0;
	l->cap = cap;
	l->v = malloc(cap * sizeof(double));
	l->rate = calloc(runs, sizeof(double));
	return l->v && l->rate ? 0 : -GPX_ENOMEM;
}

static void
lat_free(struct lat *l)
{
	free(l->v);
	free(l->rate);
}

/* Times each call of op for secs seconds or max_ops calls, whichever comes first. */
static int
lat_sample(bench_op op, void *arg, double secs, uint64_t max_ops, struct lat *l, int run)
{
	double t0 = bench_now(), t;
	uint64_t k = 0;
	int r;

	do {
		uint64_t a = bench_now_ns();
		if ((r = op(arg)) < 0)
			return r;
		uint64_t z = bench_now_ns();
		if (l->n < l->cap)
			l->v[l->n++] = (z - a) * 1e-9;
		t = bench_now();
	} while (++k < max_ops && t - t0 < secs);
	l->rate[run] = k / (t - t0);
	return 0;
}

static void
lat_rows(struct bench_ctx *b, const char *what, double direct_rate, struct lat *d, struct lat *g)
{
	double grate = bench_median(g->rate, b->runs);
	struct bench_row rate = { .what = what, .metric = "transfers/s", .direct = direct_rate,
	    .gpx = grate, .bytes = PAGE };
	struct bench_row p50 = { .what = what, .metric = "p50 latency us", .lower_is_better = true,
	    .direct = d ? bench_percentile(d->v, d->n, 50) * 1e6 : NAN,
	    .gpx = bench_percentile(g->v, g->n, 50) * 1e6, .bytes = PAGE };
	struct bench_row p99 = { .what = what, .metric = "p99 latency us", .lower_is_better = true,
	    .direct = d ? bench_percentile(d->v, d->n, 99) * 1e6 : NAN,
	    .gpx = bench_percentile(g->v, g->n, 99) * 1e6, .bytes = PAGE };

	bench_table_row(b, &rate);
	bench_table_row(b, &p50);
	bench_table_row(b, &p99);
}

/*
 * Pipelined: keeps b->depth copies outstanding for b->min_time, reaping with gpx_poll and
 * sleeping in gpx_wait only when nothing is ready.  Each tag is a slot that remembers its
 * submit time, so latency is submit -> completion seen here, under load.
 */
static int
pipelined(struct small_arg *a, struct lat *l, int run)
{
	struct bench_ctx *b = a->b;
	unsigned depth = b->depth;
	uint64_t *t_sub = calloc(depth, sizeof(*t_sub));
	uint32_t *free_slots = malloc(depth * sizeof(*free_slots));
	struct gpx_completion c[64];
	unsigned nfree = depth;
	uint64_t done = 0;
	double t0 = bench_now(), end = t0 + b->min_time;
	int r = 0;

	if (t_sub == NULL || free_slots == NULL) {
		free(t_sub);
		free(free_slots);
		return -GPX_ENOMEM;
	}
	for (unsigned i = 0; i < depth; i++)
		free_slots[i] = i;
	while (nfree < depth || bench_now() < end) {
		while (nfree > 0 && bench_now() < end) {
			uint32_t slot = free_slots[nfree - 1];
			uint64_t off = (a->next++ % a->slots) * PAGE;
			t_sub[slot] = bench_now_ns();
			r = gpx_copy(b->conn, a->src->region, off, a->dst->region, off, PAGE, slot);
			if (r == -GPX_EBUSY)
				break;
			if (r < 0)
				goto out;
			nfree--;
		}
		int n = gpx_poll(b->conn, c, 64);
		if (n == 0 && nfree < depth)
			n = gpx_wait(b->conn, c, 64, 1000);
		if (n < 0) {
			r = n;
			goto out;
		}
		uint64_t now = bench_now_ns();
		for (int i = 0; i < n; i++) {
			if (c[i].tag >= depth || (c[i].status < 0 && c[i].status != -GPX_EBUSY)) {
				r = c[i].status < 0 ? c[i].status : -GPX_EPROTO;
				goto out;
			}
			free_slots[nfree++] = (uint32_t)c[i].tag;
			if (c[i].status == -GPX_EBUSY)
				continue;       /* refused for lack of credit: the slot is simply reused */
			if (l->n < l->cap)
				l->v[l->n++] = (now - t_sub[c[i].tag]) * 1e-9;
			done++;
		}
	}
	l->rate[run] = done / (bench_now() - t0);
	r = 0;
out:
	free(t_sub);
	free(free_slots);
	return r;
}

static uint64_t
xorshift(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/* A random permutation of 0..n-1 (fixed seed: the same pattern every run). */
static void
shuffle(uint32_t *v, size_t n, uint64_t seed)
{
	for (size_t i = 0; i < n; i++)
		v[i] = i;
	for (size_t i = n - 1; i > 0; i--) {
		size_t j = xorshift(&seed) % (i + 1);
		uint32_t t = v[i];
		v[i] = v[j];
		v[j] = t;
	}
}

static int
vectored(struct small_arg *a, size_t nseg)
{
	struct bench_ctx *b = a->b;
	uint32_t *ps = malloc(nseg * sizeof(*ps)), *pd = malloc(nseg * sizeof(*pd));
	struct bench_pair p;
	char what[64];
	int r = -1;

	a->segs = malloc(nseg * sizeof(*a->segs));
	a->nseg = nseg;
	if (ps == NULL || pd == NULL || a->segs == NULL) {
		bench_fail(b, -GPX_ENOMEM, "segment list");
		goto out;
	}
	shuffle(ps, nseg, 0x1234567 + nseg);
	shuffle(pd, nseg, 0x7654321 + nseg);
	for (size_t i = 0; i < nseg; i++)
		a->segs[i] = (struct gpx_seg){ ps[i] * PAGE, pd[i] * PAGE, PAGE };

	memset(a->dst->ptr, 0, nseg * PAGE);
	if ((r = vec_gpx(a)) < 0) {
		r = bench_fail(b, r, "gpx_copyv");
		goto out;
	}
	for (size_t i = 0; i < nseg; i++)
		if (memcmp(a->dst->ptr + a->segs[i].dst_offset, a->src->ptr + a->segs[i].src_offset,
		    PAGE) != 0) {
			fprintf(stderr, "gpx-bench: small: segment %zu of a vectored copy through gpxd did "
			    "not arrive intact\n", i);
			r = -1;
			goto out;
		}
	if ((r = bench_pair_measure(b, vec_direct, vec_gpx, a, &p)) < 0) {
		r = bench_fail(b, r, "vectored copy");
		goto out;
	}
	snprintf(what, sizeof(what), "%zu x 4 KiB scattered, one request", nseg);
	struct bench_row rows[] = {
		{ .what = what, .metric = "segments/s", .direct = nseg / p.direct, .gpx = nseg / p.gpx,
		    .bytes = nseg * PAGE },
		{ .what = what, .metric = "GB/s", .direct = nseg * PAGE / p.direct / 1e9,
		    .gpx = nseg * PAGE / p.gpx / 1e9, .bytes = nseg * PAGE },
		{ .what = what, .metric = "us/request", .direct = p.direct * 1e6, .gpx = p.gpx * 1e6,
		    .lower_is_better = true, .bytes = nseg * PAGE },
	};
	for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
		bench_table_row(b, &rows[i]);
	bench_pair_free(&p);
	r = 0;
out:
	free(ps);
	free(pd);
	free(a->segs);
	a->segs = NULL;
	return r;
}

static int
mode_small(struct bench_ctx *b)
{
	static const size_t vec_counts[] = { 1024, 65536 };
	struct bench_buf src = { .fd = -1 }, dst = { .fd = -1 };
	uint64_t len = b->max_size < 256 * MiB ? b->max_size & ~(PAGE - 1) : 256 * MiB;
	struct lat ld = { 0 }, lb = { 0 }, lp = { 0 }, lq = { 0 };
	struct bench_pair p = { 0 };
	char what[64], s[32];
	int ret = -1, r;

	if (len < PAGE) {
		bench_skip(b, "small", "--max-size is below 4 KiB");
		return BENCH_SKIP;
	}
	if (bench_buf_new(b, len, &src) < 0 || bench_buf_new(b, len, &dst) < 0) {
		bench_buf_free(b, &src);
		return -1;
	}
	bench_fill(src.ptr, len, 2);
	struct small_arg a = { .b = b, .src = &src, .dst = &dst,
	    .slots = (len < WINDOW ? len : WINDOW) / PAGE };

	/* One copy first, checked, before anything is timed. */
	memset(dst.ptr, 0, PAGE);
	if ((r = one_blocking(&a)) < 0) {
		bench_fail(b, r, "gpx_copy_sync");
		goto out;
	}
	if (memcmp(dst.ptr, src.ptr, PAGE) != 0) {
		fprintf(stderr, "gpx-bench: small: a 4 KiB copy through gpxd did not arrive intact\n");
		goto out;
	}
	snprintf(what, sizeof(what), "4 KiB transfers; buffers of %s", bench_size_str(len, s, sizeof(s)));
	bench_table_begin(b, "small", what);

	/* Rates without a clock read per call: memcpy against gpx_copy_sync. */
	if ((r = bench_pair_measure(b, one_direct, one_blocking, &a, &p)) < 0) {
		bench_fail(b, r, "4 KiB copies");
		goto out_table;
	}
	/* Latencies: every call timed; the kinds alternate run by run. */
	size_t cap = 1 << 20;
	if (lat_init(&ld, cap, b->runs) < 0 || lat_init(&lb, cap, b->runs) < 0 ||
	    lat_init(&lp, cap, b->runs) < 0 || lat_init(&lq, cap, b->runs) < 0) {
		bench_fail(b, -GPX_ENOMEM, "latency samples");
		goto out_table;
	}
	for (int run = 0; run < b->runs; run++) {
		if ((r = lat_sample(one_direct, &a, b->min_time, 100000, &ld, run)) < 0 ||
		    (r = lat_sample(one_blocking, &a, b->min_time, UINT64_MAX, &lb, run)) < 0 ||
		    (r = lat_sample(one_polling, &a, b->min_time, UINT64_MAX, &lp, run)) < 0 ||
		    (r = pipelined(&a, &lq, run)) < 0) {
			bench_fail(b, r, "4 KiB copies");
			goto out_table;
		}
	}
	lat_rows(b, "one at a time, blocking", 1 / p.direct, &ld, &lb);
	lat_rows(b, "one at a time, polling the ring", 1 / p.direct, &ld, &lp);
	snprintf(what, sizeof(what), "pipelined, %u outstanding", b->depth);
	lat_rows(b, what, 1 / p.direct, NULL, &lq);

	ret = 0;
	for (size_t i = 0; i < sizeof(vec_counts) / sizeof(vec_counts[0]); i++) {
		if (vec_counts[i] * PAGE > len) {
			fprintf(stderr, "gpx-bench: small: %zu segments need buffers of %s; raise --max-size\n",
			    vec_counts[i], bench_size_str(vec_counts[i] * PAGE, s, sizeof(s)));
			continue;
		}
		if ((ret = vectored(&a, vec_counts[i])) < 0)
			break;
	}
out_table:
	bench_table_end(b, "direct = memcpy of the same 4 KiB segments in this process; latencies "
	    "include two clock reads");
out:
	bench_pair_free(&p);
	lat_free(&ld);
	lat_free(&lb);
	lat_free(&lp);
	lat_free(&lq);
	bench_buf_free(b, &dst);
	bench_buf_free(b, &src);
	return ret;
}

/*
 * ==== segs: the CPU work of one vectored request before its first byte moves ====
 *
 * Every segment of a request is checked before any of it is copied, so for scattered pages the
 * client's and the daemon's work per segment stands in front of the copy (on a GPU, in front of
 * the copy kernel).  Requests are timed from their start to three points: gpx_copyv returned
 * (the list is in the segment area and the request sent); the first byte of the first segment
 * arrived (the daemon took the list, checked it and made the job: this client watches a word of
 * that page, set to something else before); the completion seen.  The same list with every
 * length 0 moves nothing, so its whole request is that CPU work alone, without copy threads
 * competing for the cores.
 */
struct segs_arg {
	struct bench_ctx *b;
	struct bench_buf *src, *dst;
	struct gpx_seg *segs;
	uint32_t *ps, *pd;          /* the pages the list names, for building it per request */
	size_t nseg;
};

/* Stage times of one kind of request, pooled over the runs; microseconds. */
struct stages {
	double *submit, *first, *done;
	size_t n, cap;
};

enum segs_kind { SEGS_PREPARED, SEGS_BUILT, SEGS_IN_PLACE, SEGS_KINDS };

/* The list as an application makes it for each request: pages from its own tables. */
static void
segs_build(const struct segs_arg *a, struct gpx_seg *out, uint64_t len)
{
	for (size_t i = 0; i < a->nseg; i++)
		out[i] = (struct gpx_seg){ a->ps[i] * PAGE, a->pd[i] * PAGE, len };
}

/*
 * One request of segments of len bytes (0 or PAGE), timed.  Its list was made before, or is
 * made in the request into memory of this process, or into the segment area (gpx_segs_reserve).
 */
static int
segs_one(struct segs_arg *a, enum segs_kind kind, uint64_t len, struct stages *st)
{
	volatile uint64_t *first = (volatile uint64_t *)(a->dst->ptr + a->pd[0] * PAGE);
	const uint64_t want = *(const uint64_t *)(a->src->ptr + a->ps[0] * PAGE);
	struct gpx_seg *list = a->segs;
	struct gpx_completion c;
	int r;

	*first = len > 0 ? ~want : want;
	uint64_t t0 = bench_now_ns();
	if (kind == SEGS_IN_PLACE && (r = gpx_segs_reserve(a->b->conn, a->nseg, &list)) < 0)
		return r;
	if (kind != SEGS_PREPARED)
		segs_build(a, list, len);
	if ((r = gpx_copyv(a->b->conn, a->src->region, a->dst->region, list, a->nseg, 3)) < 0)
		return r;
	uint64_t t1 = bench_now_ns();
	/* Yielding: on a small machine the daemon's threads need this core too. */
	while (*first != want && bench_now_ns() - t1 < 5000000000ull)
		sched_yield();
	uint64_t t2 = bench_now_ns();
	if ((r = gpx_wait_tag(a->b->conn, 3, &c, -1)) < 0)
		return r;
	if (c.status < 0)
		return c.status;
	uint64_t t3 = bench_now_ns();
	if (*first != want)
		return -GPX_EIO;
	if (st->n < st->cap) {
		st->submit[st->n] = (t1 - t0) / 1e3;
		st->first[st->n] = (t2 - t0) / 1e3;
		st->done[st->n] = (t3 - t0) / 1e3;
		st->n++;
	}
	return 0;
}

static int
segs_stages_init(struct stages *st, size_t cap)
{
	st->n = 0;
	st->cap = cap;
	st->submit = malloc(cap * sizeof(double));
	st->first = malloc(cap * sizeof(double));
	st->done = malloc(cap * sizeof(double));
	return st->submit && st->first && st->done ? 0 : -GPX_ENOMEM;
}

static void
segs_stages_free(struct stages *st)
{
	free(st->submit);
	free(st->first);
	free(st->done);
}

static int
segs_count(struct segs_arg *a, size_t nseg)
{
	static const char *how[SEGS_KINDS] = { "list prepared", "built per request", "built in the area" };
	struct bench_ctx *b = a->b;
	struct stages st[2][SEGS_KINDS] = { { { 0 } } };     /* [len > 0][kind] */
	struct bench_pair p = { 0 };
	char what[64];
	int r = -1;

	a->nseg = nseg;
	a->segs = malloc(nseg * sizeof(*a->segs));
	a->ps = malloc(nseg * sizeof(*a->ps));
	a->pd = malloc(nseg * sizeof(*a->pd));
	for (int l = 0; l < 2; l++)
		for (int k = 0; k < SEGS_KINDS; k++)
			if (segs_stages_init(&st[l][k], 1 << 16) < 0)
				a->nseg = 0;
	if (a->segs == NULL || a->ps == NULL || a->pd == NULL || a->nseg == 0) {
		bench_fail(b, -GPX_ENOMEM, "segment list");
		goto out;
	}
	shuffle(a->ps, nseg, 0x1234567 + nseg);
	shuffle(a->pd, nseg, 0x7654321 + nseg);
	segs_build(a, a->segs, PAGE);
	/* The in-process copy of the same pages, for the whole request's row. */
	struct small_arg sa = { .b = b, .src = a->src, .dst = a->dst, .segs = a->segs, .nseg = nseg };
	if ((r = vec_gpx(&sa)) < 0 || (r = bench_pair_measure(b, vec_direct, vec_gpx, &sa, &p)) < 0) {
		r = bench_fail(b, r, "vectored copy");
		goto out;
	}
	for (int run = 0; run < b->runs; run++)
		for (int l = 1; l >= 0; l--)
			for (int k = 0; k < SEGS_KINDS; k++) {
				double t0 = bench_now();
				segs_build(a, a->segs, l ? PAGE : 0);
				do {
					if ((r = segs_one(a, k, l ? PAGE : 0, &st[l][k])) < 0) {
						r = bench_fail(b, r, "vectored copy");
						goto out;
					}
				} while (bench_now() - t0 < b->min_time);
			}
	for (int l = 1; l >= 0; l--)
		for (int k = 0; k < SEGS_KINDS; k++) {
			struct stages *s = &st[l][k];
			snprintf(what, sizeof(what), "%zu x %s, %s", nseg, l ? "4 KiB" : "0 B", how[k]);
			struct bench_row rows[] = {
				{ .what = what, .metric = "submit us", .direct = NAN,
				    .gpx = bench_median(s->submit, s->n), .lower_is_better = true },
				{ .what = what, .metric = "first byte us", .direct = NAN,
				    .gpx = bench_median(s->first, s->n), .lower_is_better = true },
				{ .what = what, .metric = "request us", .direct = l ? p.direct * 1e6 : NAN,
				    .gpx = bench_median(s->done, s->n), .lower_is_better = true,
				    .bytes = l ? nseg * PAGE : 0 },
			};
			for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
				if (l || i != 1)         /* nothing arrives from segments of 0 bytes */
					bench_table_row(b, &rows[i]);
		}
	r = 0;
out:
	bench_pair_free(&p);
	for (int l = 0; l < 2; l++)
		for (int k = 0; k < SEGS_KINDS; k++)
			segs_stages_free(&st[l][k]);
	free(a->segs);
	free(a->ps);
	free(a->pd);
	a->segs = NULL;
	a->ps = a->pd = NULL;
	return r;
}

static int
mode_segs(struct bench_ctx *b)
{
	static const size_t counts[] = { 1024, 65536 };
	struct bench_buf src = { .fd = -1 }, dst = { .fd = -1 };
	uint64_t len = b->max_size < 256 * MiB ? b->max_size & ~(PAGE - 1) : 256 * MiB;
	char s[32];
	int ret = 0;

	if (len < counts[0] * PAGE) {
		bench_skip(b, "segs", "--max-size is below 4 MiB");
		return BENCH_SKIP;
	}
	if (bench_buf_new(b, len, &src) < 0 || bench_buf_new(b, len, &dst) < 0) {
		bench_buf_free(b, &src);
		return -1;
	}
	bench_fill(src.ptr, len, 3);
	bench_table_begin(b, "segs", "the CPU work of one vectored request: microseconds from its "
	    "start (medians)");
	for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
		struct segs_arg a = { .b = b, .src = &src, .dst = &dst };
		if (counts[i] * PAGE > len) {
			fprintf(stderr, "gpx-bench: segs: %zu segments need buffers of %s; raise --max-size\n",
			    counts[i], bench_size_str(counts[i] * PAGE, s, sizeof(s)));
			continue;
		}
		if ((ret = segs_count(&a, counts[i])) < 0)
			break;
	}
	bench_table_end(b, "submit: gpx_copyv returned; first byte: the first segment's first word "
	    "arrived; request: completion seen (direct: memcpy of the same pages); built: the list made "
	    "from page tables in each request, in this process's memory or in the segment area "
	    "(gpx_segs_reserve); 0 B: the same lists with every length 0, so nothing moves");
	bench_buf_free(b, &dst);
	bench_buf_free(b, &src);
	return ret;
}

static const struct bench_mode small_modes[] = {
	{ "small", "4 KiB transfers: rate, p50/p99 latency, pipelined, vectored", mode_small },
	{ "segs", "the CPU work of a vectored request, 1,024 and 65,536 segments", mode_segs },
};
BENCH_MODES(small_modes)
