/*
 * What the GPU test programs share: a driver call that must succeed (CK), the primary context
 * of every device, and VMM memory made the way PyTorch's expandable segments make it (pieces
 * created with POSIX-fd handles, mapped back to back into one reservation), and device buffers
 * registered with gpxd next to the bytes they should hold.  Header-only.
 */
#ifndef GPX_TESTS_GPU_UTIL_H
#define GPX_TESTS_GPU_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/tap.h"
#include "tests/util.h"

#define GPU_MAX 16

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *n_ = "?"; \
	cuGetErrorName(r_, &n_); tap_bail("%s: %s", #x, n_); } } while (0)

/* The primary context of every device (at most GPU_MAX), the first one current; the count. */
static inline int
gpu_contexts(CUcontext *ctx)
{
	CUdevice d;
	int n;

	CK(cuInit(0));
	CK(cuDeviceGetCount(&n));
	if (n > GPU_MAX)
		n = GPU_MAX;
	for (int i = 0; i < n; i++) {
		CK(cuDeviceGet(&d, i));
		CK(cuDevicePrimaryCtxRetain(&ctx[i], d));
	}
	CK(cuCtxSetCurrent(ctx[0]));
	return n;
}

static inline CUmemAllocationProp
vmm_prop(int dev)
{
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, dev },
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
	};
	return prop;
}

/* The allocation granularity of VMM memory on dev. */
static inline size_t
vmm_granularity(int dev)
{
	CUmemAllocationProp prop = vmm_prop(dev);
	size_t g;

	CK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	return g;
}

/* A piece of `size` bytes (a multiple of the granularity) mapped at va, readable and writable by dev. */
static inline CUmemGenericAllocationHandle
vmm_piece(int dev, CUdeviceptr va, size_t size)
{
	CUmemAllocationProp prop = vmm_prop(dev);
	CUmemAccessDesc a = { { CU_MEM_LOCATION_TYPE_DEVICE, dev }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	CUmemGenericAllocationHandle h;

	CK(cuMemCreate(&h, size, &prop, 0));
	CK(cuMemMap(va, size, 0, h, 0));
	CK(cuMemSetAccess(va, size, &a, 1));
	return h;
}

/* One piece in a reservation of its own: plain cuMemCreate memory. */
static inline void
vmm_alloc(int dev, size_t size, CUdeviceptr *d, CUmemGenericAllocationHandle *h, size_t *alloc)
{
	size_t gran = vmm_granularity(dev);

	*alloc = (size + gran - 1) / gran * gran;
	CK(cuMemAddressReserve(d, *alloc, 0, 0, 0));
	*h = vmm_piece(dev, *d, *alloc);
}

/* A device buffer registered on a connection: VMM or cuMemAlloc memory, filled from a host copy. */
struct dbuf {
	CUcontext ctx;
	int dev;
	CUdeviceptr d;
	CUmemGenericAllocationHandle h;
	size_t len, alloc;
	bool vmm;
	unsigned char *host;       /* what it was filled with */
	gpx_region r;
};

/* len bytes on dev (whose context is ctx): random from *seed, or zeros when seed is NULL. */
static inline void
dbuf_new(struct dbuf *b, gpx_conn *c, CUcontext ctx, int dev, size_t len, bool vmm, uint64_t *seed)
{
	memset(b, 0, sizeof(*b));
	b->ctx = ctx;
	b->dev = dev;
	b->len = len;
	b->vmm = vmm;
	CK(cuCtxSetCurrent(ctx));
	if (vmm)
		vmm_alloc(dev, len, &b->d, &b->h, &b->alloc);
	else
		CK(cuMemAlloc(&b->d, len));
	if ((b->host = calloc(1, len)) == NULL)
		tap_bail("out of memory");
	if (seed != NULL)
		for (size_t i = 0; i < len; i += 8) {     /* every byte, the tail of an odd length too */
			uint64_t x = xorshift(seed);
			memcpy(b->host + i, &x, len - i < 8 ? len - i : 8);
		}
	CK(cuMemcpyHtoD(b->d, b->host, len));
	int e = gpx_register_cuda(c, (void *)b->d, len, 0, &b->r);
	if (e < 0)
		tap_bail("gpx_register_cuda on GPU%d: %s: %s", dev, gpx_strerror(e), gpx_last_error(c));
}

/* Whether the device holds exactly the b->len bytes at want. */
static inline bool
dbuf_holds(const struct dbuf *b, const unsigned char *want)
{
	unsigned char *got = malloc(b->len);
	bool same;

	if (got == NULL)
		tap_bail("out of memory");
	CK(cuCtxSetCurrent(b->ctx));
	CK(cuMemcpyDtoH(got, b->d, b->len));
	same = memcmp(got, want, b->len) == 0;
	free(got);
	return same;
}

static inline void
dbuf_free(gpx_conn *c, struct dbuf *b)
{
	gpx_deregister(c, b->r);
	CK(cuCtxSetCurrent(b->ctx));
	if (b->vmm) {
		CK(cuMemUnmap(b->d, b->alloc));
		CK(cuMemRelease(b->h));
		CK(cuMemAddressFree(b->d, b->alloc));
	} else
		CK(cuMemFree(b->d));
	free(b->host);
}

/* The pairs' buffers src[0..n) and dst[0..n), and the two arrays. */
static inline void
dbufs_free(gpx_conn *c, struct dbuf *src, struct dbuf *dst, int n)
{
	for (int k = 0; k < n; k++) {
		dbuf_free(c, &src[k]);
		dbuf_free(c, &dst[k]);
	}
	free(src);
	free(dst);
}

#endif
