/*
 * The raw-verbs anchor (bench-verbs.h): librdmacm to connect, libibverbs to move, nothing of
 * gpx in between.  Both sides register their buffer once per device (each rail may be its own
 * device), every work request is signalled, and the active side polls its completion queues
 * busily, as ib_write_bw and ib_read_bw do.
 */
#include "config.h"

#include <endian.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <netdb.h>
#include <rdma/rdma_cma.h>

#include "tests/bench-verbs.h"

#define DEPTH 16                     /* work requests in flight on a queue pair */
#define MAX_QPS 64
/*
 * READs paced as a program must pace them on RoCE, where a read's responses have no flow
 * control and a lost packet waits for the requester's ack timer: 64 KiB a request, two in
 * flight a queue pair (ib_read_bw -s 64K -o 2), and an ack timeout of 4.096 us << 14 (67 ms)
 * instead of rdma_cm's seconds.  gpxd paces its own READs the same way (daemon/fabric/rdma.h).
 */
#define READ_PIECE (64u << 10)
#define READ_DEPTH 2
#define ACK_TIMEOUT 14

/* What the server gives each connection in the accept's private data (big endian). */
struct offer {
	uint64_t addr, len;
	uint32_t rkey, pad;
};

/* A buffer registered with one device: per protection domain. */
struct reg {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
};

static struct reg *
reg_for(struct reg *regs, int *nregs, struct ibv_context *ctx, void *buf, size_t len, int access)
{
	for (int i = 0; i < *nregs; i++)
		if (regs[i].ctx == ctx)
			return &regs[i];
	if (*nregs == MAX_QPS)
		return NULL;
	struct reg *r = &regs[*nregs];
	r->ctx = ctx;
	if ((r->pd = ibv_alloc_pd(ctx)) == NULL)
		return NULL;
	if ((r->mr = ibv_reg_mr(r->pd, buf, len, access)) == NULL) {
		ibv_dealloc_pd(r->pd);
		return NULL;
	}
	(*nregs)++;
	return r;
}

static void
regs_free(struct reg *regs, int n)
{
	for (int i = 0; i < n; i++) {
		ibv_dereg_mr(regs[i].mr);
		ibv_dealloc_pd(regs[i].pd);
	}
}

static int
qp_make(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq **cq)
{
	struct ibv_qp_init_attr qa = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = DEPTH, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
	};

	if ((*cq = ibv_create_cq(id->verbs, DEPTH + 1, NULL, NULL, 0)) == NULL)
		return -1;
	qa.send_cq = qa.recv_cq = *cq;
	if (rdma_create_qp(id, pd, &qa) < 0) {
		ibv_destroy_cq(*cq);
		*cq = NULL;
		return -1;
	}
	return 0;
}

/* ---- the passive side ---- */

struct sconn {
	struct rdma_cm_id *id;
	struct ibv_cq *cq;
};

struct verbs_server {
	struct rdma_event_channel *ch;
	struct rdma_cm_id *listen;
	void *buf;
	size_t len;
	struct reg regs[MAX_QPS];
	int nregs;
	struct sconn conns[MAX_QPS];
	int nconns;
	int stop[2];
	pthread_t th;
};

static void
sconn_drop(struct sconn *c)
{
	if (c->id == NULL)
		return;
	rdma_destroy_qp(c->id);
	ibv_destroy_cq(c->cq);
	rdma_destroy_id(c->id);
	c->id = NULL;
}

static void
server_request(struct verbs_server *s, struct rdma_cm_event *ev)
{
	struct rdma_cm_id *id = ev->id;
	struct sconn *c = NULL;
	struct reg *r;
	struct offer o;
	/* The request's figures are given from our side: its responder_resources are the READs
	 * the other side wants to have in flight to us (its initiator depth). */
	struct rdma_conn_param p = { .responder_resources = ev->param.conn.responder_resources,
	    .initiator_depth = 0, .rnr_retry_count = 7 };

	for (int i = 0; i < MAX_QPS && c == NULL; i++)      /* a slot a connection that went left */
		if (s->conns[i].id == NULL)
			c = &s->conns[i];
	if (c == NULL || (r = reg_for(s->regs, &s->nregs, id->verbs, s->buf, s->len,
	    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE)) == NULL ||
	    qp_make(id, r->pd, &c->cq) < 0) {
		rdma_reject(id, NULL, 0);
		return;
	}
	c->id = id;
	o.addr = htobe64((uintptr_t)s->buf);
	o.len = htobe64(s->len);
	o.rkey = htobe32(r->mr->rkey);
	o.pad = 0;
	p.private_data = &o;
	p.private_data_len = sizeof(o);
	if (rdma_accept(id, &p) < 0) {
		rdma_destroy_qp(id);
		ibv_destroy_cq(c->cq);
		c->id = NULL;
		rdma_reject(id, NULL, 0);
		return;
	}
	if (c - s->conns >= s->nconns)
		s->nconns = (int)(c - s->conns) + 1;
}

static void *
server_loop(void *arg)
{
	struct verbs_server *s = arg;
	struct pollfd pf[2] = { { .fd = s->ch->fd, .events = POLLIN }, { .fd = s->stop[0], .events = POLLIN } };
	struct rdma_cm_event *ev;

	while (poll(pf, 2, -1) >= 0 || errno == EINTR) {
		if (pf[1].revents)
			break;
		if (!(pf[0].revents & POLLIN) || rdma_get_cm_event(s->ch, &ev) < 0)
			continue;
		struct rdma_cm_id *id = ev->id;
		enum rdma_cm_event_type type = ev->event;
		if (type == RDMA_CM_EVENT_CONNECT_REQUEST)
			server_request(s, ev);
		rdma_ack_cm_event(ev);
		if (type == RDMA_CM_EVENT_DISCONNECTED)
			for (int i = 0; i < s->nconns; i++)
				if (s->conns[i].id == id)
					sconn_drop(&s->conns[i]);
	}
	return NULL;
}

struct verbs_server *
verbs_serve(uint16_t port, void *buf, size_t len, char *why, size_t whylen)
{
	struct verbs_server *s = calloc(1, sizeof(*s));
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };

	if (s == NULL) {
		snprintf(why, whylen, "out of memory");
		return NULL;
	}
	s->buf = buf;
	s->len = len;
	s->stop[0] = s->stop[1] = -1;
	if ((s->ch = rdma_create_event_channel()) == NULL || rdma_create_id(s->ch, &s->listen, s, RDMA_PS_TCP) < 0 ||
	    rdma_bind_addr(s->listen, (struct sockaddr *)&sa) < 0 || rdma_listen(s->listen, MAX_QPS) < 0 ||
	    pipe(s->stop) < 0 || pthread_create(&s->th, NULL, server_loop, s) != 0) {
		snprintf(why, whylen, "listening for RDMA connections on port %u: %s", port, strerror(errno));
		if (s->listen != NULL)
			rdma_destroy_id(s->listen);
		if (s->ch != NULL)
			rdma_destroy_event_channel(s->ch);
		if (s->stop[0] >= 0) {
			close(s->stop[0]);
			close(s->stop[1]);
		}
		free(s);
		return NULL;
	}
	return s;
}

void
verbs_server_stop(struct verbs_server *s)
{
	if (s == NULL)
		return;
	if (write(s->stop[1], "x", 1) == 1)
		pthread_join(s->th, NULL);
	for (int i = 0; i < s->nconns; i++) {
		if (s->conns[i].id != NULL)
			rdma_disconnect(s->conns[i].id);
		sconn_drop(&s->conns[i]);
	}
	rdma_destroy_id(s->listen);
	rdma_destroy_event_channel(s->ch);
	regs_free(s->regs, s->nregs);
	close(s->stop[0]);
	close(s->stop[1]);
	free(s);
}

/* ---- the active side ---- */

struct cqp {
	struct rdma_cm_id *id;
	struct ibv_cq *cq;
	uint32_t lkey, rkey;
	uint64_t raddr;
	int depth;
};

struct verbs_client {
	struct rdma_event_channel *ch;
	char *local;
	size_t len, rlen;
	struct reg regs[MAX_QPS];
	int nregs;
	struct cqp qps[MAX_QPS];
	int nqps, rails;
};

/*
 * Waits for the next event of the channel, 10 s at most (a peer that never answers is an error,
 * not a hang); it must be want.  Fills o from a connection's offer.
 */
#define EVENT_WAIT_MS 10000

static int
expect(struct verbs_client *c, enum rdma_cm_event_type want, struct offer *o, char *why, size_t whylen)
{
	struct pollfd pf = { .fd = c->ch->fd, .events = POLLIN };
	struct rdma_cm_event *ev;
	int n;

	while ((n = poll(&pf, 1, EVENT_WAIT_MS)) < 0 && errno == EINTR)
		;
	if (n == 0) {
		snprintf(why, whylen, "no %s within %d s", rdma_event_str(want), EVENT_WAIT_MS / 1000);
		return -1;
	}
	if (rdma_get_cm_event(c->ch, &ev) < 0) {
		snprintf(why, whylen, "rdma_get_cm_event: %s", strerror(errno));
		return -1;
	}
	enum rdma_cm_event_type got = ev->event;
	int status = ev->status;
	if (got == want && o != NULL) {
		if (ev->param.conn.private_data == NULL || ev->param.conn.private_data_len < sizeof(*o))
			got = RDMA_CM_EVENT_CONNECT_ERROR;
		else
			memcpy(o, ev->param.conn.private_data, sizeof(*o));
	}
	rdma_ack_cm_event(ev);
	if (got != want) {
		snprintf(why, whylen, "%s instead of %s (status %d)", rdma_event_str(got), rdma_event_str(want), status);
		return -1;
	}
	return 0;
}

static int
connect_one(struct verbs_client *c, struct sockaddr *addr, char *why, size_t whylen)
{
	struct cqp *q = &c->qps[c->nqps];
	struct ibv_device_attr da;
	struct offer o;
	struct reg *r;

	if (c->nqps == MAX_QPS) {
		snprintf(why, whylen, "more than %d queue pairs", MAX_QPS);
		return -1;
	}
	if (rdma_create_id(c->ch, &q->id, NULL, RDMA_PS_TCP) < 0) {
		snprintf(why, whylen, "rdma_create_id: %s", strerror(errno));
		return -1;
	}
	c->nqps++;               /* from here on, verbs_close takes it apart */
	uint8_t t = ACK_TIMEOUT;
	(void)rdma_set_option(q->id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof(t));
	if (rdma_resolve_addr(q->id, NULL, addr, 2000) < 0 || expect(c, RDMA_CM_EVENT_ADDR_RESOLVED, NULL, why, whylen) < 0 ||
	    rdma_resolve_route(q->id, 2000) < 0 || expect(c, RDMA_CM_EVENT_ROUTE_RESOLVED, NULL, why, whylen) < 0) {
		if (!why[0])
			snprintf(why, whylen, "resolving the address: %s", strerror(errno));
		return -1;
	}
	if ((r = reg_for(c->regs, &c->nregs, q->id->verbs, c->local, c->len, IBV_ACCESS_LOCAL_WRITE)) == NULL ||
	    qp_make(q->id, r->pd, &q->cq) < 0 || ibv_query_device(q->id->verbs, &da) != 0) {
		snprintf(why, whylen, "registering memory or making a queue pair on %s: %s",
		    ibv_get_device_name(q->id->verbs->device), strerror(errno));
		return -1;
	}
	q->depth = da.max_qp_init_rd_atom < DEPTH ? da.max_qp_init_rd_atom : DEPTH;
	if (q->depth < 1)
		q->depth = 1;
	struct rdma_conn_param p = { .initiator_depth = (uint8_t)q->depth, .responder_resources = 0,
	    .retry_count = 7, .rnr_retry_count = 7 };
	if (rdma_connect(q->id, &p) < 0 || expect(c, RDMA_CM_EVENT_ESTABLISHED, &o, why, whylen) < 0) {
		if (!why[0])
			snprintf(why, whylen, "rdma_connect: %s", strerror(errno));
		return -1;
	}
	q->lkey = r->mr->lkey;
	q->rkey = be32toh(o.rkey);
	q->raddr = be64toh(o.addr);
	c->rlen = be64toh(o.len);
	return 0;
}

struct verbs_client *
verbs_connect(const char *spec, int qps, void *local, size_t len, char *why, size_t whylen)
{
	struct verbs_client *c = calloc(1, sizeof(*c));
	char *copy = strdup(spec), *save = NULL;

	why[0] = '\0';
	if (c == NULL || copy == NULL) {
		snprintf(why, whylen, "out of memory");
		goto fail;
	}
	c->local = local;
	c->len = len;
	if ((c->ch = rdma_create_event_channel()) == NULL) {
		snprintf(why, whylen, "rdma_create_event_channel: %s", strerror(errno));
		goto fail;
	}
	for (char *tok = strtok_r(copy, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
		char *colon = strrchr(tok, ':');
		struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM }, *ai;
		if (colon == NULL) {
			snprintf(why, whylen, "\"%s\": not ADDR:PORT", tok);
			goto fail;
		}
		*colon = '\0';
		int e = getaddrinfo(tok, colon + 1, &hints, &ai);
		if (e != 0) {
			snprintf(why, whylen, "%s: %s", tok, gai_strerror(e));
			goto fail;
		}
		for (int i = 0; i < qps; i++)
			if (connect_one(c, ai->ai_addr, why, whylen) < 0) {
				freeaddrinfo(ai);
				goto fail;
			}
		freeaddrinfo(ai);
		c->rails++;
	}
	if (c->nqps == 0) {
		snprintf(why, whylen, "no address in \"%s\"", spec);
		goto fail;
	}
	free(copy);
	return c;
fail:
	free(copy);
	verbs_close(c);
	return NULL;
}

int
verbs_copy(struct verbs_client *c, bool read, size_t len, size_t chunk)
{
	if (read && chunk > READ_PIECE)
		chunk = READ_PIECE;
	size_t pieces = (len + chunk - 1) / chunk, next[MAX_QPS], done = 0;
	int out[MAX_QPS] = { 0 };
	struct timespec t0, t;
	unsigned spins = 0;

	if (len > c->len || len > c->rlen || chunk == 0)
		return -1;
	for (int q = 0; q < c->nqps; q++)
		next[q] = (size_t)q;             /* queue pair q carries pieces q, q + n, q + 2n, ... */
	clock_gettime(CLOCK_MONOTONIC, &t0);
	while (done < pieces) {
		/* A request the other side never completes: an error, not a hang (5 s of nothing). */
		if (++spins % 4096 == 0) {
			clock_gettime(CLOCK_MONOTONIC, &t);
			if (t.tv_sec - t0.tv_sec > 5) {
				fprintf(stderr, "bench-verbs: %zu of %zu %s requests not completed in 5 s\n", pieces - done,
				    pieces, read ? "READ" : "WRITE");
				return -1;
			}
		}
		for (int q = 0; q < c->nqps; q++) {
			struct cqp *p = &c->qps[q];
			int depth = read && p->depth > READ_DEPTH ? READ_DEPTH : p->depth;
			while (out[q] < depth && next[q] < pieces) {
				size_t off = next[q] * chunk, n = len - off < chunk ? len - off : chunk;
				struct ibv_sge sge = { .addr = (uintptr_t)c->local + off, .length = (uint32_t)n,
				    .lkey = p->lkey };
				struct ibv_send_wr wr = { .wr_id = next[q], .sg_list = &sge, .num_sge = 1,
				    .opcode = read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED,
				    .wr.rdma = { .remote_addr = p->raddr + off, .rkey = p->rkey } }, *bad;
				if (ibv_post_send(p->id->qp, &wr, &bad) != 0)
					return -1;
				out[q]++;
				next[q] += (size_t)c->nqps;
			}
			struct ibv_wc wc[DEPTH];
			int n = ibv_poll_cq(p->cq, DEPTH, wc);
			if (n < 0)
				return -1;
			for (int i = 0; i < n; i++)
				if (wc[i].status != IBV_WC_SUCCESS) {
					fprintf(stderr, "bench-verbs: %s\n", ibv_wc_status_str(wc[i].status));
					return -1;
				}
			out[q] -= n;
			done += (size_t)n;
			if (n > 0)
				clock_gettime(CLOCK_MONOTONIC, &t0);
		}
	}
	return 0;
}

int
verbs_queue_pairs(const struct verbs_client *c)
{
	return c->nqps;
}

int
verbs_rails(const struct verbs_client *c)
{
	return c->rails;
}

size_t
verbs_remote_len(const struct verbs_client *c)
{
	return c->rlen;
}

void
verbs_close(struct verbs_client *c)
{
	if (c == NULL)
		return;
	for (int i = 0; i < c->nqps; i++) {
		struct cqp *q = &c->qps[i];
		if (q->id->qp != NULL) {
			rdma_disconnect(q->id);
			rdma_destroy_qp(q->id);
		}
		if (q->cq != NULL)
			ibv_destroy_cq(q->cq);
		rdma_destroy_id(q->id);
	}
	regs_free(c->regs, c->nregs);
	if (c->ch != NULL)
		rdma_destroy_event_channel(c->ch);
	free(c);
}
