/*
 * Logging for gpxd: stderr by default, the journal when systemd started us (through sdn.c).
 * Debug lines carry a subsystem token ("conn", "engine", "region", ...) so that
 * `gpxd -d -D engine` shows only the engine's.  Audit lines name the peer of every refusal.
 * What a client or a uid can make the daemon say is rate-limited per source (log_take).
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/gpxd.h"

/*
 * The level and the debug filter, which a reload changes (log_set_level, on the loop thread)
 * while copy workers, host workers and fabric threads log.  The level alone decides whether a
 * line is wanted at all, so it is one atomic integer that every line reads once, relaxed.  The
 * filter and the level's text are strings: each setting is written whole into a view no one
 * reads, then published by one atomic pointer, so that a reader sees one setting or the
 * other, never a string half rewritten.  A reader announces itself on the view it took
 * (readers) and checks that the view is still the current one before it reads; the writer
 * only rewrites a view that is not current and has no reader.  With three views a writer
 * always finds one, unless threads are in the middle of a line on both old ones, which it
 * waits out.  No lock on any path.
 */
static atomic_int log_level = LOG_L_INFO;
static bool log_journal;            /* set once, before any thread */

struct log_view {
	atomic_uint readers;
	char subsys[256];               /* comma-separated; empty = all */
	char text[300];                 /* "debug conn,engine", as log_get_level says it */
};
static struct log_view views[3] = { [0].text = "info" };
static _Atomic(struct log_view *) view = &views[0];

static const char *level_names[] = { "error", "warning", "info", "debug" };

/* The current view, held against being rewritten until view_drop. */
static struct log_view *
view_hold(void)
{
	for (;;) {
		struct log_view *v = atomic_load(&view);
		atomic_fetch_add(&v->readers, 1);
		if (atomic_load(&view) == v)
			return v;
		atomic_fetch_sub(&v->readers, 1);
	}
}

static void
view_drop(struct log_view *v)
{
	atomic_fetch_sub(&v->readers, 1);
}

/* Writes the setting into a view that is neither current nor read, then makes it current. */
static void
view_publish(int level, const char *subsys)
{
	struct log_view *cur = atomic_load(&view), *v = NULL;

	while (v == NULL) {
		for (size_t i = 0; i < sizeof(views) / sizeof(views[0]) && v == NULL; i++)
			if (&views[i] != cur && atomic_load(&views[i].readers) == 0)
				v = &views[i];
		if (v == NULL)
			cpu_pause();
	}
	snprintf(v->subsys, sizeof(v->subsys), "%s", subsys);
	snprintf(v->text, sizeof(v->text), "%s%s%s", level_names[level], subsys[0] ? " " : "", subsys);
	atomic_store(&view, v);
	atomic_store_explicit(&log_level, level, memory_order_relaxed);
}

static int
level_now(void)
{
	return atomic_load_explicit(&log_level, memory_order_relaxed);
}

/* At start, before any other thread. */
void
log_init(int level, const char *debug_subsys, bool to_journal)
{
	log_journal = to_journal;
	view_publish(level, debug_subsys ? debug_subsys : "");
}

/* "error|warning|info|debug [sub,sub]"; the loop thread (a reload, an Admin request). */
int
log_set_level(const char *spec)
{
	char word[16] = "", subs[256] = "";

	if (sscanf(spec, "%15s %255s", word, subs) < 1)
		return -1;
	for (int i = 0; i <= LOG_L_DEBUG; i++)
		if (strcmp(word, level_names[i]) == 0) {
			view_publish(i, subs);
			return 0;
		}
	return -1;
}

bool
log_level_debug(void)
{
	return level_now() >= LOG_L_DEBUG;
}

/* The loop thread's: only it rewrites views, so the text stays until its next change. */
const char *
log_get_level(void)
{
	return atomic_load(&view)->text;
}

/* Whether the debug filter lets lines of subsystem sub through. */
static bool
subsys_wanted(const char *sub)
{
	struct log_view *v = view_hold();
	const char *p = v->subsys;
	size_t l = strlen(sub);
	bool hit = v->subsys[0] == '\0';

	while (!hit && (p = strstr(p, sub)) != NULL) {
		if ((p == v->subsys || p[-1] == ',') && (p[l] == '\0' || p[l] == ','))
			hit = true;
		p += l;
	}
	view_drop(v);
	return hit;
}

static void
vlog(int level, const char *sub, int err, const char *fmt, va_list ap)
{
	char msg[1024];
	int n;

	if (level > level_now())
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

static void vlog_line(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
vlog_line(int level, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vlog(level, NULL, 0, fmt, ap);
	va_end(ap);
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

	if (level_now() < LOG_L_DEBUG || !subsys_wanted(sub))
		return;
	va_start(ap, fmt);
	vlog(LOG_L_DEBUG, sub, 0, fmt, ap);
	va_end(ap);
}

/*
 * The share of the log of one source.  A window lasts LOG_WINDOW_S; in it a client may cause
 * LOG_CLIENT_LINES lines and all of a uid's clients and connection attempts together
 * LOG_UID_LINES.  What is held back is counted on the uid and reported in one line when its
 * window ends (at the next line of that uid, or by log_tick within a second), so a uid costs
 * the log at most LOG_UID_LINES + 1 lines a window, however many connections it opens.
 * (Root and the admin group are not limited: see log_take.)
 */
#define LOG_WINDOW_S 5.0
#define LOG_CLIENT_LINES 10
#define LOG_UID_LINES 30

/* Ends a uid's window if its time is up (or when told), reporting what it held back. */
void
log_roll(struct logrl *u, uid_t uid, bool force)
{
	double now = now_s();

	if (now - u->start < LOG_WINDOW_S && !force)
		return;
	if (u->held > 0)
		log_warnx("uid %u: %u lines suppressed in the last %.1f s (its clients may cause %d lines "
		    "in %.0f s, and each of them %d)", (unsigned)uid, u->held, now - u->start,
		    LOG_UID_LINES, LOG_WINDOW_S, LOG_CLIENT_LINES);
	u->start = now;
	u->lines = u->held = 0;
}

/*
 * Whether one more line about w may be logged.  Root's and the admin group's lines are not
 * limited: they are the node's operators, whose programs' lines are the record the operator
 * reads, and no other user can cause them.
 */
static bool
log_take(const struct logwho *w)
{
	double now = now_s();

	if (w->operator)
		return true;
	log_roll(w->uid_share, w->uid, false);
	if (w->mine != NULL) {
		if (now - w->mine->start >= LOG_WINDOW_S) {
			w->mine->start = now;
			w->mine->lines = 0;
		}
		if (w->mine->lines >= LOG_CLIENT_LINES) {
			w->uid_share->held++;
			return false;
		}
	}
	if (w->uid_share->lines >= LOG_UID_LINES) {
		w->uid_share->held++;
		return false;
	}
	if (w->mine != NULL)
		w->mine->lines++;
	w->uid_share->lines++;
	return true;
}

void
log_other(struct logrl *rl, int level, const char *fmt, ...)
{
	char msg[768];
	va_list ap;
	double now = now_s();

	if (level > level_now())
		return;
	if (now - rl->start >= LOG_WINDOW_S) {
		rl->start = now;
		rl->lines = 0;
	}
	if (rl->lines >= LOG_UID_LINES) {
		rl->held++;
		return;
	}
	rl->lines++;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (rl->held > 0)
		vlog_line(level, "%s (and %u more like it suppressed before)", msg, rl->held);
	else
		vlog_line(level, "%s", msg);
	rl->held = 0;
}

/* One line per refusal: who (client, uid, pid) and why, within the client's and uid's share. */
void
log_vrefused(const struct logwho *w, const char *fmt, va_list ap)
{
	char why[512];

	if (level_now() < LOG_L_WARN || !log_take(w))
		return;
	vsnprintf(why, sizeof(why), fmt, ap);
	log_warnx("refused client %llu (uid %u pid %d %s): %s", (unsigned long long)w->client, (unsigned)w->uid,
	    (int)w->pid, w->name != NULL && w->name[0] ? w->name : "-", why);
}

void
log_vwho(const struct logwho *w, int level, const char *fmt, va_list ap)
{
	if (level > level_now() || !log_take(w))
		return;
	vlog(level, NULL, 0, fmt, ap);
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
