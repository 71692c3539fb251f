/*
 * The integration tests' wrong input (tests/integ.c runs them): descriptors that are not what
 * the message says, and the wire protocol spoken wrong where libgpxclient would never speak
 * it (versions, messages before Hello, oversized datagrams, too many descriptors, undecodable
 * bytes), each refused and every descriptor closed; and libgpxclient's socket made
 * non-blocking under it.
 */
#include "config.h"

#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/integ.h"
#include "tests/tclient.h"
#include "tests/tap.h"
#include "tests/util.h"

/* ---- descriptors that are not what the message says ---- */

void
test_bad_fds(void)
{
	gpx_conn *c = client("integ-badfd");
	gpx_region r;
	int with_c, pfd[2], sp[2];
	char path[256];

	if (c == NULL || pipe(pfd) < 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, sp) < 0)
		tap_bail("cannot set up the bad-fd test");
	with_c = harness_fds(&H);
	snprintf(path, sizeof(path), "%s/regular", H.dir);
	int file = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	(void)!ftruncate(file, 65536);
	int unsealed = memfd_create("integ-unsealed", MFD_ALLOW_SEALING);
	(void)!ftruncate(unsealed, 65536);
	int noseal = memfd_create("integ-noseal", 0);
	(void)!ftruncate(noseal, 65536);
	struct {
		const char *what;
		int fd;
	} bad[] = {
		{ "a pipe", pfd[0] },
		{ "/dev/null", open("/dev/null", O_RDWR) },
		{ "an eventfd", eventfd(0, 0) },
		{ "a socket", sp[0] },
		{ "a regular file", file },
		{ "a memfd without seals", unsealed },
		{ "a memfd that cannot be sealed", noseal },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int e = gpx_register_host(c, bad[i].fd, 0, 4096, 0, &r);
		ok(e == -GPX_EBADFD, "%s as host memory: EBADFD (%s)", bad[i].what, gpx_strerror(e));
		int n = harness_wait_fds(&H, with_c, WAIT_MS);
		ok(n == with_c, "  and gpxd closed it (%d descriptors, want %d)", n, with_c);
		close(bad[i].fd);
	}
	close(pfd[1]);
	close(sp[1]);
	unlink(path);

	struct buf b;
	if (buf_new(&b, 65536) < 0)
		tap_bail("memfd");
	ok(gpx_register_host(c, b.fd, 4096, 65536, 0, &r) == -GPX_ERANGE, "a range beyond the memfd's end: ERANGE");
	ok(gpx_register_host(c, b.fd, UINT64_MAX - 10, 100, 0, &r) == -GPX_EINVAL, "offset + length overflowing: EINVAL");
	ok(gpx_register_host(c, b.fd, 0, 0, 0, &r) == -GPX_EINVAL, "length 0: EINVAL");
	ok(harness_wait_fds(&H, with_c, WAIT_MS) == with_c, "none of those memfds stays open in gpxd");
	ok(gpx_register_host(c, b.fd, 4096, 8192, 0, &r) == 0 && harness_fds(&H) == with_c,
	    "a good memfd is mapped while registered, and not held: a region costs gpxd no descriptor (%d, want %d)",
	    harness_fds(&H), with_c);
	ok(gpx_copy_sync(c, r, 0, r, 4096, 4096) == 0 && gpx_deregister(c, r) == 0 &&
	    harness_wait_fds(&H, with_c, WAIT_MS) == with_c, "it serves copies, and is let go of when deregistered");
	buf_free(&b);
	gpx_close(c);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");
}

/* ---- the wire protocol, spoken wrong ---- */

static Gpx__ClientMsg
query_msg(uint32_t seq, Gpx__Query *q)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;

	gpx__query__init(q);
	q->what = GPX__QUERY_WHAT__Q_STATUS;
	m.seq = seq;
	m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
	m.query = q;
	return m;
}

static size_t
pack_query(uint8_t *buf, uint32_t seq)
{
	Gpx__Query q;
	Gpx__ClientMsg m = query_msg(seq, &q);

	return gpx__client_msg__pack(&m, buf);
}

/* A query-only raw connection past Hello. */
static int
raw_ready(void)
{
	int s = harness_connect(&H);
	Gpx__DaemonMsg *m = s >= 0 ? harness_hello(s, GPX_PROTO_VERSION, -1, NULL) : NULL;
	bool good = m != NULL && m->reply->status == 0;

	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	if (!good) {
		if (s >= 0)
			close(s);
		return -1;
	}
	return s;
}

/* A Query round trip: the reply's status, -1 if none came, -2 if it came under another seq. */
static int
query_status(int s, uint32_t seq, const int *fds, int nfds)
{
	uint8_t buf[256];
	size_t n = pack_query(buf, seq);

	if (send_fds(s, buf, n, fds, nfds) != (ssize_t)n)
		return -1;
	Gpx__DaemonMsg *m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
	int st = m == NULL ? -1 : m->reply->seq != seq ? -2 : (int)m->reply->status;
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	return st;
}

/*
 * A connection refused before its Hello must be closed at once, well before the Hello timeout
 * (5 s, looked at once a second) would close it anyway.
 */
#define AT_ONCE_MS 2000

void
test_protocol(void)
{
	uint8_t *big = calloc(1, 3 * GPX_MSG_MAX);
	Gpx__DaemonMsg *m;
	int s, efd = eventfd(0, EFD_CLOEXEC);

	/* Wrong version: EVERSION, then closed. */
	s = harness_connect(&H);
	m = harness_hello(s, 99, efd, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EVERSION, "Hello with version 99 gets EVERSION");
	if (m != NULL) {
		ok(m->reply->message != NULL && strstr(m->reply->message, "99") != NULL,
		    "the refusal explains itself: \"%s\"", m->reply->message);
		gpx__daemon_msg__free_unpacked(m, NULL);
	} else
		ok(0, "the refusal explains itself");
	ok(harness_wait_eof(s, AT_ONCE_MS), "and the connection is closed");
	close(s);

	/* Hello that promises a ring but brings no eventfd. */
	s = harness_connect(&H);
	Gpx__ClientMsg hm = GPX__CLIENT_MSG__INIT;
	Gpx__Hello h = GPX__HELLO__INIT;
	h.version = GPX_PROTO_VERSION;
	hm.seq = 1;
	hm.body_case = GPX__CLIENT_MSG__BODY_HELLO;
	hm.hello = &h;
	harness_send(s, &hm, NULL, 0);
	m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EBADFD && harness_wait_eof(s, AT_ONCE_MS),
	    "Hello asking for a ring without an eventfd: EBADFD, closed");
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	close(s);
	/* Hello whose fd is not an eventfd. */
	s = harness_connect(&H);
	int notefd = memfd_create("integ-not-eventfd", MFD_CLOEXEC);
	m = harness_hello(s, GPX_PROTO_VERSION, notefd, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EBADFD && harness_wait_eof(s, AT_ONCE_MS),
	    "Hello with a memfd for its eventfd: EBADFD, closed");
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	close(notefd);
	close(s);

	/* Anything before Hello closes the connection. */
	s = harness_connect(&H);
	ok(query_status(s, 1, NULL, 0) == GPX__STATUS__EPROTO && harness_wait_eof(s, AT_ONCE_MS),
	    "a Query before Hello: EPROTO, closed");
	close(s);
	s = harness_connect(&H);
	ok(query_status(s, 1, &efd, 1) == GPX__STATUS__EPROTO && harness_wait_eof(s, AT_ONCE_MS),
	    "a Query with an fd before Hello: EPROTO, closed");
	close(s);
	s = harness_connect(&H);
	ok(send_fds(s, "\x0a\xff\xff", 3, NULL, 0) == 3 && harness_wait_eof(s, AT_ONCE_MS),
	    "undecodable bytes before Hello: closed at once");
	close(s);
	s = harness_connect(&H);
	{
		uint8_t hb[128];
		Gpx__ClientMsg m3 = GPX__CLIENT_MSG__INIT;
		Gpx__Hello h3 = GPX__HELLO__INIT;
		int three[3] = { efd, efd, efd };
		h3.version = GPX_PROTO_VERSION;
		m3.seq = 1;
		m3.body_case = GPX__CLIENT_MSG__BODY_HELLO;
		m3.hello = &h3;
		size_t hl = gpx__client_msg__pack(&m3, hb);
		ok(send_fds(s, hb, hl, three, 3) == (ssize_t)hl && harness_wait_eof(s, AT_ONCE_MS),
		    "a Hello carrying three fds (it takes one): closed");
	}
	close(s);

	/* The size cap: exactly GPX_MSG_MAX is read, one byte more closes the connection. */
	for (int over = 0; over <= 1; over++) {
		s = raw_ready();
		size_t n = pack_query(big, 7);
		/* Pad with an unknown length-delimited field 15 to the exact size. */
		size_t want = GPX_MSG_MAX + over, pad = want - n - 1 - 3;
		big[n] = (15 << 3) | 2;
		big[n + 1] = 0x80 | (pad & 0x7f);
		big[n + 2] = 0x80 | ((pad >> 7) & 0x7f);
		big[n + 3] = (uint8_t)(pad >> 14);
		memset(big + n + 4, 'x', pad);
		ssize_t sent = send_fds(s, big, want, NULL, 0);
		if (!over) {
			m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
			ok(sent == (ssize_t)want && m != NULL && m->reply->status == 0 && m->reply->seq == 7,
			    "a datagram of exactly GPX_MSG_MAX (%d) bytes is answered", GPX_MSG_MAX);
			if (m != NULL)
				gpx__daemon_msg__free_unpacked(m, NULL);
		} else
			ok(sent == (ssize_t)want && harness_wait_eof(s, WAIT_MS),
			    "a datagram of GPX_MSG_MAX + 1 bytes closes the connection");
		close(s);
	}
	/* Three times the cap (the socket's send buffer permitting): the same, nothing read into memory. */
	s = raw_ready();
	int sndbuf = 1 << 20;
	setsockopt(s, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
	memset(big, 0, 3 * GPX_MSG_MAX);
	ok(send_fds(s, big, 3 * GPX_MSG_MAX, NULL, 0) == 3 * GPX_MSG_MAX && harness_wait_eof(s, WAIT_MS),
	    "a datagram of 3 x GPX_MSG_MAX closes the connection");
	close(s);
	s = raw_ready();
	ok(send_fds(s, "\x12\x01", 2, NULL, 0) == 2 && harness_wait_eof(s, WAIT_MS), "undecodable bytes after Hello: closed");
	close(s);
	s = raw_ready();
	uint8_t noBody[8];
	Gpx__ClientMsg nb = GPX__CLIENT_MSG__INIT;
	nb.seq = 3;
	size_t nbl = gpx__client_msg__pack(&nb, noBody);
	ok(send_fds(s, noBody, nbl, NULL, 0) == (ssize_t)nbl && harness_wait_eof(s, WAIT_MS),
	    "a message without a body (unknown type): closed");
	close(s);

	/* Descriptors the message does not take: refused, closed, connection kept. */
	s = raw_ready();
	int with_s = harness_fds(&H);
	int many[100];
	for (int i = 0; i < 100; i++)
		many[i] = efd;
	ok(query_status(s, 11, many, 1) == GPX__STATUS__EPROTO, "a Query carrying one fd: EPROTO, under its seq");
	ok(query_status(s, 12, many, GPX_MAX_FDS + 1) == GPX__STATUS__EPROTO,
	    "a Query carrying GPX_MAX_FDS + 1 fds (more than any message takes): EPROTO, under its seq");
	ok(query_status(s, 13, many, 100) == GPX__STATUS__EPROTO,
	    "a Query carrying 100 fds (control data truncated): EPROTO, under its seq");
	ok(query_status(s, 14, NULL, 0) == 0, "the connection still works");
	ok(harness_wait_fds(&H, with_s, WAIT_MS) == with_s, "every one of those fds was closed in gpxd");
	/* 10,000 times over, in bursts: the daemon never runs out of descriptors. */
	uint8_t qb[64];
	size_t ql = pack_query(qb, 0);
	int answered = 0, sent = 0;
	for (int burst = 0; burst < 200; burst++) {
		for (int i = 0; i < 50; i++)
			sent += send_fds(s, qb, ql, many, 2 + (i % 3)) == (ssize_t)ql;
		for (int i = 0; i < 50; i++) {
			m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
			if (m == NULL)
				break;
			answered += m->reply->status == GPX__STATUS__EPROTO;
			gpx__daemon_msg__free_unpacked(m, NULL);
		}
	}
	ok(sent == 10000 && answered == 10000, "10,000 messages with 2-4 unwanted fds each are all refused (%d)", answered);
	ok(query_status(s, 15, NULL, 0) == 0 && harness_wait_fds(&H, with_s, WAIT_MS) == with_s,
	    "the connection still works and gpxd holds none of those fds");
	close(s);
	close(efd);
	free(big);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");
}

/* ---- the library's socket, made non-blocking by another holder of it ---- */

/* The newest descriptor of this process connected to H's socket: the last client's. */
static int
client_socket(void)
{
	int found = -1;

	for (int fd = 3; fd < 1024; fd++) {
		struct sockaddr_un a;
		socklen_t al = sizeof(a);
		int type = 0;
		socklen_t tl = sizeof(type);
		if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) == 0 && type == SOCK_SEQPACKET &&
		    getpeername(fd, (struct sockaddr *)&a, &al) == 0 && a.sun_family == AF_UNIX &&
		    strcmp(a.sun_path, H.sock) == 0)
			found = fd;
	}
	return found;
}

/*
 * The socket's open file description is shared with whoever holds a copy of it (a child
 * after fork, a wrapper that sets O_NONBLOCK on every descriptor): a request's wait for its
 * answer must not take "nothing yet" for an answer.  Each request here outlasts the
 * library's brief spin before it blocks (its answer comes after a Register's check), many
 * times over.
 */
void
test_nonblocking_socket(void)
{
	gpx_conn *c = client("integ-nonblocking");
	struct buf b;
	int s = client_socket(), fl, good = 0, n = 200;

	if (c == NULL || s < 0 || buf_new(&b, 1 << 20) < 0)
		tap_bail("cannot set up a client and its socket");
	fl = fcntl(s, F_GETFL);
	ok(fl >= 0 && fcntl(s, F_SETFL, fl | O_NONBLOCK) == 0, "the client's socket (fd %d) made non-blocking", s);
	for (int i = 0; i < n; i++) {
		gpx_region r = 0;
		if (gpx_register_host(c, b.fd, 0, b.len, 0, &r) == 0 && r != 0 &&
		    gpx_copy_sync(c, r, 0, r, b.len / 2, 4096) == 0 && gpx_deregister(c, r) == 0)
			good++;
	}
	ok(good == n, "%d of %d rounds of register, copy and deregister answered right (%s)", good, n,
	    gpx_last_error(c));
	gpx_close(c);
	buf_free(&b);
}

/*
 * A refusal's reason is the client's to read with its completion, whatever the library did
 * between: gpxd answers a request in order, so a refusal sent before the answer to the next
 * request is taken while the library waits for that answer, and the answer, a success, must
 * not wipe the reason.  (budget.c's connection test read an empty reason once that way.)
 */
void
test_refusal_reason_kept(void)
{
	gpx_conn *c = client("integ-reason");
	struct buf b;
	struct gpx_completion e;
	gpx_region r = 0;

	if (c == NULL || buf_new(&b, 1 << 16) < 0 || buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up a client");
	int rc = gpx_copy(c, b.r, 0, b.r, 0, 1 << 20, 4242);            /* past the region: ERANGE */
	int reg = gpx_register_host(c, b.fd, 0, 4096, 0, &r);            /* answered after the refusal */
	int w = gpx_wait_tag(c, 4242, &e, WAIT_MS);
	const char *why = gpx_last_error(c);
	ok(rc == 0 && reg == 0 && w == 0 && e.status == -GPX_ERANGE && strstr(why, "leaves its region") != NULL,
	    "a refused copy, then a registration that succeeds: the copy's completion is ERANGE and "
	    "gpx_last_error still gives its reason (\"%s\")", why);
	gpx_close(c);
	buf_free(&b);
}
