/*
 * From a Transfer message to a job the engine can run.  Everything a client says is checked
 * here, before a single byte moves: both regions belong to (or were imported by) this
 * connection, the destination is writable, and every segment lies inside both regions, with
 * offset + length overflow caught.  Large segment lists come in the connection's segment area
 * (or a memfd) and are copied out as they are checked, one read of each value, so the client
 * cannot change them afterwards.  For a request of 65,536 pages this pass is most of the
 * daemon's work before the first byte may move, so it is kept to one load, a few additions and
 * ORs, and one store per segment.  The loop thread does it for at most XFER_LOOP_BYTES of
 * lists a turn; a longer request is checked on a task thread (struct xfer_check below).
 *
 * A batch (Transfer.pair_count) names many (source, destination) pairs.  Every pair is
 * resolved and checked like a single transfer before any job exists, and its pairs are
 * grouped by the path they run on: one job per path, and a group (struct jgroup) that posts
 * the one completion when the last of them ends.  A connection's batch whose pair records
 * came twice running is kept resolved, its regions held (struct xfer_pairs): the same records
 * again take their pairs from there, and their jobs hold it instead of every region.
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

#include "daemon/engine/xfer-private.h"
#include "daemon/fabric/fabric.h"

/*
 * A request being built.  Everything that needs the connection's tables or the budgets is
 * done on the loop thread first: both regions of every pair resolved and held, every job,
 * pair and private list charged (and the kernel's page list taken from its arena).  What
 * remains is the check: each private list allocated, copied in from where the client wrote
 * it (the segment area, a memfd; the message's own few were copied already) and checked from
 * the copy.  Its cost grows with the list (about 10 ms per million segments), so the loop
 * checks at most XFER_LOOP_BYTES of private lists in one turn (one callback: a connection's
 * messages, a pass over the submission queues): a request that would take it past that is
 * checked on a task thread (xfer_check_run) while the connection's further requests wait
 * (client/conn-xfer.c holds them back), and allocates its lists there too, so that the loop
 * never waits on the allocator for them.  Either way xfer_check_end, on the loop thread, hands
 * the jobs over or refuses the request.  What requests make the loop do in one turn is thus
 * bounded, however long their lists; the core counts what each turn checked
 * (loop_turn_checked) and keeps the most.
 */
#define XFER_LOOP_BYTES (1u << 20)

struct xfer_check {
	uint64_t client;             /* who asked (struct xfer_from) */
	struct logwho who;           /* its share of the log, while its connection lives */
	struct charge ch;            /* (with a reference on ch.cq while a task thread checks) */
	struct job *head;            /* its jobs, each holding its pairs' regions */
	int ngroups;
	uint64_t tag;
	double t_build;
	bool batch, pages;
	const unsigned char *in;     /* the list in the segment area, or NULL */
	int fd;                      /* or the memfd a single transfer's segments are read from, or -1 */
	bool own_fd;                 /* (then closed at the end) */
	uint32_t n;                  /* records in the list */
	uint64_t work;               /* bytes of private lists the check fills */
	unsigned char *plist;        /* a page batch of several groups: the list, copied once for all */
	struct gpx_wire_pair *pr;    /* a batch's pairs as sent */
	struct xfer_pairs *kept;     /* the kept pairs it took them from, while building */
	struct region *list;         /* a page list's region (protocol 4), held until its job has it */
	uint32_t *idx;               /* their indexes, group after group in the order of the jobs */
	uint32_t gfirst[NPATHS];     /* where each group's indexes begin */
	unsigned char want[NPATHS];  /* each job's private list, to allocate when checking (enum xfer_list) */
	bool want_plist;             /* and plist */
	bool later;                  /* checked by a task thread: this is on the heap */
	int status;
	char err[256];
	void *area;                  /* the segment area, when its connection ended during the check */
	size_t area_len;
};

/* A refusal in the log, within the asker's share (its struct logwho came with the request). */
void
xfer_audit(const struct xfer_from *c, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	log_vrefused(&c->who, fmt, ap);
	va_end(ap);
}

static int
resolve(const struct xfer_from *c, uint64_t id, const char *which, struct region **out, bool *read_only,
    char *err, size_t errlen)
{
	struct region *h = c->region(c->arg, id, read_only);

	if (h == NULL) {
		if ((uint32_t)(id >> 32) != c->epoch && id != 0) {
			snprintf(err, errlen, "%s region %#llx is not this connection's", which,
			    (unsigned long long)id);
			xfer_audit(c, "%s", err);
			return -GPX__STATUS__EACCES;
		}
		snprintf(err, errlen, "no %s region %#llx", which, (unsigned long long)id);
		return -GPX__STATUS__ENOENT;
	}
	if (atomic_load(&h->revoked)) {
		snprintf(err, errlen, "%s region %#llx was withdrawn by its owner", which,
		    (unsigned long long)id);
		return -GPX__STATUS__EREVOKED;
	}
	*out = h;
	return 0;
}

/* Both regions of a pair for this connection, the destination writable, local or remote. */
static int
resolve_pair(const struct xfer_from *c, uint64_t src, uint64_t dst, struct region **sh, struct region **dh,
    char *err, size_t errlen)
{
	bool src_ro, dst_ro;
	int r;

	if ((r = resolve(c, src, "source", sh, &src_ro, err, errlen)) < 0 ||
	    (r = resolve(c, dst, "destination", dh, &dst_ro, err, errlen)) < 0)
		return r;
	if (dst_ro || (*dh)->read_only) {
		snprintf(err, errlen, "destination region %#llx is read-only", (unsigned long long)dst);
		xfer_audit(c, "%s", err);
		return -GPX__STATUS__EACCES;
	}
	/* fabric: another node's region on one side (without the fabric, no region is remote) */
	return fabric != NULL ? fabric->xfer_check(*sh, *dh, err, errlen) : 0;
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
seg_refused(uint32_t i, const struct gpx_wire_seg *g, const struct region *src, const struct region *dst,
    char *err, size_t errlen)
{
	snprintf(err, errlen, "segment %u (%llu+%llu -> %llu+%llu) leaves its region "
	    "(source %llu bytes, destination %llu bytes)", i,
	    (unsigned long long)g->src_offset, (unsigned long long)g->length,
	    (unsigned long long)g->dst_offset, (unsigned long long)g->length,
	    (unsigned long long)src->length, (unsigned long long)dst->length);
	return -GPX__STATUS__ERANGE;
}


/* Source and destination offsets side by side: one subtraction checks both (GCC and Clang). */
typedef uint64_t seg_pair __attribute__((vector_size(16), aligned(8)));

/* The slow path of a refused request: which segment, from the private copy, for the message. */
static int
segs_refused(const struct job *j, const struct region *src, const struct region *dst, char *err, size_t errlen)
{
	const uint64_t slen = src->length < SEG_LIMIT ? src->length : SEG_LIMIT - 1;
	const uint64_t dlen = dst->length < SEG_LIMIT ? dst->length : SEG_LIMIT - 1;
	uint64_t total = 0;

	for (uint32_t i = 0; i < j->nseg; i++) {
		const struct gpx_wire_seg *g = &j->segs[i];
		if (!inside(g->src_offset, g->length, slen) || !inside(g->dst_offset, g->length, dlen))
			return seg_refused(i, g, src, dst, err, errlen);
		total += g->length;
		if (total >= SEG_LIMIT)
			break;
	}
	snprintf(err, errlen, "the %u segments add up to 2^62 bytes or more", j->nseg);
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
    const struct region *dst, char *err, size_t errlen)
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
		return segs_refused(j, src, dst, err, errlen);
	j->total = total;
	return 0;
}

/*
 * A batch's version of check_segs: the n records of one pair's run at `in`, each loaded once,
 * rebased by the pair's bases, checked against its regions and stored at j->segs[at..]; the
 * running byte count of the job in *total and blocks[].  True when some segment may be bad
 * (the raw offsets go into the test too, so a base cannot wrap a huge one into range).
 */
static bool
check_run(struct job *j, uint32_t at, const struct gpx_wire_seg *in, uint32_t n, const struct jpair *p,
    uint64_t *total)
{
	const seg_pair lim = { p->src->length < SEG_LIMIT ? p->src->length : SEG_LIMIT - 1,
	    p->dst->length < SEG_LIMIT ? p->dst->length : SEG_LIMIT - 1 };
	const seg_pair base = { p->src_base, p->dst_base };
	seg_pair bad2 = { 0, 0 };
	uint64_t t = *total, bad = p->src_base | p->dst_base;

	for (uint32_t i = 0; i < n; i++) {
		const seg_pair raw = *(const volatile seg_pair *)&in[i];
		const uint64_t len = *(const volatile uint64_t *)&in[i].length;
		const seg_pair off = raw + base;
		t += len;
		bad2 |= raw | off | (lim - off - len);
		bad |= len | t;
		memcpy(&j->segs[at + i], &off, sizeof(off));
		j->segs[at + i].length = len;
		if ((at + i + 1) % SEG_BLOCK == 0)
			j->blocks[(at + i) / SEG_BLOCK] = t;
	}
	*total = t;
	return ((bad | bad2[0] | bad2[1]) & SEG_BAD) != 0;
}

/* Reads the job's n segments from the memfd the client sent them in. */
static int
read_segs(struct job *j, int fd, char *err, size_t errlen)
{
	size_t want = (size_t)j->nseg * sizeof(*j->segs);

	for (size_t got = 0; got < want;) {
		ssize_t k = pread(fd, (char *)j->segs + got, want - got, got);
		if (k <= 0) {
			snprintf(err, errlen, "reading the segment table: %s", k < 0 ? strerror(errno) : "short");
			return -GPX__STATUS__EINVAL;
		}
		got += k;
	}
	return 0;
}

int
xfer_charge(struct charge *ch, uint64_t bytes, const struct xfer_from *c, char *err, size_t errlen)
{
	int r;

	if (ch->cq == NULL)
		return 0;
	if ((r = xfer_pairs_charge(c->pairs, ch, bytes, err, errlen)) < 0)
		xfer_audit(c, "%s", err);
	return r;
}

uint64_t
xfer_segs_bytes(uint32_t n)
{
	return (uint64_t)n * sizeof(struct gpx_wire_seg) + (n + SEG_BLOCK - 1) / SEG_BLOCK * sizeof(uint64_t);
}

int
xfer_segs_charge(struct job *j, struct charge *ch, const struct xfer_from *c, char *err, size_t errlen)
{
	return xfer_charge(ch, xfer_segs_bytes(j->nseg), c, err, errlen);
}

int
xfer_segs_alloc(struct job *j)
{
	if ((j->segs = malloc(xfer_segs_bytes(j->nseg))) == NULL)
		return -GPX__STATUS__ENOMEM;
	j->blocks = (uint64_t *)(j->segs + j->nseg);
	return 0;
}

/*
 * Maps a client's segment area read-only into *area, replacing the previous one.  (No check
 * of its lists runs meanwhile: a connection's further messages wait while one does.)
 */
int
xfer_set_area(const unsigned char **area, size_t *area_len, int fd, uint64_t length, char *err, size_t errlen)
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
	xfer_drop_area(area, area_len, NULL);
	*area = p;
	*area_len = length;
	return 0;
}

/*
 * Unmapping what the loop has read of a large area costs it milliseconds (32 ms for 128 MiB of
 * lists): a task thread does it.
 */
struct unmap {
	struct defer_task task;        /* queued through it (defer.c) */
	void *p;
	size_t len;
};

static void
unmap_work(void *arg)
{
	struct unmap *u = arg;

	munmap(u->p, u->len);
}

static void
area_unmap(void *p, size_t len)
{
	struct unmap *u;

	if ((u = malloc(sizeof(*u))) == NULL) {
		munmap(p, len);
		return;
	}
	*u = (struct unmap){ .p = p, .len = len };
	defer_run(&u->task, unmap_work, free, u);
}

/* Lets go of a segment area; one that checking (a task thread) still reads goes when it ends. */
void
xfer_drop_area(const unsigned char **area, size_t *area_len, struct xfer_check *checking)
{
	if (*area != NULL && checking != NULL && checking->in != NULL) {
		checking->area = (void *)*area;
		checking->area_len = *area_len;
	} else if (*area != NULL)
		area_unmap((void *)*area, *area_len);
	*area = NULL;
	*area_len = 0;
}

const unsigned char *
xfer_area(const unsigned char *area, size_t area_len, uint64_t off, uint64_t bytes)
{
	if (area == NULL || off % 8 != 0 || !inside(off, bytes, area_len))
		return NULL;
	return area + off;
}

/* What a job of npairs pairs is, without its lists. */
static uint64_t
job_bytes(uint32_t npairs)
{
	return sizeof(struct job) + (npairs > 1 ? (uint64_t)npairs * sizeof(struct jpair) : 0);
}

/* What a built job holds: itself, its pairs and its list. */
static uint64_t
job_footprint(const struct job *j)
{
	return job_bytes(j->npairs) + (j->segs != NULL ? xfer_segs_bytes(j->nseg) : 0) +
	    (j->plist != NULL ? (uint64_t)j->npages * sizeof(*j->plist) : 0);
}

/* A job with one pair slot, or npairs of its own, charged first; NULL with err set. */
static struct job *
job_new(uint32_t npairs, struct charge *ch, const struct xfer_from *c, int *r, char *err, size_t errlen)
{
	struct job *j;

	if ((*r = xfer_charge(ch, job_bytes(npairs), c, err, errlen)) < 0)
		return NULL;
	if ((j = calloc(1, sizeof(*j))) != NULL && npairs > 1 && (j->pairs = calloc(npairs, sizeof(*j->pairs))) == NULL) {
		free(j);
		j = NULL;
	}
	if (j == NULL) {
		*r = -GPX__STATUS__ENOMEM;
		snprintf(err, errlen, "out of memory for a transfer");
		return NULL;
	}
	if (npairs <= 1)
		j->pairs = &j->one;
	j->npairs = npairs;
	err[0] = '\0';
	return j;
}

/*
 * A request built: each job keeps the charge of what it holds until it is freed (the group,
 * shared by all, on the first); the scratch of building it is given back.
 */
static void
charge_keep(struct charge *ch, struct job *head)
{
	uint64_t kept = 0;

	if (ch->cq == NULL)
		return;
	for (struct job *j = head; j != NULL; j = j->gnext) {
		j->charged = job_footprint(j) + (j == head && j->group != NULL ? sizeof(struct jgroup) : 0);
		kept += j->charged;
	}
	budget_release(ch->cq, ch->user, ch->bytes - kept);
}

/*
 * The job names its first pair's regions, and has its path (a page job the kernel runs has
 * one already): from here on, before its lists are checked, xfer_build wakes that path's
 * worker.
 */
static void
job_route(struct job *j)
{
	j->src = j->pairs[0].src;
	j->dst = j->pairs[0].dst;
	if (j->pages == NULL)
		j->path = engine_path_for(j->src, j->dst);
}

/*
 * Takes a mapping user and a reference on both regions of every pair of the checked job, or
 * none at all; then routes it (job_route).
 */
static int
job_hold(struct job *j, char *err, size_t errlen)
{
	for (uint32_t k = 0; k < j->npairs; k++) {
		struct jpair *p = &j->pairs[k];
		struct region *side[2] = { p->src, p->dst };
		for (int i = 0; i < 2; i++)
			if (!region_hold(side[i])) {
				snprintf(err, errlen, "%s region was withdrawn by its owner", i ? "destination" : "source");
				if (i == 1)
					region_drop(p->src);
				while (k-- > 0) {
					region_drop(j->pairs[k].src);
					region_drop(j->pairs[k].dst);
				}
				return -GPX__STATUS__EREVOKED;
			}
	}
	job_route(j);
	return 0;
}

/* Frees a job that holds no region yet: its lists, its pairs and itself. */
static void
job_drop(struct job *j)
{
	for (uint32_t k = 0; k < j->npairs; k++)
		j->pairs[k].src = j->pairs[k].dst = NULL;
	engine_free_job(j);
}

/* What every job of a transfer carries. */
static void
job_finish_build(struct job *j, const struct xfer_check *k)
{
	j->tag = k->tag;
	j->client = k->client;
	j->t_build = k->t_build;
	j->t_submit = now_s();
}

/*
 * A batch takes a use and a reference of each of its regions, and a copy worker gave back the
 * previous batch's at its end: every region's counters lie in that worker's cache.  Fetched
 * for writing all at once, their misses overlap instead of following one another (64 pairs
 * on two H200s: the check took 16 us, 13 with this).
 */
static void
prefetch_regions(const struct xfer_from *c, const struct gpx_wire_pair *pr, uint32_t np)
{
	for (uint32_t q = 0; q < np; q++) {
		const uint64_t id[2] = { pr[q].src_region, pr[q].dst_region };
		for (int i = 0; i < 2; i++) {
			bool ro;
			struct region *r = c->region(c->arg, id[i], &ro);
			if (r != NULL) {
				__builtin_prefetch(r, 1);                        /* its counts, taken below */
				__builtin_prefetch((const char *)r + 64, 0);     /* what resolve reads */
			}
		}
	}
}

/*
 * A connection's last batch, resolved: its pair records as they came and, for each, its two
 * regions (with the pair's bases) and its path, both regions held.  A weight push sends the
 * same records every time; a batch of the same bytes takes its pairs from here instead of
 * looking up, checking and holding both regions of each again: its jobs hold this instead
 * (one reference each, where each pair took two atomic operations at the check and two more
 * at its end).  Sound because a record names handles by id, ids are never reused, and what a
 * live handle names (its region, whether it is read-only, the region's kind and GPU) never
 * changes: the connection drops this whenever it lets go of a handle.  A region it names that
 * is revoked (its owner withdrew it) drops it too, on the loop thread (region_on_revoke), so
 * that no such region is taken from here and no mapping is kept past its jobs for it.  All on
 * the loop thread but the references, which jobs give back on copy workers.
 */
struct xfer_pairs {
	TAILQ_ENTRY(xfer_pairs) entry;   /* in kept, while its connection keeps it */
	atomic_uint refs;            /* its connection's, the check's that uses it, each job's */
	struct xfer_pairs **slot;    /* its connection's pointer to it, while kept */
	uint64_t *entries;           /* the connection's entries it is charged to */
	struct user *user;
	uint64_t charged;
	uint32_t np;
	uint64_t nsegs;              /* the segments the records name, all pairs */
	uint64_t seg_end;            /* the end of the furthest run of segments */
	struct gpx_wire_pair *pr;    /* np of each, in the same allocation as the struct */
	struct jpair *jp;
	enum path_kind *path;
	struct gpu_pair_at *at;      /* np, where every pair takes one GPU's path; else NULL */
};
static TAILQ_HEAD(, xfer_pairs) kept = TAILQ_HEAD_INITIALIZER(kept);
static atomic_uint_fast64_t kept_lists, kept_taken;     /* for the metrics */

void
xfer_pairs_counts(uint64_t *lists, uint64_t *taken)
{
	*lists = atomic_load_explicit(&kept_lists, memory_order_relaxed);
	*taken = atomic_load_explicit(&kept_taken, memory_order_relaxed);
}

#define PAIRS_KEEP_MIN 16            /* fewer pairs are resolved again each time */

struct gpu_pair_at *
xfer_pairs_at(struct xfer_pairs *p, uint32_t *np)
{
	*np = p->np;
	return p->at;
}

void
xfer_pairs_unref(struct xfer_pairs *p)
{
	if (atomic_fetch_sub(&p->refs, 1) != 1)
		return;
	for (uint32_t q = 0; q < p->np; q++) {
		region_drop(p->jp[q].src);
		region_drop(p->jp[q].dst);
	}
	free(p);
}

/* Its connection lets go of it (loop thread): its jobs keep it until they end. */
static void
pairs_detach(struct xfer_pairs *p)
{
	budget_entry_release(p->entries, p->user, p->charged);
	for (uint32_t q = 0; q < p->np; q++) {
		p->jp[q].src->kept_by--;
		p->jp[q].dst->kept_by--;
	}
	TAILQ_REMOVE(&kept, p, entry);
	*p->slot = NULL;
	xfer_pairs_unref(p);
}

void
xfer_pairs_drop(struct xfer_pairs **kp)
{
	if (*kp != NULL)
		pairs_detach(*kp);
}

int
xfer_pairs_charge(struct xfer_pairs **kp, struct charge *ch, uint64_t bytes, char *err, size_t errlen)
{
	if (kp != NULL && *kp != NULL) {
		/* (a try that is not counted as a refusal when it fails) */
		const bool optional = ch->optional;
		ch->optional = true;
		int r = budget_charge(ch, bytes, err, errlen);
		ch->optional = optional;
		if (r == 0)
			return 0;
		xfer_pairs_drop(kp);
	}
	return budget_charge(ch, bytes, err, errlen);
}

/* region_revoke's hook: every kept list that names r goes. */
static void
pairs_revoked(struct region *r)
{
	struct xfer_pairs *p, *t;

	TAILQ_FOREACH_SAFE(p, &kept, entry, t)
		for (uint32_t q = 0; q < p->np; q++)
			if (p->jp[q].src == r || p->jp[q].dst == r) {
				pairs_detach(p);
				break;
			}
}

void
xfer_pairs_init(void)
{
	region_on_revoke(pairs_revoked);
}

/* Whether pair record q's run of segments lies in a list of n and is not empty; else the refusal in err. */
static bool
run_inside(const struct gpx_wire_pair *w, uint32_t q, uint32_t n, char *err, size_t errlen)
{
	if ((uint64_t)w->seg_first + w->seg_count <= n && w->seg_count > 0)
		return true;
	snprintf(err, errlen, "pair %u names segments %u..%u of a list of %u", q, w->seg_first,
	    w->seg_first + w->seg_count, n);
	return false;
}

/*
 * When the batch's np records are the kept ones: their pairs and paths into jp and path, the
 * segments they name in *nsegs, a reference for the check in k->kept, and true; *r then says
 * whether they fit this request's list of n (a refusal as the full check gives it).  False:
 * resolve them.
 */
static bool
pairs_kept(const struct xfer_from *c, struct xfer_check *k, const struct gpx_wire_pair *pr, uint32_t np, bool pages,
    uint32_t n, struct jpair *jp, enum path_kind *path, uint64_t *nsegs, int *r, char *err, size_t errlen)
{
	struct xfer_pairs *p = c->pairs != NULL ? *c->pairs : NULL;

	if (p == NULL || p->np != np || memcmp(p->pr, pr, np * sizeof(*pr)) != 0)
		return false;
	memcpy(jp, p->jp, np * sizeof(*jp));
	memcpy(path, p->path, np * sizeof(*path));
	*nsegs = pages ? 0 : p->nsegs;
	*r = 0;
	for (uint32_t q = 0; !pages && p->seg_end > n && q < np; q++)
		if (!run_inside(&pr[q], q, n, err, errlen)) {
			*r = -GPX__STATUS__EINVAL;
			break;
		}
	atomic_fetch_add(&p->refs, 1);
	k->kept = p;
	atomic_fetch_add_explicit(&kept_taken, 1, memory_order_relaxed);
	return true;
}

/*
 * Keeps a batch's np resolved pairs for the next, holding their regions (when the
 * connection's budget has room and none is being withdrawn), in place of what it kept.
 */
static void
pairs_keep(const struct xfer_from *c, const struct gpx_wire_pair *pr, uint32_t np, const struct jpair *jp,
    const enum path_kind *path, uint64_t nsegs)
{
	bool one_gpu = np > 0 && path[0] >= PATH_GPU0 && path[0] < PATH_GPU0 + GPX_MAX_GPUS;
	for (uint32_t q = 1; q < np && one_gpu; q++)
		one_gpu = path[q] == path[0];
	const uint64_t bytes = sizeof(struct xfer_pairs) + np * (sizeof(*pr) + sizeof(*jp) + sizeof(*path)) +
	    (one_gpu ? np * sizeof(struct gpu_pair_at) : 0);
	struct charge ch = { .cq = c->cq, .entries = c->entries, .user = c->user, .entry = true, .optional = true,
	    .what = "batch pairs kept" };
	struct xfer_pairs *p = NULL;
	char why[256];
	uint32_t held = 0;

	if (c->pairs == NULL || np < PAIRS_KEEP_MIN || c->cq == NULL)
		return;
	/*
	 * Only records that came twice running are kept: a client that alternates between
	 * batches would otherwise pay for keeping each (the holds, the copies) and for dropping
	 * the last, at every request; and one other batch between two of the kept leaves it.
	 */
	uint64_t fp = np;
	const uint64_t *w = (const uint64_t *)pr;
	for (size_t i = 0; i < np * sizeof(*pr) / sizeof(*w); i++)
		fp = (fp ^ w[i]) * 0x9e3779b97f4a7c15ULL;
	if (*c->pairs_seen != fp) {
		*c->pairs_seen = fp;
		return;
	}
	xfer_pairs_drop(c->pairs);
	if (budget_charge(&ch, bytes, why, sizeof(why)) < 0)
		return;          /* (not kept: the next batch resolves its pairs again) */
	if ((p = calloc(1, bytes)) == NULL)
		goto fail;
	_Static_assert(sizeof(struct xfer_pairs) % _Alignof(struct gpu_pair_at) == 0 &&
	    sizeof(struct gpu_pair_at) % _Alignof(struct gpx_wire_pair) == 0 &&
	    sizeof(struct gpx_wire_pair) % _Alignof(struct jpair) == 0 &&
	    sizeof(struct jpair) % _Alignof(enum path_kind) == 0, "each array of a kept list stays aligned");
	p->at = one_gpu ? (struct gpu_pair_at *)(p + 1) : NULL;      /* (zero: none found yet) */
	p->pr = (struct gpx_wire_pair *)((struct gpu_pair_at *)(p + 1) + (one_gpu ? np : 0));
	p->jp = (struct jpair *)(p->pr + np);
	p->path = (enum path_kind *)(p->jp + np);
	memcpy(p->pr, pr, np * sizeof(*pr));
	memcpy(p->jp, jp, np * sizeof(*jp));
	memcpy(p->path, path, np * sizeof(*path));
	for (; held < np; held++)
		if (!region_hold(jp[held].src))
			goto fail;
		else if (!region_hold(jp[held].dst)) {
			region_drop(jp[held].src);
			goto fail;
		}
	p->np = np;
	p->nsegs = nsegs;
	for (uint32_t q = 0; q < np; q++) {
		if ((uint64_t)pr[q].seg_first + pr[q].seg_count > p->seg_end)
			p->seg_end = (uint64_t)pr[q].seg_first + pr[q].seg_count;
		jp[q].src->kept_by++;
		jp[q].dst->kept_by++;
	}
	atomic_init(&p->refs, 1);
	p->slot = c->pairs;
	p->entries = c->entries;
	p->user = c->user;
	p->charged = bytes;
	TAILQ_INSERT_TAIL(&kept, p, entry);
	*c->pairs = p;
	atomic_fetch_add_explicit(&kept_lists, 1, memory_order_relaxed);
	return;
fail:
	while (held-- > 0) {
		region_drop(jp[held].src);
		region_drop(jp[held].dst);
	}
	free(p);
	budget_entry_release(c->entries, c->user, bytes);
}

/*
 * A page list in GPU memory (protocol 4): its region (this connection's, or one it imported)
 * resolved and held for the request, and the list's n source and n destination numbers
 * inside it.  Nothing of the list itself is read here.
 */
static int
list_take(const struct xfer_from *c, const Gpx__Transfer *t, uint32_t n, struct xfer_check *k, char *err,
    size_t errlen)
{
	struct region *r;
	bool ro;
	int e;

	if ((e = resolve(c, t->list_region, "page list", &r, &ro, err, errlen)) < 0)
		return e;
	if (t->list_offset % 4 != 0 || !inside(t->list_offset, 8ull * n, r->length)) {
		snprintf(err, errlen, "a list of %u pages (%llu bytes) at %llu: 4-byte aligned and inside its region "
		    "(%llu bytes)", n, 8ull * n, (unsigned long long)t->list_offset, (unsigned long long)r->length);
		return -GPX__STATUS__ERANGE;
	}
	if (r->dev == DEV_HOST || r->kind == GPX__MEM_KIND__MEM_REMOTE) {
		snprintf(err, errlen, "page list region %#llx is not GPU memory of this node (a list in host memory "
		    "comes in the segment area)", (unsigned long long)t->list_region);
		return -GPX__STATUS__EINVAL;
	}
	if (!region_hold(r)) {
		snprintf(err, errlen, "page list region was withdrawn by its owner");
		return -GPX__STATUS__EREVOKED;
	}
	k->list = r;
	return 0;
}

/*
 * A batch (protocol 3): the pairs copied out of the segment area and resolved, grouped by
 * path; then per group one job, with its segment array (each pair's run, rebased) or its page
 * list allocated.  Any refusal refuses the whole batch, before any job is handed over.
 */
static int
build_batch(const struct xfer_from *c, const Gpx__Transfer *t, int segfd, struct xfer_check *k, char *err,
    size_t errlen)
{
	const bool pages = t->page_size > 0;
	const uint32_t np = t->pair_count, n = t->seg_count;
	const unsigned char *wp, *list = NULL;
	struct gpx_wire_pair *pr;
	struct jpair *jp = NULL;
	enum path_kind *path = NULL;
	struct job **tail = &k->head;
	uint32_t used = 0;
	int r = 0;

	const bool table = t->list_region != 0 || t->list_offset != 0;
	if (c->version < 3 || np > GPX_PAIRS_MAX || segfd >= 0 || t->n_segments > 0 || n == 0 ||
	    t->src_region != 0 || t->dst_region != 0 || t->src_offset != 0 || t->dst_offset != 0 ||
	    (table && (c->version < 4 || t->list_region == 0 || !pages || t->area_offset != 0))) {
		snprintf(err, errlen, "a batch (protocol 3) is 1..%u pairs and its list, both in the segment "
		    "area (or, protocol 4, its pages' table in a region), and nothing else", GPX_PAIRS_MAX);
		return -GPX__STATUS__EPROTO;
	}
	if (n > cfg->max_segs || (wp = xfer_area(c->area, c->area_len, t->pair_offset, (uint64_t)np * sizeof(*pr))) == NULL ||
	    (!table && (list = xfer_area(c->area, c->area_len, t->area_offset, (uint64_t)n * (pages ?
	    sizeof(struct gpx_wire_page) : sizeof(struct gpx_wire_seg)))) == NULL)) {
		snprintf(err, errlen, "%u pairs at %llu and %u %s at %llu: at most %u, inside the segment "
		    "area (%zu bytes)", np, (unsigned long long)t->pair_offset, n, pages ? "pages" : "segments",
		    (unsigned long long)t->area_offset, cfg->max_segs, c->area_len);
		return -GPX__STATUS__EINVAL;
	}
	if (table && (r = list_take(c, t, n, k, err, errlen)) < 0)
		return r;
	if ((r = xfer_charge(&k->ch, (uint64_t)np * (sizeof(*pr) + sizeof(*jp) + sizeof(*path) + sizeof(*k->idx)),
	    c, err, errlen)) < 0)
		return r;
	k->pr = pr = malloc(np * sizeof(*pr));
	jp = calloc(np, sizeof(*jp));
	path = malloc(np * sizeof(*path));
	k->idx = malloc(np * sizeof(*k->idx));
	if (pr == NULL || jp == NULL || path == NULL || k->idx == NULL) {
		snprintf(err, errlen, "out of memory for %u pairs", np);
		r = -GPX__STATUS__ENOMEM;
		goto out;
	}
	k->in = list;
	k->n = n;
	/* The pairs, read once; every one resolved before anything else. */
	memcpy(pr, (const void *)wp, np * sizeof(*pr));
	uint64_t nsegs = 0;
	if (pairs_kept(c, k, pr, np, pages, n, jp, path, &nsegs, &r, err, errlen))
		goto resolved;
	prefetch_regions(c, pr, np);
	for (uint32_t q = 0; q < np && r == 0; q++) {
		struct region *sh, *dh;
		if ((r = resolve_pair(c, pr[q].src_region, pr[q].dst_region, &sh, &dh, err, errlen)) < 0)
			break;
		if (sh->kind == GPX__MEM_KIND__MEM_REMOTE || dh->kind == GPX__MEM_KIND__MEM_REMOTE) {
			snprintf(err, errlen, "pair %u: a batch moves memory of this node; copy to or from another "
			    "node's region one transfer at a time", q);
			r = -GPX__STATUS__ENOTSUP;
			break;
		}
		jp[q] = (struct jpair){ .src = sh, .dst = dh, .src_base = pr[q].src_offset,
		    .dst_base = pr[q].dst_offset };
		path[q] = engine_path_for(sh, dh);
		if (!pages && !run_inside(&pr[q], q, n, err, errlen))
			r = -GPX__STATUS__EINVAL;
		nsegs += pages ? 0 : pr[q].seg_count;
	}
	if (r == 0)
		pairs_keep(c, pr, np, jp, path, nsegs);
resolved:
	if (r == 0 && nsegs > cfg->max_segs) {
		snprintf(err, errlen, "the pairs name %llu segments in all (at most %u)", (unsigned long long)nsegs,
		    cfg->max_segs);
		r = -GPX__STATUS__EINVAL;
	}
	/* One job per path, its pairs in the batch's order. */
	for (uint32_t q0 = 0; q0 < np && r == 0; q0++) {
		const enum path_kind pk = path[q0];
		uint32_t cnt = 0, *ix = k->idx + used;
		uint64_t segs = 0;
		if (pk == NPATHS)
			continue;       /* in an earlier group */
		for (uint32_t q = q0; q < np; q++)
			if (path[q] == pk) {
				ix[cnt++] = q;
				segs += pages ? 0 : pr[q].seg_count;
				path[q] = NPATHS;
			}
		struct job *j = job_new(cnt, &k->ch, c, &r, err, errlen);
		if (j == NULL)
			break;
		*tail = j;
		tail = &j->gnext;
		k->gfirst[k->ngroups++] = used;
		used += cnt;
		for (uint32_t i = 0; i < cnt; i++)
			j->pairs[i] = jp[ix[i]];
		if (pages)
			continue;       /* the page list is taken once the groups are known */
		j->nseg = (uint32_t)segs;
		k->work += xfer_segs_bytes(j->nseg);
		k->want[k->ngroups - 1] = LIST_SEGS;
		if ((r = xfer_segs_charge(j, &k->ch, c, err, errlen)) < 0)
			break;
	}
	if (r == 0 && k->list != NULL && k->ngroups > 1) {
		snprintf(err, errlen, "a page table in GPU memory is read by one GPU's page kernel: every pair of "
		    "the batch on the GPUs that kernel runs (its pairs take %d paths)", k->ngroups);
		r = -GPX__STATUS__ENOTSUP;
	}
	if (r == 0 && pages && k->ngroups > 1) {
		/* Several groups read one private copy; one group reads the area itself. */
		k->work += (uint64_t)n * sizeof(struct gpx_wire_page);
		k->want_plist = true;
		r = xfer_charge(&k->ch, (uint64_t)n * sizeof(struct gpx_wire_page), c, err, errlen);
	}
	int g = 0;
	for (struct job *j = k->head; j != NULL && r == 0 && pages; j = j->gnext, g++) {
		enum xfer_list want;
		r = xfer_pages_prepare(j, n, t->page_size, k->list, t->list_offset, c, &k->ch, &k->work, &want, err,
		    errlen);
		k->want[g] = want;
	}
	for (struct job *j = k->head; j != NULL && r == 0 && k->kept != NULL; j = j->gnext) {
		/* the kept pairs' holds stand for the pairs' own */
		atomic_fetch_add(&k->kept->refs, 1);
		j->kept = k->kept;
		job_route(j);
	}
	for (struct job *j = k->head; j != NULL && r == 0 && k->kept == NULL; j = j->gnext)
		if ((r = job_hold(j, err, errlen)) < 0)
			for (struct job *h = k->head; h != j; h = h->gnext) {
				/* the groups before let go of what they took */
				for (uint32_t q = 0; q < h->npairs; q++) {
					region_drop(h->pairs[q].src);
					region_drop(h->pairs[q].dst);
				}
			}
	if (r == 0 && k->list != NULL) {
		k->head->list = k->list;     /* (one job: a table's batch has one group) */
		k->list = NULL;
	}
out:
	if (k->kept != NULL) {
		xfer_pairs_unref(k->kept);   /* the check's: its jobs have theirs */
		k->kept = NULL;
	}
	free(path);
	free(jp);
	return r;
}

/* A batch's segments, group after group: each pair's run rebased and checked, into its job's array. */
static int
check_batch_segs(struct xfer_check *k, char *err, size_t errlen)
{
	int g = 0;

	for (struct job *j = k->head; j != NULL; j = j->gnext, g++) {
		const uint32_t *ix = k->idx + k->gfirst[g];
		uint64_t total = 0;
		bool bad = false;
		for (uint32_t i = 0, at = 0; i < j->npairs; i++) {
			const struct gpx_wire_pair *w = &k->pr[ix[i]];
			struct jpair *p = &j->pairs[i];
			uint64_t before = total;
			bad |= check_run(j, at, (const struct gpx_wire_seg *)k->in + w->seg_first, w->seg_count, p, &total);
			at += w->seg_count;
			p->seg_end = at;
			p->bytes = total - before;
		}
		if (j->nseg % SEG_BLOCK != 0)
			j->blocks[j->nseg / SEG_BLOCK] = total;
		if (bad) {
			snprintf(err, errlen, "a segment of the batch leaves its pair's region, or the segments "
			    "add up to 2^62 bytes or more");
			return -GPX__STATUS__ERANGE;
		}
		j->total = total;
	}
	return 0;
}

/* A single transfer: its regions resolved and held, its job and private list allocated. */
static int
build_one(const struct xfer_from *c, const Gpx__Transfer *t, int segfd, struct xfer_check *k, char *err,
    size_t errlen)
{
	struct region *sh, *dh;
	const unsigned char *table = NULL;
	uint32_t n;
	int r;

	if ((t->list_region != 0 || t->list_offset != 0) && (c->version < 4 || t->list_region == 0 ||
	    t->page_size == 0 || t->seg_count == 0 || t->area_offset != 0 || segfd >= 0 || t->n_segments > 0)) {
		snprintf(err, errlen, c->version < 4 ? "a page list in a region needs protocol 4 (this connection "
		    "speaks %u)" : "a page list in a region is a page transfer's (page_size, seg_count pages), named "
		    "by list_region, with nothing in the segment area, no memfd, no inline segments", c->version);
		return -GPX__STATUS__EPROTO;
	}
	if ((r = resolve_pair(c, t->src_region, t->dst_region, &sh, &dh, err, errlen)) < 0)
		return r;
	/* What the hold and the hand-over to the engine write, fetched while the rest is checked. */
	region_warm(sh);
	region_warm(dh);
	engine_warm(engine_path_for(sh, dh), c->cq, c->user);
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
	/* The claimed count is checked against the area, memfd or region before anything is allocated. */
	if (t->list_region != 0 && (r = list_take(c, t, n, k, err, errlen)) < 0)
		return r;
	if (t->seg_count > 0 && segfd < 0 && t->list_region == 0 &&
	    (table = xfer_area(c->area, c->area_len, t->area_offset, (uint64_t)n * (t->page_size > 0 ?
	    sizeof(struct gpx_wire_page) : sizeof(struct gpx_wire_seg)))) == NULL) {
		snprintf(err, errlen, "%u segments at %llu leave the segment area (%zu bytes)", n,
		    (unsigned long long)t->area_offset, c->area_len);
		return -GPX__STATUS__EINVAL;
	}
	if (segfd >= 0 && (r = segs_fd_ok(segfd, n, err, errlen)) < 0)
		return r;

	struct job *j = job_new(1, &k->ch, c, &r, err, errlen);
	if (j == NULL)
		return r;
	k->head = j;
	k->in = table;
	k->n = n;
	j->one = (struct jpair){ .src = sh, .dst = dh, .src_base = t->src_offset,
	    .dst_base = t->dst_offset, .seg_end = n };
	if (t->page_size > 0) {
		enum xfer_list want;
		r = xfer_pages_prepare(j, n, t->page_size, k->list, t->list_offset, c, &k->ch, &k->work, &want, err,
		    errlen);
		k->want[0] = want;
	} else {
		j->nseg = n;
		k->work += xfer_segs_bytes(n);
		k->want[0] = LIST_SEGS;
		k->fd = segfd;
		r = xfer_segs_charge(j, &k->ch, c, err, errlen);
	}
	if (r == 0 && t->n_segments > 0) {
		/* inline: what one message holds, copied now (the message is gone after this turn) */
		k->want[0] = LIST_NONE;
		if ((r = xfer_segs_alloc(j)) < 0)
			snprintf(err, errlen, "out of memory for %u segments", n);
		for (uint32_t i = 0; i < n && r == 0; i++) {
			j->segs[i].src_offset = t->segments[i]->src_offset;
			j->segs[i].dst_offset = t->segments[i]->dst_offset;
			j->segs[i].length = t->segments[i]->length;
		}
	}
	if (r == 0)
		r = job_hold(j, err, errlen);
	if (r == 0 && k->list != NULL) {
		j->list = k->list;           /* the job's hold from here on */
		k->list = NULL;
	}
	return r;
}

/* The check: every list copied in and checked from the copy.  Any thread; a refusal in k->err. */
static int
check_all(struct xfer_check *k, bool on_loop)
{
	struct job *j = k->head;
	int g = 0, r;

	/* The private lists first, by the thread that fills them (charged already). */
	for (struct job *h = k->head; h != NULL; h = h->gnext, g++)
		if ((k->want[g] == LIST_SEGS && xfer_segs_alloc(h) < 0) || (k->want[g] == LIST_PAGES &&
		    (h->plist = malloc((size_t)h->npages * sizeof(*h->plist))) == NULL)) {
			snprintf(k->err, sizeof(k->err), "out of memory for a list of %u records", k->n);
			return -GPX__STATUS__ENOMEM;
		}
	if (k->want_plist && (k->plist = malloc((size_t)k->n * sizeof(struct gpx_wire_page))) == NULL) {
		snprintf(k->err, sizeof(k->err), "out of memory for %u pages", k->n);
		return -GPX__STATUS__ENOMEM;
	}
	if (!k->batch && k->pages)
		return xfer_pages_check(j, k->in, on_loop, k->err, sizeof(k->err));
	if (!k->batch) {
		if (k->fd >= 0 && (r = read_segs(j, k->fd, k->err, sizeof(k->err))) < 0)
			return r;
		r = check_segs(j, k->in != NULL ? (const struct gpx_wire_seg *)k->in : j->segs, j->src, j->dst,
		    k->err, sizeof(k->err));
		j->one.bytes = j->total;
		return r;
	}
	if (!k->pages)
		return check_batch_segs(k, k->err, sizeof(k->err));
	const unsigned char *in = k->in;
	if (k->plist != NULL) {
		memcpy(k->plist, (const void *)k->in, (size_t)k->n * sizeof(struct gpx_wire_page));
		in = k->plist;
	}
	for (; j != NULL; j = j->gnext)
		if ((r = xfer_pages_check(j, in, on_loop, k->err, sizeof(k->err))) < 0)
			return r;
	return 0;
}

void
xfer_check_run(struct xfer_check *k)
{
	k->status = check_all(k, false);
}

/* Lets go of what building needed and no job keeps. */
static void
check_free(struct xfer_check *k)
{
	free(k->plist);
	free(k->idx);
	free(k->pr);
	if (k->own_fd)
		close(k->fd);
	if (k->area != NULL)
		area_unmap(k->area, k->area_len);
	if (k->later) {
		if (k->ch.cq != NULL)
			cq_unref(k->ch.cq);
		free(k);
	}
}

/* A refusal at the end of a check, in the log within the asker's share (its connection lives). */
static void check_audit(const struct xfer_check *, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void
check_audit(const struct xfer_check *k, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	log_vrefused(&k->who, fmt, ap);
	va_end(ap);
}

int
xfer_check_end(struct xfer_check *k, bool gone, struct job **out, char *err, size_t errlen)
{
	struct jgroup *g = NULL;
	int r = k->status;

	*out = NULL;
	if (r < 0) {
		snprintf(err, errlen, "%s", k->err);
		if (r == -GPX__STATUS__ERANGE && !gone)
			check_audit(k, "%s", err);
	} else if (gone) {
		snprintf(err, errlen, "the client left while its list was checked");
		r = -GPX__STATUS__ECANCELED;
	} else if (k->ngroups > 1 && k->ch.cq != NULL && (r = budget_charge(&k->ch, sizeof(*g), err, errlen)) < 0)
		check_audit(k, "%s", err);
	else if (k->ngroups > 1 && (g = calloc(1, sizeof(*g))) == NULL) {
		snprintf(err, errlen, "out of memory for a transfer");
		r = -GPX__STATUS__ENOMEM;
	}
	if (r < 0) {
		/* (over a budget, out of memory, or a list that does not pass: refused whole) */
		while (k->head != NULL) {
			struct job *nx = k->head->gnext;
			engine_free_job(k->head);
			k->head = nx;
		}
		if (k->ch.cq != NULL)
			budget_release(k->ch.cq, k->ch.user, k->ch.bytes);
	} else {
		if (g != NULL)
			atomic_init(&g->left, k->ngroups);
		for (struct job *j = k->head; j != NULL; j = j->gnext) {
			j->group = g;
			job_finish_build(j, k);
		}
		charge_keep(&k->ch, k->head);
		*out = k->head;
	}
	check_free(k);
	return r;
}

int
xfer_build(const struct xfer_from *c, const Gpx__Transfer *t, int *segfd, struct job **out,
    struct xfer_check **later, char *err, size_t errlen)
{
	struct xfer_check k = { .client = c->client, .who = c->who,
	    .ch = { .cq = c->cq, .entries = c->entries, .user = c->user }, .tag = t->tag, .batch = t->pair_count > 0, .pages = t->page_size > 0, .fd = -1 };
	const int fd = segfd != NULL ? *segfd : -1;
	int r;

	k.t_build = log_level_debug() ? now_s() : 0;    /* for the engine's debug line */
	*out = NULL;
	if (later != NULL)
		*later = NULL;
	if (t->flags != 0) {
		/* (none is defined: a flag added later must never be ignored by a gpxd without it) */
		snprintf(err, errlen, "transfer flags 0x%x: no flag is defined in protocol %d", t->flags,
		    GPX_PROTO_VERSION);
		return -GPX__STATUS__EINVAL;
	}
	r = k.batch ? build_batch(c, t, fd, &k, err, errlen) : build_one(c, t, fd, &k, err, errlen);
	if (r < 0) {
		while (k.head != NULL) {
			struct job *nx = k.head->gnext;
			job_drop(k.head);      /* no regions held: its lists and itself */
			k.head = nx;
		}
		if (k.list != NULL)
			region_drop(k.list);
		if (k.ch.cq != NULL)
			budget_release(k.ch.cq, k.ch.user, k.ch.bytes);
		check_free(&k);
		return r;
	}
	/* Its regions are resolved, its lists to be checked: the workers of its paths may look now. */
	for (struct job *h = k.head; h != NULL; h = h->gnext)
		if (h == k.head || h->path != k.head->path)
			engine_prewake(h->path);
	struct xfer_check *h;
	if (later != NULL && loop_turn_list() + k.work > XFER_LOOP_BYTES && (h = malloc(sizeof(*h))) != NULL) {
		*h = k;
		h->later = true;
		if (h->fd >= 0) {
			h->own_fd = true;       /* the check's from now on */
			*segfd = -1;
		}
		if (h->ch.cq != NULL)
			cq_ref(h->ch.cq);
		*later = h;
		return 0;
	}
	/* (short enough for the loop, or no memory to hand it over: checked here and now) */
	loop_turn_checked(k.work);
	k.status = check_all(&k, true);
	return xfer_check_end(&k, false, out, err, errlen);
}
