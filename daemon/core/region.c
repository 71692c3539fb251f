/*
 * Regions: one opened and mapped piece of client memory, of any kind, shared by the handles
 * that name it (its owner's and its importers') and by the jobs that copy to or from it.
 *
 * Two counts keep it honest.  `refs` keeps the struct alive (handles and jobs).  `users` keeps
 * the mapping alive (the owner's handle and jobs).  When the owner withdraws the region it is
 * revoked: new jobs can no longer take it, importers' handles turn into EREVOKED, and the
 * mapping is closed as soon as the last running job lets go, even while importers still hold
 * their handles.  Both counts share one 64-bit word: a job, which holds one of each, takes
 * and gives back both with one atomic operation (region_hold, region_drop), half of what a
 * batch of many regions spent on them.
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>

#include "daemon/gpxd.h"

#define REF 1ull               /* refs: the low 32 bits of counts */
#define USE (1ull << 32)       /* users: the high 32 */

static void (*gone_hook)(struct region *);
static void (*revoke_hook)(struct region *);

static uint32_t
refs_of(uint64_t v)
{
	return (uint32_t)v;
}

static uint32_t
users_of(uint64_t v)
{
	return (uint32_t)(v >> 32);
}

/* A zeroed region, as region_new makes one: one reference and one user, its owner's. */
void
region_init(struct region *r)
{
	atomic_init(&r->counts, USE | REF);
	r->fd = -1;
	r->dev = DEV_HOST;
}

struct region *
region_new(void)
{
	struct region *r = aligned_alloc(_Alignof(struct region), sizeof(*r));

	if (r != NULL) {
		memset(r, 0, sizeof(*r));
		region_init(r);
	}
	return r;
}

uint32_t
region_refs(const struct region *r)
{
	return refs_of(atomic_load(&r->counts));
}

uint32_t
region_users(const struct region *r)
{
	return users_of(atomic_load(&r->counts));
}

/* Its mapping no longer counts against limits.mappings (it is gone, or was never made). */
static void
map_uncount(struct region *r)
{
	if (r->map_counted) {
		r->map_counted = false;
		maps_give();
	}
}

static void
region_free(struct region *r)
{
	map_uncount(r);
	if (r->notify_cq != NULL)
		cq_unref(r->notify_cq);
	free(r->pieces);
	free(r);
}

/* The last user let go: the mapping goes. */
static void
mapping_gone(struct region *r)
{
	/* Whatever its kind, an RDMA NIC lets go of its memory before the mapping goes. */
	if (gone_hook != NULL)
		gone_hook(r);
	if (r->ops != NULL)
		r->ops->close(r);
	map_uncount(r);
	/*
	 * No job holds the region any more and none can take it (it is revoked), so no copy
	 * worker reads notify_cq again: the owner's queue (and its eventfd) goes now, not when
	 * the last importer lets go of its handle.
	 */
	if (r->notify_cq != NULL) {
		cq_unref(r->notify_cq);
		r->notify_cq = NULL;
	}
}

void
region_ref(struct region *r)
{
	atomic_fetch_add(&r->counts, REF);
}

void
region_unref(struct region *r)
{
	if (refs_of(atomic_fetch_sub(&r->counts, REF)) == 1)
		region_free(r);
}

/* Adds what (USE, with REF or not) unless the mapping is gone or going. */
static bool
take(struct region *r, uint64_t what)
{
	uint64_t v = atomic_load(&r->counts);

	do {
		if (users_of(v) == 0 || atomic_load(&r->revoked))
			return false;
	} while (!atomic_compare_exchange_weak(&r->counts, &v, v + what));
	return true;
}

bool
region_use(struct region *r)
{
	return take(r, USE);
}

void
region_unuse(struct region *r)
{
	if (users_of(atomic_fetch_sub(&r->counts, USE)) == 1)
		mapping_gone(r);
}

bool
region_hold(struct region *r)
{
	return take(r, USE | REF);
}

void
region_drop(struct region *r)
{
	uint64_t v = atomic_load(&r->counts);

	do {
		/* The last user closes the mapping while its reference still keeps the struct:
		 * one at a time (rare: the region was revoked while the job ran). */
		if (users_of(v) == 1) {
			region_unuse(r);
			region_unref(r);
			return;
		}
	} while (!atomic_compare_exchange_weak(&r->counts, &v, v - USE - REF));
}

void
region_revoke(struct region *r)
{
	if (!atomic_exchange(&r->revoked, true)) {
		if (r->kept_by > 0 && revoke_hook != NULL)
			revoke_hook(r);      /* what holds it by choice lets go first */
		region_unuse(r);
	}
}

void
region_on_revoke(void (*fn)(struct region *))
{
	revoke_hook = fn;
}

/* Set once at start, before any region exists; called from any thread. */
void
region_on_gone(void (*fn)(struct region *))
{
	gone_hook = fn;
}
