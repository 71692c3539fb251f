/*
 * The data path of the RDMA transport: a chunk posted as one RDMA WRITE (local -> remote) or
 * as RDMA READs (remote -> local, paced: RDMA_READ_SEG and RQP_RD_ATOM in rdma.h), on a queue
 * pair of the peer chosen round-robin among those that may carry it (up, with room, on a
 * device that may carry the local memory, its other end on a device the remote region is
 * registered on), so that the chunks of a large transfer spread over every rail.  The local
 * memory is registered on first use (rdma-mr.c); a write that ends a transfer into a notifying
 * export carries the owner's note right behind its bytes (rdma-note.c).
 *
 * Completions: each device's completion queue is read when its channel wakes the loop; a send
 * completion ends its request (request.c), a receive is a note (rdma-note.c).  The wr_id of a
 * list carries the request id and, in its top bits, how many work requests the list posted,
 * so that a queue pair's count of outstanding requests stays right.
 */
#include "config.h"

#include <errno.h>
#include <string.h>

#include "daemon/fabric/rdma.h"

int
rdata_post(struct rpeer *rp, struct rqp *q, struct ibv_send_wr *wr, unsigned nwr)
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
	int want = rdev_for(local);

	bool with = false;

	if (!write)
		note = NULL;
	if (rp == NULL || len == 0 || len > UINT32_MAX || nwr > RQP_DEPTH || id >> WRID_SHIFT != 0 || want == -2)
		return -1;
	for (int pass = note != NULL ? 0 : 1; pass < 2 && q == NULL; pass++)
		for (int i = 0; i < RQP_MAX && mr == NULL; i++) {
			struct rqp *c = &rp->qp[(rp->next + i) % RQP_MAX];
			if (c->up && c->wrs + nwr + (pass == 0) <= RQP_DEPTH && (want < 0 || c->dev == want) && c->rdev >= 0 &&
			    rkeys[c->rdev] != 0 && (pass == 1 || rnote_ok(c)) &&
			    (mr = rmr_local(local, c->dev, !write)) != NULL) {
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
		rnote_wr(q, &wr[nwr], &sge[nwr], &n, note, wrid);
		wr[nwr - 1].next = &wr[nwr];
	}
	if (rdata_post(rp, q, wr, nwr + with) < 0)
		return -1;
	q->wseq += with;
	return note != NULL && !with;
}

/* ---- completions ---- */

void
rdata_cq(evutil_socket_t fd, short what, void *arg)
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
				rnote_in(d, &wc[i]);
				continue;
			}
			struct rqp *q = rqp_by_num(d, wc[i].qp_num);
			if (q != NULL && wc[i].status == IBV_WC_SUCCESS) {
				unsigned nwr = (unsigned)(wc[i].wr_id >> WRID_SHIFT);
				q->wrs = q->wrs > nwr ? q->wrs - nwr : 0;
			}
			request_rdma_done(id, wc[i].status == IBV_WC_SUCCESS, ibv_wc_status_str(wc[i].status));
		}
}

/* Every completion waiting on any device: before a Release drops a handle, the notes for it. */
void
fabric_rdma_drain(void)
{
	for (int i = 0; i < rdevs.n; i++)
		rdata_cq(-1, 0, &rdevs.d[i]);
}

