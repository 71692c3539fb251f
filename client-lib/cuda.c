/*
 * gpx_register_cuda(): the only file of libgpxclient that includes cuda.h.  It loads the CUDA
 * driver on first use (dlopen, cuGetProcAddress), so the library works without one for host
 * memory, and describes a device pointer to the daemon: which device (by UUID), which
 * allocation (VMM export fd, or legacy IPC handle of the allocation base), and where in it.
 * PyTorch's caching allocator hands out interior pointers of larger cudaMalloc blocks: the base
 * and size come from cuMemGetAddressRange and the offset travels separately.
 */
#include "config.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <cuda.h>

#include "client-lib/client.h"

#define API __attribute__((visibility("default")))

#define FUNCS(X) \
	X(cuGetErrorName) X(cuPointerGetAttribute) X(cuMemGetAddressRange) X(cuDeviceGet) \
	X(cuDeviceGetUuid) X(cuIpcGetMemHandle) X(cuMemRetainAllocationHandle) \
	X(cuMemExportToShareableHandle) X(cuMemRelease) X(cuMemGetAllocationPropertiesFromHandle)

#define DECL(f) static __typeof__(&f) p_##f;
FUNCS(DECL)
#undef DECL

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char load_error[160];

static void
load(void)
{
	CUresult (*getproc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
	CUdriverProcAddressQueryResult st;
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

	if (h == NULL) {
		snprintf(load_error, sizeof(load_error), "no CUDA driver in this process (libcuda.so.1)");
		return;
	}
	*(void **)&getproc = dlsym(h, "cuGetProcAddress_v2");
	if (getproc == NULL) {
		snprintf(load_error, sizeof(load_error), "the CUDA driver is too old");
		return;
	}
#define RESOLVE(f) \
	if (getproc(#f, (void **)&p_##f, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS || p_##f == NULL) { \
		snprintf(load_error, sizeof(load_error), "the CUDA driver lacks %s", #f); \
		return; \
	}
	FUNCS(RESOLVE)
#undef RESOLVE
}

static int
cu_fail(gpx_conn *c, int code, const char *what, CUresult r)
{
	const char *name = "?";
	char msg[256];

	if (p_cuGetErrorName != NULL)
		p_cuGetErrorName(r, &name);
	snprintf(msg, sizeof(msg), "%s: %s", what, name);
	return client_error(c, code, msg);
}

API int
gpx_register_cuda(gpx_conn *c, const void *ptr, uint64_t length, unsigned flags, gpx_region *out)
{
	Gpx__Register reg = GPX__REGISTER__INIT;
	CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr, base;
	CUmemGenericAllocationHandle vh;
	CUipcMemHandle ih;
	CUmemorytype mt = 0;
	CUdevice dev;
	CUuuid uuid;
	size_t size;
	int ordinal = -1, fd = -1, r;
	unsigned long long buffer_id = 0;
	CUresult e;

	pthread_once(&once, load);
	if (load_error[0] != '\0')
		return client_error(c, GPX_ENOTSUP, load_error);
	if ((e = p_cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p)) != CUDA_SUCCESS)
		return cu_fail(c, GPX_EINVAL, "not a CUDA pointer", e);
	if (mt != CU_MEMORYTYPE_DEVICE)
		return client_error(c, GPX_EINVAL, "not device memory (register host memory as a memfd)");
	if ((e = p_cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)) != CUDA_SUCCESS ||
	    (e = p_cuDeviceGet(&dev, ordinal)) != CUDA_SUCCESS || (e = p_cuDeviceGetUuid(&uuid, dev)) != CUDA_SUCCESS)
		return cu_fail(c, GPX_EINVAL, "cannot tell the pointer's device", e);
	if ((e = p_cuMemGetAddressRange(&base, &size, p)) != CUDA_SUCCESS)
		return cu_fail(c, GPX_EINVAL, "cannot find the allocation", e);
	if (length == 0 || p - base > size || length > size - (p - base))
		return client_error(c, GPX_ERANGE, "the range leaves its allocation");
	p_cuPointerGetAttribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, p);

	reg.offset = p - base;
	reg.length = length;
	reg.access = (flags & GPX_REG_READONLY) ? GPX__ACCESS__ACCESS_RO : GPX__ACCESS__ACCESS_RW;
	reg.device_uuid.data = (uint8_t *)uuid.bytes;
	reg.device_uuid.len = 16;
	reg.alloc_size = size;
	if (p_cuMemRetainAllocationHandle(&vh, (void *)ptr) == CUDA_SUCCESS) {
		/* VMM memory (cuMemCreate, expandable segments).  If the daemon already holds the
		 * allocation for this connection, it answers without the export (a driver call that
		 * costs more than the whole registration). */
		reg.kind = GPX__MEM_KIND__MEM_CUDA_VMM;
		reg.alloc_id = buffer_id ? buffer_id : (uint64_t)base;
		reg.cached_only = 1;
		if ((r = client_register(c, &reg, -1, out)) != -GPX_ENOENT) {
			p_cuMemRelease(vh);
			return r;
		}
		reg.cached_only = 0;
		e = p_cuMemExportToShareableHandle(&fd, vh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
		p_cuMemRelease(vh);
		if (e != CUDA_SUCCESS)
			return cu_fail(c, GPX_ENOTSUP, "VMM memory not exportable as a POSIX fd "
			    "(create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)", e);
	} else {
		int legacy = 0;
		p_cuPointerGetAttribute(&legacy, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p);
		if (!legacy)
			return client_error(c, GPX_ENOTSUP, "memory is neither an exportable VMM allocation "
			    "nor legacy-IPC capable (cudaMallocAsync pools are not supported)");
		if ((e = p_cuIpcGetMemHandle(&ih, base)) != CUDA_SUCCESS)
			return cu_fail(c, GPX_ENOTSUP, "cuIpcGetMemHandle", e);
		reg.kind = GPX__MEM_KIND__MEM_CUDA_IPC;
		reg.handle.data = (uint8_t *)ih.reserved;
		reg.handle.len = sizeof(ih.reserved);
	}
	r = client_register(c, &reg, fd, out);
	if (fd >= 0)
		close(fd);
	return r;
}
