/*
 * The GPU tests of stream-ordered pool memory, cuda-pool (tests/gpu/gpu-test.c runs them), on
 * a daemon of its own whose log counts the mappings it opens and closes; and the requests of
 * that kind no library sends, refused on a connection of their own.
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/gpu/gpu-test.h"
#include "tests/tap.h"
#include "tests/gpu/gpu-util.h"

/* Waits up to timeout_ms for `want` such lines (closes run after the reply); the last count. */
static int
log_wait(const struct harness *h, const char *what, int want, int timeout_ms)
{
	int n;

	for (int t = 0; (n = log_count(h, what)) < want && t < timeout_ms; t += 10)
		usleep(10000);
	return n;
}

/* A driver call of the pool tests: on failure a failed check naming the CUDA error. */
static bool
cu_ok(CUresult r, const char *what)
{
	const char *n = "?";

	if (r == CUDA_SUCCESS)
		return true;
	cuGetErrorName(r, &n);
	ok(0, "%s: %s", what, n);
	return false;
}

static double
us_since(const struct timespec *t0)
{
	struct timespec t1;

	clock_gettime(CLOCK_MONOTONIC, &t1);
	return (t1.tv_sec - t0->tv_sec) * 1e6 + (t1.tv_nsec - t0->tv_nsec) / 1e3;
}

/* Device memory [d, d+n) equals want[0, n)? */
static bool
dev_equals(CUdeviceptr d, const unsigned char *want, size_t n)
{
	unsigned char *got = malloc(n);
	bool same;

	CK(cuMemcpyDtoH(got, d, n));
	same = memcmp(got, want, n) == 0;
	for (size_t i = 0; !same && i < n; i++)
		if (got[i] != want[i]) {
			diag("first difference at byte %zu: %#x, want %#x", i, got[i], want[i]);
			break;
		}
	free(got);
	return same;
}

/* Requests no library sends, on a connection of their own: refused, nothing left behind. */
static void
test_pool_forged(struct harness *h, CUmemoryPool pool, CUdeviceptr p, const uint8_t uuid[16])
{
	CUmemPoolPtrExportData x;
	uint8_t junk[64];
	int fds0 = harness_fds(h), efd = eventfd(0, EFD_CLOEXEC), ring = -1, pfd = -1, st;
	int sock = harness_connect(h);
	Gpx__Register reg = GPX__REGISTER__INIT;
	struct harness_status s0 = { 0 }, s1 = { 0 };

	harness_status(h, &s0);
	Gpx__DaemonMsg *w = harness_hello(sock, GPX_PROTO_VERSION, efd, &ring);
	if (w != NULL)
		gpx__daemon_msg__free_unpacked(w, NULL);
	CK(cuMemPoolExportPointer(&x, p));
	reg.kind = GPX__MEM_KIND__MEM_CUDA_POOL;
	reg.length = 4096;
	reg.alloc_size = 4096;
	reg.alloc_id = (uint64_t)(uintptr_t)pool;
	reg.device_uuid.data = (uint8_t *)uuid;
	reg.device_uuid.len = 16;
	reg.handle.data = x.reserved;
	reg.handle.len = 64;
	/* The other connection's allocation, named exactly, but without the fd. */
	reg.cached_only = 1;
	st = raw_send_register(sock, &reg, -1);
	ok(st == GPX__STATUS__ENOENT, "another connection naming the held allocation without the fd: "
	    "ENOENT, not the cached mapping (status %d)", st);
	reg.cached_only = 0;
	int mfd = memfd_create("not-a-pool", MFD_CLOEXEC);
	st = raw_send_register(sock, &reg, mfd);
	ok(st == GPX__STATUS__EBADFD, "a memfd as the pool's fd: EBADFD (status %d)", st);
	close(mfd);
	if (cu_ok(cuMemPoolExportToShareableHandle(&pfd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	    "cuMemPoolExportToShareableHandle")) {
		reg.handle.len = 32;
		st = raw_send_register(sock, &reg, pfd);
		ok(st == GPX__STATUS__EINVAL, "32 bytes of export data: EINVAL (status %d)", st);
		reg.handle.len = 64;
		rnd_fill(junk, sizeof(junk));
		reg.handle.data = junk;
		st = raw_send_register(sock, &reg, pfd);
		ok(st > 0, "the real pool fd with random export data: an error (status %d)", st);
		close(pfd);
	}
	close(sock);
	close(efd);
	if (ring >= 0)
		close(ring);
	int k = harness_wait_fds(h, fds0, 5000);
	ok(k == fds0, "gpxd's descriptors back to %d (%d)", fds0, k);
	ok(harness_status(h, &s1) == 0 && s1.regions == s0.regions, "no region left behind (%d, before %d)",
	    s1.regions, s0.regions);
}

/*
 * Stream-ordered pool memory, on a daemon of its own whose log counts the mappings the GPU
 * back end opens and closes.  An allocation of a pool created exportable as POSIX fds
 * registers as cuda-pool, whole and through an interior pointer; copies to and from it verify
 * byte for byte; registering it again is served from the cache; a second allocation of the
 * same pool is a mapping of its own; withdrawing the regions frees the daemon's imports, which
 * this process waits for before it frees the memory, as CUDA requires of an exporter; plain
 * cudaMallocAsync memory (the device's default pool) is refused with advice.
 */
void
test_pool(void)
{
	const size_t n = 4 << 20, off = (1 << 20) + 4096 * 3 + 256, len = 1 << 20;
	CUmemPoolProps props = {
		.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
		.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, 0 },
	};
	unsigned char *want = malloc(n), *want2 = malloc(len), *hp = NULL;
	CUmemoryPool pool = NULL;
	CUdeviceptr p = 0, p2 = 0, d = 0;
	CUstream s = NULL;
	CUdevice d0;
	CUuuid uuid;
	struct harness h;
	struct timespec t0;
	struct stat st;
	gpx_conn *c = NULL;
	gpx_region r = 0, ri = 0, r2 = 0, rp2 = 0, hr = 0;
	int supported = 0, types = 0, hfd = -1, pfd = -1, e;
	const char *opened = "opened cuda-pool mapping", *closed = "closed cuda-pool mapping";

	CK(cuDeviceGet(&d0, 0));
	CK(cuDeviceGetUuid(&uuid, d0));
	CK(cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, d0));
	if (supported)
		CK(cuDeviceGetAttribute(&types, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, d0));
	if (!supported || !(types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
		tap_skip(1, "GPU0 has no stream-ordered pools exportable as POSIX fds");
		goto out;
	}
	if (harness_start(&h, "[daemon]\nlog_level = debug gpu\n") < 0) {
		ok(0, "a daemon for the pool tests started");
		goto out;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	if (gpx_connect(h.sock, "gpu-test-pool", &c) < 0 || gpx_host_alloc(n, &hfd, (void **)&hp) < 0 ||
	    gpx_register_host(c, hfd, 0, n, 0, &hr) < 0) {
		ok(0, "connect and register a host buffer");
		goto stop;
	}
	CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
	if (!cu_ok(cuMemPoolCreate(&pool, &props), "cuMemPoolCreate with POSIX-fd handles") ||
	    !cu_ok(cuMemAllocFromPoolAsync(&p, n, pool, s), "cuMemAllocFromPoolAsync") ||
	    !cu_ok(cuMemAllocFromPoolAsync(&p2, len, pool, s), "cuMemAllocFromPoolAsync (second)"))
		goto stop;
	rnd_fill(want, n);
	rnd_fill(want2, len);
	CK(cuMemcpyHtoDAsync(p, want, n, s));
	CK(cuMemcpyHtoDAsync(p2, want2, len, s));
	/* The daemon may touch the memory only once its allocation has completed. */
	CK(cuStreamSynchronize(s));

	/* What gpxd checks a pool's fd against, seen from here. */
	if (cu_ok(cuMemPoolExportToShareableHandle(&pfd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	    "cuMemPoolExportToShareableHandle") && fstat(pfd, &st) == 0) {
		ok(S_ISCHR(st.st_mode) && major(st.st_rdev) == 195 && minor(st.st_rdev) == 255,
		    "a pool's POSIX fd is an open of /dev/nvidiactl, as gpxd requires (mode %o, device %u:%u)",
		    (unsigned)(st.st_mode & S_IFMT), major(st.st_rdev), minor(st.st_rdev));
		close(pfd);
	}

	e = gpx_register_cuda(c, (void *)p, n, 0, &r);
	if (!ok(e == 0, "register cudaMallocFromPoolAsync memory of an exportable pool")) {
		diag("%s: %s", gpx_strerror(e), gpx_last_error(c));
		harness_dump_log(&h);
		goto stop;
	}
	ok(log_count(&h, opened) == 1, "gpxd opened it as cuda-pool (%d such lines in its log)",
	    log_count(&h, opened));
	/* host -> pool, a window in the middle: the bytes around it must not move */
	rnd_fill(hp, len);
	e = gpx_copy_sync(c, hr, 0, r, 4096, len);
	memcpy(want + 4096, hp, len);
	ok(e == 0 && dev_equals(p, want, n), "host -> pool memory verified, neighbours untouched (%s)",
	    gpx_strerror(e));
	e = gpx_copy_sync(c, r, 0, hr, 0, n);
	ok(e == 0 && memcmp(hp, want, n) == 0, "pool memory -> host verified (%s)", gpx_strerror(e));

	e = gpx_register_cuda(c, (void *)(p + off), len, 0, &ri);
	if (!ok(e == 0, "register an interior pointer of pool memory"))
		diag("%s: %s", gpx_strerror(e), gpx_last_error(c));
	rnd_fill(hp, len);
	e = e ? e : gpx_copy_sync(c, hr, 0, ri, 0, len);
	memcpy(want + off, hp, len);
	ok(e == 0 && dev_equals(p, want, n), "a copy into the interior pointer lands at its offset (%s)",
	    gpx_strerror(e));
	e = e ? e : gpx_copy_sync(c, ri, 0, r, 0, len);
	memcpy(want, want + off, len);
	ok(e == 0 && dev_equals(p, want, n), "pool -> pool on GPU0 verified (%s)", gpx_strerror(e));

	clock_gettime(CLOCK_MONOTONIC, &t0);
	e = gpx_register_cuda(c, (void *)p, n, 0, &r2);
	double us = us_since(&t0);
	ok(e == 0 && r2 != r && log_count(&h, opened) == 1, "three registrations of one pool allocation "
	    "opened it once (%d open(s) in gpxd's log; the third took %.1f us)", log_count(&h, opened), us);

	e = gpx_register_cuda(c, (void *)p2, len, 0, &rp2);
	e = e ? e : gpx_copy_sync(c, rp2, 0, r, 0, len);
	memcpy(want, want2, len);
	ok(e == 0 && log_count(&h, opened) == 2 && dev_equals(p, want, n),
	    "a second allocation of the pool is a mapping of its own, copies from it verify (%s, %d opens)",
	    gpx_strerror(e), log_count(&h, opened));

	if (ndev > 1) {
		/* GPU1 reaches the pool only through the access gpxd granted on its import. */
		CUdeviceptr v;
		CUmemGenericAllocationHandle vh;
		size_t valloc;
		gpx_region rv = 0;
		unsigned char *vwant = malloc(n);
		struct gpx_seg segs[256];
		struct gpx_completion done;

		/*
		 * GPU1's VMM memory is accessible to GPU1 alone (vmm_piece): a copy into it runs in
		 * GPU1's context, and fails with CUDA_ERROR_INVALID_VALUE in GPU0's.
		 */
		CK(cuCtxSetCurrent(ctx[1]));
		vmm_alloc(1, n, &v, &vh, &valloc);
		rnd_fill(vwant, n);
		CK(cuMemcpyHtoD(v, vwant, n));
		e = gpx_register_cuda(c, (void *)v, n, 0, &rv);
		e = e ? e : gpx_copy_sync(c, r, 0, rv, 0, n);
		memcpy(vwant, want, n);
		ok(e == 0 && dev_equals(v, vwant, n), "pool memory on GPU0 -> GPU1 verified (%s)", gpx_strerror(e));
		for (int i = 0; i < 256; i++) {
			segs[i].src_offset = (uint64_t)i * 4096;
			segs[i].dst_offset = (uint64_t)(255 - i) * 4096;
			segs[i].length = 4096;
			memcpy(want + segs[i].dst_offset, vwant + segs[i].src_offset, 4096);
		}
		e = e ? e : gpx_copyv(c, rv, r, segs, 256, 4711);
		e = e ? e : gpx_wait_tag(c, 4711, &done, 30000);
		e = e ? e : done.status;
		CK(cuCtxSetCurrent(ctx[0]));
		ok(e == 0 && dev_equals(p, want, n), "256 pages GPU1 -> pool memory on GPU0 in one request "
		    "(GPU1's SM kernel writes the pool) verified (%s)", gpx_strerror(e));
		if (e != 0)
			harness_dump_log(&h);
		gpx_deregister(c, rv);
		CK(cuCtxSetCurrent(ctx[1]));
		cuMemUnmap(v, valloc);
		cuMemAddressFree(v, valloc);
		cuMemRelease(vh);
		CK(cuCtxSetCurrent(ctx[0]));
		free(vwant);
	}

	/* Another client imports the pool region by export and lets go: nothing of the driver's
	 * is held for it, so its gpx_deregister answers at once (the owner still holds the region). */
	{
		gpx_conn *ci = NULL;
		gpx_region rim = 0;
		uint64_t il = 0;
		e = gpx_export(c, r, "pool", NULL);
		e = e ? e : gpx_connect(h.sock, "gpu-test-pool-importer", &ci);
		e = e ? e : gpx_import(ci, "pool", &rim, &il);
		clock_gettime(CLOCK_MONOTONIC, &t0);
		e = e ? e : gpx_deregister(ci, rim);
		double dt = us_since(&t0) / 1e6;
		ok(e == 0 && il == n && dt < 1, "an importer's deregister of pool memory answers at once "
		    "(%s, %.3f s)", gpx_strerror(e), dt);
		gpx_close(ci);
		gpx_unexport(c, "pool");
	}

	/* CUDA wants the importer's free before the exporter's: the last gpx_deregister of an
	 * allocation returns once gpxd's is done. */
	int dr = gpx_deregister(c, r);
	dr = dr ? dr : gpx_deregister(c, ri);
	dr = dr ? dr : gpx_deregister(c, r2);
	dr = dr ? dr : gpx_deregister(c, rp2);
	r = ri = r2 = rp2 = 0;
	int k = log_wait(&h, closed, 2, 0);
	ok(dr == 0 && k == 2, "gpxd freed both imports before the last gpx_deregister of each returned "
	    "(%s; %d close(s) in its log)", gpx_strerror(dr), k);
	cu_ok(cuMemFreeAsync(p, s), "cuMemFreeAsync");
	cu_ok(cuMemFreeAsync(p2, s), "cuMemFreeAsync (second)");
	cu_ok(cuStreamSynchronize(s), "cuStreamSynchronize after the frees");
	p = p2 = 0;

	/* Plain cudaMallocAsync: the device's default pool, never exportable. */
	if (cu_ok(cuMemAllocAsync(&d, len, s), "cuMemAllocAsync from the default pool") &&
	    cu_ok(cuStreamSynchronize(s), "cuStreamSynchronize")) {
		gpx_region rd = 0;
		e = gpx_register_cuda(c, (void *)d, len, 0, &rd);
		ok(e == -GPX_ENOTSUP && strstr(gpx_last_error(c), "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR") != NULL,
		    "memory of the default pool refused, saying what to do (%s: %s)", gpx_strerror(e),
		    gpx_last_error(c));
		if (e == 0)
			gpx_deregister(c, rd);
		cuMemFreeAsync(d, s);
		cuStreamSynchronize(s);
	}

	/* A fresh allocation for the forged requests: the pool must hold something. */
	if (cu_ok(cuMemAllocFromPoolAsync(&p, len, pool, s), "cuMemAllocFromPoolAsync (third)") &&
	    cu_ok(cuStreamSynchronize(s), "cuStreamSynchronize")) {
		gpx_region rf = 0;
		if (ok(gpx_register_cuda(c, (void *)p, len, 0, &rf) == 0, "register a third allocation")) {
			test_pool_forged(&h, pool, p, (uint8_t *)uuid.bytes);
			gpx_deregister(c, rf);
			log_wait(&h, closed, 3, 5000);
		}
		cuMemFreeAsync(p, s);
		cuStreamSynchronize(s);
		p = 0;
	}
stop:
	if (c != NULL)
		gpx_close(c);
	if (s != NULL)
		cuStreamSynchronize(s);
	if (pool != NULL)
		cuMemPoolDestroy(pool);
	if (s != NULL)
		cuStreamDestroy(s);
	ok(harness_stop(&h) == 0, "the pool tests' gpxd stopped cleanly");
	harness_cleanup(&h);
	if (hp != NULL)
		gpx_host_free(hfd, hp, n);
out:
	free(want);
	free(want2);
}
