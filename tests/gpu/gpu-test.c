/*
 * GPU tests against a real gpxd: every memory kind (host memfd, cuda-ipc from cuMemAlloc,
 * cuda-vmm from cuMemCreate with POSIX-fd handles) on every device, copied over every path
 * (same GPU, GPU to GPU, host to GPU and back, host to host) with random sizes, offsets and
 * data, verified byte for byte together with guard bytes around each destination range.  Then
 * vectored copies of scattered pages (the SM kernel path), an interior pointer of a larger
 * allocation (as PyTorch's caching allocator hands out), the refusal of legacy handles on a
 * multi-tenant node, two client processes where one copies into the other's exported buffer,
 * a client that dies mid-copy and an owner that frees its buffer mid-copy, and the latency of
 * one client's 4 KiB copies while another (of another uid when run as root) keeps a GPU's copy
 * worker full of 1 GiB copies, host to GPU and within the GPU.  Stream-ordered
 * pool memory (cuda-pool) has a daemon of its own, whose log counts the mappings it opens.
 *
 * Run by tests/gpu.test, which skips (77) on a machine without a GPU.  Child roles re-execute
 * this program, because a process that initialised CUDA must not fork.
 *
 * This file holds what the parts share (the buffers of every kind, a random copy checked with
 * guard bytes, a Register sent by hand) and runs the parts in order; the parts live in
 * gpu-test-*.c by area (tests/gpu/gpu-test.h names them).
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/gpu/gpu-test.h"
#include "tests/tap.h"
#include "tests/gpu/gpu-util.h"

#define GUARD 64

CUcontext ctx[GPU_MAX];
struct harness *the_harness;
int ndev;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

uint64_t
rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

void
rnd_fill(unsigned char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)rnd();
}

void
buf_write(struct buf *b, size_t off, const void *src, size_t n)
{
	if (b->dev < 0)
		memcpy(b->host + off, src, n);
	else {
		CK(cuCtxSetCurrent(ctx[b->dev]));
		CK(cuMemcpyHtoD(b->d + off, src, n));
	}
}

void
buf_read(struct buf *b, size_t off, void *dst, size_t n)
{
	if (b->dev < 0)
		memcpy(dst, b->host + off, n);
	else {
		CK(cuCtxSetCurrent(ctx[b->dev]));
		CK(cuMemcpyDtoH(dst, b->d + off, n));
	}
}

void
buf_init(struct buf *b, const char *name, int dev, int vmm, gpx_conn *c)
{
	int r;

	memset(b, 0, sizeof(*b));
	b->name = name;
	b->dev = dev;
	b->vmm = vmm;
	b->fd = -1;
	b->mirror = malloc(BUF);
	rnd_fill(b->mirror, BUF);
	if (dev < 0) {
		if (gpx_host_alloc(BUF, &b->fd, (void **)&b->host) < 0)
			tap_bail("gpx_host_alloc");
	} else {
		CK(cuCtxSetCurrent(ctx[dev]));
		if (vmm)
			vmm_alloc(dev, BUF, &b->d, &b->h, &b->alloc);
		else
			CK(cuMemAlloc(&b->d, BUF));
	}
	buf_write(b, 0, b->mirror, BUF);
	if (dev < 0)
		r = gpx_register_host(c, b->fd, 0, BUF, 0, &b->region);
	else
		r = gpx_register_cuda(c, (void *)b->d, BUF, 0, &b->region);
	if (!ok(r == 0, "register %s", name)) {
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
		if (the_harness != NULL)
			harness_dump_log(the_harness);
	}
}

/* One random copy a -> b through the daemon, checked with guard bytes on both sides. */
bool
random_copy(gpx_conn *c, struct buf *a, struct buf *b)
{
	size_t len = 1 + rnd() % (rnd() % 4 == 0 ? BUF / 2 : 65536);
	size_t so = rnd() % (BUF - len + 1), d0 = GUARD + rnd() % (BUF - len - 2 * GUARD + 1);
	static unsigned char got[BUF / 2 + 2 * GUARD];
	int r;

	if (a == b && (so < d0 + len && d0 < so + len))
		return true;   /* overlapping ranges of one buffer are undefined */
	r = gpx_copy_sync(c, a->region, so, b->region, d0, len);
	if (r != 0) {
		diag("copy %s -> %s of %zu: %s (%s)", a->name, b->name, len, gpx_strerror(r), gpx_last_error(c));
		return false;
	}
	memmove(b->mirror + d0, a->mirror + so, len);
	buf_read(b, d0 - GUARD, got, len + 2 * GUARD);
	if (memcmp(got, b->mirror + d0 - GUARD, len + 2 * GUARD) != 0) {
		diag("copy %s -> %s of %zu at %zu -> %zu: bytes differ", a->name, b->name, len, so, d0);
		return false;
	}
	return true;
}

void
init_cuda(void)
{
	ndev = gpu_contexts(ctx);
}

/* Regions the test's daemon holds (over a connection of its own), or -1. */
int
regions_now(void)
{
	struct harness_status st;

	return harness_status(the_harness, &st) == 0 ? st.regions : -1;
}

/* Sends a Register (and fd, if >= 0); returns the reply's status (-1: none). */
int
raw_send_register(int sock, Gpx__Register *reg, int fd)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	int st = -1;

	m.seq = 7;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = reg;
	if (harness_send(sock, &m, fd >= 0 ? &fd : NULL, fd >= 0) < 0)
		return -1;
	Gpx__DaemonMsg *r = harness_recv(sock, 10000, NULL, NULL, NULL);
	if (r != NULL) {
		st = r->reply->status;
		gpx__daemon_msg__free_unpacked(r, NULL);
	}
	return st;
}

/* Lines of a daemon's log that contain `what`. */
int
log_count(const struct harness *h, const char *what)
{
	FILE *f = fopen(h->log, "re");
	char line[512];
	int n = 0;

	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		n += strstr(line, what) != NULL;
	if (f != NULL)
		fclose(f);
	return n;
}

/* Whether GPU0 is shared through MPS (its clients share one fate). */
static bool
gpu_mps(void)
{
	CUdevice d;
	int mps = 0;

	CK(cuDeviceGet(&d, 0));
	CK(cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, d));
	return mps != 0;
}

int
main(int argc, char **argv)
{
	struct harness h;
	gpx_conn *c;
	struct buf bufs[8];
	int nb = 0;

	if (argc >= 4 && strcmp(argv[1], "owner") == 0)
		return child_owner(argv[2], argv[3], atoi(argv[4]));
	if (argc >= 4 && strcmp(argv[1], "victim") == 0)
		return child_victim(argv[2], atoi(argv[3]));
	if (argc >= 5 && strcmp(argv[1], "freer") == 0)
		return child_freer(argv[2], argv[3], atoi(argv[4]));
	if (argc >= 3 && strcmp(argv[1], "arena") == 0)
		return child_arena(argv[2]);
	if (argc >= 5 && strcmp(argv[1], "hog") == 0)
		return child_hog(argv[2], atoi(argv[3]), argv[4], argc >= 6 && strcmp(argv[5], "mps") == 0);

	/* busy_poll_us: as on machines of 8 CPUs or more, also on smaller ones (test_loop_early_wake) */
	if (harness_start(&h, "[daemon]\nmetrics = 127.0.0.1:0\nbusy_poll_us = 5000\n[cuda]\ntrust_legacy_ipc = yes\n") < 0)
		tap_bail("cannot start gpxd");
	the_harness = &h;
	init_cuda();
	diag("%d GPU(s)", ndev);
	if (gpx_connect(h.sock, "gpu-test", &c) < 0)
		tap_bail("cannot connect");

	buf_init(&bufs[nb++], "host", -1, 0, c);
	static const char *names[] = { "gpu0-ipc", "gpu0-vmm", "gpu1-ipc", "gpu1-vmm" };
	for (int d = 0; d < ndev && d < 2; d++) {
		buf_init(&bufs[nb++], names[2 * d], d, 0, c);
		buf_init(&bufs[nb++], names[2 * d + 1], d, 1, c);
	}
	test_matrix(c, bufs, nb);
	test_vectored(c, &bufs[1], &bufs[2], 4096, 4096, false);
	test_vectored(c, &bufs[1], &bufs[2], 16384, 1000, true);
	test_vectored(c, &bufs[0], &bufs[1], 4096, 2048, false);
	test_vectored(c, &bufs[1], &bufs[0], 4096, 2048, false);
	if (ndev > 1) {
		test_vectored(c, &bufs[1], &bufs[4], 4096, 4096, false);
		test_vectored(c, &bufs[3], &bufs[2], 65536, 200, true);
		test_vectored(c, &bufs[1], &bufs[3], 4096, 4096, false);   /* ipc -> peer's ipc */
		test_vectored(c, &bufs[4], &bufs[1], 4096, 1024, true);
		test_link_split(c, &bufs[2], &bufs[4]);
	}
	test_pages(c, &bufs[2], &bufs[1], 4096, 4096, 0, 0);
	test_pages(c, &bufs[1], &bufs[2], 1000, 8000, 13, 5);          /* unaligned steps */
	test_pages(c, &bufs[0], &bufs[1], 16384, 1000, 4096, 0);       /* pinned host -> GPU */
	test_pages(c, &bufs[1], &bufs[0], 4096, 2048, 0, 64);          /* GPU -> pinned host */
	test_pages(c, &bufs[1], &bufs[2], 1 << 20, 8, 0, 0);           /* copy engines */
	if (ndev > 1) {
		test_pages(c, &bufs[2], &bufs[4], 4096, 4096, 0, 0);
		test_pages(c, &bufs[1], &bufs[3], 4096, 4000, 0, 4096);     /* ipc -> peer's ipc */
		test_pages(c, &bufs[4], &bufs[1], 1000, 4000, 3, 0);
	}
	test_pages_big(c);
	test_pages_table(c, &bufs[1], &bufs[2], 0, 4096, 4096);
	if (ndev > 1) {
		test_pages_table(c, &bufs[1], &bufs[4], 0, 4096, 4096);   /* GPU1's kernel reads GPU0's table */
		test_pages_table(c, &bufs[3], &bufs[2], 1, 16384, 1000);
	}
	test_interior(c, &bufs[0]);
	test_small_batched(c, &bufs[1], &bufs[2], 4096, 64);
	test_small_batched(c, &bufs[1], &bufs[2], (128u << 10) + 3, 32);
	if (ndev > 1) {
		test_small_batched(c, &bufs[1], &bufs[4], 4096, 64);
		test_small_batched(c, &bufs[1], &bufs[4], (128u << 10) + 3, 32);
	}
	test_done_after_bytes(c, &bufs[1], &bufs[0]);
	if (gpu_mps())
		test_done_after_bytes_waves();
	test_loop_early_wake(c);
	test_wake_after_spin(h.sock, c);
	test_prewake(c, &bufs[1], &bufs[2]);
	test_cached_registration(c, &bufs[1]);
	test_cache_shared(h.sock, &bufs[1], &bufs[2]);
	/* The other processes are this program again, however it was started (PATH or not). */
	const char *self = "/proc/self/exe";
	test_two_processes(self, h.sock, c, ndev > 1 ? 1 : 0);
	test_client_dies(self, h.sock, c, &bufs[1], &bufs[2], 0);
	test_owner_frees(self, h.sock, c, &bufs[2], 0);
	test_arena_share(self, h.sock, c);
	test_small_under_load(self, h.sock, c, &bufs[1], &bufs[2], 0);
	test_matrix(c, bufs, nb > 3 ? 3 : nb);
	test_forged(&h);
	test_pool();
	test_multitenant();
	/*
	 * Under MPS every process on the GPU is a client of one MPS server, and a fatal fault in
	 * any of them (the sticky error injected into the second gpxd) ends the contexts of all:
	 * the main gpxd would die of it too.  There the sticky test runs after the main gpxd has
	 * stopped, and is the last thing this process asks of the GPU.
	 */
	bool mps = gpu_mps();
	if (!mps)
		test_sticky();

	gpx_close(c);
	harness_finish(&h);
	if (mps) {
		diag("GPU0 is shared through MPS: the sticky-error test runs after gpxd has stopped");
		test_sticky();
	}
	return tap_done();
}
