/*
 * What the files of a client connection share, and nothing else includes: conn.c (admission,
 * Hello, dispatch, a connection's end), conn-region.c (the handle table; Register, Pieces,
 * Deregister), conn-export.c (Export, Unexport, Import) and conn-xfer.c (Transfer, the
 * submission queue, SegArea, Cancel).  Every request handler answers with exactly one Reply
 * (now, or later from a deferred operation that holds c->pending) and takes the fds it keeps
 * by setting their slots to -1; the dispatcher closes the rest.
 */
#ifndef GPX_CONN_PRIVATE_H
#define GPX_CONN_PRIVATE_H

#include "daemon/client/client.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/gpu.h"
#include "daemon/host/host.h"

static inline void
reply_err(struct conn *c, uint32_t seq, int status, const char *msg)
{
	conn_reply(c, seq, status, msg, NULL, NULL, 0);
}

/* conn.c: who a connection is, for the log's lines about it (log.c) */
struct logwho conn_who(struct conn *);

/* conn-region.c */
/*
 * A handle on r in c's table, holding charged bytes of c's budgets (already charged); the
 * table's growth is charged here, to the request what.  NULL with err set (a budget, or memory).
 */
struct rhandle *handle_add(struct conn *, struct region *, bool imported, bool read_only, uint64_t charged,
    const char *what, char *err, size_t errlen);
/* What a handle costs: an import's; a registration's adds its region and its pieces. */
#define HANDLE_BYTES sizeof(struct rhandle)
#define REGION_BYTES(npieces) (sizeof(struct region) + (uint64_t)(npieces) * sizeof(struct gpx_wire_piece))
bool handles_release(struct conn *);   /* a gone one's, a slice at a time: true once all are */
void reply_registered(struct conn *, uint32_t seq, const struct rhandle *);
void req_register(struct conn *, uint32_t seq, const Gpx__Register *, int *fds, int nfds);
void req_pieces(struct conn *, uint32_t seq, const Gpx__Pieces *, int *fds, int nfds);
void req_deregister(struct conn *, uint32_t seq, const Gpx__Deregister *);

/* conn-export.c */
void req_export(struct conn *, uint32_t seq, const Gpx__Export *);
void req_unexport(struct conn *, uint32_t seq, const Gpx__Unexport *);
void req_import(struct conn *, uint32_t seq, const Gpx__Import *);

/* conn-xfer.c */
void req_transfer(struct conn *, uint32_t seq, const Gpx__Transfer *, int *fds, int nfds);
bool conn_sq_waiting(const struct conn *);   /* its queue has submissions not yet taken */
void req_seg_area(struct conn *, uint32_t seq, const Gpx__SegArea *, int *fds, int nfds);
void req_cancel(struct conn *, uint32_t seq, const Gpx__Cancel *);

#endif
