/*
 * Per-uid accounting.  Limits in gpx are per user, not per connection, so that opening more
 * connections buys a tenant nothing.  Entries are kept for the daemon's lifetime: a node has few
 * uids, and copy workers may still hold a pointer to one after its last connection closed.
 * Loop thread only, except the inflight counter, which copy workers decrement, and the
 * engine's queues of the uid (under the engine's lock).
 */
#include "config.h"

#include <errno.h>
#include <malloc.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/gpxd.h"

static TAILQ_HEAD(, user) users = TAILQ_HEAD_INITIALIZER(users);

struct user *
user_get(uid_t uid)
{
	struct user *u;

	TAILQ_FOREACH(u, &users, entry)
		if (u->uid == uid)
			return u;
	if ((u = calloc(1, sizeof(*u))) == NULL || (u->uq = calloc(NPATHS, sizeof(*u->uq))) == NULL) {
		free(u);
		return NULL;
	}
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

/* ---- budgets ---- */

static atomic_uint_fast64_t total_charged;
static atomic_uint_fast64_t entries_charged;    /* of the total, what table entries hold */
static atomic_uint_fast64_t high_water;         /* the total's most since the heap was last trimmed */
static atomic_bool trimming;
static atomic_uint_fast64_t refusals[NBUDGETS][2];    /* [scope][busy] */
static const char *const names[NBUDGETS] = { "request", "connection", "uid", "total" };

const char *
budget_name(enum budget_scope s)
{
	return names[s];
}

uint64_t
budget_limit(enum budget_scope s)
{
	switch (s) {
	case BUDGET_REQUEST: return cfg->budget_request;
	case BUDGET_CONNECTION: return cfg->budget_connection;
	case BUDGET_UID: return cfg->budget_uid;
	default: return cfg->budget_total;
	}
}

void
budget_warm(const struct cq *q, const struct user *u)
{
	if (q != NULL)
		__builtin_prefetch(&q->charged, 1);
	if (u != NULL)
		__builtin_prefetch(&u->charged, 1);     /* (and inflight, in the same line) */
	__builtin_prefetch(&total_charged, 1);
	__builtin_prefetch(&high_water, 1);
}

uint64_t
budget_used(void)
{
	return atomic_load(&total_charged);
}

uint64_t
budget_entries(void)
{
	return atomic_load(&entries_charged);
}

uint64_t
budget_refused(enum budget_scope s, bool busy)
{
	return atomic_load(&refusals[s][busy]);
}

/*
 * want: what the request needs so far, held: what other requests and entries hold against the
 * budget, what: the request.
 */
static int
refuse(enum budget_scope s, uint64_t want, uint64_t held, const char *what, bool counted, char *err, size_t errlen)
{
	const uint64_t lim = budget_limit(s);
	const bool busy = want <= lim;

	if (counted)
		atomic_fetch_add(&refusals[s][busy], 1);
	if (busy)
		snprintf(err, errlen, "busy: the %s budget (limits.%s_budget, %llu bytes) has %llu bytes held by "
		    "transfers in flight and by regions, imports and exports; this %s needs %llu or more: retry "
		    "when some have ended", names[s], names[s], (unsigned long long)lim, (unsigned long long)held,
		    what, (unsigned long long)want);
	else
		snprintf(err, errlen, "too large: this %s needs %llu bytes of gpxd's memory, more than the "
		    "%s budget (limits.%s_budget, %llu bytes) allows", what, (unsigned long long)want, names[s],
		    names[s], (unsigned long long)lim);
	return busy ? -GPX__STATUS__EBUSY : -GPX__STATUS__ENOMEM;
}

/*
 * Only the loop thread charges, and other threads only give back: a budget seen with room
 * here still has it when the bytes are added.  The request's own bytes are part of the
 * connection's, uid's and total's, so a request that never fits its budget is told so at
 * the narrowest one.  A connection's budget holds its transfers' bytes and its entries'.
 */
int
budget_charge(struct charge *ch, uint64_t bytes, char *err, size_t errlen)
{
	const uint64_t req = ch->bytes + bytes;
	const uint64_t conn = (ch->cq != NULL ? atomic_load(&ch->cq->charged) : 0) +
	    (ch->entries != NULL ? *ch->entries : 0);
	const uint64_t held[NBUDGETS] = { 0, conn - ch->bytes, atomic_load(&ch->user->charged) - ch->bytes,
	    atomic_load(&total_charged) - ch->bytes };
	const char *what = ch->what != NULL ? ch->what : "transfer";

	if (req > cfg->budget_request)
		return refuse(BUDGET_REQUEST, req, 0, what, !ch->optional, err, errlen);
	for (int s = BUDGET_CONNECTION; s < NBUDGETS; s++)
		if (req > budget_limit(s) || held[s] + req > budget_limit(s))
			return refuse(s, req, held[s], what, !ch->optional, err, errlen);
	if (ch->entry) {
		*ch->entries += bytes;
		atomic_fetch_add(&entries_charged, bytes);
	} else
		atomic_fetch_add(&ch->cq->charged, bytes);
	atomic_fetch_add(&ch->user->charged, bytes);
	uint64_t t = atomic_fetch_add(&total_charged, bytes) + bytes;
	uint64_t hw = atomic_load(&high_water);
	while (t > hw && !atomic_compare_exchange_weak(&high_water, &hw, t))
		;
	ch->bytes = req;
	return 0;
}

/* Entries go on the loop thread, and are small: no trimming for them. */
void
budget_entry_release(uint64_t *entries, struct user *u, uint64_t bytes)
{
	if (bytes == 0)
		return;
	*entries -= bytes;
	atomic_fetch_sub(&entries_charged, bytes);
	atomic_fetch_sub(&u->charged, bytes);
	atomic_fetch_sub(&total_charged, bytes);
}

/* ---- mappings (limits.mappings) ---- */

static atomic_uint maps_held;
static atomic_uint_fast64_t maps_refusals;

uint32_t
maps_default(void)
{
	unsigned long long n = sysctl_number("/proc/sys/vm/max_map_count");

	if (n < 1024 || n > UINT32_MAX)
		n = n < 1024 ? 65530 : UINT32_MAX;   /* (the kernel's default when unreadable) */
	return (uint32_t)(n / 4 * 3);
}

/* Only the loop thread takes: a count seen with room here still has it at the mmap. */
int
maps_take(const char *what, char *err, size_t errlen)
{
	uint32_t held = atomic_load(&maps_held);

	if (held >= cfg->max_mappings) {
		atomic_fetch_add(&maps_refusals, 1);
		snprintf(err, errlen, "busy: gpxd holds %u mappings of clients' memory (host regions, completion "
		    "rings, segment areas), its limit (limits.mappings, %u): this %s needs one more; retry when "
		    "some are released", held, cfg->max_mappings, what);
		return -GPX__STATUS__EBUSY;
	}
	atomic_fetch_add(&maps_held, 1);
	return 0;
}

void
maps_give(void)
{
	atomic_fetch_sub(&maps_held, 1);
}

uint32_t
maps_used(void)
{
	return atomic_load(&maps_held);
}

/* ---- a pool that uids hold runs of (the page arena) ---- */

int64_t
pool_take(struct pool *p, uint32_t need, struct user *u)
{
	if (need > p->share)
		return -E2BIG;
	if (atomic_load(&u->pooled) + (uint64_t)need > p->share) {
		p->refused[1]++;
		return -EDQUOT;
	}
	/* The shortest free run that holds it (the first of those): longer runs stay whole. */
	uint32_t best = UINT32_MAX, best_len = UINT32_MAX;
	for (uint32_t i = 0, run = 0; i <= p->grains; i++) {
		if (i < p->grains && !p->used[i]) {
			run++;
			continue;
		}
		if (run >= need && run < best_len) {
			best = i - run;
			best_len = run;
		}
		run = 0;
	}
	if (best == UINT32_MAX) {
		p->refused[0]++;
		return -ENOSPC;
	}
	memset(&p->used[best], 1, need);
	p->len[best] = (uint16_t)need;
	p->owner[best] = u;
	atomic_fetch_add(&u->pooled, need);
	return best;
}

void
pool_give(struct pool *p, uint32_t first)
{
	memset(&p->used[first], 0, p->len[first]);
	atomic_fetch_sub(&p->owner[first]->pooled, p->len[first]);
	p->len[first] = 0;
	p->owner[first] = NULL;
}

uint64_t
maps_refused(void)
{
	return atomic_load(&maps_refusals);
}

static void *
trim(void *unused)
{
	(void)unused;
	thread_name("trim");
	malloc_trim(0);
	atomic_store(&trimming, false);
	return NULL;
}

/*
 * Large lists are freed into the heap, which keeps them for the next request (main.c): once
 * the total has fallen below half of what it was, a thread of its own gives the heap's free
 * pages back to the system, so that what a client held is not kept once it is gone.
 */
#define TRIM_MIN (16u << 20)

void
budget_release(struct cq *q, struct user *u, uint64_t bytes)
{
	if (bytes == 0)
		return;
	atomic_fetch_sub(&q->charged, bytes);
	atomic_fetch_sub(&u->charged, bytes);
	uint64_t t = atomic_fetch_sub(&total_charged, bytes) - bytes;
	uint64_t hw = atomic_load(&high_water);
	if (hw < TRIM_MIN || t > hw / 2 || atomic_exchange(&trimming, true))
		return;
	atomic_store(&high_water, t);
	pthread_t th;
	pthread_attr_t a;
	pthread_attr_init(&a);
	pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&th, &a, trim, NULL) != 0)
		atomic_store(&trimming, false);
	pthread_attr_destroy(&a);
}
