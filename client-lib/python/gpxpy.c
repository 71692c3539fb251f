/*
 * What every file of the module gpx._gpx uses, and calls nothing of the others: gpx.Error's
 * subclass raised for a code with gpxd's reason (the classes are made by _gpx.c), the
 * argument helpers of every method, conversions, the clock, and the generation of fork()s
 * (bumped by _gpx.c's handler in the child).
 */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client-lib/python/_gpx.h"

unsigned gpxpy_fork_gen;

/* The slot of errors[] for a code (either sign); 0 (gpx.Error) for an unknown one. */
int
gpxpy_err_slot(int code)
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
	PyObject *cls = st->errors[gpxpy_err_slot(code)], *msg, *exc, *v;
	const char *what = gpx_strerror(code);

	if (reason == NULL || reason[0] == '\0')
		reason = what;
	if (strcmp(reason, what) == 0)
		msg = PyUnicode_FromString(what);
	else
		msg = PyUnicode_FromFormat("%s: %s", what, reason);
	if (msg == NULL)
		return NULL;
	if (gpxpy_err_slot(code) == gpxpy_err_slot(GPX_ESYS) && sys_errno > 0)
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

struct modstate *
gpxpy_state_of(PyTypeObject *tp)
{
	return PyType_GetModuleState(tp);
}
