/*
 * gpx._gpx, submitting transfers: Conn.copy, copyv, copy_pages, copy_pages_table, copy_batch,
 * copy_pages_batch and copy_pages_batch_table check their arguments (regions of this connection, offsets, segment and
 * page lists read in place), submit through libgpxclient with the GIL released for long lists,
 * and hand back a Transfer.  A batch's pairs may be parsed once into a gpx.Batch (Conn.batch)
 * and submitted many times.  Also the benchmark's C loops (Conn._c_bench), which measure the
 * library under the module without Python in the loop.
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>

#include "client-lib/python/_gpx.h"

#define INLINE_SEGS 64               /* up to this many segments travel inside the request */

/* The argument `name` as a Region of s that is still registered. */
static int
region_arg(Conn *s, PyObject *o, const char *name, Region **out)
{
	if (!Py_IS_TYPE(o, s->st->region_type)) {
		PyErr_Format(PyExc_TypeError, "%s must be a gpx.Region (from register() or import_()), not %s", name,
		    TNAME(o));
		return -1;
	}
	*out = (Region *)o;
	if ((*out)->conn != s) {
		PyErr_Format(PyExc_ValueError, "%s is a region of another connection", name);
		return -1;
	}
	if (!(*out)->live) {
		PyErr_Format(PyExc_ValueError, "%s was deregistered", name);
		return -1;
	}
	return 0;
}

/* src and dst as Regions of s that are still registered. */
static int
transfer_regions(Conn *s, PyObject *a, PyObject *b, Region **src, Region **dst)
{
	return region_arg(s, a, "src", src) < 0 || region_arg(s, b, "dst", dst) < 0 ? -1 : 0;
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

PyObject *
transfer_copy_pages_table(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy_pages_table", 5, 5,
		{ "src", "dst", "page_size", "table", "n", "table_offset", "src_offset", "dst_offset", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[9];
	Region *src, *dst, *tab;
	uint64_t psize, n, toff = 0, soff = 0, doff = 0;
	struct callres cr;
	PyThreadState *ts;
	Transfer *t;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    transfer_regions(s, a[0], a[1], &src, &dst) < 0 || gpxpy_u64(a[2], "page_size", &psize) < 0 ||
	    gpxpy_u64(a[4], "n", &n) < 0 || (a[5] != NULL && gpxpy_u64(a[5], "table_offset", &toff) < 0) ||
	    (a[6] != NULL && gpxpy_u64(a[6], "src_offset", &soff) < 0) ||
	    (a[7] != NULL && gpxpy_u64(a[7], "dst_offset", &doff) < 0))
		return NULL;
	if (region_arg(s, a[3], "table", &tab) < 0)
		return NULL;
	if (psize == 0 || n == 0) {
		PyErr_SetString(PyExc_ValueError, psize == 0 ? "page_size must be at least 1" : "no pages");
		return NULL;
	}
	if ((t = transfer_start(s, a[8])) == NULL)
		return NULL;
	ts = conn_lock_quick(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy_pages_table(s->c, src->id, soff, dst->id, doff, psize, tab->id,
	    toff, n, t->tag) : -GPX_ECONN);
	conn_unlock(s, ts);
	if (cr.r < 0)
		return transfer_abort(t, &cr);
	return (PyObject *)t;
}

/*
 * The pairs of a batch from a sequence of tuples (src, dst[, ...]): each tuple's two regions
 * (in regs[2i], regs[2i + 1] when regs is not NULL, borrowed) and the 0..nmore unsigned
 * numbers after them, in more[i] (more[i][0] is src's length unless given) with their count in
 * given[i].  A malloc'ed array of *n pairs, or NULL with the exception set.
 */
static struct gpx_pair *
batch_pairs(Conn *s, PyObject *seq, Py_ssize_t n, int nmore, uint64_t (*more)[3], int *given, Region **regs,
    const char *shape)
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
			if (regs != NULL) {
				regs[2 * i] = src;
				regs[2 * i + 1] = dst;
			}
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
 * The pairs of a batch into *pr (malloc'ed, n), or -1 with the exception set.  copy_batch's
 * (pages false), each one segment of its own in *segs (malloc'ed, n): a tuple (src, dst)
 * copies the whole of src to the start of dst, (src, dst, length) that many bytes, (src, dst,
 * length, src_offset, dst_offset) from and to those offsets.  copy_pages_batch's, each a tuple
 * (src, dst) or (src, dst, src_offset, dst_offset): the bases its pages are numbered from.
 */
static int
parse_batch(Conn *s, PyObject *seq, Py_ssize_t n, bool pages, struct gpx_pair **pr, struct gpx_seg **segs,
    Region **regs)
{
	uint64_t (*more)[3] = calloc(n ? n : 1, sizeof(*more));
	int *given = calloc(n ? n : 1, sizeof(*given));
	int r = -1;

	*pr = NULL;
	if (!pages)
		*segs = calloc(n ? n : 1, sizeof(**segs));
	if (more == NULL || given == NULL || (!pages && *segs == NULL)) {
		PyErr_NoMemory();
		goto out;
	}
	if ((*pr = batch_pairs(s, seq, n, pages ? 2 : 3, more, given, regs, pages ?
	    "(src, dst[, src_offset, dst_offset])" : "(src, dst[, length[, src_offset, dst_offset]])")) == NULL)
		goto out;
	for (Py_ssize_t i = 0; i < n; i++) {
		if (given[i] == (pages ? 1 : 2)) {
			PyErr_Format(PyExc_TypeError, "pair %zd: give both %s, or neither", i, pages ? "bases" : "offsets");
			goto out;
		}
		if (pages) {
			(*pr)[i].src_offset = given[i] ? more[i][0] : 0;
			(*pr)[i].dst_offset = given[i] ? more[i][1] : 0;
			continue;
		}
		/* Each pair's own segment; its offsets ride in the pair. */
		(*segs)[i] = (struct gpx_seg){ 0, 0, more[i][0] };
		(*pr)[i].src_offset = more[i][1];
		(*pr)[i].dst_offset = more[i][2];
		(*pr)[i].seg_first = (uint32_t)i;
		(*pr)[i].seg_count = 1;
	}
	r = 0;
out:
	if (r < 0) {
		free(*pr);
		*pr = NULL;
		if (!pages) {
			free(*segs);
			*segs = NULL;
		}
	}
	free(more);
	free(given);
	return r;
}

/*
 * gpx.Batch: the pairs of copy_batch or copy_pages_batch parsed once (Conn.batch), for a
 * program that moves the same tensors again and again, as a weight push does: submitting one
 * writes its pairs as they are, and checks no more than that its regions are still registered.
 */
typedef struct batch {
	PyObject_HEAD
	Conn *conn;
	bool pages;                  /* for copy_pages_batch */
	Py_ssize_t n;
	struct gpx_pair *pr;
	struct gpx_seg *segs;        /* copy_batch's: one per pair */
	Region **regs;               /* the 2n regions of the pairs, references */
} Batch;

static void
batch_dealloc(PyObject *op)
{
	Batch *b = (Batch *)op;
	PyTypeObject *tp = Py_TYPE(op);

	for (Py_ssize_t i = 0; b->regs != NULL && i < 2 * b->n; i++)
		Py_XDECREF((PyObject *)b->regs[i]);
	free(b->regs);
	free(b->pr);
	free(b->segs);
	Py_XDECREF((PyObject *)b->conn);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(op);
	Py_DECREF(tp);
}

static Py_ssize_t
batch_len(PyObject *op)
{
	return ((Batch *)op)->n;
}

static PyObject *
batch_repr(PyObject *op)
{
	Batch *b = (Batch *)op;

	return PyUnicode_FromFormat("<gpx.Batch of %zd pairs, for %s>", b->n,
	    b->pages ? "copy_pages_batch" : "copy_batch");
}

static PyObject *
batch_get_pages(PyObject *op, void *unused)
{
	return PyBool_FromLong(((Batch *)op)->pages);
}

static PyGetSetDef batch_getset[] = {
	{ "pages", batch_get_pages, NULL, "Whether it is for copy_pages_batch (else copy_batch).", NULL },
	{ NULL }
};

static PyType_Slot batch_slots[] = {
	{ Py_tp_doc, "Batch: the region pairs of copy_batch or copy_pages_batch, parsed once by "
	  "Conn.batch(); pass it in place of the pairs, as often as wanted.  It keeps its regions' "
	  "objects; a pair whose region was deregistered since is refused when submitted." },
	{ Py_tp_dealloc, batch_dealloc },
	{ Py_tp_repr, batch_repr },
	{ Py_sq_length, batch_len },
	{ Py_tp_getset, batch_getset },
	{ 0, NULL }
};

PyType_Spec batch_spec = {
	.name = "gpx.Batch",
	.basicsize = sizeof(Batch),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = batch_slots,
};

/* batch(pairs, *, pages=False) -> Batch */
PyObject *
transfer_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "batch", 1, 1, { "pairs", "pages", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[2];
	Batch *b;
	Py_ssize_t n;
	int pages = 0;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (a[1] != NULL && (pages = PyObject_IsTrue(a[1])) < 0) || (n = PySequence_Size(a[0])) < 0)
		return NULL;
	if ((b = (Batch *)PyType_GenericAlloc(s->st->batch_type, 0)) == NULL)
		return NULL;
	b->conn = (Conn *)Py_NewRef((PyObject *)s);
	b->pages = pages;
	if ((b->regs = calloc(n ? 2 * n : 1, sizeof(*b->regs))) == NULL) {
		Py_DECREF(b);
		return PyErr_NoMemory();
	}
	if (parse_batch(s, a[0], n, pages, &b->pr, &b->segs, b->regs) < 0) {
		memset(b->regs, 0, 2 * n * sizeof(*b->regs));       /* (borrowed until now) */
		Py_DECREF(b);
		return NULL;
	}
	b->n = n;
	for (Py_ssize_t i = 0; i < 2 * n; i++)
		Py_INCREF((PyObject *)b->regs[i]);
	return (PyObject *)b;
}

/* The pairs copy_batch (pages false) or copy_pages_batch is given: a Batch's, or parsed now (own). */
struct pairs_arg {
	const struct gpx_pair *pr;
	const struct gpx_seg *segs;  /* copy_batch's */
	Py_ssize_t n;
	struct gpx_pair *own_pr;     /* what was parsed, freed by pairs_release */
	struct gpx_seg *own_segs;
};

/*
 * A Batch is used as it is when it is one of s's of that kind whose regions are all still
 * registered; a sequence is parsed.  0, or -1 with the exception set.
 */
static int
pairs_take(Conn *s, PyObject *o, bool pages, struct pairs_arg *pa)
{
	const Batch *b = (const Batch *)o;

	*pa = (struct pairs_arg){ 0 };
	if (!Py_IS_TYPE(o, s->st->batch_type)) {
		if ((pa->n = PySequence_Size(o)) < 0 ||
		    parse_batch(s, o, pa->n, pages, &pa->own_pr, pages ? NULL : &pa->own_segs, NULL) < 0)
			return -1;
		pa->pr = pa->own_pr;
		pa->segs = pa->own_segs;
		return 0;
	}
	if (b->conn != s) {
		PyErr_SetString(PyExc_ValueError, "the Batch is of another connection");
		return -1;
	}
	if (b->pages != pages) {
		PyErr_Format(PyExc_TypeError, "the Batch was made for %s (Conn.batch(pairs, pages=%s))",
		    b->pages ? "copy_pages_batch" : "copy_batch", b->pages ? "True" : "False");
		return -1;
	}
	for (Py_ssize_t i = 0; i < 2 * b->n; i++)
		if (!b->regs[i]->live) {
			PyErr_Format(PyExc_ValueError, "pair %zd: %s was deregistered", i / 2, i % 2 ? "dst" : "src");
			return -1;
		}
	pa->pr = b->pr;
	pa->segs = b->segs;
	pa->n = b->n;
	return 0;
}

static void
pairs_release(struct pairs_arg *pa)
{
	free(pa->own_pr);
	free(pa->own_segs);
}

/* copy_batch(pairs, *, tag=None): one request of many region pairs, each one segment. */
PyObject *
transfer_copy_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy_batch", 1, 1, { "pairs", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[2];
	struct pairs_arg pa;
	struct callres cr;
	Transfer *t = NULL;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 || pairs_take(s, a[0], false, &pa) < 0)
		return NULL;
	if ((t = transfer_start(s, a[1])) == NULL)
		goto out;
	PyThreadState *ts = conn_lock_quick(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy_batch(s->c, pa.pr, pa.n, pa.segs, pa.n, t->tag) : -GPX_ECONN);
	conn_unlock(s, ts);
	if (cr.r < 0) {
		transfer_abort(t, &cr);
		t = NULL;
	}
out:
	pairs_release(&pa);
	return (PyObject *)t;
}

/*
 * copy_pages_batch(pairs, page_size, src_pages, dst_pages, *, tag=None): the same pages of
 * every pair.
 */
PyObject *
transfer_copy_pages_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy_pages_batch", 4, 4,
		{ "pairs", "page_size", "src_pages", "dst_pages", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[5];
	struct pairs_arg pa;
	uint64_t psize;
	struct pagelist sp = { 0 }, dp = { 0 };
	bool have_sp = false, have_dp = false;
	struct callres cr;
	Transfer *t = NULL;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    gpxpy_u64(a[1], "page_size", &psize) < 0)
		return NULL;
	if (psize == 0) {
		PyErr_SetString(PyExc_ValueError, "page_size must be at least 1");
		return NULL;
	}
	if (pairs_take(s, a[0], true, &pa) < 0)
		return NULL;
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
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy_pages_batch(s->c, pa.pr, pa.n, psize, sp.pages, dp.pages, sp.n,
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
	pairs_release(&pa);
	return (PyObject *)t;
}

PyObject *
transfer_copy_pages_batch_table(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "copy_pages_batch_table", 4, 4,
		{ "pairs", "page_size", "table", "n", "table_offset", "tag", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[6];
	struct pairs_arg pa;
	uint64_t psize, n, toff = 0;
	Region *tab;
	struct callres cr;
	Transfer *t = NULL;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    gpxpy_u64(a[1], "page_size", &psize) < 0 || region_arg(s, a[2], "table", &tab) < 0 ||
	    gpxpy_u64(a[3], "n", &n) < 0 || (a[4] != NULL && gpxpy_u64(a[4], "table_offset", &toff) < 0))
		return NULL;
	if (psize == 0 || n == 0) {
		PyErr_SetString(PyExc_ValueError, psize == 0 ? "page_size must be at least 1" : "no pages");
		return NULL;
	}
	if (pairs_take(s, a[0], true, &pa) < 0)
		return NULL;
	if ((t = transfer_start(s, a[5])) != NULL) {
		PyThreadState *ts = conn_lock_quick(s);
		gpxpy_note(&cr, s->c, s->c != NULL ? gpx_copy_pages_batch_table(s->c, pa.pr, pa.n, psize, tab->id, toff, n,
		    t->tag) : -GPX_ECONN);
		conn_unlock(s, ts);
		if (cr.r < 0) {
			transfer_abort(t, &cr);
			t = NULL;
		}
	}
	pairs_release(&pa);
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
