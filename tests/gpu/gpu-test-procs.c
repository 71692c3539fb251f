/*
 * The GPU tests with other processes (tests/gpu/gpu-test.c runs them, and runs the child roles
 * when it is re-executed as one): a client that copies into another process's exported VMM
 * buffer and notifies it, a client killed mid-copy and what gpxd releases, an owner that
 * frees its buffer while a copy reads it, the latency of 4 KiB copies while another
 * client (of another uid when run as root) keeps a GPU's copy worker full of 1 GiB copies,
 * and the page kernel's arena shared by two uids.
 */
#include "config.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/gpu/gpu-test.h"
#include "tests/tap.h"
#include "tests/gpu/gpu-util.h"

/* Exports a VMM buffer filled with zeros, waits for a notification, checks the pattern. */
int
child_owner(const char *sock, const char *name, int dev)
{
	gpx_conn *c;
	struct buf b;
	struct gpx_export_opts o = { .rule = GPX_EXPORT_UID, .notify = 1, .notify_tag = 4242 };
	struct gpx_completion done;

	init_cuda();
	if (gpx_connect(sock, "owner", &c) < 0)
		return 10;
	buf_init(&b, "owner-vmm", dev, 1, c);
	if (gpx_export(c, b.region, name, &o) < 0)
		return 11;
	printf("READY\n");
	fflush(stdout);
	if (gpx_wait(c, &done, 1, 20000) != 1 || !(done.flags & GPX_COMP_NOTIFY) || done.tag != 4242)
		return 12;
	unsigned char *got = malloc(BUF);
	buf_read(&b, 0, got, BUF);
	for (size_t i = 0; i < BUF; i++)
		if (got[i] != (unsigned char)(i * 7 + 3))
			return 13;
	return 0;
}

/* Registers a buffer, queues a big copy and is killed by the parent mid-copy. */
int
child_victim(const char *sock, int dev)
{
	gpx_conn *c;
	CUdeviceptr a, b;
	gpx_region ra, rb;

	init_cuda();
	if (gpx_connect(sock, "victim", &c) < 0)
		return 10;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemAlloc(&a, 1ull << 30));
	CK(cuMemAlloc(&b, 1ull << 30));
	if (gpx_register_cuda(c, (void *)a, 1ull << 30, 0, &ra) < 0 ||
	    gpx_register_cuda(c, (void *)b, 1ull << 30, 0, &rb) < 0)
		return 11;
	for (int i = 0; i < 64; i++)
		gpx_copy(c, ra, 0, rb, 0, 1ull << 30, i);
	printf("READY\n");
	fflush(stdout);
	pause();
	return 0;
}

/*
 * Keeps 16 copies of up to 1 GiB in flight on GPU dev, from host memory ("h2d") or within the
 * GPU ("d2d"), until killed.  As root it runs as another uid first, except under MPS
 * (same_uid): the MPS control daemon runs one user's server at a time and holds a client of
 * another uid in cuInit until every client of the first has gone, so such a hog would wait
 * for the test itself to end.  Its buffers take at most a quarter of what the GPU says is free
 * (an MPS client may be limited to part of the GPU's memory).
 */
int
child_hog(const char *sock, int dev, const char *mode, bool same_uid)
{
	size_t len = 1ull << 30, free_b, total_b;
	struct gpx_completion d[16];
	gpx_conn *c;
	CUdeviceptr a = 0, b;
	gpx_region ra, rb;
	unsigned char *hp;
	int hfd;

	if (geteuid() == 0 && !same_uid && (setgid(1010) < 0 || setuid(1010) < 0))
		return 9;
	init_cuda();
	if (gpx_connect(sock, "hog", &c) < 0)
		return 10;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemGetInfo(&free_b, &total_b));
	if (free_b / 4 < len)
		len = free_b / 4 / (2u << 20) * (2u << 20);
	if (len < (64u << 20)) {
		printf("NOMEM %zu MiB free on GPU%d\n", free_b >> 20, dev);
		return 14;
	}
	CK(cuMemAlloc(&b, len));
	if (strcmp(mode, "h2d") == 0) {
		if (gpx_host_alloc(len, &hfd, (void **)&hp) < 0 || gpx_register_host(c, hfd, 0, len, 0, &ra) < 0)
			return 11;
	} else {
		CK(cuMemAlloc(&a, len));
		if (gpx_register_cuda(c, (void *)a, len, 0, &ra) < 0)
			return 11;
	}
	if (gpx_register_cuda(c, (void *)b, len, 0, &rb) < 0)
		return 12;
	uint64_t tag = 0;
	for (int i = 0; i < 16; i++)
		if (gpx_copy(c, ra, 0, rb, 0, len, tag++) < 0)
			return 13;
	printf("READY %s, %zu MiB each\n", geteuid() != 0 ? "other-uid" : same_uid ? "same-uid (MPS)" : "same-uid",
	    len >> 20);
	fflush(stdout);
	for (;;) {
		int n = gpx_wait(c, d, 16, 1000);
		for (int i = 0; i < n; i++)
			gpx_copy(c, ra, 0, rb, 0, len, tag++);
	}
	return 0;
}

static pid_t spawn(const char *self, char *const argv[], FILE **out, FILE **in);

#define CHILD_WAIT_MS 180000     /* for a child's line: it hangs rather than never answers */

/*
 * The next line a child prints, waited for at most ms; false at its end or on the timeout.
 * Its pipe is unbuffered (spawn), so poll sees every byte not yet read.
 */
static bool
line_within(FILE *f, char *line, size_t n, int ms)
{
	struct pollfd p = { .fd = fileno(f), .events = POLLIN };

	line[0] = '\0';
	if (poll(&p, 1, ms) != 1)
		return false;
	return fgets(line, (int)n, f) != NULL;
}

/* n 4 KiB copies a -> b one at a time, 2 ms apart: p50, p99 and max in microseconds. */
static bool
small_latency(gpx_conn *c, struct buf *a, struct buf *b, int n, double *p50, double *p99, double *max)
{
	double *t = calloc(n, sizeof(double));
	int done = 0;

	for (int i = 0; i < n; i++) {
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		int r = gpx_copy_sync(c, a->region, 4096 * (i % 16), b->region, 4096 * (i % 16), 4096);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		if (r == 0)
			t[done++] = (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3;
		usleep(2000);
	}
	qsort(t, done, sizeof(double), cmp_double);
	*p50 = done ? t[done / 2] : 1e9;
	*p99 = done ? t[done * 99 / 100] : 1e9;
	*max = done ? t[done - 1] : 1e9;
	free(t);
	if (done == n) {
		/* what the copies wrote is what the mirror says */
		memmove(b->mirror, a->mirror, 16 * 4096);
		unsigned char *got = malloc(16 * 4096);
		buf_read(b, 0, got, 16 * 4096);
		done = memcmp(got, b->mirror, 16 * 4096) == 0 ? n : -1;
		free(got);
	}
	return done == n;
}

/*
 * Another client keeps GPU dev's copy worker full: 16 copies of 1 GiB, up to its bulk
 * stream's depth.  This client's 4 KiB copies on the same GPU must not wait for a whole bulk
 * chunk (about 20 ms from host memory on PCIe 5): the worker takes its chunk onto the quick
 * stream behind at most QUICK_SHARE pieces of 1 MiB of the other's.
 */
void
test_small_under_load(const char *self, const char *sock, gpx_conn *c, struct buf *a, struct buf *b, int dev)
{
	static const char *modes[] = { "h2d", "d2d" };
	double p50, p99, max;
	char devs[8];

	snprintf(devs, sizeof(devs), "%d", dev);
	bool good = small_latency(c, a, b, 300, &p50, &p99, &max);
	diag("4 KiB %s -> %s alone: p50 %.1f us, p99 %.1f us, max %.1f us", a->name, b->name, p50, p99, max);
	int mps = 0;
	CUdevice cd;
	CK(cuDeviceGet(&cd, dev));
	CK(cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, cd));
	if (mps)
		diag("GPU%d is shared through MPS: the other client runs as this uid", dev);
	for (int m = 0; m < 2; m++) {
		char *argv[] = { (char *)self, "hog", (char *)sock, devs, (char *)modes[m], mps ? "mps" : NULL, NULL };
		char line[64] = "";
		FILE *out, *in;
		pid_t pid = spawn(self, argv, &out, &in);
		bool ready = pid > 0 && line_within(out, line, sizeof(line), CHILD_WAIT_MS) &&
		    strncmp(line, "READY", 5) == 0;
		line[strcspn(line, "\n")] = '\0';
		if (!ok(ready, "another client keeps 16 copies of up to 1 GiB %s on GPU%d in flight (%s)", modes[m],
		    dev, ready ? line + 6 : line[0] ? line : "it said nothing: exited, or silent for 180 s")) {
			if (pid > 0) {
				kill(pid, SIGKILL);
				waitpid(pid, NULL, 0);
				fclose(out);
				fclose(in);
			}
			continue;
		}
		usleep(300000);
		good = small_latency(c, a, b, 300, &p50, &p99, &max);
		ok(good, "meanwhile 300 copies of 4 KiB %s -> %s completed and verify", a->name, b->name);
		ok(p99 < 2000, "their p99 latency is under 2 ms: p50 %.1f us, p99 %.1f us, max %.1f us", p50, p99, max);
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		fclose(out);
		fclose(in);
	}
}

/* Exports a buffer; once told to, frees it while the parent copies out of it. */
int
child_freer(const char *sock, const char *name, int dev)
{
	gpx_conn *c;
	CUdeviceptr a;
	gpx_region ra;
	char line[16];

	init_cuda();
	if (gpx_connect(sock, "freer", &c) < 0)
		return 10;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemAlloc(&a, 1ull << 30));
	if (gpx_register_cuda(c, (void *)a, 1ull << 30, 0, &ra) < 0 || gpx_export(c, ra, name, NULL) < 0)
		return 11;
	printf("READY\n");
	fflush(stdout);
	if (fgets(line, sizeof(line), stdin) == NULL)
		return 12;
	CK(cuMemFree(a));
	printf("FREED\n");
	fflush(stdout);
	return 0;
}

static pid_t
spawn(const char *self, char *const argv[], FILE **out, FILE **in)
{
	int o[2], i[2];
	pid_t pid;

	if (pipe(o) < 0 || pipe(i) < 0)
		return -1;
	if ((pid = fork()) == 0) {
		dup2(o[1], 1);
		dup2(i[0], 0);
		execv(self, argv);
		_exit(127);
	}
	close(o[1]);
	close(i[0]);
	*out = fdopen(o[0], "r");
	*in = fdopen(i[1], "w");
	setvbuf(*out, NULL, _IONBF, 0);
	return pid;
}

static bool
wait_line(FILE *f, const char *want)
{
	char line[64];

	while (line_within(f, line, sizeof(line), CHILD_WAIT_MS))
		if (strncmp(line, want, strlen(want)) == 0)
			return true;
	return false;
}

void
test_two_processes(const char *self, const char *sock, gpx_conn *c, int dev)
{
	char devs[8];
	snprintf(devs, sizeof(devs), "%d", dev);
	char *argv[] = { (char *)self, "owner", (char *)sock, "gpu-test-shared", devs, NULL };
	FILE *out, *in;
	pid_t pid = spawn(self, argv, &out, &in);
	gpx_region r;
	uint64_t len = 0;
	int st = -1;

	if (!ok(pid > 0 && wait_line(out, "READY"), "owner process exported a VMM buffer on GPU%d", dev)) {
		kill(pid, SIGKILL);
		return;
	}
	int e = gpx_import(c, "gpu-test-shared", &r, &len);
	ok(e == 0 && len >= BUF, "import the other process's buffer");
	/* Our data: a host buffer with a pattern, copied into the owner's GPU memory. */
	int fd;
	unsigned char *p;
	gpx_region hr;
	gpx_host_alloc(BUF, &fd, (void **)&p);
	for (size_t i = 0; i < BUF; i++)
		p[i] = (unsigned char)(i * 7 + 3);
	gpx_register_host(c, fd, 0, BUF, 0, &hr);
	e = e ? e : gpx_copy_sync(c, hr, 0, r, 0, BUF);
	ok(e == 0, "copy into the other process's GPU buffer");
	waitpid(pid, &st, 0);
	ok(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the owner was notified and found the bytes (status %d)",
	    WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	gpx_deregister(c, r);
	gpx_deregister(c, hr);
	gpx_host_free(fd, p, BUF);
	fclose(out);
	fclose(in);
}

void
test_client_dies(const char *self, const char *sock, gpx_conn *c, struct buf *a, struct buf *b, int dev)
{
	char devs[8];
	snprintf(devs, sizeof(devs), "%d", dev);
	char *argv[] = { (char *)self, "victim", (char *)sock, devs, NULL };
	FILE *out, *in;
	int before = regions_now();
	size_t free0, free1, total;
	CK(cuCtxSetCurrent(ctx[dev]));
	CK(cuMemGetInfo(&free0, &total));
	pid_t pid = spawn(self, argv, &out, &in);
	struct timespec t0, t1;

	if (!ok(pid > 0 && wait_line(out, "READY"), "victim registered 2 GiB and queued 64 GiB of copies")) {
		kill(pid, SIGKILL);
		return;
	}
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int n;
	do {
		n = regions_now();
		clock_gettime(CLOCK_MONOTONIC, &t1);
	} while (n != before && (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000 < 3000);
	double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
	ok(n == before && ms < 1000, "its regions released %.0f ms after SIGKILL (%d regions, baseline %d)",
	    ms, n, before);
	/* The daemon's mappings kept the victim's 2 GiB alive; with them closed, it is free again. */
	for (int i = 0; i < 100; i++) {
		CK(cuMemGetInfo(&free1, &total));
		if (free1 + (64u << 20) >= free0)
			break;
		usleep(10000);
	}
	ok(free1 + (64u << 20) >= free0, "GPU%d memory back to its baseline (%zu MiB free before, %zu MiB after)",
	    dev, free0 >> 20, free1 >> 20);
	bool good = true;
	for (int k = 0; k < 4 && good; k++)
		good = random_copy(c, a, b);
	ok(good, "another client's copies still verify afterwards");
	fclose(out);
	fclose(in);
}

void
test_owner_frees(const char *self, const char *sock, gpx_conn *c, struct buf *dst, int dev)
{
	char devs[8];
	snprintf(devs, sizeof(devs), "%d", dev);
	char *argv[] = { (char *)self, "freer", (char *)sock, "gpu-test-freed", devs, NULL };
	FILE *out, *in;
	pid_t pid = spawn(self, argv, &out, &in);
	gpx_region r;
	uint64_t len;
	struct gpx_completion done[64];
	int st, got = 0, bad = 0;

	if (!ok(pid > 0 && wait_line(out, "READY"), "owner exported 1 GiB") || gpx_import(c, "gpu-test-freed", &r, &len) < 0) {
		kill(pid, SIGKILL);
		return;
	}
	for (int i = 0; i < 32; i++)
		gpx_copy(c, r, (uint64_t)i << 20, dst->region, 0, BUF, 1000 + i);
	fprintf(in, "free\n");
	fflush(in);
	ok(wait_line(out, "FREED"), "owner freed its buffer while copies from it run");
	while (got < 32) {
		int n = gpx_wait(c, done, 64, 10000);
		if (n <= 0)
			break;
		for (int i = 0; i < n; i++)
			if (done[i].status != 0 && done[i].status != -GPX_EREVOKED && done[i].status != -GPX_ECANCELED)
				bad++;
		got += n;
	}
	waitpid(pid, &st, 0);
	ok(got == 32 && bad == 0, "every copy ended with a defined status (%d of 32, %d bad)", got, bad);
	unsigned char *tmp = malloc(BUF);
	buf_read(dst, 0, tmp, BUF);
	memcpy(dst->mirror, tmp, BUF);    /* whatever arrived is now the expected content */
	free(tmp);
	gpx_deregister(c, r);
	fclose(out);
	fclose(in);
}

/*
 * The page kernel's pinned arena (gpu-copy.c): this uid's page transfers in flight try to fill
 * it, and past its share (half) the next is refused as busy, while another uid's transfer
 * still finds room.  The other client is uid 1010 (so this runs as root), and uses no CUDA,
 * only regions this process exports to it: it runs under MPS too.
 */
#define ARENA_JOBS 40             /* this uid's transfers: more than fill the arena */
#define ARENA_PAIRS 256           /* each one's pairs, all alike: 128 GiB moved, tens of ms */
#define ARENA_PAGES 131072        /* each one's host list: 1 MiB (the harness's max_segments) */
#define OTHER_PAGES 8             /* the other uid's table, in GPU memory, for 16,384 pairs */
#define ARENA_GRAIN (64u << 10)

/* Imports the three regions, then on "GO" copies the table's pages for 16,384 pairs. */
int
child_arena(const char *sock)
{
	struct gpx_pair *p = calloc(GPX_PAIRS_MAX, sizeof(*p));
	struct gpx_completion done;
	gpx_region s, d, t;
	uint64_t len;
	gpx_conn *c;
	char line[16];

	if (geteuid() == 0 && (setgid(1010) < 0 || setuid(1010) < 0))
		return 9;
	if (gpx_connect(sock, "arena", &c) < 0)
		return 10;
	if (gpx_import(c, "gpu-test-arena-src", &s, &len) < 0 || gpx_import(c, "gpu-test-arena-dst", &d, &len) < 0 ||
	    gpx_import(c, "gpu-test-arena-table", &t, &len) < 0)
		return 11;
	printf("READY\n");
	fflush(stdout);
	if (fgets(line, sizeof(line), stdin) == NULL)
		return 12;
	for (int i = 0; i < GPX_PAIRS_MAX; i++)
		p[i] = (struct gpx_pair){ .src = s, .dst = d };
	int r = gpx_copy_pages_batch_table(c, p, GPX_PAIRS_MAX, 4096, t, 0, OTHER_PAGES, 1);
	r = r ? r : gpx_wait_tag(c, 1, &done, 60000);
	r = r ? r : done.status;
	printf("DONE %d %s\n", r, r != 0 ? gpx_last_error(c) : "");
	fflush(stdout);
	return 0;
}

static CUdeviceptr
arena_buf(gpx_conn *c, size_t len, const void *from, const char *export, gpx_region *r)
{
	struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };
	CUdeviceptr d;

	CK(cuMemAlloc(&d, len));
	if (from != NULL)
		CK(cuMemcpyHtoD(d, from, len));
	else
		CK(cuMemsetD8(d, 0, len));
	if (gpx_register_cuda(c, (void *)d, len, 0, r) < 0 || (export != NULL && gpx_export(c, *r, export, &o) < 0))
		tap_bail("arena_buf: %s", gpx_last_error(c));
	return d;
}

/* This uid's bytes of the arena and the share, from the metrics (-1: no line). */
static void
arena_held(double *mine, double *other, double *share, double *refused)
{
	char *page = harness_metrics(the_harness);

	*mine = page ? metrics_sample(page, "gpx_page_arena_uid_bytes{uid=\"0\"}") : -1;
	*other = page ? metrics_sample(page, "gpx_page_arena_uid_bytes{uid=\"1010\"}") : -1;
	*share = page ? metrics_sample(page, "gpx_page_arena_share_bytes") : -1;
	*refused = page ? metrics_sample(page, "gpx_page_arena_refused_total{reason=\"share\"}") : -1;
	free(page);
}

void
test_arena_share(const char *self, const char *sock, gpx_conn *c)
{
	const uint32_t slots = BUF / 4096;
	unsigned char *src = malloc(BUF), *want = calloc(1, BUF), *want2 = calloc(1, BUF), *got = malloc(BUF);
	uint32_t *sp = malloc(ARENA_PAGES * sizeof(*sp)), *dp = malloc(ARENA_PAGES * sizeof(*dp));
	uint32_t t2[2 * OTHER_PAGES];
	struct gpx_pair pa[ARENA_PAIRS];
	struct gpx_completion done;
	double mine, other, share, refused0, refused;
	gpx_region rs, rd, rd2, rt2;
	char line[512] = "";

	if (geteuid() != 0) {
		tap_skip(8, "the page arena's share: the other client must be another uid, so this runs as root");
		return;
	}
	rnd_fill(src, BUF);
	/* Each destination page always gets the same source page: the order of the writes is free. */
	for (uint32_t i = 0; i < ARENA_PAGES; i++) {
		dp[i] = (uint32_t)((i * 7919ull) % slots);
		sp[i] = (uint32_t)((dp[i] * 2654435761ull >> 7) % slots);
	}
	for (uint32_t q = 0; q < slots; q++)
		memcpy(want + (size_t)q * 4096, src + (size_t)((q * 2654435761ull >> 7) % slots) * 4096, 4096);
	for (uint32_t k = 0; k < OTHER_PAGES; k++) {
		t2[k] = (uint32_t)(rnd() % slots);
		t2[OTHER_PAGES + k] = k * 523 % slots;     /* distinct */
		memcpy(want2 + (size_t)t2[OTHER_PAGES + k] * 4096, src + (size_t)t2[k] * 4096, 4096);
	}
	CK(cuCtxSetCurrent(ctx[0]));
	CUdeviceptr s = arena_buf(c, BUF, src, "gpu-test-arena-src", &rs), d = arena_buf(c, BUF, NULL, NULL, &rd),
	    d2 = arena_buf(c, BUF, NULL, "gpu-test-arena-dst", &rd2),
	    t = arena_buf(c, sizeof(t2), t2, "gpu-test-arena-table", &rt2);
	for (int k = 0; k < ARENA_PAIRS; k++)
		pa[k] = (struct gpx_pair){ .src = rs, .dst = rd };
	arena_held(&mine, &other, &share, &refused0);

	char *argv[] = { (char *)self, "arena", (char *)sock, NULL };
	FILE *out, *in;
	pid_t pid = spawn(self, argv, &out, &in);
	if (!ok(pid > 0 && wait_line(out, "READY"), "a client of uid 1010 imported the regions")) {
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		return;
	}
	int sub = 0, busy = 0, fine = 0, bad = 0;
	for (int i = 0; i < ARENA_JOBS; i++)
		sub += gpx_copy_pages_batch(c, pa, ARENA_PAIRS, 4096, sp, dp, ARENA_PAGES, 7000 + i) == 0;
	/* Up to the first refusal: the transfers before it are checked and hold their lists. */
	while (busy == 0 && bad == 0 && gpx_wait(c, &done, 1, 30000) == 1)
		done.status == -GPX_EBUSY ? busy++ : done.status == 0 ? fine++ : bad++;
	arena_held(&mine, &other, &share, &refused);
	ok(sub == ARENA_JOBS && busy == 1 && bad == 0 && share > 0 && mine <= share && mine > share - 17 * ARENA_GRAIN,
	    "of %d page transfers of this uid in flight, each holding 17 of the arena's 64 KiB grains, one is "
	    "refused as busy once they hold %.0f of its share of %.0f bytes (%d ended before: %s)", sub, mine, share,
	    fine, gpx_last_error(c));

	fputs("GO\n", in);
	fflush(in);
	bool said = line_within(out, line, sizeof(line), CHILD_WAIT_MS);
	line[strcspn(line, "\n")] = '\0';
	ok(said && strcmp(line, "DONE 0 ") == 0, "meanwhile uid 1010's page transfer finds room and ends: %s",
	    said ? line : "it said nothing");
	int e = gpx_copy_pages_batch(c, pa, ARENA_PAIRS, 4096, sp, dp, ARENA_PAGES, 7999);
	e = e ? e : gpx_wait_tag(c, 7999, &done, 30000);
	e = e ? e : done.status;
	ok(e == -GPX_EBUSY && strstr(gpx_last_error(c), "its share") != NULL, "after it, this uid's next is still "
	    "refused for its share (%s: %s): its transfers held it while the other's was checked", gpx_strerror(e),
	    gpx_last_error(c));
	if (e == 0)
		fine++;
	/* The rest: refused at once, or ended in order. */
	while (busy + fine + bad < ARENA_JOBS && gpx_wait(c, &done, 1, 60000) == 1)
		done.status == -GPX_EBUSY ? busy++ : done.status == 0 ? fine++ : bad++;
	ok(bad == 0 && busy + fine == ARENA_JOBS && fine * 17 * ARENA_GRAIN <= share, "%d ended, %d refused as "
	    "busy, none otherwise (%d): no more than a share's worth ran at once", fine, busy, bad);
	arena_held(&mine, &other, &share, &refused);
	ok(mine < 0 && other < 0 && refused - refused0 >= busy, "then neither uid holds any of the arena, and the "
	    "metrics counted %.0f refusals for the share", refused - refused0);
	CK(cuMemcpyDtoH(got, d, BUF));
	ok(memcmp(got, want, BUF) == 0, "this uid's transfers that ran copied every page, verified");
	CK(cuMemcpyDtoH(got, d2, BUF));
	ok(memcmp(got, want2, BUF) == 0, "the other uid's %u pages x 16,384 pairs, verified", OTHER_PAGES);

	waitpid(pid, NULL, 0);
	fclose(out);
	fclose(in);
	gpx_unexport(c, "gpu-test-arena-src");
	gpx_unexport(c, "gpu-test-arena-dst");
	gpx_unexport(c, "gpu-test-arena-table");
	gpx_deregister(c, rs);
	gpx_deregister(c, rd);
	gpx_deregister(c, rd2);
	gpx_deregister(c, rt2);
	cuMemFree(s);
	cuMemFree(d);
	cuMemFree(d2);
	cuMemFree(t);
	free(src);
	free(want);
	free(want2);
	free(got);
	free(sp);
	free(dp);
}
