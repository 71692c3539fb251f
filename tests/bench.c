/*
 * gpx-bench's shared helpers (tests/bench.h), the part every mode calls while it measures: the
 * mode registry, timing and statistics, the side-by-side measurement loop, sizes as text and
 * from the command line, and host buffers registered with the daemon.  The tables the modes
 * print are in tests/bench-out.c, the private gpxd of --spawn in tests/bench-daemon.c.
 */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tests/bench.h"

/* ---- mode registry ---- */

#define BENCH_MAX_MODES 64

static const struct bench_mode *modes[BENCH_MAX_MODES];
static size_t nmodes;

void
bench_register(const struct bench_mode *m, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (nmodes == BENCH_MAX_MODES) {
			fprintf(stderr, "gpx-bench: more than %d modes; mode %s left out\n",
			    BENCH_MAX_MODES, m[i].name);
			continue;
		}
		modes[nmodes++] = &m[i];
	}
}

size_t
bench_mode_count(void)
{
	return nmodes;
}

const struct bench_mode *
bench_mode_at(size_t i)
{
	return i < nmodes ? modes[i] : NULL;
}

const struct bench_mode *
bench_mode_find(const char *name)
{
	for (size_t i = 0; i < nmodes; i++)
		if (strcmp(modes[i]->name, name) == 0)
			return modes[i];
	return NULL;
}

/* ---- time and statistics ---- */

double
bench_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint64_t
bench_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}

int
bench_cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

double
bench_percentile(double *v, size_t n, double p)
{
	if (n == 0)
		return NAN;
	qsort(v, n, sizeof(*v), bench_cmp_double);
	/* Nearest rank: the smallest value with at least p% of the samples at or below it. */
	size_t k = (size_t)ceil(p / 100.0 * n);
	return v[k > 0 ? k - 1 : 0];
}

double
bench_median(double *v, size_t n)
{
	if (n == 0)
		return NAN;
	qsort(v, n, sizeof(*v), bench_cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- side-by-side measurement ---- */

static int
run_n(bench_op op, void *arg, uint64_t n, double *secs)
{
	double t0 = bench_now();
	int r;

	for (uint64_t i = 0; i < n; i++)
		if ((r = op(arg)) < 0)
			return r;
	*secs = bench_now() - t0;
	return 0;
}

/* Warms op up and finds how many calls make a run of at least min_time. */
static int
calibrate(bench_op op, void *arg, double min_time, uint64_t *iters)
{
	uint64_t n = 1;
	double t;
	int r;

	for (;;) {
		if ((r = run_n(op, arg, n, &t)) < 0)
			return r;
		if (t >= min_time)
			break;
		double want = t > 0 ? n * min_time * 1.2 / t : n * 16.0;
		n = want > n * 16.0 ? n * 16 : (uint64_t)want + 1;
	}
	*iters = n;
	return 0;
}

int
bench_pair_measure(struct bench_ctx *b, bench_op direct, bench_op brokered, void *arg,
    struct bench_pair *out)
{
	int r;

	memset(out, 0, sizeof(*out));
	out->direct_runs = calloc(b->runs, sizeof(double));
	out->gpx_runs = calloc(b->runs, sizeof(double));
	if (out->direct_runs == NULL || out->gpx_runs == NULL) {
		bench_pair_free(out);
		return -GPX_ENOMEM;
	}
	if ((r = calibrate(direct, arg, b->min_time, &out->direct_iters)) < 0 ||
	    (r = calibrate(brokered, arg, b->min_time, &out->gpx_iters)) < 0)
		goto fail;
	for (int i = 0; i < b->runs; i++) {
		double t;
		if ((r = run_n(direct, arg, out->direct_iters, &t)) < 0)
			goto fail;
		out->direct_runs[i] = t / out->direct_iters;
		if ((r = run_n(brokered, arg, out->gpx_iters, &t)) < 0)
			goto fail;
		out->gpx_runs[i] = t / out->gpx_iters;
	}
	out->direct = bench_median(out->direct_runs, b->runs);
	out->gpx = bench_median(out->gpx_runs, b->runs);
	return 0;
fail:
	bench_pair_free(out);
	return r;
}

void
bench_pair_free(struct bench_pair *p)
{
	free(p->direct_runs);
	free(p->gpx_runs);
	p->direct_runs = p->gpx_runs = NULL;
}

/* ---- sizes ---- */

const char *
bench_size_str(uint64_t n, char *buf, size_t len)
{
	static const char *u[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	int i = 0;
	double v = n;

	while (v >= 1024 && i < 4) {
		v /= 1024;
		i++;
	}
	if (v == (double)(uint64_t)v)
		snprintf(buf, len, "%llu %s", (unsigned long long)v, u[i]);
	else
		snprintf(buf, len, "%.1f %s", v, u[i]);
	return buf;
}

int
bench_parse_size(const char *s, uint64_t *out)
{
	char *end;
	unsigned long long n;
	int shift = 0;

	errno = 0;
	if (*s == '-' || *s == '\0')
		return -1;
	n = strtoull(s, &end, 10);
	if (errno != 0 || end == s)
		return -1;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	}
	if (*end == 'i' && shift)
		end++;
	if (*end == 'B' || *end == 'b')
		end++;
	if (*end != '\0' || (shift && n > (~0ULL >> shift)))
		return -1;
	*out = (uint64_t)n << shift;
	return 0;
}

/* ---- buffers ---- */

void
bench_fill(void *p, size_t len, uint64_t seed)
{
	uint64_t *w = p;
	size_t n = len / 8;

	for (size_t i = 0; i < n; i++)
		w[i] = ((uint64_t)i + seed) * 0x9e3779b97f4a7c15ULL ^ seed;
	for (size_t i = n * 8; i < len; i++)
		((unsigned char *)p)[i] = (unsigned char)(i ^ seed);
}

int
bench_fail(struct bench_ctx *b, int err, const char *what)
{
	const char *detail = b->conn ? gpx_last_error(b->conn) : "";

	fprintf(stderr, "gpx-bench: %s: %s%s%s\n", what, gpx_strerror(err),
	    detail[0] && strcmp(detail, gpx_strerror(err)) ? ": " : "", detail);
	return -1;
}

int
bench_buf_new(struct bench_ctx *b, size_t len, struct bench_buf *out)
{
	int r;

	out->fd = -1;
	out->ptr = NULL;
	out->len = len;
	if ((r = gpx_host_alloc(len, &out->fd, (void **)&out->ptr)) < 0)
		return bench_fail(b, r, "gpx_host_alloc");
	/* Fault every page in now, so that no timed copy pays for first touches. */
	memset(out->ptr, 0, len);
	if ((r = gpx_register_host(b->conn, out->fd, 0, len, 0, &out->region)) < 0) {
		gpx_host_free(out->fd, out->ptr, len);
		out->fd = -1;
		out->ptr = NULL;
		return bench_fail(b, r, "gpx_register_host");
	}
	return 0;
}

void
bench_buf_free(struct bench_ctx *b, struct bench_buf *buf)
{
	if (buf->ptr == NULL)
		return;
	gpx_deregister(b->conn, buf->region);
	gpx_host_free(buf->fd, buf->ptr, buf->len);
	buf->ptr = NULL;
	buf->fd = -1;
}
