/*
 * gpx._gpx, regions: Conn.register (memory described by mem.c, handed to gpxd), import_,
 * export and unexport, and the Region object.  What a registration keeps alive (the object, its
 * buffer, its HostBuffer, a DLPack tensor) is held by the Conn, not the Region, until the
 * region is deregistered or the connection closed: a dropped Region stays registered.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client-lib/client.h"
#include "client-lib/python/_gpx.h"

static Region *
region_new(Conn *s, uint64_t id, uint64_t length, const char *kind, bool ro, PyObject *name)
{
	Region *r = (Region *)PyType_GenericAlloc(s->st->region_type, 0);

	if (r == NULL)
		return NULL;
	r->conn = (Conn *)Py_NewRef((PyObject *)s);
	r->id = id;
	r->length = length;
	r->kind = kind;
	r->read_only = ro;
	r->imported = name != NULL;
	r->live = true;
	r->name = Py_XNewRef(name);
	return r;
}

/* Keeps d (moved in) until region goes. */
static int
keep_add(Conn *s, uint64_t region, struct mem_desc *d)
{
	if (s->nkeeps == s->capkeeps) {
		size_t cap = s->capkeeps ? 2 * s->capkeeps : 16;
		struct keep *k = realloc(s->keeps, cap * sizeof(*k));
		if (k == NULL) {
			PyErr_NoMemory();
			return -1;
		}
		s->keeps = k;
		s->capkeeps = cap;
	}
	s->keeps[s->nkeeps++] = (struct keep){ .region = region, .d = *d };
	memset(d, 0, sizeof(*d));
	return 0;
}

static void
keep_drop(Conn *s, uint64_t region)
{
	for (size_t i = 0; i < s->nkeeps; i++)
		if (s->keeps[i].region == region) {
			struct mem_desc d = s->keeps[i].d;
			s->keeps[i] = s->keeps[--s->nkeeps];
			mem_release(&d);
			return;
		}
}

void
region_drop_keeps(Conn *s)
{
	/* Taken first: releasing may run arbitrary code (a DLPack deleter, a __del__). */
	struct keep *k = s->keeps;
	size_t n = s->nkeeps;

	s->keeps = NULL;
	s->nkeeps = s->capkeeps = 0;
	for (size_t i = 0; i < n; i++)
		mem_release(&k[i].d);
	free(k);
}

static PyObject *
region_deregister(PyObject *op, PyObject *unused)
{
	Region *r = (Region *)op;
	Conn *s = r->conn;
	struct callres cr = { 0 };
	PyThreadState *ts;

	if (conn_usable(s) < 0)
		return NULL;
	if (!r->live) {
		PyErr_SetString(PyExc_ValueError, "the region is already deregistered");
		return NULL;
	}
	ts = conn_lock_slow(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_deregister(s->c, r->id) : -GPX_ECONN);
	conn_unlock(s, ts);
	route_after_rpc(s);
	if (cr.r < 0)
		return gpxpy_raise_call(s->st, &cr);
	r->live = false;
	keep_drop(s, r->id);
	Py_RETURN_NONE;
}

static PyObject *
region_enter(PyObject *op, PyObject *unused)
{
	return Py_NewRef(op);
}

static PyObject *
region_exit(PyObject *op, PyObject *args)
{
	Region *r = (Region *)op;

	if (!r->live || r->conn->closed || r->conn->fork_gen != gpxpy_fork_gen)
		Py_RETURN_NONE;
	return region_deregister(op, NULL);
}

static void
region_dealloc(PyObject *op)
{
	Region *r = (Region *)op;
	PyTypeObject *tp = Py_TYPE(op);

	/* Still registered: it stays so (and its object kept) until the connection closes. */
	Py_XDECREF(r->name);
	Py_DECREF(r->conn);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(op);
	Py_DECREF(tp);
}

static PyObject *
region_repr(PyObject *op)
{
	Region *r = (Region *)op;
	char buf[160];

	snprintf(buf, sizeof(buf), "<gpx.Region %#llx %s, %llu bytes%s%s%s>", (unsigned long long)r->id,
	    r->kind, (unsigned long long)r->length, r->read_only ? ", read-only" : "",
	    r->imported ? ", imported" : "", r->live && !r->conn->closed ? "" : ", gone");
	return PyUnicode_FromString(buf);
}

static PyObject *
region_get_id(PyObject *op, void *unused)
{
	return PyLong_FromUnsignedLongLong(((Region *)op)->id);
}

static PyObject *
region_get_length(PyObject *op, void *unused)
{
	return PyLong_FromUnsignedLongLong(((Region *)op)->length);
}

static PyObject *
region_get_kind(PyObject *op, void *unused)
{
	return PyUnicode_FromString(((Region *)op)->kind);
}

static PyObject *
region_get_read_only(PyObject *op, void *unused)
{
	return PyBool_FromLong(((Region *)op)->read_only);
}

static PyObject *
region_get_imported(PyObject *op, void *unused)
{
	return PyBool_FromLong(((Region *)op)->imported);
}

static PyObject *
region_get_live(PyObject *op, void *unused)
{
	Region *r = (Region *)op;

	return PyBool_FromLong(r->live && !r->conn->closed);
}

static PyObject *
region_get_name(PyObject *op, void *unused)
{
	Region *r = (Region *)op;

	return Py_NewRef(r->name != NULL ? r->name : Py_None);
}

static PyObject *
region_get_conn(PyObject *op, void *unused)
{
	return Py_NewRef((PyObject *)((Region *)op)->conn);
}

static PyMethodDef region_methods[] = {
	{ "deregister", region_deregister, METH_NOARGS,
	  "deregister()\n--\n\nHands the region back to gpxd (the GIL released) and lets go of the "
	  "object it kept alive.  Copies that use it must have completed." },
	{ "__enter__", region_enter, METH_NOARGS, "Returns the region itself." },
	{ "__exit__", region_exit, METH_VARARGS, "Deregisters the region, if it still is." },
	{ NULL }
};

static PyGetSetDef region_getset[] = {
	{ "id", region_get_id, NULL, "The region id gpxd gave (scoped to its connection).", NULL },
	{ "length", region_get_length, NULL, "Its length in bytes.", NULL },
	{ "kind", region_get_kind, NULL, "'host', 'cuda-ipc', 'cuda-vmm', 'cuda-pool' or 'remote', as gpxd "
	  "holds it.", NULL },
	{ "read_only", region_get_read_only, NULL, "Whether it may only be a source.", NULL },
	{ "imported", region_get_imported, NULL, "Whether it came from import_() (another's export).", NULL },
	{ "live", region_get_live, NULL, "Whether it is still registered on an open connection.", NULL },
	{ "name", region_get_name, NULL, "The export it was imported from, or None.", NULL },
	{ "conn", region_get_conn, NULL, "The Conn it belongs to.", NULL },
	{ NULL }
};

static PyType_Slot region_slots[] = {
	{ Py_tp_doc, "Region: memory gpxd holds for a connection, from Conn.register() or Conn.import_(); "
	  "the source or destination of copies.\n\nA registered region keeps its object (tensor, array, "
	  "HostBuffer) alive until deregister() or until the connection closes.  As a context manager "
	  "it deregisters on exit." },
	{ Py_tp_dealloc, region_dealloc },
	{ Py_tp_repr, region_repr },
	{ Py_tp_methods, region_methods },
	{ Py_tp_getset, region_getset },
	{ 0, NULL }
};

PyType_Spec region_spec = {
	.name = "gpx.Region",
	.basicsize = sizeof(Region),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = region_slots,
};

PyObject *
region_register(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "register", 1, 1, { "obj", "read_only", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[2];
	struct mem_desc d;
	struct callres cr;
	const char *kind = "unknown";
	int ro = 0, kro = 0;
	gpx_region id = 0;
	PyThreadState *ts;
	Region *r;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (a[1] != NULL && (ro = PyObject_IsTrue(a[1])) < 0) || mem_describe(s->st, a[0], ro, &d) < 0)
		return NULL;
	unsigned flags = ro ? GPX_REG_READONLY : 0;
	ts = conn_lock_slow(s);
	if (s->c == NULL)
		gpxpy_note(&cr, NULL, -GPX_ECONN);
	else if (d.cuda)
		gpxpy_note(&cr, s->c, gpx_register_cuda(s->c, d.ptr, d.length, flags, &id));
	else
		gpxpy_note(&cr, s->c, gpx_register_host(s->c, d.hb->fd, d.offset, d.length, flags, &id));
	if (cr.r == 0)
		kind = client_last_region(s->c, &kro);
	conn_unlock(s, ts);
	route_after_rpc(s);
	if (cr.r < 0) {
		mem_release(&d);
		return gpxpy_raise_call(s->st, &cr);
	}
	/* Registered: kept from here on, even should the Region object fail to come. */
	uint64_t len = d.length;
	if (keep_add(s, id, &d) < 0) {
		/* Out of memory: gpxd lets go of the region before its object may go. */
		ts = conn_lock_slow(s);
		if (s->c != NULL)
			(void)gpx_deregister(s->c, id);
		conn_unlock(s, ts);
		mem_release(&d);
		return NULL;
	}
	r = region_new(s, id, len, kind, kro, NULL);
	return (PyObject *)r;
}

PyObject *
region_import(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "import_", 1, 1, { "name", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[1];
	const char *name, *kind = "unknown";
	struct callres cr;
	gpx_region id = 0;
	uint64_t len = 0;
	int kro = 0;
	PyThreadState *ts;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (name = gpxpy_str(a[0], "name")) == NULL)
		return NULL;
	ts = conn_lock_slow(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_import(s->c, name, &id, &len) : -GPX_ECONN);
	if (cr.r == 0)
		kind = client_last_region(s->c, &kro);
	conn_unlock(s, ts);
	route_after_rpc(s);
	if (cr.r < 0)
		return gpxpy_raise_call(s->st, &cr);
	return (PyObject *)region_new(s, id, len, kind, kro, a[0]);
}

/* export()'s peers as the library's comma-separated list; *all: any peer (returns NULL then too). */
static PyObject *
peers_list(PyObject *peers, bool *all)
{
	PyObject *comma, *joined;

	*all = false;
	if (peers == Py_True || (PyUnicode_Check(peers) && PyUnicode_CompareWithASCIIString(peers, "*") == 0)) {
		*all = true;
		return NULL;
	}
	if (PyUnicode_Check(peers))
		return Py_NewRef(peers);
	if ((comma = PyUnicode_FromString(",")) == NULL)
		return NULL;
	joined = PyUnicode_Join(comma, peers);
	Py_DECREF(comma);
	return joined;
}

PyObject *
region_export(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "export", 2, 2,
		{ "region", "name", "rule", "gid", "read_only", "notify", "peers", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[7], *plist = NULL;
	struct gpx_export_opts o = { .rule = GPX_EXPORT_UID };
	const char *name, *rule = "uid", *peers = NULL;
	struct callres cr;
	PyThreadState *ts;
	bool remote, all = false;
	uint64_t gid = getegid();
	Region *r;
	int v;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0)
		return NULL;
	remote = a[6] != NULL && a[6] != Py_None;
	if (!Py_IS_TYPE(a[0], s->st->region_type) || ((Region *)a[0])->conn != s) {
		PyErr_SetString(PyExc_TypeError, "region must be a gpx.Region of this connection");
		return NULL;
	}
	r = (Region *)a[0];
	if ((name = gpxpy_str(a[1], "name")) == NULL || (a[2] != NULL && (rule = gpxpy_str(a[2], "rule")) == NULL))
		return NULL;
	if (strcmp(rule, "uid") == 0)
		o.rule = GPX_EXPORT_UID;
	else if (strcmp(rule, "gid") == 0)
		o.rule = GPX_EXPORT_GID;
	else if (strcmp(rule, "any") == 0)
		o.rule = GPX_EXPORT_ANY;
	else {
		PyErr_Format(PyExc_ValueError, "rule must be 'uid', 'gid' or 'any', not %R", a[2]);
		return NULL;
	}
	if (a[3] != NULL && a[3] != Py_None && gpxpy_u64(a[3], "gid", &gid) < 0)
		return NULL;
	if (gid > UINT32_MAX) {
		PyErr_SetString(PyExc_ValueError, "gid out of range");
		return NULL;
	}
	o.gid = (uint32_t)gid;
	if (a[4] != NULL && (v = PyObject_IsTrue(a[4])) != 0) {
		if (v < 0)
			return NULL;
		o.read_only = 1;
	}
	/* notify: True (notifications carry the region's id as their tag) or a tag of one's own. */
	if (a[5] != NULL && a[5] != Py_False && a[5] != Py_None) {
		o.notify = 1;
		o.notify_tag = r->id;
		if (a[5] != Py_True && gpxpy_u64(a[5], "notify", &o.notify_tag) < 0)
			return NULL;
	}
	if (remote) {
		if ((plist = peers_list(a[6], &all)) == NULL && !all)
			return NULL;
		if (plist != NULL && (peers = gpxpy_str(plist, "peers")) == NULL) {
			Py_DECREF(plist);
			return NULL;
		}
	}
	ts = conn_lock_slow(s);
	if (s->c == NULL)
		gpxpy_note(&cr, NULL, -GPX_ECONN);
	else if (remote)
		gpxpy_note(&cr, s->c, gpx_export_remote(s->c, r->id, name, &o, peers));
	else
		gpxpy_note(&cr, s->c, gpx_export(s->c, r->id, name, &o));
	conn_unlock(s, ts);
	route_after_rpc(s);
	Py_XDECREF(plist);
	if (cr.r < 0)
		return gpxpy_raise_call(s->st, &cr);
	Py_RETURN_NONE;
}

PyObject *
region_unexport(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "unexport", 1, 1, { "name", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[1];
	const char *name;
	struct callres cr;
	PyThreadState *ts;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (name = gpxpy_str(a[0], "name")) == NULL)
		return NULL;
	ts = conn_lock_slow(s);
	gpxpy_note(&cr, s->c, s->c != NULL ? gpx_unexport(s->c, name) : -GPX_ECONN);
	conn_unlock(s, ts);
	route_after_rpc(s);
	if (cr.r < 0)
		return gpxpy_raise_call(s->st, &cr);
	Py_RETURN_NONE;
}
