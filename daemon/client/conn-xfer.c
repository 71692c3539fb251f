/*
 * Transfers: a Transfer message or an entry of the shared submission queue becomes one or
 * more engine jobs (xfer.c checks and builds them), or is refused with its tag; SegArea sets
 * the memfd that long segment lists are read from, and Cancel stops a tagged transfer.
 */
#include "config.h"

#include <stdlib.h>
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

/*
 * The jobs of one pass over a submission queue go to the engine together (conn_poll_sq): the
 * copy worker that takes them then contends for the engine's lock once per SUBMIT_BATCH, not
 * once per request.  Few enough that the first of a burst does not wait long for the rest.
 */
#define SUBMIT_BATCH 8
static struct job *batch[SUBMIT_BATCH];
static int nbatch = -1;            /* -1: no pass open, jobs are submitted one by one */

static void
batch_flush(void)
{
	if (nbatch > 0)
		engine_submit_many(batch, nbatch);
	nbatch = 0;
}

static void
submit(struct job *j)
{
	if (nbatch < 0) {
		engine_submit(j);
		return;
	}
	if (nbatch == SUBMIT_BATCH)
		batch_flush();
	batch[nbatch++] = j;
}

/*
 * The end of a transfer's building, now or once a task thread has checked its lists; t_recv:
 * when its message or submission came.
 */
static void
transfer_end(struct conn *c, uint32_t seq, uint64_t tag, double t_recv, int r, struct job *j, const char *err)
{
	if (r < 0) {
		cq_unreserve(c->cq);
		atomic_fetch_add(&c->cq->errors, 1);
		metrics_refused(c, -r);
		refuse(c, seq, tag, -r, err);
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
		j->t_recv = t_recv;
		submit(j);
		j = next;
	}
}

/*
 * A transfer whose lists a task thread checks (xfer.c): the connection's socket and queue wait
 * meanwhile (conn_input, conn_poll_sq), so that its requests keep their order, and what the
 * loop does for the request in any one turn stays short however long its list.
 */
struct tcheck {
	struct defer_task task;        /* queued through it (defer.c) */
	struct conn *c;
	struct cq *cq;               /* a reference: the credit was taken on it */
	struct xfer_check *k;
	uint32_t seq;
	uint64_t tag;
	double t_recv;
	bool area;                   /* its list lay in the segment area: consumed at its end */
};

static void
tcheck_work(void *arg)
{
	struct tcheck *tc = arg;

	xfer_check_run(tc->k);
}

static void
tcheck_done(void *arg)
{
	struct tcheck *tc = arg;
	struct conn *c = tc->c;
	struct job *j;
	char err[512];
	int r;

	c->checking = NULL;
	r = xfer_check_end(tc->k, c->state == CONN_DEAD, &j, err, sizeof(err));
	conn_settle(c);
	if (c->state == CONN_DEAD)
		cq_unreserve(tc->cq);        /* (refused: its jobs are gone) */
	else {
		conn_loop->pause(c, false);
		transfer_end(c, tc->seq, tc->tag, tc->t_recv, r, j, err);
		if (tc->area && c->state != CONN_DEAD)
			__atomic_fetch_add(&c->cq->ring->segs_consumed, 1, __ATOMIC_RELEASE);
		conn_poll_sq(c);             /* what was queued meanwhile */
		if (c->held != NULL)
			conn_input(c);           /* and a message kept behind it (its socket may say nothing more) */
	}
	cq_unref(tc->cq);
	free(tc);
}

/*
 * Handles a Transfer: built and handed to the engine, refused, or (true) left to a task
 * thread to check, which ends it later.
 */
static bool
transfer(struct conn *c, uint32_t seq, const Gpx__Transfer *m, int *fds, int nfds)
{
	struct xfer_check *later;
	struct tcheck *tc;
	struct job *j;
	char err[512];
	int r;

	/* The lines the credit and the charges below write, a copy worker's since the last end. */
	cq_warm(c->cq);
	budget_warm(c->cq, c->user);
	if (nfds > 1) {
		refuse(c, seq, m->tag, GPX__STATUS__EPROTO, "Transfer takes at most one fd");
		return false;
	}
	if (c->state == CONN_DRAINING) {
		refuse(c, seq, m->tag, GPX__STATUS__EDRAINING, "this client is being drained");
		return false;
	}
	if (atomic_load(&c->user->inflight) >= cfg->max_inflight_per_uid) {
		refuse(c, seq, m->tag, GPX__STATUS__EBUSY, "uid has its limit of outstanding transfers");
		return false;
	}
	if ((r = cq_reserve(c->cq)) < 0) {
		refuse(c, seq, m->tag, -r, r == -GPX__STATUS__EBUSY ? "no credit: completion ring would overflow" :
		    "completion ring broken");
		return false;
	}
	struct xfer_from from = { .client = c->id, .epoch = c->epoch, .version = c->version, .cq = c->cq,
		.entries = &c->entries, .user = c->user, .area = c->area, .area_len = c->area_len,
		.who = conn_who(c), .region = handle_region, .arg = c, .pairs = &c->pairs,
		.pairs_seen = &c->pairs_seen };
	r = xfer_build(&from, m, nfds ? &fds[0] : NULL, &j, &later, err, sizeof(err));
	if (later != NULL && (tc = malloc(sizeof(*tc))) == NULL) {
		/* (no memory to hand it over: checked here and now) */
		xfer_check_run(later);
		r = xfer_check_end(later, false, &j, err, sizeof(err));
		later = NULL;
	}
	if (later == NULL) {
		transfer_end(c, seq, m->tag, conn_last_input, r, j, err);
		return false;
	}
	*tc = (struct tcheck){ .c = c, .cq = c->cq, .k = later, .seq = seq, .tag = m->tag,
	    .t_recv = conn_last_input, .area = (m->seg_count > 0 || m->pair_count > 0) && nfds == 0 };
	cq_ref(c->cq);
	c->pending++;
	c->checking = later;
	conn_loop->pause(c, true);
	defer_run(&tc->task, tcheck_work, tcheck_done, tc);
	return true;
}

void
req_transfer(struct conn *c, uint32_t seq, const Gpx__Transfer *m, int *fds, int nfds)
{
	if (c->cq == NULL) {
		refuse(c, seq, m->tag, GPX__STATUS__EINVAL, "transfers need a completion ring");
		return;
	}
	/* Whatever became of it, its part of the segment area may be written again (now, or at its end). */
	if (!transfer(c, seq, m, fds, nfds) && (m->seg_count > 0 || m->pair_count > 0) && nfds == 0 &&
	    c->state != CONN_DEAD)
		__atomic_fetch_add(&c->cq->ring->segs_consumed, 1, __ATOMIC_RELEASE);
}

/* The seq of refusals of queued submissions, which came without a message of their own. */
#define SQ_SEQ 0xffffffffu

static struct conn *sq_from;    /* where the next pass over the queues begins; NULL: the first */
static bool sq_left;            /* a pass was cut at the turn's slice */

int
conn_poll_sq(struct conn *c)
{
	struct gpx_ring_hdr *h;
	uint64_t head, tail;
	int n = 0;

	c->sq_more = false;
	if (c->cq == NULL || c->state == CONN_DEAD || c->state == CONN_HELLO || c->checking != NULL)
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
	nbatch = 0;
	/* (one whose list goes to a task thread holds back those after it, as in conn_input) */
	while (head != tail && c->state != CONN_DEAD && c->checking == NULL) {
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
		if (loop_turn_over())
			break;
	}
	/* (cut at the turn's slice: the rest waits for the next pass, before any message of c's) */
	c->sq_more = head != tail && c->state != CONN_DEAD && c->checking == NULL;
	sq_left |= c->sq_more;
	batch_flush();
	nbatch = -1;
	if (c->state == CONN_DEAD)
		engine_cancel_client(c->id);   /* (it went with jobs of this pass not yet the engine's) */
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
 *
 * A pass ends at the turn's slice (loop_turn_over), within a queue or between two; the next
 * begins with the connection after the last one served, so that none waits behind the same
 * others every time, and the loop does not sleep before it (conn_sq_left).
 */
int
conn_poll_all(int mode)
{
	struct conn *c, *t;
	uint32_t left = conn_count();
	int n = 0;

	if (mode != SQ_POLL)
		TAILQ_FOREACH_SAFE(c, &conns, entry, t) {
			if (c->cq == NULL || c->state == CONN_HELLO)
				continue;
			__atomic_store_n(&c->cq->ring->sq_wakeup, mode == SQ_SLEEPING, __ATOMIC_RELAXED);
		}
	if (mode == SQ_SLEEPING)
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
	c = sq_from != NULL ? sq_from : TAILQ_FIRST(&conns);
	sq_from = NULL;
	for (; c != NULL && left > 0; left--) {
		struct conn *next = TAILQ_NEXT(c, entry) != NULL ? TAILQ_NEXT(c, entry) : TAILQ_FIRST(&conns);
		n += conn_poll_sq(c);
		if (c->held != NULL && !c->sq_more)
			conn_input(c);           /* a message kept behind what this pass took */
		if (c->state == CONN_DEAD && next == c)
			break;                   /* (it was the only one) */
		if (left > 1 && loop_turn_over()) {
			sq_from = next;
			sq_left = true;
			break;
		}
		c = next;
	}
	return n;
}

bool
conn_sq_left(void)
{
	bool was = sq_left;

	sq_left = false;
	return was;
}

bool
conn_sq_waiting(const struct conn *c)
{
	return c->cq != NULL && c->state != CONN_HELLO &&
	    __atomic_load_n(&c->cq->ring->sq_tail, __ATOMIC_ACQUIRE) != c->sq_head;
}

/*
 * Whether a connection still has submissions queued that gpxd has not taken, a message kept
 * behind them, or a transfer whose lists a task thread checks: a stop waits for them (up to
 * its deadline), so that each ends with its record or refusal, not with the connection.
 */
bool
conn_sq_pending(void)
{
	struct conn *c;

	TAILQ_FOREACH(c, &conns, entry) {
		if (c->state == CONN_DEAD || c->state == CONN_HELLO)
			continue;
		if (c->held != NULL || c->checking != NULL || conn_sq_waiting(c))
			return true;
	}
	return false;
}

void
conn_poll_forget(struct conn *c)
{
	if (sq_from == c)
		sq_from = TAILQ_NEXT(c, entry);
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
	/* (one a connection: a second takes the place of the first) */
	const bool first = c->area == NULL;
	if (first && (r = maps_take("segment area", err, sizeof(err))) < 0) {
		reply_err(c, seq, -r, err);
		return;
	}
	if ((r = xfer_set_area(&c->area, &c->area_len, fds[0], m->length, err, sizeof(err))) < 0) {
		if (first)
			maps_give();   /* (a failed one leaves the first in place) */
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

