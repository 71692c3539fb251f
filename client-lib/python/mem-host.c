/*
 * gpx._gpx, gpx.HostBuffer: the host memory gpxd can map, a memfd made by gpx_host_alloc, with
 * the buffer protocol, so that numpy.frombuffer / torch.frombuffer / memoryview view it in
 * place.  The live ones are kept in a list so that any view of one (a numpy array, a CPU
 * tensor) is found by its address (mem_host_find) and registered as that slice of it.
 */
#include "config.h"

#include "client-lib/python/_gpx.h"
#include <structmember.h>

/* ---- gpx.HostBuffer ---- */

static HostBuffer *hostbufs;         /* the live ones (the GIL guards the list) */

/* The live HostBuffer that holds [p, p+len), and where in it; NULL if none does. */
HostBuffer *
mem_host_find(const void *p, uint64_t len, uint64_t *off)
{
	uintptr_t a = (uintptr_t)p;

	for (HostBuffer *h = hostbufs; h != NULL; h = h->next) {
		uintptr_t b = (uintptr_t)h->ptr;
		if (!h->closed && a >= b && a - b <= h->len && len <= h->len - (a - b)) {
			*off = a - b;
			return h;
		}
	}
	return NULL;
}

static void
hostbuf_unlink(HostBuffer *h)
{
	if (h->prev != NULL)
		h->prev->next = h->next;
	else if (hostbufs == h)
		hostbufs = h->next;
	if (h->next != NULL)
		h->next->prev = h->prev;
	h->prev = h->next = NULL;
}

PyObject *
mem_host_alloc(PyObject *module, PyObject *arg)
{
	struct modstate *st = PyModule_GetState(module);
	uint64_t n;
	void *p;
	int fd, r;

	if (gpxpy_u64(arg, "nbytes", &n) < 0)
		return NULL;
	if (n == 0 || n > (uint64_t)PY_SSIZE_T_MAX) {
		PyErr_SetString(PyExc_ValueError, "host_alloc: nbytes must be at least 1");
		return NULL;
	}
	Py_BEGIN_ALLOW_THREADS
	r = gpx_host_alloc(n, &fd, &p);
	Py_END_ALLOW_THREADS
	if (r < 0)
		return gpxpy_raise(st, r, r == -GPX_ESYS ? "cannot create or map a memfd of that size" : NULL);
	HostBuffer *h = (HostBuffer *)PyType_GenericAlloc(st->hostbuf_type, 0);
	if (h == NULL) {
		gpx_host_free(fd, p, n);
		return NULL;
	}
	h->fd = fd;
	h->ptr = p;
	h->len = n;
	h->next = hostbufs;
	if (hostbufs != NULL)
		hostbufs->prev = h;
	hostbufs = h;
	return (PyObject *)h;
}

/* Unmaps and closes, unless views or regions still use it: then BufferError. */
static PyObject *
hostbuf_close(PyObject *self, PyObject *unused)
{
	HostBuffer *h = (HostBuffer *)self;

	if (h->closed)
		Py_RETURN_NONE;
	if (h->exports > 0)
		return PyErr_Format(PyExc_BufferError, "cannot close a HostBuffer while %zd buffer view(s) "
		    "of it exist (numpy arrays, tensors, memoryviews): drop them first", h->exports);
	if (h->regs > 0)
		return PyErr_Format(PyExc_BufferError, "cannot close a HostBuffer while %u region(s) are "
		    "registered in it: deregister them or close their connections first", h->regs);
	hostbuf_unlink(h);
	gpx_host_free(h->fd, h->ptr, h->len);
	h->fd = -1;
	h->ptr = NULL;
	h->closed = true;
	Py_RETURN_NONE;
}

static void
hostbuf_dealloc(PyObject *self)
{
	HostBuffer *h = (HostBuffer *)self;
	PyTypeObject *tp = Py_TYPE(self);

	if (h->weakrefs != NULL)
		PyObject_ClearWeakRefs(self);
	/* Views and regions hold references: none is left now. */
	if (!h->closed) {
		hostbuf_unlink(h);
		gpx_host_free(h->fd, h->ptr, h->len);
	}
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp);
}

static int
hostbuf_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
	HostBuffer *h = (HostBuffer *)self;

	if (h->closed) {
		PyErr_SetString(PyExc_ValueError, "the HostBuffer is closed");
		return -1;
	}
	if (PyBuffer_FillInfo(view, self, h->ptr, (Py_ssize_t)h->len, 0, flags) < 0)
		return -1;
	h->exports++;
	return 0;
}

static void
hostbuf_releasebuffer(PyObject *self, Py_buffer *view)
{
	((HostBuffer *)self)->exports--;
}

static Py_ssize_t
hostbuf_len(PyObject *self)
{
	return (Py_ssize_t)((HostBuffer *)self)->len;
}

static PyObject *
hostbuf_enter(PyObject *self, PyObject *unused)
{
	return Py_NewRef(self);
}

static PyObject *
hostbuf_exit(PyObject *self, PyObject *args)
{
	return hostbuf_close(self, NULL);
}

static PyObject *
hostbuf_repr(PyObject *self)
{
	HostBuffer *h = (HostBuffer *)self;

	if (h->closed)
		return PyUnicode_FromString("<gpx.HostBuffer closed>");
	return PyUnicode_FromFormat("<gpx.HostBuffer %zu bytes, fd %d>", h->len, h->fd);
}

static PyObject *
hostbuf_get_fd(PyObject *self, void *unused)
{
	return PyLong_FromLong(((HostBuffer *)self)->fd);
}

static PyObject *
hostbuf_get_nbytes(PyObject *self, void *unused)
{
	return PyLong_FromSize_t(((HostBuffer *)self)->len);
}

static PyObject *
hostbuf_get_closed(PyObject *self, void *unused)
{
	return PyBool_FromLong(((HostBuffer *)self)->closed);
}

static PyMethodDef hostbuf_methods[] = {
	{ "close", hostbuf_close, METH_NOARGS,
	  "close()\n--\n\nUnmaps the memory and closes the memfd.  Refused (BufferError) while buffer views "
	  "of it exist or regions are registered in it; closing twice is fine." },
	{ "__enter__", hostbuf_enter, METH_NOARGS, "Returns the HostBuffer itself." },
	{ "__exit__", hostbuf_exit, METH_VARARGS, "Closes the HostBuffer." },
	{ NULL }
};

static PyGetSetDef hostbuf_getset[] = {
	{ "fd", hostbuf_get_fd, NULL, "The memfd (close-on-exec; -1 once closed).", NULL },
	{ "nbytes", hostbuf_get_nbytes, NULL, "Its size in bytes.", NULL },
	{ "closed", hostbuf_get_closed, NULL, "Whether close() has run.", NULL },
	{ NULL }
};

static PyMemberDef hostbuf_members[] = {
	{ "__weaklistoffset__", T_PYSSIZET, offsetof(HostBuffer, weakrefs), READONLY, NULL },
	{ NULL }
};

static PyType_Slot hostbuf_slots[] = {
	{ Py_tp_doc, "HostBuffer: host memory gpxd can map, made by gpx.host_alloc(nbytes).\n\n"
	  "A memfd sealed against shrinking, mapped in this process and zero-filled.  It supports the "
	  "buffer protocol (writable bytes), so numpy.frombuffer(buf, dtype), torch.frombuffer(buf, "
	  "dtype=...) and memoryview(buf) view it without a copy, and such views (or slices of them) "
	  "can be registered: Conn.register() finds the HostBuffer by address.  It stays valid in a "
	  "child after fork() (the mapping is shared)." },
	{ Py_tp_dealloc, hostbuf_dealloc },
	{ Py_tp_repr, hostbuf_repr },
	{ Py_tp_methods, hostbuf_methods },
	{ Py_tp_getset, hostbuf_getset },
	{ Py_tp_members, hostbuf_members },
	{ Py_bf_getbuffer, hostbuf_getbuffer },
	{ Py_bf_releasebuffer, hostbuf_releasebuffer },
	{ Py_sq_length, hostbuf_len },
	{ 0, NULL }
};

PyType_Spec mem_hostbuf_spec = {
	.name = "gpx.HostBuffer",
	.basicsize = sizeof(HostBuffer),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = hostbuf_slots,
};
