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
#include <sys/stat.h>
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

/*
 * The shared memory of the input's connection, as its client maps it (fuzz.h): the segment
 * area of its last SegArea and the ring of its Welcome.  Unmapped at the end of each input.
 */
static uint8_t *area_map, *ring_map;
static size_t ring_len;

static void
unmap(uint8_t **p, size_t len)
{
	if (*p != NULL)
		munmap(*p, len);
	*p = NULL;
}

static uint8_t *
map_fd(int fd, size_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

	return p == MAP_FAILED ? NULL : p;
}

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

/* The region ids of pairs [at, at + n) of the segment area, rewritten in place. */
static void
rewrite_pairs(const struct conn *c, uint64_t at, uint64_t n)
{
	if (area_map == NULL || at > FUZZ_MEMFD_SIZE || n > (FUZZ_MEMFD_SIZE - at) / sizeof(struct gpx_wire_pair))
		return;
	for (uint64_t i = 0; i < n; i++) {
		uint8_t *q = area_map + at + i * sizeof(struct gpx_wire_pair);
		struct gpx_wire_pair w;
		memcpy(&w, q, sizeof(w));        /* (at any offset: gpxd refuses a misaligned one itself) */
		w.src_region = own_id(c, w.src_region);
		w.dst_region = own_id(c, w.dst_region);
		memcpy(q, &w, sizeof(w));
	}
}

/*
 * Rewrites small region ids to this connection's epoch (see fuzz.h).  Returns the length of the
 * re-encoded message in *out (malloc'ed), or 0 when the bytes go out as they are; *seg_area:
 * whether it is a SegArea.
 */
static size_t
rewrite_ids(const struct conn *c, const uint8_t *p, size_t len, uint8_t **out, bool *seg_area)
{
	Gpx__ClientMsg *m = gpx__client_msg__unpack(NULL, len, p);
	bool changed = false;
	size_t n = 0;

	if (m == NULL)
		return 0;
	*seg_area = m->body_case == GPX__CLIENT_MSG__BODY_SEG_AREA;
	switch (m->body_case) {
	case GPX__CLIENT_MSG__BODY_TRANSFER:
		changed = own_id(c, m->transfer->src_region) != m->transfer->src_region ||
		    own_id(c, m->transfer->dst_region) != m->transfer->dst_region;
		m->transfer->src_region = own_id(c, m->transfer->src_region);
		m->transfer->dst_region = own_id(c, m->transfer->dst_region);
		rewrite_pairs(c, m->transfer->pair_offset, m->transfer->pair_count);
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
	bool seg_area = false;
	size_t rlen = oversize ? 0 : rewrite_ids(c, p, len, &re, &seg_area);
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
	if (seg_area && nfds > 0 && ((flags >> 2) & 3) == FUZZ_FD_MEMFD) {
		unmap(&area_map, FUZZ_MEMFD_SIZE);
		area_map = map_fd(fds[0], FUZZ_MEMFD_SIZE);
	}
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
	free(re);
	free(big);
}

/* Maps the ring that a Welcome (in buf, n bytes) brought in fd. */
static void
map_ring(const uint8_t *buf, size_t n, int fd)
{
	Gpx__DaemonMsg *m = gpx__daemon_msg__unpack(NULL, n, buf);
	struct stat st;

	if (m != NULL && m->body_case == GPX__DAEMON_MSG__BODY_REPLY && m->reply->body_case == GPX__REPLY__BODY_WELCOME &&
	    fstat(fd, &st) == 0 && st.st_size >= (off_t)sizeof(struct gpx_ring_hdr)) {
		unmap(&ring_map, ring_len);
		ring_len = (size_t)st.st_size;
		ring_map = map_fd(fd, ring_len);
	}
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
}

/* Reads whatever the daemon answered, closing any fds it sent, the ring mapped first. */
static void
drain_replies(int sock)
{
	static uint8_t buf[GPX_MSG_MAX];
	int fds[GPX_MAX_FDS], nfds;

	for (;;) {
		ssize_t n = wire_recv(sock, buf, NULL, fds, &nfds, GPX_MAX_FDS, MSG_DONTWAIT);
		if (n <= 0 && n != -EMSGSIZE && n != -EBADMSG && n != -EMFILE && n != -E2BIG)
			break;
		if (n > 0 && nfds == 1)
			map_ring(buf, (size_t)n, fds[0]);
		wire_close_fds(fds, nfds);
	}
}

/*
 * A poke (fuzz.h): the bytes at p written into shared memory.  After one into the ring, the
 * region ids of the submissions it shows queued are rewritten and the queues polled.
 */
static void
poke(struct conn *c, uint8_t flags, const uint8_t *p, size_t len)
{
	uint8_t *m = flags == FUZZ_POKE_RING ? ring_map : area_map;
	const size_t size = flags == FUZZ_POKE_RING ? ring_len : FUZZ_MEMFD_SIZE;

	if (m == NULL || len < 4)
		return;
	const size_t at = (p[0] | (size_t)p[1] << 8 | (size_t)p[2] << 16 | (size_t)p[3] << 24) % size;
	len -= 4;
	memcpy(m + at, p + 4, len < size - at ? len : size - at);
	if (flags != FUZZ_POKE_RING || c->cq == NULL)
		return;
	struct gpx_ring_hdr *h = (struct gpx_ring_hdr *)ring_map;
	const uint32_t entries = c->cq->entries;
	const uint64_t head = __atomic_load_n(&h->sq_head, __ATOMIC_ACQUIRE);
	const uint64_t tail = __atomic_load_n(&h->sq_tail, __ATOMIC_ACQUIRE);
	if (gpx_ring_size(entries) <= ring_len && tail - head <= entries)
		for (uint64_t i = head; i != tail; i++) {
			struct gpx_sqe *e = gpx_sq_slot(h, entries, i);
			e->src_region = own_id(c, e->src_region);
			e->dst_region = own_id(c, e->dst_region);
		}
	conn_poll_all(SQ_POLL);
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
		if ((flags == FUZZ_POKE_AREA || flags == FUZZ_POKE_RING) && !oversize)
			poke(c, flags, data + off, len);
		else {
			send_frame(sp[1], c, flags, data + off, len, oversize);
			conn_input(c);
		}
		off += len;
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
	unmap(&area_map, FUZZ_MEMFD_SIZE);
	unmap(&ring_map, ring_len);
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
