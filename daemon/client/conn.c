/*
 * Client connections: credentials and admission at accept, the Hello state machine, the
 * message dispatcher, and a connection's end.  The handlers of the requests are in
 * conn-region.c (Register, Pieces, Deregister), conn-export.c (Export, Unexport, Import) and
 * conn-xfer.c (Transfer, the submission queue, SegArea, Cancel); conn-private.h is what the
 * four files share.
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
 * once no deferred operation refers to it any more.  Its handles go a slice of a turn at a
 * time (handles_release): conn_kill takes the first, conn_reap the rest, a turn each.
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

#include "daemon/client/conn-private.h"
#include "daemon/fabric/fabric.h"

struct conn_list conns = TAILQ_HEAD_INITIALIZER(conns);
double conn_last_input;
static struct conn_list dead = TAILQ_HEAD_INITIALIZER(dead);

/* Without a loop (tests that drive connections directly): no events, and the caller reaps. */
static void no_unwatch(struct conn *c) { (void)c; }
static void no_pause(struct conn *c, bool pause) { (void)c; (void)pause; }
static void no_reap(void) { }
static int no_reload(char *msg, size_t len) { snprintf(msg, len, "no event loop"); return -1; }
static const struct conn_loop no_loop = { NULL, no_unwatch, no_pause, no_reap, no_reload };
const struct conn_loop *conn_loop = &no_loop;

/* At start, before the first connection: the loop's services, our exports to the fabric. */
void
conn_init(const struct conn_loop *l)
{
	conn_loop = l;
	fabric_exports_from(&export_peer_ops);
}
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

/*
 * The admin group's gid, looked up again when the name changes or after a minute, not at
 * every accept: 1 with it in *gid, 0 when there is no such group, -1 when nothing is known
 * of it because its lookup failed (out of memory or descriptors).
 */
static int
admin_gid(gid_t *gid)
{
	static char name[256];
	static double when;
	static bool known;
	static gid_t g;
	double now = now_s();
	bool renamed;

	if (cfg->admin_group == NULL)
		return 0;
	renamed = strcmp(name, cfg->admin_group) != 0;
	if (renamed || now - when > 60) {
		errno = 0;
		struct group *gr = getgrnam(cfg->admin_group);
		if (gr == NULL && (errno == ENOMEM || errno == EMFILE || errno == ENFILE || errno == EIO)) {
			/* the lookup failed, which says nothing of the group: what was known stays, and
			 * the next look tries again (a renamed group is not known till then) */
			if (renamed)
				return -1;
			*gid = g;
			return known;
		}
		/*
		 * Said once per name, at start or reload (the group may be made later); a warning
		 * when the file names it, a typo most likely, as the default is often absent on
		 * machines where the package's sysusers entry did not run.
		 */
		if (gr == NULL && renamed && strcmp(cfg->admin_group, "gpx-admin") != 0)
			log_warnx("admin_group %s: no such group; only root may make administrative requests",
			    cfg->admin_group);
		else if (gr == NULL && renamed)
			log_info("admin_group %s: no such group; only root may make administrative requests",
			    cfg->admin_group);
		known = gr != NULL;
		if (known)
			g = gr->gr_gid;
		snprintf(name, sizeof(name), "%s", cfg->admin_group);
		when = now;
	}
	*gid = g;
	return known;
}

void
conn_admin_check(void)
{
	gid_t g;

	(void)admin_gid(&g);
}

/* 1 when the peer is root or of the admin group, 0 when not, -1 when the group is not known (see admin_gid). */
static int
peer_admin(uid_t uid, gid_t gid, const gid_t *groups, int ngroups)
{
	gid_t ag;
	int known;

	if (uid == 0)
		return 1;
	if ((known = admin_gid(&ag)) <= 0)
		return known;
	if (gid == ag)
		return 1;
	for (int i = 0; i < ngroups; i++)
		if (groups[i] == ag)
			return 1;
	return 0;
}

/*
 * Whether c may make administrative requests, asked again for a connection that was not
 * admitted as an administrator: the group's lookup at its accept may have found no memory
 * (then the connection was admitted as anyone's), or admin_group may name its group since.
 * 1, 0, or -1 when the lookup fails again.
 */
int
conn_admin(const struct conn *c)
{
	return c->admin ? 1 : peer_admin(c->uid, c->gid, c->groups, c->ngroups);
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
	struct user *u = user_get(cr->uid);
	struct conn *c;

	if (u == NULL || (arena == NULL && (arena = wire_arena_new(GPX_ARENA_SIZE)) == NULL) ||
	    (c = calloc(1, sizeof(*c))) == NULL)
		return NULL;
	if (next_epoch == 0) {
		if (getrandom(&next_epoch, sizeof(next_epoch), 0) != sizeof(next_epoch))
			next_epoch = (uint32_t)time(NULL) ^ ((uint32_t)getpid() << 16);
		next_epoch |= 1;
	}
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
	c->user = u;
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
	return conn_make(fd, &cr, groups, ngroups, peer_admin(cr.uid, cr.gid, groups, ngroups) > 0);
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

/*
 * Refuses a connection before anything is made for it: one Reply with the reason, then close.
 * u is NULL when not even the uid's record could be made.
 */
static void
refuse_at_accept(int fd, struct user *u, const struct ucred *cr, int status, const char *why)
{
	Gpx__Reply r = GPX__REPLY__INIT;
	Gpx__DaemonMsg m = GPX__DAEMON_MSG__INIT;

	r.status = status;
	r.message = (char *)why;
	m.body_case = GPX__DAEMON_MSG__BODY_REPLY;
	m.reply = &r;
	wire_send_msg(fd, &m.base, NULL, 0);    /* a fresh non-blocking socket: room for one */
	close(fd);
	if (u != NULL)
		log_uid(u, LOG_L_WARN, "refused a connection of uid %u pid %d: %s", (unsigned)cr->uid, (int)cr->pid, why);
	else
		log_warnx("refused a connection of uid %u pid %d: %s", (unsigned)cr->uid, (int)cr->pid, why);
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
	bool admin = peer_admin(cr.uid, cr.gid, groups, ngroups) > 0;
	if (u == NULL) {
		status = GPX__STATUS__ENOMEM;
		snprintf(why, sizeof(why), "gpxd is out of memory");
	} else if (u->conns >= cfg->max_conns_per_uid) {
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
		refuse_at_accept(fd, u, &cr, status, why);
		return NULL;
	}
	struct conn *c = conn_make(fd, &cr, groups, ngroups, admin);
	if (c == NULL)
		refuse_at_accept(fd, u, &cr, GPX__STATUS__ENOMEM, "gpxd is out of memory");
	return c;
}

/* ---- the log's lines about a client ---- */

struct logwho
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

/* ---- entries against the budgets ---- */

int
conn_charge(struct conn *c, uint64_t bytes, const char *what, char *err, size_t errlen)
{
	struct charge ch = { .cq = c->cq, .entries = &c->entries, .user = c->user, .entry = true, .what = what };
	int r;

	if ((r = xfer_pairs_charge(&c->pairs, &ch, bytes, err, errlen)) < 0)
		log_audit(c, "%s", err);
	return r;
}

void
conn_uncharge(struct conn *c, uint64_t bytes)
{
	budget_entry_release(&c->entries, c->user, bytes);
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
	if (e == -ENOMEM && body != NULL) {
		/* a reply too large for wire_send_msg's stack buffer, and no memory for it: the
		 * request is answered all the same, with the reason (which fits) */
		local.seq = seq;
		local.tag = r->tag;
		local.status = GPX__STATUS__ENOMEM;
		local.message = (char *)"out of memory sending the reply";
		m.reply = &local;
		e = wire_send_msg(c->fd, &m.base, NULL, 0);
	}
	if (e == -EAGAIN)
		/* A client that does not read its socket while it keeps writing to it. */
		conn_kill(c, "socket send buffer full: the client does not read its replies");
	else if (e < 0 && e != -EPIPE && e != -ECONNRESET)
		log_debug("conn", "client %llu: reply: %s", (unsigned long long)c->id, strerror(-e));
	return e;
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
		int efd = fds[0], e;
		fds[0] = -1;
		if ((e = maps_take("connection's completion ring", err, sizeof(err))) < 0) {
			close(efd);
			reply_err(c, seq, -e, err);
			conn_kill(c, "no mapping left for its completion ring (limits.mappings)");
			return;
		}
		if ((c->cq = cq_new(cfg->ring_entries, efd, c->id, err, sizeof(err))) == NULL) {
			maps_give();
			close(efd);
			reply_err(c, seq, GPX__STATUS__ENOMEM, err);
			conn_kill(c, err);
			return;
		}
		c->cq->map_counted = true;
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
		req_register(c, seq, m->register_, fds, nfds);
		/* A list of pieces in the segment area may be written again, whatever became of it. */
		if (m->register_->piece_count > 0 && c->cq != NULL && c->state != CONN_DEAD)
			__atomic_fetch_add(&c->cq->ring->segs_consumed, 1, __ATOMIC_RELEASE);
		break;
	case GPX__CLIENT_MSG__BODY_PIECES:
		req_pieces(c, seq, m->pieces, fds, nfds);
		break;
	case GPX__CLIENT_MSG__BODY_DEREGISTER:
		req_deregister(c, seq, m->deregister);
		break;
	case GPX__CLIENT_MSG__BODY_EXPORT:
		req_export(c, seq, m->export);
		break;
	case GPX__CLIENT_MSG__BODY_UNEXPORT:
		req_unexport(c, seq, m->unexport);
		break;
	case GPX__CLIENT_MSG__BODY_IMPORT:
		req_import(c, seq, m->import);
		break;
	case GPX__CLIENT_MSG__BODY_TRANSFER:
		req_transfer(c, seq, m->transfer, fds, nfds);
		break;
	case GPX__CLIENT_MSG__BODY_SEG_AREA:
		req_seg_area(c, seq, m->seg_area, fds, nfds);
		break;
	case GPX__CLIENT_MSG__BODY_SQ_KICK:
		break;      /* conn_input read the queue before this message */
	case GPX__CLIENT_MSG__BODY_CANCEL:
		req_cancel(c, seq, m->cancel);
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

/*
 * A message dropped for its control data: its bytes came whole, so the refusal goes under its
 * own seq (and a transfer's tag), and a request waiting for its answer ends now.  Undecodable,
 * it goes under seq 0.
 */
static void
dropped(struct conn *c, size_t len, int status, const char *why)
{
	Gpx__Reply rep = GPX__REPLY__INIT;
	uint32_t seq = 0;

	wire_arena_reset(arena);
	Gpx__ClientMsg *m = gpx__client_msg__unpack(&arena->pa, len, msgbuf);
	if (m != NULL) {
		seq = m->seq;
		if (m->body_case == GPX__CLIENT_MSG__BODY_TRANSFER)
			rep.tag = m->transfer->tag;
	}
	conn_reply(c, seq, status, why, &rep, NULL, 0);
}

/*
 * The message of len bytes in msgbuf, and its fds, kept until the submissions queued before it
 * have been taken (charged to c's entries while kept); refused busy if its budget has no room.
 */
static void
hold(struct conn *c, size_t len, int *fds, int nfds)
{
	char err[512];
	int e;

	if ((e = conn_charge(c, len, "message behind queued submissions", err, sizeof(err))) < 0 ||
	    (c->held = malloc(len)) == NULL) {
		if (e == 0)
			conn_uncharge(c, len);
		wire_close_fds(fds, nfds);
		dropped(c, len, e < 0 ? -e : GPX__STATUS__ENOMEM, e < 0 ? err : "out of memory");
		return;
	}
	memcpy(c->held, msgbuf, len);
	c->held_len = len;
	memcpy(c->held_fds, fds, (size_t)nfds * sizeof(*fds));
	c->held_nfds = nfds;
}

/* The kept message back in msgbuf and fds: its turn has come.  Its length. */
static size_t
unhold(struct conn *c, int *fds, int *nfds)
{
	size_t len = c->held_len;

	memcpy(msgbuf, c->held, len);
	memcpy(fds, c->held_fds, (size_t)c->held_nfds * sizeof(*fds));
	*nfds = c->held_nfds;
	free(c->held);
	c->held = NULL;
	conn_uncharge(c, len);
	return len;
}

/*
 * The next message of c's socket into msgbuf and fds: its length, or 0 when there is none to
 * handle now (none came, or the connection ended, or it was dropped or kept: *next says whether
 * to look for another).
 */
static size_t
next_message(struct conn *c, int *fds, int *nfds, bool *next)
{
	size_t len = 0;
	ssize_t n = wire_recv(c->fd, msgbuf, &len, fds, nfds, GPX_MAX_FDS, MSG_DONTWAIT);

	*next = false;
	if (n == -EAGAIN)
		return 0;
	c->t_last = conn_last_input = now_s();
	if (n == 0 || n == -ECONNRESET) {
		conn_kill(c, "disconnected");
		return 0;
	}
	if (n == -EMSGSIZE) {
		log_audit(c, "message larger than %d bytes", GPX_MSG_MAX);
		conn_kill(c, "message over the size cap");
		return 0;
	}
	if (n == -EBADMSG || n == -E2BIG || n == -EMFILE) {
		log_audit(c, "%s", n == -E2BIG ? "too many file descriptors in one message" : n == -EMFILE ?
		    "file descriptors gpxd could not take (its descriptor limit)" : "truncated or foreign control data");
		dropped(c, len, n == -EMFILE ? GPX__STATUS__EBUSY : GPX__STATUS__EPROTO, n == -E2BIG ?
		    "too many file descriptors: the message was dropped and they were closed" : n == -EMFILE ?
		    "gpxd is out of file descriptors and could not take this message's: it was dropped" :
		    "truncated or foreign control data: the message was dropped");
		if (c->state == CONN_HELLO)
			conn_kill(c, "first message was not Hello");   /* whatever it was, it was not a Hello */
		else
			*next = true;
		return 0;
	}
	if (n < 0) {
		conn_kill(c, strerror((int)-n));
		return 0;
	}
	/*
	 * The client published to its queue before it sent this, so what it queued first is in
	 * sight now, though the pass before the read did not see it: taken first.  What this turn
	 * has no time left for, or a list a task thread now checks, keeps the message waiting.
	 */
	if (conn_sq_waiting(c)) {
		conn_poll_sq(c);
		if (c->state == CONN_DEAD) {
			wire_close_fds(fds, *nfds);
			return 0;
		}
		if (c->sq_more || c->checking != NULL) {
			hold(c, (size_t)n, fds, *nfds);
			return 0;
		}
	}
	return (size_t)n;
}

/*
 * Loop thread: the socket is readable, or a message kept behind queued submissions may now go.
 * Handles up to MSGS_PER_WAKE messages, and none after the turn's slice (loop_turn_over): the
 * socket is still readable, or the loop's pass over the queues (conn_poll_all) comes back.
 */
void
conn_input(struct conn *c)
{
	int fds[GPX_MAX_FDS], nfds = 0;

	/* (a transfer whose lists a task thread checks holds the rest back: conn-xfer.c) */
	for (int i = 0; i < MSGS_PER_WAKE && c->state != CONN_DEAD && c->checking == NULL; i++) {
		/* Submissions queued before this message was sent come first, all of them. */
		conn_poll_sq(c);
		if (c->state == CONN_DEAD || c->checking != NULL || c->sq_more || (i > 0 && loop_turn_over()))
			return;
		/*
		 * For the test of the order next_message keeps (integ-ring): GPXD_TEST_READ_DELAY_US=N
		 * waits N us between the pass over the queue and each read after a turn's first, so
		 * that a client's answer to the last message, its submission and its next message
		 * all fall in between.  Read once; 0 (unset) in any real use.
		 */
		static long read_delay_us = -1;
		if (read_delay_us < 0) {
			const char *e = getenv("GPXD_TEST_READ_DELAY_US");
			read_delay_us = e != NULL && atol(e) > 0 && atol(e) <= 1000000 ? atol(e) : 0;
		}
		if (i > 0 && read_delay_us > 0)
			usleep((useconds_t)read_delay_us);
		bool next = false;
		size_t n = c->held != NULL ? unhold(c, fds, &nfds) : next_message(c, fds, &nfds, &next);
		if (n == 0) {
			if (next)
				continue;
			return;
		}
		wire_arena_reset(arena);
		Gpx__ClientMsg *m = gpx__client_msg__unpack(&arena->pa, n, msgbuf);
		if (m == NULL) {
			wire_close_fds(fds, nfds);
			log_audit(c, "undecodable message (%zu bytes)", n);
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
	conn_poll_forget(c);
	c->state = CONN_DEAD;
	conn_loop->unwatch(c);
	close(c->fd);
	c->fd = -1;
	if (c->pidfd >= 0)
		close(c->pidfd);
	c->pidfd = -1;
	engine_cancel_client(c->id);
	TAILQ_FOREACH_SAFE(e, &exports, entry, et)
		if (e->owner == c->id)
			export_remove(e);
	if (!handles_release(c))
		c->pending++;      /* (the rest in the turns after, conn_reap; its memory stays till then) */
	vmm_sweep(c->id);      /* pieces sent and never taken up by a region */
	if (c->area != NULL)
		maps_give();
	xfer_drop_area(&c->area, &c->area_len, c->checking);
	if (c->held != NULL) {
		wire_close_fds(c->held_fds, c->held_nfds);
		free(c->held);
		c->held = NULL;
		conn_uncharge(c, c->held_len);
	}
	if (c->cq != NULL) {
		cq_unref(c->cq);
		c->cq = NULL;
	}
	c->user->conns--;
	TAILQ_REMOVE(&conns, c, entry);
	nconns--;
	TAILQ_INSERT_TAIL(&dead, c, entry);
	conn_loop->request_reap();
}

/* A deferred operation of c ended: a dead c is reaped after its last. */
void
conn_settle(struct conn *c)
{
	if (--c->pending == 0 && c->state == CONN_DEAD)
		conn_loop->request_reap();
}

/*
 * Gives back the handles of dead connections and frees those that no deferred operation refers
 * to; true while some still hold handles (call again, in a later turn).
 */
bool
conn_reap(void)
{
	struct conn *c, *t;
	bool more = false;

	TAILQ_FOREACH_SAFE(c, &conns, entry, t)
		if (c->cq != NULL && c->cq->broken)
			conn_kill(c, c->cq->broken_why);
	TAILQ_FOREACH_SAFE(c, &dead, entry, t) {
		if (c->htab != NULL) {
			if (!handles_release(c)) {
				more = true;
				continue;
			}
			c->pending--;
		}
		if (c->pending > 0)
			continue;
		TAILQ_REMOVE(&dead, c, entry);
		free(c);
	}
	return more;
}
