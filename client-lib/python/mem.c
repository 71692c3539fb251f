/*
 * gpx._gpx, memory: what Python code hands to Conn.register(), turned into what libgpxclient
 * takes.  mem_describe finds the memory of an object: a torch tensor (data_ptr(), device,
 * is_contiguous()), anything with __cuda_array_interface__, a buffer-protocol object, or a
 * DLPack producer (__dlpack__).  CUDA memory goes to gpx_register_cuda as a pointer; host
 * memory must lie in a HostBuffer (mem-host.c; gpxd maps memfds, never a process's heap).
 * Nothing here imports torch, numpy or cupy: they are asked through their attributes.  Also
 * a CPU tensor of integers read in place, for the lists of mem-lists.c.
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>

#include "client-lib/python/_gpx.h"

/* ---- small helpers ---- */

/* o.name, or 0 with *out NULL when o has no such attribute; -1 on another error. */
static int
opt_attr(PyObject *o, PyObject *name, PyObject **out)
{
	*out = PyObject_GetAttr(o, name);
	if (*out != NULL)
		return 1;
	if (!PyErr_ExceptionMatches(PyExc_AttributeError))
		return -1;
	PyErr_Clear();
	return 0;
}

/* o.name as a truth value: 1 or 0, 2 when o has no such attribute, -1 on another error. */
static int
opt_bool(PyObject *o, PyObject *name)
{
	PyObject *a;
	int r = opt_attr(o, name, &a);

	if (r <= 0)
		return r < 0 ? -1 : 2;
	r = PyObject_IsTrue(a);
	Py_DECREF(a);
	return r;
}

/* The result of o.name() as a truth value: 1, 0 or -1. */
static int
call_bool(PyObject *o, PyObject *name)
{
	PyObject *r = PyObject_CallMethodObjArgs(o, name, NULL);
	int v;

	if (r == NULL)
		return -1;
	v = PyObject_IsTrue(r);
	Py_DECREF(r);
	return v;
}

/* The result of o.name() as a non-negative integer. */
static int
call_u64(PyObject *o, PyObject *name, const char *what, uint64_t *out)
{
	PyObject *r = PyObject_CallMethodObjArgs(o, name, NULL);
	int e;

	if (r == NULL)
		return -1;
	e = gpxpy_u64(r, what, out);
	Py_DECREF(r);
	return e;
}

/* o.a.b as a truth value (torch: t.dtype.is_signed); -1 on error. */
static int
attr2_bool(PyObject *o, PyObject *a, PyObject *b)
{
	PyObject *x = PyObject_GetAttr(o, a), *y;
	int v;

	if (x == NULL)
		return -1;
	y = PyObject_GetAttr(x, b);
	Py_DECREF(x);
	if (y == NULL)
		return -1;
	v = PyObject_IsTrue(y);
	Py_DECREF(y);
	return v;
}

/* ---- memory of objects, for register() ---- */

/* Host memory at [p, p+len): the slice of the HostBuffer that holds it, or ValueError. */
static int
describe_host(PyObject *obj, const void *p, uint64_t len, struct mem_desc *d)
{
	HostBuffer *h = mem_host_find(p, len, &d->offset);

	if (h == NULL) {
		PyErr_Format(PyExc_ValueError, "cannot register %s: its host memory is not in a "
		    "gpx.HostBuffer (gpxd maps only memfds: allocate with gpx.host_alloc(nbytes) and view "
		    "it with numpy.frombuffer or torch.frombuffer)", TNAME(obj));
		return -1;
	}
	d->cuda = false;
	d->length = len;
	d->hb = (HostBuffer *)Py_NewRef((PyObject *)h);
	h->regs++;
	return 0;
}

static int
empty_or_long(PyObject *obj, uint64_t len)
{
	if (len == 0) {
		PyErr_Format(PyExc_ValueError, "cannot register %s: it holds no bytes", TNAME(obj));
		return -1;
	}
	return 0;
}

/*
 * Whether tensor t is in CUDA memory (1) or host memory (0); else ValueError (-1).  torch's
 * is_cuda and is_cpu answer in ~0.1 us each, where device.type builds a device object first
 * (~0.65 us on an H100's host): a page list's submission read two tensors this way.  Objects
 * without them are asked for device.type.
 */
static int
tensor_where(struct modstate *st, PyObject *t, const char *what)
{
	PyObject *dev, *type;
	int c, h;

	if ((c = opt_bool(t, st->s_is_cuda)) < 0 || c == 1)
		return c;
	if ((h = opt_bool(t, st->s_is_cpu)) < 0 || (c == 0 && h == 1))
		return h < 0 ? -1 : 0;
	if ((dev = PyObject_GetAttr(t, st->s_device)) == NULL)
		return -1;
	type = PyObject_GetAttr(dev, st->s_type);
	Py_DECREF(dev);
	if (type == NULL)
		return -1;
	c = PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cuda") == 0 ? 1 :
	    PyUnicode_Check(type) && PyUnicode_CompareWithASCIIString(type, "cpu") == 0 ? 0 : -1;
	if (c < 0)
		PyErr_Format(PyExc_ValueError, "%s: a tensor on device type %R: gpx takes CUDA tensors, and "
		    "CPU tensors in a gpx.HostBuffer", what, type);
	Py_DECREF(type);
	return c;
}

/*
 * A torch tensor (or anything that answers data_ptr(), is_cuda and is_cpu or device.type,
 * is_contiguous() and nbytes or numel() and element_size()).  *cpu says whether it lives in
 * host memory.
 */
static int
tensor_memory(struct modstate *st, PyObject *t, const char *what, uint64_t *ptr, uint64_t *nbytes,
    bool *cpu)
{
	PyObject *nb;
	uint64_t numel, esize;
	int c, r;

	if ((c = tensor_where(st, t, what)) < 0)
		return -1;
	*cpu = c == 0;
	if ((c = call_bool(t, st->s_is_contiguous)) < 0)
		return -1;
	if (!c) {
		PyErr_Format(PyExc_ValueError, "%s: the tensor is not contiguous (a strided view): gpx "
		    "moves one range of bytes; pass .contiguous() or the tensor it is a view of", what);
		return -1;
	}
	if (call_u64(t, st->s_data_ptr, "data_ptr()", ptr) < 0)
		return -1;
	if ((r = opt_attr(t, st->s_nbytes, &nb)) < 0)
		return -1;
	if (r > 0) {
		r = gpxpy_u64(nb, "nbytes", nbytes);
		Py_DECREF(nb);
		return r;
	}
	if (call_u64(t, st->s_numel, "numel()", &numel) < 0 ||
	    call_u64(t, st->s_element_size, "element_size()", &esize) < 0)
		return -1;
	*nbytes = numel * esize;
	return 0;
}

/* Item size of an array-interface typestr such as "<f4" or "|u1"; 0 if unreadable. */
static uint64_t
typestr_size(PyObject *typestr)
{
	const char *s = PyUnicode_Check(typestr) ? PyUnicode_AsUTF8AndSize(typestr, NULL) : NULL;
	char *end;
	long n;

	if (s == NULL || strlen(s) < 3)
		return 0;
	n = strtol(s + 2, &end, 10);
	return *end == '\0' && n > 0 ? (uint64_t)n : 0;
}

/* Whether shape and strides (NULL: C order) describe one C-contiguous range; its size in items. */
static bool
c_contiguous(size_t ndim, const int64_t *shape, const int64_t *strides, uint64_t itemsize, uint64_t *items)
{
	int64_t want = (int64_t)itemsize;
	bool ok = true;

	*items = 1;
	for (size_t i = ndim; i-- > 0;) {
		if (shape[i] < 0)
			return false;
		*items *= (uint64_t)shape[i];
		if (strides != NULL && shape[i] > 1 && strides[i] != want)
			ok = false;
		want *= shape[i];
	}
	return ok || *items == 0;
}

/* Reads a tuple of ints into a[] (at most 32); the count, or -1. */
static Py_ssize_t
int_tuple(PyObject *t, const char *what, int64_t *a)
{
	Py_ssize_t n;

	if (!PyTuple_Check(t) || (n = PyTuple_Size(t)) > 32) {
		PyErr_Format(PyExc_ValueError, "__cuda_array_interface__: '%s' must be a tuple of at most "
		    "32 ints", what);
		return -1;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		a[i] = PyLong_AsLongLong(PyTuple_GetItem(t, i));
		if (a[i] == -1 && PyErr_Occurred())
			return -1;
	}
	return n;
}

/* __cuda_array_interface__ (CuPy, Numba, ...): pointer, shape, typestr, strides. */
static int
describe_cai(PyObject *obj, PyObject *cai, bool read_only, struct mem_desc *d)
{
	PyObject *data, *shape, *typestr, *strides, *mask;
	int64_t sh[32], sd[32];
	Py_ssize_t nd, ns = -1;
	uint64_t ptr, itemsize, items;
	int ro;

	if (!PyDict_Check(cai)) {
		PyErr_SetString(PyExc_TypeError, "__cuda_array_interface__ is not a dict");
		return -1;
	}
	data = PyDict_GetItemString(cai, "data");
	shape = PyDict_GetItemString(cai, "shape");
	typestr = PyDict_GetItemString(cai, "typestr");
	strides = PyDict_GetItemString(cai, "strides");
	mask = PyDict_GetItemString(cai, "mask");
	if (data == NULL || shape == NULL || typestr == NULL || !PyTuple_Check(data) || PyTuple_Size(data) != 2) {
		PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__ lacks data=(ptr, readonly), "
		    "shape or typestr");
		return -1;
	}
	if (mask != NULL && mask != Py_None) {
		PyErr_SetString(PyExc_ValueError, "cannot register a masked CUDA array");
		return -1;
	}
	if (gpxpy_u64(PyTuple_GetItem(data, 0), "__cuda_array_interface__ data pointer", &ptr) < 0 ||
	    (ro = PyObject_IsTrue(PyTuple_GetItem(data, 1))) < 0)
		return -1;
	if ((itemsize = typestr_size(typestr)) == 0) {
		PyErr_Format(PyExc_ValueError, "__cuda_array_interface__: unreadable typestr %R", typestr);
		return -1;
	}
	if ((nd = int_tuple(shape, "shape", sh)) < 0)
		return -1;
	if (strides != NULL && strides != Py_None && (ns = int_tuple(strides, "strides", sd)) < 0)
		return -1;
	if (ns >= 0 && ns != nd) {
		PyErr_SetString(PyExc_ValueError, "__cuda_array_interface__: strides and shape differ in length");
		return -1;
	}
	if (!c_contiguous(nd, sh, ns >= 0 ? sd : NULL, itemsize, &items)) {
		PyErr_Format(PyExc_ValueError, "cannot register %s: the CUDA array is not C-contiguous "
		    "(a strided view): gpx moves one range of bytes", TNAME(obj));
		return -1;
	}
	if (ro && !read_only) {
		PyErr_SetString(PyExc_ValueError, "the CUDA array is read-only: register it with read_only=True");
		return -1;
	}
	d->cuda = true;
	d->ptr = (const void *)(uintptr_t)ptr;
	d->length = items * itemsize;
	return empty_or_long(obj, d->length);
}

/* A buffer-protocol object: a view of host memory, which must lie in a HostBuffer. */
static int
describe_buffer(PyObject *obj, bool read_only, struct mem_desc *d)
{
	if (PyObject_GetBuffer(obj, &d->view, PyBUF_FULL_RO) < 0)
		return -1;
	d->has_view = true;
	if (!PyBuffer_IsContiguous(&d->view, 'C')) {
		PyErr_Format(PyExc_ValueError, "cannot register %s: its buffer is not C-contiguous (a "
		    "strided view): gpx moves one range of bytes", TNAME(obj));
		return -1;
	}
	if (d->view.readonly && !read_only) {
		PyErr_Format(PyExc_ValueError, "cannot register %s for writing: its buffer is read-only "
		    "(pass read_only=True)", TNAME(obj));
		return -1;
	}
	if (empty_or_long(obj, (uint64_t)d->view.len) < 0)
		return -1;
	return describe_host(obj, d->view.buf, (uint64_t)d->view.len, d);
}

/* DLPack, as its specification has it (dlpack.h, ABI version 0.x / legacy capsule). */
enum { DL_CPU = 1, DL_CUDA = 2, DL_CUDA_HOST = 3, DL_CUDA_MANAGED = 13 };
typedef struct {
	int32_t device_type;
	int32_t device_id;
} DLDevice;
typedef struct {
	uint8_t code;
	uint8_t bits;
	uint16_t lanes;
} DLDataType;
typedef struct {
	void *data;
	DLDevice device;
	int32_t ndim;
	DLDataType dtype;
	int64_t *shape;
	int64_t *strides;          /* in items; NULL: compact row-major */
	uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
	DLTensor dl_tensor;
	void *manager_ctx;
	void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/*
 * A DLPack producer: obj.__dlpack__() gives a "dltensor" capsule; we take the tensor it holds
 * (renaming the capsule "used_dltensor", as the protocol says a consumer does) and call its
 * deleter when the region goes.
 */
static int
describe_dlpack(PyObject *obj, PyObject *method, struct mem_desc *d)
{
	PyObject *cap = PyObject_CallNoArgs(method);
	DLManagedTensor *m;

	if (cap == NULL)
		return -1;
	m = PyCapsule_GetPointer(cap, "dltensor");
	if (m == NULL || PyCapsule_SetName(cap, "used_dltensor") < 0) {
		Py_DECREF(cap);
		return -1;
	}
	Py_DECREF(cap);
	d->dl = m;                 /* ours now: mem_release calls its deleter */
	const DLTensor *t = &m->dl_tensor;
	uint64_t itemsize = ((uint64_t)t->dtype.bits * t->dtype.lanes + 7) / 8, items;
	if (t->ndim < 0 || itemsize == 0 || !c_contiguous((size_t)t->ndim, t->shape, NULL, 1, &items) ||
	    (t->strides != NULL && !c_contiguous((size_t)t->ndim, t->shape, t->strides, 1, &items))) {
		PyErr_Format(PyExc_ValueError, "cannot register %s: the DLPack tensor is not C-contiguous "
		    "(a strided view): gpx moves one range of bytes", TNAME(obj));
		return -1;
	}
	const void *p = (const unsigned char *)t->data + t->byte_offset;
	if (empty_or_long(obj, items * itemsize) < 0)
		return -1;
	switch (t->device.device_type) {
	case DL_CUDA:
	case DL_CUDA_MANAGED:
		d->cuda = true;
		d->ptr = p;
		d->length = items * itemsize;
		return 0;
	case DL_CPU:
	case DL_CUDA_HOST:
		return describe_host(obj, p, items * itemsize, d);
	}
	PyErr_Format(PyExc_ValueError, "cannot register %s: DLPack device type %d (gpx takes CUDA and "
	    "host memory)", TNAME(obj), (int)t->device.device_type);
	return -1;
}

int
mem_describe(struct modstate *st, PyObject *obj, bool read_only, struct mem_desc *d)
{
	PyObject *a;
	int r;

	memset(d, 0, sizeof(*d));
	d->obj = Py_NewRef(obj);
	if (Py_IS_TYPE(obj, st->hostbuf_type)) {
		HostBuffer *h = (HostBuffer *)obj;
		if (h->closed) {
			PyErr_SetString(PyExc_ValueError, "cannot register a closed HostBuffer");
			goto fail;
		}
		d->hb = (HostBuffer *)Py_NewRef(obj);
		d->length = h->len;
		h->regs++;
		return 0;
	}
	/* torch tensors first: they also have __cuda_array_interface__ and __dlpack__. */
	if ((r = opt_attr(obj, st->s_data_ptr, &a)) < 0)
		goto fail;
	if (r > 0) {
		uint64_t ptr, n;
		bool cpu;
		Py_DECREF(a);
		if (tensor_memory(st, obj, "register()", &ptr, &n, &cpu) < 0 || empty_or_long(obj, n) < 0)
			goto fail;
		if (cpu && describe_host(obj, (const void *)(uintptr_t)ptr, n, d) < 0)
			goto fail;
		if (!cpu) {
			d->cuda = true;
			d->ptr = (const void *)(uintptr_t)ptr;
			d->length = n;
		}
		return 0;
	}
	if ((r = opt_attr(obj, st->s_cai, &a)) < 0)
		goto fail;
	if (r > 0) {
		r = describe_cai(obj, a, read_only, d);
		Py_DECREF(a);
		if (r < 0)
			goto fail;
		return 0;
	}
	if (PyObject_CheckBuffer(obj)) {
		if (describe_buffer(obj, read_only, d) < 0)
			goto fail;
		return 0;
	}
	if ((r = opt_attr(obj, st->s_dlpack, &a)) < 0)
		goto fail;
	if (r > 0) {
		r = describe_dlpack(obj, a, d);
		Py_DECREF(a);
		if (r < 0)
			goto fail;
		return 0;
	}
	PyErr_Format(PyExc_TypeError, "cannot register %s: expected a CUDA tensor or array (data_ptr(), "
	    "__cuda_array_interface__ or __dlpack__), a gpx.HostBuffer, or a buffer inside one",
	    TNAME(obj));
fail:
	mem_release(d);
	return -1;
}

void
mem_release(struct mem_desc *d)
{
	if (d->has_view)
		PyBuffer_Release(&d->view);
	d->has_view = false;
	if (d->dl != NULL) {
		DLManagedTensor *m = d->dl;
		d->dl = NULL;
		if (m->deleter != NULL)
			m->deleter(m);
	}
	if (d->hb != NULL)
		d->hb->regs--;
	Py_CLEAR(d->hb);
	Py_CLEAR(d->obj);
}

/*
 * Tensor o's dtype, when an integer one: its size and sign (1), or 0 when it is not an integer
 * (-1 on error).  Asked of the dtype once, then kept (st->int_dtypes): its three attributes and
 * element_size() cost ~1 us a list.
 */
static int
int_dtype(struct modstate *st, PyObject *o, uint64_t *size, bool *is_signed)
{
	PyObject *dt = PyObject_GetAttr(o, st->s_dtype);
	int fl, cx, sg, k, r = 1;

	if (dt == NULL)
		return -1;
	for (k = 0; k < INT_DTYPES && st->int_dtypes[k].dtype != NULL; k++)
		if (st->int_dtypes[k].dtype == dt) {
			*size = st->int_dtypes[k].size;
			*is_signed = st->int_dtypes[k].is_signed;
			Py_DECREF(dt);
			return 1;
		}
	if ((fl = attr2_bool(o, st->s_dtype, st->s_is_floating_point)) < 0 ||
	    (cx = attr2_bool(o, st->s_dtype, st->s_is_complex)) < 0 ||
	    (sg = attr2_bool(o, st->s_dtype, st->s_is_signed)) < 0 ||
	    call_u64(o, st->s_element_size, "element_size()", size) < 0)
		r = -1;
	else if (fl || cx || *size == 0 || *size > 8)
		r = 0;
	else {
		*is_signed = sg;
		if (k < INT_DTYPES) {    /* (beyond INT_DTYPES of them, asked each time) */
			st->int_dtypes[k].dtype = Py_NewRef(dt);
			st->int_dtypes[k].size = (uint8_t)*size;
			st->int_dtypes[k].is_signed = sg;
		}
	}
	Py_DECREF(dt);
	return r;
}

/* A CPU tensor of integers of `size` bytes, read through its data pointer: 1, 0 (not a tensor), -1. */
int
mem_int_tensor(struct modstate *st, PyObject *o, const char *what, size_t size, const void **p,
    size_t *items, bool *is_signed)
{
	uint64_t ptr, nbytes, esize;
	PyObject *a;
	bool cpu;
	int r;

	if ((r = opt_attr(o, st->s_data_ptr, &a)) <= 0)
		return r;
	Py_DECREF(a);
	if ((r = int_dtype(st, o, &esize, is_signed)) < 0)
		return -1;
	if (r == 0 || esize != size) {
		PyErr_Format(PyExc_TypeError, "%s must hold %zu-byte integers", what, size);
		return -1;
	}
	if (tensor_memory(st, o, what, &ptr, &nbytes, &cpu) < 0)
		return -1;
	if (!cpu) {
		PyErr_Format(PyExc_ValueError, "%s must be in host memory (a CPU tensor or array)", what);
		return -1;
	}
	*p = (const void *)(uintptr_t)ptr;
	*items = nbytes / size;
	return 1;
}
