/*
 * gpx._gpx, the connection: gpx.connect() makes a Conn; its methods, each handed to the file
 * that does the job (region.c, transfer-submit.c, route.c); closing it (cancel what is
 * pending, wait for gpxd to report it, close, only then let go of the registered objects).
 * Its lock, and the refusal of every call in a child of fork(), are conn-lock.c's.
 */
#include "config.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>

#include "client-lib/client.h"
#include "client-lib/python/_gpx.h"
#include "proto/wire.h"

#define CLOSE_DRAIN_S 10.0           /* how long close() waits for cancelled transfers */

/*
 * Closes s: cancels every transfer not yet complete and waits (bounded) until gpxd reported
 * each, closes the connection once no thread watches its fd, resolves what is left with
 * ConnectionLostError, and only then lets go of the registered objects.  In a child of
 * fork(), only closes the child's copies of the descriptors.
 */
static void
conn_close(Conn *s)
{
	PyObject *r;

	if (s->closed)
		return;
	s->closed = true;
	if (s->fork_gen != gpxpy_fork_gen) {
		gpx_close(s->c);
		s->c = NULL;
		if (s->wakefd >= 0)
			close(s->wakefd);
		s->wakefd = -1;
		route_resolve_all(s, -GPX_ECONN, "the connection belongs to the parent process");
		route_backlog_clear(s);
		region_drop_keeps(s);
		return;
	}
	if (s->aio != NULL) {
		if ((r = PyObject_CallMethodObjArgs(s->aio, s->st->s_close, NULL)) == NULL)
			PyErr_WriteUnraisable(s->aio);
		Py_XDECREF(r);
	}
	if (s->c != NULL && s->pending.n > 0) {
		uint64_t *tags = malloc(s->pending.n * sizeof(*tags));
		size_t n = 0;
		for (size_t i = 0; tags != NULL && i < s->pending.cap; i++)
			if (s->pending.s[i].used)
				tags[n++] = s->pending.s[i].tag;
		PyThreadState *ts = conn_lock_slow(s);
		for (size_t i = 0; s->c != NULL && i < n; i++)
			(void)gpx_cancel(s->c, tags[i]);
		conn_unlock(s, ts);
		free(tags);
		if (route_wait_until(s, route_pred_none_pending, NULL, CLOSE_DRAIN_S, false) <= 0)
			PyErr_Clear();
	}
	size_t unreported = s->pending.n;
	Py_BEGIN_ALLOW_THREADS
	pthread_mutex_lock(&s->mu);
	__atomic_store_n(&s->gen, s->gen + 1, __ATOMIC_RELAXED);
	if (s->sleeping) {
		uint64_t one = 1;
		(void)!write(s->wakefd, &one, sizeof(one));
	}
	pthread_cond_broadcast(&s->cv);
	while (s->sleeping)
		pthread_cond_wait(&s->cv, &s->mu);
	gpx_close(s->c);
	s->c = NULL;
	close(s->wakefd);
	s->wakefd = -1;
	pthread_mutex_unlock(&s->mu);
	Py_END_ALLOW_THREADS
	route_resolve_all(s, -GPX_ECONN, "the connection was closed before the transfer completed");
	route_backlog_clear(s);
	region_drop_keeps(s);
	if (unreported > 0 && PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "gpx: closed with %zu transfer(s) "
	    "that gpxd had not reported after %g s", unreported, CLOSE_DRAIN_S) < 0)
		PyErr_WriteUnraisable((PyObject *)s);
}

static PyObject *
conn_close_m(PyObject *op, PyObject *unused)
{
	conn_close((Conn *)op);
	Py_RETURN_NONE;
}

static PyObject *
conn_enter(PyObject *op, PyObject *unused)
{
	if (conn_usable((Conn *)op) < 0)
		return NULL;
	return Py_NewRef(op);
}

static PyObject *
conn_exit(PyObject *op, PyObject *args)
{
	conn_close((Conn *)op);
	Py_RETURN_NONE;
}

static void
conn_dealloc(PyObject *op)
{
	Conn *s = (Conn *)op;
	PyTypeObject *tp = Py_TYPE(op);
	PyObject *et, *ev, *tb;

	PyErr_Fetch(&et, &ev, &tb);
	if (s->c != NULL)
		conn_close(s);
	if (s->wakefd >= 0)
		close(s->wakefd);
	for (size_t i = 0; i < s->nreasons; i++)
		free(s->reasons[i].text);
	free(s->reasons);
	free(s->pending.s);
	free(s->back);
	free(s->keeps);
	/* A child of fork() may have copied them locked: left alone there. */
	if (s->sync_made && s->fork_gen == gpxpy_fork_gen) {
		pthread_cond_destroy(&s->cv);
		pthread_mutex_destroy(&s->mu);
	}
	Py_XDECREF(s->name);
	Py_XDECREF(s->aio);
	PyErr_Restore(et, ev, tb);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(op);
	Py_DECREF(tp);
}

static PyObject *
conn_fileno(PyObject *op, PyObject *unused)
{
	Conn *s = (Conn *)op;

	if (conn_usable(s) < 0)
		return NULL;
	return PyLong_FromLong(s->fd);
}

static PyObject *
conn_repr(PyObject *op)
{
	Conn *s = (Conn *)op;

	if (s->closed)
		return PyUnicode_FromFormat("<gpx.Conn client %llu %R closed>", (unsigned long long)s->client_id, s->name);
	return PyUnicode_FromFormat("<gpx.Conn client %llu %R, %zu transfer(s) pending>",
	    (unsigned long long)s->client_id, s->name, s->pending.n);
}

static PyObject *
conn_get_client_id(PyObject *op, void *unused)
{
	return PyLong_FromUnsignedLongLong(((Conn *)op)->client_id);
}

static PyObject *
conn_get_name(PyObject *op, void *unused)
{
	return Py_NewRef(((Conn *)op)->name);
}

static PyObject *
conn_get_closed(PyObject *op, void *unused)
{
	return PyBool_FromLong(((Conn *)op)->closed);
}

static PyObject *
conn_get_outstanding(PyObject *op, void *unused)
{
	return PyLong_FromSize_t(((Conn *)op)->pending.n);
}

static PyObject *
conn_get_dropped(PyObject *op, void *unused)
{
	Conn *s = (Conn *)op;
	uint64_t n = 0;
	PyThreadState *ts;

	if (conn_usable(s) < 0)
		return NULL;
	ts = conn_lock_quick(s);
	if (s->c != NULL)
		n = gpx_dropped(s->c);
	conn_unlock(s, ts);
	return PyLong_FromUnsignedLongLong(n);
}

static PyObject *
conn_get_aio(PyObject *op, void *unused)
{
	Conn *s = (Conn *)op;

	return Py_NewRef(s->aio != NULL ? s->aio : Py_None);
}

static int
conn_set_aio(PyObject *op, PyObject *v, void *unused)
{
	Conn *s = (Conn *)op;

	gpxpy_setref(&s->aio, v != NULL && v != Py_None ? Py_NewRef(v) : NULL);
	return 0;
}

static PyMethodDef conn_methods[] = {
	{ "register", FAST(region_register),
	  "register(obj, *, read_only=False) -> Region\n--\n\n"
	  "Hands memory to gpxd (the GIL released).  obj is a CUDA tensor or array (data_ptr() with "
	  "device and nbytes, __cuda_array_interface__, or __dlpack__), a gpx.HostBuffer, or a view of "
	  "host memory inside one (a numpy array or CPU tensor made with frombuffer, a memoryview).  "
	  "It must be contiguous.  The region keeps obj alive until deregister() or close().  "
	  "read_only: the region may only be a source.  CUDA memory must be ready (synchronise the "
	  "stream that wrote it) before a copy reads it." },
	{ "import_", FAST(region_import),
	  "import_(name) -> Region\n--\n\nImports another client's export by name (\"NODE:name\" or "
	  "\"@HOST:PORT/name\" for another node's)." },
	{ "export", FAST(region_export),
	  "export(region, name, *, rule='uid', gid=None, read_only=False, notify=False, peers=None)\n--\n\n"
	  "Shares a registered region under a name.  rule: who may import it, 'uid' (the same user), "
	  "'gid' (members of gid, default this process's group) or 'any'.  read_only: importers may "
	  "only read.  notify: True (or a tag) to be told of each peer's copy into it: a Completion "
	  "with notify=True and that tag (True: the region's id).  peers: None for this node only; "
	  "True or '*' for any peer node; a list (or comma-separated str) of node names." },
	{ "unexport", FAST(region_unexport), "unexport(name)\n--\n\nWithdraws an export." },
	{ "copy", FAST(transfer_copy),
	  "copy(src, dst, length=None, *, src_offset=0, dst_offset=0, tag=None) -> Transfer\n--\n\n"
	  "Asks gpxd to copy length bytes (None: the rest of src from src_offset) from src to dst; "
	  "returns at once.  tag: an int below 2**62 of one's own (unique among transfers not yet "
	  "complete), else one is made.  One side may be another node's region (imported as "
	  "'NODE:name'), not both: the Transfer of a copy between two remote regions fails "
	  "(its wait raises NotSupportedError, ENOTSUP) with a reason that says so; copy into a region of this node, then out of it." },
	{ "copyv", FAST(transfer_copyv),
	  "copyv(src, dst, segments, *, tag=None) -> Transfer\n--\n\n"
	  "Many pieces in one request, checked whole before any byte moves: segments is an (n, 3) "
	  "array of 64-bit integers (src_offset, dst_offset, length), read in place through the buffer "
	  "protocol, or a sequence of such triples." },
	{ "copy_pages", FAST(transfer_copy_pages),
	  "copy_pages(src, dst, page_size, src_pages, dst_pages, *, src_offset=0, dst_offset=0, tag=None) "
	  "-> Transfer\n--\n\n"
	  "Copies page src_pages[i] of src (at src_offset + src_pages[i] * page_size) to page "
	  "dst_pages[i] of dst, page_size bytes each: KV-cache blocks by number.  The page lists are "
	  "int32/uint32 arrays or CPU tensors read in place (or sequences of ints); negative numbers "
	  "are refused." },
	{ "copy_pages_table", FAST(transfer_copy_pages_table),
	  "copy_pages_table(src, dst, page_size, table, n, *, table_offset=0, src_offset=0, dst_offset=0, "
	  "tag=None) -> Transfer\n--\n\n"
	  "copy_pages with the page numbers in GPU memory, as a block table is: table is a region of "
	  "this connection (a registered or imported CUDA tensor) holding, from table_offset (a "
	  "multiple of 4), n source page numbers then n destination page numbers, 32 bits each (a "
	  "(2, n) int32 tensor: torch.stack((src_pages, dst_pages))).  Nothing of the list crosses the "
	  "host: gpxd's page kernel reads and checks each number as it copies.  A page out of its "
	  "region is left out and the Transfer's wait raises gpx.RangeError; the others are "
	  "copied.  Synchronize the work that writes the table first.  Needs both sides in GPU memory "
	  "(else NotSupportedError)." },
	{ "copy_batch", FAST(transfer_copy_batch),
	  "copy_batch(pairs, *, tag=None) -> Transfer\n--\n\n"
	  "Many region pairs in one request, checked whole before any byte moves and complete once "
	  "(a weight push: every tensor of a model).  Each pair is a tuple (src, dst): the whole of src "
	  "to the start of dst; (src, dst, length); or (src, dst, length, src_offset, dst_offset).  "
	  "Every region is of this node: the Transfer of a batch with a pair of another node's region "
	  "fails with NotSupportedError.  pairs may be a Batch from batch(pairs)." },
	{ "batch", FAST(transfer_batch),
	  "batch(pairs, *, pages=False) -> Batch\n--\n\n"
	  "The pairs of copy_batch (pages=True: of copy_pages_batch) parsed once, to pass in their "
	  "place as often as wanted: a weight push or KV handoff over the same tensors each time "
	  "then costs no parse of its tuples.  Each submission checks that its regions are still "
	  "registered; the Batch keeps them (not their registration)." },
	{ "copy_pages_batch", FAST(transfer_copy_pages_batch),
	  "copy_pages_batch(pairs, page_size, src_pages, dst_pages, *, tag=None) -> Transfer\n--\n\n"
	  "The same pages of every pair in one request (a KV-cache handoff: the same blocks out of "
	  "every layer's K and V tensors), checked whole and complete once.  Each pair is a tuple "
	  "(src, dst) or (src, dst, src_offset, dst_offset), the bases its pages are numbered from; "
	  "the page lists are read as for copy_pages.  pairs may be a Batch from batch(pairs, pages=True)." },
	{ "copy_pages_batch_table", FAST(transfer_copy_pages_batch_table),
	  "copy_pages_batch_table(pairs, page_size, table, n, *, table_offset=0, tag=None) -> Transfer\n--\n\n"
	  "copy_pages_batch with the page numbers in GPU memory, in table as copy_pages_table takes them: "
	  "every pair copies the table's n pages (a KV-cache handoff whose block table is a CUDA tensor).  "
	  "Every pair must run on the one GPU's page kernel that reads the table (else NotSupportedError)." },
	{ "poll", FAST(route_poll),
	  "poll(max=64) -> list[Completion]\n--\n\nCompletions not consumed by a Transfer, without "
	  "blocking: those kept while waiting first, then what has arrived." },
	{ "wait", FAST(route_wait),
	  "wait(timeout=None, max=64) -> list[Completion]\n--\n\nLike poll(), but waits (the GIL "
	  "released) until there is at least one; [] when timeout (seconds) passes." },
	{ "fileno", conn_fileno, METH_NOARGS,
	  "fileno() -> int\n--\n\nAn fd that is readable when completions may have arrived, for "
	  "selectors and epoll; call poll() (or Transfer.done()) then." },
	{ "close", conn_close_m, METH_NOARGS,
	  "close()\n--\n\nCancels the transfers not yet complete, waits (up to 10 s) until gpxd has "
	  "reported each, closes the connection, and then lets go of the registered objects.  Later "
	  "calls raise ConnectionLostError; closing twice is fine." },
	{ "__enter__", conn_enter, METH_NOARGS, "Returns the connection itself." },
	{ "__exit__", conn_exit, METH_VARARGS, "Closes the connection." },
	{ "_drain", route_drain, METH_NOARGS, "Routes all arrived completions without blocking (internal: asyncio)." },
	{ "_c_bench", transfer_c_bench, METH_VARARGS, "The benchmark's C loops (internal: gpx.bench)." },
	{ NULL }
};

static PyGetSetDef conn_getset[] = {
	{ "client_id", conn_get_client_id, NULL, "The id gpxd gave this client (gpxctl clients shows it).", NULL },
	{ "name", conn_get_name, NULL, "The name given to connect() (shown by gpxctl).", NULL },
	{ "closed", conn_get_closed, NULL, "Whether close() has run.", NULL },
	{ "outstanding", conn_get_outstanding, NULL, "Transfers submitted and not yet complete.", NULL },
	{ "dropped", conn_get_dropped, NULL, "Notifications gpxd dropped because this client's queue was full.", NULL },
	{ "_aio", conn_get_aio, conn_set_aio, "The asyncio glue's watcher (internal).", NULL },
	{ NULL }
};

static PyType_Slot conn_slots[] = {
	{ Py_tp_doc, "Conn: a connection to gpxd, made by gpx.connect().\n\n"
	  "A context manager (close() on exit).  It may be used from several threads; a coroutine "
	  "awaiting its transfers must run in one event loop.  It does not survive fork(): a child "
	  "connects again." },
	{ Py_tp_dealloc, conn_dealloc },
	{ Py_tp_repr, conn_repr },
	{ Py_tp_methods, conn_methods },
	{ Py_tp_getset, conn_getset },
	{ 0, NULL }
};

PyType_Spec conn_spec = {
	.name = "gpx.Conn",
	.basicsize = sizeof(Conn),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = conn_slots,
};

PyObject *
conn_connect(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "connect", 2, 0, { "socket", "name", NULL } };
	struct modstate *st = PyModule_GetState(module);
	PyObject *a[2];
	const char *sock = NULL, *name = NULL;
	pthread_condattr_t ca;
	gpx_conn *c = NULL;
	int r;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 ||
	    (a[0] != NULL && a[0] != Py_None && (sock = gpxpy_str(a[0], "socket")) == NULL) ||
	    (a[1] != NULL && a[1] != Py_None && (name = gpxpy_str(a[1], "name")) == NULL))
		return NULL;
	Conn *s = (Conn *)PyType_GenericAlloc(st->conn_type, 0);
	if (s == NULL)
		return NULL;
	s->st = st;
	s->wakefd = -1;
	s->fork_gen = gpxpy_fork_gen;
	s->closed = true;             /* until connected */
	s->name = Py_NewRef(name != NULL ? a[1] : Py_None);
	if (pthread_mutex_init(&s->mu, NULL) != 0 || pthread_condattr_init(&ca) != 0) {
		Py_DECREF(s);
		return PyErr_NoMemory();
	}
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	r = pthread_cond_init(&s->cv, &ca);
	pthread_condattr_destroy(&ca);
	if (r != 0) {
		pthread_mutex_destroy(&s->mu);
		Py_DECREF(s);
		return PyErr_NoMemory();
	}
	s->sync_made = true;
	if ((s->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
		Py_DECREF(s);
		return gpxpy_raise_errno(st, -GPX_ESYS, "eventfd", errno);
	}
	/* The doorbell is ours, so that route_kick can ring it too. */
	struct gpx_connect_opts o = { .socket = sock, .name = name, .eventfd = s->wakefd };
	Py_BEGIN_ALLOW_THREADS
	r = gpx_connect_opts(&o, &c);
	Py_END_ALLOW_THREADS
	if (r < 0) {
		int e = errno;
		Py_DECREF(s);
		return gpxpy_raise_errno(st, r, gpx_last_error(NULL), e);   /* (this thread's connect) */
	}
	client_doorbell_plain(c);     /* nobody counts its writes: spins skip them, sleeps get them early */
	s->c = c;
	s->closed = false;
	s->fd = gpx_fd(c);
	s->client_id = gpx_client_id(c);
	client_refusal_hook(c, route_on_refusal, s);
	return (PyObject *)s;
}
