/*
 * GPU memory on one side of a copy between nodes.
 *
 * GPUDirect first: over RDMA, rdma-mr.c registers GPU memory with the NIC itself
 * (a dma-buf from the driver with ibv_reg_dmabuf_mr, else the device pointer with ibv_reg_mr
 * through nvidia-peermem), and the NIC reads and writes the GPU with no copy.  Where neither
 * can be (the tcp transport, no RDMA device, a NIC that is not this GPU's, a driver or NIC
 * without either), the bytes are staged here: copied between the GPU and pinned host buffers
 * on a thread of this file (the copy waits on the GPU, the loop must not), and the fabric
 * moves the buffer as it moves host memory, by RDMA or in messages.  Every byte is counted by
 * the path it took (gpxctl peers, the metrics), and an export that peers may import is probed
 * at once: this file obtains the dma-buf of its GPU memory and checks it, so gpxctl exports
 * tells which path a peer's copies would take before any is made.
 *
 * Buffers: STAGE_BYTES of pinned memory cut into buffers of [fabric] chunk_size, allocated
 * at start when the node has a GPU, and known to rdma-mr.c as one host region (pool_r),
 * so that a staged chunk can still go by RDMA.  When every buffer is taken a chunk is staged
 * through the heap (the driver then copies pageable memory itself): slower, never stuck; up
 * to STAGE_HEAP_MAX bytes at once (two peers' full windows of the largest chunks), beyond
 * which a chunk fails (ENOMEM to a peer) rather than let requests grow the daemon without
 * bound.  A peer's chunks may be larger than ours: those are served through the heap.
 *
 * Threads: stage_get, stage_put, stage_copy and stage_probe run on the loop thread, and the
 * done functions are called there; the copies and the probes run on the stage thread, which
 * batches what is queued (one stream per GPU, one synchronisation per batch).
 */
#include "config.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <event2/event.h>

#include "daemon/fabric/internal.h"

#ifdef HAVE_CUDA

#include "daemon/gpu/gpu.h"

#define STAGE_BYTES (32u << 20)
#define STAGE_MAX 64                 /* buffers in the pool */
#define STAGE_HEAP_MAX (1ull << 30)
#define DMA_BUF_MAGIC 0x444d4142     /* statfs f_type of a dma-buf (linux/magic.h) */

enum sop_kind { SOP_TO_GPU, SOP_FROM_GPU, SOP_PROBE };

struct sop {
	STAILQ_ENTRY(sop) entry;
	enum sop_kind kind;
	int dev;
	uint64_t dptr, len;
	void *buf;
	stage_fn done;
	void *arg;
	bool ok;
	struct region *r;            /* SOP_PROBE: a reference, the result into r->gdr */
	char result[sizeof(((struct region *)0)->gdr)];
};
STAILQ_HEAD(sop_list, sop);

static struct {
	bool on;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct sop_list todo, done;
	bool quit;
	struct event *done_ev;
	void *streams[GPX_MAX_GPUS];      /* the stage thread's */
	char *pool;
	size_t slot, nslots;
	uint64_t free_mask;               /* loop thread */
	size_t heap_bytes;                /* loop thread */
	struct region pool_r;
	_Atomic uint64_t staged_bytes, staged_copies, heap_copies, direct_bytes;
} st = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.cond = PTHREAD_COND_INITIALIZER,
	.todo = STAILQ_HEAD_INITIALIZER(st.todo),
	.done = STAILQ_HEAD_INITIALIZER(st.done),
};

/* ---- buffers ---- */

void *
stage_get(size_t len)
{
	if (st.free_mask != 0 && len <= st.slot) {
		int i = __builtin_ctzll(st.free_mask);
		st.free_mask &= ~(1ull << i);
		return st.pool + (size_t)i * st.slot;
	}
	/* A heap buffer: its size in front of it, so that stage_put can count it back. */
	size_t *h;
	if (len > STAGE_HEAP_MAX - st.heap_bytes || (h = malloc(sizeof(size_t) * 2 + len)) == NULL)
		return NULL;
	atomic_fetch_add(&st.heap_copies, 1);
	st.heap_bytes += len;
	h[0] = len;
	return h + 2;
}

void
stage_put(void *buf)
{
	uint64_t off;

	if (buf == NULL)
		return;
	if (stage_pool(buf, &off) != NULL)
		st.free_mask |= 1ull << (off / st.slot);
	else {
		size_t *h = (size_t *)buf - 2;
		st.heap_bytes -= h[0];
		free(h);
	}
}

struct region *
stage_pool(const void *buf, uint64_t *off)
{
	const char *b = buf;

	if (st.pool == NULL || b < st.pool || b >= st.pool + st.slot * st.nslots)
		return NULL;
	*off = (uint64_t)(b - st.pool);
	return &st.pool_r;
}

/* ---- the stage thread ---- */

/*
 * What a peer's NIC would get for [dptr, dptr+len): the dma-buf the driver exports for it,
 * checked to be a dma-buf of the NVIDIA driver covering the whole range.
 */
static void
probe(struct sop *o)
{
	uint64_t off, want;
	char path[64], line[128], exp[64] = "?";
	unsigned long long size = 0;
	struct statfs sf;
	FILE *f;
	int fd = -1;
	const char *why = NULL;

	if (cuda_use(o->dev) < 0)
		why = "no context";
	else if ((fd = cuda_dmabuf(o->dptr, o->len, &off, &want)) < 0)
		why = cuda_errstr(-fd);
	if (why != NULL) {
		snprintf(o->result, sizeof(o->result), "staging: the driver gives no dma-buf for it (%s)", why);
		return;
	}
	snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", fd);
	if ((f = fopen(path, "re")) != NULL) {
		while (fgets(line, sizeof(line), f) != NULL)
			if (sscanf(line, "size: %llu", &size) != 1)
				sscanf(line, "exp_name: %63s", exp);
		fclose(f);
	}
	if (fstatfs(fd, &sf) < 0 || sf.f_type != DMA_BUF_MAGIC)
		snprintf(o->result, sizeof(o->result), "staging: the driver's handle is not a dma-buf");
	else if (size != want)
		snprintf(o->result, sizeof(o->result), "staging: the dma-buf holds %llu bytes, not %llu", size,
		    (unsigned long long)want);
	else {
		snprintf(o->result, sizeof(o->result), "dma-buf (%s, %llu bytes)", exp, size);
		o->ok = true;
	}
	close(fd);
}

static void
run_batch(struct sop_list *b)
{
	bool used[GPX_MAX_GPUS] = { false }, failed[GPX_MAX_GPUS] = { false };
	struct sop *o;

	STAILQ_FOREACH(o, b, entry) {
		void **s = &st.streams[o->dev];
		if (o->kind == SOP_PROBE) {
			probe(o);
			continue;
		}
		if (cuda_use(o->dev) < 0 || (*s == NULL && cuda_stream_new(s) < 0)) {
			failed[o->dev] = true;
			continue;
		}
		if (o->kind == SOP_TO_GPU ? cuda_copy(*s, o->dptr, (uintptr_t)o->buf, o->len) < 0 :
		    cuda_copy(*s, (uintptr_t)o->buf, o->dptr, o->len) < 0)
			failed[o->dev] = true;
		used[o->dev] = true;
	}
	for (int d = 0; d < GPX_MAX_GPUS; d++)
		if (used[d] && (cuda_use(d) < 0 || cuda_stream_sync(st.streams[d]) < 0))
			failed[d] = true;
	STAILQ_FOREACH(o, b, entry) {
		if (o->kind == SOP_PROBE)
			continue;
		o->ok = !failed[o->dev];
		if (!o->ok)
			log_warnx("fabric: staging %llu bytes %s GPU %d failed", (unsigned long long)o->len,
			    o->kind == SOP_TO_GPU ? "to" : "from", o->dev);
		else {
			atomic_fetch_add(&st.staged_bytes, o->len);
			atomic_fetch_add(&st.staged_copies, 1);
		}
	}
}

static void *
stage_main(void *unused)
{
	(void)unused;
	thread_name("stage");
	pthread_mutex_lock(&st.lock);
	for (;;) {
		struct sop_list b = STAILQ_HEAD_INITIALIZER(b);
		while (STAILQ_EMPTY(&st.todo) && !st.quit)
			pthread_cond_wait(&st.cond, &st.lock);
		if (STAILQ_EMPTY(&st.todo))
			break;
		STAILQ_CONCAT(&b, &st.todo);
		pthread_mutex_unlock(&st.lock);
		run_batch(&b);
		pthread_mutex_lock(&st.lock);
		STAILQ_CONCAT(&st.done, &b);
		event_active(st.done_ev, EV_READ, 0);
	}
	pthread_mutex_unlock(&st.lock);
	return NULL;
}

static void
finish(struct sop *o)
{
	if (o->kind == SOP_PROBE) {
		snprintf(o->r->gdr, sizeof(o->r->gdr), "%s", o->result);
		region_unref(o->r);
	} else
		o->done(o->arg, o->ok);
	free(o);
}

/* Loop thread: the done functions of what the stage thread finished. */
static void
on_done(evutil_socket_t fd, short what, void *arg)
{
	struct sop_list l = STAILQ_HEAD_INITIALIZER(l);
	struct sop *o;

	(void)fd;
	(void)what;
	(void)arg;
	pthread_mutex_lock(&st.lock);
	STAILQ_CONCAT(&l, &st.done);
	pthread_mutex_unlock(&st.lock);
	while ((o = STAILQ_FIRST(&l)) != NULL) {
		STAILQ_REMOVE_HEAD(&l, entry);
		finish(o);
	}
}

static void
queue(struct sop *o)
{
	pthread_mutex_lock(&st.lock);
	STAILQ_INSERT_TAIL(&st.todo, o, entry);
	pthread_cond_signal(&st.cond);
	pthread_mutex_unlock(&st.lock);
}

void
stage_copy(bool to_gpu, int dev, uint64_t dptr, void *buf, uint64_t len, stage_fn done, void *arg)
{
	struct sop *o = calloc(1, sizeof(*o));

	if (o == NULL || !st.on) {
		free(o);
		done(arg, false);
		return;
	}
	o->kind = to_gpu ? SOP_TO_GPU : SOP_FROM_GPU;
	o->dev = dev;
	o->dptr = dptr;
	o->len = len;
	o->buf = buf;
	o->done = done;
	o->arg = arg;
	queue(o);
}

void
stage_probe(struct region *r)
{
	struct sop *o;

	if (r->host != NULL || r->dev < 0)
		return;
	if (!st.on || (o = calloc(1, sizeof(*o))) == NULL) {
		snprintf(r->gdr, sizeof(r->gdr), "staging: GPU memory cannot be probed now");
		return;
	}
	snprintf(r->gdr, sizeof(r->gdr), "probing");
	region_ref(r);
	o->kind = SOP_PROBE;
	o->r = r;
	o->dev = r->dev;
	o->dptr = r->dptr;
	o->len = r->length;
	queue(o);
}

void
stage_count_direct(uint64_t bytes)
{
	atomic_fetch_add(&st.direct_bytes, bytes);
}

void
stage_stats(struct fabric_gpu_stats *s)
{
	s->staged_bytes = atomic_load(&st.staged_bytes);
	s->staged_copies = atomic_load(&st.staged_copies);
	s->heap_copies = atomic_load(&st.heap_copies);
	s->direct_bytes = atomic_load(&st.direct_bytes);
	s->pool_bytes = st.slot * st.nslots;
}

/* ---- start and stop ---- */

int
stage_init(struct event_base *b)
{
	if (gpu_count() == 0)
		return 0;
	st.slot = cfg->fabric_chunk;
	st.nslots = STAGE_BYTES / st.slot;
	if (st.nslots > STAGE_MAX)
		st.nslots = STAGE_MAX;
	if (st.nslots < 2)
		st.nslots = 2;
	if (cuda_use(0) < 0 || cuda_host_alloc((void **)&st.pool, st.slot * st.nslots) < 0) {
		log_warnx("fabric: no pinned staging buffers; GPU memory is staged through the heap");
		st.pool = NULL;
		st.nslots = 0;
	}
	st.free_mask = st.nslots == 64 ? ~0ull : (1ull << st.nslots) - 1;
	region_init(&st.pool_r);
	st.pool_r.ops = &mem_host_ops;
	st.pool_r.kind = GPX__MEM_KIND__MEM_HOST;
	st.pool_r.host = st.pool;
	st.pool_r.length = st.slot * st.nslots;
	if ((st.done_ev = event_new(b, -1, 0, on_done, NULL)) == NULL ||
	    pthread_create(&st.thread, NULL, stage_main, NULL) != 0) {
		log_warnx("fabric: cannot start the staging thread");
		return -1;
	}
	st.on = true;
	return 0;
}

/* After the queue pairs are gone: what is queued runs, its done functions see the fabric stopped. */
void
stage_shutdown(void)
{
	if (!st.on)
		return;
	pthread_mutex_lock(&st.lock);
	st.quit = true;
	pthread_cond_broadcast(&st.cond);
	pthread_mutex_unlock(&st.lock);
	pthread_join(st.thread, NULL);
	st.on = false;
	on_done(-1, 0, NULL);
	for (int d = 0; d < GPX_MAX_GPUS; d++)
		if (st.streams[d] != NULL) {
			cuda_use(d);
			cuda_stream_free(st.streams[d]);
			st.streams[d] = NULL;
		}
	event_free(st.done_ev);
	st.done_ev = NULL;
	if (st.pool != NULL) {
		fabric_rdma_region_gone(&st.pool_r);
		cuda_host_free(st.pool);
		st.pool = NULL;
	}
}

#else /* !HAVE_CUDA: no GPU memory, nothing to stage */

int stage_init(struct event_base *b) { (void)b; return 0; }
void stage_shutdown(void) {}
void *stage_get(size_t len) { return malloc(len ? len : 1); }
void stage_put(void *buf) { free(buf); }
struct region *stage_pool(const void *buf, uint64_t *off) { (void)buf; (void)off; return NULL; }
void stage_copy(bool to_gpu, int dev, uint64_t dptr, void *buf, uint64_t len, stage_fn done, void *arg)
{ (void)to_gpu; (void)dev; (void)dptr; (void)buf; (void)len; done(arg, false); }
void stage_probe(struct region *r) { (void)r; }
void stage_count_direct(uint64_t bytes) { (void)bytes; }
void stage_stats(struct fabric_gpu_stats *s) { (void)s; }

#endif
