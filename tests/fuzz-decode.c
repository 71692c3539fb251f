/*
 * Fuzz target for gpxd's framing, decoder and dispatcher: every input becomes a fresh
 * connection (conn_new on one end of a socketpair) that receives the input's frames as
 * datagrams, with real eventfds, memfds and pipes attached where a frame asks for them (the
 * format is in fuzz.h).  The daemon's code runs as in gpxd: the configuration defaults, an
 * event base, the deferred-work threads and the copy engine, initialised once as
 * daemon/levent.c does.  After the input the connection is killed and reaped, and the process
 * must hold exactly the descriptors it held before: a leak aborts the libFuzzer build and is
 * reported by the corpus replay.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <event2/event.h>
#include <event2/thread.h>

#include "daemon/gpxd.h"
#include "daemon/client/client.h"
#include "daemon/engine/engine.h"
#include "tests/fuzz.h"
#include "tests/util.h"

int fuzz_leaked;
bool fuzz_abort_on_leak = true;

static struct event_base *fuzz_base;

/* Our own descriptors, less the one reading the directory. */
static int
count_fds(void)
{
	int n = fds_in("/proc/self/fd");

	return n < 0 ? n : n - 1;
}

static void
nap_us(long us)
{
	struct timespec ts = { 0, us * 1000 };

	nanosleep(&ts, NULL);
}

/* As levent_run does, minus the listening socket, signals and timers. */
static void
fuzz_init(void)
{
	signal(SIGPIPE, SIG_IGN);
	log_init(LOG_L_ERR, NULL, false);
	cfg = conf_new();            /* one reference: a replayed reload drops it when it publishes */
	cfg->cuda = false;
	if (evthread_use_pthreads() < 0 || (fuzz_base = event_base_new()) == NULL)
		abort();
	if (defer_init(fuzz_base, cfg->blocking_threads) < 0 || engine_init(cfg->workers, cfg->chunk_size) < 0)
		abort();
}

static int
make_fd(int kind)
{
	int fd = -1, p[2];

	switch (kind) {
	case FUZZ_FD_EVENTFD:
		fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
		break;
	case FUZZ_FD_MEMFD:
		fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (fd >= 0 && (ftruncate(fd, FUZZ_MEMFD_SIZE) < 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0)) {
			close(fd);
			fd = -1;
		}
		break;
	case FUZZ_FD_PIPE:
		if (pipe2(p, O_CLOEXEC) == 0) {
			close(p[1]);
			fd = p[0];
		}
		break;
	default:
		fd = memfd_create("fuzz-unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (fd >= 0 && ftruncate(fd, 4096) < 0) {
			close(fd);
			fd = -1;
		}
		break;
	}
	return fd;
}

static uint64_t
own_id(const struct conn *c, uint64_t id)
{
	return id != 0 && (id >> 32) == 0 ? (uint64_t)c->epoch << 32 | id : id;
}

/*
 * Rewrites small region ids to this connection's epoch (see fuzz.h).  Returns the length of the
 * re-encoded message in *out (malloc'ed), or 0 when the bytes go out as they are.
 */
static size_t
rewrite_ids(const struct conn *c, const uint8_t *p, size_t len, uint8_t **out)
{
	Gpx__ClientMsg *m = gpx__client_msg__unpack(NULL, len, p);
	bool changed = false;
	size_t n = 0;

	if (m == NULL)
		return 0;
	switch (m->body_case) {
	case GPX__CLIENT_MSG__BODY_TRANSFER:
		changed = own_id(c, m->transfer->src_region) != m->transfer->src_region ||
		    own_id(c, m->transfer->dst_region) != m->transfer->dst_region;
		m->transfer->src_region = own_id(c, m->transfer->src_region);
		m->transfer->dst_region = own_id(c, m->transfer->dst_region);
		break;
	case GPX__CLIENT_MSG__BODY_DEREGISTER:
		changed = own_id(c, m->deregister->region) != m->deregister->region;
		m->deregister->region = own_id(c, m->deregister->region);
		break;
	case GPX__CLIENT_MSG__BODY_EXPORT:
		changed = own_id(c, m->export->region) != m->export->region;
		m->export->region = own_id(c, m->export->region);
		break;
	case GPX__CLIENT_MSG__BODY_ADMIN:
		if (m->admin->op == GPX__ADMIN__OP__DRAIN && m->admin->arg == 0) {
			m->admin->arg = c->id;
			changed = true;
		}
		break;
	default:
		break;
	}
	if (changed) {
		n = gpx__client_msg__get_packed_size(m);
		if (n > 0 && n <= 2 * GPX_MSG_MAX && (*out = malloc(n)) != NULL)
			gpx__client_msg__pack(m, *out);
		else
			n = 0;
	}
	gpx__client_msg__free_unpacked(m, NULL);
	return n;
}

/* One datagram: the payload (ids rewritten), or GPX_MSG_MAX + 1 zero bytes when oversize. */
static void
send_frame(int sock, const struct conn *c, uint8_t flags, const uint8_t *p, size_t len, bool oversize)
{
	char cbuf[CMSG_SPACE(3 * sizeof(int))];
	int fds[3], nfds = flags & 3;
	uint8_t *re = NULL, *big = NULL;
	size_t rlen = oversize ? 0 : rewrite_ids(c, p, len, &re);
	struct iovec iov = { .iov_base = (void *)(rlen ? re : p), .iov_len = rlen ? rlen : len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (oversize) {
		if ((big = calloc(1, GPX_MSG_MAX + 1)) == NULL)
			return;
		iov.iov_base = big;
		iov.iov_len = GPX_MSG_MAX + 1;
	}
	for (int i = 0; i < nfds; i++)
		if ((fds[i] = make_fd((flags >> (2 + 2 * i)) & 3)) < 0)
			nfds = i;
	if (nfds > 0) {
		memset(cbuf, 0, sizeof(cbuf));
		mh.msg_control = cbuf;
		mh.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
		h->cmsg_level = SOL_SOCKET;
		h->cmsg_type = SCM_RIGHTS;
		h->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(h), fds, nfds * sizeof(int));
	}
	(void)sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
	free(re);
	free(big);
}

/* Reads and forgets whatever the daemon answered, closing any fds it sent. */
static void
drain_replies(int sock)
{
	static uint8_t buf[GPX_MSG_MAX];
	int fds[GPX_MAX_FDS], nfds;

	for (;;) {
		ssize_t n = wire_recv(sock, buf, NULL, fds, &nfds, GPX_MAX_FDS, MSG_DONTWAIT);
		if (n <= 0 && n != -EMSGSIZE && n != -EBADMSG && n != -EMFILE && n != -E2BIG)
			break;
		wire_close_fds(fds, nfds);
	}
}

/* Runs the loop until no deferred operation (a registration) still refers to c. */
static void
settle(struct conn *c)
{
	while (c->pending > 0)
		event_base_loop(fuzz_base, EVLOOP_ONCE);
}

static void
run_input(const uint8_t *data, size_t size)
{
	int sp[2];
	struct conn *c;
	size_t off = 0;

	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sp) < 0)
		return;
	if ((c = conn_new(sp[0])) == NULL) {
		close(sp[0]);
		close(sp[1]);
		return;
	}
	while (size - off >= 3 && c->state != CONN_DEAD) {
		uint8_t flags = data[off];
		size_t len = data[off + 1] | (size_t)data[off + 2] << 8;
		bool oversize = len == FUZZ_OVERSIZE;
		off += 3;
		if (oversize)
			len = 0;
		if (len > size - off)
			len = size - off;
		send_frame(sp[1], c, flags, data + off, len, oversize);
		off += len;
		conn_input(c);
		settle(c);
		drain_replies(sp[1]);
		log_set_level("error");      /* an Admin message may have raised it */
	}
	if (c->state != CONN_DEAD)
		conn_kill(c, "end of input");
	settle(c);
	/* Transfers cancelled with chunks on a worker end there; wait for them. */
	while (engine_inflight() > 0)
		nap_us(50);
	conn_reap();
	drain_replies(sp[1]);
	close(sp[1]);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static bool ready;
	int before, after;

	if (!ready) {
		fuzz_init();
		ready = true;
		/* One connection first, so that whatever is opened once (and kept) is opened now. */
		run_input((const uint8_t *)"", 0);
	}
	before = count_fds();
	run_input(data, size);
	/* A job's last reference (and the fds it keeps) may be dropped just after it left the list. */
	after = count_fds();
	for (int i = 0; i < 20000 && after != before; i++) {
		nap_us(100);
		after = count_fds();
	}
	fuzz_leaked = after - before;
	if (fuzz_leaked != 0 && fuzz_abort_on_leak) {
		fprintf(stderr, "fuzz-decode: %d descriptors leaked by this input\n", fuzz_leaked);
		abort();
	}
	return 0;
}
