/*
 * gpx._gpx: Python as a client of gpx.  A CPython extension over libgpxclient (whose objects
 * are linked in), built against the stable ABI (3.11).  This file holds the module, its
 * exceptions, and the objects Conn, Region and Transfer; Completion is a struct sequence.
 * mem.c reads the memory of the objects Python code hands in.
 *
 * Locking.  A gpx_conn is not thread-safe, so each Conn has a mutex around every library call,
 * taken only with the GIL released or by a trylock: no thread ever waits for it while holding
 * the GIL.  Calls that can block (connect, register, import, export, deregister, cancel,
 * close, waits) release the GIL; calls that cannot (copy submissions, polls) keep it when the
 * mutex is free, which costs less than releasing it.  What the Python side keeps of a Conn
 * (its transfers by tag, the backlog of completions, the registered objects) is guarded by
 * the GIL.
 *
 * Completions.  Every transfer ends in one completion, consumed once: by its Transfer when a
 * thread waits for it (Transfer.wait, Transfer.done) or a coroutine awaits it, else by
 * Conn.poll/Conn.wait.  Completions read from the library are routed as they come: each
 * resolves its Transfer object if that still lives, and goes to that Transfer if it is
 * waited or awaited for, else to the backlog, where poll() finds it and where a later
 * Transfer.wait() takes its own out.  Only one thread at a time sleeps on the connection's
 * fd, as gpx_wait does; others wait on a condition variable; whoever routes completions while
 * others wait bumps a generation count, wakes them, and rings the doorbell (an eventfd of the
 * module's, handed to the library) under the sleeping one.
 *
 * Fork.  A child of fork() has copies of the connection's descriptors and shared ring but is
 * no client: a pthread_atfork handler bumps a generation each Conn compares with its own,
 * every call there fails, and close only closes the child's copies.
 *
 * Registered objects stay referenced (and their buffers held) until their region is
 * deregistered or the connection closed, after every transfer has been reported: gpxd may
 * write into them until then, and PyTorch's caching allocator would hand a freed block to
 * another tensor.
 */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include "client-lib/client.h"
#include "client-lib/python/_gpx.h"
#include "proto/wire.h"

#define TAG_AUTO (1ULL << 62)        /* automatic tags: TAG_AUTO | a counter; user tags are below */
#define TAG_BENCH (3ULL << 61)       /* the C loops of _c_bench */
#define PULL_MAX 64                  /* completions read from the library at once */
#define INLINE_SEGS 64               /* up to this many segments travel inside the request */
#define CLOSE_DRAIN_S 10.0           /* how long close() waits for cancelled transfers */
#define FOLLOWER_SLICE_MS 200        /* a thread waiting behind the fd's watcher checks signals */

static unsigned fork_gen;            /* bumped in the child of every fork() */

typedef struct transfer Transfer;

/* ---- the objects ---- */

struct tagslot {
	uint64_t tag;
	Transfer *t;                 /* borrowed; NULL once the Transfer object died */
	bool used;
};

/* Transfers not yet complete, by tag: open addressing, linear probing. */
struct tagmap {
	struct tagslot *s;
	size_t cap, n;
};

/* A completion read and not yet consumed, with the Transfer it resolved (borrowed, or NULL). */
struct bentry {
	struct gpx_completion c;
	PyObject *reason;
	Transfer *t;
};

/* A registered region's object, kept until the region goes. */
struct keep {
	uint64_t region;
	struct mem_desc d;
};

/* The daemon's reason for a refused transfer, heard by the library's hook (under mu). */
struct reason {
	uint64_t tag;
	char *text;
};

typedef struct conn {
	PyObject_HEAD
	struct modstate *st;
	gpx_conn *c;                 /* NULL once closed (changed under mu) */
	pthread_mutex_t mu;          /* every call into c, and the fields marked (mu) */
	pthread_cond_t cv;           /* threads waiting behind the fd's watcher */
	bool sync_made;              /* mu and cv were initialised */
	bool sleeping;               /* a thread watches the fd (mu) */
	uint64_t gen;                /* bumped when completions were routed (atomic, written under mu) */
	int wakefd;                  /* the doorbell: gpxd rings it, and conn_kick to wake the fd's watcher */
	int fd;                      /* gpx_fd(c) */
	unsigned fork_gen;
	bool closed;                 /* close() has begun: new calls are refused */
	uint64_t client_id;
	PyObject *name;
	unsigned waiters;            /* threads inside a wait on this connection */
	struct tagmap pending;
	uint64_t next_tag;
	struct bentry *back;         /* the backlog, oldest first */
	size_t nback, capback;
	struct keep *keeps;
	size_t nkeeps, capkeeps;
	struct reason *reasons;      /* (mu) */
	size_t nreasons, capreasons;
	PyObject *aio;               /* the asyncio glue's watcher, or NULL */
} Conn;

struct transfer {
	PyObject_HEAD
	Conn *conn;
	uint64_t tag;
	bool resolved;               /* its completion was read */
	bool in_backlog;             /* ... and waits in the backlog */
	unsigned waiting;            /* threads waiting for it */
	int status;
	uint64_t bytes;
	PyObject *reason;
	PyObject *waker;             /* the asyncio glue's callback, called once when it resolves */
};

typedef struct region {
	PyObject_HEAD
	Conn *conn;
	uint64_t id;
	uint64_t length;
	const char *kind;
	bool read_only;
	bool imported;
	bool live;
	PyObject *name;              /* the export it was imported from, or NULL */
} Region;

/* ---- errors ---- */

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

/* What a library call left for its error: the code, errno, and the daemon's reason. */
struct callres {
	int r;
	int err;
	char reason[256];
};

/* Notes a library call's result on c (whose lock is held), for raising after the lock is gone. */
static int
note(struct callres *cr, gpx_conn *c, int r)
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

static PyObject *
raise_error(struct modstate *st, int code, const char *reason, int sys_errno)
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
	return raise_error(st, code, reason, 0);
}

static PyObject *
raise_call(struct modstate *st, const struct callres *cr)
{
	return raise_error(st, cr->r, cr->reason, cr->err);
}

/* ---- arguments ---- */

/* How a method takes its arguments: the first npos by position too, the first nreq required. */
struct argspec {
	const char *fname;
	int npos, nreq;
	const char *names[10];
};

/* Binds fast-call arguments to out[] (borrowed; NULL where not given) by position and name. */
static int
args_bind(const struct argspec *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out)
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
static int
arg_u64(PyObject *o, const char *name, uint64_t *out)
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
static int
arg_timeout(PyObject *o, double *out)
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
static const char *
arg_str(PyObject *o, const char *name)
{
	if (!PyUnicode_Check(o)) {
		PyErr_Format(PyExc_TypeError, "%s must be a str, not %s", name, TNAME(o));
		return NULL;
	}
	return PyUnicode_AsUTF8AndSize(o, NULL);
}

/* *slot = v (a new reference, or NULL), dropping the old one after. */
static void
set_ref(PyObject **slot, PyObject *v)
{
	PyObject *old = *slot;

	*slot = v;
	Py_XDECREF(old);
}

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- transfers by tag ---- */

static size_t
tag_hash(uint64_t tag, size_t cap)
{
	return (size_t)((tag * 0x9E3779B97F4A7C15ULL) >> 17) & (cap - 1);
}

static struct tagslot *
tagmap_find(struct tagmap *m, uint64_t tag)
{
	if (m->n == 0)
		return NULL;
	for (size_t i = tag_hash(tag, m->cap);; i = (i + 1) & (m->cap - 1)) {
		if (!m->s[i].used)
			return NULL;
		if (m->s[i].tag == tag)
			return &m->s[i];
	}
}

static int
tagmap_put(struct tagmap *m, uint64_t tag, Transfer *t)
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
				tagmap_put(m, old[i].tag, old[i].t);
		free(old);
	}
	size_t i = tag_hash(tag, m->cap);
	while (m->s[i].used)
		i = (i + 1) & (m->cap - 1);
	m->s[i] = (struct tagslot){ .tag = tag, .t = t, .used = true };
	m->n++;
	return 0;
}

/* Removes a slot, shifting back the entries of its probe run (no tombstones). */
static void
tagmap_del(struct tagmap *m, struct tagslot *slot)
{
	size_t mask = m->cap - 1, i = (size_t)(slot - m->s), j = i;

	m->s[i].used = false;
	m->n--;
	for (;;) {
		j = (j + 1) & mask;
		if (!m->s[j].used)
			return;
		size_t home = tag_hash(m->s[j].tag, m->cap);
		/* Leave j where it is if its home lies cyclically in (i, j]. */
		if ((j > i && home > i && home <= j) || (j < i && (home > i || home <= j)))
			continue;
		m->s[i] = m->s[j];
		m->s[j].used = false;
		i = j;
	}
}

/* ---- the backlog, and the reasons the library's hook hears ---- */

/* Appends a completion; takes reason. */
static int
backlog_push(Conn *s, const struct gpx_completion *c, PyObject *reason, Transfer *t)
{
	if (s->nback == s->capback) {
		size_t cap = s->capback ? 2 * s->capback : 64;
		struct bentry *b = realloc(s->back, cap * sizeof(*b));
		if (b == NULL) {
			Py_XDECREF(reason);
			PyErr_NoMemory();
			return -1;
		}
		s->back = b;
		s->capback = cap;
	}
	s->back[s->nback++] = (struct bentry){ .c = *c, .reason = reason, .t = t };
	if (t != NULL)
		t->in_backlog = true;
	return 0;
}

/* Removes entries [i, i+k) (their reasons already taken or dropped by the caller). */
static void
backlog_cut(Conn *s, size_t i, size_t k)
{
	memmove(&s->back[i], &s->back[i + k], (s->nback - i - k) * sizeof(*s->back));
	s->nback -= k;
}

/* Takes t's completion out of the backlog: t consumed it. */
static void
backlog_take(Conn *s, Transfer *t)
{
	for (size_t i = 0; i < s->nback; i++)
		if (s->back[i].t == t) {
			Py_XDECREF(s->back[i].reason);
			backlog_cut(s, i, 1);
			break;
		}
	t->in_backlog = false;
}

static void
backlog_clear(Conn *s)
{
	for (size_t i = 0; i < s->nback; i++) {
		if (s->back[i].t != NULL)
			s->back[i].t->in_backlog = false;
		Py_XDECREF(s->back[i].reason);
	}
	s->nback = 0;
}

/* The library's refusal hook: runs inside a library call, so under s->mu, without the GIL. */
static void
on_refusal(void *arg, uint64_t tag, const char *text)
{
	Conn *s = arg;

	if (text == NULL)
		return;
	if (s->nreasons == s->capreasons) {
		size_t cap = s->capreasons ? 2 * s->capreasons : 8;
		struct reason *r = realloc(s->reasons, cap * sizeof(*r));
		if (r == NULL)
			return;     /* the completion comes without its reason */
		s->reasons = r;
		s->capreasons = cap;
	}
	char *copy = strdup(text);
	if (copy != NULL)
		s->reasons[s->nreasons++] = (struct reason){ .tag = tag, .text = copy };
}

/* The oldest reason heard for tag, now the caller's (malloc'ed), or NULL.  Under s->mu. */
static char *
reason_take(Conn *s, uint64_t tag)
{
	for (size_t i = 0; i < s->nreasons; i++)
		if (s->reasons[i].tag == tag) {
			char *t = s->reasons[i].text;
			memmove(&s->reasons[i], &s->reasons[i + 1], (s->nreasons - i - 1) * sizeof(*s->reasons));
			s->nreasons--;
			return t;
		}
	return NULL;
}

/* ---- locking ---- */

/*
 * Takes s->mu for a call that does not block: by trylock, keeping the GIL, when it is free;
 * else with the GIL released while waiting.  Returns the thread state unlock_quick restores.
 */
static PyThreadState *
lock_quick(Conn *s)
{
	PyThreadState *ts;

	if (pthread_mutex_trylock(&s->mu) == 0)
		return NULL;
	ts = PyEval_SaveThread();
	pthread_mutex_lock(&s->mu);
	return ts;
}

static void
unlock_quick(Conn *s, PyThreadState *ts)
{
	pthread_mutex_unlock(&s->mu);
	if (ts != NULL)
		PyEval_RestoreThread(ts);
}

/* Takes s->mu with the GIL released: for calls that take long (or may block). */
static PyThreadState *
lock_slow(Conn *s)
{
	PyThreadState *ts = PyEval_SaveThread();

	pthread_mutex_lock(&s->mu);
	return ts;
}

/* Whether new calls may use s: 0, or -1 with ConnectionLostError. */
static int
conn_usable(Conn *s)
{
	if (s->fork_gen != fork_gen) {
		raise_error(s->st, -GPX_ECONN, "the connection belongs to the parent process (this is a "
		    "child of fork()): connect again here", 0);
		return -1;
	}
	if (s->closed) {
		raise_error(s->st, -GPX_ECONN, "the connection is closed", 0);
		return -1;
	}
	return 0;
}

/* ---- Transfer ---- */

static void
transfer_resolve(Transfer *t, int status, uint64_t bytes, PyObject *reason)
{
	t->resolved = true;
	t->status = status;
	t->bytes = bytes;
	set_ref(&t->reason, Py_XNewRef(reason));
}

/* Calls (once) the asyncio glue's callback of a resolved transfer. */
static void
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

/* ---- completions: reading and routing ---- */

struct pulled {
	struct gpx_completion c;
	char *reason;                /* the daemon's, malloc'ed, or NULL */
};

static PyObject *
completion_new(struct modstate *st, const struct gpx_completion *c, PyObject *reason)
{
	PyObject *o = PyStructSequence_New(st->completion_type), *v[5];

	if (o == NULL)
		return NULL;
	v[0] = PyLong_FromUnsignedLongLong(c->tag);
	v[1] = PyLong_FromLong(c->status);
	v[2] = PyLong_FromUnsignedLongLong(c->bytes);
	v[3] = Py_NewRef((c->flags & GPX_COMP_NOTIFY) ? Py_True : Py_False);
	v[4] = reason != NULL ? Py_NewRef(reason) : (c->status < 0 ? PyUnicode_FromString(gpx_strerror(c->status))
	    : Py_NewRef(Py_None));
	for (int i = 0; i < 5; i++) {
		if (v[i] == NULL) {
			for (int k = i + 1; k < 5; k++)
				Py_XDECREF(v[k]);
			Py_DECREF(o);
			return NULL;
		}
		PyStructSequence_SetItem(o, i, v[i]);
	}
	return o;
}

/*
 * Reads up to max completions without blocking, with their reasons.  clear: also clear the
 * doorbell (a thread about to sleep on the fd must; a first look need not).  n, or a negative
 * code with cr filled in.
 */
static int
conn_pull(Conn *s, struct pulled *out, int max, bool clear, struct callres *cr)
{
	struct gpx_completion comp[PULL_MAX];
	PyThreadState *ts = lock_quick(s);
	int n;

	if (s->c == NULL) {
		n = -GPX_ECONN;
		cr->r = n;
		cr->err = 0;
		snprintf(cr->reason, sizeof(cr->reason), "the connection is closed");
	} else {
		n = clear ? gpx_wait(s->c, comp, max, 0) : gpx_poll(s->c, comp, max);
		if (n == -GPX_ETIMEDOUT)
			n = 0;
		note(cr, s->c, n);
		for (int i = 0; i < n; i++) {
			out[i].c = comp[i];
			out[i].reason = comp[i].status < 0 ? reason_take(s, comp[i].tag) : NULL;
		}
	}
	unlock_quick(s, ts);
	return n;
}

/* Tells threads waiting on s that completions were routed. */
static void
conn_kick(Conn *s)
{
	PyThreadState *ts = lock_quick(s);
	uint64_t one = 1;

	__atomic_store_n(&s->gen, s->gen + 1, __ATOMIC_RELAXED);
	if (s->sleeping)
		(void)!write(s->wakefd, &one, sizeof(one));
	pthread_cond_broadcast(&s->cv);
	unlock_quick(s, ts);
}

/*
 * Hands one completion on: to its Transfer when a thread waits for it or a coroutine awaits
 * it, else to list (poll's result) or, with list NULL, to the backlog.  Takes p->reason.
 */
static int
route(Conn *s, struct pulled *p, PyObject *list)
{
	PyObject *reason = NULL, *comp;
	Transfer *t = NULL;

	if (p->reason != NULL) {
		reason = PyUnicode_DecodeUTF8(p->reason, (Py_ssize_t)strlen(p->reason), "replace");
		free(p->reason);
		p->reason = NULL;
		if (reason == NULL)
			PyErr_Clear();
	}
	if (!(p->c.flags & GPX_COMP_NOTIFY)) {
		struct tagslot *slot = tagmap_find(&s->pending, p->c.tag);
		if (slot != NULL) {
			t = slot->t;
			tagmap_del(&s->pending, slot);
		}
	}
	if (t != NULL) {
		transfer_resolve(t, p->c.status, p->c.bytes, reason);
		if (t->waiting > 0 || t->waker != NULL) {
			Py_XDECREF(reason);
			if (t->waker != NULL)
				transfer_wake(t);
			return 0;
		}
	}
	if (list == NULL)
		return backlog_push(s, &p->c, reason, t);
	comp = completion_new(s->st, &p->c, reason);
	Py_XDECREF(reason);
	if (comp == NULL || PyList_Append(list, comp) < 0) {
		Py_XDECREF(comp);
		return -1;
	}
	Py_DECREF(comp);
	return 0;
}

/* Routes a batch (see route); wakes other waiters.  self_waits: the caller is one of them. */
static int
route_batch(Conn *s, struct pulled *b, int n, PyObject *list, Py_ssize_t max, bool self_waits)
{
	int r = 0;

	for (int i = 0; i < n; i++) {
		if (r == 0)
			r = route(s, &b[i], list != NULL && PyList_Size(list) < max ? list : NULL);
		else
			free(b[i].reason);
	}
	if (s->waiters > (self_waits ? 1u : 0u))
		conn_kick(s);
	return r;
}

/* Resolves every transfer not yet complete with code: the connection is closed or lost. */
static void
conn_resolve_all(Conn *s, int code, const char *why)
{
	struct tagmap m = s->pending;
	PyObject *reason = PyUnicode_FromString(why);
	Transfer **ts;
	size_t n = 0;

	if (reason == NULL)
		PyErr_Clear();
	memset(&s->pending, 0, sizeof(s->pending));
	ts = malloc((m.n ? m.n : 1) * sizeof(*ts));
	/* Collected first: a waker may run code that submits new transfers. */
	for (size_t i = 0; ts != NULL && i < m.cap; i++)
		if (m.s[i].used && m.s[i].t != NULL)
			ts[n++] = (Transfer *)Py_NewRef((PyObject *)m.s[i].t);
	free(m.s);
	for (size_t i = 0; i < n; i++) {
		transfer_resolve(ts[i], code, 0, reason);
		if (ts[i]->waker != NULL)
			transfer_wake(ts[i]);
		Py_DECREF(ts[i]);
	}
	free(ts);
	Py_XDECREF(reason);
	if (s->waiters > 0)
		conn_kick(s);
}

/*
 * Sleeps, the GIL released by the caller, until s's fd is readable, another thread routed
 * completions (the generation moved from seen), or timeout_ms (-1: no limit).  One thread
 * watches the fd; the others wait on the condition variable, in slices, to notice signals.
 */
static void
conn_sleep(Conn *s, uint64_t seen, int timeout_ms)
{
	struct epoll_event ev;

	pthread_mutex_lock(&s->mu);
	if (s->c == NULL || __atomic_load_n(&s->gen, __ATOMIC_RELAXED) != seen) {
		pthread_mutex_unlock(&s->mu);
		return;
	}
	if (s->sleeping) {
		struct timespec ts;
		int ms = timeout_ms < 0 || timeout_ms > FOLLOWER_SLICE_MS ? FOLLOWER_SLICE_MS : timeout_ms;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		ts.tv_sec += ms / 1000;
		ts.tv_nsec += (ms % 1000) * 1000000L;
		if (ts.tv_nsec >= 1000000000L) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000L;
		}
		pthread_cond_timedwait(&s->cv, &s->mu, &ts);
		pthread_mutex_unlock(&s->mu);
		return;
	}
	s->sleeping = true;
	pthread_mutex_unlock(&s->mu);
	/* As gpx_wait sleeps; a wake-up by conn_kick reads like a doorbell. */
	(void)epoll_wait(s->fd, &ev, 1, timeout_ms);
	pthread_mutex_lock(&s->mu);
	s->sleeping = false;
	pthread_cond_broadcast(&s->cv);
	pthread_mutex_unlock(&s->mu);
}

typedef bool (*wait_pred)(Conn *, void *);

/*
 * Reads and routes completions until pred(s, arg) holds, sleeping with the GIL released in
 * between.  timeout < 0: no limit.  1 when pred holds, 0 on timeout, -1 with an exception
 * (a signal handler's, or ConnectionLostError once the connection is gone).
 */
static int
conn_wait_until(Conn *s, wait_pred pred, void *arg, double timeout, bool self_waits)
{
	double deadline = timeout >= 0 ? now_s() + timeout : 0;
	struct pulled b[PULL_MAX];
	struct callres cr;
	bool clear = false;
	int res, n;

	s->waiters++;
	for (;;) {
		if (pred(s, arg)) {
			res = 1;
			break;
		}
		uint64_t seen = __atomic_load_n(&s->gen, __ATOMIC_RELAXED);
		/* A first look without clearing the doorbell saves a system call when nothing came. */
		n = conn_pull(s, b, PULL_MAX, clear, &cr);
		clear = true;
		if (n < 0) {
			/* Nothing pending can complete any more (the connection is lost or closed). */
			if (n == -GPX_ECONN)
				conn_resolve_all(s, n, cr.reason);
			if (pred(s, arg)) {
				res = 1;
				break;
			}
			raise_call(s->st, &cr);
			res = -1;
			break;
		}
		if (n > 0) {
			if (route_batch(s, b, n, NULL, 0, self_waits) < 0) {
				res = -1;
				break;
			}
			continue;
		}
		int ms = -1;
		if (timeout >= 0) {
			double left = deadline - now_s();
			if (left <= 0) {
				res = 0;
				break;
			}
			ms = left > 86400 ? 86400000 : (int)ceil(left * 1000);
		}
		Py_BEGIN_ALLOW_THREADS
		conn_sleep(s, seen, ms);
		Py_END_ALLOW_THREADS
		if (PyErr_CheckSignals() < 0) {
			res = -1;
			break;
		}
	}
	s->waiters--;
	return res;
}

/*
 * After a request that waited for its answer: completions the library read meanwhile (refused
 * transfers come over the socket and ring no doorbell) are routed now, or a thread sleeping
 * on the fd and an event loop watching it would not hear of them.
 */
static void
conn_after_rpc(Conn *s)
{
	struct pulled b[PULL_MAX];
	struct callres cr;
	int n;

	if (s->pending.n == 0)
		return;
	if ((n = conn_pull(s, b, PULL_MAX, false, &cr)) > 0 && route_batch(s, b, n, NULL, 0, false) < 0)
		PyErr_WriteUnraisable((PyObject *)s);
}

static bool
pred_resolved(Conn *s, void *arg)
{
	return ((Transfer *)arg)->resolved;
}

static bool
pred_backlog(Conn *s, void *arg)
{
	return s->nback > 0;
}

static bool
pred_none_pending(Conn *s, void *arg)
{
	return s->pending.n == 0;
}

/* ---- Transfer methods ---- */

/* The result of a resolved transfer: bytes moved, or its error raised. */
static PyObject *
transfer_result(Transfer *t)
{
	if (t->in_backlog)
		backlog_take(t->conn, t);
	if (t->status < 0) {
		const char *why = NULL;
		if (t->reason != NULL && (why = PyUnicode_AsUTF8AndSize(t->reason, NULL)) == NULL)
			PyErr_Clear();
		return raise_error(t->conn->st, t->status, why, 0);
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

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || arg_timeout(a[0], &timeout) < 0)
		return NULL;
	if (!t->resolved) {
		if (t->conn->fork_gen != fork_gen)
			return raise_error(t->conn->st, -GPX_ECONN, "the connection belongs to the parent "
			    "process (this is a child of fork())", 0);
		t->waiting++;
		r = conn_wait_until(t->conn, pred_resolved, t, timeout, true);
		t->waiting--;
		if (r < 0)
			return NULL;
		if (r == 0) {
			char why[96];
			snprintf(why, sizeof(why), "transfer %#llx not complete after %g s",
			    (unsigned long long)t->tag, timeout);
			return raise_error(t->conn->st, -GPX_ETIMEDOUT, why, 0);
		}
	}
	return transfer_result(t);
}

static PyObject *
transfer_done(PyObject *op, PyObject *unused)
{
	Transfer *t = (Transfer *)op;

	if (!t->resolved && t->conn->fork_gen == fork_gen) {
		/* One look, so that a loop on done() makes progress by itself. */
		t->waiting++;
		int r = conn_wait_until(t->conn, pred_resolved, t, 0, true);
		t->waiting--;
		if (r < 0)
			return NULL;
	}
	if (t->resolved && t->in_backlog)
		backlog_take(t->conn, t);
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
	ts = lock_slow(s);
	note(&cr, s->c, s->c != NULL ? gpx_cancel(s->c, t->tag) : -GPX_ECONN);
	unlock_quick(s, ts);
	conn_after_rpc(s);
	/* Already complete in the daemon: its completion is on its way. */
	if (cr.r == -GPX_ENOENT)
		Py_RETURN_FALSE;
	if (cr.r < 0)
		return raise_call(s->st, &cr);
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
		struct tagslot *slot = tagmap_find(&t->conn->pending, t->tag);
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
	set_ref(&t->waker, v != NULL && v != Py_None ? Py_NewRef(v) : NULL);
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

static PyType_Spec transfer_spec = {
	.name = "gpx.Transfer",
	.basicsize = sizeof(Transfer),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = transfer_slots,
};

/* ---- submitting transfers ---- */

/* A new Transfer, entered under its tag (tag_arg: the caller's, or NULL/None for an automatic one). */
static Transfer *
transfer_start(Conn *s, PyObject *tag_arg)
{
	uint64_t tag;
	Transfer *t;

	if (tag_arg == NULL || tag_arg == Py_None)
		tag = TAG_AUTO | (++s->next_tag & ((1ULL << 61) - 1));
	else {
		if (arg_u64(tag_arg, "tag", &tag) < 0)
			return NULL;
		if (tag >= TAG_AUTO) {
			PyErr_SetString(PyExc_ValueError, "tags must be below 2**62 (the others are the module's "
			    "and the library's)");
			return NULL;
		}
		if (tagmap_find(&s->pending, tag) != NULL) {
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
	if (tagmap_put(&s->pending, tag, t) < 0) {
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
	struct tagslot *slot = tagmap_find(&t->conn->pending, t->tag);

	if (slot != NULL)
		tagmap_del(&t->conn->pending, slot);
	t->resolved = true;
	raise_call(t->conn->st, cr);
	Py_DECREF(t);
	return NULL;
}

/* src and dst as Regions of s that are still registered. */
static int
regions_of(Conn *s, PyObject *a, PyObject *b, Region **src, Region **dst)
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

static PyObject *
conn_copy(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
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

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    regions_of(s, a[0], a[1], &src, &dst) < 0 ||
	    (a[3] != NULL && arg_u64(a[3], "src_offset", &soff) < 0) ||
	    (a[4] != NULL && arg_u64(a[4], "dst_offset", &doff) < 0))
		return NULL;
	if (a[2] == NULL || a[2] == Py_None) {
		if (soff >= src->length) {
			PyErr_SetString(PyExc_ValueError, "src_offset is at or past the end of src");
			return NULL;
		}
		len = src->length - soff;
	} else if (arg_u64(a[2], "length", &len) < 0)
		return NULL;
	if ((t = transfer_start(s, a[5])) == NULL)
		return NULL;
	ts = lock_quick(s);
	note(&cr, s->c, s->c != NULL ? gpx_copy(s->c, src->id, soff, dst->id, doff, len, t->tag) : -GPX_ECONN);
	unlock_quick(s, ts);
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

static PyObject *
conn_copyv(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
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

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    regions_of(s, a[0], a[1], &src, &dst) < 0 || mem_segments(s->st, a[2], &l) < 0)
		return NULL;
	if ((t = transfer_start(s, a[3])) == NULL) {
		mem_segments_release(&l);
		return NULL;
	}
	ts = l.n > HEAVY_LIST ? lock_slow(s) : lock_quick(s);
	if (s->c == NULL)
		r = -GPX_ECONN;
	else if (l.is_signed)
		r = copyv_signed(s->c, src->id, dst->id, l.segs, l.n, t->tag);
	else
		r = gpx_copyv(s->c, src->id, dst->id, l.segs, l.n, t->tag);
	note(&cr, s->c, r);
	unlock_quick(s, ts);
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

static PyObject *
conn_copy_pages(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
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

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    regions_of(s, a[0], a[1], &src, &dst) < 0 || arg_u64(a[2], "page_size", &psize) < 0 ||
	    (a[5] != NULL && arg_u64(a[5], "src_offset", &soff) < 0) ||
	    (a[6] != NULL && arg_u64(a[6], "dst_offset", &doff) < 0))
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
	ts = sp.n > HEAVY_LIST ? lock_slow(s) : lock_quick(s);
	note(&cr, s->c, s->c != NULL ? gpx_copy_pages(s->c, src->id, soff, dst->id, doff, psize, sp.pages,
	    dp.pages, sp.n, t->tag) : -GPX_ECONN);
	unlock_quick(s, ts);
	if (cr.r < 0) {
		transfer_abort(t, &cr);
		t = NULL;
	}
out:
	mem_pages_release(&sp);
	mem_pages_release(&dp);
	return (PyObject *)t;
}

/* ---- Region ---- */

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

static void
keep_drop_all(Conn *s)
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
	ts = lock_slow(s);
	note(&cr, s->c, s->c != NULL ? gpx_deregister(s->c, r->id) : -GPX_ECONN);
	unlock_quick(s, ts);
	conn_after_rpc(s);
	if (cr.r < 0)
		return raise_call(s->st, &cr);
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

	if (!r->live || r->conn->closed || r->conn->fork_gen != fork_gen)
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

static PyType_Spec region_spec = {
	.name = "gpx.Region",
	.basicsize = sizeof(Region),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = region_slots,
};

/* ---- Conn: memory and sharing ---- */

static PyObject *
conn_register(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
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

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (a[1] != NULL && (ro = PyObject_IsTrue(a[1])) < 0) || mem_describe(s->st, a[0], ro, &d) < 0)
		return NULL;
	unsigned flags = ro ? GPX_REG_READONLY : 0;
	ts = lock_slow(s);
	if (s->c == NULL)
		note(&cr, NULL, -GPX_ECONN);
	else if (d.cuda)
		note(&cr, s->c, gpx_register_cuda(s->c, d.ptr, d.length, flags, &id));
	else
		note(&cr, s->c, gpx_register_host(s->c, d.hb->fd, d.offset, d.length, flags, &id));
	if (cr.r == 0)
		kind = client_last_region(s->c, &kro);
	unlock_quick(s, ts);
	conn_after_rpc(s);
	if (cr.r < 0) {
		mem_release(&d);
		return raise_call(s->st, &cr);
	}
	/* Registered: kept from here on, even should the Region object fail to come. */
	uint64_t len = d.length;
	if (keep_add(s, id, &d) < 0) {
		mem_release(&d);
		return NULL;
	}
	r = region_new(s, id, len, kind, kro, NULL);
	return (PyObject *)r;
}

static PyObject *
conn_import(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
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

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (name = arg_str(a[0], "name")) == NULL)
		return NULL;
	ts = lock_slow(s);
	note(&cr, s->c, s->c != NULL ? gpx_import(s->c, name, &id, &len) : -GPX_ECONN);
	if (cr.r == 0)
		kind = client_last_region(s->c, &kro);
	unlock_quick(s, ts);
	conn_after_rpc(s);
	if (cr.r < 0)
		return raise_call(s->st, &cr);
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

static PyObject *
conn_export(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
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

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0)
		return NULL;
	remote = a[6] != NULL && a[6] != Py_None;
	if (!Py_IS_TYPE(a[0], s->st->region_type) || ((Region *)a[0])->conn != s) {
		PyErr_SetString(PyExc_TypeError, "region must be a gpx.Region of this connection");
		return NULL;
	}
	r = (Region *)a[0];
	if ((name = arg_str(a[1], "name")) == NULL || (a[2] != NULL && (rule = arg_str(a[2], "rule")) == NULL))
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
	if (a[3] != NULL && a[3] != Py_None && arg_u64(a[3], "gid", &gid) < 0)
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
		if (a[5] != Py_True && arg_u64(a[5], "notify", &o.notify_tag) < 0)
			return NULL;
	}
	if (remote) {
		if ((plist = peers_list(a[6], &all)) == NULL && !all)
			return NULL;
		if (plist != NULL && (peers = arg_str(plist, "peers")) == NULL) {
			Py_DECREF(plist);
			return NULL;
		}
	}
	ts = lock_slow(s);
	if (s->c == NULL)
		note(&cr, NULL, -GPX_ECONN);
	else if (remote)
		note(&cr, s->c, gpx_export_remote(s->c, r->id, name, &o, peers));
	else
		note(&cr, s->c, gpx_export(s->c, r->id, name, &o));
	unlock_quick(s, ts);
	conn_after_rpc(s);
	Py_XDECREF(plist);
	if (cr.r < 0)
		return raise_call(s->st, &cr);
	Py_RETURN_NONE;
}

static PyObject *
conn_unexport(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "unexport", 1, 1, { "name", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[1];
	const char *name;
	struct callres cr;
	PyThreadState *ts;

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    (name = arg_str(a[0], "name")) == NULL)
		return NULL;
	ts = lock_slow(s);
	note(&cr, s->c, s->c != NULL ? gpx_unexport(s->c, name) : -GPX_ECONN);
	unlock_quick(s, ts);
	conn_after_rpc(s);
	if (cr.r < 0)
		return raise_call(s->st, &cr);
	Py_RETURN_NONE;
}

/* ---- Conn: completions ---- */

/* Moves up to max backlog entries into list (as Completions). */
static int
backlog_to_list(Conn *s, PyObject *list, Py_ssize_t max)
{
	size_t k = 0;
	int r = 0;

	while (k < s->nback && PyList_Size(list) < max) {
		struct bentry *e = &s->back[k];
		PyObject *c = completion_new(s->st, &e->c, e->reason);
		if (c == NULL || PyList_Append(list, c) < 0) {
			Py_XDECREF(c);
			r = -1;
			break;
		}
		Py_DECREF(c);
		if (e->t != NULL)
			e->t->in_backlog = false;
		Py_XDECREF(e->reason);
		k++;
	}
	backlog_cut(s, 0, k);
	return r;
}

/* poll's work: backlog first, then what the library has, up to max. */
static PyObject *
poll_into(Conn *s, Py_ssize_t max)
{
	PyObject *list = PyList_New(0);
	struct pulled b[PULL_MAX];
	struct callres cr;
	int n;

	if (list == NULL || backlog_to_list(s, list, max) < 0)
		goto fail;
	while (PyList_Size(list) < max) {
		Py_ssize_t want = max - PyList_Size(list);
		n = conn_pull(s, b, want < PULL_MAX ? (int)want : PULL_MAX, true, &cr);
		if (n < 0) {
			if (n == -GPX_ECONN)
				conn_resolve_all(s, n, cr.reason);
			if (PyList_Size(list) > 0)
				break;
			raise_call(s->st, &cr);
			goto fail;
		}
		if (route_batch(s, b, n, list, max, false) < 0)
			goto fail;
		if (n < (want < PULL_MAX ? want : PULL_MAX))
			break;
	}
	return list;
fail:
	Py_XDECREF(list);
	return NULL;
}

static int
arg_max(PyObject *o, Py_ssize_t *max)
{
	*max = 64;
	if (o == NULL)
		return 0;
	*max = PyLong_AsSsize_t(o);
	if (*max == -1 && PyErr_Occurred())
		return -1;
	if (*max < 1) {
		PyErr_SetString(PyExc_ValueError, "max must be at least 1");
		return -1;
	}
	return 0;
}

static PyObject *
conn_poll(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "poll", 1, 0, { "max", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[1];
	Py_ssize_t max;

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 || arg_max(a[0], &max) < 0)
		return NULL;
	return poll_into(s, max);
}

static PyObject *
conn_wait(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "wait", 1, 0, { "timeout", "max", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[2];
	Py_ssize_t max;
	double timeout;
	int r;

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    arg_timeout(a[0], &timeout) < 0 || arg_max(a[1], &max) < 0)
		return NULL;
	if ((r = conn_wait_until(s, pred_backlog, NULL, timeout, true)) < 0)
		return NULL;
	return poll_into(s, max);
}

/* _drain(): the asyncio glue's reader callback: routes all that arrived, never blocks. */
static PyObject *
conn_drain(PyObject *op, PyObject *unused)
{
	Conn *s = (Conn *)op;
	struct pulled b[PULL_MAX];
	struct callres cr;
	int n;

	if (s->closed || s->fork_gen != fork_gen)
		Py_RETURN_NONE;
	do {
		n = conn_pull(s, b, PULL_MAX, true, &cr);
		if (n == -GPX_ECONN) {
			conn_resolve_all(s, n, cr.reason);
			break;
		}
		if (n < 0)
			return raise_call(s->st, &cr);
		if (route_batch(s, b, n, NULL, 0, false) < 0)
			return NULL;
	} while (n == PULL_MAX);
	Py_RETURN_NONE;
}

/* ---- Conn: lifetime ---- */

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
	if (s->fork_gen != fork_gen) {
		gpx_close(s->c);
		s->c = NULL;
		if (s->wakefd >= 0)
			close(s->wakefd);
		s->wakefd = -1;
		conn_resolve_all(s, -GPX_ECONN, "the connection belongs to the parent process");
		backlog_clear(s);
		keep_drop_all(s);
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
		PyThreadState *ts = lock_slow(s);
		for (size_t i = 0; s->c != NULL && i < n; i++)
			(void)gpx_cancel(s->c, tags[i]);
		unlock_quick(s, ts);
		free(tags);
		if (conn_wait_until(s, pred_none_pending, NULL, CLOSE_DRAIN_S, false) <= 0)
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
	conn_resolve_all(s, -GPX_ECONN, "the connection was closed before the transfer completed");
	backlog_clear(s);
	keep_drop_all(s);
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
	if (s->sync_made && s->fork_gen == fork_gen) {
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
	ts = lock_quick(s);
	if (s->c != NULL)
		n = gpx_dropped(s->c);
	unlock_quick(s, ts);
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

	set_ref(&s->aio, v != NULL && v != Py_None ? Py_NewRef(v) : NULL);
	return 0;
}

/*
 * _c_bench(src, dst, size, iters, mode): the benchmark's C loops on this connection, the GIL
 * released throughout.  "copy_wait": gpx_copy then gpx_wait for it, iters times; returns each
 * round trip in seconds.  "submit": iters gpx_copy calls in batches of 32, each batch timed and
 * then drained untimed; returns the seconds spent submitting.
 */
static PyObject *
conn_c_bench(PyObject *op, PyObject *args)
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
	    regions_of(s, a, b, &src, &dst) < 0)
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
	PyThreadState *ts = lock_slow(s);
	struct gpx_completion done[64];
	for (unsigned long long i = 0; s->c != NULL && cr.r >= 0 && i < iters;) {
		double t0 = now_s();
		if (copy_wait) {
			if (note(&cr, s->c, gpx_copy(s->c, src->id, 0, dst->id, 0, size, TAG_BENCH | i)) < 0 ||
			    note(&cr, s->c, gpx_wait(s->c, done, 1, -1)) < 0)
				break;
			lat[i++] = now_s() - t0;
			if (done[0].status < 0)
				note(&cr, NULL, done[0].status);
			continue;
		}
		unsigned long long k = iters - i < 32 ? iters - i : 32;
		for (unsigned long long j = 0; j < k && cr.r >= 0; j++)
			note(&cr, s->c, gpx_copy(s->c, src->id, 0, dst->id, 0, size, TAG_BENCH | (i + j)));
		total += now_s() - t0;
		i += k;
		while (cr.r >= 0 && gpx_outstanding(s->c) > 0) {
			int n = note(&cr, s->c, gpx_wait(s->c, done, 64, -1));
			for (int j = 0; j < n; j++)
				if (done[j].status < 0)
					note(&cr, NULL, done[j].status);
		}
	}
	unlock_quick(s, ts);
	if (cr.r < 0)
		raise_call(s->st, &cr);
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

#define FAST(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL | METH_KEYWORDS

static PyMethodDef conn_methods[] = {
	{ "register", FAST(conn_register),
	  "register(obj, *, read_only=False) -> Region\n--\n\n"
	  "Hands memory to gpxd (the GIL released).  obj is a CUDA tensor or array (data_ptr() with "
	  "device and nbytes, __cuda_array_interface__, or __dlpack__), a gpx.HostBuffer, or a view of "
	  "host memory inside one (a numpy array or CPU tensor made with frombuffer, a memoryview).  "
	  "It must be contiguous.  The region keeps obj alive until deregister() or close().  "
	  "read_only: the region may only be a source.  CUDA memory must be ready (synchronise the "
	  "stream that wrote it) before a copy reads it." },
	{ "import_", FAST(conn_import),
	  "import_(name) -> Region\n--\n\nImports another client's export by name (\"NODE:name\" or "
	  "\"@HOST:PORT/name\" for another node's)." },
	{ "export", FAST(conn_export),
	  "export(region, name, *, rule='uid', gid=None, read_only=False, notify=False, peers=None)\n--\n\n"
	  "Shares a registered region under a name.  rule: who may import it, 'uid' (the same user), "
	  "'gid' (members of gid, default this process's group) or 'any'.  read_only: importers may "
	  "only read.  notify: True (or a tag) to be told of each peer's copy into it: a Completion "
	  "with notify=True and that tag (True: the region's id).  peers: None for this node only; "
	  "True or '*' for any peer node; a list (or comma-separated str) of node names." },
	{ "unexport", FAST(conn_unexport), "unexport(name)\n--\n\nWithdraws an export." },
	{ "copy", FAST(conn_copy),
	  "copy(src, dst, length=None, *, src_offset=0, dst_offset=0, tag=None) -> Transfer\n--\n\n"
	  "Asks gpxd to copy length bytes (None: the rest of src from src_offset) from src to dst; "
	  "returns at once.  tag: an int below 2**62 of one's own (unique among transfers not yet "
	  "complete), else one is made." },
	{ "copyv", FAST(conn_copyv),
	  "copyv(src, dst, segments, *, tag=None) -> Transfer\n--\n\n"
	  "Many pieces in one request, checked whole before any byte moves: segments is an (n, 3) "
	  "array of 64-bit integers (src_offset, dst_offset, length), read in place through the buffer "
	  "protocol, or a sequence of such triples." },
	{ "copy_pages", FAST(conn_copy_pages),
	  "copy_pages(src, dst, page_size, src_pages, dst_pages, *, src_offset=0, dst_offset=0, tag=None) "
	  "-> Transfer\n--\n\n"
	  "Copies page src_pages[i] of src (at src_offset + src_pages[i] * page_size) to page "
	  "dst_pages[i] of dst, page_size bytes each: KV-cache blocks by number.  The page lists are "
	  "int32/uint32 arrays or CPU tensors read in place (or sequences of ints); negative numbers "
	  "are refused." },
	{ "poll", FAST(conn_poll),
	  "poll(max=64) -> list[Completion]\n--\n\nCompletions not consumed by a Transfer, without "
	  "blocking: those kept while waiting first, then what has arrived." },
	{ "wait", FAST(conn_wait),
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
	{ "_drain", conn_drain, METH_NOARGS, "Routes all arrived completions without blocking (internal: asyncio)." },
	{ "_c_bench", conn_c_bench, METH_VARARGS, "The benchmark's C loops (internal: gpx.bench)." },
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

static PyType_Spec conn_spec = {
	.name = "gpx.Conn",
	.basicsize = sizeof(Conn),
	.flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
	.slots = conn_slots,
};

/* ---- module functions ---- */

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
mod_connect(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "connect", 2, 0, { "socket", "name", NULL } };
	struct modstate *st = PyModule_GetState(module);
	PyObject *a[2];
	const char *sock = NULL, *name = NULL;
	pthread_condattr_t ca;
	gpx_conn *c = NULL;
	int r;

	if (args_bind(&spec, args, nargs, kwnames, a) < 0 ||
	    (a[0] != NULL && a[0] != Py_None && (sock = arg_str(a[0], "socket")) == NULL) ||
	    (a[1] != NULL && a[1] != Py_None && (name = arg_str(a[1], "name")) == NULL))
		return NULL;
	Conn *s = (Conn *)PyType_GenericAlloc(st->conn_type, 0);
	if (s == NULL)
		return NULL;
	s->st = st;
	s->wakefd = -1;
	s->fork_gen = fork_gen;
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
		return raise_error(st, -GPX_ESYS, "eventfd", errno);
	}
	/* The doorbell is ours, so that conn_kick can ring it too. */
	struct gpx_connect_opts o = { .socket = sock, .name = name, .eventfd = s->wakefd };
	Py_BEGIN_ALLOW_THREADS
	r = gpx_connect_opts(&o, &c);
	Py_END_ALLOW_THREADS
	if (r < 0) {
		char why[200];
		const char *path = sock ? sock : getenv("GPX_SOCKET") ? getenv("GPX_SOCKET") : GPX_DEFAULT_SOCKET;
		int e = errno;
		snprintf(why, sizeof(why), "cannot connect to gpxd at %s", path);
		Py_DECREF(s);
		return raise_error(st, r, why, e);
	}
	s->c = c;
	s->closed = false;
	s->fd = gpx_fd(c);
	s->client_id = gpx_client_id(c);
	client_refusal_hook(c, on_refusal, s);
	return (PyObject *)s;
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
	set_ref(&st->await_hook, Py_NewRef(fn));
	Py_RETURN_NONE;
}

static PyMethodDef mod_methods[] = {
	{ "connect", FAST(mod_connect),
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

/* ---- the module ---- */

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
	fork_gen++;
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
