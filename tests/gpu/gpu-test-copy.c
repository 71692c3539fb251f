/*
 * The GPU tests' copies (tests/gpu/gpu-test.c runs them): random copies between every pair of
 * buffers of every kind, vectored copies of scattered pages (the SM kernel path), page
 * transfers by number (gpx_copy_pages) on every path and at 65,536 pages, an interior pointer
 * of a larger allocation (as PyTorch's caching allocator hands out), a completion seen only
 * once every byte of a many-block launch is in place, and a registration that gpxd serves
 * from its cache of opened handles.
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/gpu/gpu-test.h"
#include "tests/tap.h"
#include "tests/gpu/gpu-util.h"

void
test_matrix(gpx_conn *c, struct buf *bufs, int nb)
{
	for (int i = 0; i < nb; i++)
		for (int j = 0; j < nb; j++) {
			bool good = true;
			for (int k = 0; k < 6 && good; k++)
				good = random_copy(c, &bufs[i], &bufs[j]);
			ok(good, "random copies %s -> %s verified", bufs[i].name, bufs[j].name);
		}
}

/* 0..n-1 in a random order, allocated. */
static uint32_t *
shuffled(size_t n)
{
	uint32_t *p = malloc(n * sizeof(*p));

	if (p == NULL)
		tap_bail("out of memory");
	for (size_t i = 0; i < n; i++)
		p[i] = i;
	for (size_t i = n - 1; i > 0; i--) {
		size_t k = rnd() % (i + 1);
		uint32_t t = p[i];
		p[i] = p[k];
		p[k] = t;
	}
	return p;
}

/* Scattered pages in one vectored request: the SM kernel between GPUs, copy engines otherwise. */
void
test_vectored(gpx_conn *c, struct buf *a, struct buf *b, size_t page, int n, bool odd)
{
	struct gpx_seg *s = calloc(n, sizeof(*s));
	size_t slots = BUF / page;
	uint32_t *perm = shuffled(slots);
	struct gpx_completion done;

	for (int i = 0; i < n; i++) {
		s[i].src_offset = (rnd() % slots) * page + (odd ? rnd() % 16 : 0);
		s[i].dst_offset = (size_t)perm[i] * page + (odd ? rnd() % 16 : 0);
		s[i].length = odd ? page - 16 - rnd() % 100 : page;
	}
	int r = gpx_copyv(c, a->region, b->region, s, n, 77);
	if (r == 0)
		r = gpx_wait_tag(c, 77, &done, 30000);
	if (r == 0)
		r = done.status;
	for (int i = 0; i < n && r == 0; i++)
		memmove(b->mirror + s[i].dst_offset, a->mirror + s[i].src_offset, s[i].length);
	unsigned char *got = malloc(BUF);
	buf_read(b, 0, got, BUF);
	ok(r == 0 && memcmp(got, b->mirror, BUF) == 0, "vectored %d x %zu%s %s -> %s verified", n, page,
	    odd ? " (unaligned)" : "", a->name, b->name);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	free(got);
	free(perm);
	free(s);
}

/*
 * Between GPUs, a chunk of many large segments goes half to a copy engine and half, in tiles,
 * to the copy kernel on the worker's other bulk stream (gpu-copy.c issue_segs): 16 segments of
 * 1 MiB, aligned and not, both ways, verified, and counted in gpx_gpu_split_chunks_total.
 */
void
test_link_split(gpx_conn *c, struct buf *a, struct buf *b)
{
	const double before = harness_metric(the_harness, "gpx_gpu_split_chunks_total");

	test_vectored(c, a, b, 1 << 20, 16, false);
	test_vectored(c, a, b, 1 << 20, 16, true);
	test_vectored(c, b, a, 1 << 20, 16, false);
	const double after = harness_metric(the_harness, "gpx_gpu_split_chunks_total");
	ok(before >= 0 && after - before >= 3, "each went half to a copy engine, half to the kernel (%.0f chunks split)",
	    after - before);
}

/*
 * Pages by number (gpx_copy_pages): the copy kernel reads gpxd's checked list in place where it
 * runs the copy; pages above 256 KiB go to copy engines as plain segments.
 */
void
test_pages(gpx_conn *c, struct buf *a, struct buf *b, size_t page, uint32_t n, size_t so, size_t dof)
{
	size_t slots = (BUF - (so > dof ? so : dof)) / page;
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(n * sizeof(*dp));
	struct gpx_completion done;

	if (n > slots)
		tap_bail("test_pages: %u pages of %zu do not fit", n, page);
	uint32_t *perm = shuffled(slots);
	for (uint32_t i = 0; i < n; i++) {
		dp[i] = perm[i];       /* distinct destinations, in a random order */
		sp[i] = rnd() % slots;
	}
	free(perm);
	int r = gpx_copy_pages(c, a->region, so, b->region, dof, page, sp, dp, n, 78);
	if (r == 0)
		r = gpx_wait_tag(c, 78, &done, 30000);
	if (r == 0)
		r = done.status;
	for (uint32_t i = 0; i < n && r == 0; i++)
		memmove(b->mirror + dof + dp[i] * page, a->mirror + so + sp[i] * page, page);
	unsigned char *got = malloc(BUF);
	buf_read(b, 0, got, BUF);
	ok(r == 0 && memcmp(got, b->mirror, BUF) == 0, "pages %u x %zu (bases %zu -> %zu) %s -> %s verified", n,
	    page, so, dof, a->name, b->name);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	free(got);
	free(sp);
	free(dp);
}

/*
 * A page transfer past the GPU worker's largest chunk (1 GiB), so the kernel gets it in two
 * launches cut inside a page: 131,072 pages (the harness's max_segments) of 9,000 bytes into
 * the last GPU.
 */
void
test_pages_big(gpx_conn *c)
{
	const uint32_t n = 131072, page = 9000;
	const size_t len = (size_t)n * page;
	int dd = ndev > 1 ? 1 : 0;
	uint64_t *src = malloc(len), *got = malloc(len);
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(n * sizeof(*dp));
	CUdeviceptr a, b;
	gpx_region ra, rb;
	struct gpx_completion done;

	for (size_t i = 0; i < len / 8; i++)
		src[i] = rnd();
	for (uint32_t i = 0; i < n; i++) {
		dp[i] = (uint32_t)((i * 7919ull) % n);      /* a permutation: n is a power of two */
		sp[i] = rnd() % n;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&a, len));
	CK(cuMemcpyHtoD(a, src, len));
	CK(cuCtxSetCurrent(ctx[dd]));
	CK(cuMemAlloc(&b, len));
	CK(cuMemsetD8(b, 0, len));
	int r = gpx_register_cuda(c, (void *)a, len, 0, &ra);
	r = r ? r : gpx_register_cuda(c, (void *)b, len, 0, &rb);
	/* One page out, in the list's first and in its second half (checked on two cores). */
	for (int k = 0; k < 2 && r == 0; k++) {
		uint32_t at = k ? n - 1 : 5, keep = sp[at];
		sp[at] = n;
		int e = gpx_copy_pages(c, ra, 0, rb, 0, page, sp, dp, n, 80 + k);
		e = e ? e : gpx_wait_tag(c, 80 + k, &done, 60000);
		e = e ? e : done.status;
		ok(e == -GPX_ERANGE, "pages past one chunk, page %u out of its region: refused (%s)", at, gpx_strerror(e));
		sp[at] = keep;
	}
	CK(cuMemcpyDtoH(got, b, len));
	bool zero = true;
	for (size_t i = 0; i < len / 8 && zero; i++)
		zero = got[i] == 0;
	ok(zero, "no byte of either reached the destination");
	r = r ? r : gpx_copy_pages(c, ra, 0, rb, 0, page, sp, dp, n, 79);
	r = r ? r : gpx_wait_tag(c, 79, &done, 60000);
	r = r ? r : done.status;
	CK(cuMemcpyDtoH(got, b, len));
	bool same = r == 0 && done.bytes == len;
	for (uint32_t i = 0; i < n && same; i++)
		same = memcmp((char *)got + (size_t)dp[i] * page, (char *)src + (size_t)sp[i] * page, page) == 0;
	ok(same, "pages past one chunk: %u x %u bytes (%.2f GiB) GPU0 -> GPU%d, cut inside a page, verified",
	    n, page, len / 1073741824.0, dd);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
	gpx_deregister(c, ra);
	gpx_deregister(c, rb);
	cuMemFree(b);
	/* Each buffer freed in its own context, and GPU0's current again for the parts after. */
	CK(cuCtxSetCurrent(ctx[0]));
	cuMemFree(a);
	free(src);
	free(got);
	free(sp);
	free(dp);
}

/*
 * Pages whose numbers lie in GPU memory (gpx_copy_pages_table): a table on GPU tdev, 64 bytes
 * into its allocation, n source numbers then n destination numbers, read in place by the page
 * kernel of the GPU that runs the copy.  Then one source number past the region: that page is
 * left out, every other one copied, and the transfer ends in GPX_ERANGE; the table's region is
 * deregistered as soon as that transfer is submitted (its job holds it).  Pages of 1 MiB go to
 * copy engines, which read no table: refused.
 */
void
test_pages_table(gpx_conn *c, struct buf *a, struct buf *b, int tdev, size_t page, uint32_t n)
{
	const size_t slots = BUF / page, tlen = 2 * (size_t)n * sizeof(uint32_t);
	uint32_t *t = malloc(tlen), *perm = shuffled(slots);
	unsigned char *got = malloc(BUF);
	struct gpx_completion done;
	CUdeviceptr d;
	gpx_region rt;

	if (n > slots)
		tap_bail("test_pages_table: %u pages of %zu do not fit", n, page);
	for (uint32_t i = 0; i < n; i++) {
		t[i] = rnd() % slots;
		t[n + i] = perm[i];      /* distinct destinations, in a random order */
	}
	CK(cuCtxSetCurrent(ctx[tdev]));
	CK(cuMemAlloc(&d, tlen + 64));
	CK(cuMemcpyHtoD(d + 64, t, tlen));
	CK(cuCtxSetCurrent(ctx[0]));
	int r = gpx_register_cuda(c, (void *)d, tlen + 64, 0, &rt);
	r = r ? r : gpx_copy_pages_table(c, a->region, 0, b->region, 0, page, rt, 64, n, 85);
	r = r ? r : gpx_wait_tag(c, 85, &done, 30000);
	r = r ? r : done.status;
	for (uint32_t i = 0; i < n && r == 0; i++)
		memmove(b->mirror + (size_t)t[n + i] * page, a->mirror + (size_t)t[i] * page, page);
	buf_read(b, 0, got, BUF);
	ok(r == 0 && memcmp(got, b->mirror, BUF) == 0, "pages %u x %zu from a table on GPU%d, %s -> %s verified", n,
	    page, tdev, a->name, b->name);
	if (r != 0)
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));

	const uint32_t out = n / 2;
	for (uint32_t i = 0; i < n; i++)
		t[i] = rnd() % slots;
	t[out] = (uint32_t)slots;       /* one past the source's last page */
	CK(cuCtxSetCurrent(ctx[tdev]));
	CK(cuMemcpyHtoD(d + 64, t, tlen));
	CK(cuCtxSetCurrent(ctx[0]));
	int e = gpx_copy_pages_table(c, a->region, 0, b->region, 0, page, rt, 64, n, 86);
	int g = gpx_deregister(c, rt);
	e = e ? e : gpx_wait_tag(c, 86, &done, 30000);
	e = e ? e : done.status;
	ok(e == -GPX_ERANGE && g == 0, "a source page out of its region in the table: GPX_ERANGE (%s), the table "
	    "deregistered while the copy ran", gpx_strerror(e));
	for (uint32_t i = 0; i < n; i++)
		if (i != out)
			memmove(b->mirror + (size_t)t[n + i] * page, a->mirror + (size_t)t[i] * page, page);
	buf_read(b, 0, got, BUF);
	ok(memcmp(got, b->mirror, BUF) == 0, "every other page copied, the one out left alone");
	r = gpx_register_cuda(c, (void *)d, tlen + 64, 0, &rt);
	r = r ? r : gpx_copy_pages_table(c, a->region, 0, b->region, 0, 1 << 20, rt, 64, 8, 87);
	r = r ? r : gpx_wait_tag(c, 87, &done, 30000);
	r = r ? r : done.status;
	ok(r == -GPX_ENOTSUP, "pages of 1 MiB (copy engines, which read no table): refused with %s (%s)",
	    gpx_strerror(r), gpx_last_error(c));
	gpx_deregister(c, rt);
	CK(cuCtxSetCurrent(ctx[tdev]));
	cuMemFree(d);
	CK(cuCtxSetCurrent(ctx[0]));
	free(got);
	free(perm);
	free(t);
}

/* An interior pointer of a larger cuMemAlloc, as PyTorch's caching allocator hands out. */
void
test_interior(gpx_conn *c, struct buf *src)
{
	CUdeviceptr big;
	size_t off = (1 << 20) + 4096 * 3 + 256, len = 1 << 20;
	unsigned char *before = malloc(4 << 20), *after = malloc(4 << 20), *want = malloc(len);
	gpx_region r;

	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&big, 4 << 20));
	rnd_fill(before, 4 << 20);
	CK(cuMemcpyHtoD(big, before, 4 << 20));
	int e = gpx_register_cuda(c, (void *)(big + off), len, 0, &r);
	ok(e == 0, "register an interior pointer of a larger allocation");
	e = e ? e : gpx_copy_sync(c, src->region, 0, r, 0, len);
	CK(cuMemcpyDtoH(after, big, 4 << 20));
	memcpy(before + off, src->mirror, len);
	ok(e == 0 && memcmp(before, after, 4 << 20) == 0, "copy into it lands at the offset, neighbours untouched");
	gpx_deregister(c, r);
	cuMemFree(big);
	free(before);
	free(after);
	free(want);
}

/*
 * Copies of `size` bytes, `depth` in flight at a time, from unaligned places of a to distinct
 * places of b, as many as b holds (at most 4,096): every byte where it belongs; and the daemon
 * issued some of them together, several in one launch of its copy kernel
 * (gpx_gpu_batched_chunks_total), which is what keeps many small copies fast.  Both sizes
 * it is run with (4 KiB, and 128 KiB + 3 unaligned) are small chunks of the quick stream.
 */
void
test_small_batched(gpx_conn *c, struct buf *a, struct buf *b, size_t size, size_t depth)
{
	const size_t n = BUF / size < 4096 ? BUF / size : 4096;
	unsigned char *got = malloc(n * size);
	struct gpx_completion done[64];
	bool good = got != NULL;
	size_t left = 0;
	const double before = harness_metric(the_harness, "gpx_gpu_batched_chunks_total");
	size_t *so = calloc(n, sizeof(*so));

	good = good && so != NULL;
	/* The expected bytes first: the copies then go in bursts, as fast as the client can send. */
	for (size_t i = 0; i < n && good; i++) {
		so[i] = (rnd() % (BUF / 4096)) * 4096 - (i % 7);
		so[i] = so[i] > BUF - size ? 0 : so[i];
		memmove(b->mirror + i * size, a->mirror + so[i], size);
	}
	for (size_t i = 0; i < n && good; i++) {
		good = gpx_copy(c, a->region, so[i], b->region, i * size, size, i) == 0;
		if (++left == depth || i == n - 1)
			while (left > 0 && good) {
				int k = gpx_wait(c, done, 64, 10000);
				good = k > 0;
				for (int e = 0; e < k; e++)
					good = good && done[e].status == 0;
				left -= k > 0 ? (size_t)k : 0;
			}
	}
	if (got != NULL)
		buf_read(b, 0, got, n * size);
	ok(good && memcmp(got, b->mirror, n * size) == 0, "%zu copies of %zu bytes, %zu in flight, %s -> %s: every "
	    "byte in place", n, size, depth, a->name, b->name);
	const double after = harness_metric(the_harness, "gpx_gpu_batched_chunks_total");
	ok(before >= 0 && after > before, "gpxd issued copies of %zu bytes queued together in one launch (%.0f of them)",
	    size, after - before);
	free(so);
	free(got);
}

/*
 * A GPU's copy worker idle for a while (past its first spin, within busy_poll_us) waits for the
 * event loop to have a request for its GPU in hand: the request's check wakes it, as soon as
 * its regions are found, so that the wake-up runs while the loop checks the rest
 * (gpx_gpu_prewakes_total).  Copies of 4 KiB a millisecond apart, each checked byte for byte.
 */
void
test_prewake(gpx_conn *c, struct buf *a, struct buf *b)
{
	const size_t size = 4096, n = 20;
	unsigned char got[4096];
	bool good = true;
	const double before = harness_metric(the_harness, "gpx_gpu_prewakes_total");

	for (size_t i = 0; i < n && good; i++) {
		const uint64_t so = (rnd() % (BUF / size)) * size, d = i * size;
		struct timespec ms = { 0, 1000000 };
		nanosleep(&ms, NULL);
		memmove(b->mirror + d, a->mirror + so, size);
		good = gpx_copy_sync(c, a->region, so, b->region, d, size) == 0;
		buf_read(b, d, got, size);
		good = good && memcmp(got, b->mirror + d, size) == 0;
	}
	ok(good, "%zu copies of 4 KiB %s -> %s, a millisecond apart: every byte in place", n, a->name, b->name);
	const double after = harness_metric(the_harness, "gpx_gpu_prewakes_total");
	ok(before >= 0 && after - before >= (double)(n / 2), "their checks woke the idle copy worker of GPU%d, "
	    "at least %zu times (%.0f)", a->dev, n / 2, after - before);
}

/*
 * A completion means every byte is in place, also for a copy made by one launch of many blocks
 * on the quick stream, which writes its own completion word (copy-kernel.cu: the last block
 * to finish writes it).  GPU -> pinned host memory, whose bytes this process reads itself the
 * moment it sees the completion: copies of 1 MiB (128 blocks each) one at a time, and 16 at
 * once, which gpxd may launch together as one kernel.  A word in every 4 KiB is looked at
 * first, then the whole compared.  Counts the words not yet in place into *early.
 */
static bool
done_after_bytes(gpx_conn *c, struct buf *a, struct buf *h, size_t *early, size_t *seen)
{
	const size_t size = 1u << 20, n = BUF / size;
	struct gpx_completion done[16];
	bool good = true;

	for (int round = 0; round < 8 && good; round++) {
		const size_t burst = round % 2 ? n : 1;
		const time_t give_up = time(NULL) + 30;
		rnd_fill(a->mirror, BUF);
		buf_write(a, 0, a->mirror, BUF);
		for (size_t i = 0; i < burst && good; i++)
			good = gpx_copy(c, a->region, i * size, h->region, i * size, size, i) == 0;
		for (size_t left = burst; left > 0 && good;) {
			int k = gpx_poll(c, done, 16);
			good = k > 0 || (k == 0 && time(NULL) < give_up);
			for (int e = 0; e < k && good; e++) {
				const size_t at = done[e].tag * size;
				good = done[e].status == 0 && done[e].tag < burst;
				for (size_t w = 0; w < size && good; w += 4096, (*seen)++)
					*early += memcmp(h->host + at + w, a->mirror + at + w, 8) != 0;
				good = good && memcmp(h->host + at, a->mirror + at, size) == 0;
				memcpy(h->mirror + at, a->mirror + at, size);
			}
			left -= k > 0 ? (size_t)k : 0;
		}
	}
	return good;
}

void
test_done_after_bytes(gpx_conn *c, struct buf *a, struct buf *h)
{
	size_t early = 0, seen = 0;
	bool good = done_after_bytes(c, a, h, &early, &seen);

	ok(good && early == 0, "GPU -> pinned host, 1 MiB copies alone and 16 at once: every byte in place when "
	    "the completion is seen (%zu of %zu words looked at then were not)", early, seen);
}

/*
 * size bytes of the pattern v from a to b on c, waited for: its seconds, or -1 if it failed or
 * the first and last 4 KiB of b are not v.
 */
static double
long_copy(gpx_conn *c, CUdeviceptr a, CUdeviceptr b, gpx_region ra, gpx_region rb, size_t size, uint32_t v)
{
	uint32_t head[1024], tail[1024];
	struct timespec t0, t1;

	CK(cuMemsetD32(a, v, size / 4));
	CK(cuMemsetD32(b, 0, size / 4));
	CK(cuCtxSynchronize());
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (gpx_copy_sync(c, ra, 0, rb, 0, size) != 0)
		return -1;
	clock_gettime(CLOCK_MONOTONIC, &t1);
	CK(cuMemcpyDtoH(head, b, sizeof(head)));
	CK(cuMemcpyDtoH(tail, b + size - sizeof(tail), sizeof(tail)));
	for (size_t w = 0; w < 1024; w++)
		if (head[w] != v || tail[w] != v)
			return -1;
	return (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
}

/* Two buffers of GPU0 for long copies, registered on one connection. */
struct long_pair {
	CUdeviceptr a, b;
	gpx_region ra, rb;
};

/*
 * p's two buffers of size bytes on GPU0, registered on c: 1, or 0 when a registration failed
 * (p's to free either way); -1 with nothing held and the test's two checks skipped when GPU0
 * has no room for them.
 */
static int
long_pair(gpx_conn *c, size_t size, struct long_pair *p)
{
	char why[80];

	*p = (struct long_pair){ 0 };
	CK(cuCtxSetCurrent(ctx[0]));
	if (cuMemAlloc(&p->a, size) != CUDA_SUCCESS || cuMemAlloc(&p->b, size) != CUDA_SUCCESS) {
		snprintf(why, sizeof(why), "no %zu MiB free on GPU0 for the long copies", 2 * (size >> 20));
		tap_skip(2, why);
		if (p->a != 0)
			cuMemFree(p->a);
		return -1;
	}
	return gpx_register_cuda(c, (void *)p->a, size, 0, &p->ra) == 0 &&
	    gpx_register_cuda(c, (void *)p->b, size, 0, &p->rb) == 0;
}

static void
long_pair_free(gpx_conn *c, struct long_pair *p)
{
	if (p->ra)
		gpx_deregister(c, p->ra);
	if (p->rb)
		gpx_deregister(c, p->rb);
	cuMemFree(p->a);
	cuMemFree(p->b);
}

/*
 * Long copies within GPU0, one at a time, while the client sends nothing: the event loop naps
 * through each (busy_poll_us, set in main), and GPU0's worker, whose own nap through the copy
 * ends a few tens of microseconds before the copy does, wakes it then
 * (gpx_event_loop_early_wakes_total), so that it polls when the client's next request comes
 * instead of waking for it.  The first copies teach the worker the rate its naps through
 * copies of that size are timed by (the smaller copies of the tests before are slower by the
 * byte, and timed by a rate of their own).  A nap that finds its copy already ended takes the
 * rate only 10% faster, so a first copy that ran slow (under MPS on two H100 one did: 3 of the
 * 7 copies after it ended after the nap) takes some copies to unlearn: the loop's wakes are
 * counted over the last eight of twelve, and at least half of those end after the worker's
 * nap.  The copies land: the first and last 4 KiB of each are read back.
 */
void
test_loop_early_wake(gpx_conn *c)
{
	static const char *const counts[] = { "gpx_event_loop_early_wakes_total", "gpx_event_loop_naps_total",
		"gpx_event_loop_nap_wakes_total", "gpx_gpu_naps_total" };
	const size_t size = 512u << 20, n = 12, learning = 4;
	double before[4] = { -1, -1, -1, -1 }, after[4];
	struct long_pair p;
	int got = long_pair(c, size, &p);
	bool good = got > 0;
	char *page;

	if (got < 0)
		return;
	for (size_t i = 0; i < n && good; i++) {
		const uint32_t v = 0x5eed0000u + (uint32_t)i;
		if (i == learning) {
			page = harness_metrics(the_harness);
			for (int k = 0; k < 4; k++)
				before[k] = page ? metrics_sample(page, counts[k]) : -1;
			free(page);
		}
		good = long_copy(c, p.a, p.b, p.ra, p.rb, size, v) > 0;
	}
	page = harness_metrics(the_harness);
	for (int k = 0; k < 4; k++)
		after[k] = page ? metrics_sample(page, counts[k]) : -1;
	free(page);
	diag("over the last %zu long copies: the loop napped %.0f times (woken early %.0f, by a completion %.0f); "
	    "GPU workers napped %.0f times", n - learning, after[1] - before[1], after[0] - before[0],
	    after[2] - before[2], after[3] - before[3]);
	ok(good, "%zu copies of 512 MiB within GPU0, one at a time: each in place", n);
	ok(before[0] >= 0 && after[0] - before[0] >= (double)((n - learning) / 2), "the event loop napped through the "
	    "last %zu and GPU0's worker woke it before their ends, at least %zu times (%.0f)", n - learning,
	    (n - learning) / 2, after[0] - before[0]);
	long_pair_free(c, &p);
}

/*
 * A client whose wait spins until 120 us before its copy's end, then sleeps: GPU0's worker
 * calls it 300 us before the end, finds it still spinning, and calls again until it sleeps,
 * so that each sleep is cut short before the record comes (gpx_doorbells_early_total).
 * Before, a call that found the client spinning was dropped, and the record itself woke it
 * (within GPU0, Python's page copies of 2 GiB spent 74 us on the client's side, against
 * 10-15 us with a wait that spins throughout).  The copy's length is measured first, the
 * spin set from it (GPX_WAIT_SPIN_US, read when a connection is made); the copies land.
 */
void
test_wake_after_spin(const char *sock, gpx_conn *c)
{
	const size_t size = 1u << 30, n = 8;
	gpx_region sa = 0, sb = 0;
	gpx_conn *s = NULL;
	double t = 1e9, before = -1, after = -1;
	struct long_pair p;
	int got = long_pair(c, size, &p);
	bool good = got > 0;
	char us[32];

	if (got < 0)
		return;
	for (int i = 0; i < 4 && good; i++) {      /* (the worker learns the rate of such copies too) */
		double d = long_copy(c, p.a, p.b, p.ra, p.rb, size, 0x10ad0000u + (uint32_t)i);
		good = d > 0;
		t = d > 0 && d < t ? d : t;
	}
	if (good && t < 450e-6) {
		char why[96];
		snprintf(why, sizeof(why), "a copy of 1 GiB within GPU0 takes %.0f us: too short to spin through most of", t * 1e6);
		tap_skip(2, why);
		goto out;
	}
	snprintf(us, sizeof(us), "%.0f", t * 1e6 - 120);
	setenv("GPX_WAIT_SPIN_US", us, 1);
	good = good && gpx_connect(sock, "spin-then-sleep", &s) == 0 && gpx_register_cuda(s, (void *)p.a, size, 0, &sa) == 0 &&
	    gpx_register_cuda(s, (void *)p.b, size, 0, &sb) == 0;
	unsetenv("GPX_WAIT_SPIN_US");
	before = harness_metric(the_harness, "gpx_doorbells_early_total");
	for (size_t i = 0; i < n && good; i++)
		good = long_copy(s, p.a, p.b, sa, sb, size, 0x5ee90000u + (uint32_t)i) > 0;
	after = harness_metric(the_harness, "gpx_doorbells_early_total");
	ok(good, "%zu copies of 1 GiB within GPU0 (%.0f us each) by a client whose wait spins %s us: each in place", n,
	    t * 1e6, us);
	ok(before >= 0 && after - before >= (double)(n - 2), "... its sleeps were cut short before the records came, "
	    "the worker calling again once it slept: %.0f early doorbells for %zu copies", after - before, n);
out:
	if (sa)
		gpx_deregister(s, sa);
	if (sb)
		gpx_deregister(s, sb);
	gpx_close(s);
	long_pair_free(c, &p);
}

/*
 * The same under MPS from a gpxd held to 5% of GPU0's threads (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE):
 * there a 1 MiB copy's 128 blocks run in waves, so a completion word written by any block but
 * the last would come while later waves have not yet started.
 */
void
test_done_after_bytes_waves(void)
{
	struct harness h;
	struct buf a, m;
	gpx_conn *c = NULL;
	size_t early = 0, seen = 0;

	setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "5", 1);
	int e = harness_start(&h, "[cuda]\ntrust_legacy_ipc = yes\n");
	unsetenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
	if (e < 0 || gpx_connect(h.sock, "waves", &c) < 0) {
		ok(0, "gpxd on 5%% of GPU0's threads started, a client connected");
		if (e == 0)
			harness_finish(&h);
		return;
	}
	buf_init(&m, "host", -1, 0, c);
	buf_init(&a, "gpu0-ipc", 0, 0, c);
	bool good = done_after_bytes(c, &a, &m, &early, &seen);
	ok(good && early == 0, "the same from a gpxd on 5%% of GPU0's threads (MPS), its launches in waves: every "
	    "byte in place when the completion is seen (%zu of %zu words looked at then were not)", early, seen);
	if (!good || early != 0)
		harness_dump_log(&h);
	gpx_close(c);
	harness_finish(&h);
	CK(cuCtxSetCurrent(ctx[0]));
	cuMemFree(a.d);
	munmap(m.host, BUF);
	close(m.fd);
	free(a.mirror);
	free(m.mirror);
}

void
test_cached_registration(gpx_conn *c, struct buf *b)
{
	struct timespec t0, t1, t2;
	gpx_region r1, r2;

	/* The last GPU's context current, as in a program working there that registers b. */
	CK(cuCtxSetCurrent(ctx[ndev - 1]));
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int e1 = gpx_register_cuda(c, (void *)b->d, BUF, 0, &r1);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	int e2 = gpx_register_cuda(c, (void *)(b->d + 4096), 4096, 0, &r2);
	clock_gettime(CLOCK_MONOTONIC, &t2);
	ok(e1 == 0 && e2 == 0 && r1 != r2, "registering %s again (GPU%d's context current) gives new region ids%s%s",
	    b->name, ndev - 1, e1 || e2 ? ": " : "", e1 || e2 ? gpx_last_error(c) : "");
	CK(cuCtxSetCurrent(ctx[0]));
	diag("re-registration of %s: %.1f us and %.1f us (both served from the mapping cache)", b->name,
	    (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3,
	    (t2.tv_sec - t1.tv_sec) * 1e6 + (t2.tv_nsec - t1.tv_nsec) / 1e3);
	gpx_deregister(c, r1);
	gpx_deregister(c, r2);
}

/*
 * The node-wide cache, seen from a second connection: a legacy IPC allocation that one
 * connection holds is served to another that presents the same handle, from what is held (one
 * more hit, no driver open), and stays open when that connection goes.  A VMM allocation is
 * held per connection (a VMM fd names nothing gpxd can recognise without importing it): the
 * second connection's registration imports its pieces anew, and they go with it.
 */
void
test_cache_shared(const char *sock, struct buf *ipc, struct buf *vmm)
{
	struct harness_status s0, s1, s2, s3;
	gpx_conn *c2;
	gpx_region r1, r2;

	if (gpx_connect(sock, "gpu-test-second", &c2) < 0) {
		ok(0, "a second connection");
		return;
	}
	int e = harness_status(the_harness, &s0);
	e = e ? e : gpx_register_cuda(c2, (void *)ipc->d, BUF, 0, &r1);
	e = e ? e : harness_status(the_harness, &s1);
	ok(e == 0 && s1.cache_hits == s0.cache_hits + 1 && s1.cache_opens == s0.cache_opens &&
	    s1.cache_ipc == s0.cache_ipc, "%s registered on a second connection: served from the node's "
	    "cache (hits %llu -> %llu, opens %llu -> %llu, %u IPC allocations held)", ipc->name, s0.cache_hits,
	    s1.cache_hits, s0.cache_opens, s1.cache_opens, s1.cache_ipc);
	e = e ? e : gpx_register_cuda(c2, (void *)vmm->d, BUF, 0, &r2);
	e = e ? e : harness_status(the_harness, &s2);
	ok(e == 0 && s2.cache_opens > s1.cache_opens && s2.cache_vmm > s1.cache_vmm, "%s registered on a "
	    "second connection: its pieces imported for that connection (opens %llu -> %llu, pieces %u -> %u)",
	    vmm->name, s1.cache_opens, s2.cache_opens, s1.cache_vmm, s2.cache_vmm);
	gpx_close(c2);
	/* the closing connection's regions go on the loop; its pieces on a task thread */
	for (int i = 0; i < 200 && harness_status(the_harness, &s3) == 0 && s3.cache_vmm != s1.cache_vmm; i++)
		usleep(10000);
	ok(harness_status(the_harness, &s3) == 0 && s3.cache_ipc == s0.cache_ipc && s3.cache_vmm == s1.cache_vmm,
	    "the second connection gone: the IPC allocation stays open for the first (%u held), its VMM pieces "
	    "are let go (%u -> %u)", s3.cache_ipc, s2.cache_vmm, s3.cache_vmm);
}
