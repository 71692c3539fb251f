/*
 * gpx._gpx: Python as a client of gpx.  A CPython extension over libgpxclient (whose objects
 * are linked in), built against the stable ABI (3.11).  This file is the module: its
 * initialisation and state, its exceptions (gpx.Error and a subclass per error code, raised
 * from a code and gpxd's reason), the argument helpers of every method, and fork detection.
 * conn.c, region.c, transfer.c and route.c hold the objects; _gpx.h says how they fit.
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

unsigned gpxpy_fork_gen;

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

/* The slot of errors[] for a code (either sign); 0 (gpx.Error) for an unknown one. */
static int
err_slot(int code)
{
	code = code < 0 ? -code : code;
	if (code >= 1 && code <= 18)
		return code;
	if (code >= 100 && code <= 102)
		return 19 + code - 100;
	return 0;
}

/* Notes a library call's result on c (whose lock is held), for raising after the lock is gone. */
int
gpxpy_note(struct callres *cr, gpx_conn *c, int r)
{
	cr->r = r;
	cr->err = errno;
	cr->reason[0] = '\0';
	if (r < 0 && c != NULL)
		snprintf(cr->reason, sizeof(cr->reason), "%s", gpx_last_error(c));
	return r;
}

/* The exception for code (negative) with reason: str() is "what: why", .code and .reason set. */
static PyObject *
make_error(struct modstate *st, int code, const char *reason, int sys_errno)
{
	PyObject *cls = st->errors[err_slot(code)], *msg, *exc, *v;
	const char *what = gpx_strerror(code);

	if (reason == NULL || reason[0] == '\0')
		reason = what;
	if (strcmp(reason, what) == 0)
		msg = PyUnicode_FromString(what);
	else
		msg = PyUnicode_FromFormat("%s: %s", what, reason);
	if (msg == NULL)
		return NULL;
	if (err_slot(code) == err_slot(GPX_ESYS) && sys_errno > 0)
		exc = PyObject_CallFunction(cls, "iO", sys_errno, msg);
	else
		exc = PyObject_CallFunctionObjArgs(cls, msg, NULL);
	Py_DECREF(msg);
	if (exc == NULL)
		return NULL;
	if ((v = PyLong_FromLong(code < 0 ? code : -code)) == NULL || PyObject_SetAttrString(exc, "code", v) < 0) {
		Py_XDECREF(v);
		Py_DECREF(exc);
		return NULL;
	}
	Py_DECREF(v);
	if ((v = PyUnicode_DecodeUTF8(reason, (Py_ssize_t)strlen(reason), "replace")) == NULL ||
	    PyObject_SetAttrString(exc, "reason", v) < 0) {
		Py_XDECREF(v);
		Py_DECREF(exc);
		return NULL;
	}
	Py_DECREF(v);
	return exc;
}

PyObject *
gpxpy_raise_errno(struct modstate *st, int code, const char *reason, int sys_errno)
{
	PyObject *exc = make_error(st, code, reason, sys_errno);

	if (exc != NULL) {
		PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
		Py_DECREF(exc);
	}
	return NULL;
}

PyObject *
gpxpy_raise(struct modstate *st, int code, const char *reason)
{
	return gpxpy_raise_errno(st, code, reason, 0);
}

PyObject *
gpxpy_raise_call(struct modstate *st, const struct callres *cr)
{
	return gpxpy_raise_errno(st, cr->r, cr->reason, cr->err);
}

/* Binds fast-call arguments to out[] (borrowed; NULL where not given) by position and name. */
int
gpxpy_args(const struct argspec *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out)
{
	Py_ssize_t nkw = kwnames != NULL ? PyTuple_Size(kwnames) : 0;
	int n = 0;

	while (s->names[n] != NULL)
		out[n++] = NULL;
	if (nargs > s->npos) {
		PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional argument%s (%zd given)",
		    s->fname, s->npos, s->npos == 1 ? "" : "s", nargs);
		return -1;
	}
	for (Py_ssize_t i = 0; i < nargs; i++)
		out[i] = args[i];
	for (Py_ssize_t k = 0; k < nkw; k++) {
		PyObject *key = PyTuple_GetItem(kwnames, k);
		int j = 0;
		while (j < n && PyUnicode_CompareWithASCIIString(key, s->names[j]) != 0)
			j++;
		if (j == n) {
			PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", s->fname, key);
			return -1;
		}
		if (out[j] != NULL) {
			PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", s->fname, s->names[j]);
			return -1;
		}
		out[j] = args[nargs + k];
	}
	for (int i = 0; i < s->nreq; i++)
		if (out[i] == NULL) {
			PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", s->fname, s->names[i]);
			return -1;
		}
	return 0;
}

/* A non-negative integer argument (an int or anything with __index__). */
int
gpxpy_u64(PyObject *o, const char *name, uint64_t *out)
{
	if (PyLong_Check(o))
		*out = PyLong_AsUnsignedLongLong(o);
	else {
		PyObject *i = PyNumber_Index(o);
		if (i == NULL)
			return -1;
		*out = PyLong_AsUnsignedLongLong(i);
		Py_DECREF(i);
	}
	if (*out == (uint64_t)-1 && PyErr_Occurred()) {
		if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
			PyErr_Clear();
			PyErr_Format(PyExc_ValueError, "%s must be an integer in [0, 2**64)", name);
		}
		return -1;
	}
	return 0;
}

/* A timeout in seconds; None (or absent) is -1, for ever. */
int
gpxpy_timeout(PyObject *o, double *out)
{
	*out = -1;
	if (o == NULL || o == Py_None)
		return 0;
	*out = PyFloat_AsDouble(o);
	if (*out == -1 && PyErr_Occurred())
		return -1;
	if (isnan(*out) || *out < 0) {
		PyErr_SetString(PyExc_ValueError, "timeout must be None or >= 0 seconds");
		return -1;
	}
	return 0;
}

/* A str argument as UTF-8 (valid while o lives). */
const char *
gpxpy_str(PyObject *o, const char *name)
{
	if (!PyUnicode_Check(o)) {
		PyErr_Format(PyExc_TypeError, "%s must be a str, not %s", name, TNAME(o));
		return NULL;
	}
	return PyUnicode_AsUTF8AndSize(o, NULL);
}

/* *slot = v (a new reference, or NULL), dropping the old one after. */
void
gpxpy_setref(PyObject **slot, PyObject *v)
{
	PyObject *old = *slot;

	*slot = v;
	Py_XDECREF(old);
}

double
gpxpy_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

const char *
gpxpy_type_name(PyObject *obj, char *buf, size_t len)
{
	PyObject *n = PyType_GetName(Py_TYPE(obj));
	const char *u = n != NULL ? PyUnicode_AsUTF8AndSize(n, NULL) : NULL;

	snprintf(buf, len, "%s", u != NULL ? u : "object");
	if (u == NULL)
		PyErr_Clear();
	Py_XDECREF(n);
	return buf;
}

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

struct modstate *
gpxpy_state_of(PyTypeObject *tp)
{
	return PyType_GetModuleState(tp);
}

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
		st->errors[err_slot(e->code)] = cls;
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
	    (st->hostbuf_type = (PyTypeObject *)add_type(m, &mem_hostbuf_spec)) == NULL)
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
	    (st->s_close = intern("close")) == NULL)
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
	Py_VISIT(st->completion_type);
	Py_VISIT(st->error);
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
