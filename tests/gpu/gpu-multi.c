/*
 * Every GPU of the node, not just two, against a real gpxd: what gpxctl topo reports matches
 * what the driver says in this process (the devices by UUID, every ordered pair, peer access;
 * NVLink counts that add up), every ordered pair of GPUs copying at once, and one batch whose
 * pairs run on three GPUs' copy workers.  Every byte is checked against its source.  What
 * needs more GPUs than the machine has is skipped, saying how many it needs.
 *
 * Run by tests/gpu-multi.test, which skips without a GPU.
 */
#include "config.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"
#include "tests/gpu/gpu-util.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/util.h"

static CUcontext ctx[GPU_MAX];
static int ndev;
static uint64_t seed = 90210;

static void
uuid_str(const CUuuid *u, char *buf, size_t len)
{
	const unsigned char *b = (const unsigned char *)u->bytes;

	snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
	    b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static void
test_topo(gpx_conn *c)
{
	void *buf;
	size_t len;
	int r = gpx_query(c, GPX_Q_TOPO, &buf, &len);
	Gpx__QueryReply *q = r < 0 ? NULL : gpx__query_reply__unpack(NULL, len, buf);

	if (q == NULL)
		tap_bail("topo query: %s", gpx_strerror(r));
	ok(q->n_devices == (size_t)ndev, "topo lists the %d GPU(s) the driver shows (%zu)", ndev, q->n_devices);
	bool uuids = q->n_devices == (size_t)ndev, links = q->n_links == (size_t)ndev * (ndev - 1), nv = true;
	for (size_t i = 0; i < q->n_devices && uuids; i++) {
		CUdevice d;
		CUuuid u;
		char want[48];
		CK(cuDeviceGet(&d, (int)q->devices[i]->index));
		CK(cuDeviceGetUuid(&u, d));
		uuid_str(&u, want, sizeof(want));
		uuids = strcmp(want, q->devices[i]->uuid) == 0;
		nv &= q->devices[i]->nvswitch_links <= q->devices[i]->nvlinks;
		diag("GPU%u %s: NVML %s, %u NVLinks up, %u to NVSwitches", q->devices[i]->index, q->devices[i]->name,
		    q->devices[i]->nvml ? "yes" : "no", q->devices[i]->nvlinks, q->devices[i]->nvswitch_links);
	}
	ok(uuids, "each GPU's UUID is the driver's for that index");
	for (size_t k = 0; k < q->n_links && links; k++) {
		Gpx__PeerLink *l = q->links[k];
		CUdevice a, b;
		int can = 0;
		CK(cuDeviceGet(&a, (int)l->src));
		CK(cuDeviceGet(&b, (int)l->dst));
		CK(cuDeviceCanAccessPeer(&can, a, b));
		links = l->src != l->dst && (bool)can == l->access &&
		    strcmp(l->path, l->access ? "p2p" : "staged") == 0;
		nv &= strcmp(l->fabric, "nvlink") == 0 ? l->nvlinks > 0 : l->nvlinks == 0;
		diag("GPU%u -> GPU%u: %s over %s, %u NVLinks, rank %d", l->src, l->dst, l->path,
		    *l->fabric ? l->fabric : "(unknown)", l->nvlinks, l->rank);
	}
	ok(links, "every ordered pair of the %d GPU(s) listed once, with the driver's peer access and the path "
	    "that follows from it", ndev);
	ok(nv, "NVLink counts add up: links to NVSwitches within those up, straight links only on nvlink pairs");
	gpx__query_reply__free_unpacked(q, NULL);
	free(buf);
}

/* Every ordered pair at once: N x (N - 1) copies in flight, each from its own source. */
static void
test_every_pair(gpx_conn *c)
{
	const size_t len = 24u << 20;
	int n = ndev * (ndev - 1), k = 0;
	struct dbuf *src = calloc(n, sizeof(*src)), *dst = calloc(n, sizeof(*dst));
	uint64_t bytes = 0;
	bool all = true;

	for (int i = 0; i < ndev; i++)
		for (int j = 0; j < ndev; j++)
			if (i != j) {
				dbuf_new(&src[k], c, ctx[i], i, len, false, &seed);
				dbuf_new(&dst[k], c, ctx[j], j, len, false, NULL);
				k++;
			}
	for (k = 0; k < n && all; k++)
		all = gpx_copy(c, src[k].r, 0, dst[k].r, 0, len, 1000 + k) == 0;
	for (int got = 0; got < n && all; got++) {
		struct gpx_completion e;
		all = gpx_wait(c, &e, 1, 120000) == 1 && e.status == 0;
		bytes += e.bytes;
	}
	for (k = 0; k < n && all; k++)
		all = dbuf_holds(&dst[k], src[k].host);
	ok(all && bytes == (uint64_t)n * len, "every ordered pair of %d GPUs at once: %d copies of %zu MiB in "
	    "flight, every byte where it belongs", ndev, n, len >> 20);
	for (k = 0; k < n; k++) {
		dbuf_free(c, &src[k]);
		dbuf_free(c, &dst[k]);
	}
	free(src);
	free(dst);
}

/* GPU0 -> GPU1, GPU1 -> GPU2, GPU2 -> GPU0 in one batch: three copy workers, one completion. */
static void
test_batch_ring(gpx_conn *c)
{
	const size_t len = 5u << 20;
	struct dbuf src[3], dst[3];
	struct gpx_pair pr[3];
	struct gpx_seg segs[3] = { { 0, 0, len / 4 }, { len / 4, 3 * len / 4, len / 4 }, { len / 2, len / 4, len / 2 } };
	struct gpx_completion e;
	uint64_t bytes = 0;

	for (int i = 0; i < 3; i++) {
		dbuf_new(&src[i], c, ctx[i], i, len, false, &seed);
		dbuf_new(&dst[i], c, ctx[(i + 1) % 3], (i + 1) % 3, len, false, NULL);
		pr[i] = (struct gpx_pair){ src[i].r, dst[i].r, 0, 0, 0, 3 };
	}
	int r = gpx_copy_batch(c, pr, 3, segs, 3, 2000);
	if (r == 0 && (r = gpx_wait_tag(c, 2000, &e, 120000)) >= 0) {
		r = e.status;
		bytes = e.bytes;
	}
	bool all = r == 0 && bytes == 3 * len;
	for (int i = 0; i < 3 && all; i++) {
		/* the segments move bytes around: build what the destination should hold */
		unsigned char *want = calloc(1, len);
		for (int s = 0; s < 3; s++)
			memcpy(want + segs[s].dst_offset, src[i].host + segs[s].src_offset, segs[s].length);
		all = dbuf_holds(&dst[i], want);
		free(want);
	}
	ok(all && gpx_poll(c, &e, 1) == 0, "a batch GPU0 -> GPU1, GPU1 -> GPU2, GPU2 -> GPU0 runs on three copy "
	    "workers and completes once, every byte where its segment says");
	if (r < 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	for (int i = 0; i < 3; i++) {
		dbuf_free(c, &src[i]);
		dbuf_free(c, &dst[i]);
	}
}

int
main(void)
{
	struct harness h;
	gpx_conn *c;

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	ndev = gpu_contexts(ctx);
	diag("%d GPU(s)", ndev);
	if (harness_start(&h, "[cuda]\ntrust_legacy_ipc = yes\n") < 0)
		tap_bail("cannot start gpxd");
	if (gpx_connect(h.sock, "gpu-multi", &c) < 0)
		tap_bail("cannot connect");
	test_topo(c);
	char why[96];
	if (ndev >= 2)
		test_every_pair(c);
	else {
		snprintf(why, sizeof(why), "every ordered pair at once needs 2 GPUs; this machine has %d", ndev);
		tap_skip(1, why);
	}
	if (ndev >= 3)
		test_batch_ring(c);
	else {
		snprintf(why, sizeof(why), "a batch over three GPUs' copy workers needs 3 GPUs; this machine has %d", ndev);
		tap_skip(1, why);
	}
	gpx_close(c);
	harness_finish(&h);
	return tap_done();
}
