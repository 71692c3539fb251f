/*
 * The VMM allocator for PyTorch (torch-alloc.c) in a module built without the CUDA headers:
 * every allocation fails and gpx.torch_mem_pool() says why.
 */
#include "config.h"

#include <sys/types.h>

#include "client-lib/python/_gpx.h"

#define EXPORT __attribute__((visibility("default")))
#define WHY "the gpx module was built without CUDA support"

EXPORT void *
gpx_torch_alloc(ssize_t size, int device, void *stream)
{
	(void)size;
	(void)device;
	(void)stream;
	return NULL;
}

EXPORT void
gpx_torch_free(void *ptr, ssize_t size, int device, void *stream)
{
	(void)ptr;
	(void)size;
	(void)device;
	(void)stream;
}

PyObject *
torch_vmm_check(PyObject *module, PyObject *device)
{
	return gpxpy_raise(PyModule_GetState(module), -GPX_ENOTSUP, WHY);
}

PyObject *
torch_alloc_error(PyObject *module, PyObject *unused)
{
	return PyUnicode_FromString(WHY);
}
