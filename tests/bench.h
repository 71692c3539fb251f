/*
 * gpx-bench's shared pieces: the mode registry, the settings every mode reads, timing and
 * statistics, the side-by-side measurement of a direct operation against the same operation
 * brokered by gpxd, the direct/gpx/ratio tables (text or JSON), host buffers registered with
 * the daemon, and a private gpxd started for the run.  tests/bench.c holds the registry, the
 * timing and the buffers, tests/bench-out.c the tables, tests/bench-daemon.c the private gpxd.
 *
 * A mode is a function that measures something twice in the same run, once done in-process
 * ("direct") and once through gpxd ("gpx"), and prints rows of both figures and their ratio.
 * Modes live in any file of gpx_bench_SOURCES and register themselves at load time:
 *
 *	static int run_p2p(struct bench_ctx *b) { ... }
 *	static const struct bench_mode gpu_modes[] = {
 *		{ "gpu-p2p", "GPU0 -> GPU1 copies: cuMemcpyPeerAsync vs gpx", run_p2p },
 *	};
 *	BENCH_MODES(gpu_modes)
 *
 * so adding a file of modes to Makefile.am is all it takes; gpx-bench.c does not change.
 */
#ifndef GPX_BENCH_H
#define GPX_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "client-lib/gpx.h"

#define BENCH_SKIP 77    /* a mode's return value: cannot run here (it said why with bench_skip) */

/* What every mode gets: the connection and the command line's settings. */
struct bench_ctx {
	gpx_conn *conn;          /* connected to the daemon under test */
	const char *socket;      /* its socket path */
	uint64_t max_size;       /* --max-size: largest buffer a mode allocates, bytes */
	int runs;                /* --runs: timed runs per figure; the median is reported */
	double min_time;         /* --min-time: seconds one timed run lasts at least */
	unsigned depth;          /* --depth: transfers kept outstanding in pipelined tests */
	bool json;               /* --json: machine-readable output */
	const char *daemon_settings;   /* --spawn: the settings given to its gpxd, for the header */
	unsigned workers;        /* gpxd's host copy workers, from its status (bench_header); 0 unknown */
};

struct bench_mode {
	const char *name;        /* as given on the command line */
	const char *help;        /* one line for --list */
	int (*fn)(struct bench_ctx *);   /* 0, BENCH_SKIP, or -1 after saying what failed */
};

void bench_register(const struct bench_mode *modes, size_t n);
size_t bench_mode_count(void);
const struct bench_mode *bench_mode_at(size_t i);
const struct bench_mode *bench_mode_find(const char *name);

/* Registers a file's array of modes before main() runs. */
#define BENCH_MODES(arr) \
	__attribute__((constructor)) static void bench_register_##arr(void) \
	{ bench_register(arr, sizeof(arr) / sizeof((arr)[0])); }

/* ---- time and statistics ---- */
double bench_now(void);                                  /* CLOCK_MONOTONIC, seconds */
uint64_t bench_now_ns(void);
double bench_median(double *v, size_t n);                 /* sorts v */
double bench_percentile(double *v, size_t n, double p);   /* sorts v; p in [0, 100] */
int bench_cmp_double(const void *a, const void *b);      /* qsort: doubles, ascending */

/* One unit of work to time; returns 0 or a negative GPX_E* code. */
typedef int (*bench_op)(void *arg);

/*
 * Measures direct and brokered side by side: each is warmed up and calibrated (iterations per
 * run so that a run lasts at least min_time), then b->runs timed runs alternate between the two,
 * so that whatever else the machine does weighs on both alike.  Results are seconds per call.
 */
struct bench_pair {
	double direct, gpx;          /* medians, seconds per call */
	double *direct_runs, *gpx_runs;   /* b->runs each, sorted; freed by bench_pair_free */
	uint64_t direct_iters, gpx_iters; /* calls per timed run */
};
int bench_pair_measure(struct bench_ctx *b, bench_op direct, bench_op brokered, void *arg,
    struct bench_pair *out);
void bench_pair_free(struct bench_pair *);

/* ---- output: a header, then per mode one table of direct / gpx / ratio rows ---- */
struct bench_row {
	const char *what;            /* "64 MiB", "one at a time (blocking)" */
	const char *metric;          /* "GB/s", "transfers/s", "p50 us" */
	double direct, gpx;          /* NAN where a side was not measured */
	bool lower_is_better;        /* latencies: the ratio is then direct / gpx */
	uint64_t bytes;              /* bytes per operation, 0 if not meaningful (JSON only) */
	const double *direct_runs, *gpx_runs;   /* optional per-run values (JSON only) */
	int nruns;
	const char *target;          /* id of its target in TARGETS.md, or NULL: met / NOT MET */
};
void bench_header(struct bench_ctx *b, const char *daemon_origin);
/* Whether CUDA clients of this process run under MPS (its control pipe exists); dir: where. */
bool bench_under_mps(char *dir, size_t len);
void bench_table_begin(struct bench_ctx *b, const char *mode, const char *title);
void bench_table_row(struct bench_ctx *b, const struct bench_row *row);
void bench_table_end(struct bench_ctx *b, const char *note);
void bench_skip(struct bench_ctx *b, const char *mode, const char *why);
void bench_footer(struct bench_ctx *b);

/* ---- targets: the rows of tests/results/TARGETS.md (tests/bench-targets.c) ---- */
struct bench_target {
	const char *id;              /* "host.large" */
	bool less;                   /* op "<=" (else ">=") */
	double value;
	const char *unit;            /* "x": a ratio to the baseline, as row ratios are; else gpx's unit */
	const char *what;            /* what is compared with what */
};
const struct bench_target *bench_target(const char *id);   /* NULL if the file has no such id */
/*
 * Writes "id: met (0.98x, target >= 0.97x)" or "id: NOT MET (...)" for the figure (a ratio for
 * a target in "x", else gpx's own figure in the target's unit); returns 1 met, 0 not met, -1
 * when there is no such target or the figure is not finite (and says so in buf).
 */
int bench_verdict(const char *id, double figure, char *buf, size_t len);

/* "4 KiB", "1 GiB": exact binary sizes print without decimals. */
const char *bench_size_str(uint64_t bytes, char *buf, size_t len);
/* "64M", "1G", "4096": returns 0 or -1. */
int bench_parse_size(const char *s, uint64_t *out);

/* ---- host buffers: a memfd from gpx_host_alloc, touched, registered ---- */
struct bench_buf {
	int fd;
	unsigned char *ptr;
	size_t len;
	gpx_region region;
};
int bench_buf_new(struct bench_ctx *b, size_t len, struct bench_buf *out);
void bench_buf_free(struct bench_ctx *b, struct bench_buf *);
/* Fills with a pattern that differs at every 8-byte word and from one seed to the next. */
void bench_fill(void *p, size_t len, uint64_t seed);

/* Prints what failed (and the daemon's explanation, if any) to stderr; returns -1. */
int bench_fail(struct bench_ctx *b, int err, const char *what);

/* ---- a private gpxd for --spawn ---- */
struct bench_daemon {
	pid_t pid;
	char dir[256];           /* the temporary directory holding the rest */
	char socket[300];
	char conf[300];
	char log[300];
};
/*
 * Starts gpxd (from $GPXD, next to this program, or PATH) with a configuration file of its own,
 * holding the n settings "section.key=value" (gpxd.conf(5)), and waits until it accepts.
 */
int bench_daemon_start(struct bench_daemon *d, const char *const *settings, size_t n);
/* SIGTERM, waits for the exit, removes the directory; prints the log if it did not stop cleanly. */
int bench_daemon_stop(struct bench_daemon *d);

#endif
