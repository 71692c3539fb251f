/*
 * The copy workers: one thread per GPU.  The worker of GPU d runs every transfer whose source
 * (or, from host memory, destination) is on d.  It takes chunks from the engine (round-robin
 * between uids, then clients), puts large ones on two "bulk" streams in turn and small ones on
 * a "quick" stream of the greatest priority, so that a 4 KiB copy never queues behind a 1 GiB
 * one.  Copy engines run the copies of streams of equal priority one whole copy after another,
 * and honour priority within a copy: on an H100, within the GPU, a 4 KiB copy waited 712 us
 * for a 1 GiB copy on a stream of equal priority, and 23 us on a greater one, the long copy no
 * slower.  (Cutting long copies into pieces of ~20 us instead let the small one in after 44 us
 * but cost large copies 5-15% and lengthened the small copies' tail; with the quick stream's
 * priority it only costs.)  Two bulk streams let two clients' long chunks run side by side
 * at the speed of one.  When the bulk streams are full, small copies (of anyone) still go onto
 * the quick stream, a few at a time: one client keeping them full cannot hold another's small
 * copy back.
 * After each chunk it has the stream write a sequence number into pinned host memory (a
 * small chunk's launch of gpx_copy_few writes it itself, from its last block).  The
 * worker polls those words (spinning while work is due soon, sleeping in proportion
 * otherwise): no host callbacks, no driver lock taken per completion.  Contiguous pieces go
 * to copy engines; chunks of many small segments go to one launch of the SM copy kernel
 * (copy-kernel.cu), a block for every 8 of them, which reads its segment list in place from
 * pinned memory (nothing is uploaded, so a launch uses no copy engine).  A page transfer
 * (gpx_copy_pages) keeps its checked page list in pinned memory (the page arena), which the
 * kernel reads in place: no list is built or staged per chunk, and a chunk is a byte range of
 * up to BULK_CHUNK.
 *
 * The workers pull their work from the engine, through the chunk source engine_init hands
 * down (gpu_chunks_from): a pull is the simplest way for a back end that decides for itself
 * when it has room, and through the table it calls nothing of the layer above.
 */
#include "config.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>

#include "daemon/gpxd.h"
#include "daemon/gpu/internal.h"

#define QUICK_MAX ENGINE_SMALL_JOB      /* chunks up to this go to the quick stream */
#define BULK_CHUNK (1ull << 30)       /* largest chunk a GPU worker takes */
#define KSEG_MAX 8192                 /* segments per kernel launch: a long list is cut into
                                         * launches so preparing one overlaps running another */
#define PEND_MAX 16                   /* chunks in flight per GPU */
#define QUICK_SHARE 2                 /* quick chunks in flight while the bulk stream is full */
#define KERNEL_MIN_SEGS 8
#define KERNEL_MAX_AVG (256u << 10)
#define TILE_MIN (32u << 10)          /* a large segment in the kernel: tiles of at least this */
#define TILE_SEG_MAX (32ull << 20)    /* and at most this large a segment */
#define SIDE_CE_MIN (16ull << 20)     /* a within-GPU split: segments from this size to copy engines */
#define IDLE_SPIN_NS 200000           /* look at least this long for new work before sleeping */
#define LIGHT_SPIN_NS 50000           /* of which spin this long, then wait for a request */
#define PREWAKE_LOOK_NS 200000        /* woken by a request's build, spin this long for its job */
#define SPIN_NS 5000000               /* spin this long for a completion before sleeping */
#define TIMED_MIN (1ull << 20)        /* chunks from this size on are timed, and napped through */
#define NAP_MIN_NS 20000              /* naps shorter than this are spun */
#define NAP_MARGIN_NS 10000           /* a nap ends this long (and its measured lateness) early */
#define WAKE_LEAD_NS 300000           /* a sleeping client is woken this long before its record */
#define WAKE_AGAIN_NS 40000           /* ... and looked at this often until it sleeps, or the end */
#define NCLASSES 16
#define NSIZES 11                     /* timed chunks by size: [1, 2) MiB, [2, 4) MiB, ... 1 GiB */

/* bulk chunks alternate between the two; S_SIDE runs the kernel of a split within the GPU */
enum { S_BULK, S_BULK2, S_QUICK, S_SIDE, NSTREAMS };

enum split { SPLIT_NONE, SPLIT_LINK, SPLIT_LOCAL };

struct pend {
	struct chunk c;
	uint64_t seq;
	uint64_t seq2;                /* a split chunk's: and S_BULK2's word reaching this (0: none) */
	uint64_t seq3;                /* ... and S_SIDE's reaching this (0: none) */
	uint64_t t_issue, due;        /* ns: when queued; when it should end (0: not known) */
	int stream;
	int slot;
	uint64_t wake;                /* ns: when to wake its client (its job's last, timed); 0: not */
	uint8_t cls;                  /* its kind of copy, for the rate it is timed at */
	bool marked;                  /* the stream writes started[stream] = seq before it */
};

/* One GPU's worker: its streams, the chunks it has in flight, its kernel staging. */
struct gdev {
	int index;
	void *stream[NSTREAMS];
	volatile uint64_t *done;            /* pinned: one word per stream */
	volatile uint64_t *started;         /* pinned: the GPU start marks of the stage clocks */
	uint64_t issued[NSTREAMS];
	struct pend pend[NSTREAMS][PEND_MAX];
	int npend[NSTREAMS], phead[NSTREAMS];
	struct gpu_kseg *kstage[PEND_MAX];  /* pinned kernel segment lists, read in place */
	bool slot_busy[PEND_MAX];
	bool kernel_ok;
	bool mps;                           /* the GPU is shared through CUDA MPS */
	uint8_t side_next;                  /* a within-GPU split's stream for its next copy: S_BULK2 if 1 */
	/*
	 * The naps through long copies: per kind of copy and size (size_class) the time a byte
	 * took (ns, 0: not yet seen), learnt from chunks whose end the worker saw while polling;
	 * when each stream's last chunk should end; when the worker last looked (a look within a
	 * few microseconds of the one before saw an end when it came); how late naps wake (ns, a
	 * running mean).  A copy's fixed cost makes a byte of a small one slower than a byte of a
	 * large one (within an H100, cuMemcpyAsync of 16 MiB ran at 0.64x-0.68x the rate of 1 GiB),
	 * and one rate for every size, learnt from the small, timed the large ones too long: in
	 * gpu-test, after copies of 16 MiB, eight 512 MiB copies took one nap each (the one up to
	 * the client's wake-up call, due 300 us before the copy's predicted end), and no nap ended
	 * before a copy did.
	 */
	double ns_per_byte[NCLASSES][NSIZES];
	uint64_t tail_due[NSTREAMS], last_end[NSTREAMS];
	uint64_t last_look;
	bool napped, nap_full;        /* since the last look: a nap; one that ran its whole length */
	uint64_t late_ns;
	pthread_t thread;
};

static struct gdev *gpus;              /* one per device, allocated at start */
static atomic_uint_fast64_t naps;       /* gpu_naps */
static atomic_uint_fast64_t batched;    /* gpu_batched */
static atomic_uint_fast64_t splits;     /* gpu_split */
static int ngpus;                       /* workers started */
/*
 * Fault injection for the test suite: GPXD_FAULT_INJECT=sticky makes the first copy launch a
 * kernel on an invalid address, which leaves the context with a sticky error, so that the
 * daemon's handling of one (a clear log line and a non-zero exit) can be tested for real.
 */
static atomic_bool fault_sticky;
/*
 * GPXD_STAGE_CLOCKS=1: before a job's first chunk the stream writes a start mark, which the
 * worker notices as it polls, so the stage clocks split the wait for the GPU from the copy.
 * Off by default: it costs a stream write per transfer.
 */
static bool start_marks;
static volatile bool gpu_quit;
static void (*idle_hook)(void);
static const struct chunk_source *chunks;

void
gpu_on_idle(void (*fn)(void))
{
	idle_hook = fn;
}

void
gpu_chunks_from(const struct chunk_source *s)
{
	chunks = s;
}

/* ---- the page arena: pinned page lists the kernel reads in place ---- */

/*
 * 4M pages in flight, one uid's at most 2M: a share holds the largest request under the
 * default max_segments (1M pages for 16,384 pairs: 8.25 MiB).
 */
#define ARENA_SIZE (32u << 20)
#define ARENA_GRAIN (64u << 10)
#define ARENA_GRAINS (ARENA_SIZE / ARENA_GRAIN)

static pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char *arena;                     /* NULL: none (no kernel) */
static uint16_t arena_len[ARENA_GRAINS];
static struct user *arena_owner[ARENA_GRAINS];
static bool arena_used[ARENA_GRAINS];
/* Runs of grains, one uid at most half of them (user.c: pool_take). */
static struct pool arena_pool = { ARENA_GRAINS, ARENA_GRAINS / 2, arena_len, arena_owner, arena_used, { 0, 0 } };

static bool kernel_takes(int dev, const struct region *src, const struct region *dst, uint64_t avg);

/*
 * The configuration a GPU worker reads: its own snapshot, refreshed once per round of its
 * loop, so that a reload never frees what a chunk in progress reads.  On the loop thread
 * (gpu_pages_alloc), cfg itself.
 */
static _Thread_local const struct conf *wcfg;

static const struct conf *
gcfg(void)
{
	return wcfg != NULL ? wcfg : cfg;
}
static uint64_t addr_on(const struct region *r, int dev);

/* Where a page list of n records ends and the pairs' addresses begin, 16-byte aligned. */
static size_t
kpairs_at(uint32_t n)
{
	return ((size_t)n * sizeof(struct gpx_wire_page) + 15) & ~(size_t)15;
}

struct gpx_wire_page *
gpu_pages_alloc(const struct jpair *pairs, uint32_t npairs, uint64_t page_size, uint32_t n, const struct region *list,
    uint64_t list_off, uint64_t *list_addr, volatile uint32_t **oob, struct user *u, int *devp, int *refused)
{
	/*
	 * Between two GPUs the destination's kernel runs it, loading over the link and storing
	 * locally: on two H200 that pulls 65,536 scattered pages 1-2% faster than pushing them.
	 * Every pair of the job must be one that kernel runs.
	 */
	const int dev = pairs[0].dst->dev != DEV_HOST ? pairs[0].dst->dev : pairs[0].src->dev;
	const uint64_t at = kpairs_at(list != NULL ? 0 : n) + (uint64_t)npairs * sizeof(struct gpu_kpair);
	const uint64_t bytes = at + (list != NULL ? sizeof(uint32_t) : 0);
	const uint64_t need = (bytes + ARENA_GRAIN - 1) / ARENA_GRAIN;
	struct gpx_wire_page *p = NULL;
	uint64_t la = 0;
	int64_t first;

	*refused = 0;
	/* (a list longer than one uid's share never runs from the arena) */
	if (arena == NULL || dev == DEV_HOST || dev >= ngpus || need > arena_pool.share)
		return NULL;
	for (uint32_t k = 0; k < npairs; k++)
		if ((pairs[k].dst->dev != DEV_HOST ? pairs[k].dst->dev : pairs[k].src->dev) != dev ||
		    !kernel_takes(dev, pairs[k].src, pairs[k].dst, page_size))
			return NULL;
	if (list != NULL && (list->dev == DEV_HOST || (la = addr_on(list, dev)) == 0))
		return NULL;
	pthread_mutex_lock(&arena_lock);
	first = pool_take(&arena_pool, (uint32_t)need, u);
	pthread_mutex_unlock(&arena_lock);
	if (first < 0)
		*refused = (int)first;
	else {
		p = (struct gpx_wire_page *)(arena + (size_t)first * ARENA_GRAIN);
		struct gpu_kpair *kp = (struct gpu_kpair *)((unsigned char *)p + kpairs_at(list != NULL ? 0 : n));
		for (uint32_t k = 0; k < npairs; k++)
			kp[k] = (struct gpu_kpair){ addr_on(pairs[k].src, dev) + pairs[k].src_base,
			    addr_on(pairs[k].dst, dev) + pairs[k].dst_base };
		if (list != NULL) {
			*oob = (volatile uint32_t *)((unsigned char *)p + at);
			**oob = 0;
			*list_addr = la + list_off;
		}
	}
	*devp = dev;
	return p;
}

void
gpu_pages_free(struct gpx_wire_page *p)
{
	if (p == NULL)
		return;
	uint32_t first = (uint32_t)(((unsigned char *)p - arena) / ARENA_GRAIN);
	pthread_mutex_lock(&arena_lock);
	pool_give(&arena_pool, first);
	pthread_mutex_unlock(&arena_lock);
}

void
gpu_pages_stats(struct gpu_arena *s)
{
	pthread_mutex_lock(&arena_lock);
	*s = (struct gpu_arena){ arena != NULL ? ARENA_SIZE : 0, ARENA_GRAIN, (uint64_t)arena_pool.share * ARENA_GRAIN,
	    { arena_pool.refused[0], arena_pool.refused[1] } };
	pthread_mutex_unlock(&arena_lock);
}

/* ---- copy workers ---- */

/* The address of r in GPU dev's context, or 0 if r is not mapped there. */
static uint64_t
addr_on(const struct region *r, int dev)
{
	if (r->dev == DEV_HOST)
		return (uint64_t)(uintptr_t)r->host;
	if (r->kind == GPX__MEM_KIND__MEM_CUDA_IPC)
		return gpu_map_addr_on(r, dev);
	return r->dptr;    /* VMM and pool: one address, access granted to every peer */
}

/*
 * What a kernel on GPU `dev` can address: pinned (mapped) host memory, VMM mappings (access
 * is granted to every peer), and IPC allocations opened in its own context; never another
 * node's region (its priv is the fabric's, not a mark of pinning).
 */
static bool
kernel_reach(const struct region *r, int dev)
{
	if (r->kind == GPX__MEM_KIND__MEM_REMOTE)
		return false;
	if (r->dev == DEV_HOST)
		return r->priv != NULL;
	return addr_on(r, dev) != 0;
}

/* Whether GPU dev's copy kernel runs copies of pieces of avg bytes between src and dst. */
static bool
kernel_takes(int dev, const struct region *src, const struct region *dst, uint64_t avg)
{
	return gpus[dev].kernel_ok && gcfg()->sm_copy && avg <= KERNEL_MAX_AVG && kernel_reach(src, dev) &&
	    kernel_reach(dst, dev);
}

static int
free_slot(struct gdev *g)
{
	for (int i = 0; i < PEND_MAX; i++)
		if (!g->slot_busy[i])
			return i;
	return -1;
}

/* Where a pair's sides are for GPU dev's copies; *peer when one is not mapped in its context. */
static void
pair_addrs(const struct jpair *p, int dev, uint64_t *src, uint64_t *dst, bool *peer)
{
	*src = addr_on(p->src, dev);
	*dst = addr_on(p->dst, dev);
	*peer = *src == 0 || *dst == 0;
	if (*peer) {
		/* A peer's IPC memory it could not open: the copy names the owners' contexts. */
		*src = p->src->dev == DEV_HOST ? *src : p->src->dptr;
		*dst = p->dst->dev == DEV_HOST ? *dst : p->dst->dptr;
	}
}

/* A pair's sides for GPU dev as issue_segs takes them (struct gpu_pair_at's flags). */
enum { PA_FOUND = 1, PA_PEER = 2, PA_KERNEL = 4, PA_LOCAL = 8, PA_GPUS = 16 };

/*
 * Pair p of job j for GPU dev's copies: its sides' addresses (pair_addrs), whether the kernel
 * reaches both, whether both are dev's own memory, whether both are GPU memory; from at[p]
 * where the job's pairs are kept with their sides (at: chunks->pairs_at), found there the
 * first time.
 */
static struct gpu_pair_at
pair_at(const struct job *j, struct gpu_pair_at *at, uint32_t p, int dev)
{
	const struct jpair *jp = &j->pairs[p];
	struct gpu_pair_at a;
	bool peer;

	if (at != NULL && at[p].flags & PA_FOUND)
		return at[p];
	pair_addrs(jp, dev, &a.src, &a.dst, &peer);
	a.flags = PA_FOUND | (peer ? PA_PEER : 0) |
	    (kernel_reach(jp->src, dev) && kernel_reach(jp->dst, dev) ? PA_KERNEL : 0) |
	    (jp->src->dev == dev && jp->dst->dev == dev ? PA_LOCAL : 0) |
	    (jp->src->dev != DEV_HOST && jp->dst->dev != DEV_HOST ? PA_GPUS : 0);
	if (at != NULL)
		at[p] = a;
	return a;
}

/* Stream s's completion word, as a launch that writes it takes its address, and the value the
 * next chunk issued on s writes there (its start mark, with stage clocks, the same value). */
static uint64_t
done_at(const struct gdev *g, int s)
{
	return (uint64_t)(uintptr_t)&g->done[s];
}

static uint64_t
next_seq(const struct gdev *g, int s)
{
	return g->issued[s] + 1;
}

/* After what is queued on stream s: the GPU writes the next chunk's value into *word. */
static int
signal_next(struct gdev *g, int s, volatile uint64_t *word)
{
	return cuda_signal(g->stream[s], (uint64_t)(uintptr_t)word, next_seq(g, s));
}

/*
 * The chunk's segments whole, then trimmed to the chunk, into one launch of the copy kernel:
 * it starts c->off into the first and ends in the last (the engine counts the pieces up to the
 * one holding the chunk's last byte).  No per-segment branch; for the first chunk of a request
 * this loop stands between the daemon's check and the first byte moving.  One pair only.
 */
static int
issue_kernel(struct gdev *g, struct chunk *c, int slot, int s)
{
	struct job *j = c->job;
	const uint32_t pieces = c->pieces;
	uint64_t src = addr_on(j->src, g->index), dst = addr_on(j->dst, g->index), whole = 0;
	struct gpu_kseg *k = g->kstage[slot];
	const struct gpx_wire_seg *w = &j->segs[c->seg];

	for (uint32_t i = 0; i < pieces; i++) {
		/* j->segs was just written by the loop thread's core: ask for it ahead */
		__builtin_prefetch((const void *)((uintptr_t)&w[i] + 2048));
		k[i] = (struct gpu_kseg){ src + w[i].src_offset, dst + w[i].dst_offset, w[i].length };
		whole += w[i].length;
	}
	k[0].src += c->off;
	k[0].dst += c->off;
	k[0].len -= c->off;
	k[pieces - 1].len -= whole - c->off - c->bytes;
	return cuda_kernel_copy(g->index, g->stream[s], k, pieces, gcfg()->sm_copy_blocks);
}

/*
 * The pieces of a chunk, segment by segment: each one's segment, where in it the piece
 * starts, its length (0 for an empty segment) and, in p, its pair.
 */
struct walk {
	const struct job *j;
	uint32_t i, p;                /* the next segment; the pair of the piece last given */
	uint64_t left, off;           /* bytes still to give; where the next piece starts in its segment */
};

static void
walk_start(struct walk *w, const struct chunk *c)
{
	*w = (struct walk){ .j = c->job, .i = c->seg, .p = chunks->pair_of(c->job, c->seg), .left = c->bytes,
	    .off = c->off };
}

static bool
walk_next(struct walk *w, const struct gpx_wire_seg **seg, uint64_t *off, uint64_t *len)
{
	if (w->left == 0)
		return false;
	*seg = &w->j->segs[w->i];
	*off = w->off;
	*len = (*seg)->length - w->off < w->left ? (*seg)->length - w->off : w->left;
	while (w->i >= w->j->pairs[w->p].seg_end)
		w->p++;
	w->left -= *len;
	w->i++;
	w->off = 0;
	return true;
}

/* Tiles of bytes that make at most `entries` list entries: ceil(bytes / entries), in TILE_MIN steps. */
static uint64_t
tile_size(uint64_t bytes, uint32_t entries)
{
	const uint64_t t = ((bytes + entries - 1) / entries + TILE_MIN - 1) / TILE_MIN * TILE_MIN;

	return t > TILE_MIN ? t : TILE_MIN;
}

/* The bytes of chunk c in segments below SIDE_CE_MIN: a within-GPU split's kernel's share. */
static uint64_t
side_kernel_bytes(const struct chunk *c)
{
	const struct gpx_wire_seg *w;
	uint64_t off, len, n = 0;
	struct walk wk;

	walk_start(&wk, c);
	while (walk_next(&wk, &w, &off, &len))
		n += len < SIDE_CE_MIN ? len : 0;
	return n;
}

/*
 * The end of a within-GPU split's issue (issue_segs): the kernel's tiles k[0..nk) onto S_SIDE,
 * and a completion word after S_BULK2's copies (bulk2) and after the kernel, whose values the
 * chunk waits for beside its own stream's (*seq2, *seq3).  r: the copies' issue so far.  On a
 * failure both side streams are drained, as the caller drains its own.
 */
static int
side_end(struct gdev *g, const struct gpu_kseg *k, uint32_t nk, bool bulk2, int r, uint64_t *seq2, uint64_t *seq3)
{
	if (r == 0 && bulk2 && (r = signal_next(g, S_BULK2, &g->done[S_BULK2])) == 0)
		*seq2 = ++g->issued[S_BULK2];
	if (r == 0 && nk > 0) {
		r = cuda_kernel_copy(g->index, g->stream[S_SIDE], k, nk, gcfg()->sm_copy_blocks);
		if (r == 0 && (r = signal_next(g, S_SIDE, &g->done[S_SIDE])) == 0)
			*seq3 = ++g->issued[S_SIDE];
	}
	if (r < 0) {
		cuda_stream_sync(g->stream[S_BULK2]);
		cuda_stream_sync(g->stream[S_SIDE]);
	} else
		atomic_fetch_add_explicit(&splits, 1, memory_order_relaxed);
	return r;
}

/*
 * Any other chunk, of one pair or of a batch's many: segments the kernel reaches and that are
 * small (all of them, when the chunk is mostly small ones) go to one launch of the copy
 * kernel, the rest each to a copy engine.  Where the chunk holds many segments, large ones
 * within this GPU up to TILE_SEG_MAX go to that launch too, cut into tiles so that the
 * kernel's warps share them.  A same-GPU copy pays a few microseconds per copy: for the 338
 * tensors of a 2.9 GiB weight push (most of them 1-30 MB) one cuMemcpyAsync per tensor ran
 * at 0.62x of one flat copy of the same bytes on an H200 (0.76x dealt over two streams, as
 * gpxd's bulk streams did; cuMemcpyBatchAsync 0.62x), a program's own kernel over 32 KiB
 * tiles with the whole GPU at 0.94x, and gpxd with tiles 0.77-0.82x
 * (tests/results/gpu-tensors-h200.txt).  Larger tensors keep the copy engine, which then loses
 * little to its per-copy cost; copies with host memory keep it too.
 * Between GPUs, a chunk of many large segments is split (split_worth): on S_BULK the copy
 * engine takes its segments in order up to half its bytes, on S_BULK2 the kernel the rest, in
 * tiles, and the chunk ends when both have.  Either alone leaves the link idle at times (a copy
 * engine between its copies, the kernel as its warps run out of tiles); together they fill it.
 * For the 338 tensors of a 2.9 GiB weight push GPU0 -> GPU1 on two H100 (NV18), against one
 * flat copy: one cuMemcpyAsync each 0.884x, the kernel alone 0.933x, the two side by side
 * 0.966x-0.970x; gpxd's push went from 0.91x to 0.96x (tests/results/gpu2-h100-split.txt).
 * Within one GPU such a chunk is split three ways (SPLIT_LOCAL): segments of SIDE_CE_MIN and
 * more to copy engines, one on S_BULK, the next on S_BULK2, and so on, the rest in tiles to the
 * kernel on S_SIDE, all three side by side.  The kernel moves some 0.93x-0.95x of a flat
 * copy's bytes a second within an H100 (a copy engine more); one engine pays a few
 * microseconds between copies, which the other's copy hides (dealing them by bytes instead,
 * runs of copies on one engine, lost 2%); the small segments would leave an engine idle
 * between them.  For the 338 tensors of a 2.9 GiB weight push on an H100, against one flat
 * copy (tests/gpu/split-probe, tests/results/gpu1-h100-local-split.txt): gpxd's way before
 * (tiles up to 32 MiB in the kernel, larger segments on a copy engine of the chunk's stream)
 * 0.94x, one copy per tensor over two streams 0.80x, this 0.98x.
 * A chunk of the quick stream sends every segment the kernel reaches to it, up to
 * GPU_KFEW_MAX of them by value (gpx_copy_few): such a copy uses no copy engine.  The stream's
 * priority orders copies within gpxd's copy engines only; under MPS the engines are shared
 * with every other process on the GPU, and a 4 KiB copy waited there behind others' 1 GiB
 * copies (p99 5.7 ms, against 263 us without MPS, on an H100).  Segments it cannot reach
 * (memory not mapped in this context) keep the copy engine.
 */
static int
issue_segs(struct gdev *g, struct chunk *c, int slot, int s, bool ce, enum split split, bool *signaled,
    uint64_t *seq2, uint64_t *seq3)
{
	struct job *j = c->job;
	const uint32_t pieces = c->pieces ? c->pieces : 1;
	const bool quick = s == S_QUICK;
	const bool all = quick || (pieces >= KERNEL_MIN_SEGS && c->bytes / pieces <= KERNEL_MAX_AVG);
	/* Tiles so that every segment, cut, still fits the list: at most pieces + bytes / tile (a
	 * split within the GPU cuts only what goes to the kernel, and as finely: a few hundred MB
	 * of small tensors in tiles sized for a whole chunk left most SMs idle). */
	const bool tiles = !all && pieces >= KERNEL_MIN_SEGS && KSEG_MAX - pieces >= KSEG_MAX / 2;
	const uint64_t tbytes = tiles && split == SPLIT_LOCAL ? side_kernel_bytes(c) : c->bytes;
	const uint64_t tile = tiles ? tile_size(tbytes, KSEG_MAX - pieces) : 0;
	struct gpu_kseg *k = g->kstage[slot];
	struct gpu_pair_at *sides = chunks->pairs_at(j);
	const bool kernel = !ce && g->kernel_ok && gcfg()->sm_copy;
	uint32_t nk = 0, cur = UINT32_MAX;
	uint64_t src = 0, dst = 0, off, len, kbytes = 0, cebytes = 0, split_kbytes = 0;
	bool peer = false, reach = false, local = false, link = false, bulk2 = false;
	const struct gpx_wire_seg *w;
	struct walk wk;
	int r = 0;

	walk_start(&wk, c);
	while (r == 0 && walk_next(&wk, &w, &off, &len)) {
		const uint32_t p = wk.p;
		if (p != cur) {
			const struct gpu_pair_at a = pair_at(j, sides, p, g->index);
			cur = p;
			src = a.src;
			dst = a.dst;
			peer = a.flags & PA_PEER;
			reach = kernel && a.flags & PA_KERNEL;
			local = reach && !peer && a.flags & PA_LOCAL;
			/* (both GPUs' memory mapped here, at least one side another GPU's) */
			link = reach && !peer && !local && a.flags & PA_GPUS;
		}
		if (len == 0)
			continue;
		if (split == SPLIT_LOCAL && local && len >= SIDE_CE_MIN) {
			const int b = g->side_next ^= 1;     /* one engine, then the other */
			r = cuda_copy(g->stream[b ? S_BULK2 : s], dst + w->dst_offset + off, src + w->src_offset + off, len);
			bulk2 |= b;
		}
		else if (reach && (all || len <= KERNEL_MAX_AVG)) {
			k[nk++] = (struct gpu_kseg){ src + w->src_offset + off, dst + w->dst_offset + off, len };
			kbytes += len;
		}
		else if ((local && tiles && len <= TILE_SEG_MAX) ||
		    (link && split == SPLIT_LINK && tiles && 2 * cebytes >= c->bytes)) {
			for (uint64_t at = 0; at < len; at += tile)
				k[nk++] = (struct gpu_kseg){ src + w->src_offset + off + at, dst + w->dst_offset + off + at,
				    len - at < tile ? len - at : tile };
			kbytes += len;
			split_kbytes += link ? len : 0;
		}
		else if (peer) {
			r = cuda_copy_peer(g->stream[s], dst + w->dst_offset + off,
			    j->pairs[p].dst->dev == DEV_HOST ? g->index : j->pairs[p].dst->dev, src + w->src_offset + off,
			    j->pairs[p].src->dev == DEV_HOST ? g->index : j->pairs[p].src->dev, len);
		}
		else {
			r = cuda_copy(g->stream[s], dst + w->dst_offset + off, src + w->src_offset + off, len);
			cebytes += link ? len : 0;
		}
	}
	if (split == SPLIT_LOCAL)
		return side_end(g, k, nk, bulk2, r, seq2, seq3);
	if (r == 0 && quick && nk > 0 && nk <= GPU_KFEW_MAX) {
		/* last on the stream for this chunk: the launch writes its completion word itself */
		r = cuda_kernel_copy_few(g->index, g->stream[s], k, nk, kbytes, gcfg()->sm_copy_blocks,
		    done_at(g, s), next_seq(g, s));
		*signaled = r == 0;
	}
	else if (r == 0 && split_kbytes > 0) {
		/* the kernel's half beside the copy engine's (s is S_BULK), with a completion word of its own */
		r = cuda_kernel_copy(g->index, g->stream[S_BULK2], k, nk, gcfg()->sm_copy_blocks);
		r = r ? r : signal_next(g, S_BULK2, &g->done[S_BULK2]);
		if (r < 0)
			cuda_stream_sync(g->stream[S_BULK2]);   /* (the caller waits for s only) */
		else {
			*seq2 = ++g->issued[S_BULK2];
			atomic_fetch_add_explicit(&splits, 1, memory_order_relaxed);
		}
	}
	else if (r == 0 && nk == 1 && !all)
		r = cuda_copy(g->stream[s], k[0].dst, k[0].src, k[0].len);     /* a launch buys nothing */
	else if (r == 0 && nk > 0)
		r = cuda_kernel_copy(g->index, g->stream[s], k, nk, gcfg()->sm_copy_blocks);
	return r;
}

/* A timed chunk's size, as the rates are kept: floor(log2(bytes)) from 1 MiB, up to 1 GiB. */
static int
size_class(uint64_t bytes)
{
	const int b = 63 - __builtin_clzll(bytes | 1) - 20;

	return b < 0 ? 0 : b >= NSIZES ? NSIZES - 1 : b;
}

/* A chunk's kind of copy: host or GPU at either end, between GPUs, a page list. */
static uint8_t
chunk_class(const struct chunk *c)
{
	const struct job *j = c->job;

	return (uint8_t)((j->src->dev == DEV_HOST) | (j->dst->dev == DEV_HOST) << 1 |
	    (j->src->dev != j->dst->dev && j->src->dev != DEV_HOST && j->dst->dev != DEV_HOST) << 2 |
	    (j->pages != NULL || j->plist != NULL) << 3);
}

/*
 * Chunk c is queued on stream s and ends when the stream's completion word reaches seq (and,
 * split, S_BULK2's reaches seq2 and S_SIDE's seq3): the next entry of the stream's pending
 * ring, with its kind (chunk_class), when it should end (0: untimed, and then so is what
 * queues behind it) and its list slot (-1: none).
 */
static void
pend_push(struct gdev *g, int s, const struct chunk *c, uint8_t cls, uint64_t seq, uint64_t seq2, uint64_t seq3,
    uint64_t now, uint64_t due, int slot, bool mark)
{
	const int at = (g->phead[s] + g->npend[s]) % PEND_MAX;

	if (g->npend[s] == 0)
		g->last_end[s] = now;       /* the stream was idle: this chunk starts now */
	g->tail_due[s] = due ? due : UINT64_MAX;
	g->pend[s][at] = (struct pend){ .c = *c, .seq = seq, .seq2 = seq2, .seq3 = seq3, .t_issue = now, .due = due,
	    .stream = s, .slot = slot, .cls = cls, .marked = mark };
	if (c->last && due != 0)
		g->pend[s][at].wake = due > now + WAKE_LEAD_NS ? due - WAKE_LEAD_NS : now;
	g->npend[s]++;
	if (slot >= 0)
		g->slot_busy[slot] = true;
	if (c->job->t_launched == 0)
		c->job->t_launched = now_s();     /* the stage clocks: queued on the GPU */
}

/* A launch or completion word for chunks c[0..n) failed: nothing queued for them can be
 * trusted; waits for the stream, then fails them. */
static void
issue_failed(struct gdev *g, int s, struct chunk *c, int n)
{
	cuda_stream_sync(g->stream[s]);
	chunks->done(c, n, false);
}

/*
 * Whether bulk chunk c is split between copy engines and the kernel (issue_segs): many large
 * segments, its first pair between two GPUs whose memory this GPU's kernel reaches (half to a
 * copy engine, half to the kernel), or within this GPU (large segments to two copy engines,
 * the rest to the kernel).  The parts of every such chunk take the same streams, so that the
 * engines and the kernel run side by side from chunk to chunk, as in the measurements that
 * chose this.
 */
static enum split
split_worth(const struct gdev *g, const struct chunk *c)
{
	const struct jpair *p = &c->job->pairs[0];
	const uint32_t pieces = c->pieces ? c->pieces : 1;

	if (!g->kernel_ok || !gcfg()->sm_copy || c->job->pages != NULL || c->bytes <= QUICK_MAX ||
	    pieces < KERNEL_MIN_SEGS || c->bytes / pieces <= KERNEL_MAX_AVG || KSEG_MAX - pieces < KSEG_MAX / 2 ||
	    p->src->dev == DEV_HOST || p->dst->dev == DEV_HOST || addr_on(p->src, g->index) == 0 ||
	    addr_on(p->dst, g->index) == 0)
		return SPLIT_NONE;
	return p->src->dev == g->index && p->dst->dev == g->index ? SPLIT_LOCAL : SPLIT_LINK;
}

/* Chunk c onto a stream; ce: on copy engines only (a lone small copy between GPUs). */
static int
issue_on(struct gdev *g, struct chunk *c, bool ce)
{
	struct job *j = c->job;
	const uint32_t pieces = c->pieces ? c->pieces : 1;
	const enum split split = ce ? SPLIT_NONE : split_worth(g, c);
	int s = c->bytes <= QUICK_MAX ? S_QUICK : split || g->npend[S_BULK] <= g->npend[S_BULK2] ? S_BULK : S_BULK2;
	int slot = free_slot(g), r;
	bool mark = start_marks && j->t_launched == 0, signaled = false;
	uint64_t seq2 = 0, seq3 = 0;

	if (atomic_exchange(&fault_sticky, false)) {
		log_warnx("GPU%d: injecting a sticky fault (GPXD_FAULT_INJECT=sticky)", g->index);
		cuda_kernel_copy(g->index, g->stream[s], (const struct gpu_kseg *)16, 1, 1);   /* unmapped */
	}
	if (mark && signal_next(g, s, &g->started[s]) < 0)
		mark = false;
	if (j->pages != NULL) {
		/* Only taken where the kernel runs (gpu_pages_alloc): the list is read in place. */
		const uint64_t sp = j->list != NULL ? j->list_addr : (uint64_t)(uintptr_t)j->pages;
		const struct gpu_plist l = j->list != NULL ?
		    (struct gpu_plist){ sp, sp + 4ull * j->npages, 1, j->lim_src, j->lim_dst, (uint64_t)(uintptr_t)j->oob } :
		    (struct gpu_plist){ sp, sp + 4, 2, UINT32_MAX, UINT32_MAX, 0 };
		r = cuda_kernel_pages(g->index, g->stream[s], &l, j->npages,
		    (const unsigned char *)j->pages + kpairs_at(j->list != NULL ? 0 : j->npages), c->seg, pieces,
		    j->page_size, c->off, c->bytes, gcfg()->sm_copy_blocks);
	} else if (!ce && j->npairs == 1 && pieces >= KERNEL_MIN_SEGS && (s != S_QUICK || pieces > GPU_KFEW_MAX) &&
	    kernel_takes(g->index, j->src, j->dst, c->bytes / pieces))
		r = issue_kernel(g, c, slot, s);
	else
		r = issue_segs(g, c, slot, s, ce, split, &signaled, &seq2, &seq3);
	if (r == 0 && !signaled)
		r = signal_next(g, s, &g->done[s]);
	if (r < 0) {
		issue_failed(g, s, c, 1);
		return r;
	}
	const uint64_t now = now_ns();
	const uint8_t cls = chunk_class(c);
	const uint64_t base = g->npend[s] == 0 ? now : g->tail_due[s];
	const double rate = c->bytes >= TIMED_MIN ? g->ns_per_byte[cls][size_class(c->bytes)] : 0;
	uint64_t due = 0;
	if (rate > 0 && base != UINT64_MAX)
		due = (base > now ? base : now) + (uint64_t)(c->bytes * rate);
	pend_push(g, s, c, cls, ++g->issued[s], seq2, seq3, now, due, slot, mark);
	if (c->last && g->npend[S_BULK] + g->npend[S_BULK2] + g->npend[S_QUICK] == 1)
		chunks->warm_end(c);
	return 0;
}

static int
issue(struct gdev *g, struct chunk *c)
{
	return issue_on(g, c, false);
}

/*
 * A small copy from this GPU to another, contiguous, with nothing else queued to go with it,
 * while gpxd has nothing on this GPU's copy engines and no other process's work that gpxd
 * cannot see may be there (not under MPS), goes to a copy engine: on two H100 a 1 MiB copy
 * ran at 0.71x-0.73x of cuMemcpyPeerAsync against 0.58x-0.59x on the kernel, and 4 KiB ended
 * 0-2 us sooner (tests/results/gpu2-h100-lone-ce.txt).  Within one GPU the two are even or
 * the kernel is ahead (same file), and many small copies in flight go twice as fast together
 * on the kernel (gpu2-h100-small-ce.txt).
 */
static bool
lone_peer(const struct gdev *g, const struct chunk *c)
{
	const struct job *j = c->job;

	return !g->mps && g->npend[S_BULK] == 0 && g->npend[S_BULK2] == 0 && c->pieces <= 1 && j->npairs == 1 &&
	    j->pages == NULL && j->plist == NULL && j->src->dev != DEV_HOST && j->dst->dev != DEV_HOST &&
	    j->src->dev != j->dst->dev;
}

/*
 * The segments of chunk c appended to k (*nk of GPU_KFEW_MAX taken) when the copy kernel
 * reaches every one of them; else false and nothing appended.  For issue_quick.
 */
static bool
few_segs(struct gdev *g, const struct chunk *c, struct gpu_kseg *k, uint32_t *nk)
{
	const struct job *j = c->job;
	struct gpu_pair_at *sides = chunks->pairs_at(j);
	uint32_t n = *nk, cur = UINT32_MAX;
	uint64_t src = 0, dst = 0, off, len;
	const struct gpx_wire_seg *w;
	struct walk wk;

	if (j->pages != NULL || j->plist != NULL || c->bytes > QUICK_MAX)
		return false;
	walk_start(&wk, c);
	while (walk_next(&wk, &w, &off, &len)) {
		if (wk.p != cur) {
			/* (where the kernel reaches both sides, they are its own addresses: not PA_PEER) */
			const struct gpu_pair_at a = pair_at(j, sides, wk.p, g->index);
			if (!(a.flags & PA_KERNEL))
				return false;
			cur = wk.p;
			src = a.src;
			dst = a.dst;
		}
		if (len == 0)
			continue;
		if (n == GPU_KFEW_MAX)
			return false;
		k[n++] = (struct gpu_kseg){ src + w->src_offset + off, dst + w->dst_offset + off, len };
	}
	*nk = n;
	return true;
}

/*
 * A small chunk, and with it the small chunks queued behind it that fit: their segments in
 * one launch of the copy kernel on the quick stream, one completion word for all of them,
 * which the launch writes itself.  Copies of 4 KiB, 64 in flight, spent ~6 us each in their
 * own launch and completion word (the stage clocks' launch stage), which bounded the rate a
 * GPU's worker sustains.  They are taken from the engine together (one hold of its lock), and
 * a chunk taken that does not fit is issued on its own.  Returns the chunks issued.
 */
static int
issue_quick(struct gdev *g, struct chunk *c, enum path_kind path, int room)
{
	struct chunk batch[PEND_MAX];
	struct gpu_kseg k[GPU_KFEW_MAX];
	uint32_t nk = 0;
	int n = 0, extra = 0;
	const int s = S_QUICK;

	if (room > PEND_MAX - g->npend[s])
		room = PEND_MAX - g->npend[s];
	if (!chunks->has_work(path) && lone_peer(g, c))
		return issue_on(g, c, true) == 0;
	if (room < 2 || !g->kernel_ok || !gcfg()->sm_copy || start_marks || atomic_load(&fault_sticky) ||
	    !chunks->has_work(path) || !few_segs(g, c, k, &nk))
		return issue(g, c) == 0;
	batch[n++] = *c;
	/* The rest under one hold of the engine's lock; no more than could each add a segment. */
	struct chunk more[PEND_MAX];
	const int want = room - 1 < (int)(GPU_KFEW_MAX - nk) ? room - 1 : (int)(GPU_KFEW_MAX - nk);
	const int got = chunks->next_small(path, more, want, KSEG_MAX);
	for (int i = 0; i < got; i++) {
		if (few_segs(g, &more[i], k, &nk))
			batch[n++] = more[i];
		else
			extra += issue(g, &more[i]) == 0;     /* not for the batch: on its own */
	}
	uint64_t bytes = 0;
	for (uint32_t i = 0; i < nk; i++)
		bytes += k[i].len;
	int r = cuda_kernel_copy_few(g->index, g->stream[s], k, nk, bytes, gcfg()->sm_copy_blocks,
	    done_at(g, s), next_seq(g, s));
	if (r < 0) {
		issue_failed(g, s, batch, n);
		return extra;
	}
	const uint64_t seq = ++g->issued[s], now = now_ns();
	if (n > 1)
		atomic_fetch_add_explicit(&batched, (uint64_t)n, memory_order_relaxed);
	for (int i = 0; i < n; i++)
		pend_push(g, s, &batch[i], chunk_class(&batch[i]), seq, 0, 0, now, 0, -1, false);   /* one word, untimed */
	return n + extra;
}

/* The stage clocks: jobs whose start mark the GPU wrote since the last look. */
static void
reap_starts(struct gdev *g, int s)
{
	uint64_t started = __atomic_load_n(&g->started[s], __ATOMIC_ACQUIRE);

	for (int i = 0; i < g->npend[s]; i++) {
		struct pend *p = &g->pend[s][(g->phead[s] + i) % PEND_MAX];
		if (p->seq > started)
			break;
		if (p->marked) {
			p->c.job->t_gpu_start = now_s();
			p->marked = false;
		}
	}
}

/*
 * What an ended chunk teaches of its kind of copy's rate.  Its start: when it was queued, or
 * when the chunk before it on its stream ended.  Its end is only known when the worker was
 * polling as it came (watching); a nap that ran its full length and found the chunk already
 * done woke late, so its kind is taken for a little faster.
 */
static void
learn(struct gdev *g, const struct pend *p, uint64_t now, bool watching, bool late)
{
	if (p->c.bytes < TIMED_MIN)
		return;
	double *r = &g->ns_per_byte[p->cls][size_class(p->c.bytes)];

	if (watching) {
		const uint64_t start = p->t_issue > g->last_end[p->stream] ? p->t_issue : g->last_end[p->stream];
		const double seen = (double)(now - start) / (double)p->c.bytes;
		*r = *r > 0 ? 0.75 * *r + 0.25 * seen : seen;
	} else if (late && p->due != 0)
		*r *= 0.9;
}

static int
reap(struct gdev *g)
{
	const uint64_t now = now_ns();
	const bool watching = !g->napped && now - g->last_look < 20000;
	const bool late = g->napped && g->nap_full;
	struct chunk ended[NSTREAMS * PEND_MAX];
	int n = 0;

	for (int s = 0; s < NSTREAMS; s++) {
		if (start_marks)
			reap_starts(g, s);
		const uint64_t done = __atomic_load_n(&g->done[s], __ATOMIC_ACQUIRE);
		const uint64_t done2 = __atomic_load_n(&g->done[S_BULK2], __ATOMIC_ACQUIRE);
		const uint64_t done3 = __atomic_load_n(&g->done[S_SIDE], __ATOMIC_ACQUIRE);
		while (g->npend[s] > 0 && g->pend[s][g->phead[s]].seq <= done && g->pend[s][g->phead[s]].seq2 <= done2 &&
		    g->pend[s][g->phead[s]].seq3 <= done3) {
			struct pend *p = &g->pend[s][g->phead[s]];
			learn(g, p, now, watching, late);
			g->last_end[s] = now;
			if (p->slot >= 0)
				g->slot_busy[p->slot] = false;
			g->phead[s] = (g->phead[s] + 1) % PEND_MAX;
			g->npend[s]--;
			ended[n++] = p->c;
		}
	}
	g->last_look = now;
	g->napped = false;
	if (n > 0)
		chunks->done(ended, n, true);   /* together: one lock, one doorbell per client */
	return n;
}

/*
 * The wake-up calls due by now: the clients of jobs whose last chunk ends within WAKE_LEAD_NS
 * (engine_chunk_soon); one whose client does not sleep yet is made again WAKE_AGAIN_NS on.
 * Returns when the next one is due, UINT64_MAX if none is.
 */
static uint64_t
wake_calls(struct gdev *g, uint64_t now)
{
	uint64_t next = UINT64_MAX;

	for (int s = 0; s < NSTREAMS; s++)
		for (int i = 0; i < g->npend[s]; i++) {
			struct pend *p = &g->pend[s][(g->phead[s] + i) % PEND_MAX];
			if (p->wake == 0)
				continue;
			if (p->wake <= now)
				p->wake = chunks->soon(&p->c) ? 0 : now + WAKE_AGAIN_NS;
			if (p->wake != 0 && p->wake < next)
				next = p->wake;
		}
	return next;
}

/* When the first of the chunks on the GPU should end; 0 when one of them is not timed. */
static uint64_t
next_due(const struct gdev *g)
{
	uint64_t due = UINT64_MAX;

	for (int s = 0; s < NSTREAMS; s++) {
		if (g->npend[s] == 0)
			continue;
		const uint64_t d = g->pend[s][g->phead[s]].due;
		if (d == 0)
			return 0;
		due = d < due ? d : due;
	}
	return due == UINT64_MAX ? 0 : due;
}

static void *
gpu_worker(void *arg)
{
	struct gdev *g = arg;
	enum path_kind path = PATH_GPU0 + g->index;
	uint64_t idle_since = now_ns(), stuck_since = 0, looking_until = 0;

	cuda_use(g->index);
	thread_name("gpu%d", g->index);
	prctl(PR_SET_TIMERSLACK, 1000UL);   /* sleeps of 20 us must not become 70 */
	while (!gpu_quit) {
		wcfg = conf_refresh(wcfg);
		int progress = reap(g);
		int pending = g->npend[S_BULK] + g->npend[S_BULK2] + g->npend[S_QUICK];
		struct chunk c;
		/*
		 * How long an idle worker keeps looking for work before it blocks: as long as the
		 * event loop polls after a client's last message (daemon.busy_poll_us), so that a
		 * client that submits between its own GPU work, a millisecond apart say, never waits
		 * for this thread to be woken (on virtual machines 100 us and more).  It spins only
		 * the first LIGHT_SPIN_NS of that (a client submitting back to back comes within
		 * it); then it waits until the loop has a request for this GPU in hand (engine_idle,
		 * engine_prewake), so that one thread polls, not two, and its wake-up runs while the
		 * loop checks the request.
		 * Once nothing has come for the whole time both sleep, and an idle daemon costs no
		 * CPU.
		 */
		const uint64_t spin_ns = gcfg()->busy_poll_us * 1000ull > IDLE_SPIN_NS ? gcfg()->busy_poll_us * 1000ull :
		    IDLE_SPIN_NS;

		/*
		 * A completion counts as activity: a long job just ended, and its client's next
		 * request is likely on its way; blocking now (the last issue may be long past) would
		 * make it pay a wake-up.
		 */
		if (progress)
			idle_since = now_ns();

		/*
		 * With the bulk stream full, small copies (of anyone) still go onto the quick
		 * stream, a few at a time: a 4 KiB copy never waits for a 1 GiB chunk, and no
		 * piece of a large copy is put in its way there.
		 */
		bool bulk_room;
		while (pending < PEND_MAX && ((bulk_room = g->npend[S_BULK] + g->npend[S_BULK2] < PEND_MAX / 2) ||
		    g->npend[S_QUICK] < QUICK_SHARE) &&
		    (chunks->has_work(path) || (pending == 0 && now_ns() - idle_since > spin_ns))) {
			/* Block only when idle for a while: the spin keeps small-copy latency low. */
			bool wait = pending == 0 && !chunks->has_work(path);
			if (!(bulk_room ? chunks->next(path, &c, wait, BULK_CHUNK, KSEG_MAX) :
			    chunks->next_small(path, &c, 1, KSEG_MAX) == 1))
				break;
			if (c.bytes <= QUICK_MAX)
				issue_quick(g, &c, path, PEND_MAX - pending);
			else
				issue(g, &c);
			pending = g->npend[S_BULK] + g->npend[S_BULK2] + g->npend[S_QUICK];
			progress++;
			idle_since = now_ns();
		}
		if (progress) {
			stuck_since = 0;
			continue;
		}
		if (pending == 0) {
			const uint64_t now = now_ns(), idle = now - idle_since;
			if (idle < LIGHT_SPIN_NS || now < looking_until) {
				if (idle_hook != NULL)
					idle_hook();   /* idle: lend this core (xfer_help: a long page list's check) */
				sched_yield();
			} else if (idle < spin_ns && chunks->idle(path, spin_ns - idle)) {
				/* a request for this GPU is being checked: its job follows */
				idle_since = now_ns();
				looking_until = idle_since + PREWAKE_LOOK_NS;
			}
			continue;
		}
		/*
		 * Work is on the GPU.  When the first chunk should end well after now (its kind's rate
		 * is known), nap until a little before, or until new work comes: polling through a
		 * long copy costs a core and gains nothing.  Then spin (a completion is seen within
		 * ~100 ns), and only after a few milliseconds without progress fall back to short
		 * sleeps.
		 */
		uint64_t now = now_ns(), due = next_due(g);
		const uint64_t wake = wake_calls(g, now);
		if (due > now + NAP_MIN_NS + NAP_MARGIN_NS + g->late_ns + (due - now) / 16 && wake > now + NAP_MIN_NS) {
			/* It ends early by a constant, by how late naps end, and by a 16th of the wait
			 * (the rate is a mean: a copy a little faster than it must not be waited for);
			 * or at the next wake-up call, unless that leaves too little to nap after it:
			 * a call made again every WAKE_AGAIN_NS must not keep the last nap, which
			 * wakes the loop, from reaching the end. */
			uint64_t want = due - now - NAP_MARGIN_NS - g->late_ns - (due - now) / 16;
			const bool to_end = wake - now >= want - NAP_MIN_NS;     /* (want > NAP_MIN_NS) */
			if (!to_end)
				want = wake - now;
			chunks->nap(path, want);
			atomic_fetch_add_explicit(&naps, 1, memory_order_relaxed);
			const uint64_t woke = now_ns();
			g->napped = true;
			g->nap_full = woke >= now + want;
			if (g->nap_full)
				g->late_ns = (3 * g->late_ns + (woke - now - want)) / 4;
			/*
			 * The first chunk ends in a few tens of microseconds: if the event loop
			 * napped meanwhile, it wakes now, not when the completion is posted, so
			 * that it polls by the time the client's next request comes (its wake-up
			 * was that request's to wait for: up to 20-35 us after a nap of a
			 * millisecond on the GPU machine, and more on other virtual machines).
			 */
			if (g->nap_full && to_end)
				chunks->ending();
			stuck_since = 0;
			continue;
		}
		if (stuck_since == 0)
			stuck_since = now;
		if (now - stuck_since > SPIN_NS) {
			struct timespec ts = { 0, 20000 };
			nanosleep(&ts, NULL);
		} else
			cpu_pause();
		if (now - stuck_since > 1000000000ull) {
			for (int s = 0; s < NSTREAMS; s++)
				cuda_stream_busy(g->stream[s]);   /* exits the daemon on a sticky error */
			stuck_since = now;
		}
	}
	conf_drop(wcfg);
	wcfg = NULL;
	return NULL;
}

uint64_t
gpu_naps(void)
{
	return atomic_load_explicit(&naps, memory_order_relaxed);
}

uint64_t
gpu_split(void)
{
	return atomic_load_explicit(&splits, memory_order_relaxed);
}

uint64_t
gpu_batched(void)
{
	return atomic_load_explicit(&batched, memory_order_relaxed);
}

/* ---- setup ---- */

static int
gdev_start(struct gdev *g)
{
	void *words;

	if (cuda_use(g->index) < 0 || cuda_host_alloc(&words, 64 * NSTREAMS) < 0)
		return -1;
	memset(words, 0, 64 * NSTREAMS);
	g->late_ns = 50000;        /* until naps are measured: as late as wake-ups on virtual machines */
	g->done = words;
	g->started = g->done + NSTREAMS;       /* the same pinned block, after the done words */
	for (int s = 0; s < NSTREAMS; s++)
		if ((s == S_QUICK ? cuda_stream_new_urgent(&g->stream[s]) : cuda_stream_new(&g->stream[s])) < 0)
			return -1;
	g->kernel_ok = cuda_load_kernel(g->index) == 0;
	g->mps = cuda_mps(g->index);
	for (int i = 0; g->kernel_ok && i < PEND_MAX; i++) {
		void *h;
		if (cuda_host_alloc(&h, KSEG_MAX * sizeof(struct gpu_kseg)) < 0) {
			g->kernel_ok = false;
			break;
		}
		g->kstage[i] = h;
	}
	if (!g->kernel_ok)
		log_warnx("GPU%d: SM copy kernel unavailable; vectored copies use copy engines", g->index);
	return pthread_create(&g->thread, NULL, gpu_worker, g) == 0 ? 0 : -1;
}

/*
 * Starts the copy workers of GPUs 0..n-1 (their streams, completion words, kernel staging),
 * and the page arena.  0, or -1 with why.
 */
int
gpu_workers_start(int n, char *why, size_t whylen)
{
	const char *fault = getenv("GPXD_FAULT_INJECT"), *clocks = getenv("GPXD_STAGE_CLOCKS");

	if (fault != NULL && strcmp(fault, "sticky") == 0)
		atomic_store(&fault_sticky, true);
	start_marks = clocks != NULL && strcmp(clocks, "1") == 0;
	if ((gpus = calloc(n, sizeof(*gpus))) == NULL) {
		snprintf(why, whylen, "out of memory for %d copy workers", n);
		return -1;
	}
	for (int i = 0; i < n; i++) {
		gpus[i].index = i;
		if (gdev_start(&gpus[i]) < 0) {
			snprintf(why, whylen, "cannot start the copy worker of GPU%d", i);
			gpu_workers_stop();
			return -1;
		}
		ngpus = i + 1;
	}
	void *p;
	if (gpus[0].kernel_ok && cuda_host_alloc(&p, ARENA_SIZE) == 0)
		arena = p;
	return 0;
}

void
gpu_workers_stop(void)
{
	gpu_quit = true;
	for (int i = 0; i < ngpus; i++) {
		pthread_join(gpus[i].thread, NULL);
		for (int s = 0; s < NSTREAMS; s++)
			cuda_stream_sync(gpus[i].stream[s]);
	}
	ngpus = 0;
	free(gpus);
	gpus = NULL;
}
