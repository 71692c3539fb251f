/*
 * The node-wide cache of opened GPU mappings, for two CUDA memory kinds: cuda-ipc (legacy
 * IPC handles of cudaMalloc memory) and cuda-pool (allocations of exportable stream-ordered
 * pools); cuda-vmm has its own, vmm.c.  Opening a CUDA IPC handle costs ~120 us and a pool
 * import about as much, so each opened allocation is kept once per node, keyed by device and
 * allocation identity (the IPC handle's bytes; for pool memory what the owning connection
 * says names it, see region_key), never by address, which is reused after a free.  Regions
 * hold references; the last one to go closes the mapping on a task thread.  A registration
 * that hits the cache is answered from the loop without a driver call.  An IPC allocation is
 * opened again in every peer GPU's context, for the copy workers there (gpu-copy.c).
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "daemon/gpxd.h"
#include "daemon/gpu/internal.h"

#define GMAP_KEY 64     /* an IPC handle; or connection, buffer id and size */

struct gmap {
	struct defer_task task;        /* queued through it (defer.c) */
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
	uint64_t base_on[];     /* gpu_count() of them */
};

static void
gmap_close_peers(struct gmap *m)
{
	for (int d = 0; d < gpu_count(); d++)
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
	for (int d = 0; d < gpu_count(); d++) {
		if (d == m->dev || !gpu_peer_access(d, m->dev) || cuda_ipc_open(d, handle, &m->base_on[d]) < 0)
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
		defer_run(&m->task, gmap_close_work, free, m);
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
	int dev = gpu_dev_by_uuid(r->uuid);

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
	int dev = gpu_dev_by_uuid(r->uuid), e;

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
	if ((m = calloc(1, sizeof(*m) + gpu_count() * sizeof(m->base_on[0]))) == NULL) {
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
		if ((e = cuda_pool_import(dev, r->fd, r->handle, gpu_access_mask(dev), &m->base, &m->handle)) < 0)
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

/*
 * What this cache and vmm.c's hold, their driver opens, and the registrations served from what
 * was held.  Loop thread (gpxctl status).
 */
void
gpu_cache_stats(struct gpu_cache *s)
{
	const struct gmap *m;
	uint64_t vhits;

	memset(s, 0, sizeof(*s));
	pthread_mutex_lock(&gmap_lock);
	TAILQ_FOREACH(m, &gmaps, entry) {
		if (m->kind == GPX__MEM_KIND__MEM_CUDA_IPC)
			s->ipc++;
		else
			s->pool++;
	}
	pthread_mutex_unlock(&gmap_lock);
	s->opens = atomic_load(&gmap_opens) + vmm_stats(&vhits, &s->vmm);
	s->hits = atomic_load(&gmap_hits) + vhits;
}

/* Where an IPC region lies in GPU dev's context, or 0 where it could not be opened there. */
uint64_t
gpu_map_addr_on(const struct region *r, int dev)
{
	const struct gmap *g = r->priv;

	return g->base_on[dev] ? g->base_on[dev] + r->offset : 0;
}
