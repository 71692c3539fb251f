/*
 * Per-uid accounting.  Limits in gpx are per user, not per connection, so that opening more
 * connections buys a tenant nothing.  Entries are kept for the daemon's lifetime: a node has few
 * uids, and copy workers may still hold a pointer to one after its last connection closed.
 * Loop thread only, except the inflight counter, which copy workers decrement, and the
 * engine's queues of the uid (under the engine's lock).
 */
#include "config.h"

#include <stdarg.h>
#include <stdlib.h>

#include "gpxd.h"

static TAILQ_HEAD(, user) users = TAILQ_HEAD_INITIALIZER(users);

struct user *
user_get(uid_t uid)
{
	struct user *u;

	TAILQ_FOREACH(u, &users, entry)
		if (u->uid == uid)
			return u;
	if ((u = calloc(1, sizeof(*u))) == NULL || (u->uq = calloc(NPATHS, sizeof(*u->uq))) == NULL)
		fatalx("out of memory");
	for (int p = 0; p < NPATHS; p++)
		TAILQ_INIT(&u->uq[p].conns);
	u->uid = uid;
	TAILQ_INSERT_TAIL(&users, u, entry);
	return u;
}

void
user_visit(void (*fn)(struct user *, void *), void *arg)
{
	struct user *u;

	TAILQ_FOREACH(u, &users, entry)
		fn(u, arg);
}

struct user *
user_most_hello(void)
{
	struct user *u, *most = NULL;

	TAILQ_FOREACH(u, &users, entry)
		if (u->hello > 0 && (most == NULL || u->hello > most->hello))
			most = u;
	return most;
}

/* The uid's own line of the log: a uid alone, within its share. */
void
log_uid(struct user *u, int level, const char *fmt, ...)
{
	struct logwho w = { .uid = u->uid, .pid = 0, .operator = u->uid == 0, .uid_share = &u->log };
	va_list ap;

	va_start(ap, fmt);
	log_vwho(&w, level, fmt, ap);
	va_end(ap);
}

void
user_log_tick(bool final)
{
	struct user *u;

	TAILQ_FOREACH(u, &users, entry)
		if (u->log.held > 0)
			log_roll(&u->log, u->uid, final);
}

bool
creds_in_group(const struct creds *c, gid_t g)
{
	if (c->gid == g)
		return true;
	for (int i = 0; i < c->ngroups; i++)
		if (c->groups[i] == g)
			return true;
	return false;
}
