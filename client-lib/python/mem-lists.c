/*
 * gpx._gpx, segment and page lists: what Conn.copyv, copy_pages and the batches take, segment
 * lists ((n, 3) 64-bit integers) and page lists (4-byte integers), read in place through the
 * buffer protocol (or a CPU tensor's data pointer, mem_int_tensor), or converted from Python
 * sequences.
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>

#include "client-lib/python/_gpx.h"

/* ---- segment and page lists ---- */

/* Whether a buffer's format is an integer of `size` bytes in native order; *is_signed. */
static bool
int_format(const char *f, size_t size, bool *is_signed)
{
	if (f == NULL)
		f = "B";
	if (*f == '@' || *f == '=' || (*f == '<' && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__))
		f++;
	if (f[0] == '\0' || f[1] != '\0')
		return false;
	switch (f[0]) {
	case 'b': case 'h': case 'i': case 'l': case 'q':
		*is_signed = true;
		break;
	case 'B': case 'H': case 'I': case 'L': case 'Q':
		*is_signed = false;
		break;
	default:
		return false;
	}
	switch (f[0]) {
	case 'b': case 'B': return size == 1;
	case 'h': case 'H': return size == sizeof(short);
	case 'i': case 'I': return size == sizeof(int);
	case 'l': case 'L': return size == sizeof(long);
	default: return size == sizeof(long long);
	}
}

/*
 * Integers of `size` bytes in place: a C-contiguous buffer of such items (any shape), or a
 * CPU tensor.  1 when found (view filled or *keep set), 0 if obj is neither, -1 on error.
 */
static int
ints_in_place(struct modstate *st, PyObject *obj, const char *what, size_t size, Py_buffer *view,
    bool *has_view, PyObject **keep, const void **p, size_t *items, bool *is_signed)
{
	int r;

	if (PyObject_CheckBuffer(obj)) {
		if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
			if (PyErr_ExceptionMatches(PyExc_BufferError)) {
				PyErr_Clear();
				PyErr_Format(PyExc_ValueError, "%s must be C-contiguous", what);
			}
			return -1;
		}
		*has_view = true;
		if (!int_format(view->format, (size_t)view->itemsize, is_signed) || (size_t)view->itemsize != size) {
			PyErr_Format(PyExc_TypeError, "%s must hold %zu-byte integers (buffer format '%s')", what,
			    size, view->format ? view->format : "B");
			return -1;
		}
		*p = view->buf;
		*items = (size_t)view->len / size;
		return 1;
	}
	if ((r = mem_int_tensor(st, obj, what, size, p, items, is_signed)) > 0)
		*keep = Py_NewRef(obj);
	return r;
}

/* One segment of a sequence: a sequence of three non-negative ints. */
static int
seg_from_seq(PyObject *item, size_t i, struct gpx_seg *s)
{
	uint64_t v[3];

	if (!PySequence_Check(item) || PySequence_Size(item) != 3) {
		if (!PyErr_Occurred())
			PyErr_Format(PyExc_TypeError, "segments[%zu] must be (src_offset, dst_offset, length)", i);
		return -1;
	}
	for (int k = 0; k < 3; k++) {
		PyObject *x = PySequence_GetItem(item, k);
		int e;
		if (x == NULL)
			return -1;
		e = gpxpy_u64(x, "a segment's offsets and length", &v[k]);
		Py_DECREF(x);
		if (e < 0)
			return -1;
	}
	*s = (struct gpx_seg){ v[0], v[1], v[2] };
	return 0;
}

int
mem_segments(struct modstate *st, PyObject *obj, struct seglist *l)
{
	const void *p;
	size_t items;
	PyObject *keep = NULL;
	int r;

	memset(l, 0, sizeof(*l));
	r = ints_in_place(st, obj, "segments", 8, &l->view, &l->has_view, &keep, &p, &items, &l->is_signed);
	Py_XDECREF(keep);  /* a CPU tensor: the caller's reference keeps it for the call */
	if (r < 0)
		goto fail;
	if (r > 0) {
		if (items % 3 != 0 || (l->has_view && l->view.ndim == 2 && l->view.shape[1] != 3)) {
			PyErr_SetString(PyExc_ValueError, "segments must be an (n, 3) array: rows of "
			    "(src_offset, dst_offset, length)");
			goto fail;
		}
		l->segs = p;
		l->n = items / 3;
	} else {
		/* A sequence of (src_offset, dst_offset, length). */
		Py_ssize_t n = PySequence_Check(obj) ? PySequence_Size(obj) : -1;
		if (n < 0) {
			if (!PyErr_Occurred())
				PyErr_Format(PyExc_TypeError, "segments must be an (n, 3) uint64 array or a "
				    "sequence of (src_offset, dst_offset, length), not %s", TNAME(obj));
			goto fail;
		}
		struct gpx_seg *s = l->own = malloc((n ? n : 1) * sizeof(*s));
		if (s == NULL) {
			PyErr_NoMemory();
			goto fail;
		}
		for (Py_ssize_t i = 0; i < n; i++) {
			PyObject *item = PySequence_GetItem(obj, i);
			int e = item ? seg_from_seq(item, (size_t)i, &s[i]) : -1;
			Py_XDECREF(item);
			if (e < 0)
				goto fail;
		}
		l->segs = s;
		l->n = (size_t)n;
	}
	if (l->n == 0) {
		PyErr_SetString(PyExc_ValueError, "no segments");
		goto fail;
	}
	return 0;
fail:
	mem_segments_release(l);
	return -1;
}

void
mem_segments_release(struct seglist *l)
{
	if (l->has_view)
		PyBuffer_Release(&l->view);
	l->has_view = false;
	free(l->own);
	l->own = NULL;
}

int
mem_pages(struct modstate *st, PyObject *obj, const char *what, struct pagelist *l)
{
	const void *p;
	size_t items;
	bool sgn = false;
	int r;

	memset(l, 0, sizeof(*l));
	r = ints_in_place(st, obj, what, 4, &l->view, &l->has_view, &l->keep, &p, &items, &sgn);
	if (r < 0)
		goto fail;
	if (r > 0) {
		l->pages = p;
		l->n = items;
		if (sgn) {
			/* Negative block numbers are refused, not taken as huge ones. */
			const int32_t *s = p;
			int32_t lo = 0;
			for (size_t i = 0; i < items; i++)
				lo = s[i] < lo ? s[i] : lo;
			if (lo < 0) {
				PyErr_Format(PyExc_ValueError, "%s holds a negative page number (%d)", what, (int)lo);
				goto fail;
			}
		}
		return 0;
	}
	Py_ssize_t n = PySequence_Check(obj) ? PySequence_Size(obj) : -1;
	if (n < 0) {
		if (!PyErr_Occurred())
			PyErr_Format(PyExc_TypeError, "%s must be an int32/uint32 array, a CPU tensor of them, "
			    "or a sequence of ints, not %s", what, TNAME(obj));
		goto fail;
	}
	uint32_t *u = l->own = malloc((n ? n : 1) * sizeof(*u));
	if (u == NULL) {
		PyErr_NoMemory();
		goto fail;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *x = PySequence_GetItem(obj, i);
		uint64_t v;
		int e = x ? gpxpy_u64(x, "a page number", &v) : -1;
		Py_XDECREF(x);
		if (e < 0)
			goto fail;
		if (v > UINT32_MAX) {
			PyErr_Format(PyExc_ValueError, "%s[%zd] does not fit 32 bits", what, i);
			goto fail;
		}
		u[i] = (uint32_t)v;
	}
	l->pages = u;
	l->n = (size_t)n;
	return 0;
fail:
	mem_pages_release(l);
	return -1;
}

void
mem_pages_release(struct pagelist *l)
{
	if (l->has_view)
		PyBuffer_Release(&l->view);
	l->has_view = false;
	Py_CLEAR(l->keep);
	free(l->own);
	l->own = NULL;
}
