/*
 * gpx-bench-gpu's remote mode: GPU memory between two daemons.
 *
 *   gpu-remote   GPU memory to and from a peer daemon's GPU memory (GPX_BENCH_PEER, as for
 *                gpx-bench remote), against host memory over the same two daemons: what
 *                GPU memory costs between nodes when it is staged (no GPUDirect NIC)
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <cuda.h>

#include "tests/bench.h"
#include "tests/bench-gpu.h"

/* A copy between two regions of this client, waited for. */
struct rop {
	gpx_conn *c;
	gpx_region src, dst;
	uint64_t len;
};

static int
rop_copy(void *arg)
{
	struct rop *o = arg;

	return gpx_copy_sync(o->c, o->src, 0, o->dst, 0, o->len);
}

/* Exports r, a region of the peer daemon's client, to peers and imports it here. */
static int
remote_pair(struct bench_ctx *b, gpx_conn *peer, const char *node, const char *tag, gpx_region r,
    gpx_region *imported)
{
	char name[96];
	int e;

	snprintf(name, sizeof(name), "gpx-bench-%s-%d", tag, (int)getpid());
	if ((e = gpx_export_remote(peer, r, name, NULL, NULL)) < 0)
		return bench_fail(b, e, "exporting to peers");
	snprintf(name, sizeof(name), "%s:gpx-bench-%s-%d", node, tag, (int)getpid());
	/* A daemon started with the run (--spawn) may not have reached its peer yet: up to 5 s. */
	for (int i = 0; (e = gpx_import(b->conn, name, imported, NULL)) == -GPX_ENOENT && i < 50; i++)
		usleep(100000);
	if (e < 0)
		return bench_fail(b, e, "importing through the daemon under test");
	return 0;
}

static int
mode_remote(struct bench_ctx *b)
{
	const char *sock = getenv("GPX_BENCH_PEER"), *node = getenv("GPX_BENCH_PEER_NODE");
	uint64_t cap = b->max_size < (64ull << 20) ? b->max_size : (64ull << 20);
	struct gbuf lg, pg;
	struct bench_buf lh;
	int pfd, r = bench_gpu_setup(b, "gpu-remote", 1);
	void *pptr;
	gpx_conn *peer;
	gpx_region ph, rg, rh;
	char what[64], sz[32];

	if (r)
		return r;
	if (sock == NULL || node == NULL) {
		bench_skip(b, "gpu-remote", "needs a peered second gpxd: GPX_BENCH_PEER=SOCKET GPX_BENCH_PEER_NODE=NODE");
		return BENCH_SKIP;
	}
	if ((r = gpx_connect(sock, "gpx-bench-peer", &peer)) < 0)
		return bench_fail(b, r, "connecting to the peer daemon");
	if (gbuf_new(b, 0, cap, &lg) < 0 || bench_buf_new(b, cap, &lh) < 0 || gbuf_alloc(0, cap, &pg) < 0)
		return -1;
	if ((r = gpx_register_cuda(peer, (void *)pg.d, pg.len, 0, &pg.region)) < 0 ||
	    (r = gpx_host_alloc(cap, &pfd, &pptr)) < 0 || (r = gpx_register_host(peer, pfd, 0, cap, 0, &ph)) < 0)
		return bench_fail(b, r, "registering memory with the peer daemon");
	if (remote_pair(b, peer, node, "g", pg.region, &rg) < 0 || remote_pair(b, peer, node, "h", ph, &rh) < 0)
		return -1;
	bench_table_begin(b, "gpu-remote", "to and from a peer daemon: host memory vs GPU memory (staged)");
	for (int dir = 0; dir < 2; dir++)
		for (uint64_t n = 1ull << 20; n <= cap; n *= 8) {
			struct rop h = { b->conn, dir ? rh : lh.region, dir ? lh.region : rh, n };
			struct rop g = { b->conn, dir ? rg : lg.region, dir ? lg.region : rg, n };
			struct bench_pair p;
			double th, tg;
			/* Two pairs so that each side is timed against itself: host, then GPU. */
			if (bench_pair_measure(b, rop_copy, rop_copy, &h, &p) < 0)
				return -1;
			th = p.gpx;
			bench_pair_free(&p);
			if (bench_pair_measure(b, rop_copy, rop_copy, &g, &p) < 0)
				return -1;
			tg = p.gpx;
			bench_pair_free(&p);
			snprintf(what, sizeof(what), "%s %s", dir == 0 ? "write" : "read", bench_size_str(n, sz, sizeof(sz)));
			bench_gpu_row(b, what, "GB/s", n / th / 1e9, n / tg / 1e9, false, n);
		}
	bench_table_end(b, "direct: host memory on both sides through the same two daemons; gpx: GPU memory "
	    "on both sides, staged through host buffers by both daemons");
	gpx_close(peer);
	gbuf_free(b, &lg);
	bench_buf_free(b, &lh);
	cuMemUnmap(pg.d, pg.len);
	cuMemAddressFree(pg.d, pg.len);
	cuMemRelease(pg.h);
	gpx_host_free(pfd, pptr, cap);
	return 0;
}

static const struct bench_mode remote_modes[] = {
	{ "gpu-remote", "GPU memory to a peer gpxd (GPX_BENCH_PEER): host vs GPU memory GB/s", mode_remote },
};
BENCH_MODES(remote_modes)
