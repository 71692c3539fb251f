/*
 * What gpx-bench-gpu's files of modes share (tests/bench-gpu.c): the devices of this process (a
 * primary context and a stream each, peer access between all of them), GPU buffers that gpxd
 * accepts, one copy done in this process or through gpxd, and a table row from its figures.
 */
#ifndef GPX_BENCH_GPU_H
#define GPX_BENCH_GPU_H

#include <stdbool.h>
#include <stdint.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/bench.h"

#define BENCH_GPUS 16

/* A CUresult that must be CUDA_SUCCESS: false, after saying which call failed, when it is not. */
#define CK(x) bench_gpu_ok((x), #x)
bool bench_gpu_ok(CUresult r, const char *what);

/* Opens every device once (at most BENCH_GPUS); returns how many, 0 without a usable GPU. */
int bench_gpu_open(void);
CUcontext bench_gpu_ctx(int dev);
CUstream bench_gpu_stream(int dev);
int bench_gpu_count(void);           /* the devices of bench_gpu_open or bench_gpu_adopt */
/* A process that opened one device itself (ctx on dev) of the node's n: VMM buffers can then
 * still be placed on the others, with no context there. */
void bench_gpu_adopt(int dev, CUcontext ctx, int n);
/* A mode's start: 0 with at least need devices open, else BENCH_SKIP after saying so. */
int bench_gpu_setup(struct bench_ctx *b, const char *mode, int need);

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
/* Maps an exported fd's allocation for GPU dev (-1: every GPU): 0 or -1. */
int gbuf_import(int fd, size_t len, int dev, CUdeviceptr *va, CUmemGenericAllocationHandle *h);
/* gbuf_alloc, then registered with the daemon under test; gbuf_free deregisters and frees. */
int gbuf_new(struct bench_ctx *b, int dev, size_t len, struct gbuf *g);
void gbuf_free(struct bench_ctx *b, struct gbuf *g);

/* One copy, direct and brokered: the two bench_op of bench_pair_measure for the same bytes. */
struct gcopy {
	struct bench_ctx *b;
	int dev;                 /* whose stream runs the direct copy */
	uint64_t dst, src, len;
	gpx_region rdst, rsrc;
	uint64_t dst_off, src_off;
	uint64_t tag;
};
int gcopy_direct(void *arg);         /* cuMemcpyAsync on dev's stream, synchronized */
int gcopy_spin(void *arg);           /* gpx_copy, then spinning on gpx_poll */

/*
 * The n copies len[i] from src[i] (on sdev) to dst[i] (on ddev) in one cuMemcpyBatchAsync on
 * sdev's stream, synchronized: 0, or an error with why said in why (the driver lacks the call:
 * -GPX_ENOTSUP; it failed: -GPX_EIO).
 */
int bench_gpu_batch(int sdev, int ddev, CUdeviceptr *dst, CUdeviceptr *src, size_t *len, size_t n, char *why,
    size_t whylen);

/* A row of the mode's table: bench_table_row with its fields as arguments. */
void bench_gpu_row(struct bench_ctx *b, const char *what, const char *metric, double direct, double gpx,
    bool lower, uint64_t bytes);
/* The same, with the id of the row's target in TARGETS.md (NULL: none). */
void bench_gpu_row_t(struct bench_ctx *b, const char *what, const char *metric, double direct, double gpx,
    bool lower, uint64_t bytes, const char *target);

#endif
