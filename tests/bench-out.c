/*
 * gpx-bench's output (tests/bench.h): the header that describes the machine and the daemon
 * under test, then per mode one table of direct / gpx / ratio rows, or a line saying why the
 * mode was skipped, and the footer; as aligned text, or as one JSON document with --json.
 */
#include "config.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/utsname.h>

#include "proto/gpx.pb-c.h"
#include "tests/bench.h"

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

/*
 * Whether this process's CUDA clients run under MPS: the control daemon's endpoint (a named
 * pipe or a socket, by version) is where the driver will look for it ($CUDA_MPS_PIPE_DIRECTORY,
 * by default /tmp/nvidia-mps).
 */
bool
bench_under_mps(char *dir, size_t len)
{
	const char *d = getenv("CUDA_MPS_PIPE_DIRECTORY");
	char path[512];
	struct stat st;

	snprintf(dir, len, "%s", d != NULL && *d ? d : "/tmp/nvidia-mps");
	snprintf(path, sizeof(path), "%s/control", dir);
	return stat(path, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
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

	char mpsdir[256];
	bool mps = bench_under_mps(mpsdir, sizeof(mpsdir));

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
	if (s != NULL)
		b->workers = s->workers;
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
		printf(", \"mps\": %s", mps ? "true" : "false");
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
		printf("CUDA MPS: %s%s%s\n", mps ? "yes: GPU clients and the spawned gpxd run under the control "
		    "daemon of " : "no (no control pipe in ", mpsdir, mps ? "" : ")");
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

/* "met (>= 0.97x)", "NOT MET (<= 50 us)": the row's figure against its target. */
static int
row_verdict(const struct bench_row *r, double ratio, char *buf, size_t len)
{
	const struct bench_target *t = bench_target(r->target);
	double v;
	bool met;

	if (t == NULL) {
		snprintf(buf, len, "(no target %s)", r->target);
		return -1;
	}
	v = strcmp(t->unit, "x") == 0 ? ratio : r->gpx;
	if (!isfinite(v)) {
		snprintf(buf, len, "not measured");
		return -1;
	}
	met = t->less ? v <= t->value : v >= t->value;
	if (strcmp(t->unit, "x") == 0)
		snprintf(buf, len, "%s (%s %.2fx)", met ? "met" : "NOT MET", t->less ? "<=" : ">=", t->value);
	else
		snprintf(buf, len, "%s (%s %g %s)", met ? "met" : "NOT MET", t->less ? "<=" : ">=", t->value,
		    t->unit);
	return met;
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
	char d[32], g[32], x[32], verdict[96];
	int met = -1;

	if (r->target != NULL)
		met = row_verdict(r, ratio, verdict, sizeof(verdict));

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
		if (r->target != NULL) {
			printf(", \"target\": ");
			json_str(r->target);
			printf(", \"met\": %s", met < 0 ? "null" : met ? "true" : "false");
		}
		putchar('}');
	} else {
		if (isfinite(ratio))
			snprintf(x, sizeof(x), ratio < 0.1 ? "%.3fx" : "%.2fx", ratio);
		else
			snprintf(x, sizeof(x), "-");
		bool same = strcmp(last_what, r->what) == 0;
		snprintf(last_what, sizeof(last_what), "%s", r->what);
		printf("  %-36s %-14s %12s %12s %9s%s%s\n", same ? "" : r->what, r->metric,
		    num_str(r->direct, d, sizeof(d)), num_str(r->gpx, g, sizeof(g)), x,
		    r->target != NULL ? "  " : "", r->target != NULL ? verdict : "");
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
