/*
 * Regions: one opened and mapped piece of client memory, of any kind, shared by the handles
 * that name it (its owner's and its importers') and by the jobs that copy to or from it.
 *
 * Two counts keep it honest.  `refs` keeps the struct alive (handles and jobs).  `users` keeps
 * the mapping alive (the owner's handle and jobs).  When the owner withdraws the region it is
 * revoked: new jobs can no longer take it, importers' handles turn into EREVOKED, and the
 * mapping is closed as soon as the last running job lets go, even while importers still hold
 * their handles.
 */
#include "config.h"

#include <stdlib.h>

#include "daemon/gpxd.h"

static void (*gone_hook)(struct region *);

struct region *
region_new(void)
{
	struct region *r = calloc(1, sizeof(*r));

	if (r == NULL)
		return NULL;
	atomic_init(&r->refs, 1);
	atomic_init(&r->users, 1);
	r->fd = -1;
	r->dev = DEV_HOST;
	return r;
}

void
region_ref(struct region *r)
{
	atomic_fetch_add(&r->refs, 1);
}

void
region_unref(struct region *r)
{
	if (atomic_fetch_sub(&r->refs, 1) != 1)
		return;
	if (r->notify_cq != NULL)
		cq_unref(r->notify_cq);
	free(r->pieces);
	free(r);
}

bool
region_use(struct region *r)
{
	int u = atomic_load(&r->users);

	do {
		if (u == 0 || atomic_load(&r->revoked))
			return false;
	} while (!atomic_compare_exchange_weak(&r->users, &u, u + 1));
	return true;
}

void
region_unuse(struct region *r)
{
	if (atomic_fetch_sub(&r->users, 1) != 1)
		return;
	/* Whatever its kind, an RDMA NIC lets go of its memory before the mapping goes. */
	if (gone_hook != NULL)
		gone_hook(r);
	if (r->ops != NULL)
		r->ops->close(r);
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
region_revoke(struct region *r)
{
	if (!atomic_exchange(&r->revoked, true))
		region_unuse(r);
}

/* Set once at start, before any region exists; called from any thread. */
void
region_on_gone(void (*fn)(struct region *))
{
	gone_hook = fn;
}
