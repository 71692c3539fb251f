/*
 * Transfers: a Transfer message or an entry of the shared submission queue becomes one or
 * more engine jobs (xfer.c checks and builds them), or is refused with its tag; SegArea sets
 * the memfd that long segment lists are read from, and Cancel stops a tagged transfer.
 */
#include "config.h"

#include <string.h>

#include "daemon/client/conn-private.h"

/* ---- transfers ---- */

/* Refuses a transfer on the socket (it has no ring slot) with its tag. */
static void
refuse(struct conn *c, uint32_t seq, uint64_t tag, int status, const char *why)
{
	Gpx__Reply rep = GPX__REPLY__INIT;

	rep.tag = tag;
	conn_reply(c, seq, status, why, &rep, NULL, 0);
}

/* The region a connection's id names, for xfer_build; NULL if it has no such handle. */
static struct region *
handle_region(void *arg, uint64_t id, bool *read_only)
{
	struct rhandle *h = conn_handle(arg, id);

	if (h == NULL)
		return NULL;
	*read_only = h->read_only;
	return h->r;
}

/* Handles a Transfer; returns once its segments have been copied in or it was refused. */
static void
transfer(struct conn *c, uint32_t seq, const Gpx__Transfer *m, int *fds, int nfds)
{
	struct job *j;
	char err[512];
	int r;

	if (nfds > 1) {
		refuse(c, seq, m->tag, GPX__STATUS__EPROTO, "Transfer takes at most one fd");
		return;
	}
	if (c->state == CONN_DRAINING) {
		refuse(c, seq, m->tag, GPX__STATUS__EDRAINING, "this client is being drained");
		return;
	}
	if (atomic_load(&c->user->inflight) >= cfg->max_inflight_per_uid) {
		refuse(c, seq, m->tag, GPX__STATUS__EBUSY, "uid has its limit of outstanding transfers");
		return;
	}
	if ((r = cq_reserve(c->cq)) < 0) {
		refuse(c, seq, m->tag, -r, r == -GPX__STATUS__EBUSY ? "no credit: completion ring would overflow" :
		    "completion ring broken");
		return;
	}
	struct xfer_from from = { .client = c->id, .epoch = c->epoch, .version = c->version, .cq = c->cq,
		.user = c->user, .area = c->area, .area_len = c->area_len, .who = conn_who(c),
		.region = handle_region, .arg = c };
	if ((r = xfer_build(&from, m, nfds ? fds[0] : -1, &j, err, sizeof(err))) < 0) {
		cq_unreserve(c->cq);
		atomic_fetch_add(&c->cq->errors, 1);
		metrics_refused(c, -r);
		refuse(c, seq, m->tag, -r, err);
		return;
	}
	/* One transfer, one credit; a batch over several paths is one job per path. */
	atomic_fetch_add(&c->user->inflight, 1);
	while (j != NULL) {
		struct job *next = j->gnext;
		j->gnext = NULL;
		cq_ref(c->cq);
		j->cq = c->cq;
		j->user = c->user;
		j->t_recv = conn_last_input;
		engine_submit(j);
		j = next;
	}
}

void
req_transfer(struct conn *c, uint32_t seq, const Gpx__Transfer *m, int *fds, int nfds)
{
	if (c->cq == NULL) {
		refuse(c, seq, m->tag, GPX__STATUS__EINVAL, "transfers need a completion ring");
		return;
	}
	transfer(c, seq, m, fds, nfds);
	/* Whatever became of it, its part of the segment area may be written again. */
	if ((m->seg_count > 0 || m->pair_count > 0) && nfds == 0 && c->state != CONN_DEAD)
		__atomic_fetch_add(&c->cq->ring->segs_consumed, 1, __ATOMIC_RELEASE);
}

/* The seq of refusals of queued submissions, which came without a message of their own. */
#define SQ_SEQ 0xffffffffu

int
conn_poll_sq(struct conn *c)
{
	struct gpx_ring_hdr *h;
	uint64_t head, tail;
	int n = 0;

	if (c->cq == NULL || c->state == CONN_DEAD || c->state == CONN_HELLO)
		return 0;
	h = c->cq->ring;
	head = c->sq_head;
	tail = __atomic_load_n(&h->sq_tail, __ATOMIC_ACQUIRE);
	if (tail == head)
		return 0;
	if (tail - head > c->cq->entries) {
		log_audit(c, "submission queue tail %llu is not within %u of %llu", (unsigned long long)tail,
		    c->cq->entries, (unsigned long long)head);
		conn_kill(c, "submission queue corrupted");
		return 0;
	}
	c->t_last = conn_last_input = now_s();
	while (head != tail && c->state != CONN_DEAD) {
		struct gpx_sqe e;
		Gpx__Transfer t = GPX__TRANSFER__INIT;
		Gpx__Segment seg = GPX__SEGMENT__INIT, *sp = &seg;

		/* One read of the shared entry; everything below looks at the private copy. */
		memcpy(&e, gpx_sq_slot(h, c->cq->entries, head), sizeof(e));
		head++;
		t.tag = e.tag;
		t.flags = e.flags;
		t.src_region = e.src_region;
		t.dst_region = e.dst_region;
		seg.src_offset = e.src_offset;
		seg.dst_offset = e.dst_offset;
		seg.length = e.length;
		t.n_segments = 1;
		t.segments = &sp;
		transfer(c, SQ_SEQ, &t, NULL, 0);
		n++;
	}
	c->sq_head = head;
	if (c->state != CONN_DEAD)
		__atomic_store_n(&h->sq_head, head, __ATOMIC_RELEASE);
	return n;
}

/*
 * Polls every connection's submission queue.  SQ_POLLING first tells the clients they need not
 * kick; SQ_SLEEPING tells them they must (the loop is about to block) and reads the queues
 * again after a full fence, so a submission published at that moment is either seen here or
 * followed by its client's kick.
 */
int
conn_poll_all(int mode)
{
	struct conn *c, *t;
	int n = 0;

	if (mode != SQ_POLL)
		TAILQ_FOREACH_SAFE(c, &conns, entry, t) {
			if (c->cq == NULL || c->state == CONN_HELLO)
				continue;
			__atomic_store_n(&c->cq->ring->sq_wakeup, mode == SQ_SLEEPING, __ATOMIC_RELAXED);
		}
	if (mode == SQ_SLEEPING)
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
	TAILQ_FOREACH_SAFE(c, &conns, entry, t)
		n += conn_poll_sq(c);
	return n;
}

void
req_seg_area(struct conn *c, uint32_t seq, const Gpx__SegArea *m, int *fds, int nfds)
{
	char err[256];
	int r;

	if (nfds != 1) {
		reply_err(c, seq, GPX__STATUS__EPROTO, "SegArea takes exactly one memfd");
		return;
	}
	if ((r = xfer_set_area(&c->area, &c->area_len, fds[0], m->length, err, sizeof(err))) < 0) {
		log_audit(c, "segment area: %s", err);
		reply_err(c, seq, -r, err);
		return;
	}
	reply_err(c, seq, 0, NULL);
}

void
req_cancel(struct conn *c, uint32_t seq, const Gpx__Cancel *m)
{
	int n = engine_cancel(c->id, m->tag);

	reply_err(c, seq, n > 0 ? 0 : GPX__STATUS__ENOENT, n > 0 ? NULL : "no transfer with that tag in flight");
}

