/*
 * gpx-bench-gpu's shared GPU pieces (tests/bench-gpu.h): the devices of this process (a primary
 * context and a stream each, peer access between all of them), GPU buffers that gpxd accepts,
 * one copy done in this process or through gpxd, and a table row from its figures.
 *
 * gpx-bench-gpu is gpx-bench with the GPU modes added.  Each prints the direct figure (the CUDA
 * driver API called in this process: cuMemcpyAsync between UVA pointers, which is
 * cuMemcpyPeerAsync between devices) next to the same work brokered by gpxd, measured in the
 * same run, and their ratio.  Buffers are cuMemCreate allocations exported as POSIX fds (the
 * `cuda-vmm` kind, accepted on every node), so direct and brokered copies touch the very same
 * memory.  The modes live in tests/bench-gpu-copy.c (gpu-import, gpu-copy, gpu-bidir,
 * gpu-latency), tests/bench-gpu-pages.c (gpu-pages, gpu-idle), tests/bench-gpu-tensors.c
 * (gpu-tensors), tests/bench-gpu-host.c (gpu-host, gpu-register), tests/bench-gpu-remote.c
 * (gpu-remote) and tests/bench-all2all.c (gpu-all2all).
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>

#include "tests/bench.h"
#include "tests/bench-gpu.h"

static CUcontext ctx[BENCH_GPUS];
static CUstream stream[BENCH_GPUS];
static int ndev = -1;

bool
bench_gpu_ok(CUresult r, const char *what)
{
	const char *n = "?";

	if (r == CUDA_SUCCESS)
		return true;
	cuGetErrorName(r, &n);
	fprintf(stderr, "gpx-bench-gpu: %s: %s\n", what, n);
	return false;
}

int
bench_gpu_open(void)
{
	if (ndev < 0) {
		CUdevice d;
		ndev = 0;
		if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&ndev) != CUDA_SUCCESS)
			ndev = 0;
		if (ndev > BENCH_GPUS)
			ndev = BENCH_GPUS;
		for (int i = 0; i < ndev; i++)
			if (!CK(cuDeviceGet(&d, i)) || !CK(cuDevicePrimaryCtxRetain(&ctx[i], d)) ||
			    !CK(cuCtxSetCurrent(ctx[i])) || !CK(cuStreamCreate(&stream[i], CU_STREAM_NON_BLOCKING)))
				ndev = 0;
		for (int i = 0; i < ndev; i++)
			for (int j = 0; j < ndev; j++)
				if (i != j) {
					cuCtxSetCurrent(ctx[i]);
					cuCtxEnablePeerAccess(ctx[j], 0);
				}
	}
	return ndev;
}

CUcontext
bench_gpu_ctx(int dev)
{
	return ctx[dev];
}

CUstream
bench_gpu_stream(int dev)
{
	return stream[dev];
}

int
bench_gpu_count(void)
{
	return ndev;
}

void
bench_gpu_adopt(int dev, CUcontext c, int n)
{
	ctx[dev] = c;
	ndev = n;
}

int
bench_gpu_setup(struct bench_ctx *b, const char *mode, int need)
{
	if (bench_gpu_open() < need) {
		char why[96];
		snprintf(why, sizeof(why), "needs %d GPU%s, this machine has %d", need, need > 1 ? "s" : "", ndev);
		bench_skip(b, mode, why);
		return BENCH_SKIP;
	}
	return 0;
}

int
gbuf_alloc(int dev, size_t len, struct gbuf *g)
{
	const char *kind = getenv("GPX_BENCH_GPU_MEM");

	if (kind != NULL && strcmp(kind, "ipc") == 0) {
		/* cudaMalloc-style memory, registered as a legacy IPC handle (trusted nodes only). */
		memset(g, 0, sizeof(*g));
		g->dev = dev;
		g->len = len;
		cuCtxSetCurrent(ctx[dev]);
		return CK(cuMemAlloc(&g->d, len)) && CK(cuMemsetD8(g->d, 0x5a, len)) ? 0 : -1;
	}
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, dev },
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
	};
	CUmemAccessDesc acc[BENCH_GPUS];
	size_t gran;

	memset(g, 0, sizeof(*g));
	g->dev = dev;
	if (ctx[dev] != NULL)
		cuCtxSetCurrent(ctx[dev]);
	if (!CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
		return -1;
	g->len = (len + gran - 1) / gran * gran;
	for (int i = 0; i < ndev; i++)
		acc[i] = (CUmemAccessDesc){ { CU_MEM_LOCATION_TYPE_DEVICE, i }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	if (!CK(cuMemCreate(&g->h, g->len, &prop, 0)) || !CK(cuMemAddressReserve(&g->d, g->len, 0, 0, 0)) ||
	    !CK(cuMemMap(g->d, g->len, 0, g->h, 0)) || !CK(cuMemSetAccess(g->d, g->len, acc, ndev)) ||
	    !CK(cuMemsetD8(g->d, 0x5a, g->len)))
		return -1;
	return 0;
}

/*
 * The allocation an exported POSIX fd names, mapped as gpxd maps a client's VMM buffer:
 * imported, reserved, mapped, and readable and writable from GPU dev (-1: from every GPU of
 * this process).  *h is the imported handle, released after cuMemUnmap and cuMemAddressFree.
 */
int
gbuf_import(int fd, size_t len, int dev, CUdeviceptr *va, CUmemGenericAllocationHandle *h)
{
	CUmemAccessDesc acc[BENCH_GPUS];
	const int first = dev < 0 ? 0 : dev, end = dev < 0 ? ndev : dev + 1;
	int n = 0;

	for (int i = first; i < end && n < BENCH_GPUS; i++)
		acc[n++] = (CUmemAccessDesc){ { CU_MEM_LOCATION_TYPE_DEVICE, i }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	*va = 0;
	return CK(cuMemImportFromShareableHandle(h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) &&
	    CK(cuMemAddressReserve(va, len, 0, 0, 0)) && CK(cuMemMap(*va, len, 0, *h, 0)) &&
	    CK(cuMemSetAccess(*va, len, acc, n)) ? 0 : -1;
}

void
gbuf_release(struct gbuf *g)
{
	if (g->h == 0) {
		cuMemFree(g->d);
		return;
	}
	cuMemUnmap(g->d, g->len);
	cuMemAddressFree(g->d, g->len);
	cuMemRelease(g->h);
}

int
gbuf_new(struct bench_ctx *b, int dev, size_t len, struct gbuf *g)
{
	int r;

	if (gbuf_alloc(dev, len, g) < 0)
		return -1;
	if ((r = gpx_register_cuda(b->conn, (void *)g->d, g->len, 0, &g->region)) < 0)
		return bench_fail(b, r, "gpx_register_cuda");
	return 0;
}

void
gbuf_free(struct bench_ctx *b, struct gbuf *g)
{
	gpx_deregister(b->conn, g->region);
	gbuf_release(g);
}

/* ---- one copy, direct and brokered ---- */

int
gcopy_direct(void *arg)
{
	struct gcopy *o = arg;

	cuCtxSetCurrent(ctx[o->dev]);
	if (cuMemcpyAsync(o->dst, o->src, o->len, stream[o->dev]) != CUDA_SUCCESS ||
	    cuStreamSynchronize(stream[o->dev]) != CUDA_SUCCESS)
		return -GPX_EIO;
	return 0;
}

/* Submits and spins on the completion queue: the lowest-latency way to use gpx. */
int
gcopy_spin(void *arg)
{
	struct gcopy *o = arg;
	struct gpx_completion c;
	int r = gpx_copy(o->b->conn, o->rsrc, o->src_off, o->rdst, o->dst_off, o->len, ++o->tag);

	if (r < 0)
		return r;
	while ((r = gpx_poll(o->b->conn, &c, 1)) == 0)
		;
	return r < 0 ? r : c.status;
}

/* ---- cuMemcpyBatchAsync, the driver's own way of many copies in one call ---- */

typedef CUresult (*batch_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
    size_t, CUstream);

int
bench_gpu_batch(int sdev, int ddev, CUdeviceptr *dst, CUdeviceptr *src, size_t *len, size_t n, char *why,
    size_t whylen)
{
	static batch_fn fn;
	static bool looked;
	CUdriverProcAddressQueryResult q;
	CUmemcpyAttributes at = { .srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
		.srcLocHint = { CU_MEM_LOCATION_TYPE_DEVICE, sdev }, .dstLocHint = { CU_MEM_LOCATION_TYPE_DEVICE, ddev } };
	size_t idx = 0;
	const char *name = NULL;
	CUresult r;

	if (!looked) {
		void *f = NULL;
		looked = true;
		/* As CUDA 13 declares it (CUDA 12.8 had a failure index more). */
		if (cuGetProcAddress("cuMemcpyBatchAsync", &f, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &q) == CUDA_SUCCESS &&
		    q == CU_GET_PROC_ADDRESS_SUCCESS)
			fn = (batch_fn)f;
	}
	if (fn == NULL) {
		snprintf(why, whylen, "this driver has no cuMemcpyBatchAsync of CUDA 13");
		return -GPX_ENOTSUP;
	}
	cuCtxSetCurrent(ctx[sdev]);
	if ((r = fn(dst, src, len, n, &at, &idx, 1, stream[sdev])) == CUDA_SUCCESS &&
	    (r = cuStreamSynchronize(stream[sdev])) == CUDA_SUCCESS)
		return 0;
	cuGetErrorName(r, &name);
	snprintf(why, whylen, "cuMemcpyBatchAsync of %zu copies failed: %s", n, name != NULL ? name : "?");
	return -GPX_EIO;
}

void
bench_gpu_row(struct bench_ctx *b, const char *what, const char *metric, double direct, double gpx, bool lower, uint64_t bytes)
{
	bench_gpu_row_t(b, what, metric, direct, gpx, lower, bytes, NULL);
}

void
bench_gpu_row_t(struct bench_ctx *b, const char *what, const char *metric, double direct, double gpx, bool lower,
    uint64_t bytes, const char *target)
{
	struct bench_row r = { .what = what, .metric = metric, .direct = direct, .gpx = gpx,
		.lower_is_better = lower, .bytes = bytes, .target = target };
	bench_table_row(b, &r);
}
