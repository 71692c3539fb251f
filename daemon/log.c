/*
 * Logging for gpxd: stderr by default, the journal when systemd started us (through sdn.c).
 * Debug lines carry a subsystem token ("conn", "engine", "region", ...) so that
 * `gpxd -d -D engine` shows only the engine's.  Audit lines name the peer of every refusal.
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpxd.h"

static int log_level = LOG_L_INFO;
static char log_subsys[256];        /* comma-separated; empty = all */
static bool log_journal;
static char log_level_text[300] = "info";

static const char *level_names[] = { "error", "warning", "info", "debug" };

void
log_init(int level, const char *debug_subsys, bool to_journal)
{
	log_level = level;
	log_journal = to_journal;
	snprintf(log_subsys, sizeof(log_subsys), "%s", debug_subsys ? debug_subsys : "");
	snprintf(log_level_text, sizeof(log_level_text), "%s%s%s", level_names[level],
	    log_subsys[0] ? " " : "", log_subsys);
}

/* "error|warning|info|debug [sub,sub]" */
int
log_set_level(const char *spec)
{
	char word[16] = "", subs[256] = "";

	if (sscanf(spec, "%15s %255s", word, subs) < 1)
		return -1;
	for (int i = 0; i <= LOG_L_DEBUG; i++)
		if (strcmp(word, level_names[i]) == 0) {
			log_init(i, subs, log_journal);
			return 0;
		}
	return -1;
}

bool
log_level_debug(void)
{
	return log_level >= LOG_L_DEBUG;
}

const char *
log_get_level(void)
{
	return log_level_text;
}

static void
vlog(int level, const char *sub, int err, const char *fmt, va_list ap)
{
	char msg[1024];
	int n;

	if (level > log_level)
		return;
	n = vsnprintf(msg, sizeof(msg), fmt, ap);
	if (n < 0)
		return;
	if (err && (size_t)n < sizeof(msg))
		snprintf(msg + n, sizeof(msg) - n, ": %s", strerror(err));
	if (log_journal) {
		sdn_journal(level, msg);
		return;
	}
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	localtime_r(&ts.tv_sec, &tm);
	fprintf(stderr, "%02d:%02d:%02d.%03ld gpxd: %s%s%s%s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
	    ts.tv_nsec / 1000000, level == LOG_L_WARN ? "warning: " : level == LOG_L_ERR ? "error: " : "",
	    sub ? sub : "", sub ? ": " : "", msg);
}

void
log_warn(const char *fmt, ...)
{
	int e = errno;
	va_list ap;
	va_start(ap, fmt);
	vlog(LOG_L_WARN, NULL, e, fmt, ap);
	va_end(ap);
	errno = e;
}

void
log_warnx(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vlog(LOG_L_WARN, NULL, 0, fmt, ap);
	va_end(ap);
}

void
log_info(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vlog(LOG_L_INFO, NULL, 0, fmt, ap);
	va_end(ap);
}

void
log_debug(const char *sub, const char *fmt, ...)
{
	va_list ap;

	if (log_level < LOG_L_DEBUG)
		return;
	if (log_subsys[0] != '\0') {
		size_t l = strlen(sub);
		const char *p = log_subsys;
		bool hit = false;
		while ((p = strstr(p, sub)) != NULL) {
			if ((p == log_subsys || p[-1] == ',') && (p[l] == '\0' || p[l] == ',')) {
				hit = true;
				break;
			}
			p += l;
		}
		if (!hit)
			return;
	}
	va_start(ap, fmt);
	vlog(LOG_L_DEBUG, sub, 0, fmt, ap);
	va_end(ap);
}

/*
 * One line per refusal: who (client, uid, pid) and why.  At most AUDIT_PER_S lines a second per
 * connection, so a hostile client cannot flood the log; what was held back is counted in the
 * next line that gets through.
 */
#define AUDIT_PER_S 20

void
log_audit(struct conn *c, const char *fmt, ...)
{
	char why[512];
	va_list ap;
	double now = now_s();

	if (now - c->audit_window >= 1.0) {
		c->audit_window = now;
		c->audit_lines = 0;
	}
	if (c->audit_lines >= AUDIT_PER_S) {
		c->audit_dropped++;
		return;
	}
	c->audit_lines++;
	va_start(ap, fmt);
	vsnprintf(why, sizeof(why), fmt, ap);
	va_end(ap);
	if (c->audit_dropped > 0)
		log_warnx("refused client %llu (uid %u pid %d %s): %s (and %u more refusals not logged)",
		    (unsigned long long)c->id, (unsigned)c->uid, (int)c->pid, c->name[0] ? c->name : "-", why,
		    c->audit_dropped);
	else
		log_warnx("refused client %llu (uid %u pid %d %s): %s", (unsigned long long)c->id,
		    (unsigned)c->uid, (int)c->pid, c->name[0] ? c->name : "-", why);
	c->audit_dropped = 0;
}

void
fatal(const char *fmt, ...)
{
	int e = errno;
	va_list ap;
	va_start(ap, fmt);
	vlog(LOG_L_ERR, NULL, e, fmt, ap);
	va_end(ap);
	exit(1);
}

void
fatalx(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vlog(LOG_L_ERR, NULL, 0, fmt, ap);
	va_end(ap);
	exit(1);
}
