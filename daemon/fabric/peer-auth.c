/*
 * The handshake of a peer connection (proto/peer.proto), before anything else crosses it:
 * version negotiation and a mutual HMAC-SHA256 challenge over both nonces and both node names
 * with the key the nodes share ([fabric] key_file; the key never crosses the wire).  The
 * connecting side says Hello, the answering side a Challenge with its proof, the connecting
 * side its own proof in Auth, and the answering side Ready with the connection's epoch and its
 * RDMA offer (rdma-qp.c).  Until Ready nothing but these messages is accepted (peer.c caps
 * their size far lower), and a side that fails to prove the key is told so and dropped.
 *
 * Two daemons that both list each other can end up with two connections.  The older one is
 * kept, since imports may already hang on it; only the node with the smaller name decides, so
 * that both sides agree: it closes the newer one as soon as that is ready, and the other side
 * keeps both until then, serving everything through the older (peer_by_node).
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/random.h>
#include <sys/stat.h>

#include "daemon/fabric/internal.h"

static uint8_t key[4096];
static size_t keylen;

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

int
peer_auth_init(void)
{
	char err[256];

	if (cfg->fabric_key_file == NULL) {
		log_warnx("fabric: [fabric] key_file is required: peers authenticate with it");
		return -1;
	}
	if (load_key(cfg->fabric_key_file, err, sizeof(err)) < 0) {
		log_warnx("fabric: %s", err);
		return -1;
	}
	return 0;
}

void
peer_auth_forget(void)
{
	memset(key, 0, sizeof(key));
}

/*
 * The proof of one side (peer_auth_proof in internal.h).  The labels differ by direction, so
 * one side's proof is never valid as the other's.
 */
void
peer_auth_proof(const void *k, size_t klen, const char *label, uint32_t version, const uint8_t *nonce_i,
    const uint8_t *nonce_r, const char *node_i, const char *node_r, uint8_t out[SHA256_LEN])
{
	struct hmac m;
	uint8_t v[4] = { version >> 24, version >> 16, version >> 8, version };
	uint8_t l;

	hmac_init(&m, k, klen);
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

/* This daemon's proof, under the fabric's key. */
static void
proof(const char *label, uint32_t version, const uint8_t *nonce_i, const uint8_t *nonce_r,
    const char *node_i, const char *node_r, uint8_t out[SHA256_LEN])
{
	peer_auth_proof(key, keylen, label, version, nonce_i, nonce_r, node_i, node_r, out);
}

/* ---- the handshake ---- */

void
peer_auth_hello(struct peer *p)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Hello h = GPXPEER__HELLO__INIT;

	h.version_min = PEER_PROTO_MIN;
	h.version_max = PEER_PROTO_MAX;
	h.node = peer_self;
	h.nonce.data = p->nonce_local;
	h.nonce.len = PEER_NONCE_LEN;
	m.body_case = GPXPEER__PEER_MSG__BODY_HELLO;
	m.hello = &h;
	p->state = PEER_HELLO;
	peer_send(p, &m, NULL, 0);
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
	if (q != NULL && strcmp(peer_self, p->node) < 0) {
		log_info("fabric: two connections with %s: keeping the older one (%s, %s)", p->node, q->addr,
		    q->outbound ? "outbound" : "inbound");
		peer_bye(p, PEER_DUPLICATE);
		peer_kill(p, PEER_DUPLICATE);
		return;
	}
	if (q != NULL)
		log_debug("fabric", "a second connection with %s (%s): %s closes one", p->node, p->addr, p->node);
	log_info("fabric: peer %s (%s, %s) ready: protocol %u, epoch %08x, transport %s", p->node,
	    p->addr, p->target && p->target->on_demand ? "dialled on demand" : p->outbound ? "outbound" :
	    "inbound", p->version, p->epoch,
	    fabric_rdma_device() ? "tcp until its rdma queue pairs connect" : "tcp");
	if (p->target != NULL)
		peer_import_target_ready(p->target, peer_by_node(p->node));
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
		peer_bye(p, why);
		peer_kill(p, "%s", why);
		return;
	}
	if (!export_node_name_ok(h->node) || h->nonce.len != PEER_NONCE_LEN) {
		peer_kill(p, "malformed Hello");
		return;
	}
	if (strcmp(h->node, peer_self) == 0) {
		peer_bye(p, "same node name as ours");
		peer_kill(p, "it calls itself %s, our own node name", peer_self);
		return;
	}
	snprintf(p->node, sizeof(p->node), "%s", h->node);
	memcpy(p->nonce_remote, h->nonce.data, PEER_NONCE_LEN);
	p->version = v;
	proof("gpx-peer-responder", v, p->nonce_remote, p->nonce_local, p->node, peer_self, mac);
	c.version = v;
	c.node = peer_self;
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
	proof("gpx-peer-responder", c->version, p->nonce_local, c->nonce.data, peer_self, c->node, mac);
	if (!hmac_equal(mac, c->mac.data, SHA256_LEN)) {
		peer_bye(p, "authentication failed: the proof in Challenge does not match our key");
		peer_kill(p, "authentication failed: %s does not hold our key", c->node);
		return;
	}
	if (strcmp(c->node, peer_self) == 0) {
		peer_kill(p, "it has our own node name %s", peer_self);
		return;
	}
	snprintf(p->node, sizeof(p->node), "%s", c->node);
	/* The address is known to be this node now: no redialling it while a connection is up. */
	if (p->target != NULL)
		snprintf(p->target->node, sizeof(p->target->node), "%s", p->node);
	memcpy(p->nonce_remote, c->nonce.data, PEER_NONCE_LEN);
	p->version = c->version;
	proof("gpx-peer-initiator", c->version, p->nonce_local, p->nonce_remote, peer_self, p->node, mac);
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
	proof("gpx-peer-initiator", p->version, p->nonce_remote, p->nonce_local, p->node, peer_self, mac);
	if (a->mac.len != SHA256_LEN || !hmac_equal(mac, a->mac.data, SHA256_LEN)) {
		peer_bye(p, "authentication failed");
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

void
peer_auth_msg(struct peer *p, const Gpxpeer__PeerMsg *m)
{
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
}
