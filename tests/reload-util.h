/*
 * What the reload tests share (tests/reload.c on the host path, tests/gpu/gpu-reload.c on
 * GPUs): the configuration file of the harness's gpxd rewritten whole (written aside and
 * renamed, as an editor or a package manager does), a reload by SIGHUP, and a wait for the
 * daemon's log to say that it took it or refused it, so that every signal is one reload and
 * none is merged with the next.  Header-only.
 */
#ifndef GPX_TESTS_RELOAD_UTIL_H
#define GPX_TESTS_RELOAD_UTIL_H

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/util.h"

/* The file harness_start wrote, kept to build the next ones from. */
static char reload_base[4096];

static inline void
reload_init(const struct harness *h)
{
	FILE *f = fopen(h->conf, "re");
	size_t n;

	if (f == NULL)
		tap_bail("cannot read %s", h->conf);
	n = fread(reload_base, 1, sizeof(reload_base) - 1, f);
	reload_base[n] = '\0';
	fclose(f);
}

/* The harness's file, then text (ini, may start new sections): written aside, then renamed. */
static inline void
reload_write(const struct harness *h, const char *text)
{
	char tmp[128];
	FILE *f;

	snprintf(tmp, sizeof(tmp), "%s.new", h->conf);
	if ((f = fopen(tmp, "we")) == NULL)
		tap_bail("cannot write %s", tmp);
	fputs(reload_base, f);
	fputs(text, f);
	if (fclose(f) != 0 || rename(tmp, h->conf) < 0)
		tap_bail("cannot write %s", h->conf);
}

/* Lines of the daemon's log that say a reload was taken or refused (key NULL), or refused
 * naming key. */
static inline int
reload_lines(const struct harness *h, const char *key)
{
	char line[2048];
	int n = 0;
	FILE *f = fopen(h->log, "re");

	if (f == NULL)
		return -1;
	while (fgets(line, sizeof(line), f) != NULL) {
		bool refused = strstr(line, "reload refused") != NULL;
		n += key == NULL ? refused || strstr(line, "configuration reloaded from") != NULL :
		    refused && strstr(line, key) != NULL;
	}
	fclose(f);
	return n;
}

static inline int
reload_count(const struct harness *h)
{
	return reload_lines(h, NULL);
}

static inline int
reload_refused(const struct harness *h, const char *key)
{
	return reload_lines(h, key);
}

/* The CPU time the daemon has used, in clock ticks; -1 when /proc does not say. */
static inline long
reload_cpu_ticks(const struct harness *h)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)h->pid);
	return proc_stat_ticks(path, NULL);
}

/*
 * SIGHUP, then waits (up to 10 s) until the log has one more line of a reload than *seen;
 * false when it never came.
 */
static inline bool
reload_hup(const struct harness *h, int *seen)
{
	struct timespec ts = { 0, 200000 };

	if (kill(h->pid, SIGHUP) < 0)
		return false;
	for (int i = 0; i < 50000; i++) {
		int n = reload_count(h);
		if (n > *seen) {
			*seen = n;
			return true;
		}
		nanosleep(&ts, NULL);
	}
	return false;
}

/* n reloads, the i-th of the file write_file(i) writes; returns how many were never answered. */
static inline int
reload_storm(const struct harness *h, int *seen, int n, void (*write_file)(int))
{
	int lost = 0;

	for (int i = 0; i < n; i++) {
		write_file(i);
		if (!reload_hup(h, seen))
			lost++;
	}
	return lost;
}

#endif
