/*
 * GPU memory between nodes: two gpxd on one GPU machine, nodes "gpua" and "gpub", peered
 * over TCP (the machine has no RDMA device), so every chunk of GPU memory is staged through
 * host buffers on both sides (daemon/fabric/stage.c).  This one process is a client of both daemons
 * and owns every buffer, so it checks each byte that crosses:
 *   - B exports GPU memory (cuda-vmm) and host memory to peers; B obtains the dma-buf of the
 *     exported GPU memory and checks it (what a NIC would register: gpxctl exports shows it);
 *   - A copies from and into them with GPU memory of its own (cuda-ipc and cuda-vmm) and host
 *     memory, random sizes (one byte to several chunks) and offsets, verified byte for byte
 *     with guard bytes; B's owner gets its notification for a copy into its GPU memory;
 *   - both daemons count the staged bytes and nothing "direct" (gpxctl peers, the metrics);
 *   - B is killed in the middle of a stream of GPU copies: every copy ends within the bound,
 *     and A lets go of everything the copies held.
 * Run by tests/fabric-gpu.test, which skips on a machine without a GPU.
 */
#include "config.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/random.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/util.h"

#define BUF (16u << 20)
#define GUARD 64
#define BOUND 8.0                /* seconds a failure may take: timeout 3 plus slack */

static CUcontext ctx;
static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint64_t
rnd(void)
{
	return xorshift(&rng);
}

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *n_ = "?"; \
	cuGetErrorName(r_, &n_); tap_bail("%s: %s", #x, n_); } } while (0)

/* A buffer in this process, with a host mirror of what it should hold. */
struct buf {
	const char *name;
	int kind;                /* 0 host, 1 cuda-ipc, 2 cuda-vmm */
	CUdeviceptr d;
	int fd;
	unsigned char *host;
	unsigned char *mirror;
	gpx_region region;       /* on its own daemon */
};

static void
bwrite(struct buf *b, size_t off, const void *src, size_t n)
{
	if (b->kind == 0)
		memcpy(b->host + off, src, n);
	else
		CK(cuMemcpyHtoD(b->d + off, src, n));
}

static void
bread(struct buf *b, size_t off, void *dst, size_t n)
{
	if (b->kind == 0)
		memcpy(dst, b->host + off, n);
	else
		CK(cuMemcpyDtoH(dst, b->d + off, n));
}

static void
binit(struct buf *b, const char *name, int kind, gpx_conn *c)
{
	memset(b, 0, sizeof(*b));
	b->name = name;
	b->kind = kind;
	b->mirror = malloc(BUF);
	fill(b->mirror, BUF, (unsigned)rnd());
	if (kind == 0) {
		if (gpx_host_alloc(BUF, &b->fd, (void **)&b->host) < 0)
			tap_bail("gpx_host_alloc");
	} else if (kind == 1) {
		CK(cuMemAlloc(&b->d, BUF));
	} else {
		CUmemAllocationProp prop = {
			.type = CU_MEM_ALLOCATION_TYPE_PINNED,
			.location = { CU_MEM_LOCATION_TYPE_DEVICE, 0 },
			.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		};
		CUmemAccessDesc a = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
		CUmemGenericAllocationHandle h;
		CK(cuMemCreate(&h, BUF, &prop, 0));
		CK(cuMemAddressReserve(&b->d, BUF, 0, 0, 0));
		CK(cuMemMap(b->d, BUF, 0, h, 0));
		CK(cuMemSetAccess(b->d, BUF, &a, 1));
		CK(cuMemRelease(h));
	}
	bwrite(b, 0, b->mirror, BUF);
	int r = kind == 0 ? gpx_register_host(c, b->fd, 0, BUF, 0, &b->region) :
	    gpx_register_cuda(c, (void *)b->d, BUF, 0, &b->region);
	if (!ok(r == 0, "register %s", name))
		diag("%s: %s", gpx_strerror(r), gpx_last_error(c));
}

/* The packed QueryReply of what, unpacked; NULL on failure. */
static Gpx__QueryReply *
query(gpx_conn *c, enum gpx_query what)
{
	void *buf = NULL;
	size_t len = 0;
	Gpx__QueryReply *q = NULL;

	if (gpx_query(c, what, &buf, &len) == 0)
		q = gpx__query_reply__unpack(NULL, len, buf);
	free(buf);
	return q;
}

/* What B found for the GPU memory of export name, once the probe is done. */
static bool
gpudirect_of(gpx_conn *c, const char *name, char *out, size_t outlen)
{
	double end = now() + 5;

	while (now() < end) {
		Gpx__QueryReply *q = query(c, GPX_Q_EXPORTS);
		for (size_t i = 0; q != NULL && i < q->n_exports; i++)
			if (strcmp(q->exports[i]->name, name) == 0)
				snprintf(out, outlen, "%s", q->exports[i]->gpudirect);
		if (q != NULL)
			gpx__query_reply__free_unpacked(q, NULL);
		if (out[0] != '\0' && strcmp(out, "probing") != 0)
			return true;
		usleep(20000);
	}
	return false;
}

static int
import_retry(gpx_conn *c, const char *name, gpx_region *r, uint64_t *len)
{
	double end = now() + 10;
	int e;

	while ((e = gpx_import(c, name, r, len)) == -GPX_ENOENT && now() < end)
		usleep(100000);
	return e;
}

/*
 * One random copy between a local buffer and a remote one (whose bytes live in far, a buffer
 * of this process on the other daemon), checked with guard bytes around the destination.
 */
static bool
cross_copy(gpx_conn *c, struct buf *local, gpx_region remote, struct buf *far, bool to_remote, size_t len)
{
	size_t so = GUARD + rnd() % (BUF - len - 2 * GUARD + 1), d0 = GUARD + rnd() % (BUF - len - 2 * GUARD + 1);
	struct buf *src = to_remote ? local : far, *dst = to_remote ? far : local;
	unsigned char *got = malloc(len + 2 * GUARD);
	bool good;
	int r;

	r = to_remote ? gpx_copy_sync(c, local->region, so, remote, d0, len) :
	    gpx_copy_sync(c, remote, so, local->region, d0, len);
	if (r != 0) {
		diag("%s %s of %zu: %s (%s)", local->name, to_remote ? "->" : "<-", len, gpx_strerror(r),
		    gpx_last_error(c));
		free(got);
		return false;
	}
	memmove(dst->mirror + d0, src->mirror + so, len);
	bread(dst, d0 - GUARD, got, len + 2 * GUARD);
	good = memcmp(got, dst->mirror + d0 - GUARD, len + 2 * GUARD) == 0;
	if (!good)
		diag("%s %s %s of %zu at %zu -> %zu: bytes differ", local->name, to_remote ? "->" : "<-",
		    far->name, len, so, d0);
	free(got);
	return good;
}

static size_t
some_len(int k)
{
	static const size_t fixed[] = { 1, 4096 + 3, (3u << 20) + 517, 1u << 20 };
	return k < 4 ? fixed[k] : 1 + rnd() % (rnd() % 2 ? 65536 : 6u << 20);
}

/* Waits for the owner's notification with tag. */
static bool
notified(gpx_conn *c, uint64_t tag, uint64_t want)
{
	struct gpx_completion comp;
	double end = now() + 5;

	while (now() < end)
		if (gpx_wait(c, &comp, 1, 200) == 1 && (comp.flags & GPX_COMP_NOTIFY) && comp.tag == tag)
			return comp.bytes == want;
	return false;
}

static void
conf(char *out, size_t n, const char *node, int port, int peer, const char *key, const char *chunk)
{
	char peers[64] = "";

	if (peer != 0)
		snprintf(peers, sizeof(peers), "peers = 127.0.0.1:%d\n", peer);
	snprintf(out, n, "[cuda]\ntrust_legacy_ipc = yes\n[fabric]\nnode = %s\nlisten = 127.0.0.1:%d\n%s"
	    "key_file = %s\ntimeout = 3\nretry_interval = 0.3\nchunk_size = %s\n", node, port, peers, key, chunk);
}

int
main(void)
{
	struct harness ha, hb;
	gpx_conn *ca, *cb;
	struct buf ah, ai, av, bg, bh;
	gpx_region rg, rh;
	uint64_t len;
	char key[] = "/tmp/gpx-fabric-gpu-key.XXXXXX", ca_conf[512], cb_conf[512], gd[160] = "";
	unsigned char k[32];
	CUdevice dev;
	int port = 30000 + getpid() % 20000, fd, e;

	if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS) {
		printf("1..0 # SKIP no usable GPU\n");
		return 0;
	}
	CK(cuDevicePrimaryCtxRetain(&ctx, dev));
	CK(cuCtxSetCurrent(ctx));
	if ((fd = mkstemp(key)) < 0 || getrandom(k, sizeof(k), 0) != sizeof(k) || write(fd, k, sizeof(k)) != sizeof(k))
		tap_bail("key file");
	close(fd);
	/* A's chunks of 4 MiB: 8 pinned buffers for a window of 32 chunks, so bursts use the heap. */
	conf(ca_conf, sizeof(ca_conf), "gpua", port, port + 1, key, "4M");
	conf(cb_conf, sizeof(cb_conf), "gpub", port + 1, 0, key, "1M");
	if (harness_start(&hb, cb_conf) < 0 || harness_start(&ha, ca_conf) < 0)
		tap_bail("cannot start the two daemons");
	if (gpx_connect(ha.sock, "fabric-gpu-a", &ca) < 0 || gpx_connect(hb.sock, "fabric-gpu-b", &cb) < 0)
		tap_bail("cannot connect to both daemons");

	binit(&bg, "B gpu (cuda-vmm)", 2, cb);
	binit(&bh, "B host", 0, cb);
	binit(&ai, "A gpu (cuda-ipc)", 1, ca);
	binit(&av, "A gpu (cuda-vmm)", 2, ca);
	binit(&ah, "A host", 0, ca);
	struct gpx_export_opts nopts = { .rule = GPX_EXPORT_UID, .notify = 1, .notify_tag = 91 };
	struct gpx_export_opts plain = { .rule = GPX_EXPORT_UID };
	ok(gpx_export_remote(cb, bg.region, "gbuf", &nopts, "gpua") == 0, "B exports its GPU memory to A (%s)",
	    gpx_last_error(cb));
	ok(gpx_export_remote(cb, bh.region, "hbuf", &plain, "gpua") == 0, "B exports host memory to A");

	/* Up to the NIC: B obtains the dma-buf of the exported GPU memory and checks it. */
	bool probed = gpudirect_of(cb, "gbuf", gd, sizeof(gd));
	ok(probed && strncmp(gd, "dma-buf (", 9) == 0 && strstr(gd, " 16777216 bytes)") != NULL,
	    "B obtained and checked the dma-buf of its exported GPU memory: %s", gd);
	char hd[160] = "";
	gpudirect_of(cb, "hbuf", hd, sizeof(hd));
	ok(hd[0] == '\0', "host memory has no GPUDirect line (\"%s\")", hd);

	e = import_retry(ca, "gpub:gbuf", &rg, &len);
	ok(e == 0 && len == BUF, "A imports gpub:gbuf (%s)", e ? gpx_last_error(ca) : "16 MiB");
	e = import_retry(ca, "gpub:hbuf", &rh, &len);
	ok(e == 0 && len == BUF, "A imports gpub:hbuf (%s)", e ? gpx_last_error(ca) : "16 MiB");

	struct buf *locals[] = { &ai, &av, &ah };
	for (int l = 0; l < 3; l++)
		for (int dir = 0; dir < 2; dir++)
			for (int far = 0; far < 2; far++) {
				bool good = true;
				if (l == 2 && far == 1)
					continue;            /* host to host: tests/fabric-tcp.test */
				for (int i = 0; i < 8 && good; i++)
					good = cross_copy(ca, locals[l], far ? rh : rg, far ? &bh : &bg, dir == 0, some_len(i));
				ok(good, "random copies %s %s %s verified (1 B to several chunks)", locals[l]->name,
				    dir == 0 ? "->" : "<-", far ? "B host" : "B gpu");
			}

	/* The owner of the GPU export hears of a copy into it, after its bytes are in. */
	struct gpx_completion comp;
	while (gpx_poll(cb, &comp, 1) > 0)
		;
	e = gpx_copy_sync(ca, av.region, 0, rg, 0, 5u << 20);
	ok(e == 0 && notified(cb, 91, 5u << 20), "B's owner notified of 5 MiB copied into its GPU memory");
	memcpy(bg.mirror, av.mirror, 5u << 20);

	/* A burst: more of A's chunks in flight than it has pinned buffers. */
	int burst = 16, good = 0, seen = 0;
	for (int i = 0; i < burst; i++)
		gpx_copy(ca, av.region, 0, rg, (uint64_t)(i % 2) << 23, 8u << 20, 500 + i);
	for (double end = now() + 20; seen < burst && now() < end;)
		if (gpx_wait(ca, &comp, 1, 200) == 1 && !(comp.flags & GPX_COMP_NOTIFY)) {
			seen++;
			good += comp.status == 0;
		}
	memcpy(bg.mirror, av.mirror, 8u << 20);
	memcpy(bg.mirror + (8u << 20), av.mirror, 8u << 20);
	unsigned char *got = malloc(BUF);
	bread(&bg, 0, got, BUF);
	bool same = memcmp(got, bg.mirror, BUF) == 0;
	if (!ok(good == burst && same, "%d concurrent 8 MiB copies into B's GPU memory, more chunks than "
	    "pinned buffers: %d ok, bytes %s", burst, good, same ? "verified" : "differ")) {
		harness_dump_log(&ha);
		harness_dump_log(&hb);
	}
	free(got);
	while (gpx_poll(cb, &comp, 1) > 0)
		;

	/* Both daemons staged: nothing went by GPUDirect here. */
	for (int side = 0; side < 2; side++) {
		Gpx__QueryReply *q = query(side ? cb : ca, GPX_Q_PEERS);
		const Gpx__FabricGpu *g = q ? q->fabric_gpu : NULL;
		ok(g != NULL && g->staged_bytes > 0 && g->direct_bytes == 0 && g->pool_bytes > 0 &&
		    (side == 1 || g->heap_copies > 0),
		    "%s: %llu bytes of GPU memory staged in %llu copies (%llu through the heap), none direct",
		    side ? "B" : "A", g ? (unsigned long long)g->staged_bytes : 0ull,
		    g ? (unsigned long long)g->staged_copies : 0ull, g ? (unsigned long long)g->heap_copies : 0ull);
		if (q != NULL)
			gpx__query_reply__free_unpacked(q, NULL);
	}

	/* B dies in the middle of a stream of GPU copies: each ends, within the bound. */
	int n = 48, ended = 0, failed = 0, first = 1, sub = 0;
	for (int i = 0; i < n; i++)
		sub += gpx_copy(ca, i % 2 ? ai.region : av.region, 0, rg, (uint64_t)(i % 2) << 23, 8u << 20, 1000 + i) == 0;
	/* The first one through, so that the rest are on their way when B dies. */
	while (gpx_wait(ca, &comp, 1, 5000) == 1 && (comp.flags & GPX_COMP_NOTIFY))
		;
	first = comp.status;
	ended = 1;
	double t0 = now();
	kill(hb.pid, SIGKILL);
	while (ended < sub && now() - t0 < BOUND) {
		if (gpx_wait(ca, &comp, 1, 200) == 1 && !(comp.flags & GPX_COMP_NOTIFY)) {
			ended++;
			failed += comp.status != 0;
		}
	}
	ok(sub == n && first == 0, "%d copies of 8 MiB submitted into B's GPU memory, the first done (%s)", sub,
	    gpx_strerror(first));
	ok(ended == n && failed > 0, "B killed: all %d ended within %.0f s (%d failed, the last after %.2f s)",
	    n, BOUND, failed, now() - t0);
	struct harness_status st1;
	for (double end = now() + 5; harness_status(&ha, &st1) == 0 && st1.inflight > 0 && now() < end;)
		usleep(50000);
	ok(st1.inflight == 0, "A has no transfer left in flight (%d)", st1.inflight);
	e = gpx_copy_sync(ca, ai.region, 0, rg, 0, 4096);
	ok(e != 0, "a copy into the dead peer's export is refused (%s)", gpx_strerror(e));
	ok(gpx_copy_sync(ca, ai.region, 0, av.region, 0, 1u << 20) == 0, "A still copies locally");

	gpx_close(ca);
	gpx_close(cb);
	ok(harness_stop(&ha) == 0, "A stopped cleanly");
	harness_stop(&hb);
	harness_cleanup(&ha);
	harness_cleanup(&hb);
	unlink(key);
	return tap_done();
}
