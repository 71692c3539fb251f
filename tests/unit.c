/*
 * Unit tests of gpxd's internals, linked against the daemon's own library (libgpxd.la): the
 * configuration parser, export names and rules, the framing and fd passing of proto/wire.c,
 * the bounded unpack arena, region lifetimes (use, revoke, the mapping closed by the last
 * user), the completion queue's credits, doorbell and broken-client detection, the check of
 * segment lists and the engine's cutting of jobs into chunks.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "daemon/gpxd.h"
#include "tests/tap.h"
#include "tests/util.h"

static char tmpdir[64];

/* Our own descriptors, less the one reading the directory. */
static int
count_fds(void)
{
	int n = fds_in("/proc/self/fd");

	return n < 0 ? n : n - 1;
}

/* ---- conf.c ---- */

static const char *
conf_file(const char *text)
{
	static char path[128];
	static int n;
	FILE *f;

	snprintf(path, sizeof(path), "%s/gpxd-%d.conf", tmpdir, n++);
	if ((f = fopen(path, "w")) == NULL)
		tap_bail("cannot write %s", path);
	fputs(text, f);
	fclose(f);
	return path;
}

/* Loads text into a fresh conf; returns conf_load's result, the conf stays in *c. */
static int
load(struct conf *c, const char *text, char *err, size_t errlen)
{
	conf_defaults(c);
	return conf_load(c, conf_file(text), err, errlen);
}

static void
test_conf(void)
{
	struct conf c;
	char err[512];

	conf_defaults(&c);
	ok(strcmp(c.socket_path, GPX_DEFAULT_SOCKET) == 0 && c.socket_mode == 0660 && c.ring_entries == 4096 &&
	    c.workers == 2 && c.chunk_size == 2u << 20 && !c.trust_legacy_ipc && c.path == NULL,
	    "conf_defaults: documented defaults");
	conf_free(&c);

	int r = load(&c,
	    "# a comment\n"
	    "[daemon]\n"
	    "socket = /run/test/gpxd.sock\n"
	    "socket_mode = 0640\n"
	    "socket_group = gpx\n"
	    "admin_group = wheel\n"
	    "workers = 4\n"
	    "blocking_threads = 3\n"
	    "chunk_size = 4M\n"
	    "ring_entries = 1024\n"
	    "max_segments = 1000\n"
	    "log_level = debug\n"
	    "idle_timeout = 30\n"
	    "metrics = 127.0.0.1:9464\n"
	    "[cuda]\n"
	    "enable = no\n"
	    "trust_legacy_ipc = yes\n"
	    "sm_copy = off\n"
	    "sm_copy_blocks = 16\n"
	    "[limits]\n"
	    "connections_per_uid = 10\n"
	    "regions_per_uid = 100\n"
	    "region_bytes_per_uid = 2G\n"
	    "exports_per_uid = 5\n"
	    "inflight_per_uid = 1000\n", err, sizeof(err));
	ok(r == 0, "conf_load: a file setting every key loads (%s)", r ? err : "ok");
	ok(strcmp(c.socket_path, "/run/test/gpxd.sock") == 0 && c.socket_mode == 0640 &&
	    strcmp(c.socket_group, "gpx") == 0 && strcmp(c.admin_group, "wheel") == 0,
	    "conf_load: [daemon] socket, mode (octal), groups");
	ok(c.workers == 4 && c.blocking_threads == 3 && c.chunk_size == 4u << 20 && c.ring_entries == 1024 &&
	    c.max_segs == 1000 && strcmp(c.log_level, "debug") == 0 && c.idle_timeout_s == 30 &&
	    strcmp(c.metrics_listen, "127.0.0.1:9464") == 0, "conf_load: [daemon] numbers, with a size suffix");
	ok(!c.cuda && c.trust_legacy_ipc && !c.sm_copy && c.sm_copy_blocks == 16, "conf_load: [cuda] booleans");
	ok(c.max_conns_per_uid == 10 && c.max_regions_per_uid == 100 && c.max_region_bytes_per_uid == 2ULL << 30 &&
	    c.max_exports_per_uid == 5 && c.max_inflight_per_uid == 1000, "conf_load: [limits]");
	ok(c.path != NULL && strstr(c.path, tmpdir) == c.path, "conf_load: remembers the file it came from");
	conf_free(&c);

	static const struct {
		const char *text;
		uint64_t want;
	} sizes[] = {
		{ "[daemon]\nchunk_size = 64k\n", 64 << 10 },
		{ "[daemon]\nchunk_size = 64K\n", 64 << 10 },
		{ "[daemon]\nchunk_size = 1G\n", 1 << 30 },
		{ "[daemon]\nchunk_size = 8192\n", 8192 },
		{ "[daemon]\nchunk_size = 0x10000\n", 0x10000 },
		{ "[daemon]\nchunk_size = 3m\n", 3 << 20 },
	};
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		r = load(&c, sizes[i].text, err, sizeof(err));
		ok(r == 0 && c.chunk_size == sizes[i].want, "size suffix: %.*s -> %llu",
		    (int)strcspn(sizes[i].text + 9, "\n"), sizes[i].text + 9, (unsigned long long)sizes[i].want);
		conf_free(&c);
	}

	static const char *bad[] = {
		"[daemon]\nworkers = 0\n",
		"[daemon]\nworkers = 257\n",
		"[daemon]\nworkers = four\n",
		"[daemon]\nworkers = -1\n",
		"[daemon]\nworkers = 4X\n",
		"[daemon]\nworkers =\n",
		"[daemon]\nring_entries = 100\n",
		"[daemon]\nring_entries = 4\n",
		"[daemon]\nchunk_size = 1K\n",
		"[daemon]\nchunk_size = 2G\n",
		"[daemon]\nchunk_size = 99999999999999999G\n",
		"[daemon]\nchunk_size = 1.5M\n",
		"[daemon]\nsocket = relative/gpxd.sock\n",
		"[daemon]\nsocket_mode = 0999\n",
		"[daemon]\nsocket_mode = 1777\n",
		"[daemon]\nsocket_mode =\n",
		"[daemon]\nidle_timeout = 1.5\n",
		"[cuda]\nenable = maybe\n",
		"[limits]\nregion_bytes_per_uid = 18446744073709551616\n",
		"[limits]\nconnections_per_uid = 0\n",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		const char *kv = strchr(bad[i], '\n') + 1;
		int len = (int)strcspn(kv, "\n");
		r = load(&c, bad[i], err, sizeof(err));
		ok(r < 0 && strstr(err, ":2:") != NULL && strstr(err, "bad value") != NULL,
		    "bad value refused, naming line 2: %.*s (%s)", len, kv, r < 0 ? err : "accepted");
		conf_free(&c);
	}

	r = load(&c, "[daemon]\nworkers = 2\ncolour = blue\n", err, sizeof(err));
	ok(r < 0 && strstr(err, "unknown key 'colour'") != NULL && strstr(err, ":3:") != NULL,
	    "an unknown key is an error naming it and its line (%s)", err);
	conf_free(&c);
	r = load(&c, "[nonsense]\nworkers = 2\n", err, sizeof(err));
	ok(r < 0 && strstr(err, "unknown key") != NULL, "a known key in an unknown section is an error (%s)", err);
	conf_free(&c);
	r = load(&c, "[daemon\nworkers = 2\n", err, sizeof(err));
	ok(r < 0 && strstr(err, ":1:") != NULL, "a syntax error is an error naming its line (%s)", err);
	conf_free(&c);
	conf_defaults(&c);
	r = conf_load(&c, "/nonexistent/gpxd.conf", err, sizeof(err));
	ok(r < 0 && strstr(err, "/nonexistent/gpxd.conf") != NULL && strstr(err, strerror(ENOENT)) != NULL,
	    "a missing file is an error naming it (%s)", err);
	conf_free(&c);
	r = load(&c, "", err, sizeof(err));
	ok(r == 0 && c.ring_entries == 4096, "an empty file keeps the defaults");
	conf_free(&c);
}

/* ---- export.c ---- */

static void
test_exports(void)
{
	char name[80];

	ok(export_name_ok("kv.cache/prefill-0:layer_3"), "export_name_ok: letters, digits and ._:/-");
	memset(name, 'a', 64);
	name[64] = '\0';
	ok(export_name_ok(name), "export_name_ok: 64 bytes");
	name[64] = 'a';
	name[65] = '\0';
	ok(!export_name_ok(name), "export_name_ok: 65 bytes refused");
	ok(!export_name_ok(""), "export_name_ok: empty refused");
	ok(!export_name_ok("a b"), "export_name_ok: space refused");
	ok(!export_name_ok("a\nb"), "export_name_ok: newline refused");
	ok(!export_name_ok("\"quote\""), "export_name_ok: quotes refused");
	ok(!export_name_ok("caf\xc3\xa9"), "export_name_ok: non-ASCII refused");
	ok(!export_name_ok("a%s"), "export_name_ok: '%%' refused");

	struct export e = { .uid = 1000, .gid = 0 };
	gid_t groups[2];
	struct creds c = { .uid = 1000, .gid = 1000, .groups = groups };
	e.rule = GPX__EXPORT_RULE__EXPORT_UID;
	ok(export_allows(&e, &c), "uid rule admits the owner's uid");
	c.uid = 1001;
	ok(!export_allows(&e, &c), "uid rule refuses another uid");
	c.uid = 0;
	ok(export_allows(&e, &c), "uid rule admits root");
	c.uid = 1001;
	e.rule = GPX__EXPORT_RULE__EXPORT_GID;
	e.gid = 2000;
	ok(!export_allows(&e, &c), "gid rule refuses a client outside the group");
	groups[0] = 3000;
	groups[1] = 2000;
	c.ngroups = 2;
	ok(export_allows(&e, &c), "gid rule admits a supplementary member");
	c.ngroups = 0;
	c.gid = 2000;
	ok(export_allows(&e, &c), "gid rule admits a primary member");
	c.gid = 1001;
	e.rule = GPX__EXPORT_RULE__EXPORT_ANY;
	ok(export_allows(&e, &c), "any rule admits anyone");
	e.rule = (Gpx__ExportRule)7;
	ok(!export_allows(&e, &c), "an unknown rule admits no one but the owner and root");
}

/* ---- wire.c ---- */

static bool
same_file(int a, int b)
{
	struct stat sa, sb;

	return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_ino == sb.st_ino && sa.st_dev == sb.st_dev;
}

static ssize_t
send_fds(int sock, const void *buf, size_t len, const int *fds, int nfds)
{
	char cbuf[CMSG_SPACE(128 * sizeof(int))];
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

	memset(cbuf, 0, sizeof(cbuf));
	if (nfds > 0) {
		mh.msg_control = cbuf;
		mh.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
	}
	return sendmsg(sock, &mh, MSG_NOSIGNAL);
}

static void
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
	n = wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, 0);
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
	    wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, 0) == GPX_MSG_MAX, "exactly GPX_MSG_MAX bytes pass");

	/* Over the cap: MSG_TRUNC -> -EMSGSIZE, and the fds that came along are closed. */
	base = count_fds();
	n = send_fds(sp[0], big, GPX_MSG_MAX + 1, two, 2);
	nfds = 99;
	ok(n == GPX_MSG_MAX + 1 && wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, 0) == -EMSGSIZE && nfds == 0,
	    "wire_recv: a datagram over the cap is -EMSGSIZE");
	ok(count_fds() == base, "wire_recv: the fds of a truncated datagram are closed");
	/* More fds than the caller takes: -E2BIG, all closed. */
	n = send_fds(sp[0], "y", 1, two, 2);
	ok(n == 1 && wire_recv(sp[1], buf, fds, &nfds, 1, 0) == -E2BIG && nfds == 0,
	    "wire_recv: 2 fds where 1 is allowed is -E2BIG");
	ok(count_fds() == base, "wire_recv: all of them are closed");
	int many[100];
	for (int i = 0; i < 100; i++)
		many[i] = efd;
	n = send_fds(sp[0], "z", 1, many, GPX_MAX_FDS + 1);
	ok(n == 1 && wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, 0) == -E2BIG && count_fds() == base,
	    "wire_recv: GPX_MAX_FDS + 1 fds -> -E2BIG, all closed");
	n = send_fds(sp[0], "z", 1, many, 100);
	ok(n == 1 && wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, 0) == -EBADMSG && count_fds() == base,
	    "wire_recv: 100 fds overflow the control buffer -> -EBADMSG, all closed");
	ok(wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, MSG_DONTWAIT) == -EAGAIN, "wire_recv: nothing there -> -EAGAIN");

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
	ok(wire_send_msg(sp[0], &m.base, NULL, 0) == 0 && (n = wire_recv(sp[1], buf, fds, &nfds, 0, 0)) > 0,
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
	ok(n == 0 && wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, 0) == 0 && nfds == 0 && count_fds() == base,
	    "wire_recv: an empty datagram with 2 fds is 0, and the fds are closed");
	close(sp[0]);
	ok(wire_recv(sp[1], buf, fds, &nfds, GPX_MAX_FDS, 0) == 0, "wire_recv: EOF is 0");
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

static void
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

/* ---- region.c ---- */

static int closes;

static void
fake_close(struct region *r)
{
	(void)r;
	closes++;
}

static const struct mem_ops fake_ops = { .name = "fake", .close = fake_close };

static void
test_region(void)
{
	struct region *r = region_new();

	ok(r != NULL && atomic_load(&r->refs) == 1 && atomic_load(&r->users) == 1 && !atomic_load(&r->revoked) &&
	    r->fd == -1 && r->dev == DEV_HOST, "region_new: one ref, one user, not revoked");
	r->ops = &fake_ops;
	ok(region_use(r) && atomic_load(&r->users) == 2, "region_use takes a user");
	region_revoke(r);
	ok(atomic_load(&r->revoked) && atomic_load(&r->users) == 1 && closes == 0,
	    "region_revoke drops the owner's user; a running job keeps the mapping");
	ok(!region_use(r), "region_use fails once revoked");
	region_unuse(r);
	ok(closes == 1 && atomic_load(&r->users) == 0, "the last user closes the mapping");
	region_revoke(r);
	ok(closes == 1 && atomic_load(&r->users) == 0, "revoking twice changes nothing");
	ok(!region_use(r), "region_use fails with no user left");
	region_ref(r);
	ok(atomic_load(&r->refs) == 2, "region_ref");
	region_unref(r);
	region_unref(r);     /* freed here; the sanitizer build would see any use after */
	ok(1, "region_unref frees on the last reference");

	r = region_new();
	r->ops = &fake_ops;
	region_revoke(r);
	ok(closes == 2, "revoking an idle region closes its mapping at once");
	region_unref(r);

	/* An owner's notification queue goes with the mapping, not with the last importer. */
	char err[128];
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct cq *q = cq_new(8, efd, 1, err, sizeof(err));
	r = region_new();
	r->ops = &fake_ops;
	cq_ref(q);
	r->notify_cq = q;
	region_ref(r);                      /* an importer's handle */
	region_revoke(r);                   /* the owner leaves */
	ok(atomic_load(&q->refs) == 1, "the notify queue is released when the mapping closes, while importers remain");
	region_unref(r);
	region_unref(r);
	cq_unref(q);
}

/* ---- cq.c ---- */

static struct cq *broken_seen;
static int broken_calls;

static void
on_broken(struct cq *q)
{
	broken_seen = q;
	broken_calls++;
}

static uint64_t
efd_read(int efd)
{
	uint64_t v = 0;

	if (read(efd, &v, sizeof(v)) != sizeof(v))
		return 0;
	return v;
}

static void
test_cq(void)
{
	char err[256];
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct cq *q = cq_new(8, efd, 42, err, sizeof(err));
	int r = 0;

	cq_set_broken_hook(on_broken);
	ok(q != NULL, "cq_new (%s)", q ? "ok" : err);
	if (q == NULL)
		return;
	struct gpx_ring_hdr *h = q->ring;
	ok(h->magic == GPX_RING_MAGIC && h->version == GPX_RING_VERSION && h->entries == 8 &&
	    h->entry_size == sizeof(struct gpx_cqe) && h->head == 0 && h->tail == 0, "the ring header is set up");
	int seals = fcntl(q->ring_fd, F_GET_SEALS);
	ok(seals >= 0 && (seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
	    "the ring memfd is sealed against shrinking, growing and further sealing");
	ok(ftruncate(q->ring_fd, 0) < 0, "so the client cannot truncate it under the daemon");

	for (int i = 0; i < 8; i++)
		r |= cq_reserve(q);
	ok(r == 0 && q->inflight == 8, "8 credits on an 8-entry ring");
	ok(cq_reserve(q) == -GPX__STATUS__EBUSY, "the 9th reservation is EBUSY");
	cq_post(q, 100, 0, 5);
	struct gpx_cqe *e = gpx_ring_slot(h, 0);
	ok(h->head == 1 && e->tag == 100 && e->bytes == 5 && e->status == 0 && e->flags == 0,
	    "cq_post writes the record and publishes head");
	ok(efd_read(efd) == 1, "and rings the doorbell once");
	ok(cq_reserve(q) == -GPX__STATUS__EBUSY, "an unread record still holds its slot");
	__atomic_store_n(&h->tail, 1, __ATOMIC_RELEASE);
	ok(cq_reserve(q) == 0, "once the client moves tail, the slot is free again");
	cq_notify(q, 7, 3, 99);
	ok(h->head == 1 && h->dropped == 1, "a notification with no free slot is dropped and counted");
	cq_unreserve(q);
	ok(q->inflight == 7, "cq_unreserve gives a credit back");
	cq_notify(q, 7, 3, 99);
	e = gpx_ring_slot(h, 1);
	ok(h->head == 2 && e->tag == 7 && e->region == 3 && e->bytes == 99 && (e->flags & GPX_CQE_NOTIFY) &&
	    efd_read(efd) == 1, "a notification with room is posted, flagged, with a doorbell");
	for (int i = 0; i < 7; i++)
		cq_post(q, 200 + i, i == 3 ? GPX__STATUS__EIO : 0, 1);
	ok(h->head == 9 && q->inflight == 0 && gpx_ring_slot(h, 8)->tag == 206 && gpx_ring_slot(h, 0)->tag == 206 &&
	    gpx_ring_slot(h, 5)->status == GPX__STATUS__EIO, "records wrap around the ring");
	ok(efd_read(efd) == 7, "one doorbell per record");
	ok(cq_reserve(q) == -GPX__STATUS__EBUSY, "8 unread records and nothing in flight: EBUSY");
	__atomic_store_n(&h->tail, 9, __ATOMIC_RELEASE);
	for (int i = 0; i < 8; i++)
		r |= cq_reserve(q);
	ok(r == 0 && cq_reserve(q) == -GPX__STATUS__EBUSY, "all read: 8 credits again, then EBUSY");
	for (int i = 0; i < 8; i++)
		cq_unreserve(q);
	ok(!q->broken && broken_calls == 0, "nothing so far broke the queue");

	/* The client publishes a tail ahead of head. */
	__atomic_store_n(&h->tail, h->head + 1, __ATOMIC_RELEASE);
	ok(cq_reserve(q) == -GPX__STATUS__EPROTO && q->broken, "a tail ahead of head breaks the queue");
	ok(broken_calls == 1 && broken_seen == q, "and the broken hook is told once");
	ok(cq_reserve(q) == -GPX__STATUS__EPROTO && broken_calls == 1, "a broken queue refuses, without telling again");
	uint64_t head = h->head;
	cq_post(q, 1, 0, 0);
	ok(h->head == head, "a broken queue gets no more records");
	cq_unref(q);
	ok(fcntl(efd, F_GETFD) < 0 && errno == EBADF, "the last cq_unref closes the client's eventfd");

	/* A tail that fell more than `entries` behind. */
	efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	q = cq_new(8, efd, 43, err, sizeof(err));
	for (int i = 0; i < 8; i++) {
		cq_reserve(q);
		cq_post(q, i, 0, 0);
		__atomic_store_n(&q->ring->tail, i + 1, __ATOMIC_RELEASE);
	}
	cq_reserve(q);
	cq_post(q, 8, 0, 0);
	__atomic_store_n(&q->ring->tail, 0, __ATOMIC_RELEASE);
	ok(cq_reserve(q) == -GPX__STATUS__EPROTO && q->broken && broken_calls == 2,
	    "a tail more than `entries` behind head breaks the queue");
	cq_unref(q);

	/* A doorbell that cannot ring: the counter is full. */
	efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	q = cq_new(8, efd, 44, err, sizeof(err));
	uint64_t max = 0xfffffffffffffffeULL;
	(void)!write(efd, &max, sizeof(max));
	cq_reserve(q);
	cq_post(q, 1, 0, 0);
	ok(q->broken && broken_calls == 3, "an eventfd whose counter is full breaks the queue, without blocking");
	cq_unref(q);

	/* A client that cleared O_NONBLOCK on its eventfd cannot make the daemon block. */
	efd = eventfd(0, EFD_CLOEXEC);
	int dup_efd = dup(efd);
	q = cq_new(8, efd, 45, err, sizeof(err));
	(void)!write(dup_efd, &max, sizeof(max));
	cq_reserve(q);
	cq_post(q, 1, 0, 0);
	ok(q->broken && (fcntl(dup_efd, F_GETFL) & O_NONBLOCK), "a blocking eventfd is made non-blocking first");
	cq_unref(q);
	close(dup_efd);
	cq_set_broken_hook(NULL);
}

/* ---- xfer.c and engine.c: checking a segment list, cutting the job into chunks ---- */

#define SEGS_TOP (1ull << 62)    /* what xfer.c refuses: any byte count from 2^62 on */

struct fake_conn {
	struct conn c;
	struct rhandle hs, hd;
	struct rhandle *slot;
	unsigned char *area;
};

/* A connection with two regions of the given lengths and a segment area, without a socket. */
static void
fake_conn_init(struct fake_conn *f, uint64_t slen, uint64_t dlen, size_t area_len)
{
	memset(f, 0, sizeof(*f));
	f->c.epoch = 7;
	f->c.hcap = 1;                 /* one hash chain holds both handles */
	f->c.htab = &f->slot;
	f->hs = (struct rhandle){ .id = 7ull << 32 | 1, .r = region_new() };
	f->hd = (struct rhandle){ .id = 7ull << 32 | 2, .r = region_new(), .next = NULL };
	f->hs.next = &f->hd;
	f->slot = &f->hs;
	f->hs.r->length = slen;
	f->hd.r->length = dlen;
	f->area = mmap(NULL, area_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	f->c.area = f->area;
	f->c.area_len = area_len;
}

static void
fake_conn_free(struct fake_conn *f)
{
	munmap(f->area, f->c.area_len);
	region_unref(f->hs.r);
	region_unref(f->hd.r);
}

/* Builds a job from n segments written into the area (offset 8, so not 16-aligned). */
static int
fake_build(struct fake_conn *f, const struct gpx_wire_seg *segs, uint32_t n, struct job **j)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	char err[512];

	memcpy(f->area + 8, segs, (size_t)n * sizeof(*segs));
	t.src_region = f->hs.id;
	t.dst_region = f->hd.id;
	t.seg_count = n;
	t.area_offset = 8;
	return xfer_build(&f->c, &t, -1, j, err, sizeof(err));
}

/* What the rules say, one segment at a time: inside both regions, no sum reaching 2^62. */
static bool
segs_valid(const struct gpx_wire_seg *g, uint32_t n, uint64_t slen, uint64_t dlen)
{
	uint64_t total = 0;

	slen = slen < SEGS_TOP ? slen : SEGS_TOP - 1;
	dlen = dlen < SEGS_TOP ? dlen : SEGS_TOP - 1;
	for (uint32_t i = 0; i < n; i++) {
		if (g[i].src_offset > slen || g[i].length > slen - g[i].src_offset ||
		    g[i].dst_offset > dlen || g[i].length > dlen - g[i].dst_offset)
			return false;
		total += g[i].length;
		if (total >= SEGS_TOP)
			return false;
	}
	return true;
}

static uint64_t
unit_rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/* A random value from 0 to max. */
static uint64_t
upto(uint64_t *seed, uint64_t max)
{
	uint64_t r = unit_rnd(seed);

	return max == UINT64_MAX ? r : r % (max + 1);
}

/* A value near one of the edges the check must get right. */
static uint64_t
edge_value(uint64_t *seed, uint64_t len)
{
	static const uint64_t edges[] = { 0, 1, SEGS_TOP - 1, SEGS_TOP, 1ull << 63, UINT64_MAX };
	uint64_t r = unit_rnd(seed);

	switch (r % 4) {
	case 0:
		return edges[(r >> 8) % 6] - (r >> 16) % 3;
	case 1:
		return len - (r >> 8) % 3 + 1;
	default:
		return upto(seed, len);
	}
}

static void
test_xfer_check(void)
{
	static struct conf conf;
	struct fake_conn f;
	struct job *j = NULL;
	uint64_t seed = 0x5eed;
	bool same = true;

	conf_defaults(&conf);
	cfg = &conf;
	fake_conn_init(&f, 1 << 20, 1 << 20, 4 << 20);
	struct gpx_wire_seg *g = calloc(100000, sizeof(*g));
	/* Counts around the block size, each segment different, all inside. */
	static const uint32_t counts[] = { 1, 63, 64, 65, 129, 100000 };
	for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++) {
		uint32_t n = counts[k];
		uint64_t total = 0;
		for (uint32_t i = 0; i < n; i++) {
			g[i] = (struct gpx_wire_seg){ unit_rnd(&seed) % 4096, unit_rnd(&seed) % 4096, i % 7 * 100 };
			total += g[i].length;
		}
		int r = fake_build(&f, g, n, &j);
		bool blocks_ok = r == 0;
		for (uint32_t b = 0, t = 0; r == 0 && b < (n + SEG_BLOCK - 1) / SEG_BLOCK; b++) {
			uint64_t want = 0;
			for (uint32_t i = 0; i < (b + 1) * SEG_BLOCK && i < n; i++)
				want += g[i].length;
			blocks_ok &= j->blocks[b] == want;
			t++;
		}
		ok(r == 0 && j->nseg == n && j->total == total && memcmp(j->segs, g, n * sizeof(*g)) == 0 &&
		    blocks_ok, "%u segments from the area: accepted, copied, counted, blocks[] right", n);
		if (r == 0)
			engine_free_job(j);
	}
	/* Random lists with values at the edges, each compared with the rules segment by segment. */
	static const uint64_t lens[] = { 1 << 20, SEGS_TOP - 1, SEGS_TOP, UINT64_MAX };
	int agree = 0, refused = 0, trials = 3000;
	for (int k = 0; k < trials; k++) {
		uint64_t slen = lens[k % 4], dlen = lens[k / 4 % 4];
		uint32_t n = 1 + unit_rnd(&seed) % 150, edges = unit_rnd(&seed) % 4;
		uint64_t lim = slen < dlen ? slen : dlen;
		f.hs.r->length = slen;
		f.hd.r->length = dlen;
		for (uint32_t i = 0; i < n; i++) {
			g[i].length = upto(&seed, lim / n);
			g[i].src_offset = upto(&seed, slen - g[i].length);
			g[i].dst_offset = upto(&seed, dlen - g[i].length);
		}
		/* Up to three values at an edge, anywhere: most lists have none or one. */
		for (uint32_t e = 0; e < edges; e++) {
			struct gpx_wire_seg *h = &g[unit_rnd(&seed) % n];
			switch (unit_rnd(&seed) % 3) {
			case 0: h->length = edge_value(&seed, lim); break;
			case 1: h->src_offset = edge_value(&seed, slen); break;
			default: h->dst_offset = edge_value(&seed, dlen); break;
			}
		}
		bool want = segs_valid(g, n, slen, dlen);
		int r = fake_build(&f, g, n, &j);
		if ((r == 0) == want && (want || r == -GPX__STATUS__ERANGE))
			agree++;
		else if (same) {
			diag("trial %d: %u segments, regions %llu and %llu: got %d, the rules say %s", k, n,
			    (unsigned long long)slen, (unsigned long long)dlen, r, want ? "accept" : "refuse");
			same = false;
		}
		refused += !want;
		if (r == 0)
			engine_free_job(j);
	}
	ok(agree == trials, "%d random lists with values at the edges (%d to refuse): the check agrees "
	    "with the rules every time", trials, refused);
	f.hs.r->length = f.hd.r->length = 1ull << 61;
	g[0] = g[1] = (struct gpx_wire_seg){ 0, 0, 1ull << 61 };
	ok(fake_build(&f, g, 1, &j) == 0 && j->total == 1ull << 61, "a segment of 2^61 bytes is accepted");
	engine_free_job(j);
	ok(fake_build(&f, g, 2, &j) == -GPX__STATUS__ERANGE, "two of them, 2^62 bytes in all, are refused");
	free(g);
	fake_conn_free(&f);
}

/* The chunks a job of these lengths should be cut into, one at a time, as the engine's contract. */
struct model {
	const uint64_t *len;
	uint32_t n, seg;
	uint64_t off, left;
};

static bool
model_next(struct model *m, uint64_t max_bytes, uint32_t max_segs, struct chunk *c)
{
	if (m->left == 0)
		return false;
	while (m->off == 0 && m->len[m->seg] == 0)
		m->seg++;
	uint32_t first = m->seg, lastbyte = m->seg;
	c->seg = m->seg;
	c->off = m->off;
	c->bytes = 0;
	while (m->seg < m->n && m->seg - first < max_segs && c->bytes < max_bytes) {
		uint64_t take = m->len[m->seg] - m->off;
		if (take > max_bytes - c->bytes)
			take = max_bytes - c->bytes;
		if (take > 0)
			lastbyte = m->seg;
		c->bytes += take;
		if (m->off + take == m->len[m->seg]) {
			m->seg++;
			m->off = 0;
		} else
			m->off += take;
	}
	c->pieces = lastbyte - first + 1;
	m->left -= c->bytes;
	return true;
}

static void
test_engine_chunks(void)
{
	struct fake_conn f;
	char err[128];
	uint64_t seed = 0xc0ffee;
	int jobs = 0, agree = 0, chunks = 0;
	uint64_t *len = calloc(5000, sizeof(*len));
	struct gpx_wire_seg *g = calloc(5000, sizeof(*g));
	struct cq *q = cq_new(64, eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), 9, err, sizeof(err));

	engine_init(0, 2 << 20);       /* no workers: the test takes the chunks itself */
	fake_conn_init(&f, 1ull << 40, 1ull << 40, 1 << 20);
	for (int k = 0; k < 400; k++) {
		/* Lengths of every kind: zero (leading, inner, trailing), small, larger than a chunk. */
		uint64_t max_bytes = (uint64_t[]){ 1, 4096, 2 << 20, 1ull << 30, UINT64_MAX }[k % 5];
		uint32_t max_segs = (uint32_t[]){ 1, 3, 64, 8192, UINT32_MAX }[k / 5 % 5];
		/* Some segments longer than a chunk, but not so many chunks that the test takes long. */
		uint64_t big = max_bytes == 1 ? 8 : max_bytes == 4096 ? 20000 : 3 << 20;
		uint32_t n = 1 + unit_rnd(&seed) % (k % 4 == 0 ? 4000 : 200);
		uint64_t total = 0;
		for (uint32_t i = 0; i < n; i++) {
			uint64_t r = unit_rnd(&seed);
			len[i] = r % 5 == 0 ? 0 : r % 5 == 1 ? r % 7 : r % 5 == 2 ? (r >> 8) % big : (r >> 8) % 5000;
			if (k % 10 == 0 && (i < 70 || i + 70 > n))
				len[i] = 0;       /* zero-length runs longer than a block, at both ends */
			g[i] = (struct gpx_wire_seg){ 0, 0, len[i] };
			total += len[i];
		}
		if (total == 0)
			continue;
		struct job *j;
		if (fake_build(&f, g, n, &j) < 0 || cq_reserve(q) < 0)
			break;
		j->path = PATH_GPU0 + 7;   /* a path no worker serves */
		j->cq = q;
		j->user = user_get(getuid());
		cq_ref(q);
		atomic_fetch_add(&j->user->inflight, 1);
		engine_submit(j);
		jobs++;
		struct model m = { .len = len, .n = n, .left = total };
		struct chunk c, w;
		bool same = true;
		uint64_t moved = 0;
		while (model_next(&m, max_bytes, max_segs, &w)) {
			if (!engine_next_chunk(PATH_GPU0 + 7, &c, false, max_bytes, max_segs) || c.job != j ||
			    c.seg != w.seg || c.off != w.off || c.bytes != w.bytes || c.pieces != w.pieces) {
				if (same)
					diag("job %d (%u segments, chunks of %llu bytes, %u segments): chunk %llu+%llu "
					    "at %u+%llu in %u pieces, the model says %llu at %u+%llu in %u", k, n,
					    (unsigned long long)max_bytes, max_segs, (unsigned long long)moved,
					    (unsigned long long)c.bytes, c.seg, (unsigned long long)c.off, c.pieces,
					    (unsigned long long)w.bytes, w.seg, (unsigned long long)w.off, w.pieces);
				same = false;
				break;
			}
			moved += c.bytes;
			chunks++;
			engine_chunk_done(&c, true);     /* the last one finishes the job */
		}
		same &= !engine_next_chunk(PATH_GPU0 + 7, &c, false, max_bytes, max_segs);
		agree += same;
		__atomic_store_n(&q->ring->tail, q->ring->head, __ATOMIC_RELEASE);   /* records read */
		if (!same)
			break;
	}
	ok(jobs > 300 && agree == jobs, "%d jobs cut into %d chunks exactly as the model cuts them (zero-length "
	    "segments anywhere, chunks from 1 byte to unlimited, 1 to unlimited segments)", jobs, chunks);
	ok(engine_inflight() == 0, "every job finished with its last chunk");
	engine_shutdown();
	fake_conn_free(&f);
	cq_unref(q);
	free(len);
	free(g);
}

int
main(void)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	log_init(LOG_L_ERR, NULL, false);
	snprintf(tmpdir, sizeof(tmpdir), "%s/gpx-unit.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (mkdtemp(tmpdir) == NULL)
		tap_bail("mkdtemp");

	test_conf();
	test_exports();
	test_wire();
	test_arena();
	test_region();
	test_cq();
	test_xfer_check();
	test_engine_chunks();

	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
	(void)!system(cmd);
	return tap_done();
}
