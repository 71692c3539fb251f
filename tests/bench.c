/*
 * gpx-bench's shared helpers (tests/bench.h): the mode registry, timing and statistics, the
 * side-by-side measurement loop, the text and JSON output of direct/gpx/ratio tables with the
 * machine and daemon description on top, registered host buffers, and the private gpxd that
 * --spawn starts on a socket in a temporary directory and stops at the end.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>

#include "proto/gpx.pb-c.h"
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

static int
cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

double
bench_percentile(double *v, size_t n, double p)
{
	if (n == 0)
		return NAN;
	qsort(v, n, sizeof(*v), cmp_double);
	/* Nearest rank: the smallest value with at least p% of the samples at or below it. */
	size_t k = (size_t)ceil(p / 100.0 * n);
	return v[k > 0 ? k - 1 : 0];
}

double
bench_median(double *v, size_t n)
{
	if (n == 0)
		return NAN;
	qsort(v, n, sizeof(*v), cmp_double);
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

/* ---- output ---- */

static bool json_first_mode = true, json_first_row = true;
static char last_what[128];     /* text tables print a row group's label once */

static void
json_str(const char *s)
{
	putchar('"');
	for (; s != NULL && *s; s++) {
		unsigned char ch = *s;
		if (ch == '"' || ch == '\\')
			printf("\\%c", ch);
		else if (ch < 0x20)
			printf("\\u%04x", ch);
		else
			putchar(ch);
	}
	putchar('"');
}

static void
json_num(double v)
{
	if (isfinite(v))
		printf("%.6g", v);
	else
		fputs("null", stdout);
}

/* CPU model as /proc/cpuinfo names it (x86 "model name", arm64 has none: "CPU part"). */
static void
cpu_model(char *buf, size_t len)
{
	FILE *f = fopen("/proc/cpuinfo", "re");
	char line[512];

	snprintf(buf, len, "unknown CPU");
	if (f == NULL)
		return;
	while (fgets(line, sizeof(line), f)) {
		char *colon = strchr(line, ':');
		if (colon == NULL || strncmp(line, "model name", 10) != 0)
			continue;
		colon++;
		while (*colon == ' ' || *colon == '\t')
			colon++;
		colon[strcspn(colon, "\n")] = '\0';
		snprintf(buf, len, "%s", colon);
		break;
	}
	fclose(f);
}

static uint64_t
mem_total(void)
{
	FILE *f = fopen("/proc/meminfo", "re");
	unsigned long long kb = 0;
	char line[256];

	if (f == NULL)
		return 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
			break;
	fclose(f);
	return kb * 1024;
}

static void
loadavg(double l[3])
{
	if (getloadavg(l, 3) != 3)
		l[0] = l[1] = l[2] = NAN;
}

void
bench_header(struct bench_ctx *b, const char *origin)
{
	struct utsname u;
	char cpu[256], mem[32], chunk[32], date[64];
	double l[3];
	long cores = sysconf(_SC_NPROCESSORS_ONLN);
	time_t now = time(NULL);
	Gpx__QueryReply *q = NULL;
	Gpx__DaemonStatus *s = NULL;
	void *buf;
	size_t len;
	int r;

	uname(&u);
	cpu_model(cpu, sizeof(cpu));
	bench_size_str(mem_total(), mem, sizeof(mem));
	loadavg(l);
	strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
	if ((r = gpx_query(b->conn, GPX_Q_STATUS, &buf, &len)) == 0) {
		q = gpx__query_reply__unpack(NULL, len, buf);
		free(buf);
		s = q ? q->status : NULL;
	}
	if (s != NULL && s->chunk_size > 0)
		bench_size_str(s->chunk_size, chunk, sizeof(chunk));
	else
		snprintf(chunk, sizeof(chunk), "?");

	if (b->json) {
		printf("{\n  \"gpx_bench\": ");
		json_str(PACKAGE_VERSION);
		printf(",\n  \"date\": ");
		json_str(date);
		printf(",\n  \"machine\": {\"cpu\": ");
		json_str(cpu);
		printf(", \"cores\": %ld, \"kernel\": ", cores);
		json_str(u.release);
		printf(", \"arch\": ");
		json_str(u.machine);
		printf(", \"memory_bytes\": %llu, \"load\": [", (unsigned long long)mem_total());
		json_num(l[0]);
		printf(", ");
		json_num(l[1]);
		printf(", ");
		json_num(l[2]);
		printf("]},\n  \"daemon\": {\"origin\": ");
		json_str(origin);
		printf(", \"socket\": ");
		json_str(b->socket);
		if (s != NULL) {
			printf(", \"version\": ");
			json_str(s->version);
			printf(", \"protocol\": %u, \"pid\": %d, \"workers\": %u, \"chunk_size\": %llu, "
			    "\"cuda\": ", s->proto, s->pid, s->workers, (unsigned long long)s->chunk_size);
			json_str(s->cuda);
			printf(", \"config\": ");
			json_str(s->config);
		}
		if (b->daemon_settings != NULL) {
			printf(", \"settings\": ");
			json_str(b->daemon_settings);
		}
		printf("},\n  \"settings\": {\"runs\": %d, \"min_time_s\": %g, \"depth\": %u, "
		    "\"max_size\": %llu},\n  \"modes\": [", b->runs, b->min_time, b->depth,
		    (unsigned long long)b->max_size);
	} else {
		printf("gpx-bench %s, %s\n", PACKAGE_VERSION, date);
		printf("machine:  %s, %ld cores, %s RAM, %s %s %s, load %.2f %.2f %.2f\n", cpu, cores,
		    mem, u.sysname, u.release, u.machine, l[0], l[1], l[2]);
		if (s != NULL) {
			printf("gpxd:     %s (protocol %u), pid %d, %s on %s\n"
			    "          %u host copy workers, chunk size %s, config %s\n"
			    "          cuda: %s\n", s->version, s->proto, s->pid, origin, b->socket,
			    s->workers, chunk, s->config, s->cuda);
			if (b->daemon_settings != NULL && b->daemon_settings[0])
				printf("          settings: %s\n", b->daemon_settings);
		} else
			printf("gpxd:     %s on %s (status query failed: %s)\n", origin, b->socket,
			    gpx_strerror(r < 0 ? r : -GPX_EPROTO));
		printf("method:   direct = the same operation in this process; gpx = submitted to gpxd, "
		    "timed until\n          this process sees the completion; median of %d runs of "
		    ">= %.0f ms each, after a warm-up;\n          ratio = gpx speed relative to direct "
		    "(1.00x = parity; for latencies direct/gpx)\n", b->runs, b->min_time * 1e3);
	}
	if (q != NULL)
		gpx__query_reply__free_unpacked(q, NULL);
	fflush(stdout);
}

void
bench_footer(struct bench_ctx *b)
{
	double l[3];

	loadavg(l);
	if (b->json) {
		printf("\n  ],\n  \"load_end\": [");
		json_num(l[0]);
		printf(", ");
		json_num(l[1]);
		printf(", ");
		json_num(l[2]);
		printf("]\n}\n");
	} else
		printf("\nload at the end: %.2f %.2f %.2f\n", l[0], l[1], l[2]);
	fflush(stdout);
}

static void
json_mode_open(const char *mode)
{
	printf("%s\n    {\"mode\": ", json_first_mode ? "" : ",");
	json_first_mode = false;
	json_str(mode);
}

void
bench_skip(struct bench_ctx *b, const char *mode, const char *why)
{
	if (b->json) {
		json_mode_open(mode);
		printf(", \"skipped\": ");
		json_str(why);
		printf("}");
	} else
		printf("\n%s: skipped: %s\n", mode, why);
	fflush(stdout);
}

void
bench_table_begin(struct bench_ctx *b, const char *mode, const char *title)
{
	if (b->json) {
		json_mode_open(mode);
		printf(", \"title\": ");
		json_str(title);
		printf(", \"rows\": [");
		json_first_row = true;
	} else {
		printf("\n%s: %s\n", mode, title);
		printf("  %-36s %-14s %12s %12s %9s\n", "", "", "direct", "gpx", "ratio");
	}
	last_what[0] = '\0';
	fflush(stdout);
}

/* Compact numbers for a table cell: 12.3M, 456.7k, 98.76, 0.123. */
static const char *
num_str(double v, char *buf, size_t len)
{
	double a = fabs(v);

	if (!isfinite(v))
		snprintf(buf, len, "-");
	else if (a >= 1e9)
		snprintf(buf, len, "%.2fG", v / 1e9);
	else if (a >= 1e6)
		snprintf(buf, len, "%.2fM", v / 1e6);
	else if (a >= 1e4)
		snprintf(buf, len, "%.1fk", v / 1e3);
	else if (a >= 100)
		snprintf(buf, len, "%.1f", v);
	else if (a >= 0.1 || a == 0)
		snprintf(buf, len, "%.2f", v);
	else
		snprintf(buf, len, "%.4f", v);
	return buf;
}

static double
row_ratio(const struct bench_row *r)
{
	if (!isfinite(r->direct) || !isfinite(r->gpx) || r->direct <= 0 || r->gpx <= 0)
		return NAN;
	return r->lower_is_better ? r->direct / r->gpx : r->gpx / r->direct;
}

static void
json_runs(const double *v, int n)
{
	putchar('[');
	for (int i = 0; i < n; i++) {
		if (i)
			printf(", ");
		json_num(v[i]);
	}
	putchar(']');
}

void
bench_table_row(struct bench_ctx *b, const struct bench_row *r)
{
	double ratio = row_ratio(r);
	char d[32], g[32], x[32];

	if (b->json) {
		printf("%s\n      {\"what\": ", json_first_row ? "" : ",");
		json_first_row = false;
		json_str(r->what);
		printf(", \"metric\": ");
		json_str(r->metric);
		printf(", \"direct\": ");
		json_num(r->direct);
		printf(", \"gpx\": ");
		json_num(r->gpx);
		printf(", \"ratio\": ");
		json_num(ratio);
		printf(", \"lower_is_better\": %s", r->lower_is_better ? "true" : "false");
		if (r->bytes)
			printf(", \"bytes\": %llu", (unsigned long long)r->bytes);
		if (r->nruns > 0 && r->direct_runs != NULL && r->gpx_runs != NULL) {
			printf(", \"direct_runs\": ");
			json_runs(r->direct_runs, r->nruns);
			printf(", \"gpx_runs\": ");
			json_runs(r->gpx_runs, r->nruns);
		}
		putchar('}');
	} else {
		if (isfinite(ratio))
			snprintf(x, sizeof(x), ratio < 0.1 ? "%.3fx" : "%.2fx", ratio);
		else
			snprintf(x, sizeof(x), "-");
		bool same = strcmp(last_what, r->what) == 0;
		snprintf(last_what, sizeof(last_what), "%s", r->what);
		printf("  %-36s %-14s %12s %12s %9s\n", same ? "" : r->what, r->metric,
		    num_str(r->direct, d, sizeof(d)), num_str(r->gpx, g, sizeof(g)), x);
	}
	fflush(stdout);
}

void
bench_table_end(struct bench_ctx *b, const char *note)
{
	if (b->json) {
		printf("\n    ]");
		if (note != NULL) {
			printf(", \"note\": ");
			json_str(note);
		}
		printf("}");
	} else if (note != NULL)
		printf("  %s\n", note);
	fflush(stdout);
}

/* ---- a private gpxd ---- */

static struct bench_daemon *live_daemon;

static void
remove_files(struct bench_daemon *d, bool keep_log)
{
	unlink(d->socket);
	unlink(d->conf);
	if (!keep_log) {
		unlink(d->log);
		rmdir(d->dir);
	}
}

/*
 * SIGINT, SIGTERM, SIGHUP or SIGPIPE (output piped into head) while a private daemon runs: stop
 * it and remove its directory (async-signal-safe calls only).
 */
static void
on_signal(int sig)
{
	struct bench_daemon *d = live_daemon;

	if (d != NULL && d->pid > 0) {
		kill(d->pid, SIGTERM);
		waitpid(d->pid, NULL, 0);
		remove_files(d, false);
	}
	_exit(128 + sig);
}

/* The gpxd to start: $GPXD, else next to this program (build tree or bin/../sbin), else PATH. */
static void
find_gpxd(char *out, size_t len)
{
	static const char *rel[] = { "gpxd", "../gpxd", "../sbin/gpxd" };
	const char *env = getenv("GPXD");
	char self[PATH_MAX];
	ssize_t n;

	if (env != NULL && env[0] != '\0') {
		snprintf(out, len, "%s", env);
		return;
	}
	if ((n = readlink("/proc/self/exe", self, sizeof(self) - 1)) > 0) {
		self[n] = '\0';
		char *slash = strrchr(self, '/');
		if (slash != NULL) {
			*slash = '\0';
			for (size_t i = 0; i < sizeof(rel) / sizeof(rel[0]); i++) {
				if (snprintf(out, len, "%s/%s", self, rel[i]) < (int)len &&
				    access(out, X_OK) == 0)
					return;
			}
		}
	}
	snprintf(out, len, "gpxd");
}

static bool
accepts(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	bool ok;

	if (fd < 0)
		return false;
	if (snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path) >= (int)sizeof(sa.sun_path)) {
		close(fd);
		return false;
	}
	ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
	close(fd);
	return ok;
}

static void
print_log(const struct bench_daemon *d)
{
	FILE *f = fopen(d->log, "re");
	char line[512];

	if (f == NULL)
		return;
	fprintf(stderr, "gpx-bench: gpxd's log (%s):\n", d->log);
	while (fgets(line, sizeof(line), f))
		fprintf(stderr, "  %s", line);
	fclose(f);
}

int
bench_daemon_start(struct bench_daemon *d, const char *const *settings, size_t nset)
{
	const char *tmp = getenv("TMPDIR");
	char bin[PATH_MAX];
	FILE *f;

	memset(d, 0, sizeof(*d));
	snprintf(d->dir, sizeof(d->dir), "%s/gpx-bench.XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
	if (mkdtemp(d->dir) == NULL) {
		fprintf(stderr, "gpx-bench: mkdtemp %s: %s\n", d->dir, strerror(errno));
		return -1;
	}
	snprintf(d->socket, sizeof(d->socket), "%s/gpxd.sock", d->dir);
	snprintf(d->conf, sizeof(d->conf), "%s/gpxd.conf", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/gpxd.log", d->dir);
	if (strlen(d->socket) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
		fprintf(stderr, "gpx-bench: socket path %s is too long (set TMPDIR to a shorter "
		    "directory)\n", d->socket);
		rmdir(d->dir);
		return -1;
	}
	/* A configuration of its own, so that no system-wide gpxd.conf changes what is measured. */
	if ((f = fopen(d->conf, "we")) == NULL) {
		fprintf(stderr, "gpx-bench: %s: %s\n", d->conf, strerror(errno));
		rmdir(d->dir);
		return -1;
	}
	fprintf(f, "# gpxd started by gpx-bench --spawn\n");
	for (size_t i = 0; i < nset; i++) {
		const char *dot = strchr(settings[i], '.'), *eq = strchr(settings[i], '=');
		if (dot == NULL || eq == NULL || dot > eq || dot == settings[i] || eq == dot + 1) {
			fprintf(stderr, "gpx-bench: '%s' is not section.key=value\n", settings[i]);
			fclose(f);
			remove_files(d, false);
			return -1;
		}
		fprintf(f, "[%.*s]\n%.*s = %s\n", (int)(dot - settings[i]), settings[i],
		    (int)(eq - dot - 1), dot + 1, eq + 1);
	}
	fclose(f);

	find_gpxd(bin, sizeof(bin));
	pid_t parent = getpid();
	if ((d->pid = fork()) < 0) {
		fprintf(stderr, "gpx-bench: fork: %s\n", strerror(errno));
		remove_files(d, false);
		return -1;
	}
	if (d->pid == 0) {
		/* The daemon goes when we go, even if we are killed outright. */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (getppid() != parent)
			_exit(1);
		int lfd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		int nfd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (lfd < 0 || nfd < 0 || dup2(nfd, 0) < 0 || dup2(lfd, 1) < 0 || dup2(lfd, 2) < 0)
			_exit(127);
		/* Not the service manager's daemon: no readiness, activation or journal hand-over. */
		unsetenv("NOTIFY_SOCKET");
		unsetenv("LISTEN_FDS");
		unsetenv("LISTEN_PID");
		unsetenv("LISTEN_FDNAMES");
		unsetenv("JOURNAL_STREAM");
		unsetenv("WATCHDOG_USEC");
		unsetenv("WATCHDOG_PID");
		char *argv[] = { bin, "-f", "-c", d->conf, "-s", d->socket, NULL };
		if (strchr(bin, '/') != NULL)
			execv(bin, argv);
		else
			execvp(bin, argv);
		fprintf(stderr, "cannot run %s: %s\n", bin, strerror(errno));
		_exit(127);
	}
	live_daemon = d;
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGHUP, on_signal);
	signal(SIGPIPE, on_signal);

	for (double t0 = bench_now(); bench_now() - t0 < 10;) {
		int st;
		if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
			fprintf(stderr, "gpx-bench: gpxd (%s) exited before it was ready\n", bin);
			print_log(d);
			d->pid = 0;
			live_daemon = NULL;
			remove_files(d, false);
			return -1;
		}
		if (accepts(d->socket))
			return 0;
		usleep(10000);
	}
	fprintf(stderr, "gpx-bench: gpxd (%s) did not accept connections on %s within 10 s\n", bin,
	    d->socket);
	bench_daemon_stop(d);
	return -1;
}

int
bench_daemon_stop(struct bench_daemon *d)
{
	int st = 0, r = 0;

	if (d->pid <= 0)
		return 0;
	kill(d->pid, SIGTERM);
	for (double t0 = bench_now(); waitpid(d->pid, &st, WNOHANG) == 0;) {
		if (bench_now() - t0 > 10) {
			fprintf(stderr, "gpx-bench: gpxd did not stop within 10 s of SIGTERM; killing it\n");
			kill(d->pid, SIGKILL);
			waitpid(d->pid, &st, 0);
			r = -1;
			break;
		}
		usleep(5000);
	}
	if (r == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
		fprintf(stderr, "gpx-bench: gpxd did not exit cleanly (%s %d)\n",
		    WIFEXITED(st) ? "status" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
		r = -1;
	}
	if (r < 0)
		print_log(d);
	d->pid = 0;
	live_daemon = NULL;
	signal(SIGINT, SIG_DFL);
	signal(SIGTERM, SIG_DFL);
	signal(SIGHUP, SIG_DFL);
	signal(SIGPIPE, SIG_DFL);
	remove_files(d, false);
	return r;
}
