/*
 * Unit tests of region lifetimes and the completion queue (tests/unit.c runs them): use and
 * revoke, the mapping closed by its last user (daemon/core/region.c); the queue's credits, doorbell
 * and the detection of a broken client (daemon/core/cq.c).
 */
#include "config.h"

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>

#include "daemon/gpxd.h"
#include "tests/tap.h"
#include "tests/unit.h"

/* ---- region.c ---- */

static int closes;

static void
fake_close(struct region *r)
{
	(void)r;
	closes++;
}

static const struct mem_ops fake_ops = { .name = "fake", .close = fake_close };

void
test_region(void)
{
	struct region *r = region_new();

	ok(r != NULL && region_refs(r) == 1 && region_users(r) == 1 && !atomic_load(&r->revoked) &&
	    r->fd == -1 && r->dev == DEV_HOST, "region_new: one ref, one user, not revoked");
	/* The counts, written by the loop and the copy workers, share no cache line with what the
	 * workers read as they issue a job's pieces. */
	ok((uintptr_t)r % 64 == 0 && offsetof(struct region, revoked) >= offsetof(struct region, counts) + 64 &&
	    offsetof(struct region, dptr) / 64 != offsetof(struct region, counts) / 64,
	    "region_new: the counts on a cache line of their own");
	r->ops = &fake_ops;
	ok(region_use(r) && region_users(r) == 2, "region_use takes a user");
	region_revoke(r);
	ok(atomic_load(&r->revoked) && region_users(r) == 1 && closes == 0,
	    "region_revoke drops the owner's user; a running job keeps the mapping");
	ok(!region_use(r), "region_use fails once revoked");
	region_unuse(r);
	ok(closes == 1 && region_users(r) == 0, "the last user closes the mapping");
	region_revoke(r);
	ok(closes == 1 && region_users(r) == 0, "revoking twice changes nothing");
	ok(!region_use(r), "region_use fails with no user left");
	region_ref(r);
	ok(region_refs(r) == 2, "region_ref");
	/* What the region holds goes with its last reference, not before: a queue reference it
	 * carries shows which unref tore it down (and the sanitizer build sees any leak of it). */
	char qerr[128];
	int qefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct cq *held = cq_new(8, qefd, 2, qerr, sizeof(qerr));
	cq_ref(held);
	r->notify_cq = held;
	region_unref(r);
	ok(region_refs(r) == 1 && atomic_load(&held->refs) == 2, "region_unref of one of two references keeps it");
	region_unref(r);     /* freed here; the sanitizer build would see any use after */
	ok(atomic_load(&held->refs) == 1, "region_unref frees on the last reference, and drops what the region held");
	cq_unref(held);

	r = region_new();
	r->ops = &fake_ops;
	region_revoke(r);
	ok(closes == 2, "revoking an idle region closes its mapping at once");
	region_unref(r);

	/* A job's hold: a user and a reference in one step, given back in one. */
	r = region_new();
	r->ops = &fake_ops;
	ok(region_hold(r) && region_hold(r) && region_users(r) == 3 && region_refs(r) == 3,
	    "region_hold takes a user and a reference (twice: 3 and 3)");
	region_drop(r);
	ok(region_users(r) == 2 && region_refs(r) == 2 && closes == 2, "region_drop gives both back");
	region_revoke(r);
	ok(!region_hold(r) && region_users(r) == 1 && region_refs(r) == 2 && closes == 2,
	    "region_hold fails once revoked, and takes nothing");
	region_ref(r);                      /* an importer's handle, so that the struct outlives the drop */
	region_drop(r);
	ok(closes == 3 && region_users(r) == 0 && region_refs(r) == 2,
	    "region_drop by the last user closes the mapping, the struct stays referenced");
	region_unref(r);
	region_unref(r);     /* freed here */
	r = region_new();
	r->ops = &fake_ops;
	ok(region_hold(r), "a job holds a new region");
	region_revoke(r);
	region_unref(r);                    /* the owner's handle goes while the job runs */
	region_drop(r);                     /* closes, then frees: the sanitizer build sees any use after */
	ok(closes == 4, "the job's drop, last of all, closes the mapping and frees the region");

	/* An owner's notification queue goes with the mapping, not with the last importer. */
	char err[128];
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct cq *q = cq_new(8, efd, 1, err, sizeof(err));
	r = region_new();
	r->ops = &fake_ops;
	cq_ref(q);
	r->notify_cq = q;
	region_ref(r);                      /* an importer's handle */
	region_revoke(r);                   /* the owner leaves */
	ok(atomic_load(&q->refs) == 1, "the notify queue is released when the mapping closes, while importers remain");
	region_unref(r);
	region_unref(r);
	cq_unref(q);
}

/* ---- cq.c ---- */

/* cq.c gives a doorbell write DOORBELL_TIMEOUT_NS (10 ms) before it calls the client broken;
 * a full counter on a non-blocking eventfd fails at once.  The margin is for a slow machine. */
#define DOORBELL_BOUND_MS (10 + 90)

static double
mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static struct cq *broken_seen;
static int broken_calls;

static void
on_broken(struct cq *q)
{
	broken_seen = q;
	broken_calls++;
}

static uint64_t
efd_read(int efd)
{
	uint64_t v = 0;

	if (read(efd, &v, sizeof(v)) != sizeof(v))
		return 0;
	return v;
}

void
test_cq(void)
{
	char err[256];
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct cq *q = cq_new(8, efd, 42, err, sizeof(err));
	int r = 0;

	cq_set_broken_hook(on_broken);
	ok(q != NULL, "cq_new (%s)", q ? "ok" : err);
	if (q == NULL)
		return;
	struct gpx_ring_hdr *h = q->ring;
	ok(h->magic == GPX_RING_MAGIC && h->version == GPX_RING_VERSION && h->entries == 8 &&
	    h->entry_size == sizeof(struct gpx_cqe) && h->head == 0 && h->tail == 0, "the ring header is set up");
	int seals = fcntl(q->ring_fd, F_GET_SEALS);
	ok(seals >= 0 && (seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
	    "the ring memfd is sealed against shrinking, growing and further sealing");
	ok(ftruncate(q->ring_fd, 0) < 0, "so the client cannot truncate it under the daemon");

	for (int i = 0; i < 8; i++)
		r |= cq_reserve(q);
	ok(r == 0 && q->inflight == 8, "8 credits on an 8-entry ring");
	ok(cq_reserve(q) == -GPX__STATUS__EBUSY, "the 9th reservation is EBUSY");
	cq_post(q, 100, 0, 5);
	struct gpx_cqe *e = gpx_ring_slot(h, 0);
	ok(h->head == 1 && e->tag == 100 && e->bytes == 5 && e->status == 0 && e->flags == 0,
	    "cq_post writes the record and publishes head");
	ok(efd_read(efd) == 1, "and rings the doorbell once");
	ok(cq_reserve(q) == -GPX__STATUS__EBUSY, "an unread record still holds its slot");
	__atomic_store_n(&h->tail, 1, __ATOMIC_RELEASE);
	ok(cq_reserve(q) == 0, "once the client moves tail, the slot is free again");
	cq_notify(q, 7, 3, 99);
	ok(h->head == 1 && h->dropped == 1, "a notification with no free slot is dropped and counted");
	cq_unreserve(q);
	ok(q->inflight == 7, "cq_unreserve gives a credit back");
	cq_notify(q, 7, 3, 99);
	e = gpx_ring_slot(h, 1);
	ok(h->head == 2 && e->tag == 7 && e->region == 3 && e->bytes == 99 && (e->flags & GPX_CQE_NOTIFY) &&
	    efd_read(efd) == 1, "a notification with room is posted, flagged, with a doorbell");
	for (int i = 0; i < 7; i++)
		cq_post(q, 200 + i, i == 3 ? GPX__STATUS__EIO : 0, 1);
	ok(h->head == 9 && q->inflight == 0 && gpx_ring_slot(h, 8)->tag == 206 && gpx_ring_slot(h, 0)->tag == 206 &&
	    gpx_ring_slot(h, 5)->status == GPX__STATUS__EIO, "records wrap around the ring");
	ok(efd_read(efd) == 7, "one doorbell per record");
	ok(cq_reserve(q) == -GPX__STATUS__EBUSY, "8 unread records and nothing in flight: EBUSY");
	__atomic_store_n(&h->tail, 9, __ATOMIC_RELEASE);
	for (int i = 0; i < 8; i++)
		r |= cq_reserve(q);
	ok(r == 0 && cq_reserve(q) == -GPX__STATUS__EBUSY, "all read: 8 credits again, then EBUSY");
	for (int i = 0; i < 8; i++)
		cq_unreserve(q);
	ok(!q->broken && broken_calls == 0, "nothing so far broke the queue");

	/* The client publishes a tail ahead of head. */
	__atomic_store_n(&h->tail, h->head + 1, __ATOMIC_RELEASE);
	ok(cq_reserve(q) == -GPX__STATUS__EPROTO && q->broken, "a tail ahead of head breaks the queue");
	ok(broken_calls == 1 && broken_seen == q, "and the broken hook is told once");
	ok(cq_reserve(q) == -GPX__STATUS__EPROTO && broken_calls == 1, "a broken queue refuses, without telling again");
	uint64_t head = h->head;
	cq_post(q, 1, 0, 0);
	ok(h->head == head, "a broken queue gets no more records");
	cq_unref(q);
	ok(fcntl(efd, F_GETFD) < 0 && errno == EBADF, "the last cq_unref closes the client's eventfd");

	/* A tail that fell more than `entries` behind. */
	efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	q = cq_new(8, efd, 43, err, sizeof(err));
	for (int i = 0; i < 8; i++) {
		cq_reserve(q);
		cq_post(q, i, 0, 0);
		__atomic_store_n(&q->ring->tail, i + 1, __ATOMIC_RELEASE);
	}
	cq_reserve(q);
	cq_post(q, 8, 0, 0);
	__atomic_store_n(&q->ring->tail, 0, __ATOMIC_RELEASE);
	ok(cq_reserve(q) == -GPX__STATUS__EPROTO && q->broken && broken_calls == 2,
	    "a tail more than `entries` behind head breaks the queue");
	cq_unref(q);

	/* A doorbell that cannot ring: the counter is full. */
	efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	q = cq_new(8, efd, 44, err, sizeof(err));
	uint64_t max = 0xfffffffffffffffeULL;
	(void)!write(efd, &max, sizeof(max));
	cq_reserve(q);
	double t0 = mono_ms();
	cq_post(q, 1, 0, 0);
	double took = mono_ms() - t0;
	ok(q->broken && broken_calls == 3 && took < DOORBELL_BOUND_MS,
	    "an eventfd whose counter is full breaks the queue, without blocking (%.1f ms, bound %d)", took,
	    DOORBELL_BOUND_MS);
	cq_unref(q);

	/* A client that cleared O_NONBLOCK on its eventfd cannot make the daemon block. */
	efd = eventfd(0, EFD_CLOEXEC);
	int dup_efd = dup(efd);
	q = cq_new(8, efd, 45, err, sizeof(err));
	(void)!write(dup_efd, &max, sizeof(max));
	cq_reserve(q);
	t0 = mono_ms();
	cq_post(q, 1, 0, 0);
	took = mono_ms() - t0;
	ok(q->broken && (fcntl(dup_efd, F_GETFL) & O_NONBLOCK) && took < DOORBELL_BOUND_MS,
	    "a blocking eventfd is made non-blocking first, and the doorbell gives up at once (%.1f ms, bound %d)",
	    took, DOORBELL_BOUND_MS);
	cq_unref(q);
	close(dup_efd);
	cq_set_broken_hook(NULL);
}
