/*
 * What the GPU test programs share: a driver call that must succeed (CK), the primary context
 * of every device, and VMM memory made the way PyTorch's expandable segments make it (pieces
 * created with POSIX-fd handles, mapped back to back into one reservation).  Header-only.
 */
#ifndef GPX_TESTS_GPU_UTIL_H
#define GPX_TESTS_GPU_UTIL_H

#include <stddef.h>
#include <cuda.h>

#include "tests/tap.h"

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

#endif
