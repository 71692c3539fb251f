/*
 * Many tenants on one gpxd: one user's programs, buggy or hostile, cannot take the daemon from
 * the others, nor read what the others do.  Each part runs a real gpxd and clients as other
 * uids (forked children that drop to them), so it needs root and skips without it.
 *
 *  - flood: four processes of one uid open 12,000 connections that never say Hello and keep
 *    churning them, against connections_per_uid = 8 and a gpxd limited to 1,024 descriptors:
 *    gpxd's descriptors stay bounded, another uid connects and copies all along, root's
 *    queries are answered, and the log stays short;
 *  - hello_max: one uid with a high connection limit holds hundreds of silent connections:
 *    the daemon-wide cap on connections waiting for Hello bounds the descriptors, and another
 *    uid still gets in (the heaviest uid's oldest silent connection makes room);
 *  - the descriptor reserve: with the descriptor table full, root is still answered, others
 *    are refused at once instead of hanging, accept backs off without spinning or flooding
 *    the log, and once the flood ends everyone is admitted again;
 *  - introspection: a non-admin's queries show its own clients, regions and transfers and the
 *    exports it may import; root and the admin group see everything;
 *  - fairness: one uid keeps both copy workers busy with large copies up to its inflight limit
 *    over many connections; another uid's 4 KiB copies complete within a bound, and two
 *    saturating uids share the workers evenly whatever their numbers of connections.
 *
 * This file holds what the parts share (children running as other uids, sockets connected as
 * one, a raw query) and runs the parts; the parts live in tenants-*.c (tests/tenants.h).
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/tenants.h"
#include "tests/util.h"

void
msleep(int ms)
{
	usleep(ms * 1000);
}

/* A connected socket to path (non-blocking connect when nb); -errno on failure. */
int
sock_to(const char *path, bool nb)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (nb ? SOCK_NONBLOCK : 0), 0);

	if (s < 0)
		return -errno;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int e = errno;
		close(s);
		return -e;
	}
	return s;
}

/* ---- sockets connected as another uid ---- */

static void
connector(void *p, int out, int stop)
{
	const char *path = p;
	int s = sock_to(path, false);
	char b = 0;
	struct iovec iov = { .iov_base = &b, .iov_len = 1 };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} cm;
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (s >= 0) {
		mh.msg_control = cm.buf;
		mh.msg_controllen = sizeof(cm.buf);
		struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
		h->cmsg_level = SOL_SOCKET;
		h->cmsg_type = SCM_RIGHTS;
		h->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(h), &s, sizeof(int));
	}
	(void)!sendmsg(out, &mh, 0);
	/* gpxd ends a connection when the process that made it exits: stay until told. */
	struct pollfd pf = { .fd = stop, .events = POLLIN };
	poll(&pf, 1, -1);
}

int
connect_as(struct as_conn *a, const char *path, uid_t uid, gid_t gid, const gid_t *groups, int ngroups)
{
	int sp[2];
	char b;
	struct iovec iov = { .iov_base = &b, .iov_len = 1 };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} cm;
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof(cm.buf) };

	/* The result channel is a socket pair here, to carry the descriptor. */
	if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sp) < 0)
		tap_bail("socketpair");
	int go[2];
	if (pipe2(go, O_CLOEXEC) < 0)
		tap_bail("pipe");
	fflush(NULL);
	if ((a->ch.pid = fork()) == 0) {
		child_close_others(sp[1], go[0]);
		if (setgroups(ngroups, groups) < 0 || setgid(gid) < 0 || setuid(uid) < 0)
			_exit(98);
		connector((void *)path, sp[1], go[0]);
		_exit(0);
	}
	close(sp[1]);
	close(go[0]);
	a->ch.rd = sp[0];
	a->ch.go = go[1];
	a->s = -1;
	if (recvmsg(sp[0], &mh, 0) == 1) {
		struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
		if (h != NULL && h->cmsg_type == SCM_RIGHTS)
			memcpy(&a->s, CMSG_DATA(h), sizeof(int));
	}
	if (a->s < 0)
		return -1;
	Gpx__DaemonMsg *m = harness_hello(a->s, GPX_PROTO_VERSION, -1, NULL);
	bool good = m != NULL && m->reply->status == 0;
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	return good ? 0 : -1;
}

void
as_close(struct as_conn *a)
{
	if (a->s >= 0)
		close(a->s);
	child_stop(&a->ch);
	waitpid(a->ch.pid, NULL, 0);
	close(a->ch.rd);
}

/* One query on a welcomed connection; the reply (free with gpx__query_reply__free_unpacked) or NULL. */
Gpx__QueryReply *
query(int s, Gpx__QueryWhat what)
{
	static uint32_t seq = 10;
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Query q = GPX__QUERY__INIT;
	Gpx__QueryReply *r = NULL;
	int fds[GPX_MAX_FDS], nfds = 0;

	q.what = what;
	m.seq = ++seq;
	m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
	m.query = &q;
	if (harness_send(s, &m, NULL, 0) < 0)
		return NULL;
	Gpx__DaemonMsg *d = harness_recv(s, 10000, fds, &nfds, NULL);
	if (d == NULL || d->reply->status != 0) {
		wire_close_fds(fds, nfds);
		if (d != NULL)
			gpx__daemon_msg__free_unpacked(d, NULL);
		return NULL;
	}
	if (d->reply->query_in_fd && nfds == 1) {
		off_t len = lseek(fds[0], 0, SEEK_END);
		uint8_t *buf = malloc(len > 0 ? len : 1);
		if (len > 0 && pread(fds[0], buf, len, 0) == len)
			r = gpx__query_reply__unpack(NULL, len, buf);
		free(buf);
	} else if (d->reply->query != NULL) {
		/* A copy that outlives the message: pack and unpack it again. */
		size_t len = gpx__query_reply__get_packed_size(d->reply->query);
		uint8_t *buf = malloc(len + 1);
		gpx__query_reply__pack(d->reply->query, buf);
		r = gpx__query_reply__unpack(NULL, len, buf);
		free(buf);
	}
	wire_close_fds(fds, nfds);
	gpx__daemon_msg__free_unpacked(d, NULL);
	return r;
}

int
main(int argc, char **argv)
{
	if (geteuid() != 0) {
		printf("1..0 # SKIP running clients as other uids needs root\n");
		return 0;
	}
	signal(SIGPIPE, SIG_IGN);
	/* Run one part by name: tenants flood|hello|reserve|introspection|fairness */
	static const struct test_part parts[] = {
		{ "introspection", test_introspection }, { "flood", test_flood }, { "hello", test_hello_max },
		{ "reserve", test_reserve }, { "fairness", test_fairness },
	};
	run_parts(argc, argv, parts, sizeof(parts) / sizeof(parts[0]));
	return tap_done();
}
