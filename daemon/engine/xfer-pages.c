/*
 * Page lists (protocol 2): a transfer of n pages names, for each, a page of the source and a
 * page of the destination, page_size bytes each from a base.  The list is copied out of the
 * client's memory and checked in one pass (two records per vector; on the loop thread, a
 * second core for long lists; a list longer than xfer.c lets the loop check, on a task
 * thread), then handed to a GPU's page kernel as it is or turned into plain segments.
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/xfer-private.h"

/*
 * Page transfers (protocol 2).  Record i of the list copies page_size bytes from page src of
 * the source (at src_base + src * page_size) to page dst of the destination.  page_size is at
 * most 2^31 and bases below 2^62, so no page's place wraps; a side of L whole pages takes page
 * numbers below L.
 */
#define PAGE_SIZE_MAX (1ull << 31)

typedef uint32_t page_quad __attribute__((vector_size(16), aligned(4)));   /* two records */

/*
 * The one pass over the records at `in`: each loaded once, stored into the private copy `out`,
 * and checked with the segments' trick (SEG_LIMIT above) in 32 bits: with lim = L - 1 below
 * 2^31, p | (lim - p) has its top bit set exactly when p > lim.  Two records per vector, no
 * branch; true when some page may be out of its region (exactly so when both L <= 2^31).
 */
static bool
pages_copy(struct gpx_wire_page *out, const unsigned char *in, uint32_t n, uint32_t lim_s, uint32_t lim_d)
{
	const page_quad lim = { lim_s, lim_d, lim_s, lim_d };
	page_quad bad = { 0, 0, 0, 0 };
	uint32_t i = 0, b;

	for (; i + 2 <= n; i += 2) {
		const page_quad v = *(const volatile page_quad *)(in + (size_t)i * sizeof(*out));
		memcpy(&out[i], &v, sizeof(v));
		bad |= v | (lim - v);
	}
	b = bad[0] | bad[1] | bad[2] | bad[3];
	if (i < n) {
		memcpy(&out[i], in + (size_t)i * sizeof(*out), sizeof(*out));
		b |= out[i].src | (lim_s - out[i].src) | out[i].dst | (lim_d - out[i].dst);
	}
	return b >> 31;
}

/*
 * A second core for long page lists.  The pass above runs at the speed one core reads lines
 * the client's core has just written (65,536 pages: ~30 us); two cores take ~19.  The loop
 * thread posts the list's second half here, and an idle GPU worker, spinning between jobs
 * anyway, may claim it (xfer_help).  If none has claimed it once the loop thread's own half
 * is done, the loop thread takes it back: never slower than one core, and never waiting on
 * a thread that is not already working on it.
 */
#define HELP_MIN 16384
enum { HELP_FREE, HELP_POSTED, HELP_CLAIMED, HELP_DONE };
static struct {
	_Atomic int state;
	struct gpx_wire_page *out;
	const unsigned char *in;
	uint32_t n, lim_s, lim_d;
	bool bad;
} help;

void
xfer_help(void)
{
	int posted = HELP_POSTED;

	if (atomic_load_explicit(&help.state, memory_order_relaxed) != HELP_POSTED ||
	    !atomic_compare_exchange_strong(&help.state, &posted, HELP_CLAIMED))
		return;
	help.bad = pages_copy(help.out, help.in, help.n, help.lim_s, help.lim_d);
	atomic_store_explicit(&help.state, HELP_DONE, memory_order_release);
}

/* pages_copy of n records, the second half offered to a helper.  Loop thread only. */
static bool
pages_copy2(struct gpx_wire_page *out, const unsigned char *in, uint32_t n, uint32_t lim_s, uint32_t lim_d)
{
	const uint32_t h = n / 2 & ~1u;
	int posted = HELP_POSTED;
	bool bad;

	if (n < HELP_MIN)
		return pages_copy(out, in, n, lim_s, lim_d);
	help.out = out + h;
	help.in = in + (size_t)h * sizeof(*out);
	help.n = n - h;
	help.lim_s = lim_s;
	help.lim_d = lim_d;
	atomic_store_explicit(&help.state, HELP_POSTED, memory_order_release);
	bad = pages_copy(out, in, h, lim_s, lim_d);
	if (atomic_compare_exchange_strong(&help.state, &posted, HELP_FREE))
		return pages_copy(help.out, help.in, help.n, lim_s, lim_d) || bad;
	while (atomic_load_explicit(&help.state, memory_order_acquire) != HELP_DONE)
		cpu_pause();
	bad |= help.bad;
	atomic_store_explicit(&help.state, HELP_FREE, memory_order_relaxed);
	return bad;
}

/* Whole pages of a side from its base on. */
static uint64_t
pages_in(const struct region *r, uint64_t base, uint64_t ps)
{
	return r->length > base ? (r->length - base) / ps : 0;
}

/* The largest page number every pair allows on each side, below 2^31, and 0 when some side has none. */
static bool
pages_limits(const struct job *j, uint64_t ps, uint64_t *ls, uint64_t *ld)
{
	*ls = *ld = 1ull << 31;
	for (uint32_t k = 0; k < j->npairs; k++) {
		const uint64_t s = pages_in(j->pairs[k].src, j->pairs[k].src_base, ps);
		const uint64_t d = pages_in(j->pairs[k].dst, j->pairs[k].dst_base, ps);
		*ls = s < *ls ? s : *ls;
		*ld = d < *ld ? d : *ld;
	}
	return *ls > 0 && *ld > 0;
}

/*
 * The refusal of a page list with a page out of some pair's region, from the copy: the first
 * pair that has such a page, and its first.  The largest page numbers of the list tell which
 * pairs have one, so this reads the list twice at most, however many pairs there are.
 */
static int
pages_refused(const struct job *j, const struct gpx_wire_page *pg, uint32_t n, uint64_t ps, char *err,
    size_t errlen)
{
	uint32_t ms = 0, md = 0;

	for (uint32_t i = 0; i < n; i++) {
		ms = pg[i].src > ms ? pg[i].src : ms;
		md = pg[i].dst > md ? pg[i].dst : md;
	}
	for (uint32_t k = 0; k < j->npairs; k++) {
		const struct jpair *p = &j->pairs[k];
		const uint64_t ls = pages_in(p->src, p->src_base, ps), ld = pages_in(p->dst, p->dst_base, ps);
		if (ls > ms && ld > md)
			continue;
		for (uint32_t i = 0; i < n; i++)
			if (ls == 0 || ld == 0 || pg[i].src >= ls || pg[i].dst >= ld) {
				snprintf(err, errlen, "page %u (%u -> %u, %llu bytes each from %llu -> %llu) of pair "
				    "%u leaves its region (source %llu bytes, destination %llu bytes)", i,
				    ls == 0 || ld == 0 ? 0 : pg[i].src, ls == 0 || ld == 0 ? 0 : pg[i].dst,
				    (unsigned long long)ps, (unsigned long long)p->src_base,
				    (unsigned long long)p->dst_base, k, (unsigned long long)p->src->length,
				    (unsigned long long)p->dst->length);
				return -GPX__STATUS__ERANGE;
			}
	}
	return 0;
}

/* Where the job's private copy of its page list lies (xfer_pages_prepare chose). */
static struct gpx_wire_page *
pages_copy_of(const struct job *j)
{
	if (j->pages != NULL)
		return j->pages;
	if (j->plist != NULL)
		return j->plist;
	return (struct gpx_wire_page *)(j->segs + j->nseg) - j->npages;    /* the array's tail */
}

/*
 * A page list the GPU's kernel would run but its pinned arena did not take (gpu_pages_alloc
 * said why): busy, for it fits once some page transfers in flight have ended.
 */
static int
arena_refusal(int dev, int refused, const struct user *u, char *err, size_t errlen)
{
	struct gpu_arena a;

	gpu_pages_stats(&a);
	if (refused == -EDQUOT)
		snprintf(err, errlen, "GPU%d's page kernel: uid %u's page transfers in flight hold its share of the "
		    "kernel's pinned arena for page lists (%llu of %llu bytes), and this one needs more: retry once "
		    "some have ended", dev, (unsigned)u->uid, (unsigned long long)a.share, (unsigned long long)a.size);
	else
		snprintf(err, errlen, "GPU%d's page kernel has no room left for another transfer in flight (its "
		    "pinned arena for page lists, %llu bytes, is taken): retry once some have ended", dev,
		    (unsigned long long)a.size);
	return -GPX__STATUS__EBUSY;
}

/*
 * A list in GPU memory (protocol 4): the kernel of the GPU that runs the pairs reads it in
 * place and copies only the pages below each side's limit (the same limits as the check of
 * a list in host memory: the fewest whole pages any pair has on that side), so that nothing
 * here reads it, and the client may write it with its own GPU work.  No other path reads GPU
 * memory as a list: a job that kernel cannot run is refused.
 */
static int
pages_in_gpu(struct job *j, uint64_t ps, const struct region *list, uint64_t list_off, struct user *u, char *err,
    size_t errlen)
{
	uint64_t ls, ld;
	int dev = -1, refused;

	if (!pages_limits(j, ps, &ls, &ld)) {
		snprintf(err, errlen, "a side of the pairs holds no whole page of %llu bytes", (unsigned long long)ps);
		return -GPX__STATUS__ERANGE;
	}
	j->pages = gpu_pages_alloc(j->pairs, j->npairs, ps, 0, list, list_off, &j->list_addr, &j->oob, u, &dev,
	    &refused);
	if (j->pages == NULL && refused != 0)
		return arena_refusal(dev, refused, u, err, errlen);
	if (j->pages == NULL) {
		snprintf(err, errlen, "a page list in GPU memory is read by the page kernel of the GPU that runs "
		    "the copy, and none runs this one (a side in host memory, pairs on several GPUs, a page size "
		    "or alignment it does not take, or the list not mapped on that GPU)");
		return -GPX__STATUS__ENOTSUP;
	}
	j->lim_src = (uint32_t)ls;
	j->lim_dst = (uint32_t)ld;
	j->path = (enum path_kind)(PATH_GPU0 + dev);
	return 0;
}

/*
 * Sets j up for a list of n pages of ps bytes for every pair of j (j->pairs with their bases
 * are set), and charges the private memory its records go to (*want: what the check
 * allocates): the kernel's pinned list when a GPU runs the job as pages (allocated here); on
 * the host path a list of its own (j->plist) that the workers read in place, so a job of
 * 16,384 pairs x 4,096 pages holds 32 KiB of pages, not 67 million segments; else a segment
 * array whose tail takes the records before they become plain segments.  *work grows by the
 * bytes xfer_pages_check will write.
 */
int
xfer_pages_prepare(struct job *j, uint32_t n, uint64_t ps, const struct region *list, uint64_t list_off,
    const struct xfer_from *c, struct charge *ch, uint64_t *work, enum xfer_list *want, char *err, size_t errlen)
{
	const uint64_t items = (uint64_t)j->npairs * n;
	int dev = -1, refused, r;

	*want = LIST_NONE;
	for (uint32_t k = 0; k < j->npairs; k++)
		if (j->pairs[k].src_base >= SEG_LIMIT || j->pairs[k].dst_base >= SEG_LIMIT)
			ps = 0;      /* refused just below */
	if (ps == 0 || ps > PAGE_SIZE_MAX || items > UINT32_MAX || items * ps >= SEG_LIMIT) {
		snprintf(err, errlen, "%u pages of %llu bytes for %u pairs: pages are 1..2^31 bytes, "
		    "bases and the whole below 2^62, at most 2^32 pages in all", n, (unsigned long long)ps,
		    j->npairs);
		return -GPX__STATUS__ERANGE;
	}
	j->page_size = ps;
	j->npages = n;
	j->nseg = (uint32_t)items;
	j->total = items * ps;
	for (uint32_t k = 0; k < j->npairs; k++) {
		j->pairs[k].seg_end = (k + 1) * n;
		j->pairs[k].bytes = n * ps;
	}
	if (list != NULL)
		return pages_in_gpu(j, ps, list, list_off, c->user, err, errlen);
	*work += (uint64_t)n * sizeof(struct gpx_wire_page);
	/*
	 * (the kernel's list lies in an arena of fixed size, allocated at start: not charged; where
	 * it has no room, or not within the uid's share, the pages go as segments, charged)
	 */
	if ((j->pages = gpu_pages_alloc(j->pairs, j->npairs, ps, n, NULL, 0, NULL, NULL, c->user, &dev,
	    &refused)) != NULL) {
		j->path = (enum path_kind)(PATH_GPU0 + dev);      /* that GPU's kernel runs it */
		return 0;
	}
	if (engine_path_for(j->pairs[0].src, j->pairs[0].dst) == PATH_HOST) {
		*want = LIST_PAGES;
		return xfer_charge(ch, (uint64_t)n * sizeof(*j->plist), c, err, errlen);
	}
	*want = LIST_SEGS;
	*work += xfer_segs_bytes(j->nseg);
	r = xfer_segs_charge(j, ch, c, err, errlen);
	if (r < 0 && refused != 0)
		return arena_refusal(dev, refused, c->user, err, errlen);   /* (as segments it never fits) */
	return r;
}

/*
 * Copies the page records at `in` (the segment area, or a batch's private copy) into the
 * job's private list and checks them from that copy only against every pair of j; then, when
 * the job runs as plain segments, writes them.  Any thread; on the loop thread (on_loop) half
 * of a long list may go to an idle GPU worker (pages_copy2).  A refusal is the caller's to log.
 */
int
xfer_pages_check(struct job *j, const unsigned char *in, bool on_loop, char *err, size_t errlen)
{
	struct gpx_wire_page *pg = pages_copy_of(j);
	const uint32_t n = j->npages;
	const uint64_t ps = j->page_size;
	uint64_t ls, ld;
	bool bad;
	int r;

	if (j->oob != NULL)
		return 0;            /* in GPU memory: the kernel checks each page as it reads it */
	/* (copied whole even when some side has no page, so that the refusal reads a copy) */
	bad = !pages_limits(j, ps, &ls, &ld);
	bad |= (on_loop ? pages_copy2 : pages_copy)(pg, in, n, (uint32_t)(ls - 1), (uint32_t)(ld - 1));
	/* Some page may be out (or a side of more than 2^31 pages): exactly, from the copy. */
	if (bad && (r = pages_refused(j, pg, n, ps, err, errlen)) < 0)
		return r;
	if (j->pages != NULL || j->plist != NULL)
		return 0;
	/*
	 * Plain segments, written over the scratch copy from the front, pair after pair.  The
	 * scratch is the array's last n * 8 bytes: no segment of a pair but the last reaches it,
	 * and the last pair's segment q ends before record q + 1 (24 (N - n + q + 1) <= 24 N - 8 n
	 * + 8 (q + 1) for q < n, N = pairs x n).  Each record is read by memcpy before the segment
	 * over it is stored, so no compiler moves that store ahead of the read.
	 */
	for (uint32_t k = 0, i = 0; k < j->npairs; k++) {
		const struct jpair *p = &j->pairs[k];
		for (uint32_t q = 0; q < n; q++, i++) {
			struct gpx_wire_page w;
			memcpy(&w, &pg[q], sizeof(w));
			j->segs[i] = (struct gpx_wire_seg){ p->src_base + w.src * ps, p->dst_base + w.dst * ps, ps };
			if ((i + 1) % SEG_BLOCK == 0 || i + 1 == j->nseg)
				j->blocks[i / SEG_BLOCK] = (uint64_t)(i + 1) * ps;
		}
	}
	return 0;
}
