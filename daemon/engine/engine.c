/*
 * The transfer engine.  Every accepted transfer becomes a job on one path (host<->host here;
 * the GPU back end adds its own).  A path keeps a round-robin list of the uids that have work
 * there, each uid a round-robin list of its connections with work, and each connection a
 * round-robin list of its jobs; workers take one chunk (at most chunk_size bytes, possibly
 * spanning many small segments) at a time from the next job of the next connection of the
 * next uid.  So a 4 KiB copy never waits behind more than one chunk of each other uid with
 * work (and of each worker's chunk in progress), however many connections and copies that
 * uid keeps busy; two saturating uids share a path evenly whatever their numbers of
 * connections, as the limits are per uid too; and within a uid its connections share evenly.
 *
 * A job ends when every byte was handed out and every handed-out chunk came back; the worker
 * that returns the last chunk posts the completion record itself.
 */
#include "config.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine/engine.h"
#include "daemon/fabric/fabric.h"
#include "daemon/gpu/gpu.h"
#include "daemon/host/host.h"

struct epath {
	TAILQ_HEAD(, uqueue) active; /* uids with work on the path */
	atomic_int nactive;          /* uids in `active`: a lock-free hint for spinning workers */
	atomic_int nqueues;          /* connections with work on the path (a hint too) */
	atomic_int nsmall;           /* jobs of ENGINE_SMALL_JOB bytes or less not yet handed out */
	atomic_int napping;          /* workers in engine_nap: every new job wakes them */
	atomic_int idle;             /* workers in engine_idle: engine_prewake's hint */
	/*
	 * The last job queued (its lines, its list, its queues, its regions), left by the loop
	 * for the path's worker: before it takes the lock it asks the cache for them all at once
	 * (warm_take), and the misses of the take (each a line the loop wrote last) overlap
	 * instead of following one another.  Addresses only: never read through, and the job
	 * may be gone.
	 */
	_Atomic(const void *) last[6];
	uint64_t prewakes;           /* engine_prewake calls that found one (under elock) */
	pthread_cond_t cond;
	atomic_uint_fast64_t transfers, bytes, errors;
};

static pthread_mutex_t elock = PTHREAD_MUTEX_INITIALIZER;
static struct epath paths[NPATHS];
static TAILQ_HEAD(, job) live = TAILQ_HEAD_INITIALIZER(live);
static atomic_uint nlive;            /* jobs in `live`: changed under elock, read without */
static atomic_uint_fast64_t prewoken; /* engine_prewakes */
static uint64_t chunk_size = 2 << 20;
static bool quit;
static int cancel_status = GPX__STATUS__ECANCELED;
static pthread_t *workers;
static int nworkers;
static void (*done_hook)(const struct job *, int status);   /* the metrics' (levent.c sets it) */

/* The stage clocks: per stage a count, a sum in ns and a histogram, lock-free. */
const double engine_stage_bounds[STAGE_BUCKETS] = {
	1e-6, 2.5e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 100e-3, 1,
};
static const char *stage_names[NSTAGES] = { "check", "queue", "launch", "gpu_wait", "copy", "post" };
static struct {
	atomic_uint_fast64_t count, ns;
	atomic_uint_fast64_t buckets[STAGE_BUCKETS + 1];
} stages[NSTAGES];

static const char *path_names[NPATHS] = {
	"host", "gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6", "gpu7",
	"gpu8", "gpu9", "gpu10", "gpu11", "gpu12", "gpu13", "gpu14", "gpu15",
	"fabric",
};

const char *
engine_path_name(enum path_kind p)
{
	return path_names[p];
}

/* Host to host runs on memcpy workers; anything touching a GPU on the source GPU's worker,
 * or the destination GPU's when the source is host memory. */
enum path_kind
engine_path_for(const struct region *src, const struct region *dst)
{
	/* fabric: anything with another node's region on one side (daemon/fabric/) */
	if (src->kind == GPX__MEM_KIND__MEM_REMOTE || dst->kind == GPX__MEM_KIND__MEM_REMOTE)
		return PATH_FABRIC;
	if (src->dev != DEV_HOST)
		return PATH_GPU0 + src->dev;
	if (dst->dev != DEV_HOST)
		return PATH_GPU0 + dst->dev;
	return PATH_HOST;
}

/* The pair that job segment (or page item) seg belongs to. */
uint32_t
engine_pair_of(const struct job *j, uint32_t seg)
{
	uint32_t lo = 0, hi = j->npairs - 1;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;
		if (j->pairs[mid].seg_end <= seg)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* Job j's pairs' sides kept for its GPU: j takes every pair of a kept batch, in its order. */
static struct gpu_pair_at *
engine_pairs_at(const struct job *j)
{
	uint32_t np;
	struct gpu_pair_at *at = j->kept != NULL ? xfer_pairs_at(j->kept, &np) : NULL;

	return at != NULL && np == j->npairs ? at : NULL;
}

bool
engine_has_work(enum path_kind p)
{
	return atomic_load_explicit(&paths[p].nactive, memory_order_relaxed) > 0;
}

/* The CLOCK_MONOTONIC time ns from now, as the paths' condition variables take it. */
static struct timespec
deadline(uint64_t ns)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	t.tv_sec += (time_t)(ns / 1000000000u);
	t.tv_nsec += (long)(ns % 1000000000u);
	if (t.tv_nsec >= 1000000000) {
		t.tv_sec++;
		t.tv_nsec -= 1000000000;
	}
	return t;
}

/*
 * A worker whose chunks are on the device, due in about ns, waits that long, or until a new
 * job comes for its path (a small copy must not wait for a long one's end to be issued).
 */
void
engine_nap(enum path_kind pk, uint64_t ns)
{
	struct epath *p = &paths[pk];
	const struct timespec t = deadline(ns);

	pthread_mutex_lock(&elock);
	atomic_fetch_add(&p->napping, 1);
	if (!quit)
		pthread_cond_timedwait(&p->cond, &elock, &t);
	atomic_fetch_sub(&p->napping, 1);
	pthread_mutex_unlock(&elock);
}

/*
 * A worker with nothing to do, that would rather be looking when the next job comes, waits up
 * to ns for a job of its path or for the loop to have a request for the path in hand
 * (engine_prewake): while the loop polls, one thread spins, not two.  True when either came,
 * false when the time ran out.  (Waiting in slices of 100 us keeps the CPU out of its deeper
 * sleep states, and the probe tests/wake-probe.c found such a thread woken in 7-8 us where one
 * asleep 1 ms took 21; but on the GPU machine the slices cost the worker 0.1 core while
 * clients came every millisecond, and moved no KV figure beyond its noise.)
 */
bool
engine_idle(enum path_kind pk, uint64_t ns)
{
	struct epath *p = &paths[pk];
	const struct timespec t = deadline(ns);
	int r = 0;

	pthread_mutex_lock(&elock);
	const uint64_t seen = p->prewakes;
	atomic_fetch_add(&p->idle, 1);
	while (!quit && TAILQ_EMPTY(&p->active) && p->prewakes == seen && r != ETIMEDOUT)
		r = pthread_cond_timedwait(&p->cond, &elock, &t);
	atomic_fetch_sub(&p->idle, 1);
	const bool woken = quit || !TAILQ_EMPTY(&p->active) || p->prewakes != seen;
	pthread_mutex_unlock(&elock);
	return woken;
}

/*
 * A request for path pk is built and about to be checked (xfer_build): a worker of the path in
 * engine_idle starts looking now, its wake-up overlapping the check.  Only the request's own
 * path, once its regions are resolved: a client's other messages, or a request refused before
 * that, wake nothing.  One relaxed load when none waits.
 */
void
engine_prewake(enum path_kind pk)
{
	struct epath *p = &paths[pk];

	if (atomic_load_explicit(&p->idle, memory_order_relaxed) == 0)
		return;
	pthread_mutex_lock(&elock);
	p->prewakes++;
	pthread_cond_broadcast(&p->cond);
	pthread_mutex_unlock(&elock);
	atomic_fetch_add_explicit(&prewoken, 1, memory_order_relaxed);
}

uint64_t
engine_prewakes(void)
{
	return atomic_load_explicit(&prewoken, memory_order_relaxed);
}

void
engine_warm(enum path_kind pk, const struct cq *q, const struct user *u)
{
	__builtin_prefetch(&paths[pk], 1);
	__builtin_prefetch(&elock, 1);
	if (q != NULL)
		__builtin_prefetch(&q->eq[pk], 1);
	if (u != NULL && u->uq != NULL)
		__builtin_prefetch(&u->uq[pk], 1);
}

/* Under the lock: j, queued on p, is the one warm_take fetches next. */
static void
leave_last(struct epath *p, const struct job *j, const struct equeue *q, const struct uqueue *u)
{
	const void *const v[6] = { j, j->segs, q, u, j->src, j->dst };

	for (int i = 0; i < 6; i++)
		atomic_store_explicit(&p->last[i], v[i], memory_order_relaxed);
}

/*
 * What a take of the job last queued on p reads and writes, fetched together before the lock:
 * the path's counts and the lock, the job (written), its list (read), its connection's and
 * uid's queues (written), and the line of each region that issuing it reads.
 */
static void
warm_take(struct epath *p)
{
	__builtin_prefetch(p, 1);                  /* (its counts: the take writes them) */
	__builtin_prefetch(&elock, 1);
	const char *j = atomic_load_explicit(&p->last[0], memory_order_relaxed);

	if (j == NULL)
		return;
	for (size_t o = 0; o < sizeof(struct job); o += 64)
		__builtin_prefetch(j + o, 1);
	__builtin_prefetch(atomic_load_explicit(&p->last[1], memory_order_relaxed), 0);
	__builtin_prefetch(atomic_load_explicit(&p->last[2], memory_order_relaxed), 1);
	__builtin_prefetch(atomic_load_explicit(&p->last[3], memory_order_relaxed), 1);
	for (int i = 4; i < 6; i++) {
		const char *r = atomic_load_explicit(&p->last[i], memory_order_relaxed);
		if (r != NULL)
			__builtin_prefetch(r + offsetof(struct region, revoked), 0);
	}
}

int
engine_queues(enum path_kind p)
{
	return atomic_load_explicit(&paths[p].nqueues, memory_order_relaxed);
}

/*
 * The pieces (segments or pages) a host worker copies in one chunk: with one-byte pieces a
 * chunk of chunk_size bytes is millions of memcpy calls (2 MiB of them: about 3 ms on one
 * core here) that another client's small copy may wait for; 16,384 take some 30 us.
 */
#define HOST_CHUNK_PIECES 16384

/*
 * A host chunk's call to a sleeping client (engine_chunk_soon) while it is not made: one whose
 * client still spins as the last chunk starts is made again after every HOST_SOON_BYTES copied,
 * until the client sleeps (a wait that spins its 1 ms and more may sleep before the chunk ends,
 * and the record's own doorbell wakes it late).  A slice of 256 KiB takes some 15-40 us.
 */
#define HOST_SOON_BYTES (256u << 10)

struct host_soon {
	const struct chunk *c;
	bool called;                /* engine_chunk_soon done with c */
	uint64_t since;             /* bytes copied since it was last tried */
};

static void
host_soon_start(struct host_soon *s, const struct chunk *c)
{
	/* (a long job's last chunk takes about as long as a sleeping client's wake-up) */
	*s = (struct host_soon){ .c = c, .called = c->job->total <= chunk_size || engine_chunk_soon(c) };
}

static void
host_copy(struct host_soon *s, char *dst, const char *src, uint64_t n)
{
	const uint64_t total = s->c->job->total;

	while (!s->called && s->since + n >= HOST_SOON_BYTES) {
		uint64_t k = HOST_SOON_BYTES - s->since;
		mem_host_copy(dst, src, k, total);
		dst += k;
		src += k;
		n -= k;
		s->since = 0;
		s->called = engine_chunk_soon(s->c);
	}
	s->since += n;
	mem_host_copy(dst, src, n, total);
}

/* A chunk of a page job whose list is read in place: item i is page plist[i % npages] of pair i / npages. */
static void
host_pages(const struct chunk *c, struct host_soon *soon)
{
	const struct job *j = c->job;
	const uint64_t ps = j->page_size;
	uint64_t left = c->bytes, off = c->off;
	uint32_t p = c->seg / j->npages, q = c->seg % j->npages;

	for (; left > 0; off = 0) {
		const struct jpair *pr = &j->pairs[p];
		const struct gpx_wire_page w = j->plist[q];
		uint64_t n = ps - off < left ? ps - off : left;
		host_copy(soon, (char *)pr->dst->host + pr->dst_base + w.dst * ps + off,
		    (const char *)pr->src->host + pr->src_base + w.src * ps + off, n);
		left -= n;
		if (++q == j->npages) {
			q = 0;
			p++;
		}
	}
}

/* Host path: the copy itself.  Regions are mapped for as long as the job holds them. */
static void *
host_worker(void *unused)
{
	struct host_soon soon;
	struct chunk c;

	(void)unused;
	thread_name("host");
	while (engine_next_chunk(PATH_HOST, &c, true, chunk_size, HOST_CHUNK_PIECES)) {
		struct job *j = c.job;
		uint64_t left = c.bytes, off = c.off;
		host_soon_start(&soon, &c);
		if (j->plist != NULL) {
			host_pages(&c, &soon);
			engine_chunk_done(&c, true);
			continue;
		}
		uint32_t p = engine_pair_of(j, c.seg);
		for (uint32_t s = c.seg; left > 0; s++, off = 0) {
			const struct gpx_wire_seg *g = &j->segs[s];
			uint64_t n = g->length - off < left ? g->length - off : left;
			while (s >= j->pairs[p].seg_end)
				p++;
			host_copy(&soon, (char *)j->pairs[p].dst->host + g->dst_offset + off,
			    (const char *)j->pairs[p].src->host + g->src_offset + off, n);
			left -= n;
		}
		engine_chunk_done(&c, true);
	}
	return NULL;
}

void
engine_on_done(void (*fn)(const struct job *, int status))
{
	done_hook = fn;
}

int
engine_init(int nthreads, uint64_t chunk)
{
	static const struct chunk_source source = {
		.next = engine_next_chunk,
		.next_small = engine_next_small_chunks,
		.has_work = engine_has_work,
		.done = engine_chunks_done,
		.nomem = engine_chunk_nomem,
		.pair_of = engine_pair_of,
		.pairs_at = engine_pairs_at,
		.nap = engine_nap,
		.ending = loop_wake_early,
		.idle = engine_idle,
		.soon = engine_chunk_soon,
		.warm_end = engine_chunk_warm,
	};
	pthread_condattr_t ca;

	xfer_pairs_init();

	/* The back ends take their chunks through this table, never by calling up here. */
	gpu_chunks_from(&source);
	fabric_chunks_from(&source);
	chunk_size = chunk;
	quit = false;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);     /* engine_nap's deadlines */
	for (int p = 0; p < NPATHS; p++) {
		TAILQ_INIT(&paths[p].active);
		pthread_cond_init(&paths[p].cond, &ca);
	}
	pthread_condattr_destroy(&ca);
	workers = calloc(nthreads, sizeof(*workers));
	for (int i = 0; i < nthreads; i++) {
		if (pthread_create(&workers[i], NULL, host_worker, NULL) != 0)
			return -EAGAIN;
		nworkers++;
	}
	return 0;
}

/* Stops the workers once nothing is queued; callers cancel what should not finish first. */
void
engine_shutdown(void)
{
	pthread_mutex_lock(&elock);
	quit = true;
	for (int p = 0; p < NPATHS; p++)
		pthread_cond_broadcast(&paths[p].cond);
	pthread_mutex_unlock(&elock);
	for (int i = 0; i < nworkers; i++)
		pthread_join(workers[i], NULL);
	free(workers);
	workers = NULL;
	nworkers = 0;
}

/* Under the lock: connection queue q of uid queue u has work on path p. */
static void
queue_link(struct epath *p, struct uqueue *u, struct equeue *q)
{
	if (!q->active) {
		q->active = true;
		atomic_fetch_add(&p->nqueues, 1);
		TAILQ_INSERT_TAIL(&u->conns, q, rr);
	}
	if (!u->active) {
		u->active = true;
		atomic_fetch_add(&p->nactive, 1);
		TAILQ_INSERT_TAIL(&p->active, u, rr);
		pthread_cond_signal(&p->cond);
	}
}

/* Under the lock: q has no job left; out of its uid's list, and the uid out of the path's if idle. */
static void
queue_unlink(struct epath *p, struct uqueue *u, struct equeue *q)
{
	if (q->active) {
		q->active = false;
		atomic_fetch_sub(&p->nqueues, 1);
		TAILQ_REMOVE(&u->conns, q, rr);
	}
	if (u->active && TAILQ_EMPTY(&u->conns)) {
		u->active = false;
		atomic_fetch_sub(&p->nactive, 1);
		TAILQ_REMOVE(&p->active, u, rr);
	}
}

/*
 * Takes jobs[0..n) under one hold of the lock: the loop hands over the requests of one pass
 * over a submission queue together (conn_poll_sq), and the workers taking them contend with
 * it once, not once per request.
 */
void
engine_submit_many(struct job *const *jobs, int n)
{
	struct chunk empty[n];
	bool kick = false;
	int nempty = 0;

	pthread_mutex_lock(&elock);
	for (int i = 0; i < n; i++) {
		struct job *j = jobs[i];
		struct equeue *q = &j->cq->eq[j->path];
		struct uqueue *u = &j->user->uq[j->path];
		struct epath *p = &paths[j->path];

		/* The loop read this request's message last (or one after it: never before
		 * submission); the caller says when (t_recv), or the submission stands for it. */
		j->t_recv = j->t_recv > 0 && j->t_recv <= j->t_submit ? j->t_recv : j->t_submit;
		TAILQ_INSERT_TAIL(&live, j, ae);
		nlive++;
		if (j->total == 0) {
			/* Nothing to move: completed at once through the normal path (below). */
			empty[nempty++] = (struct chunk){ .job = j, .bytes = 0 };
			j->handed_out = true;
			j->chunks_out = 1;
			continue;
		}
		TAILQ_INSERT_TAIL(&q->jobs, j, qe);
		queue_link(p, u, q);
		leave_last(p, j, q, u);
		if (j->total <= ENGINE_SMALL_JOB)
			atomic_fetch_add(&p->nsmall, 1);
		if (atomic_load_explicit(&p->napping, memory_order_relaxed) > 0)
			pthread_cond_broadcast(&p->cond);     /* a worker naps through a long copy */
		kick |= j->path == PATH_FABRIC;        /* (j may be finished by a worker once we unlock) */
	}
	pthread_mutex_unlock(&elock);
	if (nempty > 0)
		engine_chunks_done(empty, nempty, true);
	if (kick && fabric != NULL)
		fabric->kick();     /* the fabric takes chunks on the loop thread, not a worker */
}

void
engine_submit(struct job *j)
{
	engine_submit_many(&j, 1);
}

/*
 * Bytes of j's segments before segment i, knowing those before segment `from` (from <= i): from
 * the nearer of `from` and the start of i's block, so at most SEG_BLOCK - 1 lengths are added.
 */
static uint64_t
seg_start(const struct job *j, uint32_t i, uint32_t from, uint64_t at)
{
	uint32_t b = i / SEG_BLOCK;

	if (b * SEG_BLOCK > from) {
		from = b * SEG_BLOCK;
		at = j->blocks[b - 1];
	}
	for (; from < i; from++)
		at += j->segs[from].length;
	return at;
}

/*
 * Pages are all alike: a chunk is a byte range of at most max_bytes (no list is staged).  A
 * kernel's takes any number of pages; a host worker's (plist) at most max_segs pieces.
 */
static void
cut_pages(struct job *j, struct chunk *c, uint64_t max_bytes, uint32_t max_segs)
{
	uint64_t start = j->handed, end = j->total - start > max_bytes ? start + max_bytes : j->total;

	if (j->plist != NULL && (end - 1) / j->page_size - start / j->page_size >= max_segs)
		end = (start / j->page_size + max_segs) * j->page_size;

	c->seg = (uint32_t)(start / j->page_size);
	c->off = start % j->page_size;
	c->bytes = end - start;
	c->pieces = (uint32_t)((end - 1) / j->page_size) - c->seg + 1;
	j->handed = end;
}

/*
 * Cuts up to max_bytes from at most max_segs segments.  The running byte counts of every
 * SEG_BLOCK segments (blocks[]) make this a binary search plus a walk through one block, so
 * a request of 65,536 segments costs nothing per segment here.
 */
static void
cut_segs(struct job *j, struct chunk *c, uint64_t max_bytes, uint32_t max_segs)
{
	/* A chunk starts on a byte: zero-length segments are passed over (a queued job has bytes left). */
	while (j->cur_off == 0 && j->segs[j->cur_seg].length == 0)
		j->cur_seg++;
	c->seg = j->cur_seg;
	c->off = j->cur_off;
	uint64_t start = j->handed, base = start - j->cur_off;   /* base: bytes before cur_seg */
	uint32_t last = j->nseg - j->cur_seg > max_segs ? j->cur_seg + max_segs : j->nseg;
	uint64_t end = last == j->nseg ? j->total : seg_start(j, last, j->cur_seg, base);
	if (end - start > max_bytes)
		end = start + max_bytes;
	uint32_t lo = j->cur_seg / SEG_BLOCK, hi = (last - 1) / SEG_BLOCK;   /* first block reaching end */
	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;
		if (j->blocks[mid] < end)
			lo = mid + 1;
		else
			hi = mid;
	}
	uint32_t s = lo * SEG_BLOCK > j->cur_seg ? lo * SEG_BLOCK : j->cur_seg;
	uint64_t at = seg_start(j, s, j->cur_seg, base);    /* then the segment in it where end falls */
	while (at + j->segs[s].length < end)
		at += j->segs[s++].length;
	c->bytes = end - start;
	j->handed = end;
	c->pieces = s - j->cur_seg + 1;
	if (end == at + j->segs[s].length) {
		j->cur_seg = s + 1;
		j->cur_off = 0;
	} else {
		j->cur_seg = s;
		j->cur_off = end - at;
	}
}

/*
 * Under the lock: the next chunk of path p, of the first job in round-robin order (between
 * uids, a uid's connections, a connection's jobs) of at most max_job bytes; with max_job
 * UINT64_MAX simply the first.  The queues it came from go to the back.  now: the time, for a
 * job's first chunk (0: to be read).
 */
static bool
take_locked(struct epath *p, struct chunk *c, uint64_t max_bytes, uint32_t max_segs, uint64_t max_job, double *now)
{
	struct uqueue *u;
	struct equeue *q = NULL;
	struct job *j = NULL;

	TAILQ_FOREACH(u, &p->active, rr) {
		TAILQ_FOREACH(q, &u->conns, rr) {
			TAILQ_FOREACH(j, &q->jobs, qe)
				if (j->total <= max_job)
					break;
			if (j != NULL)
				break;
		}
		if (q != NULL)
			break;
	}
	if (u == NULL)
		return false;      /* no job small enough */
	if (j->t_start == 0) {
		if (*now == 0)
			*now = now_s();
		j->t_start = *now;
	}
	c->job = j;
	if (j->pages != NULL || j->plist != NULL)
		cut_pages(j, c, max_bytes, max_segs);
	else
		cut_segs(j, c, max_bytes, max_segs);
	j->chunks_out++;
	TAILQ_REMOVE(&q->jobs, j, qe);
	c->last = j->handed == j->total;
	if (c->last) {
		j->handed_out = true;
		if (j->total <= ENGINE_SMALL_JOB)
			atomic_fetch_sub(&p->nsmall, 1);
	} else
		TAILQ_INSERT_TAIL(&q->jobs, j, qe);     /* round-robin between a connection's jobs, */
	TAILQ_REMOVE(&u->conns, q, rr);
	if (TAILQ_EMPTY(&q->jobs)) {
		q->active = false;
		atomic_fetch_sub(&p->nqueues, 1);
	} else
		TAILQ_INSERT_TAIL(&u->conns, q, rr);    /* between a uid's connections, */
	TAILQ_REMOVE(&p->active, u, rr);
	if (TAILQ_EMPTY(&u->conns)) {
		u->active = false;
		atomic_fetch_sub(&p->nactive, 1);
	} else
		TAILQ_INSERT_TAIL(&p->active, u, rr);   /* and between uids */
	return true;
}

bool
engine_next_chunk(enum path_kind pk, struct chunk *c, bool wait, uint64_t max_bytes, uint32_t max_segs)
{
	struct epath *p = &paths[pk];
	double now = 0;
	bool got;

	warm_take(p);
	pthread_mutex_lock(&elock);
	while (TAILQ_FIRST(&p->active) == NULL) {
		if (quit || !wait) {
			pthread_mutex_unlock(&elock);
			return false;
		}
		pthread_cond_wait(&p->cond, &elock);
	}
	got = take_locked(p, c, max_bytes, max_segs, UINT64_MAX, &now);
	if (!TAILQ_EMPTY(&p->active))
		pthread_cond_signal(&p->cond);
	pthread_mutex_unlock(&elock);
	return got;
}

/*
 * Up to n chunks, each the first of a small job (ENGINE_SMALL_JOB bytes or less), in
 * round-robin order, under one hold of the lock; never waits.  Returns how many.
 */
int
engine_next_small_chunks(enum path_kind pk, struct chunk *c, int n, uint32_t max_segs)
{
	struct epath *p = &paths[pk];
	double now = 0;
	int got = 0;

	if (atomic_load_explicit(&p->nsmall, memory_order_relaxed) == 0)
		return 0;
	warm_take(p);
	pthread_mutex_lock(&elock);
	while (got < n && take_locked(p, &c[got], ENGINE_SMALL_JOB, max_segs, ENGINE_SMALL_JOB, &now))
		got++;
	if (!TAILQ_EMPTY(&p->active))
		pthread_cond_signal(&p->cond);
	pthread_mutex_unlock(&elock);
	return got;
}

void
engine_free_job(struct job *j)
{
	if (j->kept != NULL)
		xfer_pairs_unref(j->kept);   /* its holds stood for the pairs' */
	else if (j->npairs > 1)
		for (uint32_t k = 0; k < j->npairs; k++) {
			/* (the lines of their counters are the event loop's since the check: fetched
			 * together, their misses overlap; xfer.c does the same at the check) */
			__builtin_prefetch(j->pairs[k].src, 1);
			__builtin_prefetch(j->pairs[k].dst, 1);
		}
	for (uint32_t k = 0; j->kept == NULL && k < j->npairs; k++) {
		struct jpair *p = &j->pairs[k];
		if (p->src != NULL)
			region_drop(p->src);
		if (p->dst != NULL)
			region_drop(p->dst);
	}
	if (j->list != NULL)
		region_drop(j->list);
	if (j->pairs != &j->one)
		free(j->pairs);
	gpu_pages_free(j->pages);
	free(j->plist);
	free(j->segs);
	if (j->charged > 0)
		budget_release(j->cq, j->user, j->charged);
	free(j);
}

/*
 * The owners of the job's destinations that asked to hear of copies into them: one
 * notification per pair (a run of pairs into one region counts once, with their bytes).
 */
static void
job_notify(const struct job *j)
{
	if (j->npairs > 1)
		for (uint32_t k = 0; k < j->npairs; k++)
			__builtin_prefetch(&j->pairs[k].dst->notify_on, 0);   /* misses that overlap */
	for (uint32_t k = 0; k < j->npairs; k++) {
		const struct region *d = j->pairs[k].dst;
		uint64_t bytes = j->npairs == 1 ? j->done : j->pairs[k].bytes;
		while (k + 1 < j->npairs && j->pairs[k + 1].dst == d)
			bytes += j->pairs[++k].bytes;
		if (atomic_load(&d->notify_on) && d->notify_cq != NULL && d->owner != j->client)
			cq_notify(d->notify_cq, d->notify_tag, 0, bytes);
	}
}

const char *
engine_stage_name(enum engine_stage s)
{
	return stage_names[s];
}

void
engine_stage_stats(enum engine_stage s, uint64_t *count, double *seconds, uint64_t buckets[STAGE_BUCKETS + 1])
{
	*count = atomic_load(&stages[s].count);
	*seconds = atomic_load(&stages[s].ns) / 1e9;
	for (int b = 0; b <= STAGE_BUCKETS; b++)
		buckets[b] = atomic_load(&stages[s].buckets[b]);
}

/*
 * What finishing a batch of jobs (those one look of a worker found done) gives back at once:
 * their budgets, summed per connection and uid; their records (cq_posts); their stage clocks,
 * summed here and added to the shared ones once.  Flushed in that order: a client hears of a
 * transfer's end after its budgets are back.
 */
struct finish {
	double t_done;              /* when their last bytes were seen done */
	struct cq_posts posts;
	int nrel;
	struct {
		struct cq *q;           /* (the posts hold it) */
		struct user *u;
		uint64_t bytes;
	} rel[CQ_POSTS_MAX];
	struct {
		uint64_t count, ns, buckets[STAGE_BUCKETS + 1];
	} st[NSTAGES];
};

static void
finish_init(struct finish *f, double t_done)
{
	f->t_done = t_done;
	f->posts.n = 0;
	f->nrel = 0;
	memset(f->st, 0, sizeof(f->st));
}

static void
stage_add(struct finish *f, enum engine_stage s, double from, double to)
{
	double dt = to - from;
	int b = 0;

	if (from <= 0 || dt < 0)
		return;          /* a stage this job did not pass through */
	while (b < STAGE_BUCKETS && dt > engine_stage_bounds[b])
		b++;
	f->st[s].count++;
	f->st[s].ns += (uint64_t)(dt * 1e9);
	f->st[s].buckets[b]++;
}

/* A finished job's stages up to the end of its last byte (t_done); the post is added after. */
static void
stages_add(struct finish *f, const struct job *j)
{
	stage_add(f, STAGE_CHECK, j->t_recv, j->t_submit);
	stage_add(f, STAGE_QUEUE, j->t_submit, j->t_start);
	stage_add(f, STAGE_LAUNCH, j->t_start, j->t_launched);
	stage_add(f, STAGE_GPU_WAIT, j->t_launched, j->t_gpu_start);
	stage_add(f, STAGE_COPY, j->t_gpu_start ? j->t_gpu_start : j->t_launched ? j->t_launched : j->t_start,
	    f->t_done);
}

/* Gives back what the batch holds (budgets, then records), adds its stage sums; empties it. */
static void
finish_flush(struct finish *f)
{
	int ok = 0;

	for (int i = 0; i < f->nrel; i++)
		budget_release(f->rel[i].q, f->rel[i].u, f->rel[i].bytes);
	if (f->posts.n > 0) {
		for (int i = 0; i < f->posts.n; i++)
			ok += f->posts.e[i].status == 0;
		cq_posts_flush(&f->posts);
		const double t = now_s();
		while (ok-- > 0)
			stage_add(f, STAGE_POST, f->t_done, t);   /* the clients may see them from here */
		loop_wake();                /* their clients' next requests are on their way */
	}
	for (int s = 0; s < NSTAGES; s++) {
		if (f->st[s].count == 0)
			continue;
		atomic_fetch_add_explicit(&stages[s].count, f->st[s].count, memory_order_relaxed);
		atomic_fetch_add_explicit(&stages[s].ns, f->st[s].ns, memory_order_relaxed);
		for (int b = 0; b <= STAGE_BUCKETS; b++)
			if (f->st[s].buckets[b] != 0)
				atomic_fetch_add_explicit(&stages[s].buckets[b], f->st[s].buckets[b], memory_order_relaxed);
	}
	finish_init(f, f->t_done);
}

/*
 * Runs without the engine lock: adds the job's record, its budgets and its stages to the batch
 * f (or, for a job of a group, its share: the group's last job posts the whole), notifies the
 * targets' owners, lets go.  The job's reference on its queue goes with its record; what f
 * holds is given back when the caller flushes it (finish_flush).
 */
static void
job_finish(struct job *j, struct finish *f)
{
	/* (a page the kernel found out of its region, in a list in GPU memory: not copied) */
	int status = j->failed ? (j->nomem ? GPX__STATUS__ENOMEM : GPX__STATUS__EIO) : j->cancelled ? cancel_status :
	    j->oob != NULL && *j->oob != 0 ? GPX__STATUS__ERANGE : 0;
	struct epath *p = &paths[j->path];
	struct jgroup *g = j->group;
	bool post = true;
	uint64_t bytes = j->done;

	if (f->posts.n == CQ_POSTS_MAX)
		finish_flush(f);
	if (status == 0)
		stages_add(f, j);
	if (log_level_debug()) {
		double t = f->t_done;
		log_debug("engine", "client %llu tag %llu: %u segments, %llu bytes on %s, status %d; "
		    "checked %.1f us, queued %.1f us, ran %.1f us", (unsigned long long)j->client,
		    (unsigned long long)j->tag, j->nseg, (unsigned long long)j->done, path_names[j->path],
		    status, j->t_build ? (j->t_submit - j->t_build) * 1e6 : 0,
		    j->t_start ? (j->t_start - j->t_submit) * 1e6 : 0, j->t_start ? (t - j->t_start) * 1e6 : 0);
	}
	atomic_fetch_add(&p->transfers, 1);
	atomic_fetch_add(&p->bytes, j->done);
	atomic_fetch_add(&j->cq->transfers, 1);
	atomic_fetch_add(&j->cq->bytes, j->done);
	if (status != 0) {
		atomic_fetch_add(&p->errors, 1);
		atomic_fetch_add(&j->cq->errors, 1);
	}
	if (done_hook != NULL)
		done_hook(j, status);
	if (status == 0)
		job_notify(j);
	if (g != NULL) {
		if (j->failed)
			atomic_store(&g->failed, true);
		if (j->cancelled)
			atomic_store(&g->cancelled, true);
		bytes = atomic_fetch_add(&g->done, j->done) + j->done;
		if ((post = atomic_fetch_sub(&g->left, 1) == 1)) {
			status = atomic_load(&g->failed) ? GPX__STATUS__EIO : atomic_load(&g->cancelled) ?
			    cancel_status : 0;
			free(g);
		}
	}
	/*
	 * Its budgets, and its count against the uid's transfers in flight, are given back before
	 * the completion is posted, so that a client refused as busy may retry as soon as it hears
	 * of a transfer's end (the lists go just after).
	 */
	struct cq *q = j->cq;
	if (post) {
		/* (the posts keep q until the budgets are back) */
		if (f->nrel > 0 && f->rel[f->nrel - 1].q == q && f->rel[f->nrel - 1].u == j->user)
			f->rel[f->nrel - 1].bytes += j->charged;
		else if (j->charged > 0) {
			f->rel[f->nrel].q = q;
			f->rel[f->nrel].u = j->user;
			f->rel[f->nrel++].bytes = j->charged;
		}
		atomic_fetch_sub(&j->user->inflight, 1);
		cq_posts_add(&f->posts, q, j->tag, status, bytes);   /* takes over j's reference on q */
	} else
		budget_release(q, j->user, j->charged);
	j->charged = 0;
	engine_free_job(j);         /* its budgets named q, which a reference keeps */
	if (!post)
		cq_unref(q);
}

/*
 * A worker expects c, its job's last chunk, to end in a little while (a GPU worker: 300 us
 * before it is due; the host path: as it starts copying it): the job's completion will most
 * likely be posted then (the chunks handed out before it, and the other jobs of its batch,
 * being done or about to be).  A client that waited that long has stopped spinning and sleeps
 * in epoll, and being woken costs it 100 us and more on virtual machines, after the record is
 * there; rung now, with no record, it wakes and spins afresh, and sees the record as it comes
 * (and gpxd rings no doorbell for it: the client spins).  Only threads asleep in a wait of the
 * library with its own eventfd are woken (cq_wake); one woken too early spins, then sleeps
 * once more.  False when no thread sleeps yet: a client still in the spin its wait begins
 * with (1 ms where cores are plenty) sleeps once that ends, which may be before the record
 * comes (within GPU0, Python's page copies of 2 GiB, 1.5 ms long, spent 74 us on the
 * client's side, against 10-15 us with a wait that spins throughout): the caller asks again
 * (the GPU workers every WAKE_AGAIN_NS, the host path every HOST_SOON_BYTES copied).
 */
bool
engine_chunk_soon(const struct chunk *c)
{
	const struct job *j = c->job;
	bool end;

	if (!c->last)
		return true;
	if (!cq_asleep(j->cq))
		return false;               /* (most clients spin through their copies) */
	pthread_mutex_lock(&elock);     /* (j lives: c is one of its chunks out) */
	end = !j->failed && !j->cancelled && (j->group == NULL || atomic_load(&j->group->left) == 1);
	pthread_mutex_unlock(&elock);
	if (end)
		cq_wake(j->cq);
	return true;
}

/*
 * While a job's last chunk runs, and nothing else of its worker does (a client waiting for each
 * copy before its next), the lines job_finish and the post write are fetched for that worker's
 * core: the queue's and uid's counts and budgets (budget_warm), the regions' counts, the
 * queue's lock, the path's counters.  The loop wrote most of them last, at the check, and does
 * not write them again before the client hears of the end.  A hint: j lives (c is out).
 */
void
engine_chunk_warm(const struct chunk *c)
{
	const struct job *j = c->job;

	budget_warm(j->cq, j->user);
	cq_warm(j->cq);
	region_warm(j->src);
	region_warm(j->dst);
	__builtin_prefetch(&paths[j->path].transfers, 1);
	__builtin_prefetch(&elock, 1);
	__builtin_prefetch(&live, 1);    /* (the loop added the job to the list, the end takes it out) */
}

/*
 * Chunks c[0..n) are copied (ok) or failed: one hold of the lock for all of them, one clock
 * read, and the records of the jobs they end posted together (one doorbell per client).
 */
void
engine_chunks_done(struct chunk *c, int n, bool ok)
{
	struct job *ended[CQ_POSTS_MAX];
	struct finish f;
	int m = n < CQ_POSTS_MAX ? n : CQ_POSTS_MAX, nend = 0;

	pthread_mutex_lock(&elock);
	for (int i = 0; i < m; i++) {
		struct job *j = c[i].job;
		j->chunks_out--;
		if (ok)
			j->done += c[i].bytes;
		else
			j->failed = true;
		if (j->handed_out && j->chunks_out == 0) {
			TAILQ_REMOVE(&live, j, ae);
			nlive--;
			ended[nend++] = j;
		}
	}
	pthread_mutex_unlock(&elock);
	if (nend > 0) {
		finish_init(&f, now_s());
		for (int i = 0; i < nend; i++)
			job_finish(ended[i], &f);
		finish_flush(&f);
	}
	if (n > m)
		engine_chunks_done(c + m, n - m, ok);
}

void
engine_chunk_done(struct chunk *c, bool ok)
{
	engine_chunks_done(c, 1, ok);
}

void
engine_chunk_nomem(struct chunk *c)
{
	pthread_mutex_lock(&elock);
	c->job->nomem = true;
	pthread_mutex_unlock(&elock);
	engine_chunks_done(c, 1, false);
}

/* Under the lock: stop handing out chunks of j; true if it can be finished now. */
static bool
job_cancel_locked(struct job *j)
{
	/*
	 * Every byte is already with a worker: nothing can be stopped any more, so the job ends
	 * as it runs, complete (a cancelled status with every byte moved would say both).
	 */
	if (j->handed_out)
		return false;
	if (j->total <= ENGINE_SMALL_JOB)
		atomic_fetch_sub(&paths[j->path].nsmall, 1);
	j->cancelled = true;
	j->handed_out = true;
	struct equeue *q = &j->cq->eq[j->path];
	TAILQ_REMOVE(&q->jobs, j, qe);
	if (TAILQ_EMPTY(&q->jobs))
		queue_unlink(&paths[j->path], &j->user->uq[j->path], q);
	if (j->chunks_out == 0) {
		TAILQ_REMOVE(&live, j, ae);
		nlive--;
		return true;
	}
	return false;
}

static int
cancel_matching(uint64_t client, bool all, uint64_t tag, bool every_client)
{
	TAILQ_HEAD(, job) done = TAILQ_HEAD_INITIALIZER(done);
	struct job *j, *t;
	int n = 0;

	pthread_mutex_lock(&elock);
	TAILQ_FOREACH_SAFE(j, &live, ae, t) {
		if (!every_client && (j->client != client || (!all && j->tag != tag)))
			continue;
		n++;
		if (job_cancel_locked(j))
			TAILQ_INSERT_TAIL(&done, j, ae);
	}
	pthread_mutex_unlock(&elock);
	if (!TAILQ_EMPTY(&done)) {
		struct finish f;
		finish_init(&f, now_s());
		TAILQ_FOREACH_SAFE(j, &done, ae, t)
			job_finish(j, &f);
		finish_flush(&f);
	}
	return n;
}

int
engine_cancel(uint64_t client, uint64_t tag)
{
	return cancel_matching(client, false, tag, false);
}

void
engine_cancel_client(uint64_t client)
{
	cancel_matching(client, true, 0, false);
}

void
engine_cancel_all(int status)
{
	pthread_mutex_lock(&elock);
	cancel_status = status;
	pthread_mutex_unlock(&elock);
	cancel_matching(0, true, 0, true);
}

uint32_t
engine_inflight(void)
{
	return atomic_load_explicit(&nlive, memory_order_relaxed);
}

void
engine_visit(engine_visit_fn fn, void *arg)
{
	struct job *j;

	pthread_mutex_lock(&elock);
	TAILQ_FOREACH(j, &live, ae)
		fn(j, arg);
	pthread_mutex_unlock(&elock);
}

void
engine_path_stats(enum path_kind p, uint64_t *xfers, uint64_t *bytes, uint64_t *errors)
{
	*xfers = atomic_load(&paths[p].transfers);
	*bytes = atomic_load(&paths[p].bytes);
	*errors = atomic_load(&paths[p].errors);
}
