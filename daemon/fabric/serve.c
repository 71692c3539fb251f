/*
 * Serving peers: a peer's Write, Read and Notify against the handles it holds on our exports
 * (peer-import.c gave them out).  Every request is checked against its handle before any byte
 * moves: the handle must be of this connection's epoch, a Write needs a writable handle, the
 * range must lie inside the export, and the region must not be revoked; the answer (Done)
 * carries a gpx status, and a Read's bytes.  A transfer into an export whose owner asked for
 * notifications ends with the owner's notification, posted in its completion queue exactly as
 * for a local copy: from a Write that carries it, a Notify, or a note that came by RDMA
 * (rdma-note.c hands it here).
 *
 * An export in GPU memory is served through a staging buffer (stage.c): a Write's bytes go
 * into the GPU, or a Read's come out of it, on the stage thread, and the answer goes when the
 * copy is done; while it runs, the region is held as a mapping user and the peer is found
 * again by name and epoch when it ends.  Over RDMA, the peer's NIC reads and writes the
 * export itself and nothing here runs but the note.
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <event2/buffer.h>

#include "daemon/fabric/internal.h"

/* A peer's Write or Read of an export in GPU memory, while its bytes are staged. */
struct sreq {
	char node[PEER_NAME_MAX + 1];
	uint32_t epoch;
	uint64_t id;
	struct region *r;            /* a mapping user until the answer */
	void *buf;
	uint64_t len, notify;
	bool read;
};

static bool
inside(uint64_t off, uint64_t len, uint64_t size)
{
	return off <= size && len <= size - off;
}

static void
answer(struct peer *p, uint64_t id, int status, const void *data, size_t len)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Done d = GPXPEER__DONE__INIT;

	d.id = id;
	d.status = status;
	d.length = len;
	m.body_case = GPXPEER__PEER_MSG__BODY_DONE;
	m.done = &d;
	if (status != 0)
		p->errors++;
	if (peer_send(p, &m, data, len) != -ENOMEM)
		return;
	/* No memory for the answer: refused ENOMEM, without the data; else the request would wait
	 * on the peer until its timeout, which ends the connection */
	p->errors += status == 0;
	d.status = GPX__STATUS__ENOMEM;
	d.length = 0;
	if (peer_send(p, &m, NULL, 0) < 0)
		peer_kill(p, "out of memory for its answers");
}

static void
notify_owner(struct region *r, uint64_t bytes)
{
	if (atomic_load(&r->notify_on) && r->notify_cq != NULL)
		cq_notify(r->notify_cq, r->notify_tag, 0, bytes);
}

/* Checks a peer's request against the handle: a gpx status, 0 when it may go ahead. */
static int
check(struct peer *p, uint64_t handle, uint64_t off, uint64_t len, bool write, struct phandle **out)
{
	struct phandle *h = peer_handle(p, handle);

	if (h == NULL)
		return GPX__STATUS__ENOENT;
	if (write && h->read_only)
		return GPX__STATUS__EACCES;
	if (len == 0 || len > PEER_DATA_MAX || !inside(off, len, h->r->length))
		return GPX__STATUS__ERANGE;
	if (!region_use(h->r))
		return GPX__STATUS__EREVOKED;
	*out = h;
	return 0;
}

/* Loop thread: a staged Write is in the GPU, or a staged Read's bytes are out of it. */
static void
served(void *arg, bool ok)
{
	struct sreq *q = arg;
	struct peer *p = peer_by_epoch(q->node, q->epoch);

	if (ok && q->notify != 0) {
		notify_owner(q->r, q->notify);
		if (p != NULL)
			p->notes_msg_rx++;
	}
	region_unuse(q->r);
	if (p != NULL)
		answer(p, q->id, ok ? 0 : GPX__STATUS__EIO, ok && q->read ? q->buf : NULL, ok && q->read ? q->len : 0);
	stage_put(q->buf);
	free(q);
}

/* A peer's Write or Read of an export in GPU memory (h checked, its region in use): staged. */
static void
serve_staged(struct peer *p, struct phandle *h, uint64_t id, uint64_t off, uint64_t len, uint64_t notify,
    struct evbuffer *in)
{
	struct sreq *q = calloc(1, sizeof(*q));
	struct region *r = h->r;

	if (q == NULL || (q->buf = stage_get(len)) == NULL) {
		free(q);
		if (in != NULL)
			evbuffer_drain(in, len);
		region_unuse(r);
		answer(p, id, GPX__STATUS__ENOMEM, NULL, 0);
		return;
	}
	snprintf(q->node, sizeof(q->node), "%s", p->node);
	q->epoch = p->epoch;
	q->id = id;
	q->r = r;
	q->len = len;
	q->notify = notify;
	q->read = in == NULL;
	if (in != NULL)
		evbuffer_remove(in, q->buf, len);
	stage_copy(in != NULL, r->dev, r->dptr + off, q->buf, len, served, q);
}

static void
serve_write(struct peer *p, const Gpxpeer__Write *w, struct evbuffer *in, size_t dlen)
{
	struct phandle *h;
	int st;

	if (dlen != w->length) {
		peer_kill(p, "a Write of %llu bytes carries %zu", (unsigned long long)w->length, dlen);
		return;
	}
	if ((st = check(p, w->handle, w->offset, w->length, true, &h)) == 0 && h->r->host == NULL) {
		serve_staged(p, h, w->id, w->offset, w->length, w->notify, in);
		return;
	}
	if (st == 0) {
		evbuffer_remove(in, (char *)h->r->host + w->offset, dlen);
		if (w->notify != 0) {
			p->notes_msg_rx++;
			notify_owner(h->r, w->notify);
		}
		region_unuse(h->r);
	} else
		evbuffer_drain(in, dlen);
	answer(p, w->id, st, NULL, 0);
}

static void
serve_read(struct peer *p, const Gpxpeer__Read *r)
{
	struct phandle *h;
	int st;

	if ((st = check(p, r->handle, r->offset, r->length, false, &h)) != 0) {
		answer(p, r->id, st, NULL, 0);
		return;
	}
	if (h->r->host == NULL) {
		serve_staged(p, h, r->id, r->offset, r->length, 0, NULL);
		return;
	}
	answer(p, r->id, 0, (const char *)h->r->host + r->offset, r->length);
	region_unuse(h->r);
}

static void
serve_notify(struct peer *p, const Gpxpeer__Notify *n)
{
	struct phandle *h = peer_handle(p, n->handle);

	if (h == NULL) {
		answer(p, n->id, GPX__STATUS__ENOENT, NULL, 0);
		return;
	}
	if (!h->read_only) {
		p->notes_msg_rx++;
		notify_owner(h->r, n->bytes);
	}
	answer(p, n->id, h->read_only ? GPX__STATUS__EACCES : 0, NULL, 0);
}

void
serve_rdma_note(struct peer *p, uint64_t handle, uint64_t bytes)
{
	struct phandle *h = peer_handle(p, handle);

	if (h == NULL || h->read_only) {
		/* Not one of its handles (its own note arrives before its Release: see on_release). */
		p->errors++;
		log_info("fabric: peer %s: a note by rdma for %s handle %016llx: dropped", p->node,
		    h == NULL ? "no" : "read-only", (unsigned long long)handle);
		return;
	}
	p->notes_imm_rx++;
	notify_owner(h->r, bytes);
}

void
serve_msg(struct peer *p, const Gpxpeer__PeerMsg *m, struct evbuffer *in, size_t datalen)
{
	switch (m->body_case) {
	case GPXPEER__PEER_MSG__BODY_WRITE:
		serve_write(p, m->write, in, datalen);
		break;
	case GPXPEER__PEER_MSG__BODY_READ:
		serve_read(p, m->read);
		break;
	case GPXPEER__PEER_MSG__BODY_NOTIFY:
		serve_notify(p, m->notify);
		break;
	default:
		peer_kill(p, "unexpected message %d", m->body_case);
	}
}

