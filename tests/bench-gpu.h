/*
 * What gpx-bench-gpu's files of modes share: the devices of this process (a primary context
 * and a stream each, peer access between all of them) and GPU buffers that gpxd accepts.
 */
#ifndef GPX_BENCH_GPU_H
#define GPX_BENCH_GPU_H

#include <cuda.h>

#include "client-lib/gpx.h"

#define BENCH_GPUS 16

/* Opens every device once (at most BENCH_GPUS); returns how many, 0 without a usable GPU. */
int bench_gpu_open(void);
CUcontext bench_gpu_ctx(int dev);
/* A process that opened one device itself (ctx on dev) of the node's n: VMM buffers can then
 * still be placed on the others, with no context there. */
void bench_gpu_adopt(int dev, CUcontext ctx, int n);

/*
 * A buffer on dev, readable and writable from every device: a cuMemCreate allocation
 * exportable as a POSIX fd (the cuda-vmm kind), or cuMemAlloc memory (a legacy IPC handle)
 * when GPX_BENCH_GPU_MEM=ipc.  Filled with 0x5a.
 */
struct gbuf {
	int dev;
	CUdeviceptr d;
	size_t len;                      /* rounded up to the allocation granularity */
	CUmemGenericAllocationHandle h;  /* 0 for cuMemAlloc memory */
	gpx_region region;               /* once registered */
};
int gbuf_alloc(int dev, size_t len, struct gbuf *g);
void gbuf_release(struct gbuf *g);    /* frees the memory; deregistering is the caller's */

#endif
