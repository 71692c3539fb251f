/*
 * The baseline of python3 -m gpx.bench kv: the copy a PyTorch program launches itself when it
 * moves KV-cache blocks without gpx, one gather-scatter kernel over every layer's K and V
 * tensors at once (what vLLM's copy_blocks does).  The bench loads the fatbin built from this
 * file with cuModuleLoadData through ctypes, so no compiler and no extra package are needed
 * where it runs.
 *
 * Grid: x = the blocks to copy, y = the tensors.  Thread block (x, y) copies block src_idx[x]
 * of tensor y to block dst_idx[x] of its destination, in 16-byte words, eight loads in flight
 * per thread before their stores.  Tensors' addresses come from two device tables; every
 * address and block_bytes must be 16-byte aligned (the bench checks that before launching).
 */
#include <stdint.h>

#define UNROLL 8

extern "C" __global__ void __launch_bounds__(256)
gpx_bench_copy_blocks(const uint64_t *__restrict__ src_ptrs, const uint64_t *__restrict__ dst_ptrs,
    const int32_t *__restrict__ src_idx, const int32_t *__restrict__ dst_idx, uint64_t block_bytes)
{
	const uint4 *s = (const uint4 *)(src_ptrs[blockIdx.y] + (uint64_t)src_idx[blockIdx.x] * block_bytes);
	uint4 *d = (uint4 *)(dst_ptrs[blockIdx.y] + (uint64_t)dst_idx[blockIdx.x] * block_bytes);
	const uint64_t words = block_bytes >> 4;
	uint64_t i = threadIdx.x;

	for (; i + (UNROLL - 1) * blockDim.x < words; i += UNROLL * blockDim.x) {
		uint4 v[UNROLL];
#pragma unroll
		for (int k = 0; k < UNROLL; k++)
			v[k] = s[i + k * blockDim.x];
#pragma unroll
		for (int k = 0; k < UNROLL; k++)
			d[i + k * blockDim.x] = v[k];
	}
	for (; i < words; i += blockDim.x)
		d[i] = s[i];
}
