/*
 * gpx-bench's host mode: large contiguous copies between buffers of host memory.
 *
 *   host   contiguous copies between two registered memfd buffers, 4 KiB to 1 GiB:
 *          memcpy GB/s against gpx GB/s (submit to completion seen here)
 *
 * Every size is first copied once through gpxd into a cleared buffer and compared byte for
 * byte with its source, before anything is timed.
 */
#include "config.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tests/bench.h"

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)
#define GiB (1ULL << 30)

/* Keeps the compiler from treating a copy nobody reads as dead. */
#define BARRIER() __asm__ __volatile__("" ::: "memory")

struct host_arg {
	struct bench_ctx *b;
	struct bench_buf *src, *dst;
	uint64_t len;
};

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
	uint64_t max = 0;
	double worst = INFINITY;
	char s[32], title[160], note[200];
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
	bench_fill(src.ptr, max, 1);
	snprintf(title, sizeof(title), "contiguous copies between two registered memfd buffers of %s "
	    "(GB/s = 10^9 B/s)", bench_size_str(max, s, sizeof(s)));
	bench_table_begin(b, "host", title);
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && sizes[i] <= max; i++) {
		struct host_arg a = { b, &src, &dst, sizes[i] };
		struct bench_pair p;
		double dr[b->runs], gr[b->runs];

		if ((ret = host_verify(&a)) < 0)
			break;
		if ((r = bench_pair_measure(b, host_direct, host_gpx, &a, &p)) < 0) {
			ret = bench_fail(b, r, "host copy");
			break;
		}
		to_gbps(p.direct_runs, dr, b->runs, sizes[i]);
		to_gbps(p.gpx_runs, gr, b->runs, sizes[i]);
		struct bench_row row = {
			.what = bench_size_str(sizes[i], s, sizeof(s)), .metric = "GB/s",
			.direct = sizes[i] / p.direct / 1e9, .gpx = sizes[i] / p.gpx / 1e9,
			.bytes = sizes[i], .direct_runs = dr, .gpx_runs = gr, .nruns = b->runs,
		};
		bench_table_row(b, &row);
		if (sizes[i] >= 64 * MiB && row.gpx / row.direct < worst)
			worst = row.gpx / row.direct;
		bench_pair_free(&p);
	}
	if (ret == 0 && isfinite(worst))
		snprintf(note, sizeof(note), "target gpx >= 0.90x direct at >= 64 MiB: %s (lowest %.2fx)",
		    worst >= 0.9 ? "met" : "NOT met", worst);
	else
		snprintf(note, sizeof(note), "target gpx >= 0.90x direct at >= 64 MiB: not measured "
		    "(--max-size %s)", bench_size_str(b->max_size, s, sizeof(s)));
	bench_table_end(b, note);
	bench_buf_free(b, &dst);
	bench_buf_free(b, &src);
	return ret;
}

static const struct bench_mode host_modes[] = {
	{ "host", "contiguous host copies 4 KiB .. 1 GiB: memcpy vs gpx GB/s", mode_host },
};
BENCH_MODES(host_modes)
