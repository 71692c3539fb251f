/*
 * Memory kind `host`: a memfd passed with SCM_RIGHTS, mapped shared into the daemon.
 *
 * Only a memfd sealed against shrinking is accepted.  A file that its owner can truncate under a
 * live mapping turns the daemon's next access into SIGBUS; the seal makes that impossible, so no
 * copy ever needs a fault handler.  The fd's access mode decides whether the region is writable.
 * Pages are populated at registration (on a task thread) so that copies run without faults.
 * With a GPU present the mapping is also registered with the driver, for DMA at copy-engine
 * speed.
 *
 * The copy itself (mem_host_copy, for the host path's workers) is memmove, except for jobs
 * larger than the caches: a worker copies them one chunk (chunk_size, 2 MiB by default) at a
 * time, and glibc copies a 2 MiB piece with ordinary stores, paying a read-for-ownership of every
 * destination line, where its memcpy of the whole buffer would stream.  So those chunks are
 * copied with non-temporal stores, in one of two orders: four pages interleaved with software
 * prefetches, as glibc does for its own large copies, or line after line.  Which one is faster
 * depends on the CPU: on a 2-vCPU AMD EPYC virtual machine line after line moved 18-21 GB/s a
 * thread and the interleave 9.3-9.6, and host copies of 1 GiB went from 0.74x-0.78x to
 * 1.03x-1.05x of memcpy on two threads (tests/results/host-nt-order.txt).  gpxd times both on
 * the first chunks of large jobs and keeps the faster (nt_try); the log says which.
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
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "daemon/host/host.h"
#include "daemon/gpu/gpu.h"

#if defined(__x86_64__)
static inline void
nt_line(char *d, const char *s)
{
	__m128i a = _mm_loadu_si128((const __m128i *)s);
	__m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
	__m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
	__m128i e = _mm_loadu_si128((const __m128i *)(s + 48));

	_mm_stream_si128((__m128i *)d, a);
	_mm_stream_si128((__m128i *)(d + 16), b);
	_mm_stream_si128((__m128i *)(d + 32), c);
	_mm_stream_si128((__m128i *)(d + 48), e);
}

/* Non-temporal copy of n bytes (a multiple of 64) to a 64-byte aligned d, line after line. */
static void
nt_lines(char *d, const char *s, size_t n)
{
	for (; n >= 64; n -= 64, d += 64, s += 64)
		nt_line(d, s);
}

/* The same, four pages at a time. */
static void
nt_pages4(char *d, const char *s, size_t n)
{
	const size_t pg = 4096;

	/* Four source pages at a time, line by line across them: more DRAM pages in flight. */
	for (; n >= 4 * pg; n -= 4 * pg, d += 4 * pg, s += 4 * pg)
		for (size_t o = 0; o < pg; o += 128)
			for (size_t k = 0; k < 4; k++) {
				_mm_prefetch(s + k * pg + o + 256, _MM_HINT_T0);
				nt_line(d + k * pg + o, s + k * pg + o);
				nt_line(d + k * pg + o + 64, s + k * pg + o + 64);
			}
	nt_lines(d, s, n);
}

typedef void nt_fn(char *d, const char *s, size_t n);

static const struct {
	nt_fn *fn;
	const char *name;
} nt_ways[] = {
	{ nt_pages4, "four pages interleaved" },
	{ nt_lines, "line after line" },
};

/*
 * The order in use, once chosen: until then the first NT_TRIALS chunks of large jobs go to
 * the two orders in turn, each timed, and the one that moved its best chunk fastest (per byte:
 * a burst of other work spoils a chunk, not an order) is kept for good.
 */
#define NT_TRIALS 16
#define NT_TRIAL_MIN (1u << 20)       /* the least piece timed */
static _Atomic(nt_fn *) nt_copy;
static _Atomic uint32_t nt_tried;
static _Atomic uint64_t nt_best_ps[2] = { UINT64_MAX, UINT64_MAX };    /* picoseconds a byte */

void
mem_host_nt_way(int way)
{
	atomic_store(&nt_copy, way < 0 ? NULL : nt_ways[way].fn);
	if (way < 0) {
		atomic_store(&nt_tried, 0);
		atomic_store(&nt_best_ps[0], UINT64_MAX);
		atomic_store(&nt_best_ps[1], UINT64_MAX);
	}
}

const char *
mem_host_nt_order(void)
{
	nt_fn *f = atomic_load(&nt_copy);

	return f == nt_pages4 ? nt_ways[0].name : f == nt_lines ? nt_ways[1].name : NULL;
}

static void
nt_try(char *d, const char *s, size_t n, uint32_t trial)
{
	const int w = trial & 1;
	const double t0 = now_s();

	nt_ways[w].fn(d, s, n);
	_mm_sfence();
	uint64_t ps = (uint64_t)((now_s() - t0) * 1e12 / n), cur = atomic_load(&nt_best_ps[w]);
	while (ps < cur && !atomic_compare_exchange_weak(&nt_best_ps[w], &cur, ps))
		;
	if (trial == NT_TRIALS - 1) {
		const uint64_t b0 = atomic_load(&nt_best_ps[0]), b1 = atomic_load(&nt_best_ps[1]);
		const int k = b1 < b0;
		atomic_store(&nt_copy, nt_ways[k].fn);
		log_info("host copies of large jobs: non-temporal stores, %s (%.1f GB/s a thread here; %s %.1f)",
		    nt_ways[k].name, 1000.0 / (k ? b1 : b0), nt_ways[!k].name, 1000.0 / (k ? b0 : b1));
	}
}
#else
void
mem_host_nt_way(int way)
{
	(void)way;
}

const char *
mem_host_nt_order(void)
{
	return "none (memmove)";
}
#endif

/* Jobs of at least this many bytes do not fit the caches: half the L3, at least 4 MiB. */
static uint64_t
stream_min(void)
{
	static _Atomic uint64_t min;
	uint64_t m = atomic_load_explicit(&min, memory_order_relaxed);

	if (m == 0) {
		long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
		m = l3 > 0 ? (uint64_t)l3 / 2 : 32 << 20;
		if (m < 4 << 20)
			m = 4 << 20;
		atomic_store_explicit(&min, m, memory_order_relaxed);
	}
	return m;
}

void
mem_host_copy(void *dst, const void *src, size_t n, uint64_t job_bytes)
{
#if defined(__x86_64__)
	uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;

	if (n >= 4096 && job_bytes >= stream_min() && (d + n <= s || s + n <= d)) {
		size_t head = -d & 63, body = (n - head) & ~(size_t)63;
		memcpy(dst, src, head);
		nt_fn *f = atomic_load_explicit(&nt_copy, memory_order_relaxed);
		uint32_t trial;
		if (f != NULL)
			f((char *)dst + head, (const char *)src + head, body);
		else if (body >= NT_TRIAL_MIN && (trial = atomic_fetch_add(&nt_tried, 1)) < NT_TRIALS)
			nt_try((char *)dst + head, (const char *)src + head, body, trial);
		else    /* too short a piece to time, or the last trial is choosing */
			nt_pages4((char *)dst + head, (const char *)src + head, body);
		memcpy((char *)dst + head + body, (const char *)src + head + body, n - head - body);
		_mm_sfence();    /* the streamed stores are visible before the completion is */
		return;
	}
#endif
	memmove(dst, src, n);
}

static const char *
fd_type(mode_t m)
{
	if (S_ISSOCK(m)) return "a socket";
	if (S_ISFIFO(m)) return "a pipe";
	if (S_ISCHR(m)) return "a character device";
	if (S_ISBLK(m)) return "a block device";
	if (S_ISDIR(m)) return "a directory";
	return "not a regular file";
}

/* Cheap checks, run on the loop thread before anything is queued. */
bool
mem_host_fd_ok(int fd, char *err, size_t errlen)
{
	struct stat st;
	int seals;

	if (fstat(fd, &st) < 0) {
		snprintf(err, errlen, "fstat on the passed fd: %s", strerror(errno));
		return false;
	}
	if (!S_ISREG(st.st_mode)) {
		/* eventfds and other anonymous inodes are neither regular files nor memfds. */
		snprintf(err, errlen, "the passed fd is %s, not a memfd", fd_type(st.st_mode));
		return false;
	}
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0) {
		snprintf(err, errlen, "the passed fd is a file, not a memfd (no seals)");
		return false;
	}
	if (!(seals & F_SEAL_SHRINK)) {
		snprintf(err, errlen, "the memfd is not sealed with F_SEAL_SHRINK");
		return false;
	}
	return true;
}

static int
host_open(struct region *r, char *err, size_t errlen)
{
	struct stat st;
	long pg = sysconf(_SC_PAGESIZE);
	int prot = PROT_READ, acc;

	if (fstat(r->fd, &st) < 0) {
		snprintf(err, errlen, "fstat: %s", strerror(errno));
		return -GPX__STATUS__EBADFD;
	}
	if (r->length == 0 || r->offset > (uint64_t)st.st_size ||
	    r->length > (uint64_t)st.st_size - r->offset) {
		snprintf(err, errlen, "offset %llu + length %llu exceeds the memfd's %lld bytes",
		    (unsigned long long)r->offset, (unsigned long long)r->length, (long long)st.st_size);
		return -GPX__STATUS__ERANGE;
	}
	acc = fcntl(r->fd, F_GETFL) & O_ACCMODE;
	if (acc == O_RDWR && !(fcntl(r->fd, F_GET_SEALS) & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)))
		prot |= PROT_WRITE;
	else
		r->read_only = true;
	uint64_t start = r->offset & ~(uint64_t)(pg - 1);
	r->map_len = r->length + (r->offset - start);
	r->map = mmap(NULL, r->map_len, prot, MAP_SHARED | MAP_POPULATE, r->fd, start);
	if (r->map == MAP_FAILED) {
		r->map = NULL;
		snprintf(err, errlen, "mmap of %llu bytes: %s", (unsigned long long)r->map_len,
		    strerror(errno));
		return -GPX__STATUS__ENOMEM;
	}
	r->host = (char *)r->map + (r->offset - start);
	/* The mapping keeps the memfd: a region holds no descriptor of gpxd's, however many a client has. */
	close(r->fd);
	r->fd = -1;
	if (gpu_count() > 0)
		gpu_host_register(r);
	return 0;
}

/*
 * Unpinning is a driver call that can take milliseconds, and unmapping a populated mapping
 * takes about 0.25 ms per MiB: neither on the loop thread, nor on a copy worker.
 */
struct unpin {
	struct defer_task task;        /* queued through it (defer.c) */
	void *map;
	size_t len;
	int fd;
	bool pinned;
};

static void
unpin_work(void *arg)
{
	struct unpin *u = arg;

	if (u->pinned)
		gpu_host_unpin(u->map);
	munmap(u->map, u->len);
	if (u->fd >= 0)
		close(u->fd);
}

static void
host_close(struct region *r)
{
	struct unpin *u;

	if (r->map != NULL && (u = malloc(sizeof(*u))) != NULL) {
		*u = (struct unpin){ .map = r->map, .len = r->map_len, .fd = r->fd, .pinned = r->priv != NULL };
		defer_run(&u->task, unpin_work, free, u);
	} else {
		if (r->priv != NULL)
			gpu_host_unpin(r->map);
		if (r->map != NULL)
			munmap(r->map, r->map_len);
		if (r->fd >= 0)
			close(r->fd);
	}
	r->priv = NULL;
	r->map = NULL;
	r->host = NULL;
	r->fd = -1;
}

const struct mem_ops mem_host_ops = {
	.name = "host",
	.open = host_open,
	.close = host_close,
};
