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
 * copied with non-temporal stores, four pages interleaved as glibc does for its own large copies.
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

/* Non-temporal copy of n bytes (a multiple of 64) to a 64-byte aligned d. */
static void
nt_copy(char *d, const char *s, size_t n)
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
	for (; n >= 64; n -= 64, d += 64, s += 64)
		nt_line(d, s);
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
		nt_copy((char *)dst + head, (const char *)src + head, body);
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
	if (gpu_count() > 0)
		gpu_host_register(r);
	return 0;
}

/*
 * Unpinning is a driver call that can take milliseconds, and unmapping a populated mapping
 * takes about 0.25 ms per MiB: neither on the loop thread, nor on a copy worker.
 */
struct unpin {
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
unpin_done(void *arg)
{
	free(arg);
}

static void
host_close(struct region *r)
{
	struct unpin *u;

	if (r->map != NULL && (u = malloc(sizeof(*u))) != NULL) {
		*u = (struct unpin){ .map = r->map, .len = r->map_len, .fd = r->fd, .pinned = r->priv != NULL };
		defer_run(unpin_work, unpin_done, u);
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
