/*
 * Peer daemons: the control plane of the fabric.  gpxd listens for other nodes' daemons on
 * [fabric] listen, keeps a connection to each address in [fabric] peers (retrying every
 * retry_interval), and on every connection, before anything else, runs the handshake of
 * proto/peer.proto: version negotiation and a mutual HMAC-SHA256 challenge over both nonces and
 * both node names with the key shared by the nodes.  Only then are imports, Write and Read
 * accepted; the data plane itself is daemon/fabric/request.c.
 *
 * Everything a peer sends is untrusted: frame lengths are capped before anything is read (far
 * lower before authentication), messages unpack into the bounded arena, names are checked
 * against a small alphabet, handles carry the connection's epoch.  A peer that misbehaves loses
 * its connection, with a log line saying why; the daemon never exits because of it.  A peer
 * that says nothing for [fabric] timeout seconds (keepalive pings go out at a third of that) is
 * declared dead, so a vanished node turns into errors within that bound, never a hang.
 *
 * Two daemons that both list each other end up with two connections; once both are
 * authenticated, the one opened by the node with the smaller name is kept on both sides.
 *
 * A client imports "NODE:name" from a ready peer, or "@HOST:PORT/name" (IPv6 as [ADDR]:PORT)
 * from the daemon at an address: the configured peer of that address if there is one, else,
 * only with [fabric] dial_on_demand, a connection dialled then for the import, authenticated
 * exactly like the others.  The import waits for that connection without blocking the loop
 * (a pimport with a target and no peer yet) and fails with the reason as soon as the attempt
 * fails, or after [fabric] timeout.  An address dialled on demand is never redialled by the
 * tick: when its connection is gone it is forgotten, and the next import by address dials it
 * again, so an address that was mistyped or went away costs nothing after its last import.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>

#include "daemon/fabric/internal.h"

/*
 * A peer address: a configured one is dialled until a connection to it is up; one dialled on
 * demand, for imports by address, only when an import asks for it, and forgotten at the next
 * tick once no connection reaches its node and no import waits for it.
 */
struct ptarget {
	TAILQ_ENTRY(ptarget) entry;
	char addr[96];
	char node[PEER_NAME_MAX + 1];    /* learned at the first handshake */
	struct peer *p;                  /* the outbound connection, while there is one */
	bool resolving;
	bool on_demand;
	double t_next;
	char why[160];
};

/* An import a local client asked for, waiting for its peer to be ready or for its answer. */
struct pimport {
	TAILQ_ENTRY(pimport) entry;
	uint64_t id;
	struct peer *p;                  /* asked through this one, NULL while waiting for t */
	struct ptarget *t;               /* the address whose connection it waits for */
	fabric_import_fn done;           /* the asker's answer (conn.c), called once */
	void *arg;
	uid_t uid;                       /* the asker's */
	double deadline;
	char name[65];                   /* the export's name on the peer */
};

struct peer_list peers = TAILQ_HEAD_INITIALIZER(peers);
static struct peer_list dead = TAILQ_HEAD_INITIALIZER(dead);
static TAILQ_HEAD(, ptarget) targets = TAILQ_HEAD_INITIALIZER(targets);
static TAILQ_HEAD(, pimport) pimports = TAILQ_HEAD_INITIALIZER(pimports);
static struct event_base *base;
static struct evconnlistener *listener;
static struct event *tick_ev;
static struct wire_arena *arena;
static uint8_t key[4096];
static size_t keylen;
static char node[PEER_NAME_MAX + 1];
static char listen_addr[96];
static bool enabled;
static uint64_t next_import;
static char status_buf[256];
static uint8_t packbuf[PEER_MSG_MAX];

#define PEER_MAX_HANDLES 65536          /* handles one peer may hold on our exports */
#define PEER_OUT_MAX (96u << 20)        /* output a peer leaves unread before it is dropped */
#define PEER_MAX_ON_DEMAND 64           /* addresses dialled on demand at once */
#define TICK_MS 100

static void peer_free(struct peer *);
static void on_event(struct bufferevent *, short, void *);
static void on_read(struct bufferevent *, void *);
static void import_fail(struct pimport *, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void target_ready(struct ptarget *, struct peer *);
static void target_down(struct ptarget *, const char *why);
static void dial(struct ptarget *);

static const char *
state_name(enum peer_state s)
{
	static const char *n[] = { "connecting", "hello", "auth", "ready", "down" };
	return n[s];
}

/* ---- addresses ---- */

/* "HOST:PORT" or "[V6]:PORT" into host and port; false if malformed. */
static bool
split_addr(const char *a, char *host, size_t hl, char *port, size_t pl)
{
	const char *c;

	if (a[0] == '[') {
		const char *e = strchr(a, ']');
		if (e == NULL || e[1] != ':' || (size_t)(e - a - 1) >= hl)
			return false;
		snprintf(host, hl, "%.*s", (int)(e - a - 1), a + 1);
		c = e + 1;
	} else {
		if ((c = strrchr(a, ':')) == NULL || (size_t)(c - a) >= hl || c == a)
			return false;
		snprintf(host, hl, "%.*s", (int)(c - a), a);
	}
	if (c[1] == '\0' || strlen(c + 1) >= pl || strspn(c + 1, "0123456789") != strlen(c + 1))
		return false;
	snprintf(port, pl, "%s", c + 1);
	return true;
}

static void
fmt_sa(const struct sockaddr *sa, char *buf, size_t len)
{
	char h[INET6_ADDRSTRLEN] = "?";

	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s = (const void *)sa;
		inet_ntop(AF_INET, &s->sin_addr, h, sizeof(h));
		snprintf(buf, len, "%s:%u", h, ntohs(s->sin_port));
	} else if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s = (const void *)sa;
		inet_ntop(AF_INET6, &s->sin6_addr, h, sizeof(h));
		snprintf(buf, len, "[%s]:%u", h, ntohs(s->sin6_port));
	} else
		snprintf(buf, len, "?");
}

/* ---- the key ---- */

/* The key file: owner-only (like an ssh key), at least 16 bytes; trailing newlines dropped. */
static int
load_key(const char *path, char *err, size_t errlen)
{
	struct stat st;
	ssize_t n;
	int fd;

	if ((fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)) < 0) {
		snprintf(err, errlen, "key_file %s: %s", path, strerror(errno));
		return -1;
	}
	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || (st.st_mode & 077) != 0) {
		snprintf(err, errlen, "key_file %s: must be a regular file readable by its owner only "
		    "(chmod 0600)", path);
		close(fd);
		return -1;
	}
	n = read(fd, key, sizeof(key));
	close(fd);
	while (n > 0 && (key[n - 1] == '\n' || key[n - 1] == '\r'))
		n--;
	if (n < 16) {
		snprintf(err, errlen, "key_file %s: shorter than 16 bytes (make one with: head -c 32 "
		    "/dev/urandom | base64 > %s)", path, path);
		return -1;
	}
	keylen = (size_t)n;
	return 0;
}

/*
 * The proof of one side: HMAC(key, label | version | nonce of the connecting side | nonce of
 * the answering side | its node name | the other's node name), names length-prefixed.  The
 * labels differ by direction, so one side's proof is never valid as the other's.
 */
static void
proof(const char *label, uint32_t version, const uint8_t *nonce_i, const uint8_t *nonce_r,
    const char *node_i, const char *node_r, uint8_t out[SHA256_LEN])
{
	struct hmac m;
	uint8_t v[4] = { version >> 24, version >> 16, version >> 8, version };
	uint8_t l;

	hmac_init(&m, key, keylen);
	hmac_update(&m, label, strlen(label) + 1);
	hmac_update(&m, v, 4);
	hmac_update(&m, nonce_i, PEER_NONCE_LEN);
	hmac_update(&m, nonce_r, PEER_NONCE_LEN);
	l = (uint8_t)strlen(node_i);
	hmac_update(&m, &l, 1);
	hmac_update(&m, node_i, l);
	l = (uint8_t)strlen(node_r);
	hmac_update(&m, &l, 1);
	hmac_update(&m, node_r, l);
	hmac_final(&m, out);
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
	if (evbuffer_add(out, hdr, sizeof(hdr)) < 0 || evbuffer_add(out, packbuf, mlen) < 0 ||
	    (len > 0 && evbuffer_add(out, data, len) < 0)) {
		peer_kill(p, "out of memory for its output");
		return -1;
	}
	p->bytes_tx += sizeof(hdr) + mlen + len;
	p->t_tx = now_s();
	return 0;
}

static void
send_bye(struct peer *p, const char *why)
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

static struct peer *
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
	bufferevent_enable(bev, EV_READ | EV_WRITE);
	TAILQ_INSERT_TAIL(&peers, p, entry);
	return p;
}

static void
phandle_drop(struct phandle *h)
{
	struct export *e;

	fabric_rdma_unexport(h);
	TAILQ_FOREACH(e, &exports, entry)
		if (e->r == h->r && e->importers > 0) {
			e->importers--;
			break;
		}
	region_unref(h->r);
	free(h);
}

/* Marks p dead and lets go of everything that hangs on it; the struct goes at the next tick. */
void
peer_kill(struct peer *p, const char *fmt, ...)
{
	struct pimport *pi, *pt;
	struct phandle *h;
	struct ptarget *t;
	struct peer *q;
	va_list ap;

	if (p->state == PEER_DEAD)
		return;
	va_start(ap, fmt);
	vsnprintf(p->why, sizeof(p->why), fmt, ap);
	va_end(ap);
	if (strcmp(p->why, "duplicate connection") == 0)
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
	fabric_peer_down(p);
	TAILQ_FOREACH_SAFE(pi, &pimports, entry, pt)
		if (pi->p == p)
			import_fail(pi, GPX__STATUS__EIO, "peer %s went down during the import: %s", p->node,
			    p->why);
	while ((h = TAILQ_FIRST(&p->handles)) != NULL) {
		TAILQ_REMOVE(&p->handles, h, entry);
		phandle_drop(h);
	}
	TAILQ_REMOVE(&peers, p, entry);
	TAILQ_INSERT_TAIL(&dead, p, entry);
	if ((t = p->target) != NULL) {
		snprintf(t->why, sizeof(t->why), "%s", p->why);
		t->p = NULL;
		t->t_next = now_s() + cfg->fabric_retry_s;
		p->target = NULL;
		/* Lost to the node's other connection as a duplicate: that one serves the imports
		 * that waited for this one. */
		if (p->node[0] != '\0' && (q = peer_by_node(p->node)) != NULL)
			target_ready(t, q);
		else
			target_down(t, p->why);
	}
}

static void
peer_free(struct peer *p)
{
	TAILQ_REMOVE(&dead, p, entry);
	free(p);
}

struct peer *
peer_by_node(const char *name)
{
	struct peer *p;

	TAILQ_FOREACH(p, &peers, entry)
		if (p->state == PEER_READY && strcmp(p->node, name) == 0)
			return p;
	return NULL;
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

/* ---- the handshake ---- */

static void
send_hello(struct peer *p)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Hello h = GPXPEER__HELLO__INIT;

	h.version_min = PEER_PROTO_MIN;
	h.version_max = PEER_PROTO_MAX;
	h.node = node;
	h.nonce.data = p->nonce_local;
	h.nonce.len = PEER_NONCE_LEN;
	m.body_case = GPXPEER__PEER_MSG__BODY_HELLO;
	m.hello = &h;
	p->state = PEER_HELLO;
	peer_send(p, &m, NULL, 0);
}

/* Which of two connections between the same two nodes both sides keep: the one opened by the
 * smaller node name (the older one if the same side opened both). */
static bool
keeps(const struct peer *a, const struct peer *b)
{
	const char *ia = a->outbound ? node : a->node, *ib = b->outbound ? node : b->node;
	int c = strcmp(ia, ib);

	return c != 0 ? c < 0 : a->t_ready <= b->t_ready;
}

static void
become_ready(struct peer *p)
{
	struct peer *q;

	p->state = PEER_READY;
	p->t_ready = now_s();
	if (p->target != NULL) {
		snprintf(p->target->node, sizeof(p->target->node), "%s", p->node);
		p->target->why[0] = '\0';
	}
	TAILQ_FOREACH(q, &peers, entry)
		if (q != p && q->state == PEER_READY && strcmp(q->node, p->node) == 0)
			break;
	if (q != NULL) {
		struct peer *loser = keeps(p, q) ? q : p;
		log_info("fabric: two connections with %s: keeping the one opened by %s", p->node,
		    loser == p ? (q->outbound ? node : q->node) : (p->outbound ? node : p->node));
		peer_kill(loser, "duplicate connection");
		if (loser == p)
			return;
	}
	log_info("fabric: peer %s (%s, %s) ready: protocol %u, epoch %08x, transport %s", p->node,
	    p->addr, p->target && p->target->on_demand ? "dialled on demand" : p->outbound ? "outbound" :
	    "inbound", p->version, p->epoch,
	    fabric_rdma_device() ? "tcp until its rdma queue pairs connect" : "tcp");
	if (p->target != NULL)
		target_ready(p->target, p);
}

static void
on_hello(struct peer *p, const Gpxpeer__Hello *h)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Challenge c = GPXPEER__CHALLENGE__INIT;
	uint8_t mac[SHA256_LEN];
	uint32_t v = h->version_max < PEER_PROTO_MAX ? h->version_max : PEER_PROTO_MAX;

	if (p->outbound || p->state != PEER_HELLO) {
		peer_kill(p, "unexpected Hello");
		return;
	}
	if (v < PEER_PROTO_MIN || v < h->version_min) {
		char why[96];
		snprintf(why, sizeof(why), "no common protocol version (it speaks %u..%u, we %u..%u)",
		    h->version_min, h->version_max, PEER_PROTO_MIN, PEER_PROTO_MAX);
		send_bye(p, why);
		peer_kill(p, "%s", why);
		return;
	}
	if (!export_node_name_ok(h->node) || h->nonce.len != PEER_NONCE_LEN) {
		peer_kill(p, "malformed Hello");
		return;
	}
	if (strcmp(h->node, node) == 0) {
		send_bye(p, "same node name as ours");
		peer_kill(p, "it calls itself %s, our own node name", node);
		return;
	}
	snprintf(p->node, sizeof(p->node), "%s", h->node);
	memcpy(p->nonce_remote, h->nonce.data, PEER_NONCE_LEN);
	p->version = v;
	proof("gpx-peer-responder", v, p->nonce_remote, p->nonce_local, p->node, node, mac);
	c.version = v;
	c.node = node;
	c.nonce.data = p->nonce_local;
	c.nonce.len = PEER_NONCE_LEN;
	c.mac.data = mac;
	c.mac.len = sizeof(mac);
	m.body_case = GPXPEER__PEER_MSG__BODY_CHALLENGE;
	m.challenge = &c;
	p->state = PEER_AUTH;
	peer_send(p, &m, NULL, 0);
}

static void
on_challenge(struct peer *p, const Gpxpeer__Challenge *c)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Auth a = GPXPEER__AUTH__INIT;
	uint8_t mac[SHA256_LEN];

	if (!p->outbound || p->state != PEER_HELLO) {
		peer_kill(p, "unexpected Challenge");
		return;
	}
	if (c->version < PEER_PROTO_MIN || c->version > PEER_PROTO_MAX || !export_node_name_ok(c->node) ||
	    c->nonce.len != PEER_NONCE_LEN || c->mac.len != SHA256_LEN) {
		peer_kill(p, "malformed Challenge (version %u)", c->version);
		return;
	}
	proof("gpx-peer-responder", c->version, p->nonce_local, c->nonce.data, node, c->node, mac);
	if (!hmac_equal(mac, c->mac.data, SHA256_LEN)) {
		send_bye(p, "authentication failed: the proof in Challenge does not match our key");
		peer_kill(p, "authentication failed: %s does not hold our key", c->node);
		return;
	}
	if (strcmp(c->node, node) == 0) {
		peer_kill(p, "it has our own node name %s", node);
		return;
	}
	snprintf(p->node, sizeof(p->node), "%s", c->node);
	/* The address is known to be this node now: no redialling it while a connection is up. */
	if (p->target != NULL)
		snprintf(p->target->node, sizeof(p->target->node), "%s", p->node);
	memcpy(p->nonce_remote, c->nonce.data, PEER_NONCE_LEN);
	p->version = c->version;
	proof("gpx-peer-initiator", c->version, p->nonce_local, p->nonce_remote, node, p->node, mac);
	a.mac.data = mac;
	a.mac.len = sizeof(mac);
	m.body_case = GPXPEER__PEER_MSG__BODY_AUTH;
	m.auth = &a;
	p->state = PEER_AUTH;
	peer_send(p, &m, NULL, 0);
}

static void
on_auth(struct peer *p, const Gpxpeer__Auth *a)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Ready r = GPXPEER__READY__INIT;
	uint8_t mac[SHA256_LEN], token[FABRIC_RDMA_TOKEN];
	uint32_t rport;
	struct peer_rdev devs[FABRIC_RDMA_DEVS];
	Gpxpeer__RdmaDev rd[FABRIC_RDMA_DEVS], *rdp[FABRIC_RDMA_DEVS];
	size_t ndevs = 0;

	if (p->outbound || p->state != PEER_AUTH) {
		peer_kill(p, "unexpected Auth");
		return;
	}
	proof("gpx-peer-initiator", p->version, p->nonce_remote, p->nonce_local, p->node, node, mac);
	if (a->mac.len != SHA256_LEN || !hmac_equal(mac, a->mac.data, SHA256_LEN)) {
		send_bye(p, "authentication failed");
		peer_kill(p, "authentication failed: it does not hold our key");
		return;
	}
	do {
		if (getrandom(&p->epoch, sizeof(p->epoch), 0) != sizeof(p->epoch))
			p->epoch = (uint32_t)(now_s() * 1e6);
	} while (p->epoch == 0);
	r.epoch = p->epoch;
	r.transport = "tcp";
	if (fabric_rdma_offer(p, &rport, token, devs, &ndevs)) {
		r.transport = "rdma";
		r.rdma_port = rport;
		r.rdma_token.data = token;
		r.rdma_token.len = sizeof(token);
		for (size_t i = 0; i < ndevs; i++) {
			gpxpeer__rdma_dev__init(&rd[i]);
			rd[i].index = devs[i].index;
			rd[i].addr = devs[i].addr;
			rdp[i] = &rd[i];
		}
		r.n_rdma_devs = ndevs;
		r.rdma_devs = rdp;
	}
	m.body_case = GPXPEER__PEER_MSG__BODY_READY;
	m.ready = &r;
	peer_send(p, &m, NULL, 0);
	become_ready(p);
}

static void
on_ready(struct peer *p, const Gpxpeer__Ready *r)
{
	if (!p->outbound || p->state != PEER_AUTH || r->epoch == 0) {
		peer_kill(p, "unexpected Ready");
		return;
	}
	struct peer_rdev devs[FABRIC_RDMA_DEVS];
	size_t ndevs = 0;

	p->epoch = r->epoch;
	become_ready(p);
	/* The devices it offers, as far as they make sense (an address we fail to read is left out). */
	for (size_t i = 0; i < r->n_rdma_devs && ndevs < FABRIC_RDMA_DEVS; i++)
		if (r->rdma_devs[i]->index < FABRIC_RDMA_DEVS && r->rdma_devs[i]->addr != NULL &&
		    strlen(r->rdma_devs[i]->addr) < sizeof(devs[0].addr)) {
			devs[ndevs].index = r->rdma_devs[i]->index;
			snprintf(devs[ndevs].addr, sizeof(devs[0].addr), "%s", r->rdma_devs[i]->addr);
			ndevs++;
		}
	if (p->state == PEER_READY)
		fabric_rdma_connect(p, r->rdma_port, r->rdma_token.data, r->rdma_token.len, devs, ndevs);
}

/* ---- imports: serving side ---- */

static void
on_import_req(struct peer *p, const Gpxpeer__ImportReq *q)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__ImportRep rep = GPXPEER__IMPORT_REP__INIT;
	struct export *e = q->name != NULL && export_name_ok(q->name) ? export_find(q->name) : NULL;
	uint32_t n = 0, rkeys[FABRIC_RDMA_DEVS] = { 0 };
	struct phandle *h;
	char msg[256] = "";

	TAILQ_FOREACH(h, &p->handles, entry)
		n++;
	rep.id = q->id;
	if (e == NULL) {
		rep.status = GPX__STATUS__ENOENT;
		snprintf(msg, sizeof(msg), "no export of that name on %s", node);
	} else if (!export_admits_peer(e, p->node)) {
		rep.status = GPX__STATUS__EACCES;
		snprintf(msg, sizeof(msg), "export %s on %s is not open to peer %s", e->name, node, p->node);
		log_info("fabric: peer %s: import of %s refused by the export's remote rule", p->node, e->name);
	} else if (atomic_load(&e->r->revoked)) {
		rep.status = GPX__STATUS__EREVOKED;
		snprintf(msg, sizeof(msg), "export %s was withdrawn", e->name);
	} else if (n >= PEER_MAX_HANDLES || (h = calloc(1, sizeof(*h))) == NULL) {
		rep.status = GPX__STATUS__EQUOTA;
		snprintf(msg, sizeof(msg), "peer %s holds too many imports", p->node);
	} else {
		h->id = (uint64_t)p->epoch << 32 | ++p->next_serial;
		h->r = e->r;
		region_ref(e->r);
		h->read_only = e->read_only;
		snprintf(h->export_name, sizeof(h->export_name), "%s", e->name);
		TAILQ_INSERT_TAIL(&p->handles, h, entry);
		e->importers++;
		rep.handle = h->id;
		rep.length = e->r->length;
		rep.read_only = h->read_only;
		rep.notify = e->notify;
		rep.rdma = fabric_rdma_export(p, h, &rep.rdma_addr, rkeys);
		rep.rdma_rkey = rkeys[0];
		rep.n_rdma_rkeys = rep.rdma ? FABRIC_RDMA_DEVS : 0;
		rep.rdma_rkeys = rkeys;
		log_debug("fabric", "peer %s imports %s as %#llx", p->node, e->name, (unsigned long long)h->id);
	}
	rep.message = msg;
	m.body_case = GPXPEER__PEER_MSG__BODY_IMPORT_REP;
	m.import_rep = &rep;
	peer_send(p, &m, NULL, 0);
}

static void
on_release(struct peer *p, const Gpxpeer__Release *r)
{
	struct phandle *h;

	/*
	 * The peer's last note for this handle went by RDMA and completed before it let go of
	 * the import, but it may still wait in our completion queue while this message, which
	 * took the other road, is already here: the notes first, then the handle goes.
	 */
	if (p->rdma != NULL) {
		fabric_rdma_drain();
		if (p->state != PEER_READY)
			return;
	}
	if ((h = peer_handle(p, r->handle)) == NULL)
		return;          /* released twice or from an older epoch: nothing to do */
	TAILQ_REMOVE(&p->handles, h, entry);
	phandle_drop(h);
}

/* ---- imports: asking side ---- */

/* A waiting import of export `name` for the asker rq; NULL (and rq answered) without memory. */
static struct pimport *
import_new(const struct fabric_import *rq, const char *name)
{
	struct pimport *pi = calloc(1, sizeof(*pi));

	if (pi == NULL) {
		rq->done(rq->arg, GPX__STATUS__ENOMEM, "out of memory", NULL, false);
		return NULL;
	}
	pi->id = ++next_import;
	pi->done = rq->done;
	pi->arg = rq->arg;
	pi->uid = rq->uid;
	pi->deadline = now_s() + cfg->fabric_timeout_s;
	snprintf(pi->name, sizeof(pi->name), "%s", name);
	TAILQ_INSERT_TAIL(&pimports, pi, entry);
	return pi;
}

/* Asks ready peer p for the export; its answer is due within the timeout. */
static void
import_send(struct pimport *pi, struct peer *p)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__ImportReq q = GPXPEER__IMPORT_REQ__INIT;

	pi->p = p;
	pi->t = NULL;
	pi->deadline = now_s() + cfg->fabric_timeout_s;
	q.id = pi->id;
	q.name = pi->name;
	m.body_case = GPXPEER__PEER_MSG__BODY_IMPORT_REQ;
	m.import_req = &q;
	peer_send(p, &m, NULL, 0);
}

/* Answers an import no longer on the list, and forgets it. */
static void
import_answer(struct pimport *pi, int status, const char *msg, struct region *r, bool read_only)
{
	pi->done(pi->arg, status, msg, r, read_only);
	free(pi);
}

/* Answers an import with an error and forgets it. */
static void
import_fail(struct pimport *pi, int status, const char *fmt, ...)
{
	char err[320];
	va_list ap;

	TAILQ_REMOVE(&pimports, pi, entry);
	va_start(ap, fmt);
	vsnprintf(err, sizeof(err), fmt, ap);
	va_end(ap);
	import_answer(pi, status, err, NULL, false);
}

/* The connection for t is ready, p or the node's one kept instead: its waiting imports go out. */
static void
target_ready(struct ptarget *t, struct peer *p)
{
	struct pimport *pi;

	for (;;) {
		/* From the top each time: a failed send kills p, which rewrites the list. */
		TAILQ_FOREACH(pi, &pimports, entry)
			if (pi->t == t)
				break;
		if (pi == NULL)
			return;
		if (p->state != PEER_READY)
			import_fail(pi, GPX__STATUS__EIO, "peer %s went down: %s", p->node, p->why);
		else
			import_send(pi, p);
	}
}

/* The attempt to reach t failed: the imports waiting for it fail now, with the reason. */
static void
target_down(struct ptarget *t, const char *why)
{
	int st = strstr(why, "authentication failed") ? GPX__STATUS__EACCES : GPX__STATUS__EIO;
	struct pimport *pi, *pt;

	TAILQ_FOREACH_SAFE(pi, &pimports, entry, pt)
		if (pi->t == t)
			import_fail(pi, st, "peer at %s not reached: %s", t->addr, why);
}

static bool
target_waited_for(const struct ptarget *t)
{
	struct pimport *pi;

	TAILQ_FOREACH(pi, &pimports, entry)
		if (pi->t == t)
			return true;
	return false;
}

/* Addresses as clients may write them: what getaddrinfo takes, printable in logs and JSON. */
static bool
addr_chars_ok(const char *a)
{
	return strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%") ==
	    strlen(a);
}

/*
 * "@HOST:PORT/name", a past the '@': through the configured peer at that address, else one
 * dialled now if dial_on_demand allows it; the import waits for it (see the top of the file).
 */
static void
import_by_addr(const struct fabric_import *rq, const char *a)
{
	const char *slash = strchr(a, '/');
	char addr[96], host[80], port[16];
	struct ptarget *t;
	struct pimport *pi;
	struct peer *p;
	unsigned n = 0;

	if (slash != NULL && (size_t)(slash - a) < sizeof(addr))
		snprintf(addr, sizeof(addr), "%.*s", (int)(slash - a), a);
	if (slash == NULL || (size_t)(slash - a) >= sizeof(addr) || !addr_chars_ok(addr) ||
	    !split_addr(addr, host, sizeof(host), port, sizeof(port)) || host[0] == '\0' ||
	    strtoul(port, NULL, 10) - 1 >= 65535) {
		rq->done(rq->arg, GPX__STATUS__EINVAL, "an import by address is @HOST:PORT/name or "
		    "@[IPV6]:PORT/name", NULL, false);
		return;
	}
	if (!export_name_ok(slash + 1)) {
		rq->done(rq->arg, GPX__STATUS__EINVAL, "export names are 1..64 bytes of [A-Za-z0-9._:/-]",
		    NULL, false);
		return;
	}
	TAILQ_FOREACH(t, &targets, entry) {
		if (strcasecmp(t->addr, addr) == 0)
			break;
		n += t->on_demand;
	}
	if (t == NULL) {
		char err[256];
		/*
		 * Off by default: it lets any local client make the daemon open connections to any
		 * address it can reach, and learn from the errors which of them listen.
		 */
		if (!cfg->fabric_dial_on_demand) {
			snprintf(err, sizeof(err), "%s is not a configured peer, and [fabric] dial_on_demand "
			    "is off", addr);
			rq->done(rq->arg, GPX__STATUS__EACCES, err, NULL, false);
			return;
		}
		if (n >= PEER_MAX_ON_DEMAND) {
			snprintf(err, sizeof(err), "%u addresses are being dialled on demand already",
			    PEER_MAX_ON_DEMAND);
			rq->done(rq->arg, GPX__STATUS__EQUOTA, err, NULL, false);
			return;
		}
		if ((t = calloc(1, sizeof(*t))) == NULL) {
			rq->done(rq->arg, GPX__STATUS__ENOMEM, "out of memory", NULL, false);
			return;
		}
		t->on_demand = true;
		snprintf(t->addr, sizeof(t->addr), "%s", addr);
		TAILQ_INSERT_TAIL(&targets, t, entry);
	}
	if ((pi = import_new(rq, slash + 1)) == NULL)
		return;          /* a fresh target with no import is forgotten at the next tick */
	if (t->node[0] != '\0' && (p = peer_by_node(t->node)) != NULL) {
		import_send(pi, p);
		return;
	}
	pi->t = t;
	if (t->p == NULL && !t->resolving) {
		if (t->on_demand)
			log_client(rq->log_as, LOG_L_INFO, "fabric: dialling %s on demand, for an import by uid %u",
			    addr, (unsigned)rq->uid);
		dial(t);
	}
}

bool
peer_import(const struct fabric_import *rq)
{
	const char *name = rq->name, *colon = strchr(name, ':');
	char n[PEER_NAME_MAX + 1], err[256];
	struct pimport *pi;
	struct peer *p;

	/* '@' is in neither node nor export names: "@..." is an address, never NODE:name. */
	if (name[0] == '@') {
		import_by_addr(rq, name + 1);
		return true;
	}
	if (!enabled || colon == NULL || colon == name || colon - name > PEER_NAME_MAX)
		return false;
	snprintf(n, sizeof(n), "%.*s", (int)(colon - name), name);
	if (!export_node_name_ok(n) || strcmp(n, node) == 0)
		return false;
	if ((p = peer_by_node(n)) == NULL) {
		snprintf(err, sizeof(err), "no local export %s, and no connected peer named %s", name, n);
		rq->done(rq->arg, GPX__STATUS__ENOENT, err, NULL, false);
		return true;
	}
	if (!export_name_ok(colon + 1)) {
		rq->done(rq->arg, GPX__STATUS__EINVAL, "export names are 1..64 bytes of [A-Za-z0-9._:/-]",
		    NULL, false);
		return true;
	}
	if ((pi = import_new(rq, colon + 1)) != NULL)
		import_send(pi, p);
	return true;
}

static void
release_handle(struct peer *p, uint64_t handle)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Release r = GPXPEER__RELEASE__INIT;

	r.handle = handle;
	m.body_case = GPXPEER__PEER_MSG__BODY_RELEASE;
	m.release = &r;
	peer_send(p, &m, NULL, 0);
}

static void
on_import_rep(struct peer *p, const Gpxpeer__ImportRep *rep)
{
	struct pimport *pi;
	char err[256];

	TAILQ_FOREACH(pi, &pimports, entry)
		if (pi->p == p && pi->id == rep->id)
			break;
	if (pi == NULL) {
		peer_kill(p, "answer to an import it was not asked for");
		return;
	}
	TAILQ_REMOVE(&pimports, pi, entry);
	if (rep->status == 0 && ((uint32_t)(rep->handle >> 32) != p->epoch || rep->length == 0)) {
		peer_kill(p, "malformed import answer");
		import_answer(pi, GPX__STATUS__EIO, "the peer answered the import with nonsense", NULL, false);
		return;
	}
	if (rep->status != 0) {
		int st = rep->status <= GPX__STATUS__EPERM ? (int)rep->status : GPX__STATUS__EPROTO;
		snprintf(err, sizeof(err), "%s: %s", p->node,
		    rep->message && rep->message[0] ? rep->message : "import refused");
		for (char *s = err; *s; s++)
			if (*s < 0x20 || *s > 0x7e)
				*s = '?';
		import_answer(pi, st, err, NULL, false);
		return;
	}
	/* An asker gone meanwhile drops the region at once, which sends the Release. */
	struct region *r = fabric_remote_region(p, rep->handle, rep->length, rep->read_only);
	if (r == NULL) {
		release_handle(p, rep->handle);
		import_answer(pi, GPX__STATUS__ENOMEM, "out of memory", NULL, false);
		return;
	}
	if (rep->notify)
		((struct remote *)r->priv)->notify = true;
	if (rep->rdma) {
		/* Trusted no further than its NIC: the registration bounds what the key reaches. */
		((struct remote *)r->priv)->rdma = true;
		struct remote *rm = r->priv;
		rm->raddr = rep->rdma_addr;
		/* A peer that sends one key has one device: it is the key at every queue pair's end. */
		rm->rkeys[0] = rep->rdma_rkey;
		for (size_t i = 0; i < rep->n_rdma_rkeys && i < FABRIC_RDMA_DEVS; i++)
			rm->rkeys[i] = rep->rdma_rkeys[i];
	}
	r->uid = pi->uid;
	import_answer(pi, 0, NULL, r, rep->read_only);
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
		snprintf(why, sizeof(why), "it said bye: %.64s", m->bye->reason ? m->bye->reason : "");
		for (char *s = why; *s; s++)
			if (*s < 0x20 || *s > 0x7e)
				*s = '?';
		peer_kill(p, "%s", why);
		return;
	}
	if (p->state != PEER_READY) {
		switch (m->body_case) {
		case GPXPEER__PEER_MSG__BODY_HELLO:
			on_hello(p, m->hello);
			break;
		case GPXPEER__PEER_MSG__BODY_CHALLENGE:
			on_challenge(p, m->challenge);
			break;
		case GPXPEER__PEER_MSG__BODY_AUTH:
			on_auth(p, m->auth);
			break;
		case GPXPEER__PEER_MSG__BODY_READY:
			on_ready(p, m->ready);
			break;
		default:
			peer_kill(p, "message %d before authentication", m->body_case);
		}
		return;
	}
	switch (m->body_case) {
	case GPXPEER__PEER_MSG__BODY_PING:
		on_ping(p, m->ping);
		break;
	case GPXPEER__PEER_MSG__BODY_IMPORT_REQ:
		on_import_req(p, m->import_req);
		break;
	case GPXPEER__PEER_MSG__BODY_IMPORT_REP:
		on_import_rep(p, m->import_rep);
		break;
	case GPXPEER__PEER_MSG__BODY_RELEASE:
		on_release(p, m->release);
		break;
	case GPXPEER__PEER_MSG__BODY_WRITE:
	case GPXPEER__PEER_MSG__BODY_READ:
	case GPXPEER__PEER_MSG__BODY_NOTIFY:
	case GPXPEER__PEER_MSG__BODY_DONE:
		p->ops++;
		fabric_on_msg(p, m, in, datalen);
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

static void
on_read(struct bufferevent *bev, void *arg)
{
	struct peer *p = arg;
	struct evbuffer *in = bufferevent_get_input(bev);

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
			/* Wake up again only once the whole frame is here. */
			bufferevent_setwatermark(bev, EV_READ, PEER_HDR_LEN + (size_t)mlen + dlen, 0);
			return;
		}
		bufferevent_setwatermark(bev, EV_READ, 0, 0);
		evbuffer_drain(in, PEER_HDR_LEN);
		uint8_t *mb = evbuffer_pullup(in, mlen);
		wire_arena_reset(arena);
		Gpxpeer__PeerMsg *m = mb ? gpxpeer__peer_msg__unpack(&arena->pa, mlen, mb) : NULL;
		evbuffer_drain(in, mlen);
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
		send_hello(p);
		return;
	}
	if (what & BEV_EVENT_EOF)
		peer_kill(p, "connection closed by the other side");
	else if (what & BEV_EVENT_ERROR)
		peer_kill(p, "%s", evutil_socket_error_to_string(EVUTIL_SOCKET_ERROR()));
}

/* ---- accepting and dialling ---- */

static void
on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int salen, void *arg)
{
	char addr[96];
	int one = 1;

	(void)l;
	(void)salen;
	(void)arg;
	fmt_sa(sa, addr, sizeof(addr));
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	struct bufferevent *bev = bufferevent_socket_new(base, fd, BEV_OPT_CLOSE_ON_FREE);
	if (bev == NULL) {
		close(fd);
		return;
	}
	if (peer_new(bev, false, addr) == NULL) {
		bufferevent_free(bev);
		return;
	}
	log_debug("fabric", "connection from %s", addr);
}

struct resolve_op {
	struct ptarget *t;
	struct sockaddr_storage ss;
	socklen_t sslen;
	char err[128];
};

/* Task thread: name resolution may block. */
static void
resolve_work(void *arg)
{
	struct resolve_op *op = arg;
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *res;
	char host[80], port[16];
	int e;

	op->sslen = 0;
	if (!split_addr(op->t->addr, host, sizeof(host), port, sizeof(port))) {
		snprintf(op->err, sizeof(op->err), "not HOST:PORT");
		return;
	}
	if ((e = getaddrinfo(host, port, &hints, &res)) != 0) {
		snprintf(op->err, sizeof(op->err), "%s", gai_strerror(e));
		return;
	}
	memcpy(&op->ss, res->ai_addr, res->ai_addrlen);
	op->sslen = res->ai_addrlen;
	freeaddrinfo(res);
}

static void
resolve_done(void *arg)
{
	struct resolve_op *op = arg;
	struct ptarget *t = op->t;

	t->resolving = false;
	if (!enabled) {
		free(op);
		return;
	}
	if (op->sslen == 0) {
		snprintf(t->why, sizeof(t->why), "cannot resolve: %s", op->err);
		t->t_next = now_s() + cfg->fabric_retry_s;
		free(op);
		target_down(t, t->why);
		return;
	}
	struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
	struct peer *p = bev ? peer_new(bev, true, t->addr) : NULL;
	if (p == NULL) {
		if (bev != NULL)
			bufferevent_free(bev);
		snprintf(t->why, sizeof(t->why), "out of memory");
		t->t_next = now_s() + cfg->fabric_retry_s;
		free(op);
		target_down(t, t->why);
		return;
	}
	p->target = t;
	t->p = p;
	if (bufferevent_socket_connect(bev, (struct sockaddr *)&op->ss, (int)op->sslen) < 0)
		peer_kill(p, "connect: %s", strerror(errno));
	free(op);
}

static void
dial(struct ptarget *t)
{
	struct resolve_op *op = calloc(1, sizeof(*op));

	if (op == NULL)
		return;
	op->t = t;
	t->resolving = true;
	defer_run(resolve_work, resolve_done, op);
}

/* ---- the tick: dialling, keepalive, deadlines, freeing ---- */

static void
on_tick(evutil_socket_t fd, short what, void *arg)
{
	double now = now_s(), to = cfg->fabric_timeout_s;
	struct ptarget *t, *tt;
	struct peer *p, *pt;
	struct pimport *pi, *pit;

	(void)fd;
	(void)what;
	(void)arg;
	TAILQ_FOREACH_SAFE(t, &targets, entry, tt) {
		bool up = t->p != NULL || t->resolving ||
		    (t->node[0] != '\0' && peer_by_node(t->node) != NULL);
		if (!t->on_demand && !up && now >= t->t_next)
			dial(t);
		else if (t->on_demand && !up && !target_waited_for(t)) {
			/* Gone, and no import asks for it: the next import by address dials again. */
			log_debug("fabric", "%s, dialled on demand, is forgotten%s%s", t->addr,
			    t->why[0] ? ": " : "", t->why);
			TAILQ_REMOVE(&targets, t, entry);
			free(t);
		}
	}
	TAILQ_FOREACH_SAFE(p, &peers, entry, pt) {
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
	TAILQ_FOREACH_SAFE(pi, &pimports, entry, pit) {
		if (now <= pi->deadline)
			continue;
		if (pi->p == NULL) {
			t = pi->t;
			import_fail(pi, GPX__STATUS__EIO, "peer at %s not ready within %.1f s: %s", t->addr,
			    to, t->resolving ? "its name is not resolved yet" : t->p == NULL ? "not connected" :
			    t->p->state == PEER_CONNECTING ? "no TCP connection" : "no answer to the handshake");
			continue;
		}
		peer_kill(pi->p, "no answer to an import within %.1f s", to);
		break;      /* the kill rewrote the list */
	}
	fabric_tick(now);
	while ((p = TAILQ_FIRST(&dead)) != NULL)
		peer_free(p);
}

/* ---- start, stop, query ---- */

int
peer_start(struct event_base *b)
{
	char err[256], host[80], port[16];
	struct timeval tv = { 0, TICK_MS * 1000 };

	base = b;
	if (cfg->fabric_node != NULL)
		snprintf(node, sizeof(node), "%s", cfg->fabric_node);
	else {
		if (gethostname(node, sizeof(node) - 1) < 0)
			node[0] = '\0';
		node[strcspn(node, ".")] = '\0';     /* the short name */
	}
	if (!export_node_name_ok(node)) {
		log_warnx("fabric: node name '%s' is not 1..64 of [A-Za-z0-9._-]: set [fabric] node", node);
		return -1;
	}
	if (cfg->fabric_key_file == NULL) {
		log_warnx("fabric: [fabric] key_file is required: peers authenticate with it");
		return -1;
	}
	if (load_key(cfg->fabric_key_file, err, sizeof(err)) < 0) {
		log_warnx("fabric: %s", err);
		return -1;
	}
	if ((arena = wire_arena_new(16 * PEER_MSG_MAX)) == NULL || request_init(b) < 0)
		return -1;
	if (fabric_rdma_init(b, err, sizeof(err)) < 0) {
		log_warnx("fabric: transport = rdma: %s; use transport = tcp or auto", err);
		return -1;
	}
	log_info("fabric: transport %s: %s", cfg->fabric_transport, err);
	if (cfg->fabric_listen != NULL) {
		struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, *res;
		int e;
		if (!split_addr(cfg->fabric_listen, host, sizeof(host), port, sizeof(port))) {
			log_warnx("fabric: listen = %s: not ADDR:PORT", cfg->fabric_listen);
			return -1;
		}
		if ((e = getaddrinfo(host, port, &hints, &res)) != 0) {
			log_warnx("fabric: listen = %s: %s", cfg->fabric_listen, gai_strerror(e));
			return -1;
		}
		listener = evconnlistener_new_bind(b, on_accept, NULL,
		    LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC, 64,
		    res->ai_addr, (int)res->ai_addrlen);
		freeaddrinfo(res);
		if (listener == NULL) {
			log_warn("fabric: listen on %s", cfg->fabric_listen);
			return -1;
		}
		snprintf(listen_addr, sizeof(listen_addr), "%s", cfg->fabric_listen);
	}
	for (const char *s = cfg->fabric_peers ? cfg->fabric_peers : ""; *s;) {
		size_t k = strcspn(s, ", ");
		if (k > 0) {
			struct ptarget *t = calloc(1, sizeof(*t));
			if (t == NULL || k >= sizeof(t->addr) ||
			    (snprintf(t->addr, sizeof(t->addr), "%.*s", (int)k, s),
			     !split_addr(t->addr, host, sizeof(host), port, sizeof(port)))) {
				log_warnx("fabric: peers: '%.*s' is not HOST:PORT", (int)k, s);
				free(t);
				return -1;
			}
			TAILQ_INSERT_TAIL(&targets, t, entry);
		}
		s += k;
		s += strspn(s, ", ");
	}
	tick_ev = event_new(b, -1, EV_PERSIST, on_tick, NULL);
	event_add(tick_ev, &tv);
	enabled = true;
	snprintf(status_buf, sizeof(status_buf), "node %s, %s%s, transport %s%s%s%s", node,
	    listen_addr[0] ? "listening on " : "not listening", listen_addr,
	    fabric_rdma_device() ? "rdma" : "tcp", fabric_rdma_device() ? " on " : "",
	    fabric_rdma_device() ? fabric_rdma_device() : "",
	    cfg->fabric_dial_on_demand ? ", dials on demand" : "");
	log_info("fabric: node %s%s%s, transport %s, %s%s", node, listen_addr[0] ? ", listening on " : "",
	    listen_addr, fabric_rdma_device() ? "rdma" : "tcp",
	    cfg->fabric_peers ? cfg->fabric_peers : "no configured peers",
	    cfg->fabric_dial_on_demand ? ", dials on demand" : "");
	return 0;
}

void
peer_stop(void)
{
	struct peer *p;
	struct ptarget *t;
	struct pimport *pi;

	if (!enabled)
		return;
	enabled = false;
	while ((p = TAILQ_FIRST(&peers)) != NULL) {
		if (p->state == PEER_READY)
			send_bye(p, "daemon stopping");
		peer_kill(p, "daemon stopping");
	}
	while ((p = TAILQ_FIRST(&dead)) != NULL)
		peer_free(p);
	while ((pi = TAILQ_FIRST(&pimports)) != NULL)       /* those still resolving a name */
		import_fail(pi, GPX__STATUS__ESHUTDOWN, "the daemon is stopping");
	while ((t = TAILQ_FIRST(&targets)) != NULL) {
		if (t->resolving)
			break;      /* its resolve_done still refers to it: left to the exit */
		TAILQ_REMOVE(&targets, t, entry);
		free(t);
	}
	request_shutdown();
	fabric_rdma_shutdown();
	if (listener != NULL)
		evconnlistener_free(listener);
	listener = NULL;
	if (tick_ev != NULL)
		event_free(tick_ev);
	tick_ev = NULL;
	free(arena);
	arena = NULL;
	memset(key, 0, sizeof(key));
}

const char *
peer_status(void)
{
	return status_buf[0] ? status_buf : "off";
}

void
peer_query(Gpx__QueryReply *q)
{
	struct ptarget *t;
	struct peer *p;
	size_t n = 0, cap = 1;
	double now = now_s();

	TAILQ_FOREACH(t, &targets, entry)
		cap++;
	TAILQ_FOREACH(p, &peers, entry)
		cap++;
	q->peers = calloc(cap, sizeof(*q->peers));
	if (q->peers == NULL)
		return;
	TAILQ_FOREACH(p, &peers, entry) {
		Gpx__PeerInfo *i = malloc(sizeof(*i));
		struct phandle *h;
		if (i == NULL)
			break;
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
		q->peers[n++] = i;
	}
	/* Addresses with no connection now (configured, or dialled on demand and not forgotten
	 * yet): why not. */
	TAILQ_FOREACH(t, &targets, entry) {
		if (t->p != NULL || (t->node[0] && peer_by_node(t->node) != NULL))
			continue;
		Gpx__PeerInfo *i = malloc(sizeof(*i));
		if (i == NULL)
			break;
		gpx__peer_info__init(i);
		i->node = t->node;
		i->address = t->addr;
		i->state = t->resolving ? "connecting" : "down";
		i->transport = "tcp";
		i->outbound = true;
		i->why = t->why;
		i->on_demand = t->on_demand;
		q->peers[n++] = i;
	}
	q->n_peers = n;
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
