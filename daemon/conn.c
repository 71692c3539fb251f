/*
 * Client connections: credentials and admission at accept, the Hello state machine, the
 * message dispatcher and the handlers for regions, exports and transfers.
 *
 * Admission.  The peer's uid is known at accept (SO_PEERCRED), so the limits on connections
 * apply from the first byte: past connections_per_uid, or while the daemon is short of
 * descriptors for anyone but root and the admin group, or with hello_max connections of
 * others still waiting for their Hello, a connection is refused at once (one Reply with seq 0
 * saying why, then close) before anything is allocated or opened for it.  At hello_max, a
 * uid with fewer connections waiting than the uid with the most still gets in: that uid's
 * oldest silent connection is closed to make room, so one uid's silent connections cannot
 * lock the others out.  Root and the admin group do not count towards hello_max.
 *
 * The dispatcher checks the cheap invariants first (datagram size and control data in
 * wire_recv, then decoding into a bounded arena, then connection state and the number of fds
 * the message type takes) and only then calls a handler.  Handlers borrow the message; any fd
 * a handler does not take is closed by the dispatcher.  A connection is never freed inside its
 * own callback: conn_kill() releases what it holds and marks it dead, conn_reap() frees it
 * once no deferred operation refers to it any more.
 */
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <event2/event.h>

#include "gpxd.h"
#include "fabric/fabric.h"

struct conn_list conns = TAILQ_HEAD_INITIALIZER(conns);
double conn_last_input;
static struct conn_list dead = TAILQ_HEAD_INITIALIZER(dead);
static uint64_t next_client_id;
static uint32_t next_epoch;
static uint32_t nconns;
static uint32_t nhello;              /* connections of non-admins not yet past Hello */
static uint8_t msgbuf[GPX_MSG_MAX];
static struct wire_arena *arena;

#define MSGS_PER_WAKE 64

uint32_t
conn_count(void)
{
	return nconns;
}

struct conn *
conn_by_id(uint64_t id)
{
	struct conn *c;

	TAILQ_FOREACH(c, &conns, entry)
		if (c->id == id)
			return c;
	return NULL;
}

/* Who is at the other end, as the kernel said at accept: what export rules are decided on. */
struct creds
conn_creds(const struct conn *c)
{
	return (struct creds){ c->uid, c->gid, c->groups, c->ngroups };
}

/* The admin group's gid, looked up again after a reload or a minute, not at every accept. */
static bool
admin_gid(gid_t *gid)
{
	static const struct conf *for_cfg;
	static double when;
	static bool known;
	static gid_t g;
	double now = now_s();

	if (cfg->admin_group == NULL)
		return false;
	if (for_cfg != cfg || now - when > 60) {
		struct group *gr = getgrnam(cfg->admin_group);
		known = gr != NULL;
		if (known)
			g = gr->gr_gid;
		for_cfg = cfg;
		when = now;
	}
	*gid = g;
	return known;
}

static bool
peer_admin(uid_t uid, gid_t gid, const gid_t *groups, int ngroups)
{
	gid_t ag;

	if (uid == 0)
		return true;
	if (!admin_gid(&ag))
		return false;
	if (gid == ag)
		return true;
	for (int i = 0; i < ngroups; i++)
		if (groups[i] == ag)
			return true;
	return false;
}

/* The kernel's word on who is on the other end; nothing the client sends can change it. */
static int
peer_creds(int fd, struct ucred *cr, gid_t *groups, int *ngroups)
{
	socklen_t len = sizeof(*cr);

	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, cr, &len) < 0) {
		log_warn("SO_PEERCRED");
		return -1;
	}
	len = 64 * sizeof(gid_t);
	*ngroups = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0 ? (int)(len / sizeof(gid_t)) : 0;
	return 0;
}

static struct conn *
conn_make(int fd, const struct ucred *cr, const gid_t *groups, int ngroups, bool admin)
{
	struct conn *c;

	if ((c = calloc(1, sizeof(*c))) == NULL)
		return NULL;
	if (next_epoch == 0) {
		if (getrandom(&next_epoch, sizeof(next_epoch), 0) != sizeof(next_epoch))
			next_epoch = (uint32_t)time(NULL) ^ ((uint32_t)getpid() << 16);
		next_epoch |= 1;
	}
	if (arena == NULL && (arena = wire_arena_new(GPX_ARENA_SIZE)) == NULL)
		fatalx("out of memory");
	c->fd = fd;
	c->id = ++next_client_id;
	c->epoch = next_epoch++;
	if (c->epoch == 0)
		c->epoch = next_epoch++;
	c->uid = cr->uid;
	c->gid = cr->gid;
	c->pid = cr->pid;
	memcpy(c->groups, groups, ngroups * sizeof(gid_t));
	c->ngroups = ngroups;
	c->pidfd = (int)syscall(SYS_pidfd_open, cr->pid, 0);
	c->state = CONN_HELLO;
	c->user = user_get(cr->uid);
	c->user->conns++;
	c->admin = admin;
	if (!admin) {
		nhello++;
		c->user->hello++;
	}
	c->t_connect = c->t_last = now_s();
	TAILQ_INSERT_TAIL(&conns, c, entry);
	nconns++;
	log_debug("conn", "client %llu connected: uid %u gid %u pid %d", (unsigned long long)c->id,
	    (unsigned)c->uid, (unsigned)c->gid, (int)c->pid);
	return c;
}

/* A connection without the admission checks (tests driving conn.c directly). */
struct conn *
conn_new(int fd)
{
	struct ucred cr;
	gid_t groups[64];
	int ngroups;

	if (peer_creds(fd, &cr, groups, &ngroups) < 0)
		return NULL;
	return conn_make(fd, &cr, groups, ngroups, peer_admin(cr.uid, cr.gid, groups, ngroups));
}

/* c is past its Hello, or gone: it no longer counts towards hello_max. */
static void
hello_leave(struct conn *c)
{
	if (c->state == CONN_HELLO && !c->admin) {
		nhello--;
		c->user->hello--;
	}
}

/*
 * At hello_max: closes the oldest connection still waiting for its Hello of the uid with the
 * most of them, unless u has as many (then u is the one to refuse).  True if room was made.
 */
static bool
hello_evict(struct user *u)
{
	struct user *most = user_most_hello();
	struct conn *c;

	if (most == NULL || most->hello <= u->hello)
		return false;
	TAILQ_FOREACH(c, &conns, entry)
		if (c->state == CONN_HELLO && c->user == most && !c->admin) {
			conn_kill(c, "closed without a Hello to make room for another uid (hello_max)");
			return true;
		}
	return false;
}

/* Refuses a connection before anything is made for it: one Reply with the reason, then close. */
static void
refuse_at_accept(int fd, struct user *u, pid_t pid, int status, const char *why)
{
	Gpx__Reply r = GPX__REPLY__INIT;
	Gpx__DaemonMsg m = GPX__DAEMON_MSG__INIT;

	r.status = status;
	r.message = (char *)why;
	m.body_case = GPX__DAEMON_MSG__BODY_REPLY;
	m.reply = &r;
	wire_send_msg(fd, &m.base, NULL, 0);    /* a fresh non-blocking socket: room for one */
	close(fd);
	log_uid(u, LOG_L_WARN, "refused a connection of uid %u pid %d: %s", (unsigned)u->uid, (int)pid, why);
}

struct conn *
conn_accept(int fd, bool admins_only)
{
	struct ucred cr;
	gid_t groups[64];
	int ngroups, status = 0;
	char why[192];

	if (peer_creds(fd, &cr, groups, &ngroups) < 0) {
		close(fd);
		return NULL;
	}
	struct user *u = user_get(cr.uid);
	bool admin = peer_admin(cr.uid, cr.gid, groups, ngroups);
	if (u->conns >= cfg->max_conns_per_uid) {
		status = GPX__STATUS__EQUOTA;
		snprintf(why, sizeof(why), "uid %u has %u connections (limit %u)", (unsigned)cr.uid, u->conns,
		    cfg->max_conns_per_uid);
	} else if (admins_only && !admin) {
		status = GPX__STATUS__EBUSY;
		snprintf(why, sizeof(why), "gpxd is short of file descriptors: only root and the admin group "
		    "are admitted until some are free again");
	} else if (!admin && nhello >= cfg->hello_max && !hello_evict(u)) {
		status = GPX__STATUS__EBUSY;
		snprintf(why, sizeof(why), "%u connections are waiting for their Hello (hello_max), %u of them "
		    "of uid %u", nhello, u->hello, (unsigned)cr.uid);
	}
	if (status != 0) {
		refuse_at_accept(fd, u, cr.pid, status, why);
		return NULL;
	}
	struct conn *c = conn_make(fd, &cr, groups, ngroups, admin);
	if (c == NULL)
		close(fd);
	return c;
}

/* ---- the log's lines about a client ---- */

static struct logwho
conn_who(struct conn *c)
{
	return (struct logwho){ .client = c->id, .uid = c->uid, .pid = c->pid, .name = c->name,
		.operator = c->admin || c->uid == 0, .mine = &c->log, .uid_share = &c->user->log };
}

void
log_audit(struct conn *c, const char *fmt, ...)
{
	struct logwho w = conn_who(c);
	va_list ap;

	va_start(ap, fmt);
	log_vrefused(&w, fmt, ap);
	va_end(ap);
}

void
log_client(struct conn *c, int level, const char *fmt, ...)
{
	struct logwho w = conn_who(c);
	va_list ap;

	va_start(ap, fmt);
	log_vwho(&w, level, fmt, ap);
	va_end(ap);
}

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

static struct rhandle *
handle_add(struct conn *c, struct region *r, bool imported, bool read_only)
{
	struct rhandle *h;

	if (c->nhandles + 1 > c->hcap / 2) {
		uint32_t ncap = c->hcap ? c->hcap * 2 : 16;
		struct rhandle **nt = calloc(ncap, sizeof(*nt));
		if (nt == NULL)
			return NULL;
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
	}
	if ((h = calloc(1, sizeof(*h))) == NULL)
		return NULL;
	h->id = (uint64_t)c->epoch << 32 | ++c->next_serial;
	h->r = r;
	h->imported = imported;
	h->read_only = read_only;
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

	c->user->regions--;
	if (!h->imported) {
		c->user->region_bytes -= r->length;
		export_remove_region(r);
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
	free(h);
}

/* ---- replies ---- */

int
conn_reply(struct conn *c, uint32_t seq, int status, const char *msg, Gpx__Reply *body,
    const int *fds, int nfds)
{
	Gpx__Reply local = GPX__REPLY__INIT;
	Gpx__DaemonMsg m = GPX__DAEMON_MSG__INIT;
	Gpx__Reply *r = body != NULL ? body : &local;
	int e;

	if (c->state == CONN_DEAD)
		return -EPIPE;
	r->seq = seq;
	r->status = status;
	r->message = (char *)(msg != NULL ? msg : "");
	m.body_case = GPX__DAEMON_MSG__BODY_REPLY;
	m.reply = r;
	e = wire_send_msg(c->fd, &m.base, fds, nfds);
	if (e == -EAGAIN)
		/* A client that does not read its socket while it keeps writing to it. */
		conn_kill(c, "socket send buffer full: the client does not read its replies");
	else if (e < 0 && e != -EPIPE && e != -ECONNRESET)
		log_debug("conn", "client %llu: reply: %s", (unsigned long long)c->id, strerror(-e));
	return e;
}

static void
reply_err(struct conn *c, uint32_t seq, int status, const char *msg)
{
	conn_reply(c, seq, status, msg, NULL, NULL, 0);
}

/* ---- Hello ---- */

static bool
is_eventfd(int fd)
{
	char path[64], target[64];
	ssize_t n;

	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	n = readlink(path, target, sizeof(target) - 1);
	if (n < 0)
		return false;
	target[n] = '\0';
	return strcmp(target, "anon_inode:[eventfd]") == 0;
}

static void
on_hello(struct conn *c, uint32_t seq, const Gpx__Hello *h, int *fds, int nfds)
{
	Gpx__Reply r = GPX__REPLY__INIT;
	Gpx__Welcome w = GPX__WELCOME__INIT;
	char err[256];

	snprintf(c->name, sizeof(c->name), "%s", h->name ? h->name : "");
	for (char *p = c->name; *p; p++)
		if (*p < 0x20 || *p > 0x7e)
			*p = '?';
	if (h->version < GPX_PROTO_MIN || h->version > GPX_PROTO_VERSION) {
		snprintf(err, sizeof(err), "protocol version %u is not spoken here (this daemon speaks %u to %u)",
		    h->version, GPX_PROTO_MIN, GPX_PROTO_VERSION);
		reply_err(c, seq, GPX__STATUS__EVERSION, err);
		conn_kill(c, err);
		return;
	}
	if (nfds != (h->no_ring ? 0 : 1) || (!h->no_ring && !is_eventfd(fds[0]))) {
		snprintf(err, sizeof(err), "Hello takes exactly one eventfd (or none with no_ring)");
		reply_err(c, seq, GPX__STATUS__EBADFD, err);
		conn_kill(c, err);
		return;
	}
	if (!h->no_ring) {
		int efd = fds[0];
		fds[0] = -1;
		if ((c->cq = cq_new(cfg->ring_entries, efd, c->id, err, sizeof(err))) == NULL) {
			close(efd);
			reply_err(c, seq, GPX__STATUS__ENOMEM, err);
			conn_kill(c, err);
			return;
		}
		c->cq->user = c->user;
	}
	c->version = h->version;
	w.version = h->version;      /* what this connection speaks from now on */
	w.client_id = c->id;
	w.ring_entries = c->cq ? c->cq->entries : 0;
	w.max_segs = cfg->max_segs;
	w.max_inline_segs = (GPX_MSG_MAX - 256) / 40;
	w.cuda = gpu_count() > 0;
	w.trust_legacy = cfg->trust_legacy_ipc;
	r.body_case = GPX__REPLY__BODY_WELCOME;
	r.welcome = &w;
	hello_leave(c);
	c->state = CONN_READY;
	if (c->cq != NULL) {
		/* The client gets its copy; ours is the mapping.  Taken out first: a failed
		 * send kills the connection, which drops c->cq. */
		int ring_fd = c->cq->ring_fd;
		c->cq->ring_fd = -1;
		conn_reply(c, seq, 0, NULL, &r, &ring_fd, 1);
		close(ring_fd);
	} else
		conn_reply(c, seq, 0, NULL, &r, NULL, 0);
	/* Query-only connections (gpxctl, monitoring) come and go often: debug level. */
	if (c->cq != NULL)
		log_client(c, LOG_L_INFO, "client %llu: %s (uid %u pid %d)", (unsigned long long)c->id,
		    c->name[0] ? c->name : "-", (unsigned)c->uid, (int)c->pid);
	else
		log_debug("conn", "client %llu: %s (uid %u pid %d), queries only", (unsigned long long)c->id,
		    c->name[0] ? c->name : "-", (unsigned)c->uid, (int)c->pid);
}

/* ---- Register ---- */

struct reg_op {
	struct conn *c;
	uint32_t seq;
	struct region *r;
	int status;
	char err[256];
	uint32_t *missing;           /* cuda-vmm: pieces the daemon lacks (with ENOENT) */
	uint32_t nmissing;
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
		struct rhandle *h = handle_add(c, r, false, r->read_only);
		if (h != NULL) {
			Gpx__Reply rep = GPX__REPLY__INIT;
			Gpx__Registered reg = GPX__REGISTERED__INIT;
			reg.region = h->id;
			reg.length = r->length;
			reg.kind = r->kind;
			reg.read_only = r->read_only;
			rep.body_case = GPX__REPLY__BODY_REGISTERED;
			rep.registered = &reg;
			log_debug("region", "client %llu: %s region %#llx, %llu bytes",
			    (unsigned long long)c->id, r->ops->name, (unsigned long long)h->id,
			    (unsigned long long)r->length);
			conn_reply(c, op->seq, 0, NULL, &rep, NULL, 0);
			/* Pieces sent for this registration that it did not take up go now. */
			if (r->npieces > 0)
				vmm_sweep(c->id);
			free(op);
			return;
		}
		op->status = -GPX__STATUS__ENOMEM;
		snprintf(op->err, sizeof(op->err), "out of memory");
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
	if (op->status == 0)
		region_revoke(r);
	else if (r->fd >= 0)
		close(r->fd);
	region_unref(r);
	free(op);
}

static void
on_register(struct conn *c, uint32_t seq, const Gpx__Register *m, int *fds, int nfds)
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
		    (pieces = xfer_area(c, m->area_offset, (uint64_t)m->piece_count * sizeof(struct gpx_wire_piece))) == NULL) {
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

	struct reg_op *op = calloc(1, sizeof(*op));
	struct region *r = region_new();
	if (op == NULL || r == NULL) {
		free(op);
		free(r);
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return;
	}
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
		int e;
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
	defer_run(reg_work, reg_done, op);
}

/* ---- Pieces: VMM memory for the next registrations to name (daemon/vmm.c) ---- */

struct pieces_op {
	struct conn *c;
	uint32_t seq;
	uint64_t owner, res, res_size;
	int dev;
	uint32_t n;
	int status;
	struct gpx_wire_piece p[GPX_PIECES_MAX];
	int fds[GPX_PIECES_MAX];
	char err[256];
};

static void
pieces_work(void *arg)
{
	struct pieces_op *op = arg;

	op->status = vmm_import(op->owner, op->dev, op->res, op->res_size, op->p, op->fds, op->n, op->err,
	    sizeof(op->err));
	for (uint32_t i = 0; i < op->n; i++)
		close(op->fds[i]);
}

static void
pieces_done(void *arg)
{
	struct pieces_op *op = arg;

	conn_settle(op->c);
	if (op->c->state != CONN_DEAD)
		reply_err(op->c, op->seq, -op->status, op->status < 0 ? op->err : NULL);
	free(op);
}

static void
on_pieces(struct conn *c, uint32_t seq, const Gpx__Pieces *m, int *fds, int nfds)
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
	if ((op = calloc(1, sizeof(*op))) == NULL) {
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
	defer_run(pieces_work, pieces_done, op);
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

static void
on_deregister(struct conn *c, uint32_t seq, const Gpx__Deregister *m)
{
	struct rhandle *h = conn_handle(c, m->region);
	struct dereg_wait *w = NULL;

	if (h == NULL) {
		reply_err(c, seq, GPX__STATUS__ENOENT, "no such region on this connection");
		return;
	}
	/* The owner's handle only: an importer's lets go of nothing the driver holds. */
	if (!h->imported && h->r->kind == GPX__MEM_KIND__MEM_CUDA_POOL && (w = calloc(1, sizeof(*w))) != NULL &&
	    (w->ev = evtimer_new(levent_base(), dereg_check, w)) != NULL) {
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

/* ---- exports ---- */

static void
on_export(struct conn *c, uint32_t seq, const Gpx__Export *m)
{
	struct rhandle *h = conn_handle(c, m->region);
	struct export *e;

	if (h == NULL || h->imported) {
		reply_err(c, seq, h ? GPX__STATUS__EACCES : GPX__STATUS__ENOENT,
		    h ? "only a region's owner can export it" : "no such region on this connection");
		return;
	}
	if (m->name == NULL || !export_name_ok(m->name)) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "export names are 1..64 bytes of [A-Za-z0-9._:/-]");
		return;
	}
	if (export_find(m->name) != NULL) {
		reply_err(c, seq, GPX__STATUS__EEXIST, "an export of that name exists");
		return;
	}
	if (m->rule > GPX__EXPORT_RULE__EXPORT_ANY) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "unknown export rule");
		return;
	}
	if (c->user->exports >= cfg->max_exports_per_uid) {
		log_audit(c, "export limit reached");
		reply_err(c, seq, GPX__STATUS__EQUOTA, "uid is at its export limit");
		return;
	}
	if (m->notify && atomic_load(&h->r->notify_on)) {
		reply_err(c, seq, GPX__STATUS__EEXIST, "the region already notifies through another export");
		return;
	}
	if (m->notify && c->cq == NULL) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "notifications need a completion ring");
		return;
	}
	if ((e = calloc(1, sizeof(*e))) == NULL) {
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return;
	}
	snprintf(e->name, sizeof(e->name), "%s", m->name);
	e->r = h->r;
	region_ref(h->r);
	e->owner = c->id;
	e->owner_region = h->id;
	e->uid = c->uid;
	e->rule = m->rule;
	e->gid = m->gid;
	e->read_only = m->read_only || h->r->read_only;
	e->notify = m->notify;
	/* fabric: whether other nodes may import it, and which (export.c keeps that rule) */
	char ferr[160];
	int fe = export_remote_opts(e, m, ferr, sizeof(ferr));
	if (fe < 0) {
		region_unref(h->r);
		free(e);
		reply_err(c, seq, -fe, ferr);
		return;
	}
	if (m->notify) {
		h->r->notify_tag = m->notify_tag;
		if (h->r->notify_cq == NULL) {
			/* Set once (the owner's queue is always this one): workers read it unlocked. */
			cq_ref(c->cq);
			h->r->notify_cq = c->cq;
		}
		atomic_store(&h->r->notify_on, true);
	}
	c->user->exports++;
	TAILQ_INSERT_TAIL(&exports, e, entry);
	if (e->remote && fabric != NULL)
		fabric->probe(h->r);     /* GPU memory: what a peer's NIC would get */
	else if (e->remote && h->r->host == NULL && h->r->dev >= 0)
		/* No fabric to probe it: what the fabric says when it cannot. */
		snprintf(h->r->gdr, sizeof(h->r->gdr), "staging: GPU memory cannot be probed now");
	log_debug("export", "client %llu exports %#llx as %s", (unsigned long long)c->id,
	    (unsigned long long)h->id, e->name);
	reply_err(c, seq, 0, NULL);
}

static void
on_unexport(struct conn *c, uint32_t seq, const Gpx__Unexport *m)
{
	struct export *e = m->name ? export_find(m->name) : NULL;

	if (e == NULL) {
		reply_err(c, seq, GPX__STATUS__ENOENT, "no such export");
		return;
	}
	if (e->owner != c->id) {
		log_audit(c, "unexport of %s, which it does not own", e->name);
		reply_err(c, seq, GPX__STATUS__EACCES, "only the exporting connection can withdraw an export");
		return;
	}
	export_remove(e);
	reply_err(c, seq, 0, NULL);
}

/* fabric: an import the fabric answers later through import_answered, with c kept alive. */
struct rimport {
	struct conn *c;
	uint32_t seq;
};

static void import_answered(void *arg, int status, const char *msg, struct region *r, bool read_only);

/* fabric: hands an import of a name no local export has to the fabric; false: not its kind. */
static bool
import_remote(struct conn *c, uint32_t seq, const char *name)
{
	struct fabric_import rq = { .name = name, .uid = c->uid, .log_as = c, .done = import_answered };
	struct rimport *ri;

	if (fabric == NULL) {
		if (name[0] != '@')
			return false;
		reply_err(c, seq, GPX__STATUS__EACCES, "importing by address needs the fabric: "
		    "[fabric] dial_on_demand = yes in gpxd.conf");
		return true;
	}
	if ((ri = malloc(sizeof(*ri))) == NULL) {
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return true;
	}
	ri->c = c;
	ri->seq = seq;
	rq.arg = ri;
	c->pending++;                /* import_answered settles it, maybe before this returns */
	if (fabric->import(&rq))
		return true;
	c->pending--;
	free(ri);
	return false;
}

static void
on_import(struct conn *c, uint32_t seq, const Gpx__Import *m)
{
	struct export *e = m->name ? export_find(m->name) : NULL;
	struct rhandle *h;

	if (e == NULL) {
		/* fabric: "NODE:name" or "@HOST:PORT/name" is answered by the fabric, maybe later */
		if (m->name != NULL && import_remote(c, seq, m->name))
			return;
		reply_err(c, seq, GPX__STATUS__ENOENT, "no such export");
		return;
	}
	struct creds who = conn_creds(c);
	if (!export_allows(e, &who)) {
		log_audit(c, "import of %s denied by its rule", e->name);
		reply_err(c, seq, GPX__STATUS__EACCES, "the export's access rule does not admit this client");
		return;
	}
	if (c->user->regions >= cfg->max_regions_per_uid) {
		log_audit(c, "region limit reached on import");
		reply_err(c, seq, GPX__STATUS__EQUOTA, "uid is at its region limit");
		return;
	}
	if ((h = handle_add(c, e->r, true, e->read_only)) == NULL) {
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return;
	}
	region_ref(e->r);
	c->user->regions++;
	e->importers++;

	Gpx__Reply rep = GPX__REPLY__INIT;
	Gpx__Registered reg = GPX__REGISTERED__INIT;
	reg.region = h->id;
	reg.length = e->r->length;
	reg.kind = e->r->kind;
	reg.read_only = h->read_only;
	rep.body_case = GPX__REPLY__BODY_REGISTERED;
	rep.registered = &reg;
	conn_reply(c, seq, 0, NULL, &rep, NULL, 0);
}

/*
 * fabric: the answer to an import of another node's export (fabric.h's fabric_import_fn): a
 * handle on r, which arrives with one reference, or the error.  An asker gone meanwhile drops r.
 */
static void
import_answered(void *arg, int status, const char *msg, struct region *r, bool read_only)
{
	struct rimport *ri = arg;
	struct conn *c = ri->c;
	uint32_t seq = ri->seq;
	Gpx__Reply rep = GPX__REPLY__INIT;
	Gpx__Registered reg = GPX__REGISTERED__INIT;
	struct rhandle *h = NULL;

	free(ri);
	conn_settle(c);
	if (c->state == CONN_DEAD) {
		if (r != NULL) {
			region_revoke(r);      /* its closing tells the peer */
			region_unref(r);
		}
		return;
	}
	if (status != 0) {
		reply_err(c, seq, status, msg);
		return;
	}
	if (c->user->regions >= cfg->max_regions_per_uid || (h = handle_add(c, r, true, read_only)) == NULL) {
		reply_err(c, seq, c->user->regions >= cfg->max_regions_per_uid ? GPX__STATUS__EQUOTA :
		    GPX__STATUS__ENOMEM, "uid is at its region limit, or out of memory");
		region_revoke(r);
		region_unref(r);
		return;
	}
	c->user->regions++;
	reg.region = h->id;
	reg.length = r->length;
	reg.kind = r->kind;
	reg.read_only = read_only;
	rep.body_case = GPX__REPLY__BODY_REGISTERED;
	rep.registered = &reg;
	conn_reply(c, seq, 0, NULL, &rep, NULL, 0);
}

/* ---- transfers ---- */

/* Refuses a transfer on the socket (it has no ring slot) with its tag. */
static void
refuse(struct conn *c, uint32_t seq, uint64_t tag, int status, const char *why)
{
	Gpx__Reply rep = GPX__REPLY__INIT;

	rep.tag = tag;
	conn_reply(c, seq, status, why, &rep, NULL, 0);
}

/* Handles a Transfer; returns once its segments have been copied in or it was refused. */
static void
transfer(struct conn *c, uint32_t seq, const Gpx__Transfer *m, int *fds, int nfds)
{
	struct job *j;
	char err[512];
	int r;

	if (nfds > 1) {
		refuse(c, seq, m->tag, GPX__STATUS__EPROTO, "Transfer takes at most one fd");
		return;
	}
	if (c->state == CONN_DRAINING) {
		refuse(c, seq, m->tag, GPX__STATUS__EDRAINING, "this client is being drained");
		return;
	}
	if (atomic_load(&c->user->inflight) >= cfg->max_inflight_per_uid) {
		refuse(c, seq, m->tag, GPX__STATUS__EBUSY, "uid has its limit of outstanding transfers");
		return;
	}
	if ((r = cq_reserve(c->cq)) < 0) {
		refuse(c, seq, m->tag, -r, r == -GPX__STATUS__EBUSY ? "no credit: completion ring would overflow" :
		    "completion ring broken");
		return;
	}
	if ((r = xfer_build(c, m, nfds ? fds[0] : -1, &j, err, sizeof(err))) < 0) {
		cq_unreserve(c->cq);
		atomic_fetch_add(&c->cq->errors, 1);
		metrics_refused(c, -r);
		refuse(c, seq, m->tag, -r, err);
		return;
	}
	/* One transfer, one credit; a batch over several paths is one job per path. */
	atomic_fetch_add(&c->user->inflight, 1);
	while (j != NULL) {
		struct job *next = j->gnext;
		j->gnext = NULL;
		cq_ref(c->cq);
		j->cq = c->cq;
		j->user = c->user;
		engine_submit(j);
		j = next;
	}
}

static void
on_transfer(struct conn *c, uint32_t seq, const Gpx__Transfer *m, int *fds, int nfds)
{
	if (c->cq == NULL) {
		refuse(c, seq, m->tag, GPX__STATUS__EINVAL, "transfers need a completion ring");
		return;
	}
	transfer(c, seq, m, fds, nfds);
	/* Whatever became of it, its part of the segment area may be written again. */
	if ((m->seg_count > 0 || m->pair_count > 0) && nfds == 0 && c->state != CONN_DEAD)
		__atomic_fetch_add(&c->cq->ring->segs_consumed, 1, __ATOMIC_RELEASE);
}

/* The seq of refusals of queued submissions, which came without a message of their own. */
#define SQ_SEQ 0xffffffffu

int
conn_poll_sq(struct conn *c)
{
	struct gpx_ring_hdr *h;
	uint64_t head, tail;
	int n = 0;

	if (c->cq == NULL || c->state == CONN_DEAD || c->state == CONN_HELLO)
		return 0;
	h = c->cq->ring;
	head = c->sq_head;
	tail = __atomic_load_n(&h->sq_tail, __ATOMIC_ACQUIRE);
	if (tail == head)
		return 0;
	if (tail - head > c->cq->entries) {
		log_audit(c, "submission queue tail %llu is not within %u of %llu", (unsigned long long)tail,
		    c->cq->entries, (unsigned long long)head);
		conn_kill(c, "submission queue corrupted");
		return 0;
	}
	c->t_last = conn_last_input = now_s();
	while (head != tail && c->state != CONN_DEAD) {
		struct gpx_sqe e;
		Gpx__Transfer t = GPX__TRANSFER__INIT;
		Gpx__Segment seg = GPX__SEGMENT__INIT, *sp = &seg;

		/* One read of the shared entry; everything below looks at the private copy. */
		memcpy(&e, gpx_sq_slot(h, c->cq->entries, head), sizeof(e));
		head++;
		t.tag = e.tag;
		t.flags = e.flags;
		t.src_region = e.src_region;
		t.dst_region = e.dst_region;
		seg.src_offset = e.src_offset;
		seg.dst_offset = e.dst_offset;
		seg.length = e.length;
		t.n_segments = 1;
		t.segments = &sp;
		transfer(c, SQ_SEQ, &t, NULL, 0);
		n++;
	}
	c->sq_head = head;
	if (c->state != CONN_DEAD)
		__atomic_store_n(&h->sq_head, head, __ATOMIC_RELEASE);
	return n;
}

/*
 * Polls every connection's submission queue.  SQ_POLLING first tells the clients they need not
 * kick; SQ_SLEEPING tells them they must (the loop is about to block) and reads the queues
 * again after a full fence, so a submission published at that moment is either seen here or
 * followed by its client's kick.
 */
int
conn_poll_all(int mode)
{
	struct conn *c, *t;
	int n = 0;

	if (mode != SQ_POLL)
		TAILQ_FOREACH_SAFE(c, &conns, entry, t) {
			if (c->cq == NULL || c->state == CONN_HELLO)
				continue;
			__atomic_store_n(&c->cq->ring->sq_wakeup, mode == SQ_SLEEPING, __ATOMIC_RELAXED);
		}
	if (mode == SQ_SLEEPING)
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
	TAILQ_FOREACH_SAFE(c, &conns, entry, t)
		n += conn_poll_sq(c);
	return n;
}

static void
on_seg_area(struct conn *c, uint32_t seq, const Gpx__SegArea *m, int *fds, int nfds)
{
	char err[256];
	int r;

	if (nfds != 1) {
		reply_err(c, seq, GPX__STATUS__EPROTO, "SegArea takes exactly one memfd");
		return;
	}
	if ((r = xfer_set_area(c, fds[0], m->length, err, sizeof(err))) < 0) {
		log_audit(c, "segment area: %s", err);
		reply_err(c, seq, -r, err);
		return;
	}
	reply_err(c, seq, 0, NULL);
}

static void
on_cancel(struct conn *c, uint32_t seq, const Gpx__Cancel *m)
{
	int n = engine_cancel(c->id, m->tag);

	reply_err(c, seq, n > 0 ? 0 : GPX__STATUS__ENOENT, n > 0 ? NULL : "no transfer with that tag in flight");
}

/* ---- dispatch ---- */

static int
fds_for(const Gpx__ClientMsg *m)
{
	switch (m->body_case) {
	case GPX__CLIENT_MSG__BODY_HELLO:
	case GPX__CLIENT_MSG__BODY_REGISTER:
	case GPX__CLIENT_MSG__BODY_TRANSFER:
	case GPX__CLIENT_MSG__BODY_SEG_AREA:
	case GPX__CLIENT_MSG__BODY_PIECES:
		return -1;    /* checked by the handler: depends on the fields */
	default:
		return 0;
	}
}

static void
dispatch(struct conn *c, const Gpx__ClientMsg *m, int *fds, int nfds)
{
	uint32_t seq = m->seq;
	int want = fds_for(m);

	/* State first: before Hello, anything else closes the connection, fds or not. */
	if (c->state == CONN_HELLO) {
		if (m->body_case != GPX__CLIENT_MSG__BODY_HELLO) {
			reply_err(c, seq, GPX__STATUS__EPROTO, "the first message must be Hello");
			conn_kill(c, "first message was not Hello");
			return;
		}
		on_hello(c, seq, m->hello, fds, nfds);
		return;
	}
	if (want >= 0 && nfds != want) {
		reply_err(c, seq, GPX__STATUS__EPROTO, "this message takes no file descriptors");
		return;
	}
	switch (m->body_case) {
	case GPX__CLIENT_MSG__BODY_HELLO:
		reply_err(c, seq, GPX__STATUS__EPROTO, "Hello was already received");
		break;
	case GPX__CLIENT_MSG__BODY_REGISTER:
		on_register(c, seq, m->register_, fds, nfds);
		/* A list of pieces in the segment area may be written again, whatever became of it. */
		if (m->register_->piece_count > 0 && c->cq != NULL && c->state != CONN_DEAD)
			__atomic_fetch_add(&c->cq->ring->segs_consumed, 1, __ATOMIC_RELEASE);
		break;
	case GPX__CLIENT_MSG__BODY_PIECES:
		on_pieces(c, seq, m->pieces, fds, nfds);
		break;
	case GPX__CLIENT_MSG__BODY_DEREGISTER:
		on_deregister(c, seq, m->deregister);
		break;
	case GPX__CLIENT_MSG__BODY_EXPORT:
		on_export(c, seq, m->export);
		break;
	case GPX__CLIENT_MSG__BODY_UNEXPORT:
		on_unexport(c, seq, m->unexport);
		break;
	case GPX__CLIENT_MSG__BODY_IMPORT:
		on_import(c, seq, m->import);
		break;
	case GPX__CLIENT_MSG__BODY_TRANSFER:
		on_transfer(c, seq, m->transfer, fds, nfds);
		break;
	case GPX__CLIENT_MSG__BODY_SEG_AREA:
		on_seg_area(c, seq, m->seg_area, fds, nfds);
		break;
	case GPX__CLIENT_MSG__BODY_SQ_KICK:
		break;      /* conn_input read the queue before this message */
	case GPX__CLIENT_MSG__BODY_CANCEL:
		on_cancel(c, seq, m->cancel);
		break;
	case GPX__CLIENT_MSG__BODY_QUERY:
		ctl_query(c, seq, m->query);
		break;
	case GPX__CLIENT_MSG__BODY_ADMIN:
		ctl_admin(c, seq, m->admin);
		break;
	default:
		reply_err(c, seq, GPX__STATUS__EPROTO, "unknown message type");
		conn_kill(c, "unknown message type");
		break;
	}
}

/* Loop thread: the socket is readable.  Handles a bounded number of messages per wake-up. */
void
conn_input(struct conn *c)
{
	int fds[GPX_MAX_FDS], nfds;

	for (int i = 0; i < MSGS_PER_WAKE && c->state != CONN_DEAD; i++) {
		/* Submissions queued before this message was sent come first. */
		conn_poll_sq(c);
		if (c->state == CONN_DEAD)
			return;
		ssize_t n = wire_recv(c->fd, msgbuf, fds, &nfds, GPX_MAX_FDS, MSG_DONTWAIT);
		if (n == -EAGAIN)
			return;
		c->t_last = conn_last_input = now_s();
		if (n == 0 || n == -ECONNRESET) {
			conn_kill(c, "disconnected");
			return;
		}
		if (n == -EMSGSIZE) {
			log_audit(c, "message larger than %d bytes", GPX_MSG_MAX);
			conn_kill(c, "message over the size cap");
			return;
		}
		if (n == -EBADMSG || n == -E2BIG) {
			log_audit(c, "%s", n == -E2BIG ? "too many file descriptors in one message" :
			    "truncated or foreign control data");
			reply_err(c, 0, GPX__STATUS__EPROTO, n == -E2BIG ?
			    "too many file descriptors: the message was dropped and they were closed" :
			    "truncated control data: the message was dropped");
			if (c->state == CONN_HELLO) {
				/* Whatever it was, it was not a Hello. */
				conn_kill(c, "first message was not Hello");
				return;
			}
			continue;
		}
		if (n < 0) {
			conn_kill(c, strerror((int)-n));
			return;
		}
		wire_arena_reset(arena);
		Gpx__ClientMsg *m = gpx__client_msg__unpack(&arena->pa, n, msgbuf);
		if (m == NULL) {
			wire_close_fds(fds, nfds);
			log_audit(c, "undecodable message (%zd bytes)", n);
			reply_err(c, 0, GPX__STATUS__EPROTO, "undecodable message");
			conn_kill(c, "undecodable message");
			return;
		}
		dispatch(c, m, fds, nfds);
		wire_close_fds(fds, nfds);
	}
}

/* Releases everything the client holds; the struct itself is freed by conn_reap(). */
void
conn_kill(struct conn *c, const char *why)
{
	struct export *e, *et;

	if (c->state == CONN_DEAD)
		return;
	if (c->cq == NULL && strcmp(why, "disconnected") == 0)
		log_debug("conn", "client %llu (%s) gone", (unsigned long long)c->id, c->name[0] ? c->name : "-");
	else
		log_client(c, LOG_L_INFO, "client %llu (%s, uid %u pid %d) gone: %s", (unsigned long long)c->id,
		    c->name[0] ? c->name : "-", (unsigned)c->uid, (int)c->pid, why);
	hello_leave(c);
	c->state = CONN_DEAD;
	levent_conn_unwatch(c);
	close(c->fd);
	c->fd = -1;
	if (c->pidfd >= 0)
		close(c->pidfd);
	c->pidfd = -1;
	engine_cancel_client(c->id);
	TAILQ_FOREACH_SAFE(e, &exports, entry, et)
		if (e->owner == c->id)
			export_remove(e);
	for (uint32_t i = 0; i < c->hcap; i++)
		while (c->htab[i] != NULL) {
			struct rhandle *h = c->htab[i];
			c->htab[i] = h->next;
			handle_release(c, h);
		}
	free(c->htab);
	c->htab = NULL;
	vmm_sweep(c->id);      /* pieces sent and never taken up by a region */
	xfer_drop_area(c);
	c->hcap = c->nhandles = 0;
	if (c->cq != NULL) {
		cq_unref(c->cq);
		c->cq = NULL;
	}
	c->user->conns--;
	TAILQ_REMOVE(&conns, c, entry);
	nconns--;
	TAILQ_INSERT_TAIL(&dead, c, entry);
	levent_request_reap();
}

/* Frees dead connections that no deferred operation refers to. */
void
conn_settle(struct conn *c)
{
	if (--c->pending == 0 && c->state == CONN_DEAD)
		levent_request_reap();
}

void
conn_reap(void)
{
	struct conn *c, *t;

	TAILQ_FOREACH_SAFE(c, &conns, entry, t)
		if (c->cq != NULL && c->cq->broken)
			conn_kill(c, c->cq->broken_why);
	TAILQ_FOREACH_SAFE(c, &dead, entry, t) {
		if (c->pending > 0)
			continue;
		TAILQ_REMOVE(&dead, c, entry);
		free(c);
	}
}
