/*
 * gpx-bench: measures what brokering a copy through gpxd costs, next to the same copy done
 * in-process, in one run on one machine.  This file holds the command line: the options, the
 * private gpxd of --spawn, the connection, and the modes asked for (every mode without a MODE)
 * run in the order they registered.
 *
 * The modes live in files of their own and register through BENCH_MODES (tests/bench.h): the
 * host-memory modes in tests/bench-host.c (host) and tests/bench-small.c (small, segs), the
 * remote ones in tests/bench-remote.c, and in gpx-bench-gpu the GPU modes of the
 * tests/bench-gpu-*.c files and tests/bench-all2all.c.  The timing and buffers live in
 * tests/bench.c, the tables in tests/bench-out.c, the --spawn daemon in tests/bench-daemon.c.
 */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/bench.h"

#define GiB (1ULL << 30)

static void
usage(FILE *f)
{
	fprintf(f,
	    "usage: gpx-bench [options] [MODE...]\n"
	    "Measures copies brokered by gpxd next to the same copies done in-process.\n"
	    "options:\n"
	    "  -s, --socket PATH     daemon socket (default: $GPX_SOCKET or /run/gpx/gpxd.sock)\n"
	    "      --spawn           start a private gpxd on a temporary socket for the run\n"
	    "                        (the binary: $GPXD, else gpxd next to gpx-bench, else PATH)\n"
	    "      --set SEC.KEY=VAL with --spawn: a gpxd.conf setting, e.g. daemon.busy_poll_us=0\n"
	    "                        (repeatable)\n"
	    "      --workers N       with --spawn: same as --set daemon.workers=N\n"
	    "      --chunk-size SIZE with --spawn: same as --set daemon.chunk_size=SIZE\n"
	    "  -j, --json            JSON output\n"
	    "      --max-size SIZE   largest buffer and copy (default 1G)\n"
	    "      --runs N          timed runs per figure, median reported (default 5)\n"
	    "      --min-time MS     least duration of one timed run (default 200)\n"
	    "      --depth N         outstanding transfers when pipelined (default 64)\n"
	    "  -l, --list            list the modes\n"
	    "  -h, --help            this text\n"
	    "With no MODE, every mode runs.  Modes:\n");
	for (size_t i = 0; i < bench_mode_count(); i++)
		fprintf(f, "  %-10s %s\n", bench_mode_at(i)->name, bench_mode_at(i)->help);
}

static long
num_arg(const char *opt, const char *v, long lo, long hi)
{
	char *end;
	long n;

	errno = 0;
	n = strtol(v, &end, 10);
	if (errno != 0 || *end != '\0' || end == v || n < lo || n > hi) {
		fprintf(stderr, "gpx-bench: %s wants a number from %ld to %ld, not '%s'\n", opt, lo, hi, v);
		exit(2);
	}
	return n;
}

int
main(int argc, char **argv)
{
	enum { O_SPAWN = 256, O_SET, O_WORKERS, O_CHUNK, O_MAX, O_RUNS, O_MINTIME, O_DEPTH };
	static const struct option longopts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "spawn", no_argument, NULL, O_SPAWN },
		{ "set", required_argument, NULL, O_SET },
		{ "workers", required_argument, NULL, O_WORKERS },
		{ "chunk-size", required_argument, NULL, O_CHUNK },
		{ "json", no_argument, NULL, 'j' },
		{ "max-size", required_argument, NULL, O_MAX },
		{ "runs", required_argument, NULL, O_RUNS },
		{ "min-time", required_argument, NULL, O_MINTIME },
		{ "depth", required_argument, NULL, O_DEPTH },
		{ "list", no_argument, NULL, 'l' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	struct bench_ctx b = { .max_size = 1 * GiB, .runs = 5, .min_time = 0.2, .depth = 64 };
	struct bench_daemon d = { .pid = 0 };
	bool spawn = false;
	int failed = 0, ch, r;
	uint64_t n;
	static char made[64][64];        /* the settings --workers and --chunk-size make */
	char *settings[64], *tmp;
	size_t nset = 0;

	while ((ch = getopt_long(argc, argv, "s:jlh", longopts, NULL)) != -1) {
		switch (ch) {
		case 's': b.socket = optarg; break;
		case O_SPAWN: spawn = true; break;
		case O_SET:
		case O_WORKERS:
		case O_CHUNK:
			if (nset == sizeof(settings) / sizeof(settings[0])) {
				fprintf(stderr, "gpx-bench: too many daemon settings\n");
				return 2;
			}
			tmp = made[nset];
			if (ch == O_WORKERS)
				snprintf(tmp, sizeof(made[0]), "daemon.workers=%ld", num_arg("--workers", optarg, 1, 256));
			else if (ch == O_CHUNK && bench_parse_size(optarg, &n) == 0 && n >= 4096)
				snprintf(tmp, sizeof(made[0]), "daemon.chunk_size=%llu", (unsigned long long)n);
			else if (ch == O_CHUNK) {
				fprintf(stderr, "gpx-bench: --chunk-size: bad size '%s'\n", optarg);
				return 2;
			}
			settings[nset++] = ch == O_SET ? optarg : tmp;
			break;
		case 'j': b.json = true; break;
		case O_MAX:
			if (bench_parse_size(optarg, &b.max_size) < 0) {
				fprintf(stderr, "gpx-bench: --max-size: bad size '%s'\n", optarg);
				return 2;
			}
			break;
		case O_RUNS: b.runs = num_arg("--runs", optarg, 1, 1000); break;
		case O_MINTIME: b.min_time = num_arg("--min-time", optarg, 1, 600000) / 1e3; break;
		case O_DEPTH: b.depth = num_arg("--depth", optarg, 1, 1 << 20); break;
		case 'l':
			for (size_t i = 0; i < bench_mode_count(); i++)
				printf("%-10s %s\n", bench_mode_at(i)->name, bench_mode_at(i)->help);
			return 0;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	for (int i = optind; i < argc; i++)
		if (bench_mode_find(argv[i]) == NULL) {
			fprintf(stderr, "gpx-bench: no mode '%s' (gpx-bench --list)\n", argv[i]);
			return 2;
		}
	if (nset > 0 && !spawn) {
		fprintf(stderr, "gpx-bench: --set, --workers and --chunk-size configure the gpxd of --spawn\n");
		return 2;
	}
	if (spawn && b.socket != NULL) {
		fprintf(stderr, "gpx-bench: --spawn and --socket exclude each other\n");
		return 2;
	}
	if (spawn) {
		if (bench_daemon_start(&d, (const char *const *)settings, nset) < 0)
			return 1;
		b.socket = d.socket;
		size_t len = 1;
		for (size_t i = 0; i < nset; i++)
			len += strlen(settings[i]) + 1;
		char *all = calloc(1, len);
		for (size_t i = 0; all != NULL && i < nset; i++) {
			strcat(all, settings[i]);
			strcat(all, i + 1 < nset ? " " : "");
		}
		b.daemon_settings = all;
	} else if (b.socket == NULL && (b.socket = getenv("GPX_SOCKET")) == NULL)
		b.socket = "/run/gpx/gpxd.sock";

	if ((r = gpx_connect(b.socket, "gpx-bench", &b.conn)) < 0) {
		fprintf(stderr, "gpx-bench: %s%s\n", gpx_last_error(NULL), spawn ? "" : " (start one, or use --spawn)");
		if (spawn)
			bench_daemon_stop(&d);
		return 1;
	}
	if (b.depth >= 4096 && !b.json)
		fprintf(stderr, "gpx-bench: --depth %u may exceed the daemon's completion ring\n", b.depth);
	bench_header(&b, spawn ? "spawned by gpx-bench" : "running");
	for (size_t i = 0; i < bench_mode_count(); i++) {
		const struct bench_mode *m = bench_mode_at(i);
		bool wanted = optind == argc;
		for (int k = optind; k < argc && !wanted; k++)
			wanted = strcmp(argv[k], m->name) == 0;
		if (wanted && m->fn(&b) < 0) {
			fprintf(stderr, "gpx-bench: mode %s failed\n", m->name);
			failed++;
		}
	}
	bench_footer(&b);
	gpx_close(b.conn);
	free((char *)b.daemon_settings);
	if (spawn && bench_daemon_stop(&d) < 0)
		failed++;
	return failed ? 1 : 0;
}
