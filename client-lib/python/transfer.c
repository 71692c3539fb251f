/*
 * gpx._gpx, the Transfer object: made when a copy is submitted (transfer_start; the copies are
 * submitted in transfer-submit.c), it waits for its completion (wait, done, await), cancels
 * it, and reads its result.  Transfers not yet complete are found by tag in a map of the
 * Conn's (transfer-map.c, below route.c, which resolves them as completions arrive).
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>

#include "client-lib/python/_gpx.h"

/* The result of a resolved transfer: bytes moved, or its error raised. */
static PyObject *
transfer_result(Transfer *t)
{
	if (t->in_backlog)
		route_backlog_take(t->conn, t);
	if (t->status < 0) {
		const char *why = NULL;
		if (t->reason != NULL && (why = PyUnicode_AsUTF8AndSize(t->reason, NULL)) == NULL)
			PyErr_Clear();
		return gpxpy_raise_errno(t->conn->st, t->status, why, 0);
	}
	return PyLong_FromUnsignedLongLong(t->bytes);
}

static PyObject *
transfer_wait(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "wait", 1, 0, { "timeout", NULL } };
	Transfer *t = (Transfer *)op;
	PyObject *a[1];
	double timeout;
	int r;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || gpxpy_timeout(a[0], &timeout) < 0)
		return NULL;
	if (!t->resolved) {
		if (t->conn->fork_gen != gpxpy_fork_gen)
			return gpxpy_raise_errno(t->conn->st, -GPX_ECONN, "the connection belongs to the parent "
			    "process (this is a child of fork())", 0);
		t->waiting++;
		r = route_wait_until(t->conn, route_pred_resolved, t, timeout, true);
		t->waiting--;
		if (r < 0)
			return NULL;
		if (r == 0) {
			char why[96];
			snprintf(why, sizeof(why), "transfer %#llx not complete after %g s",
			    (unsigned long long)t->tag, timeout);
			return gpxpy_raise_errno(t->conn->st, -GPX_ETIMEDOUT, why, 0);
		}
	}
	return transfer_result(t);
}

static PyObject *
transfer_done(PyObject *op, PyObject *unused)
{
	Transfer *t = (Transfer *)op;

	if (!t->resolved && t->conn->fork_gen == gpxpy_fork_gen) {
		/* One look, so that a loop on done() makes progress by itself. */
		t->waiting++;
		int r = route_wait_until(t->conn, route_pred_resolved, t, 0, true);
		t->waiting--;
		if (r < 0)
			return NULL;
	}
	if (t->resolved && t->in_backlog)
		route_backlog_take(t->conn, t);
	return PyBool_FromLong(t->resolved);
}

static PyObject *
transfer_cancel(PyObject *op, PyObject *unused)
{
	Transfer *t = (Transfer *)op;
	Conn *s = t->conn;
	struct callres cr = { 0 };
	PyThreadState *ts;

	if (t->resolved)
		Py_RETURN_FALSE;
	if (conn_usable(s) < 0)
		return NULL;
	ts = conn_lock_slow(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_cancel(s->c, t->tag) : -GPX_ECONN);
	conn_unlock(s, ts);
	route_after_rpc(s);
	/* Already complete in the daemon: its completion is on its way. */
	if (cr.r == -GPX_ENOENT)
		Py_RETURN_FALSE;
	if (cr.r < 0)
		return gpxpy_raise_call(s->st, &cr);
	Py_RETURN_TRUE;
}

static PyObject *
transfer_await(PyObject *op)
{
	Transfer *t = (Transfer *)op;
	PyObject *hook = t->conn->st->await_hook;

	if (hook == NULL) {
		PyErr_SetString(PyExc_TypeError, "awaiting a Transfer needs the gpx package (import gpx)");
		return NULL;
	}
	return PyObject_CallFunctionObjArgs(hook, op, NULL);
}

static void
transfer_dealloc(PyObject *op)
{
	Transfer *t = (Transfer *)op;
	PyTypeObject *tp = Py_TYPE(op);

	/* Its completion, still to come or in the backlog, stays for poll(). */
	if (!t->resolved) {
		struct tagslot *slot = transfer_map_find(&t->conn->pending, t->tag);
		if (slot != NULL && slot->t == t)
			slot->t = NULL;
	}
	if (t->in_backlog)
		for (size_t i = 0; i < t->conn->nback; i++)
			if (t->conn->back[i].t == t)
				t->conn->back[i].t = NULL;
	Py_XDECREF(t->reason);
	Py_XDECREF(t->waker);
	Py_DECREF(t->conn);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(op);
	Py_DECREF(tp);
}

static PyObject *
transfer_repr(PyObject *op)
{
	Transfer *t = (Transfer *)op;
	char buf[128];

	if (!t->resolved)
		snprintf(buf, sizeof(buf), "<gpx.Transfer tag %#llx pending>", (unsigned long long)t->tag);
	else
		snprintf(buf, sizeof(buf), "<gpx.Transfer tag %#llx done: status %d, %llu bytes>",
		    (unsigned long long)t->tag, t->status, (unsigned long long)t->bytes);
	return PyUnicode_FromString(buf);
}

static PyObject *
transfer_get_tag(PyObject *op, void *unused)
{
	return PyLong_FromUnsignedLongLong(((Transfer *)op)->tag);
}

static PyObject *
transfer_get_status(PyObject *op, void *unused)
{
	Transfer *t = (Transfer *)op;

	if (!t->resolved)
		Py_RETURN_NONE;
	return PyLong_FromLong(t->status);
}

static PyObject *
transfer_get_bytes(PyObject *op, void *unused)
{
	Transfer *t = (Transfer *)op;

	if (!t->resolved)
		Py_RETURN_NONE;
	return PyLong_FromUnsignedLongLong(t->bytes);
}

static PyObject *
transfer_get_conn(PyObject *op, void *unused)
{
	return Py_NewRef((PyObject *)((Transfer *)op)->conn);
}

static PyObject *
transfer_get_waker(PyObject *op, void *unused)
{
	Transfer *t = (Transfer *)op;

	return Py_NewRef(t->waker != NULL ? t->waker : Py_None);
}

static int
transfer_set_waker(PyObject *op, PyObject *v, void *unused)
{
	Transfer *t = (Transfer *)op;

	if (v != NULL && v != Py_None && !PyCallable_Check(v)) {
		PyErr_SetString(PyExc_TypeError, "_waker must be callable or None");
		return -1;
	}
	gpxpy_setref(&t->waker, v != NULL && v != Py_None ? Py_NewRef(v) : NULL);
	return 0;
}

static PyMethodDef transfer_methods[] = {
	{ "wait", (PyCFunction)(void (*)(void))transfer_wait, METH_FASTCALL | METH_KEYWORDS,
	  "wait(timeout=None)\n--\n\nWaits (the GIL released) until the transfer completes; returns the "
	  "bytes moved, or raises the gpx.Error subclass of its status with gpxd's reason.  timeout "
	  "in seconds (None: no limit; 0: just look) raises gpx.TimeoutError when it passes.  "
	  "Completions of other transfers read meanwhile are kept for them and for Conn.poll()." },
	{ "done", transfer_done, METH_NOARGS,
	  "done()\n--\n\nWhether the transfer has completed (reading what has arrived, without "
	  "blocking).  A True answer consumes its completion: poll() will not return it." },
	{ "cancel", transfer_cancel, METH_NOARGS,
	  "cancel()\n--\n\nAsks gpxd to cancel the transfer; it still completes, with "
	  "gpx.CanceledError unless it finished first.  Returns False when it had already completed." },
	{ NULL }
};

static PyGetSetDef transfer_getset[] = {
	{ "tag", transfer_get_tag, NULL, "The transfer's tag (given to copy(), or made by the module).", NULL },
	{ "status", transfer_get_status, NULL, "None while pending; then 0 or a negative gpx error code.", NULL },
	{ "bytes", transfer_get_bytes, NULL, "None while pending; then the bytes moved.", NULL },
	{ "conn", transfer_get_conn, NULL, "The Conn it was submitted on.", NULL },
	{ "_waker", transfer_get_waker, transfer_set_waker, "The asyncio glue's callback (internal).", NULL },
	{ NULL }
};

static PyType_Slot transfer_slots[] = {
	{ Py_tp_doc, "Transfer: one copy submitted to gpxd, returned by Conn.copy(), copyv() and "
	  "copy_pages().\n\nwait() blocks for it, done() looks, `await transfer` waits in asyncio (the "
	  "event loop watches Conn.fileno()).  A Transfer dropped unwaited leaves its completion to "
	  "Conn.poll()." },
	{ Py_tp_dealloc, transfer_dealloc },
	{ Py_tp_repr, transfer_repr },
	{ Py_tp_methods, transfer_methods },
	{ Py_tp_getset, transfer_getset },
	{ Py_am_await, transfer_await },
	{ 0, NULL }
};

PyType_Spec transfer_spec = {
	.name = "gpx.Transfer",
	.basicsize = sizeof(Transfer),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = transfer_slots,
};

/* A new Transfer, entered under its tag (tag_arg: the caller's, or NULL/None for an automatic one). */
Transfer *
transfer_start(Conn *s, PyObject *tag_arg)
{
	uint64_t tag;
	Transfer *t;

	if (tag_arg == NULL || tag_arg == Py_None)
		tag = TAG_AUTO | (++s->next_tag & ((1ULL << 61) - 1));
	else {
		if (gpxpy_u64(tag_arg, "tag", &tag) < 0)
			return NULL;
		if (tag >= TAG_AUTO) {
			PyErr_SetString(PyExc_ValueError, "tags must be below 2**62 (the others are the module's "
			    "and the library's)");
			return NULL;
		}
		if (transfer_map_find(&s->pending, tag) != NULL) {
			PyErr_Format(PyExc_ValueError, "tag %llu is in use by a transfer not yet complete",
			    (unsigned long long)tag);
			return NULL;
		}
	}
	if ((t = (Transfer *)PyType_GenericAlloc(s->st->transfer_type, 0)) == NULL)
		return NULL;
	t->conn = (Conn *)Py_NewRef((PyObject *)s);
	t->tag = tag;
	/* Entered before it is submitted: another thread may read its completion first. */
	if (transfer_map_put(&s->pending, tag, t) < 0) {
		t->resolved = true;
		Py_DECREF(t);
		PyErr_NoMemory();
		return NULL;
	}
	return t;
}

/* A submission failed: the Transfer goes, and the error is raised. */
PyObject *
transfer_abort(Transfer *t, const struct callres *cr)
{
	struct tagslot *slot = transfer_map_find(&t->conn->pending, t->tag);

	if (slot != NULL)
		transfer_map_del(&t->conn->pending, slot);
	t->resolved = true;
	gpxpy_raise_call(t->conn->st, cr);
	Py_DECREF(t);
	return NULL;
}
