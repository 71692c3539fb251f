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
#include <stdlib.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <cuda.h>

#include "client-lib/client.h"
#include "proto/wire.h"

#define API __attribute__((visibility("default")))

#define FUNCS(X) \
	X(cuGetErrorName) X(cuPointerGetAttributes) X(cuDeviceGet) \
	X(cuDeviceGetUuid) X(cuIpcGetMemHandle) X(cuMemRetainAllocationHandle) \
	X(cuMemExportToShareableHandle) X(cuMemRelease) X(cuMemGetAllocationPropertiesFromHandle) \
	X(cuMemPoolExportPointer) X(cuMemPoolExportToShareableHandle) X(cuCtxGetCurrent) \
	X(cuCtxPushCurrent) X(cuCtxPopCurrent)

#define DECL(f) static __typeof__(&f) p_##f;
FUNCS(DECL)
#undef DECL

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char load_error[160];

/*
 * Loads the CUDA driver (libcuda.so.1, at run time, so the library needs no driver to load)
 * and resolves n entry points by name into *fns[i], through cuGetProcAddress at the CUDA 12
 * ABI.  0, or -1 with err saying why (the pointers resolved so far stay set).  The Python
 * module's allocator resolves its own list with it too.
 */
int
client_cuda_resolve(const char *const names[], void **const fns[], size_t n, char *err, size_t errlen)
{
	CUresult (*getproc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
	CUdriverProcAddressQueryResult st;
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

	if (h == NULL) {
		snprintf(err, errlen, "no CUDA driver in this process (libcuda.so.1)");
		return -1;
	}
	*(void **)&getproc = dlsym(h, "cuGetProcAddress_v2");
	if (getproc == NULL) {
		snprintf(err, errlen, "the CUDA driver is too old");
		return -1;
	}
	for (size_t i = 0; i < n; i++)
		if (getproc(names[i], fns[i], 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS || *fns[i] == NULL) {
			snprintf(err, errlen, "the CUDA driver lacks %s", names[i]);
			return -1;
		}
	return 0;
}

static void
load(void)
{
	static const char *const names[] = { FUNCS(CLIENT_CUDA_NAME) };
	void **const fns[] = { FUNCS(CLIENT_CUDA_SLOT) };

	client_cuda_resolve(names, fns, sizeof(names) / sizeof(names[0]), load_error, sizeof(load_error));
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

/* What the driver says of one address of a VMM reservation: the piece mapped there. */
struct vmm_at {
	unsigned int type;
	CUdeviceptr res;              /* the reservation's start */
	size_t res_size;
	CUdeviceptr base;             /* the piece: where it is mapped, its size, its id */
	size_t size;
	unsigned long long id;
};

static CUresult
vmm_query(CUdeviceptr p, struct vmm_at *a)
{
	CUpointer_attribute at[] = {
		CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
		CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
		CU_POINTER_ATTRIBUTE_MAPPING_SIZE, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID,
	};
	void *val[] = { &a->type, &a->res, &a->res_size, &a->base, &a->size, &a->id };

	memset(a, 0, sizeof(*a));
	return p_cuPointerGetAttributes(6, at, val, p);
}

/* Exports the piece mapped at p as a POSIX fd, or -1. */
static int
vmm_export(gpx_conn *c, CUdeviceptr p)
{
	CUmemGenericAllocationHandle h;
	int fd = -1;
	CUresult e;

	if ((e = p_cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)p)) != CUDA_SUCCESS) {
		cu_fail(c, GPX_ENOTSUP, "memory is neither an exportable VMM allocation, nor of a "
		    "stream-ordered pool, nor legacy-IPC capable", e);
		return -1;
	}
	e = p_cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	p_cuMemRelease(h);
	if (e != CUDA_SUCCESS) {
		cu_fail(c, GPX_ENOTSUP, "VMM memory not exportable as a POSIX fd (create it with "
		    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)", e);
		return -1;
	}
	return fd;
}

/* Sends pieces[idx[0..n)] with their fds, GPX_PIECES_MAX a message. */
static int
vmm_send(gpx_conn *c, const Gpx__Register *reg, const struct gpx_wire_piece *pieces, const uint32_t *idx,
    size_t n)
{
	struct gpx_wire_piece batch[GPX_PIECES_MAX];
	int fds[GPX_PIECES_MAX], r = 0;

	for (size_t done = 0; done < n && r == 0;) {
		size_t k = 0;
		while (k < GPX_PIECES_MAX && done + k < n && r == 0) {
			batch[k] = pieces[idx[done + k]];
			if ((fds[k] = vmm_export(c, reg->alloc_id + batch[k].offset)) < 0)
				r = -GPX_ENOTSUP;      /* vmm_export said why */
			else
				k++;
		}
		if (r == 0)
			r = client_send_pieces(c, reg->device_uuid.data, reg->alloc_id, reg->alloc_size, batch, fds, k);
		for (size_t i = 0; i < k; i++)
			close(fds[i]);
		done += k;
	}
	return r;
}

/*
 * VMM memory: the physical allocations ("pieces") mapped under [p, p + length), found by
 * walking the reservation one mapping at a time from the one at p (first: what the driver
 * said of p; a driver query for each further piece, ~0.1 us), named to the
 * daemon by their block ids.  The daemon answers at once from what it holds; only the pieces
 * it lacks are exported, a driver call of ~30 us each, and sent as fds.
 */
static int
register_vmm(gpx_conn *c, Gpx__Register *reg, CUdeviceptr p, uint64_t length, const struct vmm_at *first,
    gpx_region *out)
{
	struct gpx_wire_piece one, *pieces = &one;
	uint32_t *missing = NULL;
	size_t n = 0, cap = 1, nmissing = 0;
	struct vmm_at a = *first;
	int r;

	if (a.type != CU_MEMORYTYPE_DEVICE || a.size == 0)
		return client_error(c, GPX_ENOTSUP, "memory is neither VMM memory, nor of a "
		    "stream-ordered pool, nor legacy-IPC capable");
	const CUdeviceptr res = a.res, end = p + length;
	const size_t res_size = a.res_size;
	for (;;) {
		if (n == cap) {
			struct gpx_wire_piece *np = malloc(2 * cap * sizeof(*np));
			if (np == NULL) {
				r = client_error(c, GPX_ENOMEM, "out of memory for the pieces of a range");
				goto out;
			}
			memcpy(np, pieces, n * sizeof(*np));
			if (pieces != &one)
				free(pieces);
			pieces = np;
			cap *= 2;
		}
		pieces[n++] = (struct gpx_wire_piece){ a.id, a.base - res, a.size };
		if (a.base + a.size >= end)
			break;
		CUdeviceptr next = a.base + a.size;
		if (vmm_query(next, &a) != CUDA_SUCCESS || a.type != CU_MEMORYTYPE_DEVICE || a.res != res ||
		    a.base != next || a.size == 0) {
			r = client_error(c, GPX_ERANGE, "the range runs past the memory mapped in its reservation");
			goto out;
		}
	}
	reg->kind = GPX__MEM_KIND__MEM_CUDA_VMM;
	reg->alloc_id = res;
	reg->alloc_size = res_size;
	reg->offset = p - res;
	if ((missing = malloc(GPX_MISSING_MAX * sizeof(*missing))) == NULL) {
		r = client_error(c, GPX_ENOMEM, NULL);
		goto out;
	}
	/* Each round sends what the daemon lacks; it names at most GPX_MISSING_MAX at a time. */
	for (size_t sent = 0;;) {
		r = client_register_pieces(c, reg, pieces, n, out, missing, &nmissing);
		if (r != -GPX_ENOENT || nmissing == 0 || sent >= n)
			break;
		if ((r = vmm_send(c, reg, pieces, missing, nmissing)) < 0)
			break;
		sent += nmissing;
	}
out:
	free(missing);
	if (pieces != &one)
		free(pieces);
	return r;
}

API int
gpx_register_cuda(gpx_conn *c, const void *ptr, uint64_t length, unsigned flags, gpx_region *out)
{
	Gpx__Register reg = GPX__REGISTER__INIT;
	CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr, base = 0;
	CUipcMemHandle ih;
	CUmemoryPool pool = NULL;
	unsigned int mt = 0;
	int ordinal = -1, legacy = 0;
	unsigned long long buffer_id = 0;
	size_t size = 0;
	uint8_t uuid[16];
	CUresult e;

	pthread_once(&once, load);
	if (load_error[0] != '\0')
		return client_error(c, GPX_ENOTSUP, load_error);
	/* Everything about the pointer in one driver call. */
	struct vmm_at piece = { 0 };
	CUpointer_attribute at[] = {
		CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
		CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
		CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
		CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
		CU_POINTER_ATTRIBUTE_MAPPING_SIZE, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID, CU_POINTER_ATTRIBUTE_CONTEXT,
	};
	CUcontext ctx = NULL;
	void *val[] = { &mt, &ordinal, &buffer_id, &legacy, &base, &size, &pool, &piece.base, &piece.size,
		&piece.id, &ctx };
	if ((e = p_cuPointerGetAttributes(11, at, val, p)) != CUDA_SUCCESS)
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
		/*
		 * cudaMalloc/cuMemAlloc memory: the handle of the allocation base, taken in the
		 * context the memory belongs to: with another GPU's context current (a program
		 * that registers GPU0's tensor while working on GPU1) the driver refuses it.
		 */
		CUcontext cur = NULL;
		bool push = ctx != NULL && p_cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur != ctx &&
		    p_cuCtxPushCurrent(ctx) == CUDA_SUCCESS;
		e = p_cuIpcGetMemHandle(&ih, base);
		if (push)
			p_cuCtxPopCurrent(&cur);
		if (e != CUDA_SUCCESS)
			return cu_fail(c, GPX_ENOTSUP, "cuIpcGetMemHandle", e);
		reg.kind = GPX__MEM_KIND__MEM_CUDA_IPC;
		reg.handle.data = (uint8_t *)ih.reserved;
		reg.handle.len = sizeof(ih.reserved);
		return client_register(c, &reg, -1, out);
	}
	/* Otherwise it should be VMM memory (cuMemCreate, expandable segments). */
	piece.type = mt;
	piece.res = base;
	piece.res_size = size;
	return register_vmm(c, &reg, p, length, &piece, out);
}
