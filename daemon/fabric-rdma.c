/*
 * The RDMA data transport of the fabric: the only file that includes <infiniband/verbs.h> and
 * <rdma/rdma_cma.h>.  daemon/fabric.c decides what moves; this file moves it with one-sided
 * RDMA WRITE and RDMA READ between registered host memory of two nodes, when both daemons
 * have an RDMA device up ([fabric] transport = auto or rdma), and otherwise says no, so that
 * fabric.c sends Write and Read messages over the control connection instead.
 *
 * Connection setup never trusts the RDMA side on its own.  The control connection
 * (daemon/peer.c) authenticates first; the answering daemon then announces in Ready the port
 * of its rdma_cm listener and a fresh 32-byte random token, and the connecting daemon opens
 * RQP_POOL reliable-connected queue pairs to that port, each with the magic, the epoch, its
 * index and the token in the rdma_cm private data.  A request whose token, epoch and index do
 * not match a ready, announced connection is rejected and logged.  The queue pairs of a peer
 * are shared by every local client; chunks go to them round-robin.
 *
 * Registrations.  A local region used by a transfer is registered once (ibv_reg_mr) and kept
 * in a cache keyed by the region, like the GPU driver's mapping cache, until its mapping
 * closes (fabric_rdma_region_gone, from daemon/mem-host.c).  An export is registered again
 * for each import of it, with the rights of that import only (REMOTE_READ, plus REMOTE_WRITE
 * when it is writable), and its rkey is handed to the peer in ImportRep: the rkey is valid
 * for that import on that connection and dies with the Release, with the connection (every
 * handle of the epoch is dropped) or with the region's mapping.  The NIC enforces the bounds
 * of the registration, so a peer's address and length reach nothing else; the registration
 * starts at iova 0 where the device allows it, so the peer learns no address of ours.
 *
 * Failures: a work completion in error, a queue pair or port error (async events), the
 * peer's disconnection or the control connection going down all end in peer_kill, which
 * destroys the queue pairs first (so the device no longer touches any buffer) and then fails
 * every waiting chunk with EIO; a chunk that never completes is caught by fabric.c's deadline
 * ([fabric] timeout).  The outbound side reconnects after retry_interval with a new epoch.
 * The completion channel, the async-event fd and the rdma_cm event channel are all watched by
 * the libevent loop: nothing here blocks or runs on another thread, except
 * fabric_rdma_region_gone, which takes the registration lock.
 *
 * GPU memory (GPUDirect RDMA) is registered only on its GPU's NIC, from a dma-buf that the
 * driver exports for the range (ibv_reg_dmabuf_mr, no kernel module needed), else from the
 * device pointer itself (ibv_reg_mr, which only nvidia-peermem makes work); when neither
 * works the registration fails here, the failure is cached with the region, and the caller
 * stages the chunk through host buffers (daemon/stage.c).  No machine of this project has
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

#include "daemon/fabric.h"
#include "daemon/nic.h"
#ifdef HAVE_CUDA
#include "daemon/gpu.h"
#endif

#ifdef HAVE_RDMA

#include <fcntl.h>
#include <netdb.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define RQP_POOL 2                   /* queue pairs per peer, shared by all clients */
#define RQP_DEPTH 256                /* send work requests per queue pair */
#define CQ_DEPTH 4096                /* every posted request may complete (flushed) in error */
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

/* The rdma_cm private data of a connection request: what the control plane announced. */
struct rdma_hello {
	uint32_t magic;              /* big-endian, like the rest */
	uint32_t epoch;
	uint32_t index;
	uint8_t token[FABRIC_RDMA_TOKEN];
} __attribute__((packed));

struct rqp {
	struct rpeer *rp;
	struct rdma_cm_id *id;
	int idx;
	bool up;
	unsigned wrs;                /* work requests posted and not yet completed */
};

/* p->rdma: a peer's queue pairs. */
struct rpeer {
	struct peer *p;
	uint8_t token[FABRIC_RDMA_TOKEN];
	bool offered;                /* we announced the token (inbound side) */
	bool said_up;
	struct rqp qp[RQP_POOL];
	unsigned next;
};

/* A registration: a local region's (h == NULL, the cache) or one import of an export. */
struct rmr {
	TAILQ_ENTRY(rmr) entry;
	struct region *r;
	struct ibv_mr *mr;
	struct phandle *h;
	const struct peer *p;        /* the importer, only compared */
	bool writable;               /* local: LOCAL_WRITE (may be an RDMA READ's destination) */
	/* a local region in GPU memory that the NIC cannot register: mr is NULL, it is staged */
};

static struct {
	bool on;
	struct ibv_context *ctx;
	uint8_t port_num;
	struct ibv_pd *pd;
	struct ibv_comp_channel *cc;
	struct ibv_cq *cq;
	struct rdma_event_channel *ech;
	struct rdma_cm_id *listen_id;
	uint16_t port;               /* of listen_id, host order; 0: we cannot answer */
	uint8_t rd_atom;             /* RDMA READs in flight per queue pair */
	int max_cqe;
	struct event *cq_ev, *cm_ev, *async_ev;
	char name[80];
	uint64_t nreg, regfail;
	uint64_t gpu_dmabuf, gpu_peermem, gpu_none;   /* GPU memory registrations, by how */
} dev;

static pthread_mutex_t mlock = PTHREAD_MUTEX_INITIALIZER;
static TAILQ_HEAD(, rmr) mrs = TAILQ_HEAD_INITIALIZER(mrs);

static void
nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* ---- queue pairs ---- */

static void
qp_teardown(struct rqp *q)
{
	if (q->id == NULL)
		return;
	if (q->up)
		rdma_disconnect(q->id);
	if (q->id->qp != NULL)
		rdma_destroy_qp(q->id);
	rdma_destroy_id(q->id);
	q->id = NULL;
	q->up = false;
	q->wrs = 0;
}

static struct rpeer *
rpeer_get(struct peer *p)
{
	if (p->rdma == NULL && (p->rdma = calloc(1, sizeof(*p->rdma))) != NULL) {
		p->rdma->p = p;
		for (int i = 0; i < RQP_POOL; i++) {
			p->rdma->qp[i].rp = p->rdma;
			p->rdma->qp[i].idx = i;
		}
	}
	return p->rdma;
}

/*
 * A queue pair failed.  One that carried data (or any, once the peer is on rdma) takes the
 * whole peer down: its chunks fail now and the connection comes back with a new epoch.  One
 * that never came up only leaves the peer on tcp.
 */
static void
qp_fail(struct rqp *q, const char *why)
{
	struct rpeer *rp = q->rp;
	struct peer *p = rp->p;

	if (q->up || rp->said_up) {
		peer_kill(p, "rdma queue pair %d: %s", q->idx, why);
		return;
	}
	log_info("fabric: peer %s: rdma queue pair %d not connected (%s): data over tcp", p->node, q->idx, why);
	qp_teardown(q);
}

static int
qp_create(struct rqp *q)
{
	struct ibv_qp_init_attr a = {
		.send_cq = dev.cq, .recv_cq = dev.cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
		.cap = { .max_send_wr = RQP_DEPTH, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
	};

	if (q->id->verbs != dev.ctx) {
		errno = ENODEV;          /* routed to another device than the one we registered on */
		return -1;
	}
	return rdma_create_qp(q->id, dev.pd, &a);
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
conn_param(struct rdma_conn_param *cp, const void *pd, size_t pdl)
{
	memset(cp, 0, sizeof(*cp));
	cp->private_data = pd;
	cp->private_data_len = (uint8_t)pdl;
	cp->responder_resources = dev.rd_atom;
	cp->initiator_depth = dev.rd_atom;
	cp->retry_count = 7;
	cp->rnr_retry_count = 7;
}

static void
qp_established(struct rqp *q)
{
	struct rpeer *rp = q->rp;
	int n = 0;

	q->up = true;
	for (int i = 0; i < RQP_POOL; i++)
		n += rp->qp[i].up;
	if (n == RQP_POOL || !rp->said_up)
		log_info("fabric: peer %s (epoch %08x): transport rdma, %d of %d queue pairs on %s", rp->p->node,
		    rp->p->epoch, n, RQP_POOL, dev.name);
	rp->said_up = true;
	fabric_kick();
}

/* The inbound side: a connection request is accepted only as announced on a control connection. */
static void
on_request(struct rdma_cm_id *id, const uint8_t *pd, size_t pdl)
{
	struct rdma_hello h;
	struct rdma_conn_param cp;
	struct peer *p = NULL;
	const char *why = NULL;
	uint32_t idx = 0;

	if (pdl < sizeof(h))
		why = "no gpx private data";
	else {
		memcpy(&h, pd, sizeof(h));
		idx = ntohl(h.index);
		if (ntohl(h.magic) != RDMA_MAGIC)
			why = "no gpx private data";
		else if (idx >= RQP_POOL)
			why = "queue pair index out of range";
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
			else if (id->verbs != dev.ctx)
				why = "it arrived on another device";
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
	id->context = q;
	conn_param(&cp, NULL, 0);
	ack_timeout(id);
	if (qp_create(q) < 0 || rdma_accept(id, &cp) < 0) {
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
		h.magic = htonl(RDMA_MAGIC);
		h.epoch = htonl(q->rp->p->epoch);
		h.index = htonl((uint32_t)q->idx);
		memcpy(h.token, q->rp->token, sizeof(h.token));
		conn_param(&cp, &h, sizeof(h));
		ack_timeout(q->id);
		if (qp_create(q) < 0 || rdma_connect(q->id, &cp) < 0)
			qp_fail(q, strerror(errno));
		break;
	case RDMA_CM_EVENT_ESTABLISHED:
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
		if (e.event == RDMA_CM_EVENT_CONNECT_REQUEST && ev->param.conn.private_data != NULL) {
			pdl = ev->param.conn.private_data_len < sizeof(pd) ? ev->param.conn.private_data_len : sizeof(pd);
			memcpy(pd, ev->param.conn.private_data, pdl);
		}
		rdma_ack_cm_event(ev);
		cm_event(&e, pd, pdl);
	}
}

/* ---- completions and async events ---- */

static struct rqp *
qp_by_num(uint32_t num)
{
	struct peer *p;

	TAILQ_FOREACH(p, &peers, entry)
		for (int i = 0; p->rdma != NULL && i < RQP_POOL; i++)
			if (p->rdma->qp[i].id != NULL && p->rdma->qp[i].id->qp != NULL &&
			    p->rdma->qp[i].id->qp->qp_num == num)
				return &p->rdma->qp[i];
	return NULL;
}

static void
on_cq(evutil_socket_t fd, short what, void *arg)
{
	struct ibv_cq *cq;
	void *ctx;
	struct ibv_wc wc[16];
	unsigned ev = 0;
	int n;

	(void)fd;
	(void)what;
	(void)arg;
	while (ibv_get_cq_event(dev.cc, &cq, &ctx) == 0)
		ev++;
	if (ev > 0)
		ibv_ack_cq_events(dev.cq, ev);
	ibv_req_notify_cq(dev.cq, 0);
	while ((n = ibv_poll_cq(dev.cq, 16, wc)) > 0)
		for (int i = 0; i < n; i++) {
			uint64_t id = wc[i].wr_id & ((1ULL << WRID_SHIFT) - 1);
			struct rqp *q = qp_by_num(wc[i].qp_num);
			if (q != NULL && wc[i].status == IBV_WC_SUCCESS) {
				unsigned nwr = (unsigned)(wc[i].wr_id >> WRID_SHIFT);
				q->wrs = q->wrs > nwr ? q->wrs - nwr : 0;
			}
			fabric_rdma_done(id, wc[i].status == IBV_WC_SUCCESS, ibv_wc_status_str(wc[i].status));
		}
}

/* Every peer with a queue pair on this device goes down (port or device error). */
static void
kill_all(const char *why)
{
	struct peer *p, *t;

	TAILQ_FOREACH_SAFE(p, &peers, entry, t)
		if (p->rdma != NULL && p->rdma->said_up)
			peer_kill(p, "rdma: %s", why);
}

static void
on_async(evutil_socket_t fd, short what, void *arg)
{
	struct ibv_async_event ae;
	struct peer *p, *t;

	(void)fd;
	(void)what;
	(void)arg;
	while (ibv_get_async_event(dev.ctx, &ae) == 0) {
		enum ibv_event_type type = ae.event_type;
		struct ibv_qp *qp = ae.element.qp;
		ibv_ack_async_event(&ae);
		switch (type) {
		case IBV_EVENT_QP_FATAL:
		case IBV_EVENT_QP_REQ_ERR:
		case IBV_EVENT_QP_ACCESS_ERR:
		case IBV_EVENT_PATH_MIG_ERR:
			TAILQ_FOREACH_SAFE(p, &peers, entry, t)
				for (int i = 0; p->rdma != NULL && i < RQP_POOL; i++)
					if (p->rdma->qp[i].id != NULL && p->rdma->qp[i].id->qp == qp) {
						peer_kill(p, "rdma queue pair %d: %s", i, ibv_event_type_str(type));
						break;
					}
			break;
		case IBV_EVENT_PORT_ERR:
		case IBV_EVENT_DEVICE_FATAL:
			log_warnx("fabric: %s: %s", dev.name, ibv_event_type_str(type));
			kill_all(ibv_event_type_str(type));
			break;
		case IBV_EVENT_PORT_ACTIVE:
			log_info("fabric: %s: port active", dev.name);
			break;
		default:
			log_debug("fabric", "%s: %s", dev.name, ibv_event_type_str(type));
		}
	}
}

/* ---- what peer.c calls ---- */

bool
fabric_rdma_offer(struct peer *p, uint32_t *port, uint8_t token[FABRIC_RDMA_TOKEN])
{
	struct rpeer *rp;

	if (!dev.on || dev.port == 0 || (rp = rpeer_get(p)) == NULL)
		return false;
	if (getrandom(rp->token, sizeof(rp->token), 0) != (ssize_t)sizeof(rp->token))
		return false;
	rp->offered = true;
	memcpy(token, rp->token, FABRIC_RDMA_TOKEN);
	*port = dev.port;
	return true;
}

void
fabric_rdma_connect(struct peer *p, uint32_t port, const uint8_t *token, size_t tokenlen)
{
	struct sockaddr_storage src, dst;
	socklen_t sl = sizeof(src), dl = sizeof(dst);
	int fd = p->bev != NULL ? bufferevent_getfd(p->bev) : -1;
	struct rpeer *rp;

	if (!dev.on || port == 0 || port > 65535 || tokenlen != FABRIC_RDMA_TOKEN) {
		if (dev.on)
			log_info("fabric: peer %s offers no rdma: data over tcp", p->node);
		return;
	}
	if (fd < 0 || getsockname(fd, (struct sockaddr *)&src, &sl) < 0 ||
	    getpeername(fd, (struct sockaddr *)&dst, &dl) < 0 || (rp = rpeer_get(p)) == NULL)
		return;
	memcpy(rp->token, token, FABRIC_RDMA_TOKEN);
	if (src.ss_family == AF_INET) {
		((struct sockaddr_in *)&src)->sin_port = 0;
		((struct sockaddr_in *)&dst)->sin_port = htons((uint16_t)port);
	} else {
		((struct sockaddr_in6 *)&src)->sin6_port = 0;
		((struct sockaddr_in6 *)&dst)->sin6_port = htons((uint16_t)port);
	}
	for (int i = 0; i < RQP_POOL; i++) {
		struct rqp *q = &rp->qp[i];
		if (rdma_create_id(dev.ech, &q->id, q, RDMA_PS_TCP) < 0) {
			q->id = NULL;
			log_warn("fabric: peer %s: rdma_create_id", p->node);
			continue;
		}
		if (rdma_resolve_addr(q->id, (struct sockaddr *)&src, (struct sockaddr *)&dst, CM_TIMEOUT_MS) < 0)
			qp_fail(q, strerror(errno));
	}
}

/* Before the peer's chunks fail: afterwards the device touches none of their buffers. */
void
fabric_rdma_peer_down(struct peer *p)
{
	struct rpeer *rp = p->rdma;

	if (rp == NULL)
		return;
	p->rdma = NULL;
	for (int i = 0; i < RQP_POOL; i++)
		qp_teardown(&rp->qp[i]);
	free(rp);
}

uint32_t
fabric_rdma_qps(const struct peer *p)
{
	uint32_t n = 0;

	for (int i = 0; p->rdma != NULL && i < RQP_POOL; i++)
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
	return dev.on ? dev.name : NULL;
}

/* ---- registrations ---- */

static bool nic_is_open(const struct region *);

/*
 * r's GPU memory for the NIC, at iova: from the dma-buf the driver exports for the pages
 * around it, else from the device pointer (nvidia-peermem).  NULL when neither works.  A
 * driver call on the loop thread, once per region and import (its result is kept).
 */
static struct ibv_mr *
gpu_reg(const struct region *r, uint64_t iova, int acc)
{
#ifndef HAVE_CUDA
	(void)r, (void)iova, (void)acc;
	return NULL;
#else
	uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
	uint64_t a0 = r->dptr & ~(pg - 1), a1 = (r->dptr + r->length + pg - 1) & ~(pg - 1);
	struct ibv_mr *mr = NULL;
	int fd = cuda_use(r->dev) == 0 ? cuda_dmabuf(a0, a1 - a0) : -1;

	if (fd >= 0) {
		mr = ibv_reg_dmabuf_mr(dev.pd, r->dptr - a0, r->length, iova, fd, acc);
		close(fd);              /* the registration holds the dma-buf */
		if (mr != NULL) {
			dev.gpu_dmabuf++;
			return mr;
		}
	}
	if ((mr = ibv_reg_mr_iova(dev.pd, (void *)(uintptr_t)r->dptr, r->length, iova, acc)) != NULL) {
		dev.gpu_peermem++;
		return mr;
	}
	dev.gpu_none++;
	log_warnx("fabric: %s cannot register %llu bytes of GPU %d memory (dma-buf: %s; peermem: %s): "
	    "they are staged through host buffers", dev.name, (unsigned long long)r->length, r->dev,
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

bool
fabric_rdma_export(struct peer *p, struct phandle *h, uint64_t *addr, uint32_t *rkey)
{
	struct region *r = h->r;
	struct rmr *m;
	int acc = IBV_ACCESS_REMOTE_READ;

	if (!dev.on || r->length == 0 || (r->host == NULL && !nic_is_open(r)) ||
	    (m = calloc(1, sizeof(*m))) == NULL)
		return false;
	if (!h->read_only && !r->read_only)
		acc |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	/* iova 0: the peer addresses the export by offset and learns no address of ours. */
	*addr = 0;
	if (r->host == NULL)
		m->mr = gpu_reg(r, 0, acc);
	else if ((m->mr = ibv_reg_mr_iova(dev.pd, r->host, r->length, 0, acc)) == NULL) {
		*addr = (uintptr_t)r->host;
		m->mr = ibv_reg_mr(dev.pd, r->host, r->length, acc);
	}
	if (m->mr == NULL) {
		log_warn("fabric: peer %s: registering export %s (%llu bytes) for rdma; it goes over tcp%s",
		    p->node, h->export_name, (unsigned long long)r->length, r->host ? "" : ", staged");
		dev.regfail++;
		free(m);
		return false;
	}
	m->r = r;
	m->h = h;
	m->p = p;
	*rkey = m->mr->rkey;
	pthread_mutex_lock(&mlock);
	TAILQ_INSERT_TAIL(&mrs, m, entry);
	h->mr = m;
	dev.nreg++;
	pthread_mutex_unlock(&mlock);
	return true;
}

void
fabric_rdma_unexport(struct phandle *h)
{
	struct rmr *m;

	pthread_mutex_lock(&mlock);
	if ((m = h->mr) != NULL) {
		TAILQ_REMOVE(&mrs, m, entry);
		h->mr = NULL;
	}
	pthread_mutex_unlock(&mlock);
	if (m != NULL) {
		ibv_dereg_mr(m->mr);
		free(m);
	}
}

/* The cached registration of a local region, made on first use; NULL if it cannot be. */
static struct ibv_mr *
local_mr(struct region *r, bool write_into)
{
	struct rmr *m;
	struct ibv_mr *mr = NULL;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH(m, &mrs, entry)
		if (m->r == r && m->h == NULL && (m->writable || !write_into)) {
			mr = m->mr;
			break;
		}
	pthread_mutex_unlock(&mlock);
	if (m != NULL || (write_into && r->read_only))
		return mr;
	if ((m = calloc(1, sizeof(*m))) == NULL)
		return NULL;
	m->writable = !r->read_only;
	if (r->host == NULL) {
		/* Cached even when it fails: the chunks of this region are staged from now on. */
		m->mr = gpu_reg(r, r->dptr, m->writable ? IBV_ACCESS_LOCAL_WRITE : 0);
		m->r = r;
		pthread_mutex_lock(&mlock);
		TAILQ_INSERT_TAIL(&mrs, m, entry);
		pthread_mutex_unlock(&mlock);
		return m->mr;
	}
	if ((m->mr = ibv_reg_mr(dev.pd, r->host, r->length, m->writable ? IBV_ACCESS_LOCAL_WRITE : 0)) == NULL) {
		log_warn("fabric: registering a %llu-byte region for rdma", (unsigned long long)r->length);
		dev.regfail++;
		free(m);
		return NULL;
	}
	m->r = r;
	pthread_mutex_lock(&mlock);
	TAILQ_INSERT_TAIL(&mrs, m, entry);
	dev.nreg++;
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
			if (m->h != NULL)
				m->h->mr = NULL;
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

/*
 * The NIC for a transfer whose local side is r: for GPU memory the one daemon/nic.c chooses
 * for its GPU (nic_for_gpuN, else the nearest by PCI), for host memory rdma_device (else the
 * device open).  Its name into name; false when there is none.
 */
bool
fabric_rdma_nic(const struct region *r, char *name, size_t namelen, const char **why)
{
	enum nic_why w;

	if (r->dev != DEV_HOST) {
		if (!nic_for_dev(r->dev, name, namelen, &w))
			return false;
		*why = nic_why_str(w);
		return true;
	}
	*why = cfg->fabric_rdma_device != NULL ? "rdma_device" : "first with an active port";
	snprintf(name, namelen, "%s", cfg->fabric_rdma_device != NULL ? cfg->fabric_rdma_device : dev.on ? dev.name : "");
	name[strcspn(name, " ")] = '\0';                  /* dev.name: "rxe0 port 1" */
	return name[0] != '\0';
}

/* GPU memory goes only through its GPU's NIC: the one open, or none (tcp refuses it anyway). */
static bool
nic_is_open(const struct region *r)
{
	char want[64];
	const char *why;

	if (r->dev == DEV_HOST)
		return true;
	if (!fabric_rdma_nic(r, want, sizeof(want), &why))
		return false;
	return strncmp(dev.name, want, strlen(want)) == 0 && dev.name[strlen(want)] == ' ';
}

int
fabric_rdma_post(struct peer *p, uint64_t id, bool write, struct region *local, uint64_t off, uint64_t len,
    uint64_t raddr, uint32_t rkey)
{
	uintptr_t buf = local->host != NULL ? (uintptr_t)local->host + off : (uintptr_t)(local->dptr + off);
	struct rpeer *rp = p->rdma;
	struct rqp *q = NULL;
	struct ibv_mr *mr;
	unsigned nwr = write ? 1 : (unsigned)((len + RDMA_READ_SEG - 1) / RDMA_READ_SEG);

	if (rp == NULL || len == 0 || len > UINT32_MAX || nwr > RQP_DEPTH || id >> WRID_SHIFT != 0)
		return -1;
	for (int i = 0; i < RQP_POOL && q == NULL; i++) {
		struct rqp *c = &rp->qp[(rp->next + i) % RQP_POOL];
		if (c->up && c->wrs + nwr <= RQP_DEPTH)
			q = c;
	}
	if (q == NULL || !nic_is_open(local) || (mr = local_mr(local, !write)) == NULL)
		return -1;
	struct ibv_sge sge[RQP_DEPTH];
	struct ibv_send_wr wr[RQP_DEPTH], *bad;
	uint64_t wrid = id | (uint64_t)nwr << WRID_SHIFT;
	for (unsigned i = 0; i < nwr; i++) {
		uint64_t o = write ? 0 : (uint64_t)i * RDMA_READ_SEG;
		uint32_t l = write ? (uint32_t)len : (uint32_t)(len - o < RDMA_READ_SEG ? len - o : RDMA_READ_SEG);
		sge[i] = (struct ibv_sge){ .addr = buf + o, .length = l, .lkey = mr->lkey };
		wr[i] = (struct ibv_send_wr){
			.wr_id = wrid, .sg_list = &sge[i], .num_sge = 1, .next = i + 1 < nwr ? &wr[i + 1] : NULL,
			.opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ,
			.send_flags = i + 1 == nwr ? IBV_SEND_SIGNALED : 0,
		};
		wr[i].wr.rdma.remote_addr = raddr + o;
		wr[i].wr.rdma.rkey = rkey;
	}
	if ((errno = ibv_post_send(q->id->qp, wr, &bad)) != 0) {
		log_warn("fabric: peer %s: posting on rdma queue pair %d", p->node, q->idx);
		/* Nothing of a list refused at its first request was posted.  A part of it was: its
		 * completion would never come, so the queue pair carries nothing more, and this
		 * chunk goes over tcp (the parts posted only read the same bytes into it). */
		if (bad != &wr[0])
			q->up = false;
		return -1;
	}
	q->wrs += nwr;
	rp->next = (unsigned)(q->idx + 1) % RQP_POOL;
	return 0;
}

/* ---- start and stop ---- */

/* The first device (or [fabric] rdma_device) with an active port. */
static bool
pick(char *why, size_t whylen)
{
	int n = 0;
	struct ibv_context **l = rdma_get_devices(&n);
	bool named = false;

	for (int i = 0; l != NULL && i < n && !dev.on; i++) {
		const char *nm = ibv_get_device_name(l[i]->device);
		struct ibv_device_attr da;
		if (cfg->fabric_rdma_device != NULL && strcmp(cfg->fabric_rdma_device, nm) != 0)
			continue;
		named = true;
		if (ibv_query_device(l[i], &da) != 0)
			continue;
		for (uint8_t pn = 1; pn <= da.phys_port_cnt; pn++) {
			struct ibv_port_attr pa;
			if (ibv_query_port(l[i], pn, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
				dev.ctx = l[i];
				dev.port_num = pn;
				dev.max_cqe = da.max_cqe;
				dev.rd_atom = (uint8_t)(da.max_qp_rd_atom < RQP_RD_ATOM ? da.max_qp_rd_atom : RQP_RD_ATOM);
				snprintf(dev.name, sizeof(dev.name), "%s port %u", nm, pn);
				dev.on = true;
				break;
			}
		}
	}
	if (!dev.on)
		snprintf(why, whylen, "%s", n == 0 ? "no RDMA device" : cfg->fabric_rdma_device && !named ?
		    "rdma_device names no RDMA device" : "no RDMA device has an active port");
	if (l != NULL)
		rdma_free_devices(l);
	return dev.on;
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
	if ((dev.pd = ibv_alloc_pd(dev.ctx)) == NULL || (dev.cc = ibv_create_comp_channel(dev.ctx)) == NULL ||
	    (dev.cq = ibv_create_cq(dev.ctx, dev.max_cqe < CQ_DEPTH ? dev.max_cqe : CQ_DEPTH, NULL, dev.cc, 0)) == NULL ||
	    ibv_req_notify_cq(dev.cq, 0) != 0 || (dev.ech = rdma_create_event_channel()) == NULL) {
		snprintf(why, whylen, "%s: setting up: %s", dev.name, strerror(errno));
		fabric_rdma_shutdown();
		goto off;
	}
	nonblock(dev.cc->fd);
	nonblock(dev.ctx->async_fd);
	nonblock(dev.ech->fd);
	dev.cq_ev = event_new(b, dev.cc->fd, EV_READ | EV_PERSIST, on_cq, NULL);
	dev.cm_ev = event_new(b, dev.ech->fd, EV_READ | EV_PERSIST, on_cm, NULL);
	dev.async_ev = event_new(b, dev.ctx->async_fd, EV_READ | EV_PERSIST, on_async, NULL);
	if (dev.cq_ev == NULL || dev.cm_ev == NULL || dev.async_ev == NULL) {
		snprintf(why, whylen, "out of memory");
		fabric_rdma_shutdown();
		goto off;
	}
	event_add(dev.cq_ev, NULL);
	event_add(dev.cm_ev, NULL);
	event_add(dev.async_ev, NULL);
	listen_rdma();
	for (int g = 0; g < gpu_count() && g < NIC_GPUS; g++) {
		char nic[64];
		enum nic_why w;
		if (nic_for_dev(g, nic, sizeof(nic), &w))
			log_info("fabric: GPU%d's memory would go through %s (%s); host memory through %s", g, nic,
			    nic_why_str(w), dev.name);
	}
	if (dev.port)
		snprintf(why, whylen, "rdma on %s, rdma_cm port %u", dev.name, dev.port);
	else
		snprintf(why, whylen, "rdma on %s (outbound only)", dev.name);
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
		if (m->h != NULL)
			m->h->mr = NULL;
		ibv_dereg_mr(m->mr);
		free(m);
	}
	pthread_mutex_unlock(&mlock);
	if (dev.cq_ev != NULL)
		event_free(dev.cq_ev);
	if (dev.cm_ev != NULL)
		event_free(dev.cm_ev);
	if (dev.async_ev != NULL)
		event_free(dev.async_ev);
	if (dev.listen_id != NULL)
		rdma_destroy_id(dev.listen_id);
	if (dev.ech != NULL)
		rdma_destroy_event_channel(dev.ech);
	if (dev.cq != NULL)
		ibv_destroy_cq(dev.cq);
	if (dev.cc != NULL)
		ibv_destroy_comp_channel(dev.cc);
	if (dev.pd != NULL)
		ibv_dealloc_pd(dev.pd);
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
bool fabric_rdma_offer(struct peer *p, uint32_t *port, uint8_t token[FABRIC_RDMA_TOKEN])
{ (void)p; (void)port; (void)token; return false; }
void fabric_rdma_connect(struct peer *p, uint32_t port, const uint8_t *token, size_t tokenlen)
{ (void)p; (void)port; (void)token; (void)tokenlen; }
void fabric_rdma_peer_down(struct peer *p) { (void)p; }
uint32_t fabric_rdma_qps(const struct peer *p) { (void)p; return 0; }
uint32_t fabric_rdma_regs(const struct peer *p) { (void)p; return 0; }
const char *fabric_rdma_device(void) { return NULL; }
bool fabric_rdma_export(struct peer *p, struct phandle *h, uint64_t *addr, uint32_t *rkey)
{ (void)p; (void)h; (void)addr; (void)rkey; return false; }
void fabric_rdma_unexport(struct phandle *h) { (void)h; }
void fabric_rdma_region_gone(struct region *r) { (void)r; }
bool fabric_rdma_nic(const struct region *r, char *name, size_t namelen, const char **why)
{ (void)r; (void)name; (void)namelen; (void)why; return false; }
int fabric_rdma_post(struct peer *p, uint64_t id, bool write, struct region *local, uint64_t off, uint64_t len,
    uint64_t raddr, uint32_t rkey)
{ (void)p; (void)id; (void)write; (void)local; (void)off; (void)len; (void)raddr; (void)rkey; return -1; }
void fabric_rdma_gpu_regs(uint64_t *dmabuf, uint64_t *peermem, uint64_t *none)
{ *dmabuf = *peermem = *none = 0; }

#endif
