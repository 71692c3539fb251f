/*
 * The SM copy kernel: many small segments in one launch.  Copy engines pay a few microseconds
 * per copy, so 65,536 scattered 4 KiB pages as separate copies run at a few GB/s; one launch
 * of this kernel moves them at close to link speed.
 *
 * Each warp takes one segment at a time (warp w: segments w, w + warps, ...).  gpxd launches a
 * block of 256 threads for every 8 segments, so each warp copies one and its block ends with
 * it (as a program's own gather kernel is launched); gpxd.conf cuda.sm_copy_blocks can bound
 * the grid instead, and then warps loop.
 * A lane issues eight 16-byte loads before its eight stores, which hides the latency of the
 * link; segments whose source, destination or length are not 16-byte aligned take 8-byte or
 * byte steps for what remains.  The segment list holds absolute addresses, checked by gpxd.
 * gpx_copy_pages does the same for a list of page numbers (gpx_copy_pages(3)).
 */
#include <stdint.h>

struct gpx_kseg {
	uint64_t src;
	uint64_t dst;
	uint64_t len;
};

#define UNROLL 8

/*
 * One segment by nt threads, this one being thread t of them: 16-byte steps where source and
 * destination allow (UNROLL loads in flight before their stores, where the segment is long
 * enough), else 8, else bytes.
 */
static __device__ __forceinline__ void
copy_strided(const char *src, char *dst, uint64_t len, uint64_t t, uint64_t nt)
{
	uint64_t done = 0;

	if ((((uintptr_t)src | (uintptr_t)dst) & 15) == 0) {
		const uint4 *s4 = (const uint4 *)src;
		uint4 *d4 = (uint4 *)dst;
		const uint64_t words = len >> 4;
		uint64_t i = t;
		for (; i + (UNROLL - 1) * nt < words; i += UNROLL * nt) {
			uint4 v[UNROLL];
#pragma unroll
			for (int k = 0; k < UNROLL; k++)
				v[k] = s4[i + k * nt];
#pragma unroll
			for (int k = 0; k < UNROLL; k++)
				d4[i + k * nt] = v[k];
		}
		for (; i < words; i += nt)
			d4[i] = s4[i];
		done = words << 4;
	} else if ((((uintptr_t)src | (uintptr_t)dst) & 7) == 0) {
		const uint64_t *s8 = (const uint64_t *)src;
		uint64_t *d8 = (uint64_t *)dst;
		const uint64_t words = len >> 3;
		for (uint64_t i = t; i < words; i += nt)
			d8[i] = s8[i];
		done = words << 3;
	}
	for (uint64_t i = done + t; i < len; i += nt)
		dst[i] = src[i];
}

/* One segment by one warp. */
static __device__ __forceinline__ void
copy_one(const char *src, char *dst, uint64_t len, uint32_t lane)
{
	copy_strided(src, dst, len, lane, 32);
}

extern "C" __global__ void __launch_bounds__(256)
gpx_copy_segments(const struct gpx_kseg *__restrict__ segs, uint32_t n)
{
	const uint32_t lane = threadIdx.x & 31;
	const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const uint32_t warps = (gridDim.x * blockDim.x) >> 5;

	for (uint32_t s = warp; s < n; s += warps) {
		const struct gpx_kseg g = segs[s];
		copy_one((const char *)g.src, (char *)g.dst, g.len, lane);
	}
}

/*
 * A few segments passed by value, as the launch's parameters: the small chunks of gpxd's quick
 * stream.  Nothing is staged, so a small copy touches no copy engine at all (a descriptor
 * upload would be a copy of its own), and cannot queue behind copy-engine work of gpxd's bulk
 * streams or, under MPS, of other processes on the GPU.  Every segment is spread over the
 * whole grid, which the daemon sizes to the bytes.  KFEW_MAX matches GPU_KFEW_MAX in gpu.h.
 *
 * The launch also says it is done: the last block to finish writes seq into the stream's
 * completion word (pinned host memory, polled by gpxd's worker), after a system-wide fence,
 * as a stream memory operation after the launch would, but without that second operation: the
 * GPU need not wait for the kernel to drain before it, nor gpxd make a second driver call.
 * The blocks count themselves in few_blocks, which the last one sets back to 0 (atomicInc
 * wraps); the quick stream's launches run one after another, so one counter serves them.
 */
#define KFEW_MAX 32

struct gpx_kfew {
	uint64_t n;
	uint64_t done;          /* where to write seq once every block is done; 0: nowhere */
	uint64_t seq;
	struct gpx_kseg seg[KFEW_MAX];
};

static __device__ unsigned int few_blocks;

extern "C" __global__ void __launch_bounds__(256)
gpx_copy_few(const struct gpx_kfew f)
{
	const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	const uint64_t nt = (uint64_t)gridDim.x * blockDim.x;

	for (uint32_t s = 0; s < f.n; s++)
		copy_strided((const char *)f.seg[s].src, (char *)f.seg[s].dst, f.seg[s].len, t, nt);   /* the whole grid */
	if (f.done == 0)
		return;
	__syncthreads();                /* this block's stores, seen by its thread 0 */
	if (threadIdx.x != 0)
		return;
	__threadfence();                /* ... and ordered before its count */
	if (gridDim.x > 1 && atomicInc(&few_blocks, gridDim.x - 1) != gridDim.x - 1)
		return;
	__threadfence_system();         /* every block's stores before the word, to every observer */
	*(volatile unsigned long long *)f.done = f.seq;
}

/*
 * Pages: items [item0, item0 + n) of a page job, item i being page i % npages of the job's
 * list for pair i / npages (a batch's pairs share one list; a single transfer is one pair).
 * Entry e of the list is page sp[e * stride] of the source and dp[e * stride] of the
 * destination: gpxd's checked private copy in pinned host memory, read in place (pairs of
 * numbers, stride 2), or the client's own list in GPU memory (two arrays, stride 1), which
 * only this kernel reads: a page is copied only if it lies below lim_s and lim_d, and one
 * that does not sets *oob instead (which the job's end reads).  The pairs' bases are in
 * pinned host memory.  Each warp loads the page of its next item before copying the current
 * one, so the latency of the list hides behind the copy.  Page p of a side lies at its pair's
 * base + p * size.  A chunk is bytes [head, head + bytes) of the items from item0 on: the
 * first and last may be cut.
 */
extern "C" __global__ void __launch_bounds__(256)
gpx_copy_pages(const uint32_t *__restrict__ sp, const uint32_t *__restrict__ dp, uint32_t stride, uint32_t npages,
    const ulonglong2 *__restrict__ pairs, uint32_t item0, uint32_t n, uint64_t size, uint64_t head, uint64_t bytes,
    uint32_t lim_s, uint32_t lim_d, uint32_t *oob)
{
	const uint32_t lane = threadIdx.x & 31;
	const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
	const uint64_t end = head + bytes;

	if (warp >= n)
		return;
	uint32_t item = item0 + warp;
	uint64_t e = (uint64_t)(item % npages) * stride;
	uint32_t cs = sp[e], cd = dp[e];
	for (uint32_t k = warp; k < n; k += warps, item += warps) {
		uint32_t ns = cs, nd = cd;
		if (k + warps < n) {
			e = (uint64_t)((item + warps) % npages) * stride;
			ns = sp[e];
			nd = dp[e];
		}
		const ulonglong2 base = pairs[item / npages];
		const uint64_t at = (uint64_t)k * size;
		const uint64_t lo = head > at ? head - at : 0;
		const uint64_t hi = end < at + size ? end - at : size;
		if (cs < lim_s && cd < lim_d)
			copy_one((const char *)(base.x + cs * size + lo), (char *)(base.y + cd * size + lo), hi - lo, lane);
		else if (lane == 0) {
			*(volatile uint32_t *)oob = 1;
			__threadfence_system();
		}
		cs = ns;
		cd = nd;
	}
}
