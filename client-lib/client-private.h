/*
 * What the files of libgpxclient share and nothing else sees: struct gpx_conn, the segment
 * area it holds, and the calls those files make of one another.  client.h is the narrower
 * interface that client-lib/cuda.c and the Python module use; this header is kept apart from
 * it so that the module, which links the library's objects, never reaches into a connection.
 *
 * The files, bottom up (each calls only those above it in this list):
 *   client.c             the connection: connect, close, send, receive, rpc, errors
 *   client-area.c        the segment area the long lists travel in
 *   client-completion.c  the completion ring, the backlog, poll and the waits
 *   client-region.c      host memory, registration, exports and imports, VMM pieces
 *   client-transfer.c    the submission queue, copies of every shape, cancel, copy_sync
 *   client-query.c       Query and Admin
 * and no call goes down it (build-aux/layers.test checks that no cycle of calls appears).
 */
#ifndef GPX_CLIENT_PRIVATE_H
#define GPX_CLIENT_PRIVATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "client-lib/client.h"
#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"
#include "proto/ring.h"
#include "proto/wire.h"

#define API __attribute__((visibility("default")))

/*
 * The segment area: a memfd shared read-only with the daemon, used as a ring of segment lists.
 * Positions are monotonic byte counts (offset = position % len).  Each Transfer that uses it
 * is remembered with the position where its list ends; the daemon counts the Transfers it has
 * copied out in the completion ring header (segs_consumed), which frees their space in order.
 */
struct area_use {
	uint64_t index;            /* the n-th Transfer that used the area */
	uint64_t end;              /* position after its list */
};

struct area {
	int fd;
	unsigned char *p;
	size_t len;
	uint64_t head, tail;       /* positions: next write, oldest byte still in use */
	uint64_t used;             /* Transfers sent that used the area */
	struct area_use *q;        /* FIFO of those not yet known to be consumed */
	size_t qhead, qn, qcap;
	/* gpx_segs_reserve: room at position resv for resv_n segments, until the next transfer */
	uint64_t resv;
	size_t resv_n;
};

struct gpx_conn {
	int sock;
	int efd;
	bool own_efd;                  /* efd is a doorbell only, never counted (client_doorbell_plain) */
	int epfd;
	bool dead;
	struct gpx_ring_hdr *ring;
	size_t ring_len;
	uint32_t entries;
	uint64_t tail;
	uint64_t sq_tail;              /* submissions published (our copy) */
	uint64_t client_id;
	uint32_t seq;
	uint32_t max_inline;
	uint32_t max_segs;
	unsigned outstanding;
	double spin_s;                 /* client_wait_spin */
	bool spinning;                 /* it raised cq_spinners (client_spin_begin) */
	uint64_t sync_tags;
	struct gpx_completion *back;   /* backlog, FIFO */
	size_t nback, capback;
	struct wire_arena *arena;
	struct area area;
	/* What the daemon said of the last region registered or imported (client_last_region). */
	int last_kind;
	bool last_ro;
	/* Told each refused transfer's reason (client_refusal_hook). */
	void (*refusal_fn)(void *arg, uint64_t tag, const char *reason);
	void *refusal_arg;
	uint8_t buf[GPX_MSG_MAX];
	char last_error[256];
};

/* Seconds on the monotonic clock: the spins of rpc and of the waits. */
static inline double
client_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- client.c: the connection ---- */

/* Sequence numbers of requests: never 0 (unsolicited) nor the daemon's seq for queued ones. */
uint32_t client_next_seq(gpx_conn *c);
/* Sends one message with its fds: 0, or -GPX_ECONN (the connection is then dead), -GPX_EINVAL. */
int client_send(gpx_conn *c, Gpx__ClientMsg *m, const int *fds, int nfds);
/*
 * Receives one message.  Returns the Reply (valid until the next receive), NULL with *err = 0
 * if nothing was there (non-blocking), or NULL with a negative *err.
 */
Gpx__Reply *client_recv(gpx_conn *c, bool block, int *fds, int *nfds, int *err);
/* A Reply that is no request's answer: a refused transfer becomes a completion in the backlog. */
void client_async_reply(gpx_conn *c, const Gpx__Reply *r);
/* Sends m and waits for its Reply; fds of the reply (if any) land in rfds. */
int client_rpc(gpx_conn *c, Gpx__ClientMsg *m, const int *fds, int nfds, Gpx__Reply **out, int *rfds,
    int *rnfds);
/* Appends a completion that was read but not yet handed to the caller. */
void client_backlog_push(gpx_conn *c, const struct gpx_completion *e);

/* ---- client-area.c: the segment area ---- */

/* client.c: an area's memory freed (the connection's at gpx_close, or an area replaced). */
void client_area_free(struct area *a);
/* Finds room for need bytes (a list never wraps): its position.  Waits briefly if the area is full. */
int client_area_room(gpx_conn *c, size_t need, uint64_t *at);
/* Whether segs points into the segment area (a reserved list, or a stale pointer to one). */
bool client_area_in(const gpx_conn *c, const struct gpx_seg *segs);
/* Takes need bytes of room in the area for a list: where to write it, its offset in *off. */
int client_area_take(gpx_conn *c, size_t need, void **p, uint64_t *off);
/*
 * Puts segs into the area, *off is where they start: a list written in place in the room of
 * gpx_segs_reserve stays where it is, anything else is copied in.
 */
int client_area_put(gpx_conn *c, const struct gpx_seg *segs, size_t n, uint64_t *off);
/* Records the list just sent, to be freed once the daemon reports it consumed. */
void client_area_sent(gpx_conn *c);

#endif
