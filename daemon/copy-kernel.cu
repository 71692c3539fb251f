/*
 * The SM copy kernel: many small segments in one launch.  Copy engines pay a few microseconds
 * per copy, so 65,536 scattered 4 KiB pages as separate copies run at a few GB/s; one launch
 * of this kernel moves them at close to link speed.
 *
 * Each warp takes one segment at a time (warp w: segments w, w + warps, ...), so a bounded grid
 * (gpxd.conf cuda.sm_copy_blocks blocks of 256 threads, spread one per SM) keeps a thousand
 * segments in flight while leaving most of each SM's threads to the clients' own kernels.
 * A lane issues eight 16-byte loads before its eight stores, which hides the latency of the
 * link; segments whose source, destination or length are not 16-byte aligned take 8-byte or
 * byte steps for what remains.  The segment list holds absolute addresses, checked by gpxd.
 */
#include <stdint.h>

struct gpx_kseg {
	uint64_t src;
	uint64_t dst;
	uint64_t len;
};

#define UNROLL 8

extern "C" __global__ void __launch_bounds__(256)
gpx_copy_segments(const struct gpx_kseg *__restrict__ segs, uint32_t n)
{
	const uint32_t lane = threadIdx.x & 31;
	const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const uint32_t warps = (gridDim.x * blockDim.x) >> 5;

	for (uint32_t s = warp; s < n; s += warps) {
		const struct gpx_kseg g = segs[s];
		const char *src = (const char *)g.src;
		char *dst = (char *)g.dst;
		uint64_t done = 0;

		if (((g.src | g.dst) & 15) == 0) {
			const uint4 *s4 = (const uint4 *)src;
			uint4 *d4 = (uint4 *)dst;
			const uint64_t words = g.len >> 4;
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
			done = words << 4;
		} else if (((g.src | g.dst) & 7) == 0) {
			const uint64_t *s8 = (const uint64_t *)src;
			uint64_t *d8 = (uint64_t *)dst;
			const uint64_t words = g.len >> 3;
			for (uint64_t i = lane; i < words; i += 32)
				d8[i] = s8[i];
			done = words << 3;
		}
		for (uint64_t i = done + lane; i < g.len; i += 32)
			dst[i] = src[i];
	}
}
