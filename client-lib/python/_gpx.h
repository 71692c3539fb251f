/*
 * The Python module gpx._gpx: what its C files share.  _gpx.c holds the module, its errors and
 * the connection, region and transfer objects; mem.c turns the objects Python code hands in
 * (tensors, arrays, HostBuffers, segment and page lists) into what libgpxclient takes;
 * torch-alloc.c is the VMM allocator PyTorch may allocate exportable memory from.
 *
 * Built against the stable ABI of Python 3.11 (Py_LIMITED_API is set by the build), so the
 * one module loads in every CPython from 3.11 on.
 */
#ifndef GPX_PYTHON_GPX_H
#define GPX_PYTHON_GPX_H

#ifndef Py_LIMITED_API
#error "the gpx module is built against the stable ABI: compile with -DPy_LIMITED_API=0x030B0000"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "client-lib/gpx.h"

/* Error codes of gpx.h (1..18 and 100..102) packed into one table index. */
#define ERR_SLOTS 22

/* Per-module state: the types, the exception classes and interned attribute names. */
struct modstate {
	PyTypeObject *conn_type;
	PyTypeObject *region_type;
	PyTypeObject *transfer_type;
	PyTypeObject *hostbuf_type;
	PyTypeObject *completion_type;  /* a struct sequence */
	PyObject *error;                /* gpx.Error */
	PyObject *errors[ERR_SLOTS];    /* its subclass for each code */
	PyObject *await_hook;           /* the asyncio glue of __init__.py: await_hook(transfer) */
	/* attribute names looked up on tensors and arrays */
	PyObject *s_data_ptr, *s_device, *s_type, *s_is_contiguous, *s_nbytes, *s_numel,
	    *s_element_size, *s_cai, *s_dlpack, *s_dtype, *s_is_signed, *s_is_floating_point,
	    *s_is_complex, *s_wait, *s_close;
};

/* gpx.HostBuffer: a memfd made by gpx_host_alloc, mapped here, with the buffer protocol. */
typedef struct hostbuf {
	PyObject_HEAD
	int fd;
	unsigned char *ptr;
	size_t len;
	Py_ssize_t exports;             /* buffer views handed out and not released */
	unsigned regs;                  /* regions registered in it, on any connection */
	bool closed;
	struct hostbuf *prev, *next;    /* the live HostBuffers, for lookups by address */
	PyObject *weakrefs;
} HostBuffer;

/*
 * What register() hands the library, and what the region keeps alive: a slice of a HostBuffer,
 * or a CUDA device pointer.
 */
struct mem_desc {
	bool cuda;
	const void *ptr;                /* CUDA: the device pointer */
	uint64_t length;
	HostBuffer *hb;                 /* host: the HostBuffer (a reference, counted in its regs) ... */
	uint64_t offset;                /* ... and where in it */
	PyObject *obj;                  /* a reference to the object registered */
	Py_buffer view;                 /* its buffer, held while registered (has_view) */
	bool has_view;
	void *dl;                       /* a DLManagedTensor owned until the region goes */
};

/* A segment list for gpx_copyv: in the caller's buffer, or in memory of our own. */
struct seglist {
	const struct gpx_seg *segs;
	size_t n;
	bool is_signed;                 /* int64 items: none may be negative (checked by the caller) */
	Py_buffer view;
	bool has_view;
	void *own;                      /* malloc'ed, when converted from a list */
};

/* A page list for gpx_copy_pages: 4-byte items in the caller's memory or our own. */
struct pagelist {
	const uint32_t *pages;
	size_t n;
	Py_buffer view;
	bool has_view;
	PyObject *keep;                 /* a tensor read through its data pointer */
	void *own;
};

/* The name of obj's type, for messages: valid in the statement that uses it. */
#define TNAME(obj) gpxpy_type_name((obj), (char[80]){ 0 }, 80)
const char *gpxpy_type_name(PyObject *obj, char *buf, size_t len);
struct modstate *gpxpy_state_of(PyTypeObject *tp);
/* Raises gpx.Error's subclass for code (negative, as the library returns it). */
PyObject *gpxpy_raise(struct modstate *st, int code, const char *reason);

/* mem.c */
extern PyType_Spec mem_hostbuf_spec;
PyObject *mem_host_alloc(PyObject *module, PyObject *arg);
int mem_describe(struct modstate *st, PyObject *obj, bool read_only, struct mem_desc *d);
void mem_release(struct mem_desc *d);
int mem_segments(struct modstate *st, PyObject *obj, struct seglist *l);
void mem_segments_release(struct seglist *l);
int mem_pages(struct modstate *st, PyObject *obj, const char *what, struct pagelist *l);
void mem_pages_release(struct pagelist *l);

/*
 * torch-alloc.c (torch-alloc-none.c without the CUDA headers).  gpx_torch_alloc and
 * gpx_torch_free are exported for torch.cuda.memory.CUDAPluggableAllocator.
 */
void *gpx_torch_alloc(ssize_t size, int device, void *stream);
void gpx_torch_free(void *ptr, ssize_t size, int device, void *stream);
PyObject *torch_vmm_check(PyObject *module, PyObject *device);
PyObject *torch_alloc_error(PyObject *module, PyObject *unused);

#endif
