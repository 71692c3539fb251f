/*
 * Our requests to peers: the engine's path PATH_FABRIC.  A transfer with a remote side (a
 * region of kind `remote`, remote.c) is queued on PATH_FABRIC and cut into chunks of at most
 * [fabric] chunk_size, each sent to the peer that holds the export as a Write (local ->
 * remote, the bytes follow the message) or a Read (remote -> local, the bytes follow the
 * answer).  A chunk is done when its answer (Done) arrives; a transfer into an export whose
 * owner asked for notifications ends with a Notify (folded into the Write when the transfer is
 * one chunk), so the owner hears of it exactly as for a local copy.  The other side of these
 * requests is serve.c.
 *
 * Why chunks are taken on the loop thread and not by a worker as daemon/gpu/gpu-copy.c does: a chunk
 * here is a message on a non-blocking socket, not a copy that blocks, so no thread needs to
 * wait on it.  engine_submit kicks the loop (request_kick, the kick hook); the loop takes
 * chunks from the engine's chunk source (next, wait = false; fabric_chunks_from) while fewer than FABRIC_WINDOW are in flight,
 * and each answer takes the next one, which keeps the engine's round-robin between clients and
 * jobs.  The received bytes are copied out of the socket buffer into the region on the loop
 * thread: one chunk (1 MiB by default) at a time, so a large transfer never holds the loop for
 * long.
 *
 * When the peer's queue pairs are up and the import came with an RDMA registration (rdma-*.c), a
 * chunk is posted as one RDMA WRITE or READ instead of a message and ends with its work
 * completion; everything else (windows, notifications, deadlines) is the same.
 *
 * GPU memory on our side of a chunk goes by RDMA straight from or to the GPU when the NIC can
 * register it, and is staged otherwise (stage.c): a write's chunk is first copied from the GPU
 * into a host buffer, which then goes as host memory would; a read's chunk lands in a host
 * buffer and is done once copied into the GPU.  While its copy runs, a chunk belongs to the
 * stage thread: it is on no list, so a peer going down does not free it, and its done function
 * finds the peer again by name and epoch.
 *
 * Failures end every waiting chunk with EIO, never a hang: the peer connection going down
 * (peer.c), a request unanswered for [fabric] timeout seconds (the connection is then dropped:
 * a peer that lost one answer cannot be trusted with the rest), or a region imported through
 * an older connection (its epoch no longer matches: EREVOKED at submission, remote.c).
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <event2/buffer.h>
#include <event2/event.h>

#include "daemon/fabric/internal.h"

enum fop_kind { FOP_WRITE, FOP_READ, FOP_NOTIFY };

/* One request sent to a peer, waiting for its Done. */
struct fop {
	TAILQ_ENTRY(fop) entry;
	uint64_t id;
	struct peer *p;
	enum fop_kind kind;
	struct chunk c;
	uint64_t loff, roff;         /* the chunk's offsets in the local and the remote region */
	void *local;                 /* Read over tcp: where the bytes land */
	void *stage;                 /* GPU memory staged through this host buffer (stage.c) */
	bool notified;               /* the Write carried the transfer's Notify */
	bool rdma;                   /* posted as RDMA WRITE/READ: ends with its work completion */
	bool nomem;                  /* failed for want of memory (here or at the peer) */
	double deadline;
};

#define FABRIC_WINDOW 32             /* chunks in flight over all peers */
/*
 * ... and bytes: Writes queue their data on the peer's connection and Reads have the answers
 * queued on the peer's, and a connection that holds more than 96 MiB unread is dropped as
 * stuck (peer.c): 32 chunks of 4 MiB were enough to trip it.  The next chunk is taken below
 * this, so at most this plus one chunk (16 MiB) is ever in flight.
 */
#define FABRIC_WINDOW_BYTES (64u << 20)

static TAILQ_HEAD(, fop) fops = TAILQ_HEAD_INITIALIZER(fops);   /* waiting on a peer */
static uint32_t nfops;                                          /* alive: waiting or staging */
static uint64_t nfbytes;                                        /* ... and their bytes */
static uint64_t next_id;
static struct event *kick_ev;
static bool running;

/* ---- requests ---- */

static void
fop_free(struct fop *f, bool ok)
{
	stage_put(f->stage);
	nfops--;
	nfbytes -= f->c.bytes;
	if (!ok && f->nomem)
		fabric_chunks->nomem(&f->c);
	else
		fabric_chunks->done(&f->c, 1, ok);
	free(f);
}

/* f now waits on its peer, for an answer or a work completion, until its deadline. */
static void
fop_list(struct fop *f)
{
	f->deadline = now_s() + cfg->fabric_timeout_s;
	TAILQ_INSERT_TAIL(&fops, f, entry);
	f->p->inflight++;
}

static void
fop_unlist(struct fop *f)
{
	TAILQ_REMOVE(&fops, f, entry);
	f->p->inflight--;
}

static void
fop_send(struct fop *f, const Gpxpeer__PeerMsg *m, const void *data, size_t len)
{
	fop_list(f);
	/* The peer killed for it has failed f already (request_peer_down); else no memory held it. */
	if (peer_send(f->p, m, data, len) == -ENOMEM) {
		fop_unlist(f);
		f->nomem = true;
		fop_free(f, false);
	}
}

/* Waits for an RDMA completion instead of an answer. */
static void
fop_track(struct fop *f)
{
	f->rdma = true;
	fop_list(f);
}

static void pump(void);

/* The chunk as a message: a Write carrying bytes (host memory or a staged copy), or a Read. */
static void
send_chunk(struct fop *f, const struct remote *rm, const void *bytes)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Write w = GPXPEER__WRITE__INIT;
	Gpxpeer__Read rd = GPXPEER__READ__INIT;
	struct job *j = f->c.job;

	if (f->kind == FOP_WRITE) {
		w.id = f->id;
		w.handle = rm->handle;
		w.offset = f->roff;
		w.length = f->c.bytes;
		if (rm->notify && f->c.bytes == j->total) {
			w.notify = j->total;
			f->notified = true;
			f->p->notes_msg_tx++;
		}
		m.body_case = GPXPEER__PEER_MSG__BODY_WRITE;
		m.write = &w;
		fop_send(f, &m, bytes, f->c.bytes);
	} else {
		f->local = f->stage != NULL ? f->stage : (char *)j->dst->host + f->loff;
		rd.id = f->id;
		rd.handle = rm->handle;
		rd.offset = f->roff;
		rd.length = f->c.bytes;
		m.body_case = GPXPEER__PEER_MSG__BODY_READ;
		m.read = &rd;
		fop_send(f, &m, NULL, 0);
	}
}

/*
 * By RDMA from or into local at off when the import allows, a Write that is a whole transfer
 * into a notifying export with the owner's note after it; false: not by RDMA.
 */
static bool
post_rdma(struct fop *f, const struct remote *rm, struct region *local, uint64_t off)
{
	const struct job *j = f->c.job;
	struct fabric_note note = { .handle = rm->handle, .bytes = j->total };
	bool fold = f->kind == FOP_WRITE && rm->notify && f->c.bytes == j->total;
	int k;

	if (!rm->rdma || (k = fabric_rdma_post(f->p, f->id, f->kind == FOP_WRITE, local, off, f->c.bytes,
	    rm->raddr + f->roff, rm->rkeys, fold ? &note : NULL)) < 0)
		return false;
	if (fold && k == 0) {
		f->notified = true;
		f->p->notes_imm_tx++;
	}
	fop_track(f);
	return true;
}

/* By RDMA from or into f's staging buffer when the import allows; false: as a message. */
static bool
post_staged(struct fop *f, const struct remote *rm)
{
	uint64_t off;
	struct region *pool = stage_pool(f->stage, &off);

	return pool != NULL && post_rdma(f, rm, pool, off);
}

/* Loop thread: a staged Write's bytes are out of the GPU. */
static void
staged_out(void *arg, bool ok)
{
	struct fop *f = arg;
	const struct remote *rm = f->c.job->dst->priv;
	struct peer *p = rm ? peer_by_epoch(rm->node, rm->epoch) : NULL;

	if (!ok || !running || p == NULL) {
		fop_free(f, false);
		pump();
		return;
	}
	f->p = p;
	if (!post_staged(f, rm))
		send_chunk(f, rm, f->stage);
}

/* Loop thread: a staged Read's bytes are in the GPU: the chunk is done. */
static void
staged_in(void *arg, bool ok)
{
	struct fop *f = arg;

	fop_free(f, ok && running);
	pump();
}

static void
start_chunk(struct chunk *c)
{
	struct job *j = c->job;
	const struct gpx_wire_seg *g = &j->segs[c->seg];
	bool write = j->dst->kind == GPX__MEM_KIND__MEM_REMOTE;
	struct region *local = write ? j->src : j->dst;
	const struct remote *rm = (write ? j->dst : j->src)->priv;
	struct peer *p = rm ? peer_by_epoch(rm->node, rm->epoch) : NULL;
	struct fop *f;

	if (p == NULL) {
		log_debug("fabric", "client %llu tag %llu: peer %s unreachable", (unsigned long long)j->client,
		    (unsigned long long)j->tag, rm ? rm->node : "?");
		fabric_chunks->done(c, 1, false);
		return;
	}
	if ((f = calloc(1, sizeof(*f))) == NULL) {
		fabric_chunks->nomem(c);
		return;
	}
	nfops++;
	nfbytes += c->bytes;
	f->id = ++next_id;
	f->p = p;
	f->c = *c;
	f->kind = write ? FOP_WRITE : FOP_READ;
	f->loff = (write ? g->src_offset : g->dst_offset) + c->off;
	f->roff = (write ? g->dst_offset : g->src_offset) + c->off;
	/* Host memory, or GPU memory the NIC registered itself: by RDMA, no copy. */
	if (post_rdma(f, rm, local, f->loff)) {
		if (local->host == NULL)
			stage_count_direct(c->bytes);
		return;
	}
	if (local->host == NULL) {
		/* GPU memory the NIC cannot reach, or the tcp transport: through a host buffer. */
		if ((f->stage = stage_get(c->bytes)) == NULL) {
			f->nomem = true;
			fop_free(f, false);
			return;
		}
		if (write) {
			stage_copy(false, local->dev, local->dptr + f->loff, f->stage, c->bytes, staged_out, f);
			return;
		}
		if (post_staged(f, rm))
			return;
	}
	send_chunk(f, rm, write ? (const char *)local->host + f->loff : NULL);
}

/* Takes chunks while the window has room. */
static void
pump(void)
{
	struct chunk c;

	while (running && nfops < FABRIC_WINDOW && nfbytes < FABRIC_WINDOW_BYTES &&
	    fabric_chunks->next(PATH_FABRIC, &c, false, cfg->fabric_chunk, 1))
		start_chunk(&c);
}

/*
 * A request ended.  A Write's bytes count towards its transfer (j->priv holds the bytes
 * acknowledged: only this thread touches it); the one that completes a transfer into a
 * notifying export sends the owner's note and keeps its chunk until that is through too.
 * By RDMA, the note is a write with immediate data into the peer's mailbox, which completes
 * here once the peer's NIC has it (the peer's daemon posts the notification when it reads
 * its completion queue, microseconds later); as a message, a Notify, which the peer answers
 * after posting the notification.  Over tcp the note of a one-chunk transfer rides in its
 * Write, and by RDMA after its bytes on the same queue pair (post_rdma): no extra round trip.
 */
static void
fop_end(struct fop *f, bool ok)
{
	struct job *j = f->c.job;

	if (ok && f->kind == FOP_READ && f->stage != NULL) {
		/* In the host buffer: done when it is in the GPU too (staged_in frees it then). */
		stage_copy(true, j->dst->dev, j->dst->dptr + f->loff, f->stage, f->c.bytes, staged_in, f);
		return;
	}
	if (ok && f->kind == FOP_WRITE) {
		uint64_t acked = (uint64_t)(uintptr_t)j->priv + f->c.bytes;
		const struct remote *rm = j->dst->priv;
		j->priv = (void *)(uintptr_t)acked;
		if (acked == j->total && rm != NULL && rm->notify && !f->notified && f->p->state == PEER_READY) {
			Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
			Gpxpeer__Notify n = GPXPEER__NOTIFY__INIT;
			struct fabric_note note = { .handle = rm->handle, .bytes = j->total };
			f->kind = FOP_NOTIFY;
			f->id = ++next_id;
			if (rm->rdma && fabric_rdma_note(f->p, f->id, &note) == 0) {
				f->p->notes_imm_tx++;
				fop_track(f);
				return;
			}
			f->p->notes_msg_tx++;
			n.id = f->id;
			n.handle = rm->handle;
			n.bytes = j->total;
			m.body_case = GPXPEER__PEER_MSG__BODY_NOTIFY;
			m.notify = &n;
			fop_send(f, &m, NULL, 0);
			return;
		}
	}
	fop_free(f, ok);
}

void
request_done(struct peer *p, const Gpxpeer__Done *d, struct evbuffer *in, size_t dlen)
{
	struct fop *f;

	TAILQ_FOREACH(f, &fops, entry)
		if (f->p == p && f->id == d->id && !f->rdma)
			break;
	if (f == NULL) {
		peer_kill(p, "answer to request %llu, which was not sent to it", (unsigned long long)d->id);
		return;
	}
	if (f->kind == FOP_READ && d->status == 0) {
		if (dlen != f->c.bytes || d->length != dlen) {
			peer_kill(p, "answered a Read of %llu bytes with %zu", (unsigned long long)f->c.bytes, dlen);
			return;
		}
		/* The job holds the destination's mapping until the chunk is done. */
		evbuffer_remove(in, f->local, dlen);
	} else if (dlen != 0) {
		peer_kill(p, "data in an answer that takes none");
		return;
	}
	fop_unlist(f);
	f->nomem = d->status == GPX__STATUS__ENOMEM;
	if (d->status != 0) {
		p->errors++;
		log_info("fabric: peer %s refused a %s of client %llu tag %llu: status %u", p->node,
		    f->kind == FOP_WRITE ? "write" : f->kind == FOP_READ ? "read" : "notify",
		    (unsigned long long)f->c.job->client, (unsigned long long)f->c.job->tag, d->status);
	}
	fop_end(f, d->status == 0);
	pump();
}

void
request_rdma_done(uint64_t id, bool ok, const char *why)
{
	struct fop *f;

	TAILQ_FOREACH(f, &fops, entry)
		if (f->rdma && f->id == id)
			break;
	if (f == NULL)
		return;          /* its peer went down first: failed already */
	struct peer *p = f->p;
	if (!ok) {
		/* The queue pair is in error now: nothing more can complete on it. */
		peer_kill(p, "rdma %s of request %llu: %s", f->kind == FOP_WRITE ? "write" : f->kind == FOP_READ ?
		    "read" : "note", (unsigned long long)id, why);
		return;
	}
	fop_unlist(f);
	p->ops++;
	if (f->kind == FOP_WRITE)
		p->bytes_tx += f->c.bytes;
	else if (f->kind == FOP_READ)
		p->bytes_rx += f->c.bytes;
	f->rdma = false;
	fop_end(f, true);
	pump();
}

/* ---- failures, the loop's kick, start and stop ---- */

void
request_peer_down(struct peer *p)
{
	struct fop *f, *t;
	TAILQ_HEAD(, fop) failed = TAILQ_HEAD_INITIALIZER(failed);

	/* Its queue pairs first: then no device touches the buffers of the chunks failed below. */
	fabric_rdma_peer_down(p);
	TAILQ_FOREACH_SAFE(f, &fops, entry, t)
		if (f->p == p) {
			TAILQ_REMOVE(&fops, f, entry);
			p->errors++;
			TAILQ_INSERT_TAIL(&failed, f, entry);
		}
	p->inflight = 0;
	/* Failed after the walk: ending a chunk can end a job and release a region. */
	while ((f = TAILQ_FIRST(&failed)) != NULL) {
		TAILQ_REMOVE(&failed, f, entry);
		fop_free(f, false);
	}
	request_kick();
}

void
request_tick(double now)
{
	struct fop *f;

again:
	TAILQ_FOREACH(f, &fops, entry)
		if (now > f->deadline) {
			peer_kill(f->p, "request %llu unanswered for %.1f s", (unsigned long long)f->id,
			    cfg->fabric_timeout_s);
			goto again;          /* the kill removed this peer's requests */
		}
	/* Chunks whose peer is gone fail here too, whether or not anything else wakes the loop;
	 * Releases that found no memory go again. */
	pump();
	remote_flush();
}

static void
on_kick(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	remote_flush();
	pump();
}

void
request_kick(void)
{
	if (kick_ev != NULL)
		event_active(kick_ev, EV_READ, 0);
}

int
request_init(struct event_base *b)
{
	if ((kick_ev = event_new(b, -1, 0, on_kick, NULL)) == NULL || stage_init(b) < 0)
		return -1;
	remote_start();
	running = true;
	return 0;
}

/* After every peer is down (so every request has failed): nothing is queued any more. */
void
request_shutdown(void)
{
	struct fop *f;

	remote_stop();
	running = false;
	/* Those waiting on peers end first, their staging buffers given back while the pool
	 * still knows them, then the staged ones (failed: the fabric is stopped). */
	while ((f = TAILQ_FIRST(&fops)) != NULL) {
		fop_unlist(f);
		fop_free(f, false);
	}
	stage_shutdown();
	/* Chunks still queued on the path fail now, so their transfers end. */
	struct chunk c;
	while (fabric_chunks->next(PATH_FABRIC, &c, false, UINT64_MAX, UINT32_MAX))
		fabric_chunks->done(&c, 1, false);
	if (kick_ev != NULL)
		event_free(kick_ev);
	kick_ev = NULL;
}
