/*
 * gpx._gpx, a connection's lock, and in a child of fork(), where it is no client, the refusal
 * of every call.  conn.c makes and closes a Conn; every file that calls the library through
 * one takes its lock here.
 *
 * Locking.  A gpx_conn is not thread-safe, so each Conn has a mutex around every library call,
 * taken only with the GIL released or by a trylock: no thread ever waits for it while holding
 * the GIL.  Calls that can block (connect, register, import, export, deregister, cancel,
 * close, waits) release the GIL; calls that cannot (copy submissions, polls) keep it when the
 * mutex is free, which costs less than releasing it.  What the Python side keeps of a Conn
 * (its transfers by tag, the backlog, the registered objects) is guarded by the GIL.
 */
#include "config.h"

#include <pthread.h>

#include "client-lib/python/_gpx.h"

/*
 * Takes s->mu for a call that does not block: by trylock, keeping the GIL, when it is free;
 * else with the GIL released while waiting.  Returns the thread state conn_unlock restores.
 */
PyThreadState *
conn_lock_quick(Conn *s)
{
	PyThreadState *ts;

	if (pthread_mutex_trylock(&s->mu) == 0)
		return NULL;
	ts = PyEval_SaveThread();
	pthread_mutex_lock(&s->mu);
	return ts;
}

void
conn_unlock(Conn *s, PyThreadState *ts)
{
	pthread_mutex_unlock(&s->mu);
	if (ts != NULL)
		PyEval_RestoreThread(ts);
}

/* Takes s->mu with the GIL released: for calls that take long (or may block). */
PyThreadState *
conn_lock_slow(Conn *s)
{
	PyThreadState *ts = PyEval_SaveThread();

	pthread_mutex_lock(&s->mu);
	return ts;
}

/* Whether new calls may use s: 0, or -1 with ConnectionLostError. */
int
conn_usable(Conn *s)
{
	if (s->fork_gen != gpxpy_fork_gen) {
		gpxpy_raise_errno(s->st, -GPX_ECONN, "the connection belongs to the parent process (this is a "
		    "child of fork()): connect again here", 0);
		return -1;
	}
	if (s->closed) {
		gpxpy_raise_errno(s->st, -GPX_ECONN, "the connection is closed", 0);
		return -1;
	}
	return 0;
}
