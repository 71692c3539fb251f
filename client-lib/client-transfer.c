/*
 * libgpxclient's transfers: a copy asked for in every shape gpx.h offers (gpx_copy,
 * gpx_copyv, gpx_copy_pages, gpx_copy_batch, gpx_copy_pages_batch, a list made in place with
 * gpx_segs_reserve), gpx_cancel, and gpx_copy_sync, a copy and the wait for it.  A single
 * segment goes through the submission queue in the ring's shared memory when there is room;
 * a short list inside the Transfer message; anything longer, and every page list and batch,
 * through the segment area (client-area.c).  Each transfer takes one credit, a slot of the
 * completion ring, given back when its completion is read.
 */
#include "config.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "client-lib/client-private.h"

#define SYNC_TAG_BIT (1ULL << 63)    /* tags of gpx_copy_sync; reserved for the library */
#define AREA_INLINE_MAX 64         /* up to this many segments travel inside the message */

_Static_assert(sizeof(struct gpx_seg) == sizeof(struct gpx_wire_seg), "segment layout");

/*
 * A single-segment transfer through the submission queue: no message at all while the daemon
 * polls, an SqKick when it said it sleeps.  Returns 1 if the queue is full (then the transfer
 * goes as a message).
 */
static int
sq_put(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *s, uint64_t tag)
{
	struct gpx_ring_hdr *h = c->ring;

	if (c->sq_tail - __atomic_load_n(&h->sq_head, __ATOMIC_ACQUIRE) >= c->entries)
		return 1;
	struct gpx_sqe *e = gpx_sq_slot(h, c->entries, c->sq_tail);
	*e = (struct gpx_sqe){ .tag = tag, .src_region = src, .dst_region = dst, .src_offset = s->src_offset,
		.dst_offset = s->dst_offset, .length = s->length };
	c->sq_tail++;
	__atomic_store_n(&h->sq_tail, c->sq_tail, __ATOMIC_RELEASE);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);   /* pairs with the daemon's before it sleeps */
	if (__atomic_load_n(&h->sq_wakeup, __ATOMIC_RELAXED)) {
		Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
		Gpx__SqKick k = GPX__SQ_KICK__INIT;
		m.seq = client_next_seq(c);
		m.body_case = GPX__CLIENT_MSG__BODY_SQ_KICK;
		m.sq_kick = &k;
		int r = client_send(c, &m, NULL, 0);
		if (r < 0)
			return r;
	}
	return 0;
}

/* Whether c may take a list of n segments now: what submit and gpx_segs_reserve both ask. */
static int
segs_usable(gpx_conn *c, size_t n)
{
	if (c->ring == NULL)
		return client_error(c, GPX_EINVAL, "this connection has no completion queue");
	if (c->dead)
		return client_error(c, GPX_ECONN, "the connection to gpxd was lost");
	if (n == 0 || n > c->max_segs)
		return client_error(c, GPX_EINVAL, "segment count out of range");
	return 0;
}

/* Sends a Transfer (a list it names in the segment area was put there): credit and area use. */
static int
transfer_send(gpx_conn *c, Gpx__Transfer *t)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	int r;

	c->area.resv_n = 0;        /* any transfer ends a reservation */
	m.seq = client_next_seq(c);
	m.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	m.transfer = t;
	if ((r = client_send(c, &m, NULL, 0)) == 0) {
		c->outstanding++;
		if (t->seg_count > 0)
			client_area_sent(c);
	}
	return r;
}

static int
submit(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *segs, size_t n, uint64_t tag)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	Gpx__Segment one = GPX__SEGMENT__INIT, *onep = &one;
	Gpx__Segment *arr = NULL, **ptrs = NULL;
	int r;

	if ((r = segs_usable(c, n)) < 0)
		return r;
	if (c->outstanding >= c->entries)
		return client_error(c, GPX_EBUSY, "no credit left: collect completions first");
	if (n == 1 && (r = sq_put(c, src, dst, segs, tag)) <= 0) {
		c->area.resv_n = 0;
		if (r == 0)
			c->outstanding++;
		return r;
	}
	t.tag = tag;
	t.src_region = src;
	t.dst_region = dst;
	if (n == 1) {
		one.src_offset = segs[0].src_offset;
		one.dst_offset = segs[0].dst_offset;
		one.length = segs[0].length;
		t.n_segments = 1;
		t.segments = &onep;
	} else if (n <= AREA_INLINE_MAX && !client_area_in(c, segs)) {
		/* (a reserved list goes as it lies in the area; the room is given up with it) */
		arr = malloc(n * sizeof(*arr));
		ptrs = malloc(n * sizeof(*ptrs));
		if (arr == NULL || ptrs == NULL) {
			free(arr);
			free(ptrs);
			return client_error(c, GPX_ENOMEM, NULL);
		}
		for (size_t i = 0; i < n; i++) {
			gpx__segment__init(&arr[i]);
			arr[i].src_offset = segs[i].src_offset;
			arr[i].dst_offset = segs[i].dst_offset;
			arr[i].length = segs[i].length;
			ptrs[i] = &arr[i];
		}
		t.n_segments = n;
		t.segments = ptrs;
	} else {
		/* Longer lists are written into the segment area the daemon copies them out of. */
		uint64_t off;
		if ((r = client_area_put(c, segs, n, &off)) < 0) {
			c->area.resv_n = 0;
			return r;
		}
		t.seg_count = n;
		t.area_offset = off;
	}
	r = transfer_send(c, &t);
	free(arr);
	free(ptrs);
	return r;
}

API int
gpx_copy(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t len, uint64_t tag)
{
	struct gpx_seg s = { src_off, dst_off, len };

	return submit(c, src, dst, &s, 1, tag);
}

API int
gpx_copyv(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *segs, size_t n, uint64_t tag)
{
	return submit(c, src, dst, segs, n, tag);
}

API int
gpx_copy_pages(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t page_size, const uint32_t *src_pages, const uint32_t *dst_pages, size_t n, uint64_t tag)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	struct gpx_wire_page *w;
	uint64_t off;
	int r;

	if ((r = segs_usable(c, n)) < 0)
		return r;
	if (page_size == 0 || src_pages == NULL || dst_pages == NULL)
		return client_error(c, GPX_EINVAL, "a page transfer needs a page size and both page lists");
	if (c->outstanding >= c->entries)
		return client_error(c, GPX_EBUSY, "no credit left: collect completions first");
	c->area.resv_n = 0;        /* any transfer ends a reservation */
	if ((r = client_area_take(c, n * sizeof(*w), (void **)&w, &off)) < 0)
		return r;
	/* The pairs, side by side: the one pass over the lists this transfer makes here. */
	for (size_t i = 0; i < n; i++)
		w[i] = (struct gpx_wire_page){ src_pages[i], dst_pages[i] };
	t.tag = tag;
	t.src_region = src;
	t.dst_region = dst;
	t.seg_count = n;
	t.area_offset = off;
	t.page_size = page_size;
	t.src_offset = src_off;
	t.dst_offset = dst_off;
	return transfer_send(c, &t);
}

API int
gpx_copy_pages_table(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t page_size, gpx_region table, uint64_t table_off, size_t n, uint64_t tag)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	int r;

	if ((r = segs_usable(c, n)) < 0)
		return r;
	if (page_size == 0 || table == 0)
		return client_error(c, GPX_EINVAL, "a page transfer needs a page size and the region of its table");
	if (c->outstanding >= c->entries)
		return client_error(c, GPX_EBUSY, "no credit left: collect completions first");
	t.tag = tag;
	t.src_region = src;
	t.dst_region = dst;
	t.seg_count = n;
	t.page_size = page_size;
	t.src_offset = src_off;
	t.dst_offset = dst_off;
	t.list_region = table;
	t.list_offset = table_off;
	return transfer_send(c, &t);
}

_Static_assert(sizeof(struct gpx_pair) == sizeof(struct gpx_wire_pair), "pair layout");

/*
 * A batch: the pairs, then the segment or page list, in one piece of the segment area, and
 * one Transfer naming both.  recs is the list's record size, fill writes it in place.
 */
static int
batch_send(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, size_t nrecs, size_t recs,
    uint64_t page_size, void (*fill)(void *at, const void *a, const void *b, size_t n),
    const void *a, const void *b, gpx_region table, uint64_t table_off, uint64_t tag)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	unsigned char *p;
	uint64_t off;
	int r;

	if ((r = segs_usable(c, nrecs)) < 0)
		return r;
	if (pairs == NULL || npairs == 0 || npairs > GPX_PAIRS_MAX)
		return client_error(c, GPX_EINVAL, "a batch takes 1..GPX_PAIRS_MAX pairs");
	if (c->outstanding >= c->entries)
		return client_error(c, GPX_EBUSY, "no credit left: collect completions first");
	c->area.resv_n = 0;        /* any transfer ends a reservation */
	/* (a page table in GPU memory: only the pairs go into the area) */
	if ((r = client_area_take(c, npairs * sizeof(*pairs) + (table ? 0 : nrecs * recs), (void **)&p, &off)) < 0)
		return r;
	memcpy(p, pairs, npairs * sizeof(*pairs));
	if (!table)
		fill(p + npairs * sizeof(*pairs), a, b, nrecs);
	t.tag = tag;
	t.pair_count = npairs;
	t.pair_offset = off;
	t.seg_count = nrecs;
	t.area_offset = table ? 0 : off + npairs * sizeof(*pairs);
	t.page_size = page_size;
	t.list_region = table;
	t.list_offset = table_off;
	return transfer_send(c, &t);
}

static void
fill_segs(void *at, const void *segs, const void *unused, size_t n)
{
	(void)unused;
	memcpy(at, segs, n * sizeof(struct gpx_seg));
}

/* The two page lists side by side, as gpx_copy_pages writes them. */
static void
fill_pages(void *at, const void *src, const void *dst, size_t n)
{
	struct gpx_wire_page *w = at;
	const uint32_t *s = src, *d = dst;

	for (size_t i = 0; i < n; i++)
		w[i] = (struct gpx_wire_page){ s[i], d[i] };
}

API int
gpx_copy_batch(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, const struct gpx_seg *segs,
    size_t nsegs, uint64_t tag)
{
	if (segs == NULL)
		return client_error(c, GPX_EINVAL, "a batch of segments needs its segment list");
	return batch_send(c, pairs, npairs, nsegs, sizeof(*segs), 0, fill_segs, segs, NULL, 0, 0, tag);
}

API int
gpx_copy_pages_batch(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, uint64_t page_size,
    const uint32_t *src_pages, const uint32_t *dst_pages, size_t npages, uint64_t tag)
{
	if (page_size == 0 || src_pages == NULL || dst_pages == NULL)
		return client_error(c, GPX_EINVAL, "a page transfer needs a page size and both page lists");
	return batch_send(c, pairs, npairs, npages, sizeof(struct gpx_wire_page), page_size, fill_pages,
	    src_pages, dst_pages, 0, 0, tag);
}

API int
gpx_copy_pages_batch_table(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, uint64_t page_size,
    gpx_region table, uint64_t table_off, size_t npages, uint64_t tag)
{
	if (page_size == 0 || table == 0)
		return client_error(c, GPX_EINVAL, "a page transfer needs a page size and the region of its table");
	return batch_send(c, pairs, npairs, npages, 0, page_size, NULL, NULL, NULL, table, table_off, tag);
}

API int
gpx_segs_reserve(gpx_conn *c, size_t n, struct gpx_seg **out)
{
	uint64_t pos;
	int r;

	*out = NULL;
	if ((r = segs_usable(c, n)) < 0)
		return r;
	c->area.resv_n = 0;
	if ((r = client_area_room(c, n * sizeof(**out), &pos)) < 0)
		return r;
	c->area.resv = pos;
	c->area.resv_n = n;
	*out = (struct gpx_seg *)(c->area.p + pos % c->area.len);
	return 0;
}

API int
gpx_cancel(gpx_conn *c, uint64_t tag)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Cancel x = GPX__CANCEL__INIT;

	x.tag = tag;
	m.body_case = GPX__CLIENT_MSG__BODY_CANCEL;
	m.cancel = &x;
	return client_rpc(c, &m, NULL, 0, NULL, NULL, NULL);
}

API int
gpx_copy_sync(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off, uint64_t len)
{
	uint64_t tag = SYNC_TAG_BIT | ++c->sync_tags;
	struct gpx_completion done;
	int r;

	/* A refusal's reason lands in last_error; a failure without one reads as its code. */
	c->last_error[0] = '\0';
	/*
	 * The wait that follows looks at the ring first: gpxd hears so before the copy goes, so
	 * that a completion posted while this thread is still on its way there (taken off the
	 * core by the very wake-up of gpxd, say) rings no doorbell either.  The wait lowers it.
	 */
	if (c->spin_s > 0)
		client_spin_begin(c);
	if ((r = gpx_copy(c, src, src_off, dst, dst_off, len, tag)) < 0) {
		client_spin_end(c);
		return r;
	}
	if ((r = gpx_wait_tag(c, tag, &done, -1)) < 0)
		return r;
	if (done.status < 0 && c->last_error[0] == '\0')
		client_error(c, -done.status, NULL);
	return done.status;
}
