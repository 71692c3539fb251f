/*
 * gpx_register_cuda(): the only file of libgpxclient that includes cuda.h.  It loads the CUDA
 * driver on first use (dlopen, cuGetProcAddress), so the library works without one for host
 * memory, and describes a device pointer to the daemon: which device (by UUID), which
 * allocation (VMM export fd, pool fd plus the allocation's export data, or legacy IPC handle of
 * the allocation base), and where in it.
 * PyTorch's caching allocator hands out interior pointers of larger cudaMalloc blocks: the base
 * and size come from cuMemGetAddressRange and the offset travels separately.
 */
#include "config.h"

#include <dlfcn.h>
#include <stdbool.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <cuda.h>

#include "client-lib/client.h"

#define API __attribute__((visibility("default")))

#define FUNCS(X) \
	X(cuGetErrorName) X(cuPointerGetAttributes) X(cuDeviceGet) \
	X(cuDeviceGetUuid) X(cuIpcGetMemHandle) X(cuMemRetainAllocationHandle) \
	X(cuMemExportToShareableHandle) X(cuMemRelease) X(cuMemGetAllocationPropertiesFromHandle) \
	X(cuMemPoolExportPointer) X(cuMemPoolExportToShareableHandle)

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

/* The UUID of a device ordinal, looked up once. */
static int
device_uuid(int ordinal, uint8_t out[16])
{
	static uint8_t uuids[64][16];
	static bool known[64];
	CUdevice dev;
	CUuuid u;

	if (ordinal < 0 || ordinal >= 64)
		return -1;
	if (!__atomic_load_n(&known[ordinal], __ATOMIC_ACQUIRE)) {
		if (p_cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS || p_cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS)
			return -1;
		memcpy(uuids[ordinal], u.bytes, 16);
		__atomic_store_n(&known[ordinal], true, __ATOMIC_RELEASE);
	}
	memcpy(out, uuids[ordinal], 16);
	return 0;
}

/*
 * Stream-ordered pool memory (cudaMallocAsync, cuMemAllocFromPoolAsync).  The daemon imports
 * the pool from an fd and the allocation from its export data; the allocation is named by its
 * buffer id, as VMM memory is (the export data is not the same from one export to the next),
 * so that a registration of an allocation the daemon already holds costs neither the pool
 * export nor a driver open there.  The device's default pool, which plain
 * cudaMallocAsync uses, is never exportable: that fails with what to do instead.
 */
static int
register_pool(gpx_conn *c, Gpx__Register *reg, CUmemoryPool pool, CUdeviceptr base, gpx_region *out)
{
	/* With the error name it must fit gpx_last_error()'s 256 bytes. */
	static const char advice[] = "pool not exportable as a POSIX fd (plain cudaMallocAsync uses "
	    "the device's default pool, which never is): allocate from a pool created with "
	    "handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (cudaMallocFromPoolAsync)";
	CUmemPoolPtrExportData data;
	int fd = -1, r;
	CUresult e;

	/* Held already (by its buffer id): no export at all. */
	reg->kind = GPX__MEM_KIND__MEM_CUDA_POOL;
	reg->cached_only = 1;
	if ((r = client_register(c, reg, -1, out)) != -GPX_ENOENT)
		return r;
	if ((e = p_cuMemPoolExportPointer(&data, base)) != CUDA_SUCCESS)
		return cu_fail(c, GPX_ENOTSUP, advice, e);
	reg->handle.data = data.reserved;
	reg->handle.len = sizeof(data.reserved);
	e = p_cuMemPoolExportToShareableHandle(&fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (e != CUDA_SUCCESS)
		return cu_fail(c, GPX_ENOTSUP, advice, e);
	reg->cached_only = 0;
	r = client_register(c, reg, fd, out);
	close(fd);
	return r;
}

API int
gpx_register_cuda(gpx_conn *c, const void *ptr, uint64_t length, unsigned flags, gpx_region *out)
{
	Gpx__Register reg = GPX__REGISTER__INIT;
	CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr, base = 0;
	CUmemGenericAllocationHandle vh;
	CUipcMemHandle ih;
	CUmemoryPool pool = NULL;
	unsigned int mt = 0;
	int ordinal = -1, legacy = 0, fd = -1, r;
	unsigned long long buffer_id = 0;
	size_t size = 0;
	uint8_t uuid[16];
	CUresult e;

	pthread_once(&once, load);
	if (load_error[0] != '\0')
		return client_error(c, GPX_ENOTSUP, load_error);
	/* Everything about the pointer in one driver call. */
	CUpointer_attribute at[] = {
		CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
		CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
		CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
		CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
	};
	void *val[] = { &mt, &ordinal, &buffer_id, &legacy, &base, &size, &pool };
	if ((e = p_cuPointerGetAttributes(7, at, val, p)) != CUDA_SUCCESS)
		return cu_fail(c, GPX_EINVAL, "not a CUDA pointer", e);
	if (mt != CU_MEMORYTYPE_DEVICE)
		return client_error(c, GPX_EINVAL, "not device memory (register host memory as a memfd)");
	if (device_uuid(ordinal, uuid) < 0)
		return client_error(c, GPX_EINVAL, "cannot tell the pointer's device");
	if (base == 0 || size == 0)
		return client_error(c, GPX_EINVAL, "cannot find the allocation that holds the pointer");
	if (length == 0 || p - base > size || length > size - (p - base))
		return client_error(c, GPX_ERANGE, "the range leaves its allocation");
	reg.offset = p - base;
	reg.length = length;
	reg.access = (flags & GPX_REG_READONLY) ? GPX__ACCESS__ACCESS_RO : GPX__ACCESS__ACCESS_RW;
	reg.device_uuid.data = uuid;
	reg.device_uuid.len = 16;
	reg.alloc_size = size;
	/* What names the allocation in the daemon's cache: its process-wide unique buffer id. */
	reg.alloc_id = buffer_id ? buffer_id : (uint64_t)base;
	/*
	 * The kind from the attributes already read: pool memory first, as its attribute is
	 * unambiguous while a pool is built of VMM allocations that the VMM path below could
	 * take for this one; then legacy IPC capability; otherwise VMM memory, which only the
	 * export below can tell.
	 */
	if (pool != NULL)
		return register_pool(c, &reg, pool, base, out);
	if (legacy) {
		/* cudaMalloc/cuMemAlloc memory: the handle of the allocation base. */
		if ((e = p_cuIpcGetMemHandle(&ih, base)) != CUDA_SUCCESS)
			return cu_fail(c, GPX_ENOTSUP, "cuIpcGetMemHandle", e);
		reg.kind = GPX__MEM_KIND__MEM_CUDA_IPC;
		reg.handle.data = (uint8_t *)ih.reserved;
		reg.handle.len = sizeof(ih.reserved);
		return client_register(c, &reg, -1, out);
	}
	/*
	 * Otherwise it should be VMM memory (cuMemCreate, expandable segments).  If the daemon
	 * already holds the allocation for this connection it answers without the export, a
	 * driver call that costs more than the whole registration.
	 */
	reg.kind = GPX__MEM_KIND__MEM_CUDA_VMM;
	reg.cached_only = 1;
	if ((r = client_register(c, &reg, -1, out)) != -GPX_ENOENT)
		return r;
	if (p_cuMemRetainAllocationHandle(&vh, (void *)ptr) != CUDA_SUCCESS)
		return client_error(c, GPX_ENOTSUP, "memory is neither an exportable VMM allocation, "
		    "nor of a stream-ordered pool, nor legacy-IPC capable");
	e = p_cuMemExportToShareableHandle(&fd, vh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	p_cuMemRelease(vh);
	if (e != CUDA_SUCCESS)
		return cu_fail(c, GPX_ENOTSUP, "VMM memory not exportable as a POSIX fd "
		    "(create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)", e);
	reg.cached_only = 0;
	r = client_register(c, &reg, fd, out);
	close(fd);
	return r;
}
