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
 *               1 MiB to 8 MiB, and 4 KiB write latency, gpx alone: the anchors (ib_read_bw,
 *               ib_write_bw, ib_send_lat) run between the same nodes in tests/vm-rdma.test
 *
 * Needs a second gpxd peered with the one under test: GPX_BENCH_PEER=its socket and
 * GPX_BENCH_PEER_NODE=its node name; the modes skip without them.  The TCP anchor only means
 * something when both daemons run on this machine (tests/fabric-tcp.test's setup); between
 * RDMA nodes the anchors are ib_write_bw and ib_send_lat, run by the test that starts the nodes.
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
			    .gpx = a.len / p.gpx / 1e9, .bytes = a.len };
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

static int
mode_remote_import(struct bench_ctx *b)
{
	static const uint64_t sizes[] = { 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB };
	const char *name = getenv("GPX_BENCH_IMPORT");
	struct remote_arg a;
	uint64_t rlen = 0;
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
	for (int dir = 0; dir < 2; dir++)
		for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && sizes[i] <= a.cap; i++) {
			double t[64];
			int runs = b->runs < 64 ? b->runs : 64;
			a.len = sizes[i];
			a.read = dir == 0;
			if ((r = gpx_op(&a)) < 0) {
				bench_buf_free(b, &a.local);
				return bench_fail(b, r, "a copy across");
			}
			for (int k = 0; k < runs; k++) {
				double t0 = bench_now(), el;
				unsigned n = 0;
				do {
					if ((r = gpx_op(&a)) < 0) {
						bench_buf_free(b, &a.local);
						return bench_fail(b, r, "a copy across");
					}
					n++;
				} while ((el = bench_now() - t0) < b->min_time);
				t[k] = (double)a.len * n / el;
			}
			printf("remote-import %s %llu MiB: %.1f MiB/s\n", a.read ? "read" : "write",
			    (unsigned long long)(a.len / MiB), bench_median(t, (size_t)runs) / MiB);
		}
	a.len = 4 * KiB;
	a.read = false;
	size_t nl = 0;
	double lat[4096];
	for (double t0 = bench_now(); nl < 4096 && (nl < 100 || bench_now() - t0 < b->min_time * b->runs); nl++) {
		double s = bench_now();
		if ((r = gpx_op(&a)) < 0) {
			bench_buf_free(b, &a.local);
			return bench_fail(b, r, "a 4 KiB copy across");
		}
		lat[nl] = (bench_now() - s) * 1e6;
	}
	printf("remote-import write 4 KiB latency: p50 %.1f us p99 %.1f us (%zu copies)\n",
	    bench_percentile(lat, nl, 50), bench_percentile(lat, nl, 99), nl);
	fflush(stdout);
	bench_buf_free(b, &a.local);
	return 0;
}

static const struct bench_mode remote_modes[] = {
	{ "remote", "to and from a peer gpxd (GPX_BENCH_PEER): TCP vs gpx GB/s", mode_remote },
	{ "remote-lat", "4 KiB to a peer gpxd: TCP round trip vs gpx latency", mode_remote_lat },
	{ "remote-import", "import GPX_BENCH_IMPORT=NODE:NAME from another node: read/write MiB/s, 4 KiB latency",
	    mode_remote_import },
};
BENCH_MODES(remote_modes)
