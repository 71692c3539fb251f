/*
 * gpx-bench's remote modes: copies between this daemon and a peer daemon (the fabric), with
 * the bytes crossing the peers' data transport.
 *
 *   remote      write and read bandwidth, 64 KiB to 16 MiB, through gpxd -> peer gpxd,
 *               against the same bytes sent over one plain TCP connection on loopback with a
 *               one-byte answer per message (the kernel path the tcp transport uses)
 *   remote-lat  4 KiB write, submit to completion: p50 and p99 against the TCP round trip
 *   remote-import  import only: GPX_BENCH_IMPORT=NODE:NAME, an export another node's daemon
 *               holds (tests/bench-export.c keeps one there); RDMA READ and WRITE bandwidth,
 *               1 MiB to 8 MiB, and 4 KiB write latency, against raw verbs in this process to
 *               the same node with the same queue pairs, rails and chunks (GPX_BENCH_VERBS:
 *               bench-export serves the same buffer through librdmacm beside the export)
 *
 * Needs a second gpxd peered with the one under test: GPX_BENCH_PEER=its socket and
 * GPX_BENCH_PEER_NODE=its node name; the modes skip without them.  The TCP anchor only means
 * something when both daemons run on this machine (tests/fabric-tcp.test's setup); between
 * RDMA nodes the anchor is remote-import's raw verbs (and tests/vm-rdma.test runs ib_write_bw,
 * ib_read_bw and ib_send_lat beside it).
 */
#include "config.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "tests/bench.h"
#include "tests/bench-verbs.h"

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)

/* ---- the anchor: one TCP connection on loopback, an echo thread answering each message ---- */

struct tcp_pair {
	int tx, rx;
	pthread_t th;
	unsigned char *sink;
	size_t len;
};

static void *
tcp_sink(void *p)
{
	struct tcp_pair *t = p;
	char ack = 1;

	for (;;) {
		size_t got = 0;
		while (got < t->len) {
			ssize_t n = read(t->rx, t->sink + got, t->len - got);
			if (n <= 0)
				return NULL;
			got += n;
		}
		if (write(t->rx, &ack, 1) != 1)
			return NULL;
	}
}

static int
tcp_open(struct tcp_pair *t, size_t len)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t sl = sizeof(sa);
	int one = 1, l = socket(AF_INET, SOCK_STREAM, 0);

	if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(l, 1) < 0 ||
	    getsockname(l, (struct sockaddr *)&sa, &sl) < 0)
		return -1;
	t->tx = socket(AF_INET, SOCK_STREAM, 0);
	if (t->tx < 0 || connect(t->tx, (struct sockaddr *)&sa, sizeof(sa)) < 0 || (t->rx = accept(l, NULL, NULL)) < 0)
		return -1;
	close(l);
	setsockopt(t->tx, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	setsockopt(t->rx, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	t->len = len;
	if ((t->sink = malloc(len)) == NULL)
		return -1;
	return pthread_create(&t->th, NULL, tcp_sink, t) == 0 ? 0 : -1;
}

static void
tcp_close(struct tcp_pair *t)
{
	shutdown(t->tx, SHUT_RDWR);
	close(t->tx);
	pthread_join(t->th, NULL);
	close(t->rx);
	free(t->sink);
}

/* ---- the peer: a buffer registered with the other daemon, exported, imported here ---- */

struct remote_arg {
	struct bench_ctx *b;
	gpx_conn *peer;
	struct bench_buf local;
	int pfd;
	void *pptr;
	gpx_region pregion, rregion;
	size_t cap;
	uint64_t len;
	bool read;
	struct tcp_pair tcp;
	const unsigned char *src;
	struct verbs_client *verbs;  /* remote-import's anchor, when there is a raw-verbs server */
	size_t chunk;
};

static int
tcp_op(void *p)
{
	struct remote_arg *a = p;
	char ack;

	for (size_t sent = 0; sent < a->len;) {
		ssize_t n = write(a->tcp.tx, a->src + sent, a->len - sent);
		if (n <= 0)
			return -GPX_ESYS;
		sent += n;
	}
	return read(a->tcp.tx, &ack, 1) == 1 ? 0 : -GPX_ESYS;
}

static int
gpx_op(void *p)
{
	struct remote_arg *a = p;

	if (a->read)
		return gpx_copy_sync(a->b->conn, a->rregion, 0, a->local.region, 0, a->len);
	return gpx_copy_sync(a->b->conn, a->local.region, 0, a->rregion, 0, a->len);
}

static int
remote_setup(struct bench_ctx *b, const char *mode, struct remote_arg *a, size_t cap)
{
	const char *sock = getenv("GPX_BENCH_PEER"), *node = getenv("GPX_BENCH_PEER_NODE");
	char name[160];
	int r;

	memset(a, 0, sizeof(*a));
	a->b = b;
	a->cap = cap;
	if (sock == NULL || node == NULL) {
		bench_skip(b, mode, "needs a peered second gpxd: GPX_BENCH_PEER=SOCKET GPX_BENCH_PEER_NODE=NODE");
		return BENCH_SKIP;
	}
	if ((r = gpx_connect(sock, "gpx-bench-peer", &a->peer)) < 0)
		return bench_fail(b, r, "connecting to the peer daemon");
	if ((r = gpx_host_alloc(cap, &a->pfd, &a->pptr)) < 0 ||
	    (r = gpx_register_host(a->peer, a->pfd, 0, cap, 0, &a->pregion)) < 0)
		return bench_fail(b, r, "registering memory with the peer daemon");
	snprintf(name, sizeof(name), "gpx-bench-%d", (int)getpid());
	if ((r = gpx_export_remote(a->peer, a->pregion, name, NULL, NULL)) < 0)
		return bench_fail(b, r, "exporting it to peers");
	snprintf(name, sizeof(name), "%s:gpx-bench-%d", node, (int)getpid());
	/* A daemon started with the run (--spawn) may not have reached its peer yet: up to 5 s. */
	for (int i = 0; (r = gpx_import(b->conn, name, &a->rregion, NULL)) == -GPX_ENOENT && i < 50; i++)
		usleep(100000);
	if (r < 0)
		return bench_fail(b, r, "importing it through the daemon under test");
	if ((r = bench_buf_new(b, cap, &a->local)) < 0)
		return r;
	bench_fill(a->local.ptr, cap, 7);
	a->src = a->local.ptr;
	return 0;
}

static void
remote_teardown(struct remote_arg *a)
{
	if (a->local.ptr != NULL)
		bench_buf_free(a->b, &a->local);
	if (a->peer != NULL)
		gpx_close(a->peer);
	if (a->pptr != NULL)
		gpx_host_free(a->pfd, a->pptr, a->cap);
}

static int
mode_remote(struct bench_ctx *b)
{
	static const uint64_t sizes[] = { 64 * KiB, 1 * MiB, 16 * MiB };
	struct remote_arg a;
	size_t cap = 16 * MiB;
	int r;

	if (cap > b->max_size)
		cap = b->max_size;
	if ((r = remote_setup(b, "remote", &a, cap)) != 0) {
		remote_teardown(&a);
		return r;
	}
	/* Check first: one write and one read across must carry the bytes intact. */
	a.len = cap;
	if ((r = gpx_op(&a)) < 0 || memcmp(a.pptr, a.local.ptr, cap) != 0) {
		remote_teardown(&a);
		fprintf(stderr, "gpx-bench: remote: a write across did not arrive intact\n");
		return -1;
	}
	bench_table_begin(b, "remote", "copies to and from a peer daemon: plain TCP on loopback vs gpx");
	for (int dir = 0; dir < 2; dir++)
		for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && sizes[i] <= cap; i++) {
			struct bench_pair p;
			char what[64], s[32];
			a.len = sizes[i];
			a.read = dir == 1;
			if (tcp_open(&a.tcp, a.len) < 0) {
				remote_teardown(&a);
				return bench_fail(b, -GPX_ESYS, "a loopback TCP connection");
			}
			r = bench_pair_measure(b, tcp_op, gpx_op, &a, &p);
			tcp_close(&a.tcp);
			if (r < 0) {
				remote_teardown(&a);
				return bench_fail(b, r, "remote copies");
			}
			snprintf(what, sizeof(what), "%s %s", dir ? "read" : "write", bench_size_str(a.len, s, sizeof(s)));
			struct bench_row row = { .what = what, .metric = "GB/s", .direct = a.len / p.direct / 1e9,
			    .gpx = a.len / p.gpx / 1e9, .bytes = a.len, .target = a.len >= MiB ? "fabric.tcp.large" : NULL };
			bench_table_row(b, &row);
			bench_pair_free(&p);
		}
	bench_table_end(b, "direct: the same bytes over one loopback TCP connection in this process (as many as "
	    "the tcp transport keeps to a peer), a 1-byte answer each; "
	    "gpx: client -> gpxd -> peer gpxd (tcp transport) -> completion");
	remote_teardown(&a);
	return 0;
}

static int
mode_remote_lat(struct bench_ctx *b)
{
	struct remote_arg a;
	int r;

	if ((r = remote_setup(b, "remote-lat", &a, 64 * KiB)) != 0) {
		remote_teardown(&a);
		return r;
	}
	a.len = 4 * KiB;
	bench_table_begin(b, "remote-lat", "4 KiB to a peer daemon, submit to completion: TCP round trip vs gpx");
	if (tcp_open(&a.tcp, a.len) < 0) {
		remote_teardown(&a);
		return bench_fail(b, -GPX_ESYS, "a loopback TCP connection");
	}
	struct bench_pair p;
	r = bench_pair_measure(b, tcp_op, gpx_op, &a, &p);
	tcp_close(&a.tcp);
	if (r < 0) {
		remote_teardown(&a);
		return bench_fail(b, r, "remote 4 KiB copies");
	}
	struct bench_row row = { .what = "4 KiB write, one at a time", .metric = "us", .direct = p.direct * 1e6,
	    .gpx = p.gpx * 1e6, .lower_is_better = true, .bytes = a.len };
	bench_table_row(b, &row);
	bench_pair_free(&p);
	bench_table_end(b, "medians of per-call times over the timed runs");
	remote_teardown(&a);
	return 0;
}

/* ---- import only: the exporting side is another node ---- */

/* Whether the kernel knows an RDMA device (a NIC or Soft-RoCE). */
static bool
rdma_devices(void)
{
	DIR *d = opendir("/sys/class/infiniband");
	struct dirent *e;
	bool any = false;

	while (d != NULL && !any && (e = readdir(d)) != NULL)
		any = e->d_name[0] != '.';
	if (d != NULL)
		closedir(d);
	return any;
}

/* The anchor's copy; nothing where there is no anchor (its column then says so). */
static int
direct_op(void *p)
{
#ifdef HAVE_RDMA
	struct remote_arg *a = p;

	if (a->verbs != NULL)
		return verbs_copy(a->verbs, a->read, a->len, a->chunk) == 0 ? 0 : -GPX_EIO;
#else
	(void)p;
#endif
	return 0;
}

/*
 * The anchor: GPX_BENCH_VERBS=ADDR:PORT[,ADDR:PORT...] (one address a rail) of a raw-verbs
 * server beside the export (tests/bench-export.c serves one), GPX_BENCH_VERBS_QPS queue pairs
 * to each (default 2, gpxd's default queue_pairs) and chunks of GPX_BENCH_VERBS_CHUNK (default
 * 256K): set them to what the daemons under test use.  Without it the rows hold gpx alone.
 */
static void
verbs_anchor(struct remote_arg *a, char *note, size_t len)
{
	const char *spec = getenv("GPX_BENCH_VERBS");

	snprintf(note, len, "direct: not measured (GPX_BENCH_VERBS=ADDR:PORT,... names no raw-verbs server)");
#ifdef HAVE_RDMA
	const char *q = getenv("GPX_BENCH_VERBS_QPS"), *ch = getenv("GPX_BENCH_VERBS_CHUNK");
	uint64_t chunk = 256 * KiB;
	char why[256];

	if (spec == NULL)
		return;
	if (ch != NULL && (bench_parse_size(ch, &chunk) < 0 || chunk == 0 || chunk > (1u << 30))) {
		snprintf(note, len, "direct: not measured: GPX_BENCH_VERBS_CHUNK=%s is not a size", ch);
		return;
	}
	a->chunk = chunk;
	if ((a->verbs = verbs_connect(spec, q ? atoi(q) : 2, a->local.ptr, a->cap, why, sizeof(why))) == NULL) {
		snprintf(note, len, "direct: not measured: raw verbs to %s: %s", spec, why);
		return;
	}
	if (verbs_remote_len(a->verbs) < a->cap) {
		snprintf(note, len, "direct: not measured: the raw-verbs server offers %zu bytes, fewer than %zu",
		    verbs_remote_len(a->verbs), a->cap);
		verbs_close(a->verbs);
		a->verbs = NULL;
		return;
	}
	snprintf(note, len, "direct: raw verbs in this process (librdmacm + libibverbs), %d queue pairs on %d rail%s "
	    "(%s), each copy in %llu KiB chunks posted round robin over them (READs in 64 KiB requests, two in "
	    "flight a queue pair, ack timeout 67 ms, as gpxd paces them), every request signalled and its "
	    "completion polled, as ib_read_bw / ib_write_bw do; gpx: client -> gpxd -> RDMA to the exporting node's "
	    "memory -> completion", verbs_queue_pairs(a->verbs), verbs_rails(a->verbs),
	    verbs_rails(a->verbs) == 1 ? "" : "s", spec, (unsigned long long)(chunk / KiB));
#else
	(void)a;
	if (spec != NULL)
		snprintf(note, len, "direct: not measured: gpx-bench was built without rdma-core");
#endif
}

static int
mode_remote_import(struct bench_ctx *b)
{
	static const uint64_t sizes[] = { 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB };
	const char *name = getenv("GPX_BENCH_IMPORT");
	struct remote_arg a;
	uint64_t rlen = 0;
	char note[512];
	int r;

	memset(&a, 0, sizeof(a));
	a.b = b;
	if (name == NULL) {
		bench_skip(b, "remote-import", rdma_devices() ? "needs GPX_BENCH_IMPORT=NODE:NAME, exported by "
		    "another node" : "no RDMA device on this machine (/sys/class/infiniband is empty), and "
		    "needs GPX_BENCH_IMPORT=NODE:NAME, exported by another node");
		return BENCH_SKIP;
	}
	if ((r = gpx_import(b->conn, name, &a.rregion, &rlen)) < 0)
		return bench_fail(b, r, "importing the remote export");
	a.cap = rlen < 8 * MiB ? (size_t)rlen : 8 * MiB;
	if ((r = bench_buf_new(b, a.cap, &a.local)) < 0)
		return r;
	bench_fill(a.local.ptr, a.cap, 7);
	verbs_anchor(&a, note, sizeof(note));
	bench_table_begin(b, "remote-import", "copies to and from another node's export: raw verbs vs gpx");
	for (int dir = 0; dir < 2; dir++)
		for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && sizes[i] <= a.cap; i++) {
			struct bench_pair p;
			char what[64], s[32];
			a.len = sizes[i];
			a.read = dir == 0;
			r = bench_pair_measure(b, direct_op, gpx_op, &a, &p);
			if (r < 0)
				break;
			snprintf(what, sizeof(what), "%s %s", a.read ? "read" : "write", bench_size_str(a.len, s, sizeof(s)));
			struct bench_row row = { .what = what, .metric = "GB/s", .direct = a.verbs ? a.len / p.direct / 1e9 : NAN,
			    .gpx = a.len / p.gpx / 1e9, .bytes = a.len, .target = "fabric.rdma.large" };
			bench_table_row(b, &row);
			bench_pair_free(&p);
		}
	if (r >= 0) {
		struct bench_pair p;
		a.len = 4 * KiB;
		a.read = false;
		if ((r = bench_pair_measure(b, direct_op, gpx_op, &a, &p)) >= 0) {
			struct bench_row row = { .what = "4 KiB write, one at a time", .metric = "us",
			    .direct = a.verbs ? p.direct * 1e6 : NAN, .gpx = p.gpx * 1e6, .lower_is_better = true,
			    .bytes = a.len, .target = "fabric.rdma.lat" };
			bench_table_row(b, &row);
			bench_pair_free(&p);
		}
	}
	bench_table_end(b, note);
#ifdef HAVE_RDMA
	verbs_close(a.verbs);
#endif
	bench_buf_free(b, &a.local);
	return r < 0 ? bench_fail(b, r, "copies across") : 0;
}

static const struct bench_mode remote_modes[] = {
	{ "remote", "to and from a peer gpxd (GPX_BENCH_PEER): TCP vs gpx GB/s", mode_remote },
	{ "remote-lat", "4 KiB to a peer gpxd: TCP round trip vs gpx latency", mode_remote_lat },
	{ "remote-import", "import GPX_BENCH_IMPORT=NODE:NAME from another node: read/write MiB/s, 4 KiB latency",
	    mode_remote_import },
};
BENCH_MODES(remote_modes)
