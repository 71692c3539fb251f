/*
 * Framing and fd passing over SOCK_SEQPACKET, and the bounded unpack allocator (see wire.h).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>

#include "wire.h"

/* Room for far more fds than any message takes, so an excess is seen and closed, not leaked. */
#define WIRE_CMSG_FDS 64

static void *
arena_alloc(void *data, size_t size)
{
	struct wire_arena *a = data;
	size_t need = (size + 15) & ~(size_t)15;

	if (need < size || need > a->cap - a->used) {
		a->failed = 1;
		return NULL;
	}
	void *p = a->buf + a->used;
	a->used += need;
	return p;
}

static void
arena_free(void *data, void *p)
{
	(void)data;
	(void)p;
}

struct wire_arena *
wire_arena_new(size_t cap)
{
	struct wire_arena *a = malloc(sizeof(*a) + cap);

	if (a == NULL)
		return NULL;
	a->pa.alloc = arena_alloc;
	a->pa.free = arena_free;
	a->pa.allocator_data = a;
	a->used = 0;
	a->cap = cap;
	a->failed = 0;
	return a;
}

void
wire_arena_reset(struct wire_arena *a)
{
	a->used = 0;
	a->failed = 0;
}

void
wire_close_fds(int *fds, int nfds)
{
	for (int i = 0; i < nfds; i++)
		if (fds[i] >= 0) {
			close(fds[i]);
			fds[i] = -1;
		}
}

int
wire_send(int sock, const void *buf, size_t len, const int *fds, int nfds)
{
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(GPX_MAX_FDS * sizeof(int))];
	} cbuf;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (len > GPX_MSG_MAX || nfds < 0 || nfds > GPX_MAX_FDS)
		return -EMSGSIZE;
	if (nfds > 0) {
		memset(&cbuf, 0, sizeof(cbuf));
		mh.msg_control = cbuf.b;
		mh.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
	}
	for (;;) {
		ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL);
		if (n >= 0)
			return (size_t)n == len ? 0 : -EMSGSIZE;
		if (errno != EINTR)
			return -errno;
	}
}

int
wire_send_msg(int sock, const ProtobufCMessage *msg, const int *fds, int nfds)
{
	size_t len = protobuf_c_message_get_packed_size(msg);
	uint8_t stackbuf[1024];
	uint8_t *buf = stackbuf;
	int r;

	if (len > GPX_MSG_MAX)
		return -EMSGSIZE;
	if (len > sizeof(stackbuf) && (buf = malloc(len)) == NULL)
		return -ENOMEM;
	protobuf_c_message_pack(msg, buf);
	r = wire_send(sock, buf, len, fds, nfds);
	if (buf != stackbuf)
		free(buf);
	return r;
}

ssize_t
wire_recv(int sock, void *buf, size_t *len, int *fds, int *nfds, int maxfds, int flags)
{
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(WIRE_CMSG_FDS * sizeof(int))];
	} cbuf;
	struct iovec iov = { .iov_base = buf, .iov_len = GPX_MSG_MAX };
	struct msghdr mh = {
		.msg_iov = &iov, .msg_iovlen = 1,
		.msg_control = cbuf.b, .msg_controllen = sizeof(cbuf.b),
	};
	int got[WIRE_CMSG_FDS];
	int ngot = 0, bad = 0;
	ssize_t n;

	*nfds = 0;
	do
		n = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;

	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
			bad = 1;
			continue;
		}
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k && ngot < WIRE_CMSG_FDS; i++)
			memcpy(&got[ngot++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	}
	if (mh.msg_flags & MSG_TRUNC) {
		wire_close_fds(got, ngot);
		return -EMSGSIZE;
	}
	if (n == 0) {
		/* An empty datagram reads like EOF, and is handled as one: nothing it carried stays open. */
		wire_close_fds(got, ngot);
		return 0;
	}
	if (len != NULL)
		*len = (size_t)n;
	/* Truncated with room left: the kernel could not install them all (EMFILE), not too many. */
	if ((mh.msg_flags & MSG_CTRUNC) && !bad && ngot < WIRE_CMSG_FDS) {
		wire_close_fds(got, ngot);
		return -EMFILE;
	}
	if ((mh.msg_flags & MSG_CTRUNC) || bad) {
		wire_close_fds(got, ngot);
		return -EBADMSG;
	}
	if (ngot > maxfds) {
		wire_close_fds(got, ngot);
		return -E2BIG;
	}
	memcpy(fds, got, ngot * sizeof(int));
	*nfds = ngot;
	return n;
}
