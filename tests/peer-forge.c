/*
 * peer-forge: a peer of gpxd's fabric that answers the handshake whatever the key, to check
 * the side that accepts a connection (tests/fabric-tcp.test).  A real gpxd with another key
 * gives up at the Challenge, so the listening side's check of the Auth proof never runs
 * against it; this one goes on and sends an Auth made with the key it is given.
 *
 * Usage: peer-forge HOST PORT KEY_FILE OTHER_KEY_FILE
 *
 * With the daemon's own key (KEY_FILE) the Challenge's proof matches and the Auth is answered
 * with Ready: this program speaks the protocol right.  With another key (OTHER_KEY_FILE) the
 * Challenge's proof does not match, and the Auth sent anyway must be answered with a Bye that
 * says the authentication failed, never with Ready.  TAP.
 *
 * The other way round, the dialling side's check of the Challenge:
 *   peer-forge listen SOCK PORT OTHER_KEY_FILE
 * listens on 127.0.0.1:PORT and, as a client of the gpxd at SOCK (with [fabric]
 * dial_on_demand), imports "@127.0.0.1:PORT/kv", so that gpxd dials it.  It answers the Hello
 * with a Challenge whose proof is made with another key: gpxd must end the connection with a
 * Bye that says the authentication failed, never answer it with an Auth, and the import must
 * fail with EACCES.
 */
#include "config.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>

#include "client-lib/gpx.h"
#include "daemon/fabric/internal.h"
#include "proto/peer.pb-c.h"
#include "tests/tap.h"

static uint8_t key[4096];
static size_t keylen;

/* As daemon/fabric/peer-auth.c reads a key file: trailing newlines dropped. */
static int
read_key(const char *path)
{
	FILE *f = fopen(path, "r");

	if (f == NULL)
		return -1;
	keylen = fread(key, 1, sizeof(key), f);
	fclose(f);
	while (keylen > 0 && (key[keylen - 1] == '\n' || key[keylen - 1] == '\r'))
		keylen--;
	return keylen >= 16 ? 0 : -1;
}

/* The proof of proto/peer.proto under this forger's key (the daemon's own code computes it). */
static void
proof(const char *label, uint32_t version, const uint8_t *nonce_i, const uint8_t *nonce_r,
    const char *node_i, const char *node_r, uint8_t out[SHA256_LEN])
{
	peer_auth_proof(key, keylen, label, version, nonce_i, nonce_r, node_i, node_r, out);
}

static int
send_msg(int s, const Gpxpeer__PeerMsg *m)
{
	uint8_t buf[PEER_HDR_LEN + PEER_PREAUTH_MAX];
	size_t n = gpxpeer__peer_msg__get_packed_size(m);

	if (n > PEER_PREAUTH_MAX)
		return -1;
	for (int i = 0; i < 4; i++) {
		buf[i] = (uint8_t)(PEER_MAGIC >> (24 - 8 * i));
		buf[4 + i] = (uint8_t)(n >> (24 - 8 * i));
		buf[8 + i] = 0;
	}
	gpxpeer__peer_msg__pack(m, buf + PEER_HDR_LEN);
	return send(s, buf, PEER_HDR_LEN + n, MSG_NOSIGNAL) == (ssize_t)(PEER_HDR_LEN + n) ? 0 : -1;
}

static int
read_full(int s, void *p, size_t n)
{
	size_t got = 0;

	while (got < n) {
		ssize_t k = recv(s, (char *)p + got, n - got, 0);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		got += (size_t)k;
	}
	return 0;
}

/* The next message, or NULL at the end of the connection (or after 5 s, or on garbage). */
static Gpxpeer__PeerMsg *
recv_msg(int s)
{
	uint8_t hdr[PEER_HDR_LEN], buf[PEER_MSG_MAX];
	uint32_t magic = 0, n = 0, data = 0;

	if (read_full(s, hdr, sizeof(hdr)) < 0)
		return NULL;
	for (int i = 0; i < 4; i++) {
		magic = magic << 8 | hdr[i];
		n = n << 8 | hdr[4 + i];
		data = data << 8 | hdr[8 + i];
	}
	if (magic != PEER_MAGIC || n > sizeof(buf) || data != 0 || read_full(s, buf, n) < 0)
		return NULL;
	return gpxpeer__peer_msg__unpack(NULL, n, buf);
}

static int
dial(const char *host, int port)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
	struct timeval tv = { 5, 0 };
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (s < 0 || inet_pton(AF_INET, host, &sa.sin_addr) != 1 ||
	    connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		if (s >= 0)
			close(s);
		return -1;
	}
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	return s;
}

/*
 * One handshake as node `self`, with the key read from keyfile: Hello, the Challenge (whose
 * proof is checked here and reported in *challenge_ok), an Auth made with that key in any
 * case, and the answer to it.  Returns the answer's body case (0 if the connection ended
 * first); a Bye's reason goes to why.
 */
static int
handshake(const char *host, int port, const char *keyfile, const char *self, bool *challenge_ok,
    char *why, size_t whylen)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT, *in;
	Gpxpeer__Hello h = GPXPEER__HELLO__INIT;
	Gpxpeer__Auth a = GPXPEER__AUTH__INIT;
	uint8_t nonce[PEER_NONCE_LEN], nonce_r[PEER_NONCE_LEN], mac[SHA256_LEN];
	char node_r[PEER_NAME_MAX + 1];
	uint32_t version;
	int s, answer = 0;

	*challenge_ok = false;
	why[0] = '\0';
	if (read_key(keyfile) < 0 || (s = dial(host, port)) < 0 || getrandom(nonce, sizeof(nonce), 0) != sizeof(nonce))
		return -1;
	h.version_min = PEER_PROTO_MIN;
	h.version_max = PEER_PROTO_MAX;
	h.node = (char *)self;
	h.nonce.data = nonce;
	h.nonce.len = sizeof(nonce);
	m.body_case = GPXPEER__PEER_MSG__BODY_HELLO;
	m.hello = &h;
	if (send_msg(s, &m) < 0 || (in = recv_msg(s)) == NULL) {
		close(s);
		return -1;
	}
	if (in->body_case != GPXPEER__PEER_MSG__BODY_CHALLENGE || in->challenge->nonce.len != PEER_NONCE_LEN ||
	    in->challenge->mac.len != SHA256_LEN || strlen(in->challenge->node) > PEER_NAME_MAX) {
		gpxpeer__peer_msg__free_unpacked(in, NULL);
		close(s);
		return -1;
	}
	version = in->challenge->version;
	memcpy(nonce_r, in->challenge->nonce.data, PEER_NONCE_LEN);
	snprintf(node_r, sizeof(node_r), "%s", in->challenge->node);
	proof("gpx-peer-responder", version, nonce, nonce_r, self, node_r, mac);
	*challenge_ok = memcmp(mac, in->challenge->mac.data, SHA256_LEN) == 0;
	gpxpeer__peer_msg__free_unpacked(in, NULL);

	proof("gpx-peer-initiator", version, nonce, nonce_r, self, node_r, mac);
	a.mac.data = mac;
	a.mac.len = sizeof(mac);
	m.body_case = GPXPEER__PEER_MSG__BODY_AUTH;
	m.auth = &a;
	if (send_msg(s, &m) == 0 && (in = recv_msg(s)) != NULL) {
		answer = in->body_case;
		if (answer == GPXPEER__PEER_MSG__BODY_BYE)
			snprintf(why, whylen, "%s", in->bye->reason ? in->bye->reason : "");
		gpxpeer__peer_msg__free_unpacked(in, NULL);
	}
	close(s);
	return answer;
}

struct listener {
	int ls;
	int answer;          /* the body case of gpxd's answer to our Challenge, 0 for none */
	char why[256];       /* a Bye's reason */
};

/* Accepts gpxd's dial, answers its Hello with a Challenge made with the key read last. */
static void *
listen_main(void *arg)
{
	struct listener *l = arg;
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT, *in;
	Gpxpeer__Challenge ch = GPXPEER__CHALLENGE__INIT;
	uint8_t nonce[PEER_NONCE_LEN], mac[SHA256_LEN];
	struct timeval tv = { 10, 0 };
	int s;

	setsockopt(l->ls, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	if ((s = accept(l->ls, NULL, NULL)) < 0)
		return NULL;
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	if ((in = recv_msg(s)) == NULL || in->body_case != GPXPEER__PEER_MSG__BODY_HELLO ||
	    in->hello->nonce.len != PEER_NONCE_LEN || getrandom(nonce, sizeof(nonce), 0) != sizeof(nonce)) {
		if (in != NULL)
			gpxpeer__peer_msg__free_unpacked(in, NULL);
		close(s);
		return NULL;
	}
	proof("gpx-peer-responder", PEER_PROTO_MIN, in->hello->nonce.data, nonce, in->hello->node, "forgelisten", mac);
	gpxpeer__peer_msg__free_unpacked(in, NULL);
	ch.version = PEER_PROTO_MIN;
	ch.node = "forgelisten";
	ch.nonce.data = nonce;
	ch.nonce.len = sizeof(nonce);
	ch.mac.data = mac;
	ch.mac.len = sizeof(mac);
	m.body_case = GPXPEER__PEER_MSG__BODY_CHALLENGE;
	m.challenge = &ch;
	if (send_msg(s, &m) == 0 && (in = recv_msg(s)) != NULL) {
		l->answer = in->body_case;
		if (l->answer == GPXPEER__PEER_MSG__BODY_BYE)
			snprintf(l->why, sizeof(l->why), "%s", in->bye->reason ? in->bye->reason : "");
		gpxpeer__peer_msg__free_unpacked(in, NULL);
	}
	close(s);
	return NULL;
}

static int
listen_mode(const char *sock, int port, const char *keyfile)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port),
	    .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct listener l = { .ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0) };
	int one = 1, e;
	char name[64];
	pthread_t t;
	gpx_conn *c;
	gpx_region r;

	setsockopt(l.ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (read_key(keyfile) < 0 || l.ls < 0 || bind(l.ls, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
	    listen(l.ls, 4) < 0 || pthread_create(&t, NULL, listen_main, &l) != 0) {
		fprintf(stderr, "peer-forge: cannot listen on port %d\n", port);
		return 2;
	}
	if ((e = gpx_connect(sock, "peer-forge", &c)) < 0) {
		fprintf(stderr, "peer-forge: %s: %s\n", sock, gpx_strerror(e));
		return 2;
	}
	snprintf(name, sizeof(name), "@127.0.0.1:%d/kv", port);
	e = gpx_import(c, name, &r, NULL);
	ok(e == -GPX_EACCES && strstr(gpx_last_error(c), "authentication failed") != NULL,
	    "an import from a peer whose Challenge is made with another key fails: %s (%s)", gpx_strerror(e),
	    gpx_last_error(c));
	pthread_join(t, NULL);
	ok(l.answer == GPXPEER__PEER_MSG__BODY_BYE && strstr(l.why, "authentication failed") != NULL,
	    "gpxd answers that Challenge with Bye, not Auth (%d: %s)", l.answer, l.why);
	gpx_close(c);
	close(l.ls);
	printf("1..%d\n", tap_count);
	return tap_failed ? 1 : 0;
}

int
main(int argc, char **argv)
{
	char why[256];
	bool chal;
	int r;

	if (argc == 5 && strcmp(argv[1], "listen") == 0)
		return listen_mode(argv[2], atoi(argv[3]), argv[4]);
	if (argc != 5) {
		fprintf(stderr, "usage: peer-forge HOST PORT KEY_FILE OTHER_KEY_FILE\n");
		return 2;
	}
	int port = atoi(argv[2]);

	r = handshake(argv[1], port, argv[3], "forgeok", &chal, why, sizeof(why));
	ok(chal && r == GPXPEER__PEER_MSG__BODY_READY,
	    "with the daemon's key: its Challenge proves the key, and our Auth is answered with Ready (%d)", r);
	r = handshake(argv[1], port, argv[4], "forgebad", &chal, why, sizeof(why));
	ok(!chal, "with another key: the daemon's Challenge does not match it, and we answer anyway");
	ok(r == GPXPEER__PEER_MSG__BODY_BYE && strstr(why, "authentication failed") != NULL,
	    "the Auth made with another key is answered with Bye, not Ready (%d: %s)", r, why);
	printf("1..%d\n", tap_count);
	return tap_failed ? 1 : 0;
}
