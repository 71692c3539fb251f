/*
 * gpx._gpx, the VMM allocator PyTorch can allocate from (gpx.torch_mem_pool): each allocation
 * is its own cuMemCreate memory, made exportable as a POSIX fd, mapped into a reservation of
 * its own and readable and writable by its device and by every device that can reach it
 * peer-to-peer.  A tensor from it registers as a cuda-vmm region, a capability by possession,
 * where PyTorch's default allocator gives cuda-ipc (legacy handles, accepted only on nodes
 * that are one trust domain).  PyTorch calls gpx_torch_alloc and gpx_torch_free through
 * torch.cuda.memory.CUDAPluggableAllocator; the module exports them for that.
 *
 * The only file of the module that includes cuda.h.  The driver is loaded at first use
 * (client_cuda_resolve, libgpxclient's loader), so the module imports without one.
 */
#include "config.h"

#include <pthread.h>
#include <stdio.h>
#include <sys/types.h>
#include <cuda.h>

#include "client-lib/client.h"
#include "client-lib/python/_gpx.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 64

#define FUNCS(X) \
	X(cuInit) X(cuGetErrorName) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetAttribute) \
	X(cuDeviceCanAccessPeer) X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease) \
	X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)

#define DECL(f) static __typeof__(&f) p_##f;
FUNCS(DECL)
#undef DECL

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char load_error[160];
/* Why the last allocation of this thread failed (PyTorch only hears NULL). */
static _Thread_local char alloc_error[256];
static size_t granularity[MAX_DEVICES];   /* per device, found once (atomic) */

static void
load(void)
{
	static const char *const names[] = { FUNCS(CLIENT_CUDA_NAME) };
	void **const fns[] = { FUNCS(CLIENT_CUDA_SLOT) };

	if (client_cuda_resolve(names, fns, sizeof(names) / sizeof(names[0]), load_error, sizeof(load_error)) == 0 &&
	    p_cuInit(0) != CUDA_SUCCESS)
		snprintf(load_error, sizeof(load_error), "cuInit failed: no usable GPU");
}

/* Records why an allocation failed; returns NULL for the caller to return. */
static void *
fail(const char *what, CUresult e)
{
	const char *name = "?";

	if (p_cuGetErrorName != NULL)
		p_cuGetErrorName(e, &name);
	snprintf(alloc_error, sizeof(alloc_error), "%s: %s", what, name);
	return NULL;
}

static CUmemAllocationProp
prop_of(int device)
{
	CUmemAllocationProp p = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device },
	};
	return p;
}

/* The device's allocation granularity, or 0 (with alloc_error) when the driver will not say. */
static size_t
gran_of(int device)
{
	size_t g;
	CUresult e;

	if (device < 0 || device >= MAX_DEVICES) {
		snprintf(alloc_error, sizeof(alloc_error), "device %d out of range", device);
		return 0;
	}
	if ((g = __atomic_load_n(&granularity[device], __ATOMIC_ACQUIRE)) != 0)
		return g;
	CUmemAllocationProp p = prop_of(device);
	if ((e = p_cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) != CUDA_SUCCESS) {
		fail("cuMemGetAllocationGranularity", e);
		return 0;
	}
	__atomic_store_n(&granularity[device], g, __ATOMIC_RELEASE);
	return g;
}

/* Lets `device` and each device that can reach it peer-to-peer read and write [p, p+len). */
static CUresult
set_access(CUdeviceptr p, size_t len, int device)
{
	CUmemAccessDesc acc[MAX_DEVICES];
	CUdevice self, other;
	int n = 0, count = 0, can;

	if (p_cuDeviceGet(&self, device) != CUDA_SUCCESS || p_cuDeviceGetCount(&count) != CUDA_SUCCESS)
		count = 0;
	acc[n++] = (CUmemAccessDesc){ .location = { CU_MEM_LOCATION_TYPE_DEVICE, device },
		.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	for (int d = 0; d < count && d < MAX_DEVICES && n < MAX_DEVICES; d++) {
		if (d == device || p_cuDeviceGet(&other, d) != CUDA_SUCCESS ||
		    p_cuDeviceCanAccessPeer(&can, other, self) != CUDA_SUCCESS || !can)
			continue;
		acc[n++] = (CUmemAccessDesc){ .location = { CU_MEM_LOCATION_TYPE_DEVICE, d },
			.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	}
	return p_cuMemSetAccess(p, len, acc, n);
}

EXPORT void *
gpx_torch_alloc(ssize_t size, int device, void *stream)
{
	CUmemGenericAllocationHandle h;
	CUdeviceptr p = 0;
	size_t g, len;
	CUresult e;

	(void)stream;
	pthread_once(&once, load);
	if (load_error[0] != '\0') {
		snprintf(alloc_error, sizeof(alloc_error), "%s", load_error);
		return NULL;
	}
	if (size < 0 || (g = gran_of(device)) == 0)
		return NULL;
	len = ((size_t)(size ? size : 1) + g - 1) / g * g;
	CUmemAllocationProp prop = prop_of(device);
	if ((e = p_cuMemCreate(&h, len, &prop, 0)) != CUDA_SUCCESS)
		return fail("cuMemCreate (exportable as a POSIX fd)", e);
	if ((e = p_cuMemAddressReserve(&p, len, 0, 0, 0)) != CUDA_SUCCESS) {
		p_cuMemRelease(h);
		return fail("cuMemAddressReserve", e);
	}
	if ((e = p_cuMemMap(p, len, 0, h, 0)) != CUDA_SUCCESS) {
		p_cuMemAddressFree(p, len);
		p_cuMemRelease(h);
		return fail("cuMemMap", e);
	}
	/* The mapping holds the memory from here on: cuMemRetainAllocationHandle finds it. */
	p_cuMemRelease(h);
	if ((e = set_access(p, len, device)) != CUDA_SUCCESS) {
		p_cuMemUnmap(p, len);
		p_cuMemAddressFree(p, len);
		return fail("cuMemSetAccess", e);
	}
	alloc_error[0] = '\0';
	return (void *)(uintptr_t)p;
}

EXPORT void
gpx_torch_free(void *ptr, ssize_t size, int device, void *stream)
{
	CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
	size_t g, len;

	(void)stream;
	if (ptr == NULL || load_error[0] != '\0' || size < 0 || (g = gran_of(device)) == 0)
		return;
	len = ((size_t)(size ? size : 1) + g - 1) / g * g;
	p_cuMemUnmap(p, len);
	p_cuMemAddressFree(p, len);
}

/* _vmm_check(device): None when `device` can make exportable VMM memory, else NotSupportedError. */
PyObject *
torch_vmm_check(PyObject *module, PyObject *arg)
{
	struct modstate *st = PyModule_GetState(module);
	int ordinal = PyLong_AsLong(arg), vmm = 0, fd = 0;
	char why[200] = "";
	CUdevice dev;

	if (ordinal == -1 && PyErr_Occurred())
		return NULL;
	Py_BEGIN_ALLOW_THREADS
	pthread_once(&once, load);
	if (load_error[0] != '\0')
		snprintf(why, sizeof(why), "%s", load_error);
	else if (p_cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS)
		snprintf(why, sizeof(why), "no CUDA device %d", ordinal);
	else if (p_cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS ||
	    p_cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) != CUDA_SUCCESS ||
	    !vmm || !fd)
		snprintf(why, sizeof(why), "device %d cannot make VMM memory exportable as a POSIX fd", ordinal);
	Py_END_ALLOW_THREADS
	if (why[0] != '\0')
		return gpxpy_raise(st, -GPX_ENOTSUP, why);
	Py_RETURN_NONE;
}

/* _torch_alloc_error(): why this thread's last gpx_torch_alloc failed, or None. */
PyObject *
torch_alloc_error(PyObject *module, PyObject *unused)
{
	if (alloc_error[0] == '\0')
		Py_RETURN_NONE;
	return PyUnicode_FromString(alloc_error);
}
