/*
 * Peer daemons: the control plane of the fabric, and the life of each connection with another
 * node's gpxd.  A connection comes from the listener or from dialling an address
 * (peer-dial.c); before anything else it runs the handshake of proto/peer.proto (peer-auth.c);
 * then it carries imports (peer-import.c), the data plane's requests and answers
 * (request.c, serve.c) and keepalive pings.  This file owns the list of connections, frames
 * what goes out and what comes in, hands each message to the file of its job, and runs the
 * tick; it starts and stops the rest of the fabric (peer_start, peer_stop), and answers
 * gpxctl's status and peers.
 *
 * Everything a peer sends is untrusted: frame lengths are capped before anything is read (far
 * lower before authentication), messages unpack into the bounded arena, names are checked
 * against a small alphabet, handles carry the connection's epoch.  A peer that misbehaves loses
 * its connection, with a log line saying why; the daemon never exits because of it.  A peer
 * that says nothing for [fabric] timeout seconds (keepalive pings go out at a third of that) is
 * declared dead, so a vanished node turns into errors within that bound, never a hang.
 * peer_kill lets go of everything that hangs on a connection at once (its requests, imports,
 * handles and queue pairs); the struct itself is freed at the next tick, so that no caller
 * holding it is left with freed memory.
 */
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>

#include "daemon/fabric/internal.h"

struct peer_list peers = TAILQ_HEAD_INITIALIZER(peers);
char peer_self[PEER_NAME_MAX + 1];
static struct peer_list dead = TAILQ_HEAD_INITIALIZER(dead);
static struct event *tick_ev;
static struct wire_arena *arena;
static bool enabled;
static char status_buf[256];
static uint8_t packbuf[PEER_MSG_MAX];

#define PEER_OUT_MAX (96u << 20)        /* output a peer leaves unread before it is dropped */
#define TICK_MS 100

static void peer_free(struct peer *);
static void on_event(struct bufferevent *, short, void *);
static void on_read(struct bufferevent *, void *);

static const char *
state_name(enum peer_state s)
{
	static const char *n[] = { "connecting", "hello", "auth", "ready", "down" };
	return n[s];
}

/* ---- sending ---- */

int
peer_send(struct peer *p, const Gpxpeer__PeerMsg *m, const void *data, size_t len)
{
	struct evbuffer *out;
	size_t mlen;
	uint8_t hdr[PEER_HDR_LEN];

	if (p->state == PEER_DEAD || p->bev == NULL)
		return -1;
	mlen = gpxpeer__peer_msg__get_packed_size(m);
	if (mlen > PEER_MSG_MAX || len > PEER_DATA_MAX) {
		log_warnx("fabric: message to %s too large (%zu + %zu bytes)", p->addr, mlen, len);
		return -1;
	}
	gpxpeer__peer_msg__pack(m, packbuf);
	for (int i = 0; i < 4; i++) {
		hdr[i] = (uint8_t)(PEER_MAGIC >> (24 - 8 * i));
		hdr[4 + i] = (uint8_t)(mlen >> (24 - 8 * i));
		hdr[8 + i] = (uint8_t)(len >> (24 - 8 * i));
	}
	out = bufferevent_get_output(p->bev);
	if (evbuffer_get_length(out) > PEER_OUT_MAX) {
		peer_kill(p, "it leaves more than %u MiB of our output unread", PEER_OUT_MAX >> 20);
		return -1;
	}
	/*
	 * Room for the whole frame first: without it nothing is queued, and a ready connection
	 * stands (the caller answers its own request ENOMEM); one in its handshake goes.
	 */
	if (evbuffer_expand(out, sizeof(hdr) + mlen + len) < 0) {
		if (p->state != PEER_READY)
			peer_kill(p, "out of memory for its output");
		return p->state == PEER_READY ? -ENOMEM : -1;
	}
	if (evbuffer_add(out, hdr, sizeof(hdr)) < 0 || evbuffer_add(out, packbuf, mlen) < 0 ||
	    (len > 0 && evbuffer_add(out, data, len) < 0)) {
		peer_kill(p, "out of memory for its output");
		return -1;
	}
	p->bytes_tx += sizeof(hdr) + mlen + len;
	p->t_tx = now_s();
	return 0;
}

void
peer_bye(struct peer *p, const char *why)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Bye b = GPXPEER__BYE__INIT;

	b.reason = (char *)why;
	m.body_case = GPXPEER__PEER_MSG__BODY_BYE;
	m.bye = &b;
	/*
	 * One non-blocking attempt to put it on the wire now, since the connection is closed next.
	 * A socket bufferevent keeps the front of its output frozen for its own writes: thawed
	 * for this one.
	 */
	if (peer_send(p, &m, NULL, 0) == 0) {
		struct evbuffer *out = bufferevent_get_output(p->bev);
		evbuffer_unfreeze(out, 1);
		evbuffer_write(out, bufferevent_getfd(p->bev));
		evbuffer_freeze(out, 1);
	}
}

/* ---- lifecycle ---- */

struct peer *
peer_new(struct bufferevent *bev, bool outbound, const char *addr)
{
	struct peer *p = calloc(1, sizeof(*p));

	if (p == NULL)
		return NULL;
	p->bev = bev;
	p->outbound = outbound;
	p->state = outbound ? PEER_CONNECTING : PEER_HELLO;
	snprintf(p->addr, sizeof(p->addr), "%s", addr);
	TAILQ_INIT(&p->handles);
	p->t_start = p->t_rx = p->t_tx = now_s();
	if (getrandom(p->nonce_local, PEER_NONCE_LEN, 0) != PEER_NONCE_LEN) {
		free(p);
		return NULL;
	}
	bufferevent_setcb(bev, on_read, NULL, on_event, p);
	/* libevent 2.1 writes 16 KiB a turn of the loop by default: a 1 MiB chunk took 64 turns. */
	bufferevent_set_max_single_write(bev, PEER_FILL_MAX);
	bufferevent_enable(bev, EV_READ | EV_WRITE);
	TAILQ_INSERT_TAIL(&peers, p, entry);
	return p;
}

/* Marks p dead and lets go of everything that hangs on it; the struct goes at the next tick. */
void
peer_kill(struct peer *p, const char *fmt, ...)
{
	va_list ap;

	if (p->state == PEER_DEAD)
		return;
	va_start(ap, fmt);
	vsnprintf(p->why, sizeof(p->why), fmt, ap);
	va_end(ap);
	if (strcmp(p->why, PEER_DUPLICATE) == 0)
		log_debug("fabric", "closed a duplicate connection with %s (%s)", p->node, p->addr);
	else if (p->target != NULL && p->state != PEER_READY && strcmp(p->why, p->target->why) == 0)
		log_debug("fabric", "%s: still %s", p->addr, p->why);     /* said once already */
	else if (p->state == PEER_READY)
		log_warnx("fabric: peer %s (%s, epoch %08x) down: %s", p->node, p->addr, p->epoch, p->why);
	else if (!p->outbound && p->node[0] == '\0') {
		/* anyone who reaches the port can cause this: a share of the log for all of them */
		static struct logrl unauthenticated;
		log_other(&unauthenticated, LOG_L_INFO, "fabric: connection from %s (unauthenticated) failed: %s",
		    p->addr, p->why);
	} else
		log_info("fabric: connection %s %s (%s) failed: %s", p->outbound ? "to" : "from",
		    p->addr, p->node[0] ? p->node : "unauthenticated", p->why);
	p->state = PEER_DEAD;
	if (p->bev != NULL) {
		bufferevent_disable(p->bev, EV_READ | EV_WRITE);
		bufferevent_free(p->bev);
		p->bev = NULL;
	}
	request_peer_down(p);
	peer_import_down(p);
	TAILQ_REMOVE(&peers, p, entry);
	TAILQ_INSERT_TAIL(&dead, p, entry);
	if (p->target != NULL)
		peer_dial_lost(p);
}

static void
peer_free(struct peer *p)
{
	TAILQ_REMOVE(&dead, p, entry);
	free(p);
}

/* The connection with a node that new work goes through: the older one while there are two
 * (peer-auth.c). */
struct peer *
peer_by_node(const char *name)
{
	struct peer *p, *best = NULL;

	TAILQ_FOREACH(p, &peers, entry)
		if (p->state == PEER_READY && strcmp(p->node, name) == 0 &&
		    (best == NULL || p->t_ready < best->t_ready))
			best = p;
	return best;
}

/* The connection that a handle, an import or a request of that epoch came through, if it still
 * stands. */
struct peer *
peer_by_epoch(const char *name, uint32_t epoch)
{
	struct peer *p;

	TAILQ_FOREACH(p, &peers, entry)
		if (p->state == PEER_READY && p->epoch == epoch && strcmp(p->node, name) == 0)
			return p;
	return NULL;
}

void
peer_node_gone(const char *node, const char *why)
{
	struct peer *p;

	/* From the top each time: a kill moves p to the dead list. */
	for (;;) {
		TAILQ_FOREACH(p, &peers, entry)
			if (strcmp(p->node, node) == 0)
				break;
		if (p == NULL)
			return;
		peer_kill(p, "node %s left the cluster: %s", node, why);
	}
}

bool
peer_node_up(const char *node)
{
	return peer_by_node(node) != NULL;
}

struct phandle *
peer_handle(struct peer *p, uint64_t id)
{
	struct phandle *h;

	if ((uint32_t)(id >> 32) != p->epoch)
		return NULL;
	TAILQ_FOREACH(h, &p->handles, entry)
		if (h->id == id)
			return h;
	return NULL;
}

/* ---- input ---- */

static void
on_ping(struct peer *p, const Gpxpeer__Ping *g)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Ping r = GPXPEER__PING__INIT;

	if (g->pong)
		return;
	r.id = g->id;
	r.pong = true;
	m.body_case = GPXPEER__PEER_MSG__BODY_PING;
	m.ping = &r;
	peer_send(p, &m, NULL, 0);
}

/* One message, with datalen bytes of raw data still in `in`, which must be consumed. */
static void
dispatch(struct peer *p, const Gpxpeer__PeerMsg *m, struct evbuffer *in, size_t datalen)
{
	bool takes_data = m->body_case == GPXPEER__PEER_MSG__BODY_WRITE ||
	    m->body_case == GPXPEER__PEER_MSG__BODY_DONE;

	if (datalen > 0 && !takes_data) {
		peer_kill(p, "data after a message that takes none");
		return;
	}
	if (m->body_case == GPXPEER__PEER_MSG__BODY_BYE) {
		char why[96];
		/* It closes the newer of two connections with us (peer-auth.c): not news for the log. */
		if (m->bye->reason != NULL && strcmp(m->bye->reason, PEER_DUPLICATE) == 0 &&
		    p->state == PEER_READY && peer_by_node(p->node) != p) {
			peer_kill(p, PEER_DUPLICATE);
			return;
		}
		snprintf(why, sizeof(why), "it said bye: %.64s", m->bye->reason ? m->bye->reason : "");
		for (char *s = why; *s; s++)
			if (*s < 0x20 || *s > 0x7e)
				*s = '?';
		peer_kill(p, "%s", why);
		return;
	}
	if (p->state != PEER_READY) {
		peer_auth_msg(p, m);
		return;
	}
	switch (m->body_case) {
	case GPXPEER__PEER_MSG__BODY_PING:
		on_ping(p, m->ping);
		break;
	case GPXPEER__PEER_MSG__BODY_IMPORT_REQ:
		peer_import_req(p, m->import_req);
		break;
	case GPXPEER__PEER_MSG__BODY_IMPORT_REP:
		peer_import_rep(p, m->import_rep);
		break;
	case GPXPEER__PEER_MSG__BODY_RELEASE:
		peer_import_release(p, m->release);
		break;
	case GPXPEER__PEER_MSG__BODY_WRITE:
	case GPXPEER__PEER_MSG__BODY_READ:
	case GPXPEER__PEER_MSG__BODY_NOTIFY:
		p->ops++;
		serve_msg(p, m, in, datalen);
		break;
	case GPXPEER__PEER_MSG__BODY_DONE:
		p->ops++;
		request_done(p, m->done, in, datalen);
		break;
	default:
		peer_kill(p, "unexpected message %d", m->body_case);
	}
}

static uint32_t
be32(const uint8_t *b)
{
	return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

/*
 * Up to want bytes more of a frame, read straight into the input buffer.  libevent 2.1 reads
 * at most 4 KiB a turn of the loop into a bufferevent (EVBUFFER_MAX_READ), which held the tcp
 * transport to about a gigabyte a second: 256 turns for each 1 MiB chunk.  Returns what it
 * read: 0 once the socket has nothing more now (the bufferevent calls again when it has) or
 * is closed (the bufferevent finds that out itself and says so through on_event).
 */
static size_t
fill(struct bufferevent *bev, struct evbuffer *in, size_t want)
{
	struct evbuffer_iovec v[2];
	struct iovec iov[2];

	/* The bufferevent keeps its input's end frozen but while it reads itself. */
	evbuffer_unfreeze(in, 0);
	int n = want > 0 ? evbuffer_reserve_space(in, (ev_ssize_t)want, v, 2) : 0;
	if (n <= 0) {
		evbuffer_freeze(in, 0);
		return 0;
	}
	size_t room = 0;
	for (int i = 0; i < n; i++) {
		if (v[i].iov_len > want - room)
			v[i].iov_len = want - room;
		iov[i] = (struct iovec){ v[i].iov_base, v[i].iov_len };
		room += v[i].iov_len;
	}
	ssize_t r = readv(bufferevent_getfd(bev), iov, n);
	if (r <= 0) {
		evbuffer_commit_space(in, v, 0);
		evbuffer_freeze(in, 0);
		return 0;
	}
	size_t left = (size_t)r;
	for (int i = 0; i < n; i++) {
		v[i].iov_len = left < v[i].iov_len ? left : v[i].iov_len;
		left -= v[i].iov_len;
	}
	evbuffer_commit_space(in, v, n);
	evbuffer_freeze(in, 0);
	return (size_t)r;
}

static void
on_read(struct bufferevent *bev, void *arg)
{
	struct peer *p = arg;
	struct evbuffer *in = bufferevent_get_input(bev);
	size_t budget = PEER_FILL_MAX;     /* read here this turn, beyond what libevent read */

	p->t_rx = now_s();
	while (p->state != PEER_DEAD) {
		uint8_t hdr[PEER_HDR_LEN];
		size_t avail = evbuffer_get_length(in);
		bool authed = p->state == PEER_READY;

		if (avail < PEER_HDR_LEN)
			return;
		evbuffer_copyout(in, hdr, sizeof(hdr));
		uint32_t mlen = be32(hdr + 4), dlen = be32(hdr + 8);
		/* Caps first, before anything is allocated or waited for. */
		if (be32(hdr) != PEER_MAGIC || mlen == 0 || mlen > (authed ? PEER_MSG_MAX : PEER_PREAUTH_MAX) ||
		    dlen > (authed ? PEER_DATA_MAX : 0)) {
			peer_kill(p, "bad frame (magic %08x, %u + %u bytes)", be32(hdr), mlen, dlen);
			return;
		}
		if (avail < PEER_HDR_LEN + (size_t)mlen + dlen) {
			size_t want = PEER_HDR_LEN + (size_t)mlen + dlen - avail, got;
			if ((got = fill(bev, in, want < budget ? want : budget)) == 0)
				return;
			budget -= got;
			continue;
		}
		/* (no memory to make the message contiguous: it is read again at the tick) */
		uint8_t *mb = evbuffer_pullup(in, PEER_HDR_LEN + mlen);
		if (mb == NULL) {
			p->read_again = true;
			return;
		}
		wire_arena_reset(arena);
		Gpxpeer__PeerMsg *m = gpxpeer__peer_msg__unpack(&arena->pa, mlen, mb + PEER_HDR_LEN);
		evbuffer_drain(in, PEER_HDR_LEN + mlen);
		p->bytes_rx += PEER_HDR_LEN + mlen + dlen;
		if (m == NULL) {
			peer_kill(p, "undecodable message (%u bytes)", mlen);
			return;
		}
		size_t before = evbuffer_get_length(in);
		dispatch(p, m, in, dlen);
		/* The handler consumed the data, or the peer is dead and `in` is gone with it. */
		if (p->state != PEER_DEAD && before - evbuffer_get_length(in) != dlen) {
			peer_kill(p, "internal: data of message %d not consumed", m->body_case);
			return;
		}
	}
}

static void
on_event(struct bufferevent *bev, short what, void *arg)
{
	struct peer *p = arg;
	int one = 1;

	if (what & BEV_EVENT_CONNECTED) {
		setsockopt(bufferevent_getfd(bev), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		peer_auth_hello(p);
		return;
	}
	if (what & BEV_EVENT_EOF)
		peer_kill(p, "connection closed by the other side");
	else if ((what & BEV_EVENT_READING) && EVUTIL_SOCKET_ERROR() == ENOMEM)
		/* libevent found no memory for what came and read none of it: again at the tick */
		p->read_again = true;
	else if (what & BEV_EVENT_ERROR)
		peer_kill(p, "%s", evutil_socket_error_to_string(EVUTIL_SOCKET_ERROR()));
}

/* ---- the tick: dialling, keepalive, deadlines, freeing ---- */

static void
on_tick(evutil_socket_t fd, short what, void *arg)
{
	double now = now_s(), to = cfg->fabric_timeout_s;
	struct peer *p, *pt;

	(void)fd;
	(void)what;
	(void)arg;
	peer_dial_tick(now);
	TAILQ_FOREACH_SAFE(p, &peers, entry, pt) {
		if (p->read_again) {
			p->read_again = false;
			bufferevent_enable(p->bev, EV_READ);
			on_read(p->bev, p);
			if (p->state == PEER_DEAD)
				continue;
		}
		if (p->state != PEER_READY) {
			if (now - p->t_start > to)
				peer_kill(p, "no handshake within %.1f s", to);
			continue;
		}
		if (now - p->t_rx > to) {
			peer_kill(p, "silent for %.1f s", now - p->t_rx);
			continue;
		}
		if (now - p->t_tx > to / 3 || now - p->t_rx > to / 3) {
			Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
			Gpxpeer__Ping g = GPXPEER__PING__INIT;
			g.id = (uint64_t)(now * 1e3);
			m.body_case = GPXPEER__PEER_MSG__BODY_PING;
			m.ping = &g;
			peer_send(p, &m, NULL, 0);
		}
	}
	peer_import_tick(now);
	request_tick(now);
	while ((p = TAILQ_FIRST(&dead)) != NULL)
		peer_free(p);
}

/* ---- start, stop, query ---- */

int
peer_start(struct event_base *b)
{
	char err[256];
	const char *listening;
	struct timeval tv = { 0, TICK_MS * 1000 };

	if (cfg->fabric_node != NULL)
		snprintf(peer_self, sizeof(peer_self), "%s", cfg->fabric_node);
	else {
		if (gethostname(peer_self, sizeof(peer_self) - 1) < 0)
			peer_self[0] = '\0';
		peer_self[strcspn(peer_self, ".")] = '\0';     /* the short name */
	}
	if (!export_node_name_ok(peer_self)) {
		log_warnx("fabric: node name '%s' is not 1..64 of [A-Za-z0-9._-]: set [fabric] node",
		    peer_self);
		return -1;
	}
	if (peer_auth_init() < 0)
		return -1;
	if ((arena = wire_arena_new(16 * PEER_MSG_MAX)) == NULL || request_init(b) < 0)
		return -1;
	if (fabric_rdma_init(b, err, sizeof(err)) < 0) {
		log_warnx("fabric: transport = rdma: %s; use transport = tcp or auto", err);
		return -1;
	}
	log_info("fabric: transport %s: %s", cfg->fabric_transport, err);
	if (peer_dial_start(b) < 0)
		return -1;
	listening = peer_dial_listening();
	tick_ev = event_new(b, -1, EV_PERSIST, on_tick, NULL);
	event_add(tick_ev, &tv);
	enabled = true;
	/* dial_on_demand is added when asked: a reload may change it */
	snprintf(status_buf, sizeof(status_buf), "node %s, %s%s, transport %s%s%s", peer_self,
	    listening[0] ? "listening on " : "not listening", listening,
	    fabric_rdma_device() ? "rdma" : "tcp", fabric_rdma_device() ? " on " : "",
	    fabric_rdma_device() ? fabric_rdma_device() : "");
	log_info("fabric: node %s%s%s, transport %s, %s%s", peer_self,
	    listening[0] ? ", listening on " : "", listening, fabric_rdma_device() ? "rdma" : "tcp",
	    cfg->fabric_peers ? cfg->fabric_peers : "no configured peers",
	    cfg->fabric_dial_on_demand ? ", dials on demand" : "");
	return 0;
}

void
peer_stop(void)
{
	struct peer *p;

	if (!enabled)
		return;
	enabled = false;
	while ((p = TAILQ_FIRST(&peers)) != NULL) {
		if (p->state == PEER_READY)
			peer_bye(p, "daemon stopping");
		peer_kill(p, "daemon stopping");
	}
	while ((p = TAILQ_FIRST(&dead)) != NULL)
		peer_free(p);
	peer_import_stop();
	peer_dial_stop();
	request_shutdown();
	fabric_rdma_shutdown();
	if (tick_ev != NULL)
		event_free(tick_ev);
	tick_ev = NULL;
	free(arena);
	arena = NULL;
	peer_auth_forget();
}

const char *
peer_status(void)
{
	static char s[sizeof(status_buf) + 32];

	if (status_buf[0] == '\0')
		return "off";
	snprintf(s, sizeof(s), "%s%s", status_buf, cfg->fabric_dial_on_demand ? ", dials on demand" : "");
	return s;
}

bool
peer_query(Gpx__QueryReply *q)
{
	struct peer *p;
	size_t cap = 1 + peer_dial_count();
	double now = now_s();

	TAILQ_FOREACH(p, &peers, entry)
		cap++;
	q->peers = calloc(cap, sizeof(*q->peers));
	if (q->peers == NULL)
		return false;
	TAILQ_FOREACH(p, &peers, entry) {
		Gpx__PeerInfo *i = malloc(sizeof(*i));
		struct phandle *h;
		if (i == NULL)
			return false;
		gpx__peer_info__init(i);
		i->node = p->node;
		i->address = p->addr;
		i->state = (char *)state_name(p->state);
		i->transport = fabric_rdma_qps(p) > 0 ? "rdma" : "tcp";
		i->queue_pairs = fabric_rdma_qps(p);
		i->registrations = fabric_rdma_regs(p);
		i->outbound = p->outbound;
		i->version = p->version;
		i->epoch = p->epoch;
		i->imports = p->nimports;
		TAILQ_FOREACH(h, &p->handles, entry)
			i->exported++;
		i->bytes_tx = p->bytes_tx;
		i->bytes_rx = p->bytes_rx;
		i->ops = p->ops;
		i->errors = p->errors;
		i->notes_imm_tx = p->notes_imm_tx;
		i->notes_imm_rx = p->notes_imm_rx;
		i->notes_msg_tx = p->notes_msg_tx;
		i->notes_msg_rx = p->notes_msg_rx;
		i->inflight = p->inflight;
		i->connected_s = p->state == PEER_READY ? now - p->t_ready : 0;
		i->why = p->why;
		i->on_demand = p->target != NULL && p->target->on_demand;
		q->peers[q->n_peers++] = i;
	}
	return peer_dial_query(q);
}

void
peer_query_free(Gpx__QueryReply *q)
{
	for (size_t i = 0; i < q->n_peers; i++)
		free(q->peers[i]);
	free(q->peers);
	q->peers = NULL;
	q->n_peers = 0;
}
