/*
 * The baselines of gpx-bench-gpu's page and tensor modes.  bench_gather: the gather-scatter
 * kernel a program without gpx writes for itself (what vLLM's copy_blocks does), one launch
 * over all pages.  Page i goes
 * from src + sp[i] * size to dst + dp[i] * size; the two lists live in device memory, as a
 * program's block table does.  One warp per page at a time, 16-byte loads, eight in flight per
 * lane before their stores.  The page size is a multiple of 16 bytes and both bases are
 * 16-byte aligned (the benchmark's buffers are).
 */
#include <stdint.h>

#define UNROLL 8

/* words 16-byte words from s4 to d4 by one warp, this thread being its lane. */
static __device__ __forceinline__ void
warp_copy(const uint4 *s4, uint4 *d4, uint64_t words, uint32_t lane)
{
	uint64_t i = lane;

	for (; i + (UNROLL - 1) * 32 < words; i += UNROLL * 32) {
		uint4 v[UNROLL];
#pragma unroll
		for (int k = 0; k < UNROLL; k++)
			v[k] = s4[i + k * 32];
#pragma unroll
		for (int k = 0; k < UNROLL; k++)
			d4[i + k * 32] = v[k];
	}
	for (; i < words; i += 32)
		d4[i] = s4[i];
}

extern "C" __global__ void __launch_bounds__(256)
bench_gather(const char *__restrict__ src, char *__restrict__ dst, const uint32_t *__restrict__ sp,
    const uint32_t *__restrict__ dp, uint32_t n, uint32_t size)
{
	const uint32_t lane = threadIdx.x & 31;
	const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
	const uint64_t words = size >> 4;

	for (uint32_t p = warp; p < n; p += warps)
		warp_copy((const uint4 *)(src + (uint64_t)sp[p] * size), (uint4 *)(dst + (uint64_t)dp[p] * size), words,
		    lane);
}

/*
 * gpu-tensors' baseline: the multi-tensor copy kernel a program writes for a list of separate
 * tensors (as PyTorch's multi_tensor_apply does), one launch over all of them.  The list holds
 * (source, destination, length) of tiles: each tensor cut into tiles of a few tens of KiB, so
 * that the warps share a large tensor.  One warp per tile at a time, as above; addresses and
 * lengths are multiples of 16 bytes (the benchmark's tensors are).
 */
struct bench_tile {
	uint64_t src, dst, len;
};

extern "C" __global__ void __launch_bounds__(256)
bench_tensors(const struct bench_tile *__restrict__ tiles, uint32_t n)
{
	const uint32_t lane = threadIdx.x & 31;
	const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const uint32_t warps = (gridDim.x * blockDim.x) >> 5;

	for (uint32_t t = warp; t < n; t += warps)
		warp_copy((const uint4 *)tiles[t].src, (uint4 *)tiles[t].dst, tiles[t].len >> 4, lane);
}
