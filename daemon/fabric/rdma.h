/*
 * The RDMA data transport of the fabric, private to its files: the only header that includes
 * <infiniband/verbs.h> and <rdma/rdma_cma.h> (STYLE.md: one file per dependency; the
 * transport is split by job, so its files share this one header instead).  request.c decides
 * what moves; these files move it with one-sided RDMA WRITE and RDMA READ between registered
 * memory of two nodes, when both daemons have an RDMA device up ([fabric] transport = auto or
 * rdma), and otherwise say no, so that request.c sends Write and Read messages over the
 * control connection instead.  What the rest of the fabric calls is declared in internal.h
 * (fabric_rdma_*); rdma_ is rdma_cm's own prefix, so the files' shared functions are named
 * by their file: rdev_ (rdma-dev.c), rqp_ (rdma-qp.c), rmr_ (rdma-mr.c), rdata_
 * (rdma-data.c), rnote_ (rdma-note.c).
 *
 *   rdma-dev.c   the devices: which are opened, their completion queues, async events and
 *                addresses, the rdma_cm listener, each GPU's NIC; init and shutdown
 *   rdma-qp.c    queue pairs: set up through rdma_cm as the control connection announced,
 *                a pool per pair of devices for each peer, torn down with the peer
 *   rdma-mr.c    registrations: the cache of local regions, exports registered per import,
 *                GPU memory from a dma-buf or through nvidia-peermem
 *   rdma-data.c  the data path: RDMA WRITE and READ of a chunk, and their completions
 *   rdma-note.c  owners' notifications: the mailbox at each end of a queue pair, written
 *                with immediate data
 *   rdma-none.c  the interface without rdma-core, saying why (built instead of the above)
 *
 * Threads: everything runs on the loop thread (the completion channels, the async-event fds
 * and the rdma_cm event channel are watched by the libevent loop; nothing blocks), except
 * fabric_rdma_region_gone, which takes the registration lock, and the destruction of the
 * connection ids of queue pairs torn down, which may block in the kernel for as long as the
 * connection manager waits for a peer gone (rdma-qp.c: a thread of its own).
 *
 * Failures: a work completion in error, a queue pair or port error (async events), the
 * peer's disconnection or the control connection going down all end in peer_kill, which
 * destroys the queue pairs first (so the device no longer touches any buffer) and then fails
 * every waiting chunk with EIO; a chunk that never completes is caught by request.c's
 * deadline ([fabric] timeout).  The outbound side reconnects after retry_interval with a new
 * epoch.
 */
#ifndef GPX_FABRIC_RDMA_H
#define GPX_FABRIC_RDMA_H

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <event2/util.h>

#include "daemon/fabric/internal.h"

struct event;

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
 * crawled from retry to retry and missed the request deadline (tests/vm-rdma.test).  So a
 * read is posted as segments of RDMA_READ_SEG bytes (one work request each, the last one
 * signalled), at most RQP_RD_ATOM of them outstanding per queue pair: 128 KiB, about what the
 * requester keeps unacknowledged for writes.  RQP_ACK_TIMEOUT (4.096 us << 14, 67 ms) is the
 * ack timeout, so a loss costs tens of milliseconds, not the seconds rdma_cm's default waits
 * for RoCE.
 */
#define RDMA_READ_SEG (64u << 10)
#define RQP_RD_ATOM 2
#define RQP_ACK_TIMEOUT 14
/* wr_id: the request id, and in the top bits how many work requests it posted. */
#define WRID_SHIFT 48
#define WRID_RECV (1ULL << 63)       /* a receive: its mailbox slot in the low bits */

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

/* ---- rdma-dev.c ---- */
/* The devices this gpxd opened, and the rdma_cm side shared by them (loop thread). */
struct rdevs {
	bool on;
	struct rdev d[FABRIC_RDMA_DEVS];
	int n;
	struct rdma_event_channel *ech;
	struct rdma_cm_id *listen_id;
	uint16_t port;               /* of listen_id, host order; 0: we cannot answer */
	struct event *cm_ev;
	char names[FABRIC_RDMA_DEVS * 24];   /* "rxe0 port 1, rxe1 port 1" */
	int gpu_nic[GPX_MAX_GPUS];   /* the device that carries each GPU's memory (rdev_for) */
};
extern struct rdevs rdevs;
/* Our device of a verbs context (from an rdma_cm id), or NULL. */
struct rdev *rdev_of(const struct ibv_context *ctx);
/* Which of our devices may carry r: -1 any (host memory), the GPU's NIC's index, -2 none. */
int rdev_for(const struct region *r);

/* ---- rdma-qp.c ---- */
/* A queue pair failed: one that was up takes the peer down, one that never came up is dropped. */
void rqp_fail(struct rqp *q, const char *why);
/* The queue pair of qp_num on device d, or NULL. */
struct rqp *rqp_by_num(const struct rdev *d, uint32_t num);
/* Loop thread: the rdma_cm event channel is readable. */
void rqp_cm(evutil_socket_t fd, short what, void *arg);
/* The thread that lets go of connection ids off the loop: started with the channel, and
 * stopped after the peers, waiting up to wait_s for its ids; false when some are still going
 * (the channel must then stay). */
void rqp_release_start(void);
bool rqp_release_stop(double wait_s);

/* ---- rdma-mr.c ---- */
/* The cached registration of a local region on device d, made on first use; NULL if it cannot be. */
struct ibv_mr *rmr_local(struct region *r, int d, bool write_into);
void rmr_shutdown(void);                     /* every registration goes */

/* ---- rdma-data.c ---- */
/* Posts the list wr (nwr requests) on q, a queue pair of rp; -1 (said) if the device refused it. */
int rdata_post(struct rpeer *rp, struct rqp *q, struct ibv_send_wr *wr, unsigned nwr);
/* Loop thread: device arg's completion channel is readable (or fd -1: look anyway). */
void rdata_cq(evutil_socket_t fd, short what, void *arg);

/* ---- rdma-note.c ---- */
/* Our mailbox on q, on device d, with a receive posted for each slot; none, said, on failure. */
void rnote_box_open(struct rqp *q, struct rdev *d);
/* A receive completed on device d: a note in our mailbox, or a flush. */
void rnote_in(const struct rdev *d, const struct ibv_wc *wc);
/* q may carry a note: the peer has a mailbox at its other end, and we can send inline. */
bool rnote_ok(const struct rqp *q);
/* The note as the work request that ends a list on q (n holds it, may be on the stack). */
void rnote_wr(struct rqp *q, struct ibv_send_wr *wr, struct ibv_sge *sge, struct note *n,
    const struct fabric_note *note, uint64_t wrid);

#endif
