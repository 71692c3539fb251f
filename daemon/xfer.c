/*
 * From a Transfer message to a job the engine can run.  Everything a client says is checked
 * here, before a single byte moves: both regions belong to (or were imported by) this
 * connection, the destination is writable, and every segment lies inside both regions, with
 * offset + length overflow caught.  Large segment lists come in the connection's segment area
 * (or a memfd) and are copied out as they are checked, one read of each value, so the client
 * cannot change them afterwards.  For a request of 65,536 pages this pass is most of the
 * daemon's work before the first byte may move, so it is kept to one load, a few additions and
 * ORs, and one store per segment.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "gpxd.h"

static int
resolve(struct conn *c, uint64_t id, const char *which, struct rhandle **out, char *err, size_t errlen)
{
	struct rhandle *h = conn_handle(c, id);

	if (h == NULL) {
		if ((uint32_t)(id >> 32) != c->epoch && id != 0) {
			snprintf(err, errlen, "%s region %#llx is not this connection's", which,
			    (unsigned long long)id);
			log_audit(c, "%s", err);
			return -GPX__STATUS__EACCES;
		}
		snprintf(err, errlen, "no %s region %#llx", which, (unsigned long long)id);
		return -GPX__STATUS__ENOENT;
	}
	if (atomic_load(&h->r->revoked)) {
		snprintf(err, errlen, "%s region %#llx was withdrawn by its owner", which,
		    (unsigned long long)id);
		return -GPX__STATUS__EREVOKED;
	}
	*out = h;
	return 0;
}

static int
segs_fd_ok(int fd, uint32_t count, char *err, size_t errlen)
{
	size_t want = (size_t)count * sizeof(struct gpx_wire_seg);
	struct stat st;

	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || fcntl(fd, F_GET_SEALS) < 0) {
		snprintf(err, errlen, "the segment table fd is not a memfd");
		return -GPX__STATUS__EBADFD;
	}
	if ((uint64_t)st.st_size < want) {
		snprintf(err, errlen, "the segment table holds %lld bytes, %u segments need %zu",
		    (long long)st.st_size, count, want);
		return -GPX__STATUS__EINVAL;
	}
	return 0;
}

static bool
inside(uint64_t off, uint64_t len, uint64_t size)
{
	return off <= size && len <= size - off;
}

static int
seg_refused(struct conn *c, uint32_t i, const struct gpx_wire_seg *g, const struct region *src,
    const struct region *dst, char *err, size_t errlen)
{
	snprintf(err, errlen, "segment %u (%llu+%llu -> %llu+%llu) leaves its region "
	    "(source %llu bytes, destination %llu bytes)", i,
	    (unsigned long long)g->src_offset, (unsigned long long)g->length,
	    (unsigned long long)g->dst_offset, (unsigned long long)g->length,
	    (unsigned long long)src->length, (unsigned long long)dst->length);
	log_audit(c, "%s", err);
	return -GPX__STATUS__ERANGE;
}

/*
 * No region, segment or request reaches 2^62 bytes (4 EiB).  That bound lets the checking pass
 * use plain 64-bit arithmetic without a compare per segment.  Every offset, length and running
 * total goes into one OR: any of them at 2^62 or above sets one of its top two bits.  Below
 * that nothing can wrap (the total is caught before it could), and limit - offset - length,
 * with the limit below 2^62 too, has its top bit set exactly when offset + length passes the
 * limit; it goes into the OR as well.  One test of the top two bits at the end says whether
 * any segment is bad; then a second pass over the private copy finds which.
 */
#define SEG_LIMIT (1ull << 62)
#define SEG_BAD (~(SEG_LIMIT - 1))

/* Source and destination offsets side by side: one subtraction checks both (GCC and Clang). */
typedef uint64_t seg_pair __attribute__((vector_size(16), aligned(8)));

/* The slow path of a refused request: which segment, from the private copy, for the message. */
static int
segs_refused(const struct job *j, const struct region *src, const struct region *dst,
    struct conn *c, char *err, size_t errlen)
{
	const uint64_t slen = src->length < SEG_LIMIT ? src->length : SEG_LIMIT - 1;
	const uint64_t dlen = dst->length < SEG_LIMIT ? dst->length : SEG_LIMIT - 1;
	uint64_t total = 0;

	for (uint32_t i = 0; i < j->nseg; i++) {
		const struct gpx_wire_seg *g = &j->segs[i];
		if (!inside(g->src_offset, g->length, slen) || !inside(g->dst_offset, g->length, dlen))
			return seg_refused(c, i, g, src, dst, err, errlen);
		total += g->length;
		if (total >= SEG_LIMIT)
			break;
	}
	snprintf(err, errlen, "the %u segments add up to 2^62 bytes or more", j->nseg);
	log_audit(c, "%s", err);
	return -GPX__STATUS__ERANGE;
}

/*
 * The one pass over the n segment records at `in`: each is loaded once (volatile: the compiler
 * may not load it again later in place of the value), checked against both regions, and stored
 * into the job's private array, which is all that is used from then on.  `in` is the shared
 * segment area, so that nothing the client writes there later can change what was checked, or
 * the job's own array already filled from a memfd or the message.  Every SEG_BLOCK segments the
 * running byte count goes into blocks[] for the engine's chunking.  No branch depends on the
 * values: one test at the end (SEG_LIMIT above).
 */
static int
check_segs(struct job *j, const struct gpx_wire_seg *in, const struct region *src,
    const struct region *dst, struct conn *c, char *err, size_t errlen)
{
	const seg_pair lim = { src->length < SEG_LIMIT ? src->length : SEG_LIMIT - 1,
	    dst->length < SEG_LIMIT ? dst->length : SEG_LIMIT - 1 };
	seg_pair bad2 = { 0, 0 };
	uint64_t total = 0, bad = 0;
	const uint32_t n = j->nseg;

	for (uint32_t b = 0; b < n; b += SEG_BLOCK) {
		const uint32_t e = n - b > SEG_BLOCK ? b + SEG_BLOCK : n;
		for (uint32_t i = b; i < e; i++) {
			/*
			 * The list is mostly still in the client's core's caches: asking for it 2 KiB
			 * ahead keeps more of those transfers in flight (a prefetch never faults).
			 */
			__builtin_prefetch((const void *)((uintptr_t)&in[i] + 2048));
			const seg_pair off = *(const volatile seg_pair *)&in[i];
			const uint64_t len = *(const volatile uint64_t *)&in[i].length;
			total += len;
			bad2 |= off | (lim - off - len);
			bad |= len | total;
			memcpy(&j->segs[i], &off, sizeof(off));
			j->segs[i].length = len;
		}
		j->blocks[b / SEG_BLOCK] = total;
	}
	if ((bad | bad2[0] | bad2[1]) & SEG_BAD)
		return segs_refused(j, src, dst, c, err, errlen);
	j->total = total;
	return 0;
}

/* Takes n segments in from the segment area, a memfd or the message, and checks them. */
static int
take_segs(struct job *j, const Gpx__Transfer *t, const unsigned char *table, int fd,
    const struct region *src, const struct region *dst, struct conn *c, char *err, size_t errlen)
{
	uint32_t n = j->nseg;

	if (table != NULL)
		return check_segs(j, (const struct gpx_wire_seg *)table, src, dst, c, err, errlen);
	if (fd >= 0) {
		size_t want = (size_t)n * sizeof(*j->segs);
		for (size_t got = 0; got < want;) {
			ssize_t k = pread(fd, (char *)j->segs + got, want - got, got);
			if (k <= 0) {
				snprintf(err, errlen, "reading the segment table: %s", k < 0 ? strerror(errno) : "short");
				return -GPX__STATUS__EINVAL;
			}
			got += k;
		}
	} else
		for (uint32_t i = 0; i < n; i++) {
			j->segs[i].src_offset = t->segments[i]->src_offset;
			j->segs[i].dst_offset = t->segments[i]->dst_offset;
			j->segs[i].length = t->segments[i]->length;
		}
	return check_segs(j, j->segs, src, dst, c, err, errlen);
}

/* The job's private segment array, with room for blocks[] after it. */
static int
segs_alloc(struct job *j, char *err, size_t errlen)
{
	size_t nblocks = (j->nseg + SEG_BLOCK - 1) / SEG_BLOCK;

	j->segs = malloc((size_t)j->nseg * sizeof(*j->segs) + nblocks * sizeof(*j->blocks));
	if (j->segs == NULL) {
		snprintf(err, errlen, "out of memory for %u segments", j->nseg);
		return -GPX__STATUS__ENOMEM;
	}
	j->blocks = (uint64_t *)(j->segs + j->nseg);
	return 0;
}

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

/*
 * Takes the n page records at `in` (the segment area) into private memory, the kernel's pinned
 * list when the GPU takes the job as pages, else a scratch array that becomes plain segments,
 * and checks them from that copy only.
 */
static int
take_pages(struct job *j, const Gpx__Transfer *t, const unsigned char *in, const struct region *src,
    const struct region *dst, struct conn *c, char *err, size_t errlen)
{
	const uint32_t n = j->nseg;
	const uint64_t ps = t->page_size;
	struct gpx_wire_page *pg;
	int r, dev;

	if (ps > PAGE_SIZE_MAX || t->src_offset >= SEG_LIMIT || t->dst_offset >= SEG_LIMIT ||
	    (uint64_t)n * ps >= SEG_LIMIT) {
		snprintf(err, errlen, "%u pages of %llu bytes from %llu -> %llu: pages are 1..2^31 bytes, "
		    "offsets and the whole below 2^62", n, (unsigned long long)ps,
		    (unsigned long long)t->src_offset, (unsigned long long)t->dst_offset);
		return -GPX__STATUS__ERANGE;
	}
	j->page_size = ps;
	j->src_base = t->src_offset;
	j->dst_base = t->dst_offset;
	j->total = n * ps;
	if ((j->pages = gpu_pages_alloc(src, dst, ps, n, &dev)) != NULL) {
		pg = j->pages;
		j->path = (enum path_kind)(PATH_GPU0 + dev);      /* that GPU's kernel runs it */
	} else if ((r = segs_alloc(j, err, errlen)) < 0)
		return r;
	else
		pg = (struct gpx_wire_page *)(j->segs + n) - n;    /* the array's last third */
	const uint64_t ls = pages_in(src, j->src_base, ps), ld = pages_in(dst, j->dst_base, ps);
	if (ls == 0 || ld == 0 ||
	    pages_copy2(pg, in, n, (uint32_t)((ls < (1ull << 31) ? ls : 1ull << 31) - 1),
		(uint32_t)((ld < (1ull << 31) ? ld : 1ull << 31) - 1))) {
		/* Some page may be out (or sides of more than 2^31 pages): exactly, from the copy. */
		for (uint32_t i = 0; i < n; i++)
			if (ls == 0 || ld == 0 || pg[i].src >= ls || pg[i].dst >= ld) {
				snprintf(err, errlen, "page %u (%u -> %u, %llu bytes each from %llu -> %llu) leaves "
				    "its region (source %llu bytes, destination %llu bytes)", i,
				    ls == 0 || ld == 0 ? 0 : pg[i].src, ls == 0 || ld == 0 ? 0 : pg[i].dst,
				    (unsigned long long)ps, (unsigned long long)j->src_base,
				    (unsigned long long)j->dst_base, (unsigned long long)src->length,
				    (unsigned long long)dst->length);
				log_audit(c, "%s", err);
				return -GPX__STATUS__ERANGE;
			}
	}
	if (j->pages != NULL)
		return 0;
	/*
	 * Plain segments, written over the scratch copy from the front: segment i ends at byte
	 * 24 (i + 1), where record i + 1 at 16 n + 8 (i + 1) has not begun, and record i was read
	 * before: by memcpy, which may alias the segment stored over it, so no compiler moves
	 * that store ahead of the read (the last record lies inside the last segment).
	 */
	for (uint32_t i = 0; i < n; i++) {
		struct gpx_wire_page p;
		memcpy(&p, &pg[i], sizeof(p));
		j->segs[i] = (struct gpx_wire_seg){ j->src_base + p.src * ps, j->dst_base + p.dst * ps, ps };
		if ((i + 1) % SEG_BLOCK == 0 || i + 1 == n)
			j->blocks[i / SEG_BLOCK] = (uint64_t)(i + 1) * ps;
	}
	return 0;
}

/* Maps the client's segment area read-only, replacing the previous one. */
int
xfer_set_area(struct conn *c, int fd, uint64_t length, char *err, size_t errlen)
{
	struct stat st;
	void *p;

	if (!mem_host_fd_ok(fd, err, errlen))
		return -GPX__STATUS__EBADFD;
	if (length == 0 || length > GPX_AREA_MAX || fstat(fd, &st) < 0 || (uint64_t)st.st_size < length) {
		snprintf(err, errlen, "segment area of %llu bytes: 1..%u bytes of the memfd",
		    (unsigned long long)length, GPX_AREA_MAX);
		return -GPX__STATUS__EINVAL;
	}
	if ((p = mmap(NULL, length, PROT_READ, MAP_SHARED, fd, 0)) == MAP_FAILED) {
		snprintf(err, errlen, "mapping the segment area: %s", strerror(errno));
		return -GPX__STATUS__ENOMEM;
	}
	xfer_drop_area(c);
	c->area = p;
	c->area_len = length;
	return 0;
}

void
xfer_drop_area(struct conn *c)
{
	if (c->area != NULL)
		munmap((void *)c->area, c->area_len);
	c->area = NULL;
	c->area_len = 0;
}

int
xfer_build(struct conn *c, const Gpx__Transfer *t, int segfd, struct job **out, char *err, size_t errlen)
{
	struct rhandle *sh, *dh;
	const unsigned char *table = NULL;
	double t_build = log_level_debug() ? now_s() : 0;    /* for the engine's debug line */
	uint32_t n;
	int r;

	if ((r = resolve(c, t->src_region, "source", &sh, err, errlen)) < 0 ||
	    (r = resolve(c, t->dst_region, "destination", &dh, err, errlen)) < 0)
		return r;
	if (dh->read_only || dh->r->read_only) {
		snprintf(err, errlen, "destination region %#llx is read-only", (unsigned long long)t->dst_region);
		log_audit(c, "%s", err);
		return -GPX__STATUS__EACCES;
	}
	/* fabric: another node's region on one side (daemon/fabric.c) */
	if ((r = fabric_xfer_check(sh->r, dh->r, err, errlen)) < 0)
		return r;
	if (t->page_size > 0 && (c->version < 2 || t->seg_count == 0 || segfd >= 0)) {
		snprintf(err, errlen, c->version < 2 ? "page transfers need protocol 2 (this connection speaks %u)"
		    : "a page list comes as seg_count records in the segment area", c->version);
		return -GPX__STATUS__EPROTO;
	}
	if ((segfd >= 0 && t->seg_count == 0) || (t->seg_count > 0 && t->n_segments > 0)) {
		snprintf(err, errlen, "segments come inline, or as seg_count in the segment area or one memfd");
		return -GPX__STATUS__EPROTO;
	}
	n = t->seg_count > 0 ? t->seg_count : (uint32_t)t->n_segments;
	if (n == 0 || n > cfg->max_segs) {
		snprintf(err, errlen, "%u segments (1..%u allowed)", n, cfg->max_segs);
		return -GPX__STATUS__EINVAL;
	}
	/* The claimed count is checked against the area or memfd before anything is allocated. */
	if (t->seg_count > 0 && segfd < 0) {
		uint64_t want = (uint64_t)n * (t->page_size > 0 ? sizeof(struct gpx_wire_page) : sizeof(struct gpx_wire_seg));
		if (c->area == NULL || t->area_offset % 8 != 0 || !inside(t->area_offset, want, c->area_len)) {
			snprintf(err, errlen, "%u segments at %llu leave the segment area (%zu bytes)", n,
			    (unsigned long long)t->area_offset, c->area_len);
			return -GPX__STATUS__EINVAL;
		}
		table = c->area + t->area_offset;
	}
	if (segfd >= 0 && (r = segs_fd_ok(segfd, n, err, errlen)) < 0)
		return r;

	struct job *j = calloc(1, sizeof(*j));
	if (j == NULL) {
		snprintf(err, errlen, "out of memory for a transfer");
		return -GPX__STATUS__ENOMEM;
	}
	j->nseg = n;
	j->t_build = t_build;
	if (t->page_size > 0)
		r = take_pages(j, t, table, sh->r, dh->r, c, err, errlen);
	else if ((r = segs_alloc(j, err, errlen)) == 0)
		r = take_segs(j, t, table, segfd, sh->r, dh->r, c, err, errlen);
	if (r == 0 && !region_use(sh->r)) {
		snprintf(err, errlen, "source region was withdrawn by its owner");
		r = -GPX__STATUS__EREVOKED;
	} else if (r == 0 && !region_use(dh->r)) {
		region_unuse(sh->r);
		snprintf(err, errlen, "destination region was withdrawn by its owner");
		r = -GPX__STATUS__EREVOKED;
	}
	if (r < 0) {
		engine_free_job(j);     /* no regions held yet: its lists and itself */
		return r;
	}
	region_ref(sh->r);
	region_ref(dh->r);
	j->src = sh->r;
	j->dst = dh->r;
	j->tag = t->tag;
	j->flags = t->flags;
	j->client = c->id;
	if (j->pages == NULL)
		j->path = engine_path_for(sh->r, dh->r);
	j->t_submit = now_s();
	*out = j;
	return 0;
}
