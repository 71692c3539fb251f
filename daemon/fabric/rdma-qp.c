/*
 * The queue pairs to each peer, set up through rdma_cm.  Connection setup never trusts the
 * RDMA side on its own.  The control connection authenticates first (peer-auth.c); the
 * answering daemon then announces in Ready the port of its rdma_cm listener, a fresh 32-byte
 * random token and the address of each of its devices (fabric_rdma_offer), and the connecting
 * daemon opens a pool of RQP_POOL reliable-connected queue pairs to each of those addresses
 * (fabric_rdma_connect, from whichever of its devices the route leaves by), each with the
 * magic, the epoch, its index, its device and the token in the rdma_cm private data; the
 * acceptance says which device answered.  A request whose token, epoch and index do not match
 * a ready, announced connection is rejected and logged.  The queue pairs of a peer are shared
 * by every local client; chunks go to them round-robin (rdma-data.c), so that a large transfer
 * is striped over every rail, except GPU memory, which goes only through its GPU's NIC.
 *
 * Each queue pair gets its mailbox for the peer's notes when it is created (rdma-note.c), and
 * the two ends exchange the mailboxes' keys in the same private data.  A queue pair that fails
 * after it came up takes the whole peer down (its chunks fail, the connection comes back with
 * a new epoch); one that never came up only leaves the peer on tcp or on its other rails.
 * The peer's queue pairs go before its chunks fail (fabric_rdma_peer_down), so that no device
 * touches their buffers afterwards.
 */
#include "config.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <event2/bufferevent.h>

#include "daemon/fabric/rdma.h"

/* The rdma_cm private data of a connection request: what the control plane announced. */
struct rdma_hello {
	uint32_t magic;              /* big-endian, like the rest */
	uint32_t epoch;
	uint32_t index;              /* of the queue pair in the peer's pool */
	uint32_t dev;                /* the connecting side's device it runs on */
	uint8_t token[FABRIC_RDMA_TOKEN];
	uint32_t box;                /* the rkey of the connecting side's mailbox (0: none) */
} __attribute__((packed));

/* ... and of its acceptance: the answering side's device, whose keys the other side uses. */
struct rdma_welcome {
	uint32_t magic;
	uint32_t dev;
	uint32_t box;                /* the rkey of the answering side's mailbox (0: none) */
} __attribute__((packed));

/*
 * A daemon that has no mailbox sends neither key (its private data ends before it, or, on
 * InfiniBand and RoCE, is padded with zeros): its peer then sends it Notify messages.  The
 * hello must fit the 56 bytes rdma_cm carries in a connection request.
 */
#define HELLO_MIN offsetof(struct rdma_hello, box)
#define WELCOME_MIN offsetof(struct rdma_welcome, box)
_Static_assert(sizeof(struct rdma_hello) <= 56, "rdma_cm private data of a request");

/* ---- connection ids let go of off the loop ---- */

/*
 * rdma_destroy_id waits in the kernel until the connection manager lets go of the id, which
 * after a peer vanished can be as long as the manager's own retries (other rdma_cm programs
 * have been seen waiting there).  Once, when the link under one rail went down during a
 * stream of copies (tests/vm-rdma.test, Soft-RoCE), the teardown of the peer's queue pairs
 * held the event loop for 52 s: the copies the link had failed, every client and the
 * cluster's lease (which ended) waited with it.  The ids of queue pairs torn down go to a
 * thread of their own, which destroys them one after the other; their queue pairs are
 * destroyed on the loop first (qp_teardown), so that no device touches a chunk's buffer once
 * the chunk has failed.  An id given away has no context: its events still reaching the loop
 * are acked and dropped (rqp_cm), and its destruction waits for those acks, never for the
 * loop.  Each teardown call that takes longer than SLOW_S, on the loop or on that thread, is
 * logged with its time, so that what waits is named.
 */
#define RELEASE_MAX 256               /* ids waiting for the thread; beyond, destroyed here */
#define SLOW_S 0.5
static struct {
	pthread_mutex_t lock;
	pthread_cond_t cond;          /* work for the thread; the thread idle, for rqp_release_stop */
	pthread_t thread;
	bool running, quit, busy;
	struct rdma_cm_id *q[RELEASE_MAX];
	unsigned head, n;
} rel = { .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER };

/* Logs a teardown call that took longer than SLOW_S. */
static void
slow(const char *call, double t0)
{
	double dt = now_s() - t0;

	if (dt > SLOW_S)
		log_warnx("fabric: %s took %.1f s", call, dt);
}

static void *
release_main(void *unused)
{
	(void)unused;
	thread_name("rdma-ids");
	pthread_mutex_lock(&rel.lock);
	for (;;) {
		while (rel.n == 0 && !rel.quit)
			pthread_cond_wait(&rel.cond, &rel.lock);
		if (rel.n == 0)
			break;
		struct rdma_cm_id *id = rel.q[rel.head];
		rel.head = (rel.head + 1) % RELEASE_MAX;
		rel.n--;
		rel.busy = true;
		pthread_mutex_unlock(&rel.lock);
		double t0 = now_s();
		rdma_destroy_id(id);
		slow("letting go of an rdma connection id (its own thread)", t0);
		pthread_mutex_lock(&rel.lock);
		rel.busy = false;
		pthread_cond_broadcast(&rel.cond);
	}
	pthread_mutex_unlock(&rel.lock);
	return NULL;
}

void
rqp_release_start(void)
{
	rel.quit = false;
	if (pthread_create(&rel.thread, NULL, release_main, NULL) == 0)
		rel.running = true;
	else
		log_warnx("fabric: no thread to let go of rdma connection ids: the loop does it");
}

bool
rqp_release_stop(double wait_s)
{
	const double end = now_s() + wait_s;
	bool idle;

	if (!rel.running)
		return true;
	pthread_mutex_lock(&rel.lock);
	rel.quit = true;
	pthread_cond_broadcast(&rel.cond);
	while (!(idle = rel.n == 0 && !rel.busy) && now_s() < end) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += 50000000;
		if (ts.tv_nsec >= 1000000000) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000;
		}
		pthread_cond_timedwait(&rel.cond, &rel.lock, &ts);
	}
	pthread_mutex_unlock(&rel.lock);
	if (!idle) {
		log_warnx("fabric: %u rdma connection ids still being let go of at the stop: left to the kernel",
		    rel.n + rel.busy);
		return false;
	}
	pthread_join(rel.thread, NULL);
	rel.running = false;
	return true;
}

/* Id goes: to the thread, its context cleared first (loop thread). */
static void
id_release(struct rdma_cm_id *id)
{
	id->context = NULL;
	pthread_mutex_lock(&rel.lock);
	if (rel.running && !rel.quit && rel.n < RELEASE_MAX) {
		rel.q[(rel.head + rel.n) % RELEASE_MAX] = id;
		rel.n++;
		pthread_cond_broadcast(&rel.cond);
		id = NULL;
	}
	pthread_mutex_unlock(&rel.lock);
	if (id != NULL) {
		double t0 = now_s();
		rdma_destroy_id(id);
		slow("letting go of an rdma connection id (the loop)", t0);
	}
}

/* ---- queue pairs ---- */

static void
qp_teardown(struct rqp *q)
{
	double t0;

	if (q->id == NULL)
		return;
	t0 = now_s();
	if (q->up)
		rdma_disconnect(q->id);
	slow("rdma_disconnect", t0);
	if (q->id->qp != NULL) {
		t0 = now_s();
		rdma_destroy_qp(q->id);
		slow("destroying an rdma queue pair", t0);
		rdevs.d[q->dev].cq_used -= RQP_DEPTH + RQP_NOTES;     /* counted by qp_create */
	}
	id_release(q->id);
	/* The queue pair is gone: the device writes no more into its mailbox. */
	if (q->box_mr != NULL)
		ibv_dereg_mr(q->box_mr);
	free(q->box);
	q->id = NULL;
	q->up = q->inl = false;
	q->wrs = q->wseq = q->rseq = q->rbox = 0;
	q->box = NULL;
	q->box_mr = NULL;
}

static struct rpeer *
rpeer_get(struct peer *p)
{
	if (p->rdma == NULL && (p->rdma = calloc(1, sizeof(*p->rdma))) != NULL) {
		p->rdma->p = p;
		for (int i = 0; i < RQP_MAX; i++) {
			p->rdma->qp[i].rp = p->rdma;
			p->rdma->qp[i].idx = i;
			p->rdma->qp[i].dev = p->rdma->qp[i].rdev = -1;
		}
	}
	return p->rdma;
}

/*
 * A queue pair failed.  One that was up takes the whole peer down: its chunks fail now and
 * the connection comes back with a new epoch.  One that never came up only leaves the peer
 * on tcp or on its other rails: a rail whose link is down when the connection comes (after
 * that link took the last one down, say) is not used by this connection, the others are.
 */
void
rqp_fail(struct rqp *q, const char *why)
{
	struct rpeer *rp = q->rp;
	struct peer *p = rp->p;

	if (q->up) {
		peer_kill(p, "rdma queue pair %d: %s", q->idx, why);
		return;
	}
	log_info("fabric: peer %s: rdma queue pair %d not connected (%s)", p->node, q->idx, why);
	qp_teardown(q);
}

/*
 * The queue pair on the device rdma_cm routed it to, which must be the one it was meant for,
 * while that device's completion queue has room for every request it may post.
 */
static int
qp_create(struct rqp *q)
{
	struct rdev *d = rdev_of(q->id->verbs);

	if (d == NULL || (q->dev >= 0 && q->dev != d->index)) {
		errno = ENODEV;          /* routed to another device than the one we registered on */
		return -1;
	}
	if (d->cq_used + RQP_DEPTH + RQP_NOTES > d->cq->cqe) {
		log_warnx("fabric: %s: its completion queue (%d entries) holds no more queue pairs", d->name,
		    d->cq->cqe);
		errno = ENOSPC;
		return -1;
	}
	q->dev = d->index;
	struct ibv_qp_init_attr a = {
		.send_cq = d->cq, .recv_cq = d->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
		.cap = { .max_send_wr = RQP_DEPTH, .max_recv_wr = RQP_NOTES, .max_send_sge = 1, .max_recv_sge = 1,
		    .max_inline_data = sizeof(struct note) },
	};
	if (rdma_create_qp(q->id, d->pd, &a) < 0) {
		/* A device that sends nothing inline: no notes from this end, data as before. */
		a.cap.max_inline_data = 0;
		if (rdma_create_qp(q->id, d->pd, &a) < 0)
			return -1;
	}
	q->inl = a.cap.max_inline_data >= sizeof(struct note);
	d->cq_used += RQP_DEPTH + RQP_NOTES;
	rnote_box_open(q, d);
	return 0;
}

/* Before connect or accept: the ack timeout its queue pair gets (see RQP_ACK_TIMEOUT). */
static void
ack_timeout(struct rdma_cm_id *id)
{
	uint8_t t = RQP_ACK_TIMEOUT;

	if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof(t)) < 0)
		log_debug("fabric", "rdma ack timeout not set: %s", strerror(errno));
}

/* The rdma_cm parameters of connecting or accepting q, with pd as private data. */
static void
qp_param(struct rdma_conn_param *cp, const struct rqp *q, const void *pd, size_t pdl)
{
	memset(cp, 0, sizeof(*cp));
	cp->private_data = pd;
	cp->private_data_len = (uint8_t)pdl;
	cp->responder_resources = rdevs.d[q->dev].rd_atom;
	cp->initiator_depth = rdevs.d[q->dev].rd_atom;
	cp->retry_count = 7;
	cp->rnr_retry_count = 7;
}

static void
qp_established(struct rqp *q)
{
	struct rpeer *rp = q->rp;
	int n = 0, want = 0;

	q->up = true;
	for (int i = 0; i < RQP_MAX; i++) {
		n += rp->qp[i].up;
		want += rp->qp[i].id != NULL;
	}
	log_debug("fabric", "peer %s: rdma queue pair %d up on %s (its device %d)", rp->p->node, q->idx,
	    rdevs.d[q->dev].name, q->rdev);
	if (n == want || !rp->said_up)
		log_info("fabric: peer %s (epoch %08x): transport rdma, %d of %d queue pairs on %s", rp->p->node,
		    rp->p->epoch, n, want, rdevs.names);
	rp->said_up = true;
	request_kick();
}

/* ---- rdma_cm events ---- */

/* The inbound side: a connection request is accepted only as announced on a control connection. */
static void
on_request(struct rdma_cm_id *id, const uint8_t *pd, size_t pdl)
{
	struct rdma_hello h;
	struct rdma_welcome w;
	struct rdma_conn_param cp;
	struct peer *p = NULL;
	struct rdev *d = rdev_of(id->verbs);
	const char *why = NULL;
	uint32_t idx = 0;

	memset(&h, 0, sizeof(h));
	if (pdl < HELLO_MIN)
		why = "no gpx private data";
	else {
		memcpy(&h, pd, pdl < sizeof(h) ? pdl : sizeof(h));
		idx = ntohl(h.index);
		if (ntohl(h.magic) != RDMA_MAGIC)
			why = "no gpx private data";
		else if (idx >= RQP_MAX || ntohl(h.dev) >= FABRIC_RDMA_DEVS)
			why = "queue pair or device index out of range";
		else if (d == NULL)
			why = "it arrived on a device this gpxd does not use";
		else {
			TAILQ_FOREACH(p, &peers, entry)
				if (p->state == PEER_READY && !p->outbound && p->epoch == ntohl(h.epoch) &&
				    p->rdma != NULL && p->rdma->offered &&
				    hmac_equal(p->rdma->token, h.token, FABRIC_RDMA_TOKEN))
					break;
			if (p == NULL)
				why = "not announced on an authenticated control connection";
			else if (p->rdma->qp[idx].id != NULL)
				why = "that queue pair is connected already";
		}
	}
	if (why != NULL) {
		char a[64] = "?";
		struct sockaddr *sa = rdma_get_peer_addr(id);
		if (sa != NULL && sa->sa_family == AF_INET)
			inet_ntop(AF_INET, &((struct sockaddr_in *)sa)->sin_addr, a, sizeof(a));
		else if (sa != NULL && sa->sa_family == AF_INET6)
			inet_ntop(AF_INET6, &((struct sockaddr_in6 *)sa)->sin6_addr, a, sizeof(a));
		log_warnx("fabric: rdma connection request from %s refused: %s", a, why);
		rdma_reject(id, NULL, 0);
		id_release(id);
		return;
	}
	struct rqp *q = &p->rdma->qp[idx];
	q->id = id;
	q->dev = d->index;
	q->rdev = (int)ntohl(h.dev);
	q->rbox = ntohl(h.box);
	id->context = q;
	ack_timeout(id);
	if (qp_create(q) == 0) {
		w.magic = htonl(RDMA_MAGIC);
		w.dev = htonl((uint32_t)d->index);
		w.box = htonl(q->box_mr != NULL ? q->box_mr->rkey : 0);
		qp_param(&cp, q, &w, sizeof(w));
	}
	if (q->id->qp == NULL || rdma_accept(id, &cp) < 0) {
		log_warn("fabric: peer %s: accepting rdma queue pair %u", p->node, idx);
		rdma_reject(id, NULL, 0);
		qp_teardown(q);
	}
}

/* One event of the channel; q: its id's context as it was before the event was acked. */
static void
cm_event(const struct rdma_cm_event *e, struct rqp *q, const uint8_t *pd, size_t pdl)
{
	struct rdma_conn_param cp;
	struct rdma_hello h;
	struct rdma_welcome w;

	if (e->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
		on_request(e->id, pd, pdl);
		return;
	}
	if (q == NULL)
		return;
	switch (e->event) {
	case RDMA_CM_EVENT_ADDR_RESOLVED:
		if (rdma_resolve_route(q->id, CM_TIMEOUT_MS) < 0)
			rqp_fail(q, strerror(errno));
		break;
	case RDMA_CM_EVENT_ROUTE_RESOLVED:
		if (qp_create(q) < 0) {
			rqp_fail(q, strerror(errno));
			break;
		}
		h.magic = htonl(RDMA_MAGIC);
		h.epoch = htonl(q->rp->p->epoch);
		h.index = htonl((uint32_t)q->idx);
		h.dev = htonl((uint32_t)q->dev);
		memcpy(h.token, q->rp->token, sizeof(h.token));
		h.box = htonl(q->box_mr != NULL ? q->box_mr->rkey : 0);
		qp_param(&cp, q, &h, sizeof(h));
		ack_timeout(q->id);
		if (rdma_connect(q->id, &cp) < 0)
			rqp_fail(q, strerror(errno));
		break;
	case RDMA_CM_EVENT_ESTABLISHED:
		/* The outbound side learns here which of the peer's devices answered. */
		if (q->rdev < 0) {
			memset(&w, 0, sizeof(w));
			if (pdl >= WELCOME_MIN)
				memcpy(&w, pd, pdl < sizeof(w) ? pdl : sizeof(w));
			if (pdl < WELCOME_MIN || ntohl(w.magic) != RDMA_MAGIC || ntohl(w.dev) >= FABRIC_RDMA_DEVS) {
				rqp_fail(q, "accepted without saying on which device");
				break;
			}
			q->rdev = (int)ntohl(w.dev);
			q->rbox = ntohl(w.box);
		}
		qp_established(q);
		break;
	case RDMA_CM_EVENT_ADDR_ERROR:
	case RDMA_CM_EVENT_ROUTE_ERROR:
	case RDMA_CM_EVENT_CONNECT_ERROR:
	case RDMA_CM_EVENT_UNREACHABLE:
	case RDMA_CM_EVENT_REJECTED:
	case RDMA_CM_EVENT_DISCONNECTED:
	case RDMA_CM_EVENT_DEVICE_REMOVAL:
		rqp_fail(q, rdma_event_str(e->event));
		break;
	default:
		break;
	}
}

void
rqp_cm(evutil_socket_t fd, short what, void *arg)
{
	struct rdma_cm_event *ev;

	(void)fd;
	(void)what;
	(void)arg;
	while (rdevs.ech != NULL && rdma_get_cm_event(rdevs.ech, &ev) == 0) {
		/*
		 * Acked before acting: acting may destroy the id, which waits for its events' acks.
		 * Its context is read before: an id given away (id_release) may be freed by its
		 * thread once this event is acked.
		 */
		struct rdma_cm_event e = *ev;
		struct rqp *q = ev->event != RDMA_CM_EVENT_CONNECT_REQUEST && ev->id != NULL ? ev->id->context : NULL;
		uint8_t pd[64];
		size_t pdl = 0;
		if ((e.event == RDMA_CM_EVENT_CONNECT_REQUEST || e.event == RDMA_CM_EVENT_ESTABLISHED) &&
		    ev->param.conn.private_data != NULL) {
			pdl = ev->param.conn.private_data_len < sizeof(pd) ? ev->param.conn.private_data_len : sizeof(pd);
			memcpy(pd, ev->param.conn.private_data, pdl);
		}
		rdma_ack_cm_event(ev);
		cm_event(&e, q, pd, pdl);
	}
}

struct rqp *
rqp_by_num(const struct rdev *d, uint32_t num)
{
	struct peer *p;

	TAILQ_FOREACH(p, &peers, entry)
		for (int i = 0; p->rdma != NULL && i < RQP_MAX; i++) {
			struct rqp *q = &p->rdma->qp[i];
			if (q->id != NULL && q->id->qp != NULL && q->dev == d->index && q->id->qp->qp_num == num)
				return q;
		}
	return NULL;
}

/* ---- what the rest of the fabric calls ---- */

bool
fabric_rdma_offer(struct peer *p, uint32_t *port, uint8_t token[FABRIC_RDMA_TOKEN],
    struct peer_rdev devs[FABRIC_RDMA_DEVS], size_t *ndevs)
{
	struct rpeer *rp;

	*ndevs = 0;
	if (!rdevs.on || rdevs.port == 0 || (rp = rpeer_get(p)) == NULL)
		return false;
	if (getrandom(rp->token, sizeof(rp->token), 0) != (ssize_t)sizeof(rp->token))
		return false;
	rp->offered = true;
	memcpy(token, rp->token, FABRIC_RDMA_TOKEN);
	*port = rdevs.port;
	for (int i = 0; i < rdevs.n; i++)
		if (rdevs.d[i].addr[0] != '\0') {
			devs[*ndevs].index = (uint32_t)i;
			snprintf(devs[*ndevs].addr, sizeof(devs[0].addr), "%s", rdevs.d[i].addr);
			(*ndevs)++;
		}
	return true;
}

static bool
sockaddr_of(const char *addr, uint16_t port, struct sockaddr_storage *ss)
{
	struct addrinfo hints = { .ai_flags = AI_NUMERICHOST }, *res = NULL;

	if (getaddrinfo(addr, NULL, &hints, &res) != 0 || res->ai_addrlen > sizeof(*ss)) {
		if (res != NULL)
			freeaddrinfo(res);
		return false;
	}
	memset(ss, 0, sizeof(*ss));
	memcpy(ss, res->ai_addr, res->ai_addrlen);
	freeaddrinfo(res);
	if (ss->ss_family == AF_INET)
		((struct sockaddr_in *)ss)->sin_port = htons(port);
	else
		((struct sockaddr_in6 *)ss)->sin6_port = htons(port);
	return true;
}

/* Opens a pool of queue pairs to dst (from src, or NULL: as routed). */
static void
open_pool(struct rpeer *rp, int pool, struct sockaddr *src, struct sockaddr *dst)
{
	for (int i = 0; i < RQP_POOL; i++) {
		struct rqp *q = &rp->qp[pool * RQP_POOL + i];
		if (rdma_create_id(rdevs.ech, &q->id, q, RDMA_PS_TCP) < 0) {
			q->id = NULL;
			log_warn("fabric: peer %s: rdma_create_id", rp->p->node);
			continue;
		}
		if (rdma_resolve_addr(q->id, src, dst, CM_TIMEOUT_MS) < 0)
			rqp_fail(q, strerror(errno));
	}
}

/*
 * One pool of queue pairs to each device the peer announced, each from whichever of our
 * devices the route to it leaves by (rails: NIC k reaches the peer's NIC k on its own
 * network).  A peer that announced none: one pool to the address of the control connection.
 */
void
fabric_rdma_connect(struct peer *p, uint32_t port, const uint8_t *token, size_t tokenlen,
    const struct peer_rdev *devs, size_t ndevs)
{
	struct sockaddr_storage src, dst;
	socklen_t sl = sizeof(src), dl = sizeof(dst);
	int fd = p->bev != NULL ? bufferevent_getfd(p->bev) : -1, pools = 0;
	struct rpeer *rp;

	if (!rdevs.on || port == 0 || port > 65535 || tokenlen != FABRIC_RDMA_TOKEN) {
		if (rdevs.on)
			log_info("fabric: peer %s offers no rdma: data over tcp", p->node);
		return;
	}
	if ((rp = rpeer_get(p)) == NULL)
		return;
	memcpy(rp->token, token, FABRIC_RDMA_TOKEN);
	for (size_t k = 0; k < ndevs && pools < FABRIC_RDMA_DEVS; k++)
		if (sockaddr_of(devs[k].addr, (uint16_t)port, &dst)) {
			log_info("fabric: peer %s: rdma to %s (its device %u)", p->node, devs[k].addr, devs[k].index);
			open_pool(rp, pools++, NULL, (struct sockaddr *)&dst);
		}
	if (pools > 0)
		return;
	if (fd < 0 || getsockname(fd, (struct sockaddr *)&src, &sl) < 0 ||
	    getpeername(fd, (struct sockaddr *)&dst, &dl) < 0)
		return;
	if (src.ss_family == AF_INET) {
		((struct sockaddr_in *)&src)->sin_port = 0;
		((struct sockaddr_in *)&dst)->sin_port = htons((uint16_t)port);
	} else {
		((struct sockaddr_in6 *)&src)->sin6_port = 0;
		((struct sockaddr_in6 *)&dst)->sin6_port = htons((uint16_t)port);
	}
	open_pool(rp, 0, (struct sockaddr *)&src, (struct sockaddr *)&dst);
}

/* Before the peer's chunks fail: afterwards the device touches none of their buffers. */
void
fabric_rdma_peer_down(struct peer *p)
{
	struct rpeer *rp = p->rdma;

	if (rp == NULL)
		return;
	p->rdma = NULL;
	for (int i = 0; i < RQP_MAX; i++)
		qp_teardown(&rp->qp[i]);
	free(rp);
}

uint32_t
fabric_rdma_qps(const struct peer *p)
{
	uint32_t n = 0;

	for (int i = 0; p->rdma != NULL && i < RQP_MAX; i++)
		n += p->rdma->qp[i].up;
	return n;
}

