/*
 * gpx._gpx, the Transfers not yet complete: a map of the Conn's by tag (open addressing,
 * linear probing), which holds them borrowed: a Transfer that dies leaves its slot empty, and
 * its completion goes to poll().  route.c resolves a Transfer here when its completion is
 * read, and wakes the asyncio glue's callback; transfer.c enters and removes them.
 */
#include "config.h"

#include <stdlib.h>

#include "client-lib/python/_gpx.h"

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
