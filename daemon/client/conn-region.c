/*
 * A connection's regions: its handle table (ids of the form epoch << 32 | serial, so an id
 * from another connection or from before a restart is refused), and the requests that
 * make and end regions: Register (each memory kind through its mem_ops, opened on a task
 * thread), Pieces (VMM memory sent ahead for the registrations that name it) and Deregister.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <event2/event.h>

#include "daemon/client/conn-private.h"

/* ---- handle tables ---- */

static uint32_t
hslot(const struct conn *c, uint64_t id)
{
	return (uint32_t)(id * 0x9e3779b97f4a7c15ULL >> 32) & (c->hcap - 1);
}

struct rhandle *
conn_handle(struct conn *c, uint64_t id)
{
	if (c->hcap == 0 || (uint32_t)(id >> 32) != c->epoch)
		return NULL;
	for (struct rhandle *h = c->htab[hslot(c, id)]; h != NULL; h = h->next)
		if (h->id == id)
			return h;
	return NULL;
}

struct rhandle *
handle_add(struct conn *c, struct region *r, bool imported, bool read_only, uint64_t charged,
    const char *what, char *err, size_t errlen)
{
	struct rhandle *h;

	if (c->nhandles + 1 > c->hcap / 2) {
		uint32_t ncap = c->hcap ? c->hcap * 2 : 16;
		/* The larger table is charged whole; the smaller one given back once it is gone. */
		if (conn_charge(c, (uint64_t)ncap * sizeof(*c->htab), what, err, errlen) < 0)
			return NULL;
		struct rhandle **nt = calloc(ncap, sizeof(*nt));
		if (nt == NULL) {
			conn_uncharge(c, (uint64_t)ncap * sizeof(*c->htab));
			snprintf(err, errlen, "out of memory");
			return NULL;
		}
		uint32_t ocap = c->hcap;
		struct rhandle **ot = c->htab;
		c->htab = nt;
		c->hcap = ncap;
		for (uint32_t i = 0; i < ocap; i++)
			while (ot[i] != NULL) {
				struct rhandle *m = ot[i];
				ot[i] = m->next;
				uint32_t s = hslot(c, m->id);
				m->next = nt[s];
				nt[s] = m;
			}
		free(ot);
		conn_uncharge(c, (uint64_t)ocap * sizeof(*c->htab));
	}
	if ((h = calloc(1, sizeof(*h))) == NULL) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	h->id = (uint64_t)c->epoch << 32 | ++c->next_serial;
	h->r = r;
	h->imported = imported;
	h->read_only = read_only;
	h->charged = charged;
	uint32_t s = hslot(c, h->id);
	h->next = c->htab[s];
	c->htab[s] = h;
	c->nhandles++;
	return h;
}

static void
handle_unlink(struct conn *c, struct rhandle *h)
{
	struct rhandle **p = &c->htab[hslot(c, h->id)];

	while (*p != h)
		p = &(*p)->next;
	*p = h->next;
	c->nhandles--;
}

/* Lets go of one handle: the owner's withdraws the region from everyone. */
static void
handle_release(struct conn *c, struct rhandle *h)
{
	struct region *r = h->r;

	xfer_pairs_drop(&c->pairs);     /* it may name this handle's region */
	c->user->regions--;
	if (!h->imported) {
		c->user->region_bytes -= r->length;
		if (c->state != CONN_DEAD)
			export_remove_region(r);     /* (a gone client's exports went at once: conn_kill) */
		region_revoke(r);
	} else {
		struct export *e;
		TAILQ_FOREACH(e, &exports, entry)
			if (e->r == r && e->importers > 0) {
				e->importers--;
				break;
			}
		/* fabric: a remote region has no local owner; its only handle lets the peer's go */
		if (r->kind == GPX__MEM_KIND__MEM_REMOTE)
			region_revoke(r);
	}
	region_unref(r);
	conn_uncharge(c, h->charged);
	free(h);
}

/* The answer to a Register or an Import: the handle's id and what it names. */
void
reply_registered(struct conn *c, uint32_t seq, const struct rhandle *h)
{
	Gpx__Reply rep = GPX__REPLY__INIT;
	Gpx__Registered reg = GPX__REGISTERED__INIT;

	reg.region = h->id;
	reg.length = h->r->length;
	reg.kind = h->r->kind;
	reg.read_only = h->read_only;
	rep.body_case = GPX__REPLY__BODY_REGISTERED;
	rep.registered = &reg;
	conn_reply(c, seq, 0, NULL, &rep, NULL, 0);
}

/*
 * Lets go of the handles of a connection that ended, until the loop's turn has had its slice
 * (loop_turn_over; at least one handle): a client that held tens of thousands of regions is
 * given back over many turns, each unmapping its share, and other clients are served between
 * them.  True once all are (conn_reap calls again until then).
 */
bool
handles_release(struct conn *c)
{
	for (; c->hswept < c->hcap; c->hswept++)
		while (c->htab[c->hswept] != NULL) {
			struct rhandle *h = c->htab[c->hswept];
			c->htab[c->hswept] = h->next;
			c->nhandles--;
			handle_release(c, h);
			if (loop_turn_over() && (c->htab[c->hswept] != NULL || c->hswept + 1 < c->hcap))
				return false;
		}
	free(c->htab);
	conn_uncharge(c, (uint64_t)c->hcap * sizeof(*c->htab));
	c->htab = NULL;
	c->hcap = c->nhandles = c->hswept = 0;
	return true;
}

/* ---- Register ---- */

struct reg_op {
	struct defer_task task;        /* queued through it (defer.c) */
	struct conn *c;
	uint32_t seq;
	struct region *r;
	int status;
	char err[256];
	uint32_t *missing;           /* cuda-vmm: pieces the daemon lacks (with ENOENT) */
	uint32_t nmissing;
	uint64_t charged;            /* the handle's bytes and this op's, of c's budgets */
};

static void
reg_work(void *arg)
{
	struct reg_op *op = arg;

	op->status = op->r->ops->open(op->r, op->err, sizeof(op->err));
}

static void
reg_done(void *arg)
{
	struct reg_op *op = arg;
	struct conn *c = op->c;
	struct region *r = op->r;

	conn_settle(c);
	if (op->status == 0 && c->state != CONN_DEAD) {
		struct rhandle *h = handle_add(c, r, false, r->read_only, op->charged - sizeof(*op), "registration",
		    op->err, sizeof(op->err));
		if (h != NULL) {
			conn_uncharge(c, sizeof(*op));      /* the handle keeps the rest */
			log_debug("region", "client %llu: %s region %#llx, %llu bytes",
			    (unsigned long long)c->id, r->ops->name, (unsigned long long)h->id,
			    (unsigned long long)r->length);
			reply_registered(c, op->seq, h);
			/* Pieces sent for this registration that it did not take up go now. */
			if (r->npieces > 0)
				vmm_sweep(c->id);
			free(op);
			return;
		}
		/* (over a budget for its table's growth, or out of memory) */
		op->status = strncmp(op->err, "busy", 4) == 0 ? -GPX__STATUS__EBUSY : -GPX__STATUS__ENOMEM;
	}
	if (op->status < 0 && op->nmissing > 0) {
		Gpx__Reply rep = GPX__REPLY__INIT;
		rep.missing = op->missing;
		rep.n_missing = op->nmissing;
		conn_reply(c, op->seq, -op->status, op->err, &rep, NULL, 0);
	} else if (op->status < 0)
		reply_err(c, op->seq, -op->status, op->err);
	/* Failed, or the client left meanwhile: give back what was opened and accounted. */
	c->user->regions--;
	c->user->region_bytes -= r->length;
	conn_uncharge(c, op->charged);
	if (op->status == 0)
		region_revoke(r);
	else if (r->fd >= 0)
		close(r->fd);
	region_unref(r);
	free(op);
}

/* The memory kinds this daemon serves: host always, the GPU kinds with a GPU. */
static const struct mem_ops *
mem_ops_for(Gpx__MemKind kind)
{
	switch (kind) {
	case GPX__MEM_KIND__MEM_HOST:
		return &mem_host_ops;
	case GPX__MEM_KIND__MEM_CUDA_IPC:
		return gpu_count() > 0 ? &mem_cuda_ipc_ops : NULL;
	case GPX__MEM_KIND__MEM_CUDA_VMM:
		return gpu_count() > 0 ? &mem_cuda_vmm_ops : NULL;
	case GPX__MEM_KIND__MEM_CUDA_POOL:
		return gpu_count() > 0 ? &mem_cuda_pool_ops : NULL;
	default:
		return NULL;
	}
}

void
req_register(struct conn *c, uint32_t seq, const Gpx__Register *m, int *fds, int nfds)
{
	const struct mem_ops *ops;
	char err[256];
	int want = m->kind == GPX__MEM_KIND__MEM_CUDA_IPC || m->cached_only || m->piece_count > 0 ? 0 : 1;
	const unsigned char *pieces = NULL;

	if (nfds != want) {
		snprintf(err, sizeof(err), "Register of this kind takes %d fd(s), got %d", want, nfds);
		reply_err(c, seq, GPX__STATUS__EPROTO, err);
		return;
	}
	if (m->cached_only && m->kind != GPX__MEM_KIND__MEM_CUDA_VMM && m->kind != GPX__MEM_KIND__MEM_CUDA_POOL) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "cached_only applies to cuda-vmm and cuda-pool registrations");
		return;
	}
	if (m->kind == GPX__MEM_KIND__MEM_CUDA_IPC && !cfg->trust_legacy_ipc) {
		log_audit(c, "legacy CUDA IPC handle while the node is multi-tenant");
		reply_err(c, seq, GPX__STATUS__EACCES,
		    "legacy CUDA IPC handles are forgeable and refused: this node is not configured as "
		    "one trust domain (cuda.trust_legacy_ipc); register VMM memory instead");
		return;
	}
	if ((ops = mem_ops_for(m->kind)) == NULL) {
		snprintf(err, sizeof(err), "memory kind %d is not available here: %s", m->kind,
		    m->kind == GPX__MEM_KIND__MEM_HOST ? "unknown" : gpu_status());
		reply_err(c, seq, GPX__STATUS__ENOTSUP, err);
		return;
	}
	if (m->length == 0 || m->offset + m->length < m->offset) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "length must be > 0 and offset + length must not overflow");
		return;
	}
	if (m->piece_count > 0) {
		/* Protocol 3: the pieces of a VMM range, in the segment area. */
		if (m->kind != GPX__MEM_KIND__MEM_CUDA_VMM || c->version < 3 || m->cached_only) {
			reply_err(c, seq, GPX__STATUS__EPROTO, "pieces are listed by cuda-vmm registrations of "
			    "protocol 3, without cached_only");
			return;
		}
		if (m->piece_count > cfg->max_segs || m->alloc_size == 0 ||
		    (pieces = xfer_area(c->area, c->area_len, m->area_offset, (uint64_t)m->piece_count * sizeof(struct gpx_wire_piece))) == NULL) {
			snprintf(err, sizeof(err), "%u pieces at %llu: 1..%u records inside the segment area "
			    "(%zu bytes), of a reservation of a size", m->piece_count,
			    (unsigned long long)m->area_offset, cfg->max_segs, c->area_len);
			reply_err(c, seq, GPX__STATUS__EINVAL, err);
			return;
		}
	}
	if (((m->kind == GPX__MEM_KIND__MEM_HOST && !mem_host_fd_ok(fds[0], err, sizeof(err))) ||
	    ((m->kind == GPX__MEM_KIND__MEM_CUDA_VMM || m->kind == GPX__MEM_KIND__MEM_CUDA_POOL) &&
	     !m->cached_only && m->piece_count == 0 && !gpu_vmm_fd_ok(fds[0], err, sizeof(err))))) {
		log_audit(c, "%s", err);
		reply_err(c, seq, GPX__STATUS__EBADFD, err);
		return;
	}
	if (m->kind != GPX__MEM_KIND__MEM_HOST &&
	    (m->device_uuid.len != 16 || ((m->kind == GPX__MEM_KIND__MEM_CUDA_IPC ||
	     (m->kind == GPX__MEM_KIND__MEM_CUDA_POOL && !m->cached_only)) && m->handle.len != 64))) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "a CUDA region needs a 16-byte device UUID (and a "
		    "64-byte IPC handle or pool export data, unless cached_only)");
		return;
	}
	struct user *u = c->user;
	if (u->regions >= cfg->max_regions_per_uid ||
	    (cfg->max_region_bytes_per_uid &&
	     (m->length > cfg->max_region_bytes_per_uid || u->region_bytes > cfg->max_region_bytes_per_uid - m->length))) {
		snprintf(err, sizeof(err), "uid %u is at its registration limit (%u regions, %llu bytes)",
		    (unsigned)c->uid, u->regions, (unsigned long long)u->region_bytes);
		log_audit(c, "%s", err);
		reply_err(c, seq, GPX__STATUS__EQUOTA, err);
		return;
	}
	/* Its region, pieces and handle, and this request until it is answered, against the budgets. */
	const uint64_t cost = sizeof(struct reg_op) + HANDLE_BYTES + REGION_BYTES(m->kind == GPX__MEM_KIND__MEM_CUDA_VMM ?
	    (pieces != NULL ? m->piece_count : 1) : 0);
	const bool mapped = m->kind == GPX__MEM_KIND__MEM_HOST;   /* one mapping of gpxd's */
	int e;
	if (mapped && (e = maps_take("registration", err, sizeof(err))) < 0) {
		reply_err(c, seq, -e, err);
		return;
	}
	if ((e = conn_charge(c, cost, "registration", err, sizeof(err))) < 0) {
		if (mapped)
			maps_give();
		reply_err(c, seq, -e, err);
		return;
	}

	struct reg_op *op = calloc(1, sizeof(*op));
	struct region *r = region_new();
	if (op == NULL || r == NULL) {
		free(op);
		free(r);
		conn_uncharge(c, cost);
		if (mapped)
			maps_give();
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return;
	}
	r->map_counted = mapped;
	op->charged = cost;
	r->ops = ops;
	r->kind = m->kind;
	r->offset = m->offset;
	r->length = m->length;
	r->read_only = m->access == GPX__ACCESS__ACCESS_RO;
	r->owner = c->id;
	r->uid = c->uid;
	r->alloc_size = m->alloc_size;
	r->alloc_id = m->alloc_id;
	if (m->handle.len == 64)
		memcpy(r->handle, m->handle.data, 64);
	if (m->device_uuid.len == 16)
		memcpy(r->uuid, m->device_uuid.data, 16);
	if (want) {
		r->fd = fds[0];
		fds[0] = -1;
	}
	if (m->kind == GPX__MEM_KIND__MEM_CUDA_VMM) {
		/* Its pieces, read once; before protocol 3, the one allocation (= the reservation). */
		uint32_t n = pieces != NULL ? m->piece_count : 1;
		if ((r->pieces = malloc(n * sizeof(*r->pieces))) == NULL) {
			e = -GPX__STATUS__ENOMEM;
			snprintf(err, sizeof(err), "out of memory for %u pieces", n);
		} else {
			if (pieces != NULL)
				memcpy(r->pieces, pieces, n * sizeof(*r->pieces));
			else
				r->pieces[0] = (struct gpx_wire_piece){ m->alloc_id, 0, m->alloc_size };
			r->npieces = n;
			e = vmm_check(r, err, sizeof(err));
		}
		if (e < 0) {
			if (r->fd >= 0)
				close(r->fd);
			region_unref(r);
			free(op);
			conn_uncharge(c, cost);
			reply_err(c, seq, -e, err);
			return;
		}
	}
	u->regions++;
	u->region_bytes += m->length;
	op->c = c;
	op->seq = seq;
	op->r = r;
	c->pending++;
	if (pieces != NULL) {
		/* Answered from the pieces held, or with those missing for the client to send. */
		uint32_t missing[GPX_MISSING_MAX];
		op->missing = missing;
		op->status = vmm_bind(r, missing, &op->nmissing, op->err, sizeof(op->err));
		reg_done(op);
		return;
	}
	if (ops->try_open != NULL && ops->try_open(r)) {
		/* Already open on this node: answered from the cache, no driver call. */
		reg_done(op);
		return;
	}
	if (m->cached_only) {
		op->status = -GPX__STATUS__ENOENT;
		snprintf(op->err, sizeof(op->err), "not held by the daemon: register it with its fd");
		reg_done(op);
		return;
	}
	defer_run(&op->task, reg_work, reg_done, op);
}

/* ---- Pieces: VMM memory for the next registrations to name (daemon/gpu/vmm.c) ---- */

struct pieces_op {
	struct defer_task task;        /* queued through it (defer.c) */
	struct conn *c;
	uint32_t seq;
	uint64_t owner, res, res_size;
	int dev;
	uint32_t n;
	int status;
	double queued, started, worked;  /* when: handed to a task thread, begun, done */
	struct gpx_wire_piece p[GPX_PIECES_MAX];
	int fds[GPX_PIECES_MAX];
	char err[256];
};

static void
pieces_work(void *arg)
{
	struct pieces_op *op = arg;

	op->started = now_s();
	op->status = vmm_import(op->owner, op->dev, op->res, op->res_size, op->p, op->fds, op->n, op->err,
	    sizeof(op->err));
	op->worked = now_s();
	log_debug("gpu", "Pieces: %u imported in %.1f us", op->n, (op->worked - op->started) * 1e6);
}

static void
pieces_done(void *arg)
{
	struct pieces_op *op = arg;

	log_debug("gpu", "Pieces: %.1f us to a task thread, %.1f us back to the loop",
	    (op->started - op->queued) * 1e6, (now_s() - op->worked) * 1e6);
	conn_settle(op->c);
	conn_uncharge(op->c, sizeof(*op));
	if (op->c->state != CONN_DEAD)
		reply_err(op->c, op->seq, -op->status, op->status < 0 ? op->err : NULL);
	/* Closed after the client closes its copies: their teardown is then not on its path. */
	vmm_park(op->owner, op->fds, op->n);
	if (op->c->state == CONN_DEAD)
		vmm_sweep(op->owner);        /* its end came first: nothing will take them up */
	free(op);
}

void
req_pieces(struct conn *c, uint32_t seq, const Gpx__Pieces *m, int *fds, int nfds)
{
	struct pieces_op *op;
	char err[256];
	int dev;

	if (c->version < 3 || m->n_pieces == 0 || m->n_pieces > GPX_PIECES_MAX || (int)m->n_pieces != nfds) {
		reply_err(c, seq, GPX__STATUS__EPROTO, "Pieces (protocol 3) carries 1..GPX_PIECES_MAX pieces "
		    "and one fd for each");
		return;
	}
	if (gpu_count() == 0) {
		snprintf(err, sizeof(err), "cuda-vmm memory is not available here: %s", gpu_status());
		reply_err(c, seq, GPX__STATUS__ENOTSUP, err);
		return;
	}
	if (m->device_uuid.len != 16 || (dev = gpu_dev_by_uuid(m->device_uuid.data)) < 0 ||
	    m->reservation_size == 0) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "Pieces needs the 16-byte UUID of a GPU of this node "
		    "and the reservation's size");
		return;
	}
	for (int i = 0; i < nfds; i++) {
		const Gpx__Piece *p = m->pieces[i];
		if (!gpu_vmm_fd_ok(fds[i], err, sizeof(err))) {
			log_audit(c, "%s", err);
			reply_err(c, seq, GPX__STATUS__EBADFD, err);
			return;
		}
		if (p->size == 0 || p->offset > m->reservation_size || p->size > m->reservation_size - p->offset) {
			snprintf(err, sizeof(err), "piece %d (%llu bytes at %llu) leaves the %llu-byte reservation", i,
			    (unsigned long long)p->size, (unsigned long long)p->offset,
			    (unsigned long long)m->reservation_size);
			reply_err(c, seq, GPX__STATUS__EINVAL, err);
			return;
		}
	}
	/* The request, with its pieces and fds, until it is answered, against the budgets. */
	int e;
	if ((e = conn_charge(c, sizeof(*op), "Pieces message", err, sizeof(err))) < 0) {
		reply_err(c, seq, -e, err);
		return;
	}
	if ((op = calloc(1, sizeof(*op))) == NULL) {
		conn_uncharge(c, sizeof(*op));
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return;
	}
	op->c = c;
	op->seq = seq;
	op->owner = c->id;
	op->dev = dev;
	op->res = m->reservation;
	op->res_size = m->reservation_size;
	op->n = nfds;
	for (int i = 0; i < nfds; i++) {
		op->p[i] = (struct gpx_wire_piece){ m->pieces[i]->id, m->pieces[i]->offset, m->pieces[i]->size };
		op->fds[i] = fds[i];
		fds[i] = -1;
	}
	c->pending++;
	op->queued = now_s();
	defer_run(&op->task, pieces_work, pieces_done, op);
}

/*
 * Pool memory (cuda-pool) must be freed by its importer before its exporter frees it, so
 * the Deregister that lets go of the last region of a pool allocation is answered only once
 * the driver has released gpxd's import (a task thread does that): the client may free the
 * memory as soon as gpx_deregister returns.  Checked from a timer, so no thread waits.
 */
struct dereg_wait {
	struct conn *c;
	uint32_t seq;
	struct region *r;            /* a reference */
	struct event *ev;
	double deadline;
};

static void
dereg_check(evutil_socket_t fd, short what, void *arg)
{
	struct dereg_wait *w = arg;
	struct timeval tv = { 0, 200 };
	bool released = gpu_released(w->r);

	(void)fd;
	(void)what;
	if (!released && now_s() < w->deadline) {
		evtimer_add(w->ev, &tv);
		return;
	}
	conn_settle(w->c);
	if (w->c->state != CONN_DEAD) {
		if (released)
			reply_err(w->c, w->seq, 0, NULL);
		else
			reply_err(w->c, w->seq, GPX__STATUS__EBUSY, "deregistered, but the driver still holds "
			    "the pool memory (a transfer of it is in flight): do not free it yet");
	}
	region_unref(w->r);
	event_free(w->ev);
	free(w);
}

void
req_deregister(struct conn *c, uint32_t seq, const Gpx__Deregister *m)
{
	struct rhandle *h = conn_handle(c, m->region);
	struct dereg_wait *w = NULL;

	if (h == NULL) {
		reply_err(c, seq, GPX__STATUS__ENOENT, "no such region on this connection");
		return;
	}
	/* The owner's handle only: an importer's lets go of nothing the driver holds. */
	if (!h->imported && h->r->kind == GPX__MEM_KIND__MEM_CUDA_POOL && (w = calloc(1, sizeof(*w))) != NULL &&
	    (w->ev = evtimer_new(conn_loop->base, dereg_check, w)) != NULL) {
		w->c = c;
		w->seq = seq;
		w->r = h->r;
		region_ref(w->r);
		w->deadline = now_s() + 10;
		c->pending++;
	}
	handle_unlink(c, h);
	handle_release(c, h);
	if (w != NULL && w->ev != NULL)
		dereg_check(-1, 0, w);
	else {
		free(w);
		reply_err(c, seq, 0, NULL);
	}
}

