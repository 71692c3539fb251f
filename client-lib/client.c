/*
 * libgpxclient: the client side of the gpx protocol (proto/gpx.proto).  This file is the
 * connection: connecting (Hello, the completion ring's mapping, the epoll set of gpx_fd),
 * closing, sending and receiving messages, the request-and-answer of rpc, and the errors
 * (gpx_strerror, the last error's text).  The other client-*.c files build on it; see
 * client-private.h for the order.
 *
 * Requests that expect an answer (Hello, Register, Export, Import, Cancel, Query, Admin) are
 * sent with a sequence number and the call blocks until the Reply with that number arrives.
 * Transfers are fire-and-forget: the daemon answers them in the completion ring it shares with
 * us, or, if it refuses one before it runs, with a Reply carrying the transfer's tag, which is
 * turned into a completion here.  Either way each transfer yields exactly one completion.
 *
 * Completions that were read but not yet handed to the caller (refusals, or records set aside
 * by gpx_wait_tag) wait in a small backlog that gpx_poll empties first.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "client-lib/client-private.h"

static const char *errnames[] = {
	[GPX_OK] = "success",
	[GPX_EPROTO] = "protocol error",
	[GPX_EVERSION] = "protocol version not supported by the daemon",
	[GPX_EINVAL] = "invalid argument",
	[GPX_ENOENT] = "no such region, export or transfer",
	[GPX_EACCES] = "permission denied",
	[GPX_ERANGE] = "segment out of the region's bounds",
	[GPX_EBUSY] = "busy: too many outstanding transfers, or connections waiting",
	[GPX_EQUOTA] = "per-user limit reached",
	[GPX_EBADFD] = "file descriptor of the wrong kind",
	[GPX_ENOMEM] = "out of memory",
	[GPX_ECANCELED] = "transfer cancelled",
	[GPX_EREVOKED] = "region withdrawn by its owner",
	[GPX_EEXIST] = "export name already in use",
	[GPX_ENOTSUP] = "memory kind or path not supported here",
	[GPX_EIO] = "copy failed",
	[GPX_ESHUTDOWN] = "daemon shutting down",
	[GPX_EDRAINING] = "client is being drained",
	[GPX_EPERM] = "administrative request not permitted",
};

API const char *
gpx_strerror(int err)
{
	int e = err < 0 ? -err : err;

	if (e < (int)(sizeof(errnames) / sizeof(errnames[0])) && errnames[e] != NULL)
		return errnames[e];
	switch (e) {
	case GPX_ECONN: return "cannot reach gpxd, or the connection was lost";
	case GPX_ETIMEDOUT: return "timed out";
	case GPX_ESYS: return "system call failed";
	}
	return "unknown error";
}

/* Why this thread's last gpx_connect failed (there is no connection to hold it). */
static _Thread_local char connect_error[512];

API const char *
gpx_last_error(const gpx_conn *c)
{
	return c != NULL ? c->last_error : connect_error;
}

API uint64_t
gpx_client_id(const gpx_conn *c)
{
	return c->client_id;
}

/* Records msg (or the code's own text) as the last error and returns -code. */
int
client_error(gpx_conn *c, int code, const char *msg)
{
	snprintf(c->last_error, sizeof(c->last_error), "%s", msg ? msg : gpx_strerror(code));
	return -code;
}

void
client_refusal_hook(gpx_conn *c, void (*fn)(void *arg, uint64_t tag, const char *reason), void *arg)
{
	c->refusal_fn = fn;
	c->refusal_arg = arg;
}

void
client_backlog_push(gpx_conn *c, const struct gpx_completion *e)
{
	if (c->nback == c->capback) {
		size_t n = c->capback ? c->capback * 2 : 16;
		struct gpx_completion *b = realloc(c->back, n * sizeof(*b));
		if (b == NULL)
			return;    /* cannot happen in practice; the completion is lost, not the process */
		c->back = b;
		c->capback = n;
	}
	c->back[c->nback++] = *e;
}

int
client_send(gpx_conn *c, Gpx__ClientMsg *m, const int *fds, int nfds)
{
	if (c->dead)
		return client_error(c, GPX_ECONN, "the connection to gpxd was lost");
	int r = wire_send_msg(c->sock, &m->base, fds, nfds);
	if (r == -EMSGSIZE)
		return client_error(c, GPX_EINVAL, "request too large for one message");
	if (r < 0) {
		c->dead = true;
		return client_error(c, GPX_ECONN, "the connection to gpxd was lost");
	}
	return 0;
}

/*
 * Receives one message.  Replies that answer a transfer (they carry a tag and no request is
 * waiting for them) become completions.  Returns the Reply (valid until the next receive),
 * NULL with *err = 0 if nothing was there (non-blocking), or NULL with a negative *err.
 */
Gpx__Reply *
client_recv(gpx_conn *c, bool block, int *fds, int *nfds, int *err)
{
	int lfds[GPX_MAX_FDS], lnfds;
	ssize_t n = wire_recv(c->sock, c->buf, NULL, fds ? fds : lfds, nfds ? nfds : &lnfds, GPX_MAX_FDS,
	    block ? 0 : MSG_DONTWAIT);

	*err = 0;
	if (n == -EAGAIN)
		return NULL;
	if (n <= 0) {
		c->dead = true;
		*err = client_error(c, GPX_ECONN, n == 0 ? "gpxd closed the connection" : "receive failed");
		return NULL;
	}
	if (fds == NULL)
		wire_close_fds(lfds, lnfds);
	wire_arena_reset(c->arena);
	Gpx__DaemonMsg *m = gpx__daemon_msg__unpack(&c->arena->pa, n, c->buf);
	if (m == NULL || m->body_case != GPX__DAEMON_MSG__BODY_REPLY) {
		if (fds != NULL)
			wire_close_fds(fds, *nfds);
		*err = client_error(c, GPX_EPROTO, "undecodable message from gpxd");
		return NULL;
	}
	return m->reply;
}

/* A Reply that is no request's answer: a refused transfer, or a warning about a bad message. */
void
client_async_reply(gpx_conn *c, const Gpx__Reply *r)
{
	if (r->status != 0 && r->message && r->message[0])
		snprintf(c->last_error, sizeof(c->last_error), "%s", r->message);
	if (r->seq == 0 && r->tag == 0)
		return;
	struct gpx_completion e = { .tag = r->tag, .bytes = 0, .status = -(int)r->status };
	if (c->outstanding > 0)
		c->outstanding--;
	if (c->refusal_fn != NULL && e.status < 0)
		c->refusal_fn(c->refusal_arg, e.tag, r->message && r->message[0] ? r->message : NULL);
	client_backlog_push(c, &e);
}

#define RPC_SPIN_S 50e-6
#define SQ_SEQ 0xffffffffu     /* the daemon's seq for refusals of queued submissions */

/* Sequence numbers of requests: never 0 (unsolicited) nor SQ_SEQ. */
uint32_t
client_next_seq(gpx_conn *c)
{
	do
		c->seq++;
	while (c->seq == 0 || c->seq == SQ_SEQ);
	return c->seq;
}

/*
 * A connection gpxd would not admit (a limit on connections) is closed at once after a Reply
 * with seq 0 that says why, so the Hello fails to go out, or the first receive reports the
 * reset (the kernel says that before the Reply waiting behind it).  If that Reply is there,
 * *err becomes its status.
 */
static void
refusal(gpx_conn *c, int *err)
{
	for (int i = 0; i < 2; i++) {
		int e;
		Gpx__Reply *r = client_recv(c, false, NULL, NULL, &e);
		if (r != NULL && r->seq == 0 && r->status != 0) {
			*err = client_error(c, r->status, r->message && r->message[0] ? r->message : NULL);
			return;
		}
		if (r != NULL || e == 0)
			return;
	}
}

/* Sends m and waits for its Reply; fds of the reply (if any) land in rfds. */
int
client_rpc(gpx_conn *c, Gpx__ClientMsg *m, const int *fds, int nfds, Gpx__Reply **out, int *rfds, int *rnfds)
{
	bool hello = m->body_case == GPX__CLIENT_MSG__BODY_HELLO, reason = false;
	int err;

	m->seq = client_next_seq(c);
	if ((err = client_send(c, m, fds, nfds)) < 0) {
		if (hello)
			refusal(c, &err);
		return err;
	}
	double spin_until = client_now() + RPC_SPIN_S;
	for (;;) {
		int lfds[GPX_MAX_FDS], lnfds = 0;
		/* Most answers come within microseconds: poll for them briefly before sleeping. */
		bool block = client_now() >= spin_until;
		Gpx__Reply *r = client_recv(c, block, lfds, &lnfds, &err);
		/* (nothing yet; also after blocking, where another holder of the socket made it non-blocking) */
		if (r == NULL && err == 0)
			continue;
		if (r == NULL) {
			if (hello && err == -GPX_ECONN)
				refusal(c, &err);
			return err;
		}
		if (r->seq != m->seq) {
			wire_close_fds(lfds, lnfds);
			/* gpxd refuses a connection it will not admit with seq 0 before any answer */
			if (hello && r->seq == 0 && r->tag == 0 && r->status != 0)
				return client_error(c, r->status, r->message && r->message[0] ? r->message : NULL);
			/* (a refusal's reason, kept for its completion: this answer must not wipe it) */
			reason |= r->status != 0 && r->message && r->message[0];
			client_async_reply(c, r);
			continue;
		}
		if (rfds != NULL) {
			memcpy(rfds, lfds, lnfds * sizeof(int));
			*rnfds = lnfds;
		} else
			wire_close_fds(lfds, lnfds);
		if (out != NULL)
			*out = r;      /* a refusal's too: Register's list of missing pieces */
		if (r->status != 0) {
			if (rfds != NULL)
				wire_close_fds(rfds, *rnfds);
			return client_error(c, r->status, r->message && r->message[0] ? r->message : NULL);
		}
		if (!reason)
			c->last_error[0] = '\0';
		return 0;
	}
}

static int
connect_sock(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -GPX_EINVAL;
	strcpy(sa.sun_path, path);
	if ((fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)) < 0)
		return -GPX_ESYS;
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		close(fd);
		return -GPX_ECONN;
	}
	return fd;
}

static int
map_ring(gpx_conn *c, int fd, uint32_t entries)
{
	struct stat st;
	size_t len = gpx_ring_size(entries);

	if (entries == 0 || (entries & (entries - 1)) || fstat(fd, &st) < 0 || (size_t)st.st_size < len)
		return -GPX_EPROTO;
	c->ring = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (c->ring == MAP_FAILED) {
		c->ring = NULL;
		return -GPX_ENOMEM;
	}
	if (c->ring->magic != GPX_RING_MAGIC || c->ring->version != GPX_RING_VERSION || c->ring->entries != entries ||
	    c->ring->entry_size != sizeof(struct gpx_cqe)) {
		munmap(c->ring, len);
		c->ring = NULL;
		return -GPX_EPROTO;
	}
	c->ring_len = len;
	c->entries = entries;
	c->tail = __atomic_load_n(&c->ring->tail, __ATOMIC_ACQUIRE);
	c->sq_tail = __atomic_load_n(&c->ring->sq_tail, __ATOMIC_ACQUIRE);
	return 0;
}

/* client_wait_spin's value for a new connection (client.h). */
static double
wait_spin_s(void)
{
	const char *e = getenv("GPX_WAIT_SPIN_US");
	char *end;

	if (e != NULL && *e != '\0') {
		unsigned long us = strtoul(e, &end, 10);
		if (*end == '\0' && us <= 1000000)
			return us / 1e6;
	}
	return sysconf(_SC_NPROCESSORS_ONLN) >= CLIENT_SPIN_BIG_CPUS ? CLIENT_WAIT_SPIN_BIG_S : CLIENT_WAIT_SPIN_S;
}

/*
 * A failed connect: why, for gpx_last_error(NULL) (gpxd's own refusal where it sent one, else
 * what and errno's text where errno tells), c closed; returns r.
 */
static int
connect_failed(gpx_conn *c, const char *path, int r, const char *what)
{
	int e = errno;

	if (c != NULL && c->last_error[0] != '\0')
		snprintf(connect_error, sizeof(connect_error), "gpxd at %s: %s", path, c->last_error);
	else if (r == -GPX_ESYS || r == -GPX_ECONN)
		snprintf(connect_error, sizeof(connect_error), "%s %s: %s", what, path, strerror(e));
	else
		snprintf(connect_error, sizeof(connect_error), "%s %s: %s", what, path, gpx_strerror(r));
	if (c != NULL)
		gpx_close(c);
	return r;
}

API int
gpx_connect_opts(const struct gpx_connect_opts *o, gpx_conn **out)
{
	const char *path = o->socket;
	gpx_conn *c;
	int r;

	*out = NULL;
	if (path == NULL && (path = getenv("GPX_SOCKET")) == NULL)
		path = GPX_DEFAULT_SOCKET;
	if ((c = calloc(1, sizeof(*c))) == NULL)
		return connect_failed(NULL, path, -GPX_ENOMEM, "no memory for a connection to");
	c->efd = c->epfd = -1;
	c->area.fd = -1;
	c->spin_s = wait_spin_s();
	if ((c->arena = wire_arena_new(GPX_ARENA_SIZE)) == NULL) {
		free(c);
		return connect_failed(NULL, path, -GPX_ENOMEM, "no memory for a connection to");
	}
	if ((c->sock = connect_sock(path)) < 0) {
		r = c->sock;
		c->sock = -1;
		return connect_failed(c, path, r, r == -GPX_EINVAL ? "socket path too long:" : "cannot connect to gpxd at");
	}
	if (!o->no_ring) {
		if (o->eventfd >= 0)
			c->efd = fcntl(o->eventfd, F_DUPFD_CLOEXEC, 0);
		else {
			c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
			c->own_efd = true;
		}
		if (c->efd < 0)
			return connect_failed(c, path, -GPX_ESYS, "no eventfd for a connection to");
	}

	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Hello h = GPX__HELLO__INIT;
	Gpx__Reply *rep;
	int rfds[GPX_MAX_FDS], rnfds = 0;
	h.version = GPX_PROTO_VERSION;
	h.name = (char *)(o->name ? o->name : "");
	h.no_ring = o->no_ring != 0;
	m.body_case = GPX__CLIENT_MSG__BODY_HELLO;
	m.hello = &h;
	if ((r = client_rpc(c, &m, c->efd >= 0 ? &c->efd : NULL, c->efd >= 0, &rep, rfds, &rnfds)) < 0)
		return connect_failed(c, path, r, "no welcome from gpxd at");
	if (rep->body_case != GPX__REPLY__BODY_WELCOME || rnfds != (o->no_ring ? 0 : 1)) {
		wire_close_fds(rfds, rnfds);
		return connect_failed(c, path, -GPX_EPROTO, "no welcome from gpxd at");
	}
	c->client_id = rep->welcome->client_id;
	c->max_inline = rep->welcome->max_inline_segs;
	c->max_segs = rep->welcome->max_segs;
	if (!o->no_ring) {
		r = map_ring(c, rfds[0], rep->welcome->ring_entries);
		close(rfds[0]);
		if (r < 0)
			return connect_failed(c, path, r, "cannot map the completion ring of gpxd at");
	}
	struct epoll_event ev = { .events = EPOLLIN };
	if ((c->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
	    epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->sock, &ev) < 0 ||
	    (c->efd >= 0 && epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->efd, &ev) < 0))
		return connect_failed(c, path, -GPX_ESYS, "no epoll for a connection to");
	connect_error[0] = '\0';
	*out = c;
	return 0;
}

API int
gpx_connect(const char *socket, const char *name, gpx_conn **out)
{
	struct gpx_connect_opts o = { .socket = socket, .name = name, .eventfd = -1 };

	return gpx_connect_opts(&o, out);
}

/* A segment area's memory: the connection's, freed with it; or one client-area.c replaces. */
void
client_area_free(struct area *a)
{
	if (a->p != NULL)
		munmap(a->p, a->len);
	if (a->fd >= 0)
		close(a->fd);
	free(a->q);
	memset(a, 0, sizeof(*a));
	a->fd = -1;
}

API void
gpx_close(gpx_conn *c)
{
	if (c == NULL)
		return;
	if (c->sock >= 0)
		close(c->sock);
	if (c->efd >= 0)
		close(c->efd);
	if (c->epfd >= 0)
		close(c->epfd);
	if (c->ring != NULL)
		munmap(c->ring, c->ring_len);
	client_area_free(&c->area);
	free(c->back);
	free(c->arena);
	free(c);
}
