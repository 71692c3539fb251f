/*
 * Owners' notifications by RDMA.  Each queue pair has at each end a mailbox of RQP_NOTES slots,
 * registered at iova 0 for remote writes only, with a receive posted for every slot; its rkey
 * goes in the rdma_cm private data (rdma-qp.c).  A daemon that wrote a transfer into a
 * notifying export sends the note (handle and bytes) as an RDMA WRITE with immediate data into
 * the next slot of the peer's mailbox, the immediate naming the slot: right behind the bytes on
 * the same queue pair when the transfer is one chunk (a reliable connection delivers in order,
 * so the note lands after them; rdma-data.c), else alone once every chunk has completed
 * (fabric_rdma_note).  The peer's receives complete in order, slot after slot; it reads the
 * note, posts the receive again and notifies the owner (serve.c).  A slot is written again
 * only after the receive it consumed was posted again, so a note is never overwritten unread;
 * a writer ahead of the reader waits for a receive in its NIC (receiver-not-ready retries,
 * unbounded; the request deadline bounds it).  A queue pair without a mailbox at the other
 * end, or that cannot send inline, carries no notes: they go as Notify messages.
 */
#include "config.h"

#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>

#include "daemon/fabric/rdma.h"

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
void
rnote_box_open(struct rqp *q, struct rdev *d)
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

/* A receive completed: the peer wrote a note into our mailbox on its queue pair, or it flushed. */
void
rnote_in(const struct rdev *d, const struct ibv_wc *wc)
{
	struct rqp *q = rqp_by_num(d, wc->qp_num);
	uint32_t slot = (uint32_t)(wc->wr_id & ~WRID_RECV);
	struct note n;

	if (q == NULL || wc->status == IBV_WC_WR_FLUSH_ERR)
		return;              /* its queue pair is going or gone */
	if (wc->status != IBV_WC_SUCCESS) {
		rqp_fail(q, ibv_wc_status_str(wc->status));
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
		rqp_fail(q, strerror(errno));
		return;
	}
	serve_rdma_note(q->rp->p, be64toh(n.handle), be64toh(n.bytes));
}

bool
rnote_ok(const struct rqp *q)
{
	return q->rbox != 0 && q->inl;
}

/*
 * The note (the owner's notification) as the work request that ends a list on q: an RDMA
 * WRITE with immediate of n into the next slot of the peer's mailbox, inline (n may be on
 * the stack), its immediate the slot.  On a reliable connection it lands after every write
 * posted before it on q, and the peer's receive completes only then.
 */
void
rnote_wr(struct rqp *q, struct ibv_send_wr *wr, struct ibv_sge *sge, struct note *n,
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
		if (!q->up || q->wrs + 1 > RQP_DEPTH || !rnote_ok(q))
			continue;
		rnote_wr(q, &wr, &sge, &n, note, id | 1ULL << WRID_SHIFT);
		if (rdata_post(rp, q, &wr, 1) < 0)
			return -1;
		q->wseq++;
		return 0;
	}
	return -1;
}

