/*
 * Unit tests of the wire (tests/unit.c runs them): the framing and descriptor passing of
 * proto/wire.c (sizes, truncation, descriptors closed on every error path, close-on-exec) and
 * the bounded arena that protobuf-c unpacks into.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "daemon/gpxd.h"
#include "tests/tap.h"
#include "tests/unit.h"
#include "tests/util.h"

/* Our own descriptors, less the one reading the directory. */
static int
count_fds(void)
{
	int n = fds_in("/proc/self/fd");

	return n < 0 ? n : n - 1;
}

/* ---- wire.c ---- */

static bool
same_file(int a, int b)
{
	struct stat sa, sb;

	return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_ino == sb.st_ino && sa.st_dev == sb.st_dev;
}

void
test_wire(void)
{
	static uint8_t buf[GPX_MSG_MAX + 16], big[2 * GPX_MSG_MAX];
	int sp[2], fds[GPX_MAX_FDS], nfds, base;
	int efd = eventfd(0, EFD_CLOEXEC), mfd = memfd_create("unit", MFD_CLOEXEC);
	ssize_t n;

	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) < 0)
		tap_bail("socketpair");
	int two[2] = { efd, mfd };
	ok(wire_send(sp[0], "hello", 5, two, 2) == 0, "wire_send: 5 bytes and 2 fds");
	n = wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, 0);
	ok(n == 5 && memcmp(buf, "hello", 5) == 0 && nfds == 2, "wire_recv: the bytes and 2 fds arrive");
	ok(nfds == 2 && same_file(fds[0], efd) && same_file(fds[1], mfd), "wire_recv: the fds are the ones sent, in order");
	ok(nfds == 2 && (fcntl(fds[0], F_GETFD) & FD_CLOEXEC) && (fcntl(fds[1], F_GETFD) & FD_CLOEXEC),
	    "wire_recv: received fds are close-on-exec");
	wire_close_fds(fds, nfds);
	ok(fds[0] == -1 && fds[1] == -1, "wire_close_fds: closes and forgets them");

	ok(wire_send(sp[0], big, GPX_MSG_MAX + 1, NULL, 0) == -EMSGSIZE, "wire_send: GPX_MSG_MAX + 1 bytes refused");
	int over[GPX_MAX_FDS + 1];
	for (int i = 0; i <= GPX_MAX_FDS; i++)
		over[i] = efd;
	ok(wire_send(sp[0], "x", 1, over, GPX_MAX_FDS + 1) == -EMSGSIZE, "wire_send: more than GPX_MAX_FDS fds refused");
	ok(wire_send(sp[0], "x", 1, over, -1) == -EMSGSIZE, "wire_send: a negative fd count refused");
	ok(wire_send(sp[0], big, GPX_MSG_MAX, NULL, 0) == 0 &&
	    wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, 0) == GPX_MSG_MAX, "exactly GPX_MSG_MAX bytes pass");

	/* Over the cap: MSG_TRUNC -> -EMSGSIZE, and the fds that came along are closed. */
	base = count_fds();
	n = send_fds(sp[0], big, GPX_MSG_MAX + 1, two, 2);
	nfds = 99;
	ok(n == GPX_MSG_MAX + 1 && wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, 0) == -EMSGSIZE && nfds == 0,
	    "wire_recv: a datagram over the cap is -EMSGSIZE");
	ok(count_fds() == base, "wire_recv: the fds of a truncated datagram are closed");
	/* More fds than the caller takes: -E2BIG, all closed. */
	n = send_fds(sp[0], "y", 1, two, 2);
	ok(n == 1 && wire_recv(sp[1], buf, NULL, fds, &nfds, 1, 0) == -E2BIG && nfds == 0,
	    "wire_recv: 2 fds where 1 is allowed is -E2BIG");
	ok(count_fds() == base, "wire_recv: all of them are closed");
	int many[100];
	for (int i = 0; i < 100; i++)
		many[i] = efd;
	n = send_fds(sp[0], "z", 1, many, GPX_MAX_FDS + 1);
	ok(n == 1 && wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, 0) == -E2BIG && count_fds() == base,
	    "wire_recv: GPX_MAX_FDS + 1 fds -> -E2BIG, all closed");
	n = send_fds(sp[0], "z", 1, many, 100);
	ok(n == 1 && wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, 0) == -EBADMSG && count_fds() == base,
	    "wire_recv: 100 fds overflow the control buffer -> -EBADMSG, all closed");
	/* Fds this process cannot take (its descriptor limit): -EMFILE, the bytes' length told, none left open. */
	struct rlimit rl0, rl;
	size_t len = 0;
	getrlimit(RLIMIT_NOFILE, &rl0);
	int lowest = dup(0);            /* the lowest free number: the limit lets that one be had */
	close(lowest);
	rl = (struct rlimit){ (rlim_t)lowest + 1, rl0.rlim_max };
	n = send_fds(sp[0], "four", 4, many, 3);
	int cut = setrlimit(RLIMIT_NOFILE, &rl);
	ssize_t got = wire_recv(sp[1], buf, &len, fds, &nfds, GPX_MAX_FDS, 0);
	setrlimit(RLIMIT_NOFILE, &rl0);
	ok(n == 4 && cut == 0 && got == -EMFILE && len == 4 && nfds == 0 && count_fds() == base,
	    "wire_recv: 3 fds when 1 more may be open -> -EMFILE, the 4 bytes told (%zd, %zu), all closed", got, len);
	ok(wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, MSG_DONTWAIT) == -EAGAIN, "wire_recv: nothing there -> -EAGAIN");

	/* A message that packs larger than the cap is refused by wire_send_msg. */
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	size_t ns = 3000;
	Gpx__Segment *segs = calloc(ns, sizeof(*segs)), **sp2 = calloc(ns, sizeof(*sp2));
	for (size_t i = 0; i < ns; i++) {
		gpx__segment__init(&segs[i]);
		segs[i].src_offset = segs[i].dst_offset = segs[i].length = UINT64_MAX;
		sp2[i] = &segs[i];
	}
	t.n_segments = ns;
	t.segments = sp2;
	m.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	m.transfer = &t;
	ok(wire_send_msg(sp[0], &m.base, NULL, 0) == -EMSGSIZE, "wire_send_msg: a message packing over the cap is refused");
	t.n_segments = 1;
	ok(wire_send_msg(sp[0], &m.base, NULL, 0) == 0 && (n = wire_recv(sp[1], buf, NULL, fds, &nfds, 0, 0)) > 0,
	    "wire_send_msg: a small one goes through");
	Gpx__ClientMsg *u = n > 0 ? gpx__client_msg__unpack(NULL, n, buf) : NULL;
	ok(u != NULL && u->body_case == GPX__CLIENT_MSG__BODY_TRANSFER && u->transfer->n_segments == 1 &&
	    u->transfer->segments[0]->length == UINT64_MAX, "and decodes to what was sent");
	if (u != NULL)
		gpx__client_msg__free_unpacked(u, NULL);
	free(segs);
	free(sp2);

	/* An empty datagram reads as EOF: whatever rode along with it must not stay open. */
	n = send_fds(sp[0], "", 0, two, 2);
	ok(n == 0 && wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, 0) == 0 && nfds == 0 && count_fds() == base,
	    "wire_recv: an empty datagram with 2 fds is 0, and the fds are closed");
	close(sp[0]);
	ok(wire_recv(sp[1], buf, NULL, fds, &nfds, GPX_MAX_FDS, 0) == 0, "wire_recv: EOF is 0");
	ok(wire_send(sp[1], "x", 1, NULL, 0) == -EPIPE, "wire_send: to a closed peer is -EPIPE, no SIGPIPE");
	close(sp[1]);
	close(efd);
	close(mfd);
}

/* ---- the bounded arena ---- */

static size_t
put_varint(uint8_t *p, uint64_t v)
{
	size_t n = 0;

	while (v >= 0x80) {
		p[n++] = (uint8_t)(v | 0x80);
		v >>= 7;
	}
	p[n++] = (uint8_t)v;
	return n;
}

void
test_arena(void)
{
	static uint8_t msg[GPX_MSG_MAX];
	struct wire_arena *a = wire_arena_new(GPX_ARENA_SIZE);
	Gpx__ClientMsg *m;
	size_t n;

	ok(a != NULL && a->used == 0 && a->cap == GPX_ARENA_SIZE, "wire_arena_new");

	/* A hostile message: a Transfer of nothing but empty segments, filling the whole cap. */
	size_t k = (GPX_MSG_MAX - 8) / 2;
	size_t body = 2 * k;
	n = 0;
	msg[n++] = (8 << 3) | 2;            /* ClientMsg.transfer */
	n += put_varint(msg + n, body);
	for (size_t i = 0; i < k; i++) {
		msg[n++] = (5 << 3) | 2;    /* Transfer.segments, empty */
		msg[n++] = 0;
	}
	m = gpx__client_msg__unpack(&a->pa, n, msg);
	ok(m == NULL && a->failed, "%zu empty segments in %zu bytes (%zu decoded bytes) do not fit the arena", k, n,
	    k * (sizeof(Gpx__Segment) + sizeof(void *)));
	ok(a->used <= a->cap, "the arena never hands out more than its cap (%zu of %zu)", a->used, a->cap);
	wire_arena_reset(a);
	ok(a->used == 0 && !a->failed, "wire_arena_reset");

	/* The largest inline request libgpxclient sends fits easily. */
	size_t ns = (GPX_MSG_MAX - 256) / 40;
	Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	Gpx__Segment *segs = calloc(ns, sizeof(*segs)), **ptrs = calloc(ns, sizeof(*ptrs));
	for (size_t i = 0; i < ns; i++) {
		gpx__segment__init(&segs[i]);
		segs[i].src_offset = segs[i].dst_offset = segs[i].length = UINT64_MAX;
		ptrs[i] = &segs[i];
	}
	t.n_segments = ns;
	t.segments = ptrs;
	cm.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	cm.transfer = &t;
	n = gpx__client_msg__get_packed_size(&cm);
	ok(n <= GPX_MSG_MAX, "%zu inline segments of maximal values pack into %zu bytes", ns, n);
	gpx__client_msg__pack(&cm, msg);
	m = gpx__client_msg__unpack(&a->pa, n, msg);
	ok(m != NULL && m->transfer->n_segments == ns && !a->failed, "and unpack within the arena (%zu bytes used)", a->used);
	free(segs);
	free(ptrs);
	wire_arena_reset(a);

	/* A length prefix claiming 2 GiB in a 12-byte message: refused, nothing big allocated. */
	n = 0;
	msg[n++] = (3 << 3) | 2;            /* ClientMsg.register */
	n += put_varint(msg + n, 1ULL << 31);
	msg[n++] = (5 << 3) | 2;
	msg[n++] = 0;
	m = gpx__client_msg__unpack(&a->pa, n, msg);
	ok(m == NULL && a->used < 4096, "a claimed 2 GiB field in a %zu-byte message is refused without allocating", n);
	wire_arena_reset(a);
	ok(a->pa.alloc(a->pa.allocator_data, SIZE_MAX) == NULL && a->failed, "an allocation of SIZE_MAX fails cleanly");
	wire_arena_reset(a);
	ok(a->pa.alloc(a->pa.allocator_data, GPX_ARENA_SIZE + 1) == NULL && a->used == 0,
	    "an allocation over the cap fails and uses nothing");
	void *p1 = a->pa.alloc(a->pa.allocator_data, 3), *p2 = a->pa.alloc(a->pa.allocator_data, 1);
	ok(p1 != NULL && p2 != NULL && ((uintptr_t)p1 % 16) == 0 && ((uintptr_t)p2 % 16) == 0,
	    "arena allocations are 16-byte aligned");
	free(a);
}
