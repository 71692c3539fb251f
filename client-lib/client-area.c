/*
 * libgpxclient's segment area: the memfd, shared read-only with gpxd, that segment and page
 * lists too long for a message travel in (proto/ring.h), used as a ring of lists.  Made and
 * handed to the daemon (SegArea) on first need and replaced by a larger one when a list does
 * not fit; room is taken for a list, and given back once the ring's header says the daemon
 * has copied it out.  What goes into it is client-transfer.c's and client-region.c's affair.
 */
#include "config.h"

#include <fcntl.h>
#include <sched.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#include "client-lib/client-private.h"

#define AREA_MIN (2u << 20)

/*
 * The pages of a new area, allocated and mapped for writing now, once: the lists go round the
 * whole area, and a page touched for the first time by a list costs that list a fault (12-30
 * us each on a virtual machine: a Python client's submit of a 256-page list took 34 us until
 * the area had gone round once, 9.5 us after).  The area is this process's own memory.  Only
 * an area of the first size, for lists shorter than 1 MiB: one grown for longer lists is left
 * to take its faults as they are written, in proportion to their length (faulting in such an
 * area at once, even its first 4 MiB, made the loop of a gpxd on the same 2 CPUs slower at its
 * own faults: one turn of budget.test's took 8-16 ms of CPU instead of 3.5-3.9).
 */
static void
area_fault_in(struct area *a, size_t len)
{
	const long page = sysconf(_SC_PAGESIZE);

#ifdef MADV_POPULATE_WRITE
	if (madvise(a->p, len, MADV_POPULATE_WRITE) == 0)
		return;
#endif
	/* (kernels before 5.14: a write to each page; the area holds no list yet) */
	for (size_t off = 0; off < len; off += page > 0 ? (size_t)page : 4096)
		((volatile unsigned char *)a->p)[off] = 0;
}

/* Makes an area of at least `need` bytes and hands it to the daemon, replacing the old one. */
static int
area_grow(gpx_conn *c, size_t need)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__SegArea sa = GPX__SEG_AREA__INIT;
	struct area a = { .fd = -1 };
	size_t len = AREA_MIN;
	int r;

	while (len < 2 * need && len < GPX_AREA_MAX)
		len *= 2;
	if (need > len)
		return client_error(c, GPX_EINVAL, "segment list larger than the largest segment area");
	a.fd = memfd_create("gpx-segments", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (a.fd < 0 || ftruncate(a.fd, len) < 0 ||
	    fcntl(a.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0 ||
	    (a.p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, a.fd, 0)) == MAP_FAILED) {
		a.p = NULL;
		client_area_free(&a);
		return client_error(c, GPX_ESYS, "cannot create the segment area");
	}
	if (len == AREA_MIN)
		area_fault_in(&a, len);
	a.len = len;
	sa.length = len;
	m.body_case = GPX__CLIENT_MSG__BODY_SEG_AREA;
	m.seg_area = &sa;
	/* Its reply also says the daemon is done with every list in the old area. */
	if ((r = client_rpc(c, &m, &a.fd, 1, NULL, NULL, NULL)) < 0) {
		client_area_free(&a);
		return r;
	}
	client_area_free(&c->area);
	c->area = a;
	return 0;
}

/* Frees the space of the lists the daemon has copied out. */
static void
area_reclaim(gpx_conn *c)
{
	struct area *a = &c->area;
	uint64_t done = __atomic_load_n(&c->ring->segs_consumed, __ATOMIC_ACQUIRE);

	while (a->qn > 0 && a->q[a->qhead].index < done) {
		a->tail = a->q[a->qhead].end;
		a->qhead = (a->qhead + 1) % a->qcap;
		a->qn--;
	}
	if (a->qn == 0)
		a->tail = a->head;
}

/* Finds room for need bytes (a list never wraps): its position.  Waits briefly if the area is full. */
int
client_area_room(gpx_conn *c, size_t need, uint64_t *at)
{
	struct area *a = &c->area;
	int r;

	if (a->p == NULL || need > a->len / 2) {
		if ((r = area_grow(c, need)) < 0)
			return r;
	}
	for (int spins = 0;; spins++) {
		area_reclaim(c);
		uint64_t pos = a->head;
		if (pos % a->len + need > a->len)
			pos += a->len - pos % a->len;
		if (pos + need - a->tail <= a->len) {
			*at = pos;
			return 0;
		}
		/* The daemon copies lists out as it reads the socket: it is never long. */
		if (c->dead || spins > 1000000)
			return client_error(c, GPX_EBUSY, "the segment area stays full");
		sched_yield();
	}
}

/* Whether segs points into the segment area (a reserved list, or a stale pointer to one). */
bool
client_area_in(const gpx_conn *c, const struct gpx_seg *segs)
{
	uintptr_t p = (uintptr_t)segs, base = (uintptr_t)c->area.p;

	return c->area.p != NULL && p >= base && p < base + c->area.len;
}

/* Takes need bytes of room in the area for a list: where to write it, its offset in *off. */
int
client_area_take(gpx_conn *c, size_t need, void **p, uint64_t *off)
{
	struct area *a = &c->area;
	uint64_t pos;
	int r;

	if ((r = client_area_room(c, need, &pos)) < 0)
		return r;
	*p = a->p + pos % a->len;
	*off = pos % a->len;
	a->head = pos + need;
	return 0;
}

/*
 * Puts segs into the area, *off is where they start: a list written in place in the room of
 * gpx_segs_reserve stays where it is, anything else is copied in.
 */
int
client_area_put(gpx_conn *c, const struct gpx_seg *segs, size_t n, uint64_t *off)
{
	struct area *a = &c->area;
	size_t need = n * sizeof(*segs);
	void *p;
	int r;

	if (client_area_in(c, segs)) {
		if (a->resv_n == 0 || (const unsigned char *)segs != a->p + a->resv % a->len || n > a->resv_n)
			return client_error(c, GPX_EINVAL, "a list in the segment area outside the room reserved for it");
		*off = a->resv % a->len;
		a->head = a->resv + need;
		return 0;
	}
	if ((r = client_area_take(c, need, &p, off)) < 0)
		return r;
	memcpy(p, segs, need);
	return 0;
}

/* Records the list just sent, to be freed once the daemon reports it consumed. */
void
client_area_sent(gpx_conn *c)
{
	struct area *a = &c->area;

	a->used++;
	if (a->qn == a->qcap) {
		size_t ncap = a->qcap ? a->qcap * 2 : 64;
		struct area_use *q = malloc(ncap * sizeof(*q));
		if (q == NULL)
			return;      /* then its space is reclaimed with the next one's */
		for (size_t i = 0; i < a->qn; i++)
			q[i] = a->q[(a->qhead + i) % a->qcap];
		free(a->q);
		a->q = q;
		a->qhead = 0;
		a->qcap = ncap;
	}
	a->q[(a->qhead + a->qn) % a->qcap] = (struct area_use){ .index = a->used - 1, .end = a->head };
	a->qn++;
}
