/*
 * Other nodes' memory as regions: the memory kind `remote`.  A client that imported
 * "NODE:name" (peer-import.c) holds a region of this kind; its r->priv (struct remote) names
 * the peer node, the epoch of the connection it came through and the peer's handle, and, when
 * the owner registered the export for RDMA, its address and keys.  Nothing is mapped here: the
 * bytes move by request.c.  A transfer with a remote side is checked here before it becomes a
 * job (remote_xfer_check: its connection must still be the one it was imported through, else
 * EREVOKED).  When the region's last user lets go, on whatever thread, the peer is told with a
 * Release, sent from the loop thread: the release is queued under a lock and the loop woken.
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/fabric/internal.h"

/* Releases queued by threads other than the loop's: each its import's own record. */
static pthread_mutex_t rlock = PTHREAD_MUTEX_INITIALIZER;
static TAILQ_HEAD(, remote) rels = TAILQ_HEAD_INITIALIZER(rels);
static bool running;             /* releases may be queued (rlock) */

/* ---- the `remote` memory kind ---- */

static int
remote_open(struct region *r, char *err, size_t errlen)
{
	(void)r;
	snprintf(err, errlen, "remote regions come from importing NODE:name, not from registration");
	return -GPX__STATUS__ENOTSUP;
}

/*
 * Any thread: the last user let go; tell the peer, from the loop thread.  The import's own
 * record is queued, so that letting go allocates nothing (a Release lost would keep the
 * peer's handle until the connection ends).
 */
static void
remote_close(struct region *r)
{
	struct remote *rm = r->priv;

	if (rm == NULL)
		return;
	r->priv = NULL;
	pthread_mutex_lock(&rlock);
	if (running) {
		TAILQ_INSERT_TAIL(&rels, rm, rel);
		request_kick();
		rm = NULL;
	}
	pthread_mutex_unlock(&rlock);
	free(rm);
}

static const struct mem_ops mem_remote_ops = {
	.name = "remote",
	.open = remote_open,
	.close = remote_close,
};

struct region *
remote_region(struct peer *p, uint64_t handle, uint64_t length, bool read_only)
{
	struct region *r = region_new();
	struct remote *rm = calloc(1, sizeof(*rm));

	if (r == NULL || rm == NULL) {
		free(r);
		free(rm);
		return NULL;
	}
	snprintf(rm->node, sizeof(rm->node), "%s", p->node);
	rm->epoch = p->epoch;
	rm->handle = handle;
	r->ops = &mem_remote_ops;
	r->kind = GPX__MEM_KIND__MEM_REMOTE;
	r->dev = DEV_HOST;
	r->length = length;
	r->read_only = read_only;
	r->priv = rm;
	p->nimports++;
	return r;
}

/* xfer.c (the hook): what a transfer with a remote side needs, checked before it becomes a job. */
int
remote_xfer_check(const struct region *src, const struct region *dst, char *err, size_t errlen)
{
	bool rs = src->kind == GPX__MEM_KIND__MEM_REMOTE, rd = dst->kind == GPX__MEM_KIND__MEM_REMOTE;
	const struct remote *rm = (rs ? src : dst)->priv;
	struct peer *p;

	if (!rs && !rd)
		return 0;
	if (rs && rd) {
		/*
		 * Staging through this node would move every byte twice over the network and hold
		 * a local buffer as large as the copy; handing the copy to one of the nodes would
		 * need that node to hold an import of the other's export.  Neither is done: the
		 * client copies through a region of its own, which it sizes and can reuse.
		 */
		const struct remote *sm = src->priv, *dm = dst->priv;
		snprintf(err, errlen, "both regions are on other nodes (%s and %s): gpxd copies only between "
		    "this node and another; copy into a region of this node, then out of it",
		    sm ? sm->node : "?", dm ? dm->node : "?");
		return -GPX__STATUS__ENOTSUP;
	}
	if (rm == NULL || (p = peer_by_epoch(rm->node, rm->epoch)) == NULL) {
		snprintf(err, errlen, "the connection to peer %s this region was imported through has "
		    "ended: import it again", rm ? rm->node : "?");
		return -GPX__STATUS__EREVOKED;
	}
	return 0;
}

/* ---- releases ---- */

int
remote_release(const char *n, uint32_t epoch, uint64_t handle)
{
	struct peer *p = peer_by_epoch(n, epoch);

	if (p == NULL)
		return 0;        /* that connection is gone, and its handles with it */
	if (peer_import_let_go(p, handle) == -ENOMEM)
		return -ENOMEM;
	if (p->nimports > 0)
		p->nimports--;
	return 0;
}

void
remote_flush(void)
{
	TAILQ_HEAD(, remote) todo = TAILQ_HEAD_INITIALIZER(todo), again = TAILQ_HEAD_INITIALIZER(again);
	struct remote *rm;

	pthread_mutex_lock(&rlock);
	TAILQ_CONCAT(&todo, &rels, rel);
	pthread_mutex_unlock(&rlock);
	while ((rm = TAILQ_FIRST(&todo)) != NULL) {
		TAILQ_REMOVE(&todo, rm, rel);
		/* one that found no memory goes again at the tick */
		if (remote_release(rm->node, rm->epoch, rm->handle) == -ENOMEM)
			TAILQ_INSERT_TAIL(&again, rm, rel);
		else
			free(rm);
	}
	pthread_mutex_lock(&rlock);
	TAILQ_CONCAT(&rels, &again, rel);
	pthread_mutex_unlock(&rlock);
}

void
remote_start(void)
{
	pthread_mutex_lock(&rlock);
	running = true;
	pthread_mutex_unlock(&rlock);
}

void
remote_stop(void)
{
	struct remote *rm;

	pthread_mutex_lock(&rlock);
	running = false;
	while ((rm = TAILQ_FIRST(&rels)) != NULL) {
		TAILQ_REMOVE(&rels, rm, rel);
		free(rm);
	}
	pthread_mutex_unlock(&rlock);
}
