/*
 * The GPU back end: devices by UUID, the peer matrix, the node-wide cache of opened GPU
 * mappings for two CUDA memory kinds (cuda-ipc, cuda-pool; cuda-vmm has its own, vmm.c),
 * pinning of host regions, and one copy worker per GPU.
 *
 * Mapping cache.  Opening a CUDA IPC handle costs ~120 us and a pool import about as much, so
 * each opened allocation is kept once per node, keyed by device and allocation identity (the
 * IPC handle's bytes; for pool memory what the owning connection says names it, see
 * region_key), never by address, which is reused after a free.  Regions hold references; the
 * last one to go closes the mapping on a task thread.  A registration that hits the cache is
 * answered from the loop without a driver call.
 *
 * Copy workers.  The worker of GPU d runs every transfer whose source (or, from host memory,
 * destination) is on d.  It takes chunks from the engine (round-robin between uids, then
 * clients), puts large ones on a "bulk" stream and small ones on a "quick" stream so that a
 * 4 KiB copy never queues behind a 1 GiB one.  When the bulk stream is full and another
 * client has work too, the worker still takes chunks, cut to the quick stream's size, a few at
 * a time: so one client keeping the bulk stream full cannot hold another's small copy back
 * until a whole bulk chunk ends.  After each chunk it has the stream write a sequence number into
 * pinned host memory.  The worker polls those words (spinning while work is due soon, sleeping
 * in proportion otherwise): no host callbacks, no driver lock taken per completion.
 * Contiguous pieces go to copy engines; chunks of many small segments go to one launch of the
 * SM copy kernel (copy-kernel.cu), with a bounded grid.  A page transfer (gpx_copy_pages) keeps
 * its checked page list in pinned memory (the page arena), which the kernel reads in place: no
 * list is built or staged per chunk, and a chunk is a byte range of up to BULK_CHUNK.
 */
#include "config.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "gpxd.h"
#include "gpu.h"

#define QUICK_MAX ENGINE_SMALL_JOB      /* chunks up to this go to the quick stream */
#define BULK_CHUNK (1ull << 30)       /* largest chunk a GPU worker takes */
#define KSEG_MAX 8192                 /* segments per kernel launch: a long list is cut into
                                         * launches so preparing one overlaps running another */
#define PEND_MAX 16                   /* chunks in flight per GPU */
#define QUICK_SHARE 2                 /* quick chunks in flight while the bulk stream is full */
#define KERNEL_MIN_SEGS 8
#define KERNEL_MAX_AVG (256u << 10)
#define IDLE_SPIN_NS 200000           /* spin at least this long for new work before sleeping */
#define SPIN_NS 5000000               /* spin this long for a completion before sleeping */

enum { S_BULK, S_QUICK, NSTREAMS };

struct pend {
	struct chunk c;
	uint64_t seq;
	int stream;
	int slot;
};

struct gdev {
	int index;
	struct gpu_info info;
	struct gpu_link link[GPX_MAX_GPUS];
	uint32_t access_mask;               /* devices that can reach this one's memory */
	void *stream[NSTREAMS];
	volatile uint64_t *done;            /* pinned: one word per stream */
	uint64_t issued[NSTREAMS];
	struct pend pend[NSTREAMS][PEND_MAX];
	int npend[NSTREAMS], phead[NSTREAMS];
	struct gpu_kseg *kstage[PEND_MAX];  /* pinned staging of kernel segment lists */
	uint64_t kdev[PEND_MAX];            /* their device copies */
	bool slot_busy[PEND_MAX];
	bool kernel_ok;
	pthread_t thread;
};

static struct gdev gpus[GPX_MAX_GPUS];
/*
 * Fault injection for the test suite: GPXD_FAULT_INJECT=sticky makes the first copy launch a
 * kernel on an invalid address, which leaves the context with a sticky error, so that the
 * daemon's handling of one (a clear log line and a non-zero exit) can be tested for real.
 */
static atomic_bool fault_sticky;
static int ngpus;
static char status_text[256] = "not initialised";
static volatile bool gpu_quit;

int
gpu_count(void)
{
	return ngpus;
}

const char *
gpu_status(void)
{
	return status_text;
}

static int
gpu_by_uuid(const uint8_t uuid[16])
{
	for (int i = 0; i < ngpus; i++)
		if (memcmp(gpus[i].info.uuid, uuid, 16) == 0)
			return i;
	return -1;
}

int
gpu_dev_by_uuid(const uint8_t uuid[16])
{
	return gpu_by_uuid(uuid);
}

uint32_t
gpu_access_mask(int dev)
{
	return gpus[dev].access_mask;
}

static void
uuid_str(const uint8_t u[16], char *buf, size_t len)
{
	snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
	    u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

/* ---- the mapping cache ---- */

#define GMAP_KEY 64     /* an IPC handle; or connection, buffer id and size */

struct gmap {
	TAILQ_ENTRY(gmap) entry;
	int refs;
	Gpx__MemKind kind;
	int dev;
	uint8_t key[GMAP_KEY];
	uint64_t base;
	uint64_t size;
	uint64_t handle;        /* pool: the imported pool */
	/*
	 * IPC only: the allocation opened again in each peer's context.  A copy engine or kernel
	 * of GPU d reaches a peer's IPC memory at link speed only through a mapping in d's own
	 * context; through the owner's mapping the driver stages it at a tenth of that.
	 */
	uint64_t base_on[GPX_MAX_GPUS];
};

static void
gmap_close_peers(struct gmap *m)
{
	for (int d = 0; d < ngpus; d++)
		if (d != m->dev && m->base_on[d] != 0)
			cuda_ipc_close(d, m->base_on[d]);
}

static pthread_mutex_t gmap_lock = PTHREAD_MUTEX_INITIALIZER;
static TAILQ_HEAD(, gmap) gmaps = TAILQ_HEAD_INITIALIZER(gmaps);
static atomic_uint_fast64_t gmap_opens, gmap_hits;

/*
 * Whether the driver handed back, in GPU dev's context, a mapping that an entry opened under
 * other handle bytes already holds.  gmap_lock held.
 *
 * The driver returns the existing mapping, and counts one more reference, for any handle it
 * takes to name an allocation it has mapped, including one altered in bytes it does not
 * compare.  Closing such a reference corrupts the driver's own heap (libcuda's, in this
 * process) once the mapping's last reference goes, seen on CUDA 13 with handles changed in
 * their exporter-process field: the daemon then aborts later, anywhere.  Since a real handle
 * is the same 64 bytes every time, a second set of bytes for one mapping is an altered or
 * forged handle: it is refused, and what it opened is never closed (a few references and at
 * most a mapping per GPU, until the daemon exits).  An altered handle that is the first to
 * open its allocation cannot be told from a real one; that is left to the trust that
 * accepting legacy handles declares (gpxd.conf(5)).
 */
static bool
ipc_held(int dev, uint64_t p)
{
	struct gmap *m;

	TAILQ_FOREACH(m, &gmaps, entry)
		if (m->kind == GPX__MEM_KIND__MEM_CUDA_IPC && m->base_on[dev] == p)
			return true;
	return false;
}

/*
 * Opens an IPC allocation in every context that can reach it; a failure only costs speed.
 * False if some context handed back a mapping already held under other bytes (ipc_held).
 */
static bool
gmap_open_peers(struct gmap *m, const uint8_t handle[64])
{
	bool ok = true;

	m->base_on[m->dev] = m->base;
	for (int d = 0; d < ngpus; d++) {
		if (d == m->dev || !gpus[d].link[m->dev].access || cuda_ipc_open(d, handle, &m->base_on[d]) < 0)
			continue;
		if (ipc_held(d, m->base_on[d]))
			ok = false;
	}
	return ok;
}

static struct gmap *
gmap_find(Gpx__MemKind kind, int dev, const uint8_t key[GMAP_KEY])
{
	struct gmap *m;

	TAILQ_FOREACH(m, &gmaps, entry)
		if (m->kind == kind && m->dev == dev && memcmp(m->key, key, GMAP_KEY) == 0)
			return m;
	return NULL;
}

static const char *
gmap_kind(const struct gmap *m)
{
	switch (m->kind) {
	case GPX__MEM_KIND__MEM_CUDA_IPC:
		return "cuda-ipc";
	default:
		return "cuda-pool";
	}
}

/* Undoes what cuda_open opened for m; blocking driver calls. */
static void
gmap_release(struct gmap *m)
{
	switch (m->kind) {
	case GPX__MEM_KIND__MEM_CUDA_IPC:
		gmap_close_peers(m);
		cuda_ipc_close(m->dev, m->base);
		break;
	default:
		cuda_pool_release(m->dev, m->base, m->handle);
		break;
	}
}

static atomic_int gmap_closing;     /* mappings handed to a task thread, not yet closed */

static void
gmap_close_work(void *arg)
{
	struct gmap *m = arg;

	gmap_release(m);
	log_debug("gpu", "closed %s mapping of %llu bytes on GPU%d", gmap_kind(m),
	    (unsigned long long)m->size, m->dev);
	atomic_fetch_sub(&gmap_closing, 1);
	free(m);
}

static void
gmap_noop(void *arg)
{
	(void)arg;
}

/* Drops a region's reference; the last one closes the mapping off the calling thread. */
static void
gmap_unref(struct gmap *m)
{
	pthread_mutex_lock(&gmap_lock);
	bool last = --m->refs == 0;
	if (last)
		TAILQ_REMOVE(&gmaps, m, entry);
	pthread_mutex_unlock(&gmap_lock);
	if (last) {
		atomic_fetch_add(&gmap_closing, 1);
		defer_run(gmap_close_work, gmap_noop, m);
	}
}

/*
 * Whether the driver has let go of r's memory: its mapping is closed and no closing is
 * still under way (a closing is not tied to its region once it starts, so any counts).
 */
bool
gpu_released(struct region *r)
{
	return __atomic_load_n(&r->priv, __ATOMIC_ACQUIRE) == NULL && atomic_load(&gmap_closing) == 0;
}

/* Binds r to m after checking the requested window against the allocation. */
static int
region_bind(struct region *r, struct gmap *m, char *err, size_t errlen)
{
	if (r->offset > m->size || r->length > m->size - r->offset) {
		if (err != NULL)
			snprintf(err, errlen, "offset %llu + length %llu exceeds the %llu-byte allocation",
			    (unsigned long long)r->offset, (unsigned long long)r->length,
			    (unsigned long long)m->size);
		return -GPX__STATUS__ERANGE;
	}
	r->priv = m;
	r->dptr = m->base + r->offset;
	return 0;
}

/*
 * Key of a region's allocation.  A legacy IPC handle names its allocation node-wide (and the
 * node is one trust domain when they are accepted at all).  A pool export is an anonymous
 * open of /dev/nvidiactl that names nothing, so a pool mapping is shared only within the
 * connection that opened it, keyed by the driver's buffer id the client gives: a client that
 * lies about it can only confuse its own registrations (the allocation's export data is no
 * capability either, and differs from one export to the next).  VMM memory is kept the same
 * way, per connection, by vmm.c.
 */
static bool
region_key(struct region *r, uint8_t key[GMAP_KEY])
{
	memset(key, 0, GMAP_KEY);
	if (r->kind == GPX__MEM_KIND__MEM_CUDA_IPC) {
		memcpy(key, r->handle, 64);
		return true;
	}
	if (r->alloc_id == 0)
		return false;
	memcpy(key, &r->owner, sizeof(r->owner));
	memcpy(key + 8, &r->alloc_id, sizeof(r->alloc_id));
	memcpy(key + 16, &r->alloc_size, sizeof(r->alloc_size));
	return true;
}

/*
 * A VMM export, and a pool's, is an open file of the NVIDIA control device; anything else is
 * refused before the driver sees it.
 */
bool
gpu_vmm_fd_ok(int fd, char *err, size_t errlen)
{
	struct stat st;

	if (fstat(fd, &st) < 0 || !S_ISCHR(st.st_mode) || major(st.st_rdev) != 195 || minor(st.st_rdev) != 255) {
		snprintf(err, errlen, "the passed fd is not a CUDA VMM or pool export (an open of /dev/nvidiactl)");
		return false;
	}
	return true;
}

static bool
cuda_try_open(struct region *r)
{
	uint8_t key[GMAP_KEY];
	struct gmap *m;
	int dev = gpu_by_uuid(r->uuid);

	if (dev < 0 || !region_key(r, key))
		return false;
	/* Without a key the open below reports the error. */
	pthread_mutex_lock(&gmap_lock);
	m = gmap_find(r->kind, dev, key);
	if (m != NULL && region_bind(r, m, NULL, 0) == 0) {
		m->refs++;
		r->dev = dev;
		atomic_fetch_add(&gmap_hits, 1);
		pthread_mutex_unlock(&gmap_lock);
		if (r->fd >= 0) {
			close(r->fd);
			r->fd = -1;
		}
		return true;
	}
	pthread_mutex_unlock(&gmap_lock);
	return false;
}

/* Task thread.  The lock is held across the driver call so one allocation is opened once. */
static int
cuda_open(struct region *r, char *err, size_t errlen)
{
	uint8_t key[GMAP_KEY];
	struct gmap *m;
	int dev = gpu_by_uuid(r->uuid), e;

	if (dev < 0) {
		snprintf(err, errlen, "no GPU with that UUID on this node");
		return -GPX__STATUS__EINVAL;
	}
	if (!region_key(r, key)) {
		snprintf(err, errlen, "cannot identify the allocation");
		return -GPX__STATUS__EBADFD;
	}
	r->dev = dev;
	pthread_mutex_lock(&gmap_lock);
	if ((m = gmap_find(r->kind, dev, key)) != NULL) {
		if ((e = region_bind(r, m, err, errlen)) == 0)
			m->refs++;
		pthread_mutex_unlock(&gmap_lock);
		goto out;
	}
	if ((m = calloc(1, sizeof(*m))) == NULL) {
		pthread_mutex_unlock(&gmap_lock);
		snprintf(err, errlen, "out of memory");
		e = -GPX__STATUS__ENOMEM;
		goto out;
	}
	m->kind = r->kind;
	m->dev = dev;
	memcpy(m->key, key, GMAP_KEY);
	if (r->kind == GPX__MEM_KIND__MEM_CUDA_IPC) {
		uint64_t base;
		if ((e = cuda_ipc_open(dev, r->handle, &m->base)) < 0)
			snprintf(err, errlen, "the driver refused the IPC handle (forged, stale, or of another device)");
		else if ((e = cuda_addr_range(m->base, &base, &m->size)) < 0) {
			snprintf(err, errlen, "cannot size the allocation");
			cuda_ipc_close(dev, m->base);
		} else if (ipc_held(dev, m->base) || !gmap_open_peers(m, r->handle)) {
			/* Never closed: see ipc_held. */
			snprintf(err, errlen, "the IPC handle maps an allocation already open under another "
			    "handle: it was altered or forged");
			log_warnx("cuda: %s; its driver references are kept until gpxd exits", err);
			e = -GPX__STATUS__EINVAL;
		}
	} else {
		/* The size is the driver's, never the client's: it bounds every copy. */
		uint64_t base = 0;
		if ((e = cuda_pool_import(dev, r->fd, r->handle, gpus[dev].access_mask, &m->base, &m->handle)) < 0)
			snprintf(err, errlen, "the driver refused the pool fd or the allocation's export data "
			    "(forged, freed, of another pool or another device)");
		else if ((e = cuda_addr_range(m->base, &base, &m->size)) < 0 || base != m->base) {
			snprintf(err, errlen, "cannot size the pool allocation (its range starts at %#llx, "
			    "the import at %#llx)", (unsigned long long)base, (unsigned long long)m->base);
			cuda_pool_release(dev, m->base, m->handle);
			e = e < 0 ? e : -GPX__STATUS__EIO;
		}
	}
	if (e == 0 && (e = region_bind(r, m, err, errlen)) < 0)
		gmap_release(m);
	if (e < 0) {
		free(m);
	} else {
		m->refs = 1;
		TAILQ_INSERT_TAIL(&gmaps, m, entry);
		atomic_fetch_add(&gmap_opens, 1);
		log_debug("gpu", "opened %s mapping of %llu bytes on GPU%d", gmap_kind(m),
		    (unsigned long long)m->size, m->dev);
	}
	pthread_mutex_unlock(&gmap_lock);
out:
	if (r->fd >= 0) {
		close(r->fd);
		r->fd = -1;
	}
	return e;
}

static void
cuda_close(struct region *r)
{
	if (r->priv != NULL)
		gmap_unref(r->priv);
	__atomic_store_n(&r->priv, NULL, __ATOMIC_RELEASE);
}

const struct mem_ops mem_cuda_ipc_ops = {
	.name = "cuda-ipc", .open = cuda_open, .close = cuda_close, .try_open = cuda_try_open,
};
const struct mem_ops mem_cuda_pool_ops = {
	.name = "cuda-pool", .open = cuda_open, .close = cuda_close, .try_open = cuda_try_open,
};

/* Host regions are pinned for DMA when a GPU is present; failure only costs speed. */
void
gpu_host_register(struct region *r)
{
	if (cuda_use(0) == 0 && cuda_host_register(r->map, r->map_len, r->read_only) == 0)
		r->priv = r;          /* marks the mapping as pinned */
	else
		log_warnx("could not pin a %llu-byte host region (memlock limit?): host<->GPU copies "
		    "of it run from pageable memory", (unsigned long long)r->map_len);
}

void
gpu_host_unpin(void *map)
{
	cuda_use(0);
	cuda_host_unregister(map);
}

uint64_t
gpu_cache_stats(uint64_t *hits)
{
	uint64_t vhits, vopens = vmm_stats(&vhits);

	*hits = atomic_load(&gmap_hits) + vhits;
	return atomic_load(&gmap_opens) + vopens;
}

/* ---- the page arena: pinned page lists the kernel reads in place ---- */

#define ARENA_SIZE (16u << 20)        /* 2M pages in flight */
#define ARENA_GRAIN (64u << 10)
#define ARENA_GRAINS (ARENA_SIZE / ARENA_GRAIN)

static pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char *arena;                     /* NULL: none (no kernel) */
static uint16_t arena_len[ARENA_GRAINS];        /* at a list's first grain: its grains; 0: free */
static bool arena_used[ARENA_GRAINS];

static bool kernel_takes(int dev, const struct region *src, const struct region *dst, uint64_t avg);
static uint64_t addr_on(const struct region *r, int dev);

/* Where a page list of n records ends and the pairs' addresses begin, 16-byte aligned. */
static size_t
kpairs_at(uint32_t n)
{
	return ((size_t)n * sizeof(struct gpx_wire_page) + 15) & ~(size_t)15;
}

struct gpx_wire_page *
gpu_pages_alloc(const struct jpair *pairs, uint32_t npairs, uint64_t page_size, uint32_t n, int *devp)
{
	/*
	 * Between two GPUs the destination's kernel runs it, loading over the link and storing
	 * locally: on two H200 that pulls 65,536 scattered pages 1-2% faster than pushing them.
	 * Every pair of the job must be one that kernel runs.
	 */
	const int dev = pairs[0].dst->dev != DEV_HOST ? pairs[0].dst->dev : pairs[0].src->dev;
	const uint64_t bytes = kpairs_at(n) + (uint64_t)npairs * sizeof(struct gpu_kpair);
	const uint64_t need = (bytes + ARENA_GRAIN - 1) / ARENA_GRAIN;
	struct gpx_wire_page *p = NULL;

	if (arena == NULL || dev == DEV_HOST || dev >= ngpus || need > ARENA_GRAINS)
		return NULL;
	for (uint32_t k = 0; k < npairs; k++)
		if ((pairs[k].dst->dev != DEV_HOST ? pairs[k].dst->dev : pairs[k].src->dev) != dev ||
		    !kernel_takes(dev, pairs[k].src, pairs[k].dst, page_size))
			return NULL;
	pthread_mutex_lock(&arena_lock);
	for (uint32_t i = 0, run = 0; i < ARENA_GRAINS; i++) {
		run = arena_used[i] ? 0 : run + 1;
		if (run == need) {
			uint32_t first = i + 1 - (uint32_t)need;
			memset(&arena_used[first], 1, need);
			arena_len[first] = (uint16_t)need;
			p = (struct gpx_wire_page *)(arena + (size_t)first * ARENA_GRAIN);
			break;
		}
	}
	pthread_mutex_unlock(&arena_lock);
	if (p != NULL) {
		struct gpu_kpair *kp = (struct gpu_kpair *)((unsigned char *)p + kpairs_at(n));
		for (uint32_t k = 0; k < npairs; k++)
			kp[k] = (struct gpu_kpair){ addr_on(pairs[k].src, dev) + pairs[k].src_base,
			    addr_on(pairs[k].dst, dev) + pairs[k].dst_base };
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
	memset(&arena_used[first], 0, arena_len[first]);
	arena_len[first] = 0;
	pthread_mutex_unlock(&arena_lock);
}

/* ---- copy workers ---- */

/* The address of r in GPU dev's context, or 0 if r is not mapped there. */
static uint64_t
addr_on(const struct region *r, int dev)
{
	if (r->dev == DEV_HOST)
		return (uint64_t)(uintptr_t)r->host;
	if (r->kind == GPX__MEM_KIND__MEM_CUDA_IPC) {
		const struct gmap *m = r->priv;
		return m->base_on[dev] ? m->base_on[dev] + r->offset : 0;
	}
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
	return gpus[dev].kernel_ok && cfg->sm_copy && avg <= KERNEL_MAX_AVG && kernel_reach(src, dev) &&
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
	int r;

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
	r = cuda_htod(g->stream[s], g->kdev[slot], k, pieces * sizeof(*k));
	if (r == 0)
		r = cuda_kernel_copy(g->index, g->stream[s], g->kdev[slot], pieces, cfg->sm_copy_blocks);
	return r;
}

/*
 * Any other chunk, of one pair or of a batch's many: segments the kernel reaches and that are
 * small (all of them, when the chunk is mostly small ones) go to one launch of the copy
 * kernel, the rest each to a copy engine.  A weight push thus pays one launch for its hundred
 * norms and biases and one copy per large tensor.
 */
static int
issue_segs(struct gdev *g, struct chunk *c, int slot, int s)
{
	struct job *j = c->job;
	const uint32_t pieces = c->pieces ? c->pieces : 1;
	const bool all = pieces >= KERNEL_MIN_SEGS && c->bytes / pieces <= KERNEL_MAX_AVG;
	struct gpu_kseg *k = g->kstage[slot];
	uint32_t nk = 0, p = engine_pair_of(j, c->seg), cur = UINT32_MAX;
	uint64_t src = 0, dst = 0, left = c->bytes, off = c->off;
	bool peer = false, reach = false;
	int r = 0;

	for (uint32_t i = c->seg; left > 0 && r == 0; i++, off = 0) {
		const struct gpx_wire_seg *w = &j->segs[i];
		const uint64_t len = w->length - off < left ? w->length - off : left;
		while (i >= j->pairs[p].seg_end)
			p++;
		if (p != cur) {
			const struct jpair *jp = &j->pairs[p];
			cur = p;
			pair_addrs(jp, g->index, &src, &dst, &peer);
			reach = g->kernel_ok && cfg->sm_copy && kernel_reach(jp->src, g->index) &&
			    kernel_reach(jp->dst, g->index);
		}
		left -= len;
		if (len == 0)
			continue;
		if (reach && (all || len <= KERNEL_MAX_AVG))
			k[nk++] = (struct gpu_kseg){ src + w->src_offset + off, dst + w->dst_offset + off, len };
		else if (peer)
			r = cuda_copy_peer(g->stream[s], dst + w->dst_offset + off,
			    j->pairs[p].dst->dev == DEV_HOST ? g->index : j->pairs[p].dst->dev, src + w->src_offset + off,
			    j->pairs[p].src->dev == DEV_HOST ? g->index : j->pairs[p].src->dev, len);
		else
			r = cuda_copy(g->stream[s], dst + w->dst_offset + off, src + w->src_offset + off, len);
	}
	if (r == 0 && nk == 1 && !all)
		r = cuda_copy(g->stream[s], k[0].dst, k[0].src, k[0].len);     /* a launch buys nothing */
	else if (r == 0 && nk > 0) {
		r = cuda_htod(g->stream[s], g->kdev[slot], k, nk * sizeof(*k));
		if (r == 0)
			r = cuda_kernel_copy(g->index, g->stream[s], g->kdev[slot], nk, cfg->sm_copy_blocks);
	}
	return r;
}

static int
issue(struct gdev *g, struct chunk *c)
{
	struct job *j = c->job;
	const uint32_t pieces = c->pieces ? c->pieces : 1;
	int s = c->bytes <= QUICK_MAX ? S_QUICK : S_BULK;
	int slot = free_slot(g), r;

	if (atomic_exchange(&fault_sticky, false)) {
		log_warnx("GPU%d: injecting a sticky fault (GPXD_FAULT_INJECT=sticky)", g->index);
		cuda_kernel_copy(g->index, g->stream[s], 16, 1, 1);
	}
	if (j->pages != NULL)
		/* Only taken where the kernel runs (gpu_pages_alloc): the list is read in place. */
		r = cuda_kernel_pages(g->index, g->stream[s], j->pages, j->npages,
		    (const unsigned char *)j->pages + kpairs_at(j->npages), c->seg, pieces, j->page_size, c->off,
		    c->bytes, cfg->sm_copy_blocks);
	else if (j->npairs == 1 && pieces >= KERNEL_MIN_SEGS && kernel_takes(g->index, j->src, j->dst, c->bytes / pieces))
		r = issue_kernel(g, c, slot, s);
	else
		r = issue_segs(g, c, slot, s);
	if (r == 0)
		r = cuda_signal(g->stream[s], (uint64_t)(uintptr_t)&g->done[s], g->issued[s] + 1);
	if (r < 0) {
		/* Nothing queued for this chunk can be trusted: wait for the stream, then fail it. */
		cuda_stream_sync(g->stream[s]);
		engine_chunk_done(c, false);
		return r;
	}
	int at = (g->phead[s] + g->npend[s]) % PEND_MAX;
	g->pend[s][at] = (struct pend){ .c = *c, .seq = ++g->issued[s], .stream = s, .slot = slot };
	g->npend[s]++;
	g->slot_busy[slot] = true;
	return 0;
}

static int
reap(struct gdev *g)
{
	int n = 0;

	for (int s = 0; s < NSTREAMS; s++) {
		uint64_t done = __atomic_load_n(&g->done[s], __ATOMIC_ACQUIRE);
		while (g->npend[s] > 0 && g->pend[s][g->phead[s]].seq <= done) {
			struct pend *p = &g->pend[s][g->phead[s]];
			g->slot_busy[p->slot] = false;
			g->phead[s] = (g->phead[s] + 1) % PEND_MAX;
			g->npend[s]--;
			engine_chunk_done(&p->c, true);
			n++;
		}
	}
	return n;
}

static uint64_t
mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void *
gpu_worker(void *arg)
{
	struct gdev *g = arg;
	enum path_kind path = PATH_GPU0 + g->index;
	uint64_t idle_since = mono_ns(), stuck_since = 0;

	cuda_use(g->index);
	prctl(PR_SET_TIMERSLACK, 1000UL);   /* sleeps of 20 us must not become 70 */
	while (!gpu_quit) {
		int progress = reap(g);
		int pending = g->npend[S_BULK] + g->npend[S_QUICK];
		struct chunk c;
		/*
		 * How long an idle worker keeps looking for work before it blocks: as long as the
		 * event loop polls after a client's last message (daemon.busy_poll_us), so that a
		 * client that submits between its own GPU work, a millisecond apart say, never waits
		 * for this thread to be woken (on virtual machines 100 us and more).  Once nothing
		 * has come for that long both sleep, and an idle daemon costs no CPU.
		 */
		const uint64_t spin_ns = cfg->busy_poll_us * 1000ull > IDLE_SPIN_NS ? cfg->busy_poll_us * 1000ull :
		    IDLE_SPIN_NS;

		/*
		 * A completion counts as activity: a long job just ended, and its client's next
		 * request is likely on its way; blocking now (the last issue may be long past) would
		 * make it pay a wake-up.
		 */
		if (progress)
			idle_since = mono_ns();

		/*
		 * With the bulk stream full, small copies (of anyone) still go onto the quick
		 * stream, a few at a time: a 4 KiB copy never waits for a 1 GiB chunk, and no
		 * piece of a large copy is put in its way there.
		 */
		bool bulk_room;
		while (pending < PEND_MAX && ((bulk_room = g->npend[S_BULK] < PEND_MAX / 2) ||
		    g->npend[S_QUICK] < QUICK_SHARE) &&
		    (engine_has_work(path) || (pending == 0 && mono_ns() - idle_since > spin_ns))) {
			/* Block only when idle for a while: the spin keeps small-copy latency low. */
			bool wait = pending == 0 && !engine_has_work(path);
			if (!(bulk_room ? engine_next_chunk(path, &c, wait, BULK_CHUNK, KSEG_MAX) :
			    engine_next_small_chunk(path, &c, KSEG_MAX)))
				break;
			issue(g, &c);
			pending = g->npend[S_BULK] + g->npend[S_QUICK];
			progress++;
			idle_since = mono_ns();
		}
		if (progress) {
			stuck_since = 0;
			continue;
		}
		if (pending == 0) {
			xfer_help();       /* idle: lend this core to a long page list's check */
			sched_yield();
			continue;
		}
		/* Work is on the GPU: spin (a completion is seen within ~100 ns), and only after a
		 * few milliseconds without progress fall back to short sleeps. */
		uint64_t now = mono_ns();
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
	return NULL;
}

/* ---- setup ---- */

static int
gdev_start(struct gdev *g)
{
	void *words;

	if (cuda_use(g->index) < 0 || cuda_host_alloc(&words, 64 * NSTREAMS) < 0)
		return -1;
	memset(words, 0, 64 * NSTREAMS);
	g->done = words;
	for (int s = 0; s < NSTREAMS; s++)
		if (cuda_stream_new(&g->stream[s]) < 0)
			return -1;
	g->kernel_ok = cuda_load_kernel(g->index) == 0;
	for (int i = 0; g->kernel_ok && i < PEND_MAX; i++) {
		void *h;
		if (cuda_host_alloc(&h, KSEG_MAX * sizeof(struct gpu_kseg)) < 0 ||
		    cuda_alloc(&g->kdev[i], KSEG_MAX * sizeof(struct gpu_kseg)) < 0) {
			g->kernel_ok = false;
			break;
		}
		g->kstage[i] = h;
	}
	if (!g->kernel_ok)
		log_warnx("GPU%d: SM copy kernel unavailable; vectored copies use copy engines", g->index);
	return pthread_create(&g->thread, NULL, gpu_worker, g) == 0 ? 0 : -1;
}

int
gpu_init(char *why, size_t whylen)
{
	int n = cuda_load(why, whylen);
	const char *fault = getenv("GPXD_FAULT_INJECT");

	if (fault != NULL && strcmp(fault, "sticky") == 0)
		atomic_store(&fault_sticky, true);

	if (n <= 0) {
		snprintf(status_text, sizeof(status_text), "unavailable: %s", why);
		return -1;
	}
	for (int i = 0; i < n; i++) {
		gpus[i].index = i;
		if (cuda_device_info(i, &gpus[i].info) < 0) {
			snprintf(why, whylen, "cannot query GPU%d", i);
			snprintf(status_text, sizeof(status_text), "unavailable: %s", why);
			return -1;
		}
		gpus[i].access_mask = 1u << i;
	}
	for (int a = 0; a < n; a++)
		for (int b = 0; b < n; b++)
			if (a != b) {
				cuda_peer(a, b, &gpus[a].link[b]);
				if (gpus[a].link[b].access)
					gpus[b].access_mask |= 1u << a;   /* a's copies can reach b's memory */
			}
	ngpus = n;
	for (int i = 0; i < n; i++)
		if (gdev_start(&gpus[i]) < 0) {
			snprintf(why, whylen, "cannot start the copy worker of GPU%d", i);
			snprintf(status_text, sizeof(status_text), "unavailable: %s", why);
			ngpus = 0;
			return -1;
		}
	void *a;
	if (gpus[0].kernel_ok && cuda_host_alloc(&a, ARENA_SIZE) == 0)
		arena = a;
	int v = cuda_driver_version();
	snprintf(status_text, sizeof(status_text), "available: %d GPU%s, driver API %d.%d", n,
	    n == 1 ? "" : "s", v / 1000, v % 1000 / 10);
	for (int i = 0; i < n; i++) {
		char u[48];
		uuid_str(gpus[i].info.uuid, u, sizeof(u));
		log_info("GPU%d: %s %s pci %s, %d copy engines, %d SMs", i, gpus[i].info.name, u,
		    gpus[i].info.pci, gpus[i].info.copy_engines, gpus[i].info.sms);
	}
	return 0;
}

void
gpu_shutdown(void)
{
	gpu_quit = true;
	for (int i = 0; i < ngpus; i++) {
		pthread_join(gpus[i].thread, NULL);
		for (int s = 0; s < NSTREAMS; s++)
			cuda_stream_sync(gpus[i].stream[s]);
	}
}

/* ---- gpxctl topo ---- */

void
gpu_topo(Gpx__QueryReply *q)
{
	q->devices = calloc(ngpus + 1, sizeof(*q->devices));
	q->links = calloc(ngpus * ngpus + 1, sizeof(*q->links));
	for (int i = 0; i < ngpus; i++) {
		Gpx__DeviceInfo *d = malloc(sizeof(*d));
		char *u = malloc(48);
		gpx__device_info__init(d);
		uuid_str(gpus[i].info.uuid, u, 48);
		d->index = i;
		d->uuid = u;
		d->name = gpus[i].info.name;
		d->pci = gpus[i].info.pci;
		d->memory = gpus[i].info.memory;
		d->copy_engines = gpus[i].info.copy_engines;
		d->sms = gpus[i].info.sms;
		q->devices[q->n_devices++] = d;
		for (int j = 0; j < ngpus; j++) {
			if (i == j)
				continue;
			Gpx__PeerLink *l = malloc(sizeof(*l));
			gpx__peer_link__init(l);
			l->src = i;
			l->dst = j;
			l->access = gpus[i].link[j].access;
			l->rank = gpus[i].link[j].rank;
			l->atomics = gpus[i].link[j].atomics;
			l->path = (char *)(l->access ? "p2p" : "staged");
			q->links[q->n_links++] = l;
		}
	}
}

const char *
gpu_pci(int dev)
{
	return dev >= 0 && dev < ngpus ? gpus[dev].info.pci : NULL;
}

void
gpu_topo_free(Gpx__QueryReply *q)
{
	for (size_t i = 0; i < q->n_devices; i++) {
		free(q->devices[i]->uuid);
		free(q->devices[i]);
	}
	for (size_t i = 0; i < q->n_links; i++)
		free(q->links[i]);
	free(q->devices);
	free(q->links);
}
