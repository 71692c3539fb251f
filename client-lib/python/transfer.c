/*
 * gpx._gpx, transfers: Conn.copy, copyv and copy_pages submit them; the Transfer object waits
 * for one (wait, done, await), cancels it, and reads its result.  Transfers not yet complete
 * are found by tag in a map of the Conn's, which holds them borrowed: a Transfer that dies
 * leaves its slot empty, and its completion goes to poll().  Also the benchmark's C loops.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client-lib/python/_gpx.h"

#define INLINE_SEGS 64               /* up to this many segments travel inside the request */

static size_t
map_hash(uint64_t tag, size_t cap)
{
	return (size_t)((tag * 0x9E3779B97F4A7C15ULL) >> 17) & (cap - 1);
}

struct tagslot *
transfer_map_find(struct tagmap *m, uint64_t tag)
{
	if (m->n == 0)
		return NULL;
	for (size_t i = map_hash(tag, m->cap);; i = (i + 1) & (m->cap - 1)) {
		if (!m->s[i].used)
			return NULL;
		if (m->s[i].tag == tag)
			return &m->s[i];
	}
}

int
transfer_map_put(struct tagmap *m, uint64_t tag, Transfer *t)
{
	if (2 * (m->n + 1) > m->cap) {
		size_t cap = m->cap ? 2 * m->cap : 64;
		struct tagslot *s = calloc(cap, sizeof(*s)), *old = m->s;
		if (s == NULL)
			return -1;
		m->s = s;
		m->n = 0;
		size_t ocap = m->cap;
		m->cap = cap;
		for (size_t i = 0; i < ocap; i++)
			if (old[i].used)
				transfer_map_put(m, old[i].tag, old[i].t);
		free(old);
	}
	size_t i = map_hash(tag, m->cap);
	while (m->s[i].used)
		i = (i + 1) & (m->cap - 1);
	m->s[i] = (struct tagslot){ .tag = tag, .t = t, .used = true };
	m->n++;
	return 0;
}

/* Removes a slot, shifting back the entries of its probe run (no tombstones). */
void
transfer_map_del(struct tagmap *m, struct tagslot *slot)
{
	size_t mask = m->cap - 1, i = (size_t)(slot - m->s), j = i;

	m->s[i].used = false;
	m->n--;
	for (;;) {
		j = (j + 1) & mask;
		if (!m->s[j].used)
			return;
		size_t home = map_hash(m->s[j].tag, m->cap);
		/* Leave j where it is if its home lies cyclically in (i, j]. */
		if ((j > i && home > i && home <= j) || (j < i && (home > i || home <= j)))
			continue;
		m->s[i] = m->s[j];
		m->s[j].used = false;
		i = j;
	}
}

void
transfer_resolve(Transfer *t, int status, uint64_t bytes, PyObject *reason)
{
	t->resolved = true;
	t->status = status;
	t->bytes = bytes;
	gpxpy_setref(&t->reason, Py_XNewRef(reason));
}

/* Calls (once) the asyncio glue's callback of a resolved transfer. */
void
transfer_wake(Transfer *t)
{
	PyObject *w = t->waker, *r;

	t->waker = NULL;
	r = PyObject_CallFunctionObjArgs(w, (PyObject *)t, NULL);
	if (r == NULL)
		PyErr_WriteUnraisable(w);
	Py_XDECREF(r);
	Py_DECREF(w);
}

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
static Transfer *
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
static PyObject *
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

/* src and dst as Regions of s that are still registered. */
static int
transfer_regions(Conn *s, PyObject *a, PyObject *b, Region **src, Region **dst)
{
	PyObject *o[2] = { a, b };
	Region *r[2];

	for (int i = 0; i < 2; i++) {
		if (!Py_IS_TYPE(o[i], s->st->region_type)) {
			PyErr_Format(PyExc_TypeError, "%s must be a gpx.Region (from register() or import_()), not %s",
			    i ? "dst" : "src", TNAME(o[i]));
			return -1;
		}
		r[i] = (Region *)o[i];
		if (r[i]->conn != s) {
			PyErr_Format(PyExc_ValueError, "%s is a region of another connection", i ? "dst" : "src");
			return -1;
		}
		if (!r[i]->live) {
			PyErr_Format(PyExc_ValueError, "%s was deregistered", i ? "dst" : "src");
			return -1;
		}
	}
	*src = r[0];
	*dst = r[1];
	return 0;
}

PyObject *
transfer_copy(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy", 3, 2,
		{ "src", "dst", "length", "src_offset", "dst_offset", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[6];
	Region *src, *dst;
	uint64_t len, soff = 0, doff = 0;
	struct callres cr;
	PyThreadState *ts;
	Transfer *t;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    transfer_regions(s, a[0], a[1], &src, &dst) < 0 ||
	    (a[3] != NULL && gpxpy_u64(a[3], "src_offset", &soff) < 0) ||
	    (a[4] != NULL && gpxpy_u64(a[4], "dst_offset", &doff) < 0))
		return NULL;
	if (a[2] == NULL || a[2] == Py_None) {
		if (soff >= src->length) {
			PyErr_SetString(PyExc_ValueError, "src_offset is at or past the end of src");
			return NULL;
		}
		len = src->length - soff;
	} else if (gpxpy_u64(a[2], "length", &len) < 0)
		return NULL;
	if ((t = transfer_start(s, a[5])) == NULL)
		return NULL;
	ts = conn_lock_quick(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy(s->c, src->id, soff, dst->id, doff, len, t->tag) : -GPX_ECONN);
	conn_unlock(s, ts);
	if (cr.r < 0)
		return transfer_abort(t, &cr);
	return (PyObject *)t;
}

/*
 * gpx_copyv of rows of signed 64-bit integers, refused if one is negative.  A long list is
 * checked as it is written into the segment area (gpx_segs_reserve): one pass over it, not
 * two.  1 if a value is negative (nothing submitted), else the library's result.
 */
static int
copyv_signed(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *segs, size_t n, uint64_t tag)
{
	struct gpx_seg *room;
	uint64_t bits = 0;
	int r;

	if (n <= INLINE_SEGS) {
		for (size_t i = 0; i < n; i++)
			bits |= segs[i].src_offset | segs[i].dst_offset | segs[i].length;
		return bits >> 63 ? 1 : gpx_copyv(c, src, dst, segs, n, tag);
	}
	if ((r = gpx_segs_reserve(c, n, &room)) < 0)
		return r;
	for (size_t i = 0; i < n; i++) {
		room[i] = segs[i];
		bits |= segs[i].src_offset | segs[i].dst_offset | segs[i].length;
	}
	/* A refused list's room is given up with the next transfer. */
	return bits >> 63 ? 1 : gpx_copyv(c, src, dst, room, n, tag);
}

/* Long lists take a while to check and copy: then the GIL is released for the call. */
#define HEAVY_LIST 4096

PyObject *
transfer_copyv(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copyv", 3, 3, { "src", "dst", "segments", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[4];
	Region *src, *dst;
	struct seglist l;
	struct callres cr;
	PyThreadState *ts;
	Transfer *t;
	int r;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    transfer_regions(s, a[0], a[1], &src, &dst) < 0 || mem_segments(s->st, a[2], &l) < 0)
		return NULL;
	if ((t = transfer_start(s, a[3])) == NULL) {
		mem_segments_release(&l);
		return NULL;
	}
	ts = l.n > HEAVY_LIST ? conn_lock_slow(s) : conn_lock_quick(s);
	if (s->c == NULL)
		r = -GPX_ECONN;
	else if (l.is_signed)
		r = copyv_signed(s->c, src->id, dst->id, l.segs, l.n, t->tag);
	else
		r = gpx_copyv(s->c, src->id, dst->id, l.segs, l.n, t->tag);
	gpxpy_note(&cr, s->c, r);
	conn_unlock(s, ts);
	mem_segments_release(&l);
	if (r == 1) {
		cr.r = 0;
		transfer_abort(t, &cr);
		PyErr_Clear();
		PyErr_SetString(PyExc_ValueError, "segments hold a negative value");
		return NULL;
	}
	if (r < 0)
		return transfer_abort(t, &cr);
	return (PyObject *)t;
}

PyObject *
transfer_copy_pages(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy_pages", 5, 5,
		{ "src", "dst", "page_size", "src_pages", "dst_pages", "src_offset", "dst_offset", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[8];
	Region *src, *dst;
	uint64_t psize, soff = 0, doff = 0;
	struct pagelist sp, dp;
	struct callres cr;
	PyThreadState *ts;
	Transfer *t = NULL;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    transfer_regions(s, a[0], a[1], &src, &dst) < 0 || gpxpy_u64(a[2], "page_size", &psize) < 0 ||
	    (a[5] != NULL && gpxpy_u64(a[5], "src_offset", &soff) < 0) ||
	    (a[6] != NULL && gpxpy_u64(a[6], "dst_offset", &doff) < 0))
		return NULL;
	if (psize == 0) {
		PyErr_SetString(PyExc_ValueError, "page_size must be at least 1");
		return NULL;
	}
	if (mem_pages(s->st, a[3], "src_pages", &sp) < 0)
		return NULL;
	if (mem_pages(s->st, a[4], "dst_pages", &dp) < 0) {
		mem_pages_release(&sp);
		return NULL;
	}
	if (sp.n != dp.n || sp.n == 0) {
		PyErr_Format(PyExc_ValueError, sp.n ? "src_pages and dst_pages differ in length (%zu, %zu)" :
		    "no pages", sp.n, dp.n);
		goto out;
	}
	if ((t = transfer_start(s, a[7])) == NULL)
		goto out;
	ts = sp.n > HEAVY_LIST ? conn_lock_slow(s) : conn_lock_quick(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy_pages(s->c, src->id, soff, dst->id, doff, psize, sp.pages,
	    dp.pages, sp.n, t->tag) : -GPX_ECONN);
	conn_unlock(s, ts);
	if (cr.r < 0) {
		transfer_abort(t, &cr);
		t = NULL;
	}
out:
	mem_pages_release(&sp);
	mem_pages_release(&dp);
	return (PyObject *)t;
}

/*
 * The pairs of a batch from a sequence of tuples (src, dst[, ...]): each tuple's two regions
 * and the 0..nmore unsigned numbers after them, in more[i] (more[i][0] is src's length unless
 * given) with their count in given[i].  A malloc'ed array of *n pairs, or NULL with the
 * exception set.
 */
static struct gpx_pair *
batch_pairs(Conn *s, PyObject *seq, Py_ssize_t n, int nmore, uint64_t (*more)[3], int *given, const char *shape)
{
	struct gpx_pair *pr = NULL;

	if (n == 0 || n > GPX_PAIRS_MAX) {
		PyErr_Format(PyExc_ValueError, "a batch takes 1..%d pairs, not %zd", GPX_PAIRS_MAX, n);
		return NULL;
	}
	if ((pr = calloc(n, sizeof(*pr))) == NULL) {
		PyErr_NoMemory();
		return NULL;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *t = PySequence_GetItem(seq, i);
		Py_ssize_t k = t != NULL && PyTuple_Check(t) ? PyTuple_Size(t) : -1;
		Region *src, *dst;
		int bad = t == NULL;
		if (!bad && (k < 2 || k > 2 + nmore)) {
			PyErr_Format(PyExc_TypeError, "pair %zd must be a tuple %s, not %s", i, shape, TNAME(t));
			bad = 1;
		}
		if (!bad && transfer_regions(s, PyTuple_GetItem(t, 0), PyTuple_GetItem(t, 1), &src, &dst) < 0)
			bad = 1;
		if (!bad) {
			pr[i].src = src->id;
			pr[i].dst = dst->id;
			more[i][0] = src->length;     /* the default length: the whole source */
			given[i] = (int)k - 2;
			for (Py_ssize_t j = 2; j < k && !bad; j++)
				bad = gpxpy_u64(PyTuple_GetItem(t, j), "a pair's number", &more[i][j - 2]) < 0;
		}
		Py_XDECREF(t);
		if (bad) {
			free(pr);
			return NULL;
		}
	}
	return pr;
}

/*
 * copy_batch(pairs, *, tag=None): one request of many region pairs, each one segment: a
 * tuple (src, dst) copies the whole of src to the start of dst, (src, dst, length) that many
 * bytes, (src, dst, length, src_offset, dst_offset) from and to those offsets.
 */
PyObject *
transfer_copy_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy_batch", 1, 1, { "pairs", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[2];
	struct gpx_pair *pr = NULL;
	struct gpx_seg *segs = NULL;
	uint64_t (*more)[3] = NULL;
	int *given = NULL;
	struct callres cr;
	Transfer *t = NULL;
	Py_ssize_t n;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (n = PySequence_Size(a[0])) < 0)
		return NULL;
	if ((more = calloc(n ? n : 1, sizeof(*more))) == NULL || (segs = calloc(n ? n : 1, sizeof(*segs))) == NULL ||
	    (given = calloc(n ? n : 1, sizeof(*given))) == NULL) {
		PyErr_NoMemory();
		goto out;
	}
	if ((pr = batch_pairs(s, a[0], n, 3, more, given, "(src, dst[, length[, src_offset, dst_offset]])")) == NULL)
		goto out;
	for (Py_ssize_t i = 0; i < n; i++) {
		if (given[i] == 2) {
			PyErr_Format(PyExc_TypeError, "pair %zd: give both offsets, or neither", i);
			goto out;
		}
		/* Each pair's own segment; its offsets ride in the pair. */
		segs[i] = (struct gpx_seg){ 0, 0, more[i][0] };
		pr[i].src_offset = more[i][1];
		pr[i].dst_offset = more[i][2];
		pr[i].seg_first = (uint32_t)i;
		pr[i].seg_count = 1;
	}
	if ((t = transfer_start(s, a[1])) == NULL)
		goto out;
	PyThreadState *ts = conn_lock_quick(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy_batch(s->c, pr, n, segs, n, t->tag) : -GPX_ECONN);
	conn_unlock(s, ts);
	if (cr.r < 0) {
		transfer_abort(t, &cr);
		t = NULL;
	}
out:
	free(more);
	free(given);
	free(segs);
	free(pr);
	return (PyObject *)t;
}

/*
 * copy_pages_batch(pairs, page_size, src_pages, dst_pages, *, tag=None): the same pages of
 * every pair, each pair a tuple (src, dst) or (src, dst, src_offset, dst_offset).
 */
PyObject *
transfer_copy_pages_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy_pages_batch", 4, 4,
		{ "pairs", "page_size", "src_pages", "dst_pages", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[5];
	struct gpx_pair *pr = NULL;
	uint64_t (*more)[3] = NULL, psize;
	int *given = NULL;
	struct pagelist sp = { 0 }, dp = { 0 };
	bool have_sp = false, have_dp = false;
	struct callres cr;
	Transfer *t = NULL;
	Py_ssize_t n;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    gpxpy_u64(a[1], "page_size", &psize) < 0 || (n = PySequence_Size(a[0])) < 0)
		return NULL;
	if (psize == 0) {
		PyErr_SetString(PyExc_ValueError, "page_size must be at least 1");
		return NULL;
	}
	if ((more = calloc(n ? n : 1, sizeof(*more))) == NULL || (given = calloc(n ? n : 1, sizeof(*given))) == NULL) {
		PyErr_NoMemory();
		goto out;
	}
	if ((pr = batch_pairs(s, a[0], n, 2, more, given, "(src, dst[, src_offset, dst_offset])")) == NULL)
		goto out;
	for (Py_ssize_t i = 0; i < n; i++) {
		if (given[i] == 1) {
			PyErr_Format(PyExc_TypeError, "pair %zd: give both bases, or neither", i);
			goto out;
		}
		pr[i].src_offset = given[i] ? more[i][0] : 0;
		pr[i].dst_offset = given[i] ? more[i][1] : 0;
	}
	if (!(have_sp = mem_pages(s->st, a[2], "src_pages", &sp) == 0) ||
	    !(have_dp = mem_pages(s->st, a[3], "dst_pages", &dp) == 0))
		goto out;
	if (sp.n != dp.n || sp.n == 0) {
		PyErr_Format(PyExc_ValueError, sp.n ? "src_pages and dst_pages differ in length (%zu, %zu)" :
		    "no pages", sp.n, dp.n);
		goto out;
	}
	if ((t = transfer_start(s, a[4])) == NULL)
		goto out;
	PyThreadState *ts = sp.n > HEAVY_LIST ? conn_lock_slow(s) : conn_lock_quick(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy_pages_batch(s->c, pr, n, psize, sp.pages, dp.pages, sp.n,
	    t->tag) : -GPX_ECONN);
	conn_unlock(s, ts);
	if (cr.r < 0) {
		transfer_abort(t, &cr);
		t = NULL;
	}
out:
	if (have_sp)
		mem_pages_release(&sp);
	if (have_dp)
		mem_pages_release(&dp);
	free(more);
	free(given);
	free(pr);
	return (PyObject *)t;
}

/*
 * _c_bench(src, dst, size, iters, mode): the benchmark's C loops on this connection, the GIL
 * released throughout.  "copy_wait": gpx_copy then gpx_wait for it, iters times; returns each
 * round trip in seconds.  "submit": iters gpx_copy calls in batches of 32, each batch timed and
 * then drained untimed; returns the seconds spent submitting.
 */
PyObject *
transfer_c_bench(PyObject *op, PyObject *args)
{
	Conn *s = (Conn *)op;
	PyObject *a, *b, *out = NULL;
	unsigned long long size, iters;
	const char *mode;
	Region *src, *dst;
	struct callres cr = { 0 };
	double *lat = NULL, total = 0;
	bool copy_wait;

	if (!PyArg_ParseTuple(args, "OOKKs", &a, &b, &size, &iters, &mode) || conn_usable(s) < 0 ||
	    transfer_regions(s, a, b, &src, &dst) < 0)
		return NULL;
	copy_wait = strcmp(mode, "copy_wait") == 0;
	if (!copy_wait && strcmp(mode, "submit") != 0)
		return PyErr_Format(PyExc_ValueError, "mode must be 'copy_wait' or 'submit', not %R", PyTuple_GetItem(args, 4));
	if (s->pending.n > 0 || s->nback > 0) {
		PyErr_SetString(PyExc_RuntimeError, "_c_bench needs a connection with nothing pending");
		return NULL;
	}
	if (copy_wait && iters > 0 && (lat = malloc(iters * sizeof(*lat))) == NULL)
		return PyErr_NoMemory();
	PyThreadState *ts = conn_lock_slow(s);
	struct gpx_completion done[64];
	for (unsigned long long i = 0; s->c != NULL && cr.r >= 0 && i < iters;) {
		double t0 = gpxpy_now();
		if (copy_wait) {
			if (gpxpy_note(&cr, s->c, gpx_copy(s->c, src->id, 0, dst->id, 0, size, TAG_BENCH | i)) < 0 ||
			    gpxpy_note(&cr, s->c, gpx_wait(s->c, done, 1, -1)) < 0)
				break;
			lat[i++] = gpxpy_now() - t0;
			if (done[0].status < 0)
				gpxpy_note(&cr, NULL, done[0].status);
			continue;
		}
		unsigned long long k = iters - i < 32 ? iters - i : 32;
		for (unsigned long long j = 0; j < k && cr.r >= 0; j++)
			gpxpy_note(&cr, s->c, gpx_copy(s->c, src->id, 0, dst->id, 0, size, TAG_BENCH | (i + j)));
		total += gpxpy_now() - t0;
		i += k;
		while (cr.r >= 0 && gpx_outstanding(s->c) > 0) {
			int n = gpxpy_note(&cr, s->c, gpx_wait(s->c, done, 64, -1));
			for (int j = 0; j < n; j++)
				if (done[j].status < 0)
					gpxpy_note(&cr, NULL, done[j].status);
		}
	}
	conn_unlock(s, ts);
	if (cr.r < 0)
		gpxpy_raise_call(s->st, &cr);
	else if (!copy_wait)
		out = PyFloat_FromDouble(total);
	else if ((out = PyList_New((Py_ssize_t)iters)) != NULL)
		for (unsigned long long i = 0; i < iters; i++) {
			PyObject *v = PyFloat_FromDouble(lat[i]);
			if (v == NULL || PyList_SetItem(out, (Py_ssize_t)i, v) < 0) {
				Py_CLEAR(out);
				break;
			}
		}
	free(lat);
	return out;
}
