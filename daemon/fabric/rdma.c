/*
 * The RDMA data transport of the fabric: the only file that includes <infiniband/verbs.h> and
 * <rdma/rdma_cma.h>.  daemon/fabric/request.c decides what moves; this file moves it with one-sided
 * RDMA WRITE and RDMA READ between registered host memory of two nodes, when both daemons
 * have an RDMA device up ([fabric] transport = auto or rdma), and otherwise says no, so that
 * request.c sends Write and Read messages over the control connection instead.
 *
 * Devices.  Every RDMA device with an active port is opened (or those [fabric] rdma_device
 * names), each with its protection domain, completion queue and events: the NICs of a node,
 * its rails.  Memory is registered per device.
 *
 * Connection setup never trusts the RDMA side on its own.  The control connection
 * (daemon/fabric/peer.c) authenticates first; the answering daemon then announces in Ready the port
 * of its rdma_cm listener, a fresh 32-byte random token and the address of each of its
 * devices, and the connecting daemon opens a pool of RQP_POOL reliable-connected queue pairs
 * to each of those addresses (from whichever of its devices the route leaves by), each with
 * the magic, the epoch, its index, its device and the token in the rdma_cm private data; the
 * acceptance says which device answered.  A request whose token, epoch and index do not match
 * a ready, announced connection is rejected and logged.  The queue pairs of a peer are shared
 * by every local client; chunks go to them round-robin, so that a large transfer is striped
 * over every rail, except GPU memory, which goes only through its GPU's NIC.
 *
 * Registrations.  A local region used by a transfer is registered once per device
 * (ibv_reg_mr) and kept in a cache keyed by the region and device, like the GPU driver's
 * mapping cache, until its mapping closes (fabric_rdma_region_gone, from region_unuse
 * before any kind's close).  An export is registered again for each import of it, on each device,
 * with the rights of that import only (REMOTE_READ, plus REMOTE_WRITE when it is writable),
 * and its rkeys are handed to the peer in ImportRep, by device: an rkey is valid
 * for that import on that connection and dies with the Release, with the connection (every
 * handle of the epoch is dropped) or with the region's mapping.  The NIC enforces the bounds
 * of the registration, so a peer's address and length reach nothing else; the registration
 * starts at iova 0 where the device allows it, so the peer learns no address of ours.
 *
 * Owners' notifications.  Each queue pair has at each end a mailbox of RQP_NOTES slots,
 * registered at iova 0 for remote writes only, with a receive posted for every slot; its rkey
 * goes in the rdma_cm private data.  A daemon that wrote a transfer into a notifying export
 * sends the note (handle and bytes) as an RDMA WRITE with immediate data into the next slot
 * of the peer's mailbox, the immediate naming the slot: right behind the bytes on the same
 * queue pair when the transfer is one chunk (a reliable connection delivers in order, so the
 * note lands after them), else alone once every chunk has completed.  The peer's receives
 * complete in order, slot after slot; it reads the note, posts the receive again and
 * notifies the owner.  A slot is written again only after the receive it consumed was posted
 * again, so a note is never overwritten unread; a writer ahead of the reader waits for a
 * receive in its NIC (receiver-not-ready retries, unbounded; the request deadline bounds it).
 * A queue pair without a mailbox at the other end, or that cannot send inline, carries no
 * notes: they go as Notify messages.
 *
 * Failures: a work completion in error, a queue pair or port error (async events), the
 * peer's disconnection or the control connection going down all end in peer_kill, which
 * destroys the queue pairs first (so the device no longer touches any buffer) and then fails
 * every waiting chunk with EIO; a chunk that never completes is caught by request.c's deadline
 * ([fabric] timeout).  The outbound side reconnects after retry_interval with a new epoch.
 * The completion channel, the async-event fd and the rdma_cm event channel are all watched by
 * the libevent loop: nothing here blocks or runs on another thread, except
 * fabric_rdma_region_gone, which takes the registration lock.
 *
 * GPU memory (GPUDirect RDMA) is registered only on its GPU's NIC, from a dma-buf that the
 * driver exports for the range (ibv_reg_dmabuf_mr, no kernel module needed), else from the
 * device pointer itself (ibv_reg_mr, which only nvidia-peermem makes work); when neither
 * works the registration fails here, the failure is cached with the region, and the caller
 * stages the chunk through host buffers (daemon/fabric/stage.c).  No machine of this project has
 * both a GPU and an RDMA NIC: these two registrations have never run.
 *
 * Built without rdma-core, the stubs at the end keep the interface and say why.
 *
 * Reads are paced (RDMA_READ_SEG, RQP_RD_ATOM below): unpaced, a lossy link turned them into
 * a crawl of ack timeouts, which looked like reads that never complete (tests/vm-rdma.test).
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/fabric/internal.h"
#include "daemon/fabric/nic.h"
#ifdef HAVE_CUDA
#include "daemon/gpu.h"
#endif

#ifdef HAVE_RDMA

#include <endian.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define RQP_POOL 2                   /* queue pairs per peer, shared by all clients */
#define RQP_DEPTH 256                /* send work requests per queue pair */
#define RQP_NOTES 32                 /* notifications a queue pair holds unread: its receives */
/*
 * Every work request posted may complete, if only flushed in error, and a completion queue
 * that overflows takes its device down: a queue pair is created only while the queue has
 * room for all of its own (RQP_DEPTH + RQP_NOTES), up to this many entries per device.
 */
#define CQ_DEPTH 32768
#define RDMA_MAGIC 0x47505852u       /* "GPXR" */
#define CM_TIMEOUT_MS 2000
/*
 * RDMA READ pacing.  A read's responses are sent by the peer's NIC without flow control:
 * nothing bounds them but the reads outstanding on the queue pair, and a lost response
 * packet is recovered only when the requester's ack timer fires (the requester has no NAK
 * for reads; Soft-RoCE drops every packet after the gap and re-reads from it).  A whole
 * chunk per read, 4 or 16 outstanding, put thousands of packets in flight at once; on a
 * lossy link (Soft-RoCE between qemu guests loses a sixth of such a burst) every read then
 * crawled from retry to retry and missed the request deadline.  So a read is posted as
 * segments of RDMA_READ_SEG bytes (one work request each, the last one signalled), at most
 * RQP_RD_ATOM of them outstanding per queue pair: 128 KiB, about what the requester keeps
 * unacknowledged for writes.  RQP_ACK_TIMEOUT (4.096 us << 14, 67 ms) is the ack timeout,
 * so a loss costs tens of milliseconds, not the seconds rdma_cm's default waits for RoCE.
 */
#define RDMA_READ_SEG (64u << 10)
#define RQP_RD_ATOM 2
#define RQP_ACK_TIMEOUT 14
/* wr_id: the request id, and in the top bits how many work requests it posted. */
#define WRID_SHIFT 48
#define WRID_RECV (1ULL << 63)       /* a receive: its mailbox slot in the low bits */

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

/*
 * An owner's notification, as the writing daemon puts it into a slot of the mailbox of the
 * queue pair at the other end, with RDMA WRITE with immediate data, the immediate being the
 * slot: the handle of the import written into and the bytes of the transfer, big-endian.
 */
struct note {
	uint64_t handle;
	uint64_t bytes;
};

#define RQP_MAX (RQP_POOL * FABRIC_RDMA_DEVS)

struct rqp {
	struct rpeer *rp;
	struct rdma_cm_id *id;
	int idx;
	int dev;                     /* our device it runs on (-1: not known yet) */
	int rdev;                    /* the peer's device at its other end (-1: not known yet) */
	bool up;
	unsigned wrs;                /* work requests posted and not yet completed */
	bool inl;                    /* it sends a note inline (from the stack, no registration) */
	struct note *box;            /* our mailbox on it: RQP_NOTES slots the peer writes */
	struct ibv_mr *box_mr;       /* ... registered at iova 0, remote write only */
	uint32_t rbox;               /* the rkey of the peer's mailbox at the other end (0: none) */
	uint32_t wseq, rseq;         /* notes written into the peer's mailbox, read from ours */
};

/* p->rdma: a peer's queue pairs, RQP_POOL for each pair of devices. */
struct rpeer {
	struct peer *p;
	uint8_t token[FABRIC_RDMA_TOKEN];
	bool offered;                /* we announced the token (inbound side) */
	bool said_up;
	struct rqp qp[RQP_MAX];
	unsigned next;
};

/* A registration: a local region's (h == NULL, the cache) or one import of an export. */
struct rmr {
	TAILQ_ENTRY(rmr) entry;
	struct region *r;
	int dev;                     /* the device it is registered on */
	struct ibv_mr *mr;
	struct phandle *h;
	const struct peer *p;        /* the importer, only compared */
	bool writable;               /* local: LOCAL_WRITE (may be an RDMA READ's destination) */
	/* a local region in GPU memory that the NIC cannot register: mr is NULL, it is staged */
};

/* One open RDMA device: a NIC, one rail. */
struct rdev {
	int index;
	struct ibv_context *ctx;
	uint8_t port_num;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	uint8_t rd_atom;             /* RDMA READs in flight per queue pair */
	int max_cqe;
	int cq_used;                 /* entries its queue pairs may fill (RQP_DEPTH + RQP_NOTES each) */
	struct event *cq_ev, *async_ev;
	char name[80];               /* "rxe0 port 1" */
	char addr[64];               /* an IP address of its netdev, "" if none */
};

static struct {
	bool on;
	struct rdev d[FABRIC_RDMA_DEVS];
	int n;
	struct rdma_event_channel *ech;
	struct rdma_cm_id *listen_id;
	uint16_t port;               /* of listen_id, host order; 0: we cannot answer */
	struct event *cm_ev;
	char names[FABRIC_RDMA_DEVS * 24];   /* "rxe0 port 1, rxe1 port 1" */
	uint64_t gpu_dmabuf, gpu_peermem, gpu_none;   /* GPU memory registrations, by how */
	int gpu_nic[GPX_MAX_GPUS];   /* the device that carries each GPU's memory (nic_dev) */
} dev;

static void gpu_nics(bool say);

static pthread_mutex_t mlock = PTHREAD_MUTEX_INITIALIZER;
static TAILQ_HEAD(, rmr) mrs = TAILQ_HEAD_INITIALIZER(mrs);

static void
nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Our device of a verbs context (from an rdma_cm id), or NULL. */
static struct rdev *
rdev_of(const struct ibv_context *ctx)
{
	for (int i = 0; i < dev.n; i++)
		if (dev.d[i].ctx == ctx)
			return &dev.d[i];
	return NULL;
}

/* ---- queue pairs ---- */

static void
qp_teardown(struct rqp *q)
{
	if (q->id == NULL)
		return;
	if (q->up)
		rdma_disconnect(q->id);
	if (q->id->qp != NULL) {
		rdma_destroy_qp(q->id);
		dev.d[q->dev].cq_used -= RQP_DEPTH + RQP_NOTES;     /* counted by qp_create */
	}
	rdma_destroy_id(q->id);
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
static void
qp_fail(struct rqp *q, const char *why)
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

static int
post_recv(struct rqp *q, uint32_t slot)
{
	/* No scatter list: a write with immediate data consumes a receive but lands where it says. */
	struct ibv_recv_wr wr = { .wr_id = WRID_RECV | slot }, *bad;

	return ibv_post_recv(q->id->qp, &wr, &bad);
}

/*
 * Our mailbox on q: RQP_NOTES slots registered at iova 0 for the peer's writes with
 * immediate data, a receive posted for each.  Without one, the peer's notifications come
 * as Notify messages on the control connection (said here, and counted in gpxctl peers).
 */
static void
box_open(struct rqp *q, struct rdev *d)
{
	size_t len = RQP_NOTES * sizeof(struct note);

	/* A page of its own: the kernel takes iova 0 only for memory at the start of a page. */
	_Static_assert(RQP_NOTES * sizeof(struct note) <= 4096, "a mailbox in one page");
	if ((q->box = aligned_alloc(4096, 4096)) != NULL) {
		memset(q->box, 0, 4096);
		q->box_mr = ibv_reg_mr_iova(d->pd, q->box, len, 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	}
	if (q->box_mr == NULL)
		goto none;
	for (uint32_t i = 0; i < RQP_NOTES; i++)
		if ((errno = post_recv(q, i)) != 0)
			goto none;       /* the receives posted need no memory; the peer just gets no key */
	return;
none:
	log_warn("fabric: peer %s: no rdma mailbox on queue pair %d: its notifications come as messages",
	    q->rp->p->node, q->idx);
	if (q->box_mr != NULL)
		ibv_dereg_mr(q->box_mr);
	q->box_mr = NULL;
	free(q->box);
	q->box = NULL;
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
	box_open(q, d);
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

static void
conn_param(struct rdma_conn_param *cp, const struct rqp *q, const void *pd, size_t pdl)
{
	memset(cp, 0, sizeof(*cp));
	cp->private_data = pd;
	cp->private_data_len = (uint8_t)pdl;
	cp->responder_resources = dev.d[q->dev].rd_atom;
	cp->initiator_depth = dev.d[q->dev].rd_atom;
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
	    dev.d[q->dev].name, q->rdev);
	if (n == want || !rp->said_up)
		log_info("fabric: peer %s (epoch %08x): transport rdma, %d of %d queue pairs on %s", rp->p->node,
		    rp->p->epoch, n, want, dev.names);
	rp->said_up = true;
	request_kick();
}

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
		rdma_destroy_id(id);
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
		conn_param(&cp, q, &w, sizeof(w));
	}
	if (q->id->qp == NULL || rdma_accept(id, &cp) < 0) {
		log_warn("fabric: peer %s: accepting rdma queue pair %u", p->node, idx);
		rdma_reject(id, NULL, 0);
		qp_teardown(q);
	}
}

static void
cm_event(const struct rdma_cm_event *e, const uint8_t *pd, size_t pdl)
{
	struct rqp *q = e->id != NULL ? e->id->context : NULL;
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
			qp_fail(q, strerror(errno));
		break;
	case RDMA_CM_EVENT_ROUTE_RESOLVED:
		if (qp_create(q) < 0) {
			qp_fail(q, strerror(errno));
			break;
		}
		h.magic = htonl(RDMA_MAGIC);
		h.epoch = htonl(q->rp->p->epoch);
		h.index = htonl((uint32_t)q->idx);
		h.dev = htonl((uint32_t)q->dev);
		memcpy(h.token, q->rp->token, sizeof(h.token));
		h.box = htonl(q->box_mr != NULL ? q->box_mr->rkey : 0);
		conn_param(&cp, q, &h, sizeof(h));
		ack_timeout(q->id);
		if (rdma_connect(q->id, &cp) < 0)
			qp_fail(q, strerror(errno));
		break;
	case RDMA_CM_EVENT_ESTABLISHED:
		/* The outbound side learns here which of the peer's devices answered. */
		if (q->rdev < 0) {
			memset(&w, 0, sizeof(w));
			if (pdl >= WELCOME_MIN)
				memcpy(&w, pd, pdl < sizeof(w) ? pdl : sizeof(w));
			if (pdl < WELCOME_MIN || ntohl(w.magic) != RDMA_MAGIC || ntohl(w.dev) >= FABRIC_RDMA_DEVS) {
				qp_fail(q, "accepted without saying on which device");
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
		qp_fail(q, rdma_event_str(e->event));
		break;
	default:
		break;
	}
}

static void
on_cm(evutil_socket_t fd, short what, void *arg)
{
	struct rdma_cm_event *ev;

	(void)fd;
	(void)what;
	(void)arg;
	while (dev.ech != NULL && rdma_get_cm_event(dev.ech, &ev) == 0) {
		/* Acked before acting: acting may destroy the id, which waits for its events' acks. */
		struct rdma_cm_event e = *ev;
		uint8_t pd[64];
		size_t pdl = 0;
		if ((e.event == RDMA_CM_EVENT_CONNECT_REQUEST || e.event == RDMA_CM_EVENT_ESTABLISHED) &&
		    ev->param.conn.private_data != NULL) {
			pdl = ev->param.conn.private_data_len < sizeof(pd) ? ev->param.conn.private_data_len : sizeof(pd);
			memcpy(pd, ev->param.conn.private_data, pdl);
		}
		rdma_ack_cm_event(ev);
		cm_event(&e, pd, pdl);
	}
}

/* ---- completions and async events ---- */

static struct rqp *
qp_by_num(const struct rdev *d, uint32_t num)
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

/* A receive completed: the peer wrote a note into our mailbox on its queue pair, or it flushed. */
static void
note_in(const struct rdev *d, const struct ibv_wc *wc)
{
	struct rqp *q = qp_by_num(d, wc->qp_num);
	uint32_t slot = (uint32_t)(wc->wr_id & ~WRID_RECV);
	struct note n;

	if (q == NULL || wc->status == IBV_WC_WR_FLUSH_ERR)
		return;              /* its queue pair is going or gone */
	if (wc->status != IBV_WC_SUCCESS) {
		qp_fail(q, ibv_wc_status_str(wc->status));
		return;
	}
	/* In order, one slot after the other, each as announced by its immediate. */
	if (q->box == NULL || wc->opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc->wc_flags & IBV_WC_WITH_IMM) ||
	    slot != q->rseq % RQP_NOTES || ntohl(wc->imm_data) != slot || wc->byte_len != sizeof(n)) {
		peer_kill(q->rp->p, "rdma queue pair %d: a receive that is not its next notification", q->idx);
		return;
	}
	memcpy(&n, &q->box[slot], sizeof(n));
	q->rseq++;
	if ((errno = post_recv(q, slot)) != 0) {
		qp_fail(q, strerror(errno));
		return;
	}
	serve_rdma_note(q->rp->p, be64toh(n.handle), be64toh(n.bytes));
}

static void on_cq(evutil_socket_t, short, void *);

/* Every completion waiting on any device: before a Release drops a handle, the notes for it. */
void
fabric_rdma_drain(void)
{
	for (int i = 0; i < dev.n; i++)
		on_cq(-1, 0, &dev.d[i]);
}

static void
on_cq(evutil_socket_t fd, short what, void *arg)
{
	struct rdev *d = arg;
	struct ibv_cq *cq;
	void *ctx;
	struct ibv_wc wc[16];
	unsigned ev = 0;
	int n;

	(void)fd;
	(void)what;
	while (ibv_get_cq_event(d->cc, &cq, &ctx) == 0)
		ev++;
	if (ev > 0)
		ibv_ack_cq_events(d->cq, ev);
	ibv_req_notify_cq(d->cq, 0);
	while ((n = ibv_poll_cq(d->cq, 16, wc)) > 0)
		for (int i = 0; i < n; i++) {
			uint64_t id = wc[i].wr_id & ((1ULL << WRID_SHIFT) - 1);
			if (wc[i].wr_id & WRID_RECV) {
				note_in(d, &wc[i]);
				continue;
			}
			struct rqp *q = qp_by_num(d, wc[i].qp_num);
			if (q != NULL && wc[i].status == IBV_WC_SUCCESS) {
				unsigned nwr = (unsigned)(wc[i].wr_id >> WRID_SHIFT);
				q->wrs = q->wrs > nwr ? q->wrs - nwr : 0;
			}
			request_rdma_done(id, wc[i].status == IBV_WC_SUCCESS, ibv_wc_status_str(wc[i].status));
		}
}

/* Every peer with a queue pair on device d goes down (port or device error). */
static void
kill_all(const struct rdev *d, const char *why)
{
	struct peer *p, *t;

	TAILQ_FOREACH_SAFE(p, &peers, entry, t)
		for (int i = 0; p->rdma != NULL && i < RQP_MAX; i++)
			if (p->rdma->qp[i].id != NULL && p->rdma->qp[i].dev == d->index) {
				peer_kill(p, "rdma on %s: %s", d->name, why);
				break;
			}
}

static void
on_async(evutil_socket_t fd, short what, void *arg)
{
	struct rdev *d = arg;
	struct ibv_async_event ae;
	struct peer *p, *t;

	(void)fd;
	(void)what;
	while (ibv_get_async_event(d->ctx, &ae) == 0) {
		enum ibv_event_type type = ae.event_type;
		struct ibv_qp *qp = ae.element.qp;
		ibv_ack_async_event(&ae);
		switch (type) {
		case IBV_EVENT_QP_FATAL:
		case IBV_EVENT_QP_REQ_ERR:
		case IBV_EVENT_QP_ACCESS_ERR:
		case IBV_EVENT_PATH_MIG_ERR:
			TAILQ_FOREACH_SAFE(p, &peers, entry, t)
				for (int i = 0; p->rdma != NULL && i < RQP_MAX; i++)
					if (p->rdma->qp[i].id != NULL && p->rdma->qp[i].id->qp == qp) {
						peer_kill(p, "rdma queue pair %d: %s", i, ibv_event_type_str(type));
						break;
					}
			break;
		case IBV_EVENT_PORT_ERR:
		case IBV_EVENT_DEVICE_FATAL:
			log_warnx("fabric: %s: %s", d->name, ibv_event_type_str(type));
			kill_all(d, ibv_event_type_str(type));
			gpu_nics(false);
			break;
		case IBV_EVENT_PORT_ACTIVE:
			log_info("fabric: %s: port active", d->name);
			gpu_nics(false);
			break;
		default:
			log_debug("fabric", "%s: %s", d->name, ibv_event_type_str(type));
		}
	}
}

/* ---- what peer.c calls ---- */

bool
fabric_rdma_offer(struct peer *p, uint32_t *port, uint8_t token[FABRIC_RDMA_TOKEN],
    struct peer_rdev devs[FABRIC_RDMA_DEVS], size_t *ndevs)
{
	struct rpeer *rp;

	*ndevs = 0;
	if (!dev.on || dev.port == 0 || (rp = rpeer_get(p)) == NULL)
		return false;
	if (getrandom(rp->token, sizeof(rp->token), 0) != (ssize_t)sizeof(rp->token))
		return false;
	rp->offered = true;
	memcpy(token, rp->token, FABRIC_RDMA_TOKEN);
	*port = dev.port;
	for (int i = 0; i < dev.n; i++)
		if (dev.d[i].addr[0] != '\0') {
			devs[*ndevs].index = (uint32_t)i;
			snprintf(devs[*ndevs].addr, sizeof(devs[0].addr), "%s", dev.d[i].addr);
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
		if (rdma_create_id(dev.ech, &q->id, q, RDMA_PS_TCP) < 0) {
			q->id = NULL;
			log_warn("fabric: peer %s: rdma_create_id", rp->p->node);
			continue;
		}
		if (rdma_resolve_addr(q->id, src, dst, CM_TIMEOUT_MS) < 0)
			qp_fail(q, strerror(errno));
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

	if (!dev.on || port == 0 || port > 65535 || tokenlen != FABRIC_RDMA_TOKEN) {
		if (dev.on)
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

uint32_t
fabric_rdma_regs(const struct peer *p)
{
	struct rmr *m;
	uint32_t n = 0;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH(m, &mrs, entry)
		n += m->p == p;
	pthread_mutex_unlock(&mlock);
	return n;
}

const char *
fabric_rdma_device(void)
{
	return dev.on ? dev.names : NULL;
}

/* ---- registrations ---- */

static int nic_dev(const struct region *);

/*
 * r's GPU memory for device d's NIC, at iova: from the dma-buf the driver exports for the
 * pages around it, else from the device pointer (nvidia-peermem).  NULL when neither works.
 * A driver call on the loop thread, once per region and import (its result is kept).
 */
static struct ibv_mr *
gpu_reg(const struct region *r, const struct rdev *d, uint64_t iova, int acc)
{
#ifndef HAVE_CUDA
	(void)r, (void)d, (void)iova, (void)acc;
	return NULL;
#else
	uint64_t off, size;
	struct ibv_mr *mr = NULL;
	int fd = cuda_use(r->dev) == 0 ? cuda_dmabuf(r->dptr, r->length, &off, &size) : -1;

	if (fd >= 0) {
		mr = ibv_reg_dmabuf_mr(d->pd, off, r->length, iova, fd, acc);
		close(fd);              /* the registration holds the dma-buf */
		if (mr != NULL) {
			dev.gpu_dmabuf++;
			return mr;
		}
	}
	if ((mr = ibv_reg_mr_iova(d->pd, (void *)(uintptr_t)r->dptr, r->length, iova, acc)) != NULL) {
		dev.gpu_peermem++;
		return mr;
	}
	dev.gpu_none++;
	log_warnx("fabric: %s cannot register %llu bytes of GPU %d memory (dma-buf: %s; peermem: %s): "
	    "they are staged through host buffers", d->name, (unsigned long long)r->length, r->dev,
	    fd >= 0 ? "refused by the NIC" : "none from the driver", strerror(errno));
	return NULL;
#endif
}

void
fabric_rdma_gpu_regs(uint64_t *dmabuf, uint64_t *peermem, uint64_t *none)
{
	*dmabuf = dev.gpu_dmabuf;
	*peermem = dev.gpu_peermem;
	*none = dev.gpu_none;
}

/*
 * On every device that may carry the region (host memory: all; GPU memory: its GPU's NIC
 * only), for this import alone.  iova 0: the peer addresses the export by offset and learns
 * no address of ours; a device that cannot take an iova gets no registration, unless none
 * can, when the last takes the region at its address.
 */
bool
fabric_rdma_export(struct peer *p, struct phandle *h, uint64_t *addr, uint32_t rkeys[FABRIC_RDMA_DEVS])
{
	struct region *r = h->r;
	int acc = IBV_ACCESS_REMOTE_READ, only = nic_dev(r), n = 0;

	memset(rkeys, 0, sizeof(uint32_t) * FABRIC_RDMA_DEVS);
	*addr = 0;
	if (!dev.on || r->length == 0 || only == -2)
		return false;
	if (!h->read_only && !r->read_only)
		acc |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	for (int i = 0; i < dev.n; i++) {
		struct rdev *d = &dev.d[i];
		struct rmr *m;
		if ((only >= 0 && i != only) || (m = calloc(1, sizeof(*m))) == NULL)
			continue;
		if (r->host == NULL)
			m->mr = gpu_reg(r, d, 0, acc);
		else if ((m->mr = ibv_reg_mr_iova(d->pd, r->host, r->length, 0, acc)) == NULL && n == 0 &&
		    i == dev.n - 1 && (m->mr = ibv_reg_mr(d->pd, r->host, r->length, acc)) != NULL)
			*addr = (uintptr_t)r->host;
		if (m->mr == NULL) {
			log_warn("fabric: peer %s: registering export %s (%llu bytes) on %s", p->node,
			    h->export_name, (unsigned long long)r->length, d->name);
			free(m);
			continue;
		}
		m->r = r;
		m->h = h;
		m->p = p;
		m->dev = i;
		rkeys[i] = m->mr->rkey;
		n++;
		pthread_mutex_lock(&mlock);
		TAILQ_INSERT_TAIL(&mrs, m, entry);
		pthread_mutex_unlock(&mlock);
	}
	if (n == 0)
		log_warnx("fabric: peer %s: export %s is not registered for rdma: it goes over tcp%s", p->node,
		    h->export_name, r->host ? "" : ", staged");
	return n > 0;
}

void
fabric_rdma_unexport(struct phandle *h)
{
	TAILQ_HEAD(, rmr) gone = TAILQ_HEAD_INITIALIZER(gone);
	struct rmr *m, *t;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH_SAFE(m, &mrs, entry, t)
		if (m->h == h) {
			TAILQ_REMOVE(&mrs, m, entry);
			TAILQ_INSERT_TAIL(&gone, m, entry);
		}
	pthread_mutex_unlock(&mlock);
	while ((m = TAILQ_FIRST(&gone)) != NULL) {
		TAILQ_REMOVE(&gone, m, entry);
		ibv_dereg_mr(m->mr);
		free(m);
	}
}

/* The cached registration of a local region on device d, made on first use; NULL if it cannot be. */
static struct ibv_mr *
local_mr(struct region *r, int d, bool write_into)
{
	struct rmr *m;
	struct ibv_mr *mr = NULL;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH(m, &mrs, entry)
		if (m->r == r && m->h == NULL && m->dev == d && (m->writable || !write_into)) {
			mr = m->mr;
			break;
		}
	pthread_mutex_unlock(&mlock);
	if (m != NULL || (write_into && r->read_only))
		return mr;
	if ((m = calloc(1, sizeof(*m))) == NULL)
		return NULL;
	m->writable = !r->read_only;
	m->dev = d;
	m->r = r;
	if (r->host == NULL)
		/* Cached even when it fails: the chunks of this region are staged from now on. */
		m->mr = gpu_reg(r, &dev.d[d], r->dptr, m->writable ? IBV_ACCESS_LOCAL_WRITE : 0);
	else if ((m->mr = ibv_reg_mr(dev.d[d].pd, r->host, r->length,
	    m->writable ? IBV_ACCESS_LOCAL_WRITE : 0)) == NULL) {
		log_warn("fabric: registering a %llu-byte region for rdma on %s", (unsigned long long)r->length,
		    dev.d[d].name);
		free(m);
		return NULL;
	}
	pthread_mutex_lock(&mlock);
	TAILQ_INSERT_TAIL(&mrs, m, entry);
	pthread_mutex_unlock(&mlock);
	return m->mr;
}

/* Any thread: r's mapping is closing; every registration of it goes (the cache's and exports'). */
void
fabric_rdma_region_gone(struct region *r)
{
	TAILQ_HEAD(, rmr) gone = TAILQ_HEAD_INITIALIZER(gone);
	struct rmr *m, *t;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH_SAFE(m, &mrs, entry, t)
		if (m->r == r) {
			TAILQ_REMOVE(&mrs, m, entry);
			TAILQ_INSERT_TAIL(&gone, m, entry);
		}
	pthread_mutex_unlock(&mlock);
	while ((m = TAILQ_FIRST(&gone)) != NULL) {
		TAILQ_REMOVE(&gone, m, entry);
		if (m->mr != NULL)
			ibv_dereg_mr(m->mr);
		free(m);
	}
}

/* ---- the data path ---- */

/* Which of our devices may carry r: -1 any (host memory), the GPU's NIC's index, -2 none. */
static int
nic_dev(const struct region *r)
{
	if (r->host != NULL)
		return -1;
	return r->dev >= 0 && r->dev < GPX_MAX_GPUS ? dev.gpu_nic[r->dev] : -2;
}

/*
 * Each GPU's NIC among our devices (-2: none, or not open), from the topology in sysfs: at
 * start, and again when a port's state changes (the choice prefers active ports), not for
 * every chunk.  It logs the choices when asked to.
 */
static void
gpu_nics(bool say)
{
	for (int g = 0; g < GPX_MAX_GPUS; g++) {
		char want[64];
		enum nic_why w;
		dev.gpu_nic[g] = -2;
		if (g >= gpu_count() || !nic_for_dev(g, want, sizeof(want), &w))
			continue;
		for (int i = 0; i < dev.n; i++)
			if (strncmp(dev.d[i].name, want, strlen(want)) == 0 && dev.d[i].name[strlen(want)] == ' ')
				dev.gpu_nic[g] = i;
		if (say)
			log_info("fabric: GPU%d's memory goes through %s (%s)%s", g, want, nic_why_str(w),
			    dev.gpu_nic[g] >= 0 ? "" : ", which is not open: staged");
	}
}

/* q may carry a note: the peer has a mailbox at its other end, and we can send inline. */
static bool
note_ok(const struct rqp *q)
{
	return q->rbox != 0 && q->inl;
}

/*
 * The note (the owner's notification) as the work request that ends a list on q: an RDMA
 * WRITE with immediate of n into the next slot of the peer's mailbox, inline (n may be on
 * the stack), its immediate the slot.  On a reliable connection it lands after every write
 * posted before it on q, and the peer's receive completes only then.
 */
static void
note_wr(struct rqp *q, struct ibv_send_wr *wr, struct ibv_sge *sge, struct note *n,
    const struct fabric_note *note, uint64_t wrid)
{
	uint32_t slot = q->wseq % RQP_NOTES;      /* the caller counts it once posted */

	n->handle = htobe64(note->handle);
	n->bytes = htobe64(note->bytes);
	*sge = (struct ibv_sge){ .addr = (uintptr_t)n, .length = sizeof(*n) };
	*wr = (struct ibv_send_wr){
		.wr_id = wrid, .sg_list = sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
		.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE, .imm_data = htonl(slot),
	};
	wr->wr.rdma.remote_addr = (uint64_t)slot * sizeof(*n);
	wr->wr.rdma.rkey = q->rbox;
}

static int
post(struct rpeer *rp, struct rqp *q, struct ibv_send_wr *wr, unsigned nwr)
{
	struct ibv_send_wr *bad;

	if ((errno = ibv_post_send(q->id->qp, wr, &bad)) != 0) {
		log_warn("fabric: peer %s: posting on rdma queue pair %d", rp->p->node, q->idx);
		/* Nothing of a list refused at its first request was posted.  A part of it was: its
		 * completion would never come, so the queue pair carries nothing more, and this
		 * chunk goes over tcp (the parts posted only read or write the same bytes again). */
		if (bad != &wr[0])
			q->up = false;
		return -1;
	}
	q->wrs += nwr;
	rp->next = (unsigned)(q->idx + 1) % RQP_MAX;
	return 0;
}

/*
 * A queue pair of the peer for a chunk: up, with room, on a device that may carry the local
 * memory, its other end on a device the remote region is registered on; round-robin over all
 * of them, so that the chunks of a large transfer spread over every rail.  With a note, one
 * that can carry it too, else any (1: posted without the note).
 */
int
fabric_rdma_post(struct peer *p, uint64_t id, bool write, struct region *local, uint64_t off, uint64_t len,
    uint64_t raddr, const uint32_t rkeys[FABRIC_RDMA_DEVS], const struct fabric_note *note)
{
	struct rpeer *rp = p->rdma;
	struct rqp *q = NULL;
	struct ibv_mr *mr = NULL;
	unsigned nwr = write ? 1 : (unsigned)((len + RDMA_READ_SEG - 1) / RDMA_READ_SEG);
	uintptr_t buf = local->host != NULL ? (uintptr_t)local->host + off : (uintptr_t)(local->dptr + off);
	int want = nic_dev(local);

	bool with = false;

	if (!write)
		note = NULL;
	if (rp == NULL || len == 0 || len > UINT32_MAX || nwr > RQP_DEPTH || id >> WRID_SHIFT != 0 || want == -2)
		return -1;
	for (int pass = note != NULL ? 0 : 1; pass < 2 && q == NULL; pass++)
		for (int i = 0; i < RQP_MAX && mr == NULL; i++) {
			struct rqp *c = &rp->qp[(rp->next + i) % RQP_MAX];
			if (c->up && c->wrs + nwr + (pass == 0) <= RQP_DEPTH && (want < 0 || c->dev == want) && c->rdev >= 0 &&
			    rkeys[c->rdev] != 0 && (pass == 1 || note_ok(c)) &&
			    (mr = local_mr(local, c->dev, !write)) != NULL) {
				q = c;
				with = pass == 0;
			}
		}
	if (q == NULL)
		return -1;
	struct ibv_sge sge[RQP_DEPTH + 1];
	struct ibv_send_wr wr[RQP_DEPTH + 1];
	struct note n;
	uint64_t wrid = id | (uint64_t)(nwr + with) << WRID_SHIFT;
	for (unsigned i = 0; i < nwr; i++) {
		uint64_t o = write ? 0 : (uint64_t)i * RDMA_READ_SEG;
		uint32_t l = write ? (uint32_t)len : (uint32_t)(len - o < RDMA_READ_SEG ? len - o : RDMA_READ_SEG);
		sge[i] = (struct ibv_sge){ .addr = buf + o, .length = l, .lkey = mr->lkey };
		wr[i] = (struct ibv_send_wr){
			.wr_id = wrid, .sg_list = &sge[i], .num_sge = 1, .next = i + 1 < nwr ? &wr[i + 1] : NULL,
			.opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ,
			.send_flags = i + 1 == nwr && !with ? IBV_SEND_SIGNALED : 0,
		};
		wr[i].wr.rdma.remote_addr = raddr + o;
		wr[i].wr.rdma.rkey = rkeys[q->rdev];
	}
	if (with) {
		note_wr(q, &wr[nwr], &sge[nwr], &n, note, wrid);
		wr[nwr - 1].next = &wr[nwr];
	}
	if (post(rp, q, wr, nwr + with) < 0)
		return -1;
	q->wseq += with;
	return note != NULL && !with;
}

/* A note alone, after the chunks of a transfer on whatever queue pairs carried them completed. */
int
fabric_rdma_note(struct peer *p, uint64_t id, const struct fabric_note *note)
{
	struct rpeer *rp = p->rdma;
	struct ibv_sge sge;
	struct ibv_send_wr wr;
	struct note n;

	if (rp == NULL || id >> WRID_SHIFT != 0)
		return -1;
	for (int i = 0; i < RQP_MAX; i++) {
		struct rqp *q = &rp->qp[(rp->next + i) % RQP_MAX];
		if (!q->up || q->wrs + 1 > RQP_DEPTH || !note_ok(q))
			continue;
		note_wr(q, &wr, &sge, &n, note, id | 1ULL << WRID_SHIFT);
		if (post(rp, q, &wr, 1) < 0)
			return -1;
		q->wseq++;
		return 0;
	}
	return -1;
}

/* ---- start and stop ---- */

/* Whether name is one of the comma-separated list. */
static bool
name_listed(const char *list, const char *name)
{
	size_t n = strlen(name);

	for (const char *p = list; *p != '\0'; p += strcspn(p, ",")) {
		p += strspn(p, ", ");
		if (strncmp(p, name, n) == 0 && (p[n] == '\0' || p[n] == ',' || p[n] == ' '))
			return true;
	}
	return false;
}

/* Every device with an active port (or those [fabric] rdma_device names, comma-separated). */
static bool
pick(char *why, size_t whylen)
{
	int n = 0;
	struct ibv_context **l = rdma_get_devices(&n);
	bool named = false;

	for (int i = 0; l != NULL && i < n && dev.n < FABRIC_RDMA_DEVS; i++) {
		const char *nm = ibv_get_device_name(l[i]->device);
		struct ibv_device_attr da;
		if (cfg->fabric_rdma_device != NULL && !name_listed(cfg->fabric_rdma_device, nm))
			continue;
		named = true;
		if (ibv_query_device(l[i], &da) != 0)
			continue;
		for (uint8_t pn = 1; pn <= da.phys_port_cnt; pn++) {
			struct ibv_port_attr pa;
			if (ibv_query_port(l[i], pn, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
				struct rdev *d = &dev.d[dev.n];
				d->index = dev.n++;
				d->ctx = l[i];
				d->port_num = pn;
				d->max_cqe = da.max_cqe;
				d->rd_atom = (uint8_t)(da.max_qp_rd_atom < RQP_RD_ATOM ? da.max_qp_rd_atom : RQP_RD_ATOM);
				snprintf(d->name, sizeof(d->name), "%s port %u", nm, pn);
				break;
			}
		}
	}
	if (dev.n == 0)
		snprintf(why, whylen, "%s", n == 0 ? "no RDMA device" : cfg->fabric_rdma_device && !named ?
		    "rdma_device names no RDMA device" : "no RDMA device has an active port");
	if (l != NULL)
		rdma_free_devices(l);
	return dev.n > 0;
}

/*
 * The IP address of each device, which the connecting side's rdma_cm needs for the pairs of
 * devices: the first address of the host that rdma_cm binds to that device.
 */
static void
find_addrs(void)
{
	struct ifaddrs *ifs = NULL;

	if (getifaddrs(&ifs) < 0)
		return;
	for (struct ifaddrs *a = ifs; a != NULL; a = a->ifa_next) {
		struct rdma_cm_id *id;
		struct rdev *d;
		char host[64];
		if (a->ifa_addr == NULL || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6) ||
		    (a->ifa_flags & IFF_LOOPBACK) || rdma_create_id(dev.ech, &id, NULL, RDMA_PS_TCP) < 0)
			continue;
		if (rdma_bind_addr(id, a->ifa_addr) == 0 && (d = rdev_of(id->verbs)) != NULL && d->addr[0] == '\0' &&
		    getnameinfo(a->ifa_addr, a->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in) :
		    sizeof(struct sockaddr_in6), host, sizeof(host), NULL, 0, NI_NUMERICHOST) == 0 &&
		    strchr(host, '%') == NULL)
			snprintf(d->addr, sizeof(d->addr), "%s", host);
		rdma_destroy_id(id);
	}
	freeifaddrs(ifs);
}

/* The rdma_cm listener on the host of [fabric] listen, port chosen by the system. */
static void
listen_rdma(void)
{
	char host[80];
	const char *l = cfg->fabric_listen, *c;
	struct addrinfo hints = { .ai_flags = AI_PASSIVE }, *res = NULL;

	if (l == NULL || (c = strrchr(l, ':')) == NULL || (size_t)(c - l) >= sizeof(host))
		return;
	snprintf(host, sizeof(host), "%.*s", (int)(c - l), l);
	if (host[0] == '[' && host[strlen(host) - 1] == ']') {
		memmove(host, host + 1, strlen(host));
		host[strlen(host) - 1] = '\0';
	}
	/* A listener on one device's address would not hear the others: any address then. */
	if (dev.n > 1)
		host[0] = '\0';
	if (getaddrinfo(host[0] ? host : NULL, "0", &hints, &res) != 0 ||
	    rdma_create_id(dev.ech, &dev.listen_id, NULL, RDMA_PS_TCP) < 0) {
		log_warnx("fabric: no rdma listener on %s: peers connecting here use tcp", host);
		if (res != NULL)
			freeaddrinfo(res);
		dev.listen_id = NULL;
		return;
	}
	if (rdma_bind_addr(dev.listen_id, res->ai_addr) < 0 || rdma_listen(dev.listen_id, 16) < 0) {
		log_warn("fabric: rdma listener on %s (peers connecting here use tcp)", host);
		rdma_destroy_id(dev.listen_id);
		dev.listen_id = NULL;
	} else
		dev.port = ntohs(rdma_get_src_port(dev.listen_id));
	freeaddrinfo(res);
}

static int
rdev_open(struct event_base *b, struct rdev *d)
{
	if ((d->pd = ibv_alloc_pd(d->ctx)) == NULL || (d->cc = ibv_create_comp_channel(d->ctx)) == NULL ||
	    (d->cq = ibv_create_cq(d->ctx, d->max_cqe < CQ_DEPTH ? d->max_cqe : CQ_DEPTH, NULL, d->cc, 0)) == NULL ||
	    ibv_req_notify_cq(d->cq, 0) != 0)
		return -1;
	nonblock(d->cc->fd);
	nonblock(d->ctx->async_fd);
	d->cq_ev = event_new(b, d->cc->fd, EV_READ | EV_PERSIST, on_cq, d);
	d->async_ev = event_new(b, d->ctx->async_fd, EV_READ | EV_PERSIST, on_async, d);
	if (d->cq_ev == NULL || d->async_ev == NULL)
		return -1;
	event_add(d->cq_ev, NULL);
	event_add(d->async_ev, NULL);
	return 0;
}

int
fabric_rdma_init(struct event_base *b, char *why, size_t whylen)
{
	bool must = strcmp(cfg->fabric_transport, "rdma") == 0;

	if (strcmp(cfg->fabric_transport, "tcp") == 0) {
		snprintf(why, whylen, "tcp (configured)");
		return 0;
	}
	if (!pick(why, whylen))
		goto off;
	if ((dev.ech = rdma_create_event_channel()) == NULL) {
		snprintf(why, whylen, "rdma_cm: %s", strerror(errno));
		fabric_rdma_shutdown();
		goto off;
	}
	for (int i = 0; i < dev.n; i++)
		if (rdev_open(b, &dev.d[i]) < 0) {
			snprintf(why, whylen, "%s: setting up: %s", dev.d[i].name, strerror(errno));
			fabric_rdma_shutdown();
			goto off;
		}
	nonblock(dev.ech->fd);
	if ((dev.cm_ev = event_new(b, dev.ech->fd, EV_READ | EV_PERSIST, on_cm, NULL)) == NULL) {
		snprintf(why, whylen, "out of memory");
		fabric_rdma_shutdown();
		goto off;
	}
	event_add(dev.cm_ev, NULL);
	dev.on = true;
	find_addrs();
	for (int i = 0; i < dev.n; i++) {
		size_t k = strlen(dev.names);
		snprintf(dev.names + k, sizeof(dev.names) - k, "%s%s", k ? ", " : "", dev.d[i].name);
		log_info("fabric: rdma device %d: %s, address %s", i, dev.d[i].name,
		    dev.d[i].addr[0] ? dev.d[i].addr : "none (reached only as the control connection's)");
	}
	listen_rdma();
	gpu_nics(true);
	if (dev.port)
		snprintf(why, whylen, "rdma on %s, rdma_cm port %u", dev.names, dev.port);
	else
		snprintf(why, whylen, "rdma on %s (outbound only)", dev.names);
	return 1;
off:
	if (must)
		return -1;
	snprintf(why + strlen(why), whylen - strlen(why), ": tcp");
	return 0;
}

/* After every peer is down. */
void
fabric_rdma_shutdown(void)
{
	struct rmr *m;

	pthread_mutex_lock(&mlock);
	while ((m = TAILQ_FIRST(&mrs)) != NULL) {
		TAILQ_REMOVE(&mrs, m, entry);
		if (m->mr != NULL)
			ibv_dereg_mr(m->mr);
		free(m);
	}
	pthread_mutex_unlock(&mlock);
	if (dev.cm_ev != NULL)
		event_free(dev.cm_ev);
	if (dev.listen_id != NULL)
		rdma_destroy_id(dev.listen_id);
	if (dev.ech != NULL)
		rdma_destroy_event_channel(dev.ech);
	for (int i = 0; i < dev.n; i++) {
		struct rdev *d = &dev.d[i];
		if (d->cq_ev != NULL)
			event_free(d->cq_ev);
		if (d->async_ev != NULL)
			event_free(d->async_ev);
		if (d->cq != NULL)
			ibv_destroy_cq(d->cq);
		if (d->cc != NULL)
			ibv_destroy_comp_channel(d->cc);
		if (d->pd != NULL)
			ibv_dealloc_pd(d->pd);
	}
	memset(&dev, 0, sizeof(dev));
}

#else /* !HAVE_RDMA: the interface, and why there is nothing behind it */

int
fabric_rdma_init(struct event_base *b, char *why, size_t whylen)
{
	(void)b;
	snprintf(why, whylen, "this gpxd was built without rdma-core%s",
	    strcmp(cfg->fabric_transport, "rdma") == 0 ? "" : ": tcp");
	return strcmp(cfg->fabric_transport, "rdma") == 0 ? -1 : 0;
}
void fabric_rdma_shutdown(void) {}
bool fabric_rdma_offer(struct peer *p, uint32_t *port, uint8_t token[FABRIC_RDMA_TOKEN],
    struct peer_rdev devs[FABRIC_RDMA_DEVS], size_t *ndevs)
{ (void)p; (void)port; (void)token; (void)devs; *ndevs = 0; return false; }
void fabric_rdma_connect(struct peer *p, uint32_t port, const uint8_t *token, size_t tokenlen,
    const struct peer_rdev *devs, size_t ndevs)
{ (void)p; (void)port; (void)token; (void)tokenlen; (void)devs; (void)ndevs; }
void fabric_rdma_peer_down(struct peer *p) { (void)p; }
uint32_t fabric_rdma_qps(const struct peer *p) { (void)p; return 0; }
uint32_t fabric_rdma_regs(const struct peer *p) { (void)p; return 0; }
const char *fabric_rdma_device(void) { return NULL; }
bool fabric_rdma_export(struct peer *p, struct phandle *h, uint64_t *addr, uint32_t rkeys[FABRIC_RDMA_DEVS])
{ (void)p; (void)h; (void)addr; (void)rkeys; return false; }
void fabric_rdma_unexport(struct phandle *h) { (void)h; }
void fabric_rdma_region_gone(struct region *r) { (void)r; }
int fabric_rdma_post(struct peer *p, uint64_t id, bool write, struct region *local, uint64_t off, uint64_t len,
    uint64_t raddr, const uint32_t rkeys[FABRIC_RDMA_DEVS], const struct fabric_note *note)
{ (void)p; (void)id; (void)write; (void)local; (void)off; (void)len; (void)raddr; (void)rkeys; (void)note; return -1; }
int fabric_rdma_note(struct peer *p, uint64_t id, const struct fabric_note *note)
{ (void)p; (void)id; (void)note; return -1; }
void fabric_rdma_drain(void) {}
void fabric_rdma_gpu_regs(uint64_t *dmabuf, uint64_t *peermem, uint64_t *none)
{ *dmabuf = *peermem = *none = 0; }

#endif
