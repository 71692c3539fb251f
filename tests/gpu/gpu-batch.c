/*
 * Batches on GPUs against a real gpxd: the shapes of a KV-cache handoff (the same blocks out
 * of every layer's K and V tensors, one page list for all, one kernel launch) and of a weight
 * push (hundreds of tensors of every size: within a GPU those of 16 MiB and more on the copy
 * engines of two streams and the rest in tiles of one launch beside them, between GPUs half on
 * a copy engine and half in the kernel), between VMM and cudaMalloc memory, on one GPU and
 * between two; a push made again and again with the same pairs (kept resolved by gpxd, with
 * their sides for the GPU that runs them); and one batch whose pairs run on different paths
 * (host to host, host to GPU, GPU to host, GPU to GPU), which gpxd splits and completes once.
 * Every byte is checked against its source.
 *
 * Run by tests/gpu-batch.test, which skips without a GPU.
 */
#include "config.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/gpu/gpu-util.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/util.h"

static CUcontext ctx[GPU_MAX];
static int ndev;
static uint64_t seed = 4711;

static int
wait_tag(gpx_conn *c, uint64_t tag, uint64_t *bytes)
{
	struct gpx_completion e;
	int r = gpx_wait_tag(c, tag, &e, 120000);

	if (r < 0)
		return r;
	*bytes = e.bytes;
	return e.status;
}

/*
 * 2 x layers tensors of blocks x bs bytes a side; the same n blocks of each to new places.
 * With table, the block numbers go in a block table on the destination's GPU
 * (gpx_copy_pages_batch_table), as a program keeps them.
 */
static void
test_kv(gpx_conn *c, int sdev, int ddev, int layers, uint32_t blocks, uint32_t bs, uint32_t n, bool vmm, bool table)
{
	const int np = 2 * layers;
	struct dbuf *src = calloc(np, sizeof(*src)), *dst = calloc(np, sizeof(*dst));
	struct gpx_pair *pr = calloc(np, sizeof(*pr));
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(blocks * sizeof(*dp));
	uint64_t bytes = 0;

	for (int k = 0; k < np; k++) {
		dbuf_new(&src[k], c, ctx[sdev], sdev, (size_t)blocks * bs, vmm, &seed);
		dbuf_new(&dst[k], c, ctx[ddev], ddev, (size_t)blocks * bs, !vmm, NULL);
		pr[k] = (struct gpx_pair){ src[k].r, dst[k].r, 0, 0, 0, 0 };
	}
	for (uint32_t i = 0; i < blocks; i++)
		dp[i] = i;
	for (uint32_t i = blocks - 1; i > 0; i--) {
		uint32_t j = xorshift(&seed) % (i + 1), x = dp[i];
		dp[i] = dp[j];
		dp[j] = x;
	}
	for (uint32_t i = 0; i < n; i++)
		sp[i] = xorshift(&seed) % blocks;
	struct dbuf tb;
	int r;
	if (table) {
		dbuf_new(&tb, c, ctx[ddev], ddev, 2 * (size_t)n * sizeof(uint32_t), vmm, NULL);
		CK(cuMemcpyHtoD(tb.d, sp, n * sizeof(*sp)));
		CK(cuMemcpyHtoD(tb.d + n * sizeof(*sp), dp, n * sizeof(*dp)));
		r = gpx_copy_pages_batch_table(c, pr, np, bs, tb.r, 0, n, 100);
	} else
		r = gpx_copy_pages_batch(c, pr, np, bs, sp, dp, n, 100);
	r = r < 0 ? r : wait_tag(c, 100, &bytes);
	if (table)
		dbuf_free(c, &tb);
	for (int k = 0; k < np; k++)
		for (uint32_t i = 0; i < n; i++)
			memcpy(dst[k].host + (size_t)dp[i] * bs, src[k].host + (size_t)sp[i] * bs, bs);
	bool all = r == 0 && bytes == (uint64_t)np * n * bs;
	for (int k = 0; k < np && all; k++)
		all = dbuf_holds(&dst[k], dst[k].host);
	ok(all, "KV handoff GPU%d -> GPU%d: %u blocks of %u bytes out of %d tensors (%s -> %s) in one batch%s, "
	    "every byte where it belongs", sdev, ddev, n, bs, np, vmm ? "vmm" : "cudaMalloc", vmm ? "cudaMalloc" : "vmm",
	    table ? ", its block numbers in a table on the GPU" : "");
	if (r < 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	dbufs_free(c, src, dst, np);
	free(pr);
	free(sp);
	free(dp);
}

/*
 * A model's tensors, from 256 bytes to 40 MiB, pushed whole into another set; heavy: one of
 * 16 MiB and n - 1 of about 4 MiB, so that within a GPU the kernel's share (the small ones)
 * runs far longer than the copy engines' (the transfer must end with the last of them).
 */
static void
test_weights(const struct harness *h, gpx_conn *c, int sdev, int ddev, int n, bool heavy)
{
	struct dbuf *src = calloc(n, sizeof(*src)), *dst = calloc(n, sizeof(*dst));
	struct gpx_pair *pr = calloc(n, sizeof(*pr));
	struct gpx_seg *segs = calloc(n, sizeof(*segs));
	uint64_t bytes = 0, want = 0;

	for (int k = 0; k < n; k++) {
		/* A third tiny (norms, biases), a third of a few KiB to 1 MiB, a third of any length up
		 * to 8 MiB (the kernel's tiles); one of 40 MiB, one of 20 MiB + 3 and one of 17 MiB + 1
		 * (within a GPU, on the copy engines of two streams beside the kernel; between GPUs the
		 * first is a copy engine's, the others tiles).  Every sixth from an odd offset to another. */
		size_t len = k % 3 == 0 ? 256 + 8 * (xorshift(&seed) % 64) :
		    k % 3 == 1 ? 4096 + 8 * (xorshift(&seed) % (1 << 17)) : (1u << 20) + xorshift(&seed) % (7u << 20);
		len = k == 8 ? (20u << 20) + 3 : k == 5 ? 40u << 20 : k == 11 ? (17u << 20) + 1 : len;
		if (heavy)
			len = k == 0 ? 16u << 20 : (4u << 20) - 8 * (k % 7);
		const uint64_t so = k % 6 == 2 ? 5 : 0, dof = k % 6 == 2 ? 11 : 0;
		dbuf_new(&src[k], c, ctx[sdev], sdev, len + so, k % 2 == 0, &seed);
		dbuf_new(&dst[k], c, ctx[ddev], ddev, len + dof, k % 2 == 1, NULL);
		pr[k] = (struct gpx_pair){ src[k].r, dst[k].r, 0, 0, k, 1 };
		segs[k] = (struct gpx_seg){ so, dof, len };
		memcpy(dst[k].host + dof, src[k].host + so, len);
		want += len;
	}
	/*
	 * Heavy: the destination read back into host memory through gpxd as soon as the push ends,
	 * on a copy engine of gpxd's own context, which does not wait for its kernel (a read by
	 * another process does: the GPU runs one context at a time).  A push that ended before its
	 * kernel's part did is read back with that part missing.
	 */
	struct gpx_pair *bp = calloc(n, sizeof(*bp));
	struct gpx_seg *bs = calloc(n, sizeof(*bs));
	unsigned char *back = NULL;
	gpx_region br = 0;
	int bfd = -1, r = 0;
	if (heavy && (gpx_host_alloc(want, &bfd, (void **)&back) < 0 || gpx_register_host(c, bfd, 0, want, 0, &br) < 0))
		tap_bail("host memory for the read-back");
	for (int k = 0, at = 0; heavy && k < n; at += segs[k].length, k++) {
		bp[k] = (struct gpx_pair){ dst[k].r, br, 0, 0, k, 1 };
		bs[k] = (struct gpx_seg){ segs[k].dst_offset, at, segs[k].length };
	}
	const double split0 = harness_metric(h, "gpx_gpu_split_chunks_total");
	r = gpx_copy_batch(c, pr, n, segs, n, 200);
	r = r < 0 ? r : wait_tag(c, 200, &bytes);
	bool all = r == 0 && bytes == want, early = false;
	uint64_t bbytes = 0;
	if (heavy && r == 0) {
		r = gpx_copy_batch(c, bp, n, bs, n, 201);
		r = r < 0 ? r : wait_tag(c, 201, &bbytes);
		for (int k = 0, at = 0; k < n && r == 0 && !early; at += segs[k].length, k++)
			early = memcmp(back + at, dst[k].host + segs[k].dst_offset, segs[k].length) != 0;
	}
	const double split1 = harness_metric(h, "gpx_gpu_split_chunks_total");
	int bad = -1;
	for (int k = 0; k < n && all; k++)
		if (!(all = dbuf_holds(&dst[k], dst[k].host)))
			bad = k;
	ok(all, "weight push GPU%d -> GPU%d: %d tensors of %s (%.1f MiB) in one batch, verified", sdev, ddev, n,
	    heavy ? "16 MiB and 4 MiB" : "256 B to 40 MiB", want / 1048576.0);
	ok(split0 >= 0 && split1 > split0, "... split between copy engines and the copy kernel side by side (%.0f "
	    "chunks split)", split1 - split0);
	if (heavy)
		ok(r == 0 && bbytes == want && !early, "... and read back through gpxd the moment it ended, every byte "
		    "there: it ended with the last of its parts");
	if (back != NULL) {
		gpx_deregister(c, br);
		gpx_host_free(bfd, back, want);
	}
	free(bp);
	free(bs);
	if (bad >= 0)
		diag("tensor %d (%zu bytes from offset %llu) differs", bad, (size_t)segs[bad].length,
		    (unsigned long long)segs[bad].src_offset);
	if (r < 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	dbufs_free(c, src, dst, n);
	free(pr);
	free(segs);
}

/*
 * A weight push made again and again with the same pairs: gpxd keeps them resolved from the
 * second push on (xfer.c), and with them each pair's sides as GPU ddev's worker issues them,
 * found at the third and read from the fourth (gpu-copy.c pair_at).  n tensors of 64 KiB, each
 * push with new bytes in every source, verified; then the same tensors paired the other way
 * round (tensor k into n - 1 - k), a kept list of their own, pushed and verified as often.
 */
static void
test_pushed_again(const struct harness *h, gpx_conn *c, int sdev, int ddev, int n)
{
	const size_t len = 64u << 10;
	struct dbuf *src = calloc(n, sizeof(*src)), *dst = calloc(n, sizeof(*dst));
	struct gpx_pair *pr = calloc(n, sizeof(*pr));
	struct gpx_seg *segs = calloc(n, sizeof(*segs));
	const double taken0 = harness_metric(h, "gpx_batch_pairs_taken_total");
	int good[2] = { 0, 0 }, bad = -1, r = 0;

	if (src == NULL || dst == NULL || pr == NULL || segs == NULL)
		tap_bail("out of memory");
	for (int k = 0; k < n; k++) {
		dbuf_new(&src[k], c, ctx[sdev], sdev, len, k % 2 == 0, &seed);
		dbuf_new(&dst[k], c, ctx[ddev], ddev, len, k % 2 == 1, NULL);
		segs[k] = (struct gpx_seg){ 8 * (k % 5), 16 * (k % 3), len - 64 };
	}
	for (int way = 0; way < 2; way++)
		for (int push = 0; push < 4 && r == 0 && bad < 0; push++) {
			uint64_t bytes = 0;
			for (int k = 0; k < n; k++) {
				const int to = way ? n - 1 - k : k;
				pr[k] = (struct gpx_pair){ src[k].r, dst[to].r, 0, 0, k, 1 };
				for (size_t i = 0; i < len; i += 8) {
					uint64_t x = xorshift(&seed);
					memcpy(src[k].host + i, &x, 8);
				}
				CK(cuCtxSetCurrent(src[k].ctx));
				CK(cuMemcpyHtoD(src[k].d, src[k].host, len));
				memcpy(dst[to].host + segs[k].dst_offset, src[k].host + segs[k].src_offset, segs[k].length);
			}
			r = gpx_copy_batch(c, pr, n, segs, n, 400 + 4 * way + push);
			r = r < 0 ? r : wait_tag(c, 400 + 4 * way + push, &bytes);
			for (int k = 0; k < n && r == 0 && bad < 0; k++)
				if (!dbuf_holds(&dst[k], dst[k].host))
					bad = k;
			good[way] += r == 0 && bad < 0 && bytes == (uint64_t)n * (len - 64);
		}
	const double taken1 = harness_metric(h, "gpx_batch_pairs_taken_total");
	ok(good[0] == 4 && good[1] == 4 && taken0 >= 0 && taken1 - taken0 >= 4, "a push of %d tensors GPU%d -> GPU%d "
	    "four times, then paired the other way round four times: every byte in place each time (%d and %d of 4), "
	    "%.0f of them from the pairs kept", n, sdev, ddev, good[0], good[1], taken1 - taken0);
	if (bad >= 0)
		diag("tensor %d differs", bad);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	dbufs_free(c, src, dst, n);
	free(pr);
	free(segs);
}

/* One batch over four paths' kinds of pair: host -> host, host -> GPU, GPU -> host, GPU -> GPU. */
static void
test_paths(gpx_conn *c)
{
	const size_t len = 3u << 20;
	struct dbuf g1, g2, g3;
	unsigned char *h[4];
	int fd[4];
	gpx_region hr[4];
	uint64_t bytes = 0;
	const int d3 = ndev > 1 ? 1 : 0;     /* the third buffer on another GPU where there is one */

	dbuf_new(&g1, c, ctx[0], 0, len, true, &seed);
	dbuf_new(&g2, c, ctx[0], 0, len, false, NULL);
	dbuf_new(&g3, c, ctx[d3], d3, len, true, NULL);
	for (int i = 0; i < 4; i++) {
		if (gpx_host_alloc(len, &fd[i], (void **)&h[i]) < 0 || gpx_register_host(c, fd[i], 0, len, 0, &hr[i]) < 0)
			tap_bail("host memory");
		fill(h[i], len, 100 + i);
	}
	struct gpx_seg segs[2] = { { 0, 0, len / 2 }, { len / 2, len / 2, len / 2 } };
	struct gpx_pair pr[4] = {
		{ hr[0], hr[1], 0, 0, 0, 2 },       /* host -> host */
		{ hr[2], g2.r, 0, 0, 0, 2 },        /* host -> GPU0 */
		{ g1.r, hr[3], 0, 0, 0, 2 },        /* GPU0 -> host */
		{ g1.r, g3.r, 0, 0, 0, 2 },         /* GPU0 -> GPU0 or GPU1 */
	};
	int r = gpx_copy_batch(c, pr, 4, segs, 2, 300);
	r = r < 0 ? r : wait_tag(c, 300, &bytes);
	memcpy(g2.host, h[2], len);
	memcpy(g3.host, g1.host, len);
	bool all = r == 0 && bytes == 4 * len && memcmp(h[1], h[0], len) == 0 && memcmp(h[3], g1.host, len) == 0 &&
	    dbuf_holds(&g2, g2.host) && dbuf_holds(&g3, g3.host);
	struct gpx_completion e;
	ok(all && gpx_poll(c, &e, 1) == 0, "a batch over host -> host, host -> GPU, GPU -> host and GPU -> GPU%d: "
	    "split over its paths, one completion with every byte (%llu), verified", g3.dev, (unsigned long long)bytes);
	for (int i = 0; i < 4; i++) {
		gpx_deregister(c, hr[i]);
		gpx_host_free(fd[i], h[i], len);
	}
	dbuf_free(c, &g1);
	dbuf_free(c, &g2);
	dbuf_free(c, &g3);
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
	if (harness_start(&h, "[daemon]\nmetrics = 127.0.0.1:0\n[cuda]\ntrust_legacy_ipc = yes\n") < 0)
		tap_bail("cannot start gpxd");
	if (gpx_connect(h.sock, "gpu-batch", &c) < 0)
		tap_bail("cannot connect");
	test_kv(c, 0, 0, 32, 512, 32768, 400, true, false);
	test_kv(c, 0, 0, 4, 2048, 4096, 2048, false, false);
	test_kv(c, 0, 0, 2, 64, 1 << 20, 64, true, false);        /* large blocks: not the kernel */
	test_kv(c, 0, 0, 32, 512, 32768, 400, true, true);
	test_kv(c, 0, 0, 4, 2048, 4096, 2048, false, true);
	test_weights(&h, c, 0, 0, 300, false);
	test_weights(&h, c, 0, 0, 200, true);
	test_pushed_again(&h, c, 0, 0, 40);
	test_paths(c);
	if (ndev > 1) {
		test_kv(c, 0, 1, 32, 512, 32768, 400, true, false);
		test_kv(c, 1, 0, 8, 2048, 4096, 2048, false, false);
		test_kv(c, 0, 1, 32, 512, 32768, 400, true, true);
		test_weights(&h, c, 0, 1, 300, false);
		test_pushed_again(&h, c, 0, 1, 40);
	} else
		tap_skip(6, "one GPU: no batch between two");
	gpx_close(c);
	harness_finish(&h);
	return tap_done();
}
