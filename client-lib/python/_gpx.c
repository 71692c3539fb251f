/*
 * gpx._gpx: Python as a client of gpx.  A CPython extension over libgpxclient (whose objects
 * are linked in), built against the stable ABI (3.11).  This file is the module: its
 * initialisation and state, its functions, its types (conn.c, region.c, transfer.c,
 * mem-host.c hold them) and exceptions (gpx.Error and a subclass per error code), and fork
 * detection.  It is the top of the module's files: none calls it.  gpxpy.c holds the helpers
 * every file uses (raising those exceptions, arguments); _gpx.h says how the files fit.
 */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client-lib/python/_gpx.h"
#include "proto/wire.h"

static const struct errdef {
	int code;
	const char *name;            /* the class */
	const char *cname;           /* the constant */
	PyObject **extra;            /* a built-in base it also has, or NULL */
	const char *doc;
} errdefs[] = {
	{ GPX_EPROTO, "ProtocolError", "EPROTO", NULL, "A malformed or unexpected message (EPROTO)." },
	{ GPX_EVERSION, "VersionError", "EVERSION", NULL, "gpxd does not speak this protocol version (EVERSION)." },
	{ GPX_EINVAL, "InvalidError", "EINVAL", &PyExc_ValueError, "An argument is out of range (EINVAL); also a ValueError." },
	{ GPX_ENOENT, "NotFoundError", "ENOENT", NULL, "No such region, export or transfer (ENOENT)." },
	{ GPX_EACCES, "AccessError", "EACCES", &PyExc_PermissionError,
	  "Not allowed: ownership, an export's rule, read-only, trust domain (EACCES); also a PermissionError." },
	{ GPX_ERANGE, "RangeError", "ERANGE", NULL, "A segment leaves its region (ERANGE)." },
	{ GPX_EBUSY, "BusyError", "EBUSY", NULL, "Out of credit (too many outstanding transfers), or memory still in use (EBUSY)." },
	{ GPX_EQUOTA, "QuotaError", "EQUOTA", NULL, "A per-uid limit of gpxd is reached (EQUOTA)." },
	{ GPX_EBADFD, "BadFdError", "EBADFD", NULL, "A passed descriptor is not what it should be (EBADFD)." },
	{ GPX_ENOMEM, "NoMemoryError", "ENOMEM", &PyExc_MemoryError, "Out of memory, here or in gpxd (ENOMEM); also a MemoryError." },
	{ GPX_ECANCELED, "CanceledError", "ECANCELED", NULL, "The transfer was cancelled (ECANCELED)." },
	{ GPX_EREVOKED, "RevokedError", "EREVOKED", NULL, "The region's owner withdrew it (EREVOKED)." },
	{ GPX_EEXIST, "ExistsError", "EEXIST", NULL, "An export of that name exists (EEXIST)." },
	{ GPX_ENOTSUP, "NotSupportedError", "ENOTSUP", NULL, "Memory kind or path not available here (ENOTSUP)." },
	{ GPX_EIO, "CopyError", "EIO", NULL, "The copy failed (EIO)." },
	{ GPX_ESHUTDOWN, "ShutdownError", "ESHUTDOWN", NULL, "gpxd is stopping (ESHUTDOWN)." },
	{ GPX_EDRAINING, "DrainingError", "EDRAINING", NULL, "An operator drains this client (EDRAINING)." },
	{ GPX_EPERM, "NotAdminError", "EPERM", NULL, "An administrative request from a non-administrator (EPERM)." },
	{ GPX_ECONN, "ConnectionLostError", "ECONN", &PyExc_ConnectionError,
	  "gpxd cannot be reached, the connection was lost or closed, or it belongs to the parent "
	  "process (ECONN); also a ConnectionError." },
	{ GPX_ETIMEDOUT, "TimeoutError", "ETIMEDOUT", &PyExc_TimeoutError, "A wait timed out (ETIMEDOUT); also the built-in TimeoutError." },
	{ GPX_ESYS, "SysError", "ESYS", &PyExc_OSError, "A system call failed (ESYS); also an OSError, with errno." },
};

static PyObject *
mod_strerror(PyObject *module, PyObject *arg)
{
	long code = PyLong_AsLong(arg);

	if (code == -1 && PyErr_Occurred())
		return NULL;
	return PyUnicode_FromString(gpx_strerror((int)code));
}

static PyObject *
mod_set_await_hook(PyObject *module, PyObject *fn)
{
	struct modstate *st = PyModule_GetState(module);

	if (!PyCallable_Check(fn)) {
		PyErr_SetString(PyExc_TypeError, "the await hook must be callable");
		return NULL;
	}
	gpxpy_setref(&st->await_hook, Py_NewRef(fn));
	Py_RETURN_NONE;
}

static PyMethodDef mod_methods[] = {
	{ "connect", FAST(conn_connect),
	  "connect(socket=None, name=None) -> Conn\n--\n\nConnects to gpxd (the GIL released) at socket "
	  "(default $GPX_SOCKET, else " GPX_DEFAULT_SOCKET "); name is shown by gpxctl." },
	{ "host_alloc", mem_host_alloc, METH_O,
	  "host_alloc(nbytes) -> HostBuffer\n--\n\nMakes nbytes of host memory gpxd can map (a memfd "
	  "sealed against shrinking, mapped here, zero-filled)." },
	{ "strerror", mod_strerror, METH_O, "strerror(code) -> str\n--\n\nThe name of a gpx error code "
	  "(either sign), as gpx_strerror(3) gives it." },
	{ "_set_await_hook", mod_set_await_hook, METH_O, "Sets what `await transfer` calls (internal)." },
	{ "_vmm_check", torch_vmm_check, METH_O, "Whether a device can make exportable VMM memory (internal)." },
	{ "_torch_alloc_error", torch_alloc_error, METH_NOARGS,
	  "Why this thread's last allocation from gpx.torch_mem_pool() failed, or None (internal)." },
	{ NULL }
};

static PyStructSequence_Field completion_fields[] = {
	{ "tag", "The transfer's tag, or for a notification the export's notify tag." },
	{ "status", "0, or a negative gpx error code (gpx.strerror names it)." },
	{ "bytes", "Bytes moved." },
	{ "notify", "True for a notification: a peer's copy into an export of ours completed." },
	{ "reason", "None on success; else gpxd's reason, or the code's name." },
	{ NULL, NULL }
};

static PyStructSequence_Desc completion_desc = {
	"gpx.Completion",
	"Completion(tag, status, bytes, notify, reason): one finished transfer or notification, from "
	"Conn.poll() and Conn.wait().",
	completion_fields,
	5,
};

static void
on_fork_child(void)
{
	gpxpy_fork_gen++;
}

static PyObject *
intern(const char *s)
{
	return PyUnicode_InternFromString(s);
}

static int
add_errors(PyObject *m, struct modstate *st)
{
	PyObject *dict = Py_BuildValue("{sO}", "code", Py_None);

	if (dict == NULL)
		return -1;
	st->error = PyErr_NewExceptionWithDoc("gpx.Error", "Error: what gpx refused or could not do.\n\n"
	    ".code is the negative gpx error code (as gpx.h has it), .reason gpxd's own explanation (or "
	    "the code's name); each code has its subclass.", NULL, dict);
	Py_DECREF(dict);
	if (st->error == NULL || PyModule_AddObjectRef(m, "Error", st->error) < 0)
		return -1;
	st->errors[0] = Py_NewRef(st->error);
	for (size_t i = 0; i < sizeof(errdefs) / sizeof(errdefs[0]); i++) {
		const struct errdef *e = &errdefs[i];
		char qual[64];
		PyObject *bases = e->extra ? PyTuple_Pack(2, st->error, *e->extra) : PyTuple_Pack(1, st->error);
		PyObject *d = Py_BuildValue("{si}", "code", -e->code), *cls;
		if (bases == NULL || d == NULL) {
			Py_XDECREF(bases);
			Py_XDECREF(d);
			return -1;
		}
		snprintf(qual, sizeof(qual), "gpx.%s", e->name);
		cls = PyErr_NewExceptionWithDoc(qual, e->doc, bases, d);
		Py_DECREF(bases);
		Py_DECREF(d);
		if (cls == NULL || PyModule_AddObjectRef(m, e->name, cls) < 0 ||
		    PyModule_AddIntConstant(m, e->cname, e->code) < 0) {
			Py_XDECREF(cls);
			return -1;
		}
		st->errors[gpxpy_err_slot(e->code)] = cls;
	}
	return 0;
}

static PyObject *
add_type(PyObject *m, PyType_Spec *spec)
{
	PyObject *t = PyType_FromModuleAndSpec(m, spec, NULL);

	if (t == NULL || PyModule_AddType(m, (PyTypeObject *)t) < 0) {
		Py_XDECREF(t);
		return NULL;
	}
	return t;
}

static int
mod_exec(PyObject *m)
{
	static bool atfork;
	struct modstate *st = PyModule_GetState(m);

	if (!atfork) {
		if (pthread_atfork(NULL, NULL, on_fork_child) != 0) {
			PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
			return -1;
		}
		atfork = true;
	}
	if ((st->conn_type = (PyTypeObject *)add_type(m, &conn_spec)) == NULL ||
	    (st->region_type = (PyTypeObject *)add_type(m, &region_spec)) == NULL ||
	    (st->transfer_type = (PyTypeObject *)add_type(m, &transfer_spec)) == NULL ||
	    (st->hostbuf_type = (PyTypeObject *)add_type(m, &mem_hostbuf_spec)) == NULL ||
	    (st->batch_type = (PyTypeObject *)add_type(m, &batch_spec)) == NULL)
		return -1;
	if ((st->completion_type = PyStructSequence_NewType(&completion_desc)) == NULL ||
	    PyModule_AddObjectRef(m, "Completion", (PyObject *)st->completion_type) < 0)
		return -1;
	if (add_errors(m, st) < 0)
		return -1;
	if ((st->s_data_ptr = intern("data_ptr")) == NULL || (st->s_device = intern("device")) == NULL ||
	    (st->s_type = intern("type")) == NULL || (st->s_is_contiguous = intern("is_contiguous")) == NULL ||
	    (st->s_nbytes = intern("nbytes")) == NULL || (st->s_numel = intern("numel")) == NULL ||
	    (st->s_element_size = intern("element_size")) == NULL ||
	    (st->s_cai = intern("__cuda_array_interface__")) == NULL || (st->s_dlpack = intern("__dlpack__")) == NULL ||
	    (st->s_dtype = intern("dtype")) == NULL || (st->s_is_signed = intern("is_signed")) == NULL ||
	    (st->s_is_floating_point = intern("is_floating_point")) == NULL ||
	    (st->s_is_complex = intern("is_complex")) == NULL || (st->s_wait = intern("wait")) == NULL ||
	    (st->s_close = intern("close")) == NULL || (st->s_is_cuda = intern("is_cuda")) == NULL ||
	    (st->s_is_cpu = intern("is_cpu")) == NULL)
		return -1;
	if (PyModule_AddStringConstant(m, "__version__", PACKAGE_VERSION) < 0 ||
	    PyModule_AddIntConstant(m, "API_VERSION", GPX_API_VERSION) < 0 ||
	    PyModule_AddStringConstant(m, "DEFAULT_SOCKET", GPX_DEFAULT_SOCKET) < 0)
		return -1;
	return 0;
}

static int
mod_traverse(PyObject *m, visitproc visit, void *arg)
{
	struct modstate *st = PyModule_GetState(m);

	if (st == NULL)
		return 0;
	Py_VISIT(st->conn_type);
	Py_VISIT(st->region_type);
	Py_VISIT(st->transfer_type);
	Py_VISIT(st->hostbuf_type);
	Py_VISIT(st->batch_type);
	Py_VISIT(st->completion_type);
	Py_VISIT(st->error);
	for (int i = 0; i < INT_DTYPES; i++)
		Py_VISIT(st->int_dtypes[i].dtype);
	for (int i = 0; i < ERR_SLOTS; i++)
		Py_VISIT(st->errors[i]);
	Py_VISIT(st->await_hook);
	return 0;
}

static int
mod_clear(PyObject *m)
{
	struct modstate *st = PyModule_GetState(m);

	if (st == NULL)
		return 0;
	Py_CLEAR(st->conn_type);
	Py_CLEAR(st->region_type);
	Py_CLEAR(st->transfer_type);
	Py_CLEAR(st->hostbuf_type);
	Py_CLEAR(st->batch_type);
	Py_CLEAR(st->completion_type);
	Py_CLEAR(st->error);
	for (int i = 0; i < ERR_SLOTS; i++)
		Py_CLEAR(st->errors[i]);
	Py_CLEAR(st->await_hook);
	Py_CLEAR(st->s_data_ptr);
	Py_CLEAR(st->s_device);
	Py_CLEAR(st->s_type);
	Py_CLEAR(st->s_is_contiguous);
	Py_CLEAR(st->s_nbytes);
	Py_CLEAR(st->s_numel);
	Py_CLEAR(st->s_element_size);
	Py_CLEAR(st->s_cai);
	Py_CLEAR(st->s_dlpack);
	Py_CLEAR(st->s_dtype);
	Py_CLEAR(st->s_is_signed);
	Py_CLEAR(st->s_is_floating_point);
	Py_CLEAR(st->s_is_complex);
	Py_CLEAR(st->s_wait);
	Py_CLEAR(st->s_close);
	Py_CLEAR(st->s_is_cuda);
	Py_CLEAR(st->s_is_cpu);
	for (int i = 0; i < INT_DTYPES; i++)
		Py_CLEAR(st->int_dtypes[i].dtype);
	return 0;
}

static void
mod_free(void *m)
{
	mod_clear(m);
}

static PyModuleDef_Slot mod_slots[] = {
	{ Py_mod_exec, mod_exec },
	{ 0, NULL }
};

static struct PyModuleDef gpx_module = {
	PyModuleDef_HEAD_INIT,
	.m_name = "gpx._gpx",
	.m_doc = "The C half of the gpx package: import gpx, not this.",
	.m_size = sizeof(struct modstate),
	.m_methods = mod_methods,
	.m_slots = mod_slots,
	.m_traverse = mod_traverse,
	.m_clear = mod_clear,
	.m_free = mod_free,
};

PyMODINIT_FUNC PyInit__gpx(void);

__attribute__((visibility("default"))) PyMODINIT_FUNC
PyInit__gpx(void)
{
	return PyModuleDef_Init(&gpx_module);
}
