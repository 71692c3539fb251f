/*
 * gpx._gpx, completions: reading them from the library and handing each to whoever takes it,
 * and waiting for them (Conn.poll, Conn.wait, Transfer.wait, and the asyncio glue's reader).
 *
 * Every transfer ends in one completion, consumed once: by its Transfer when a thread waits
 * for it (Transfer.wait, Transfer.done) or a coroutine awaits it, else by Conn.poll/wait.
 * Completions are routed as they are read, whoever reads them: each resolves its Transfer
 * object if that still lives, and goes to it if it is waited or awaited for, else to the
 * backlog, where poll() finds it and where a later Transfer.wait() takes its own out.  The
 * daemon's reason for a refused transfer is heard by a hook of the library and travels with
 * its completion.
 *
 * Waiting: one thread at a time sleeps on the connection's fd, as gpx_wait does; others wait
 * on a condition variable.  Whoever routes completions while others wait bumps a generation
 * count, wakes them, and rings the doorbell (an eventfd of the module's, handed to the
 * library) under the sleeping one.  The GIL is released while sleeping.
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

#include "client-lib/client.h"
#include "client-lib/python/_gpx.h"

#define FOLLOWER_SLICE_MS 200        /* a thread waiting behind the fd's watcher checks signals */

/* Appends a completion; takes reason. */
static int
route_backlog_push(Conn *s, const struct gpx_completion *c, PyObject *reason, Transfer *t)
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
	if (k == 0)
		return;
	memmove(&s->back[i], &s->back[i + k], (s->nback - i - k) * sizeof(*s->back));
	s->nback -= k;
}

/* Takes t's completion out of the backlog: t consumed it. */
void
route_backlog_take(Conn *s, Transfer *t)
{
	for (size_t i = 0; i < s->nback; i++)
		if (s->back[i].t == t) {
			Py_XDECREF(s->back[i].reason);
			backlog_cut(s, i, 1);
			break;
		}
	t->in_backlog = false;
}

void
route_backlog_clear(Conn *s)
{
	for (size_t i = 0; i < s->nback; i++) {
		if (s->back[i].t != NULL)
			s->back[i].t->in_backlog = false;
		Py_XDECREF(s->back[i].reason);
	}
	s->nback = 0;
}

/* The library's refusal hook: runs inside a library call, so under s->mu, without the GIL. */
void
route_on_refusal(void *arg, uint64_t tag, const char *text)
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
route_pull(Conn *s, struct pulled *out, int max, bool clear, struct callres *cr)
{
	struct gpx_completion comp[PULL_MAX];
	PyThreadState *ts = conn_lock_quick(s);
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
		gpxpy_note(cr, s->c, n);
		for (int i = 0; i < n; i++) {
			out[i].c = comp[i];
			out[i].reason = comp[i].status < 0 ? reason_take(s, comp[i].tag) : NULL;
		}
	}
	conn_unlock(s, ts);
	return n;
}

/* Tells threads waiting on s that completions were routed. */
void
route_kick(Conn *s)
{
	PyThreadState *ts = conn_lock_quick(s);
	uint64_t one = 1;

	__atomic_store_n(&s->gen, s->gen + 1, __ATOMIC_RELAXED);
	if (s->sleeping)
		(void)!write(s->wakefd, &one, sizeof(one));
	pthread_cond_broadcast(&s->cv);
	conn_unlock(s, ts);
}

/*
 * Hands one completion on: to its Transfer when a thread waits for it or a coroutine awaits
 * it, else to list (poll's result) or, with list NULL, to the backlog.  Takes p->reason.
 */
static int
route_one(Conn *s, struct pulled *p, PyObject *list)
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
		struct tagslot *slot = transfer_map_find(&s->pending, p->c.tag);
		if (slot != NULL) {
			t = slot->t;
			transfer_map_del(&s->pending, slot);
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
		return route_backlog_push(s, &p->c, reason, t);
	comp = completion_new(s->st, &p->c, reason);
	Py_XDECREF(reason);
	if (comp == NULL || PyList_Append(list, comp) < 0) {
		Py_XDECREF(comp);
		return -1;
	}
	Py_DECREF(comp);
	return 0;
}

/* Routes a batch (see route_one); wakes other waiters.  self_waits: the caller is one of them. */
static int
route_batch(Conn *s, struct pulled *b, int n, PyObject *list, Py_ssize_t max, bool self_waits)
{
	int r = 0;

	for (int i = 0; i < n; i++) {
		if (r == 0)
			r = route_one(s, &b[i], list != NULL && PyList_Size(list) < max ? list : NULL);
		else
			free(b[i].reason);
	}
	if (s->waiters > (self_waits ? 1u : 0u))
		route_kick(s);
	return r;
}

/* Resolves every transfer not yet complete with code: the connection is closed or lost. */
void
route_resolve_all(Conn *s, int code, const char *why)
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
		route_kick(s);
}

/*
 * Sleeps, the GIL released by the caller, until s's fd is readable, another thread routed
 * completions (the generation moved from seen), or timeout_ms (-1: no limit).  One thread
 * watches the fd; the others wait on the condition variable, in slices, to notice signals.
 * True when this thread slept on the fd: gpxd may have woken it early (client_sleep_begin),
 * and it should spin again.
 */
static bool
route_sleep(Conn *s, uint64_t seen, int timeout_ms)
{
	struct epoll_event ev;

	pthread_mutex_lock(&s->mu);
	if (s->c == NULL || __atomic_load_n(&s->gen, __ATOMIC_RELAXED) != seen) {
		pthread_mutex_unlock(&s->mu);
		return false;
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
		return false;
	}
	s->sleeping = true;
	gpx_conn *c = s->c;
	client_sleep_begin(c);
	pthread_mutex_unlock(&s->mu);
	/* As gpx_wait sleeps; a wake-up by route_kick reads like a doorbell. */
	(void)epoll_wait(s->fd, &ev, 1, timeout_ms);
	pthread_mutex_lock(&s->mu);
	client_sleep_end(c);
	s->sleeping = false;
	pthread_cond_broadcast(&s->cv);
	pthread_mutex_unlock(&s->mu);
	return true;
}

/*
 * Spins (the GIL released) until completions wait in the ring, another thread routed some,
 * or `until` passes.
 */
static void
route_spin(Conn *s, uint64_t seen, double until)
{
	/* gpxd rings no doorbell while this thread looks (client_spin_begin); the caller looks
	 * at the ring once more after the end, before it sleeps. */
	pthread_mutex_lock(&s->mu);
	gpx_conn *c = s->c;
	if (c != NULL)
		client_spin_begin(c);
	pthread_mutex_unlock(&s->mu);
	for (;;) {
		pthread_mutex_lock(&s->mu);
		bool ready = s->c == NULL || client_ring_ready(s->c);
		pthread_mutex_unlock(&s->mu);
		if (ready || __atomic_load_n(&s->gen, __ATOMIC_RELAXED) != seen || gpxpy_now() >= until)
			break;
#if defined(__x86_64__) || defined(__i386__)
		__builtin_ia32_pause();
#endif
	}
	pthread_mutex_lock(&s->mu);
	if (c != NULL && s->c == c)
		client_spin_end(c);
	pthread_mutex_unlock(&s->mu);
}

/*
 * Reads and routes completions until pred(s, arg) holds, sleeping with the GIL released in
 * between.  timeout < 0: no limit.  1 when pred holds, 0 on timeout, -1 with an exception
 * (a signal handler's, or ConnectionLostError once the connection is gone).
 */
int
route_wait_until(Conn *s, wait_pred pred, void *arg, double timeout, bool self_waits)
{
	double deadline = timeout >= 0 ? gpxpy_now() + timeout : 0, spin_until = 0;
	struct pulled b[PULL_MAX];
	struct callres cr;
	bool clear = false, pushed = false;
	int res, n;

	s->waiters++;
	for (;;) {
		if (pred(s, arg)) {
			res = 1;
			break;
		}
		uint64_t seen = __atomic_load_n(&s->gen, __ATOMIC_RELAXED);
		/* A first look without clearing the doorbell saves a system call when nothing came. */
		n = route_pull(s, b, PULL_MAX, clear, &cr);
		clear = true;
		if (n < 0) {
			/* Nothing pending can complete any more (the connection is lost or closed). */
			if (n == -GPX_ECONN)
				route_resolve_all(s, n, cr.reason);
			if (pred(s, arg)) {
				res = 1;
				break;
			}
			gpxpy_raise_call(s->st, &cr);
			res = -1;
			break;
		}
		if (n > 0) {
			const size_t nb = s->nback;
			if (route_batch(s, b, n, NULL, 0, self_waits) < 0) {
				res = -1;
				break;
			}
			pushed |= s->nback > nb;
			continue;
		}
		int ms = -1;
		if (timeout >= 0) {
			double left = deadline - gpxpy_now();
			if (left <= 0) {
				res = 0;
				break;
			}
			ms = left > 86400 ? 86400000 : (int)ceil(left * 1000);
		}
		if (timeout != 0 && spin_until == 0) {
			/* First, as gpx_wait does, look at the ring for a while: a wake-up costs more. */
			spin_until = gpxpy_now() + (s->c != NULL ? client_wait_spin(s->c) : 0);
			Py_BEGIN_ALLOW_THREADS
			route_spin(s, seen, spin_until);
			Py_END_ALLOW_THREADS
			continue;
		}
		bool slept;
		Py_BEGIN_ALLOW_THREADS
		slept = route_sleep(s, seen, ms);
		Py_END_ALLOW_THREADS
		if (slept)
			spin_until = 0;          /* woken, perhaps just before a record: spin again */
		if (PyErr_CheckSignals() < 0) {
			res = -1;
			break;
		}
	}
	s->waiters--;
	/*
	 * Completions this wait put in the backlog may have rung no doorbell (gpxd writes none
	 * while a wait spins), or the wait read it: whoever watches the fd (an event loop that
	 * calls poll()) must still hear of them.
	 */
	if (pushed && s->nback > 0 && s->wakefd >= 0) {
		uint64_t one = 1;
		(void)!write(s->wakefd, &one, sizeof(one));
	}
	return res;
}

/*
 * After a request that waited for its answer: completions the library read meanwhile (refused
 * transfers come over the socket and ring no doorbell) are routed now, or a thread sleeping
 * on the fd and an event loop watching it would not hear of them.
 */
void
route_after_rpc(Conn *s)
{
	struct pulled b[PULL_MAX];
	struct callres cr;
	int n;

	if (s->pending.n == 0)
		return;
	if ((n = route_pull(s, b, PULL_MAX, false, &cr)) > 0 && route_batch(s, b, n, NULL, 0, false) < 0)
		PyErr_WriteUnraisable((PyObject *)s);
}

bool
route_pred_resolved(Conn *s, void *arg)
{
	return ((Transfer *)arg)->resolved;
}

static bool
pred_backlog(Conn *s, void *arg)
{
	return s->nback > 0;
}

bool
route_pred_none_pending(Conn *s, void *arg)
{
	return s->pending.n == 0;
}

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
		n = route_pull(s, b, want < PULL_MAX ? (int)want : PULL_MAX, true, &cr);
		if (n < 0) {
			if (n == -GPX_ECONN)
				route_resolve_all(s, n, cr.reason);
			if (PyList_Size(list) > 0)
				break;
			gpxpy_raise_call(s->st, &cr);
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

PyObject *
route_poll(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "poll", 1, 0, { "max", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[1];
	Py_ssize_t max;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 || arg_max(a[0], &max) < 0)
		return NULL;
	return poll_into(s, max);
}

PyObject *
route_wait(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
	static const struct argspec spec = { "wait", 1, 0, { "timeout", "max", NULL } };
	Conn *s = (Conn *)op;
	PyObject *a[2];
	Py_ssize_t max;
	double timeout;
	int r;

	if (gpxpy_args(&spec, args, nargs, kwnames, a) < 0 || conn_usable(s) < 0 ||
	    gpxpy_timeout(a[0], &timeout) < 0 || arg_max(a[1], &max) < 0)
		return NULL;
	if ((r = route_wait_until(s, pred_backlog, NULL, timeout, true)) < 0)
		return NULL;
	return poll_into(s, max);
}

/* _drain(): the asyncio glue's reader callback: routes all that arrived, never blocks. */
PyObject *
route_drain(PyObject *op, PyObject *unused)
{
	Conn *s = (Conn *)op;
	struct pulled b[PULL_MAX];
	struct callres cr;
	int n;

	if (s->closed || s->fork_gen != gpxpy_fork_gen)
		Py_RETURN_NONE;
	do {
		n = route_pull(s, b, PULL_MAX, true, &cr);
		if (n == -GPX_ECONN) {
			route_resolve_all(s, n, cr.reason);
			break;
		}
		if (n < 0)
			return gpxpy_raise_call(s->st, &cr);
		if (route_batch(s, b, n, NULL, 0, false) < 0)
			return NULL;
	} while (n == PULL_MAX);
	Py_RETURN_NONE;
}
