/*
 * gpx-bench-gpu's modes of host memory and registration: copies between pinned host memory and
 * a GPU, and what registering a GPU buffer with gpxd costs.
 *
 *   gpu-host     pinned host <-> GPU0, >= 64 MiB
 *   gpu-register registering a buffer: the driver's own open of the same kind of handle, gpx's
 *                first registration, again on the same connection, and on a second one
 */
#include "config.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <cuda.h>

#include "tests/bench.h"
#include "tests/bench-gpu.h"

static int
mode_host(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-host", 1);
	uint64_t len = b->max_size < (256ull << 20) ? b->max_size : (256ull << 20);
	struct bench_buf h;
	struct gbuf g;
	char what[64], sz[32];

	if (r)
		return r;
	if (bench_buf_new(b, len, &h) < 0 || gbuf_new(b, 0, len, &g) < 0)
		return -1;
	cuCtxSetCurrent(bench_gpu_ctx(0));
	if (!CK(cuMemHostRegister(h.ptr, h.len, CU_MEMHOSTREGISTER_PORTABLE)))
		return -1;
	bench_table_begin(b, "gpu-host", "pinned host memory <-> GPU0: cuMemcpyAsync vs gpx");
	for (int dir = 0; dir < 2; dir++)
		for (uint64_t n = 64ull << 20; n <= len; n *= 4) {
			struct gcopy o = { .b = b, .dev = 0, .len = n };
			if (dir == 0) {
				o.src = (uint64_t)(uintptr_t)h.ptr, o.dst = g.d, o.rsrc = h.region, o.rdst = g.region;
			} else {
				o.src = g.d, o.dst = (uint64_t)(uintptr_t)h.ptr, o.rsrc = g.region, o.rdst = h.region;
			}
			struct bench_pair p;
			if (bench_pair_measure(b, gcopy_direct, gcopy_spin, &o, &p) < 0)
				return -1;
			snprintf(what, sizeof(what), "%s %s", dir == 0 ? "host->GPU" : "GPU->host",
			    bench_size_str(n, sz, sizeof(sz)));
			bench_gpu_row_t(b, what, "GB/s", n / p.direct / 1e9, n / p.gpx / 1e9, false, n, "gpu.host.large");
			bench_pair_free(&p);
		}
	bench_table_end(b, "direct: cuMemcpyAsync from or to the same memory pinned by cuMemHostRegister; "
	    "the daemon pins the client's memfd at registration");
	cuMemHostUnregister(h.ptr);
	gbuf_free(b, &g);
	bench_buf_free(b, &h);
	return 0;
}

/* ---- gpu-register ---- */

/*
 * What registration costs, against what opening the same kind of handle costs a process that
 * does it itself, all measured in this run.  The handles come from another process (the driver
 * opens no IPC handle of the process's own): this program run again with GPX_BENCH_REG_EXPORTER
 * naming a socket, which allocates REG_N buffers of each kind on GPU0 and sends a legacy IPC
 * handle or a VMM fd for each, and keeps them until the socket closes.
 */
#define REG_N 100
#define REG_LEN (2u << 20)

struct reg_msg {
	char kind;               /* 'I' legacy IPC handle, 'V' VMM fd (with SCM_RIGHTS) */
	uint64_t size;
	CUipcMemHandle ipc;
};

static int
reg_send(int s, const struct reg_msg *m, int fd)
{
	char cbuf[CMSG_SPACE(sizeof(int))] = { 0 };
	struct iovec iov = { (void *)m, sizeof(*m) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (fd >= 0) {
		mh.msg_control = cbuf;
		mh.msg_controllen = sizeof(cbuf);
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof(int));
	}
	return sendmsg(s, &mh, MSG_NOSIGNAL) == (ssize_t)sizeof(*m) ? 0 : -1;
}

static int
reg_recv(int s, struct reg_msg *m, int *fd)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = { m, sizeof(*m) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	struct cmsghdr *c;

	*fd = -1;
	if (recvmsg(s, &mh, MSG_CMSG_CLOEXEC) != (ssize_t)sizeof(*m))
		return -1;
	if ((c = CMSG_FIRSTHDR(&mh)) != NULL && c->cmsg_type == SCM_RIGHTS)
		memcpy(fd, CMSG_DATA(c), sizeof(int));
	return 0;
}

/* The exporter: runs before main when this program is started as one, and never returns. */
__attribute__((constructor)) static void
reg_exporter(void)
{
	const char *env = getenv("GPX_BENCH_REG_EXPORTER");
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, 0 },
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
	};
	CUcontext c;
	CUdevice d;
	char x;

	if (env == NULL)
		return;
	int s = atoi(env);
	if (!CK(cuInit(0)) || !CK(cuDeviceGet(&d, 0)) || !CK(cuDevicePrimaryCtxRetain(&c, d)) ||
	    !CK(cuCtxSetCurrent(c)))
		_exit(2);
	for (int i = 0; i < REG_N; i++) {
		struct reg_msg m = { .kind = 'I', .size = REG_LEN };
		CUdeviceptr p;
		CUmemGenericAllocationHandle h;
		int fd;
		if (!CK(cuMemAlloc(&p, REG_LEN)) || !CK(cuIpcGetMemHandle(&m.ipc, p)) || reg_send(s, &m, -1) < 0)
			_exit(3);
		m.kind = 'V';
		if (!CK(cuMemCreate(&h, REG_LEN, &prop, 0)) ||
		    !CK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) ||
		    reg_send(s, &m, fd) < 0)
			_exit(4);
		close(fd);
	}
	while (read(s, &x, 1) > 0)
		;
	_exit(0);
}

static double
pct(double *v, int n, int p)
{
	qsort(v, n, sizeof(double), bench_cmp_double);
	return v[(n - 1) * p / 100];
}

/*
 * The driver's own cost, in this process: cuIpcOpenMemHandle of another process's handle, and
 * a VMM import as gpxd does it (import, reserve, map, access for every GPU).  0 or -1.
 */
static int
reg_direct(double *ipc_us, double *vmm_us)
{
	int sv[2];
	char env[32], self[PATH_MAX];
	ssize_t sl;
	pid_t pid;
	int bad = 0;

	if ((sl = readlink("/proc/self/exe", self, sizeof(self) - 1)) < 0 ||
	    socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	self[sl] = '\0';
	/* Set up before the fork: between fork and exec the child only execs (no malloc). */
	int cfd = dup(sv[1]);                 /* the child's end, without close-on-exec */
	snprintf(env, sizeof(env), "%d", cfd);
	setenv("GPX_BENCH_REG_EXPORTER", env, 1);
	fflush(NULL);
	if ((pid = fork()) == 0) {
		execl(self, self, (char *)NULL);
		_exit(127);
	}
	unsetenv("GPX_BENCH_REG_EXPORTER");
	close(cfd);
	close(sv[1]);
	if (pid < 0 || cfd < 0) {
		close(sv[0]);
		if (pid > 0)
			waitpid(pid, NULL, 0);
		return -1;
	}
	cuCtxSetCurrent(bench_gpu_ctx(0));
	int ni = 0, nv = 0;
	for (int k = 0; k < 2 * REG_N && !bad; k++) {
		struct reg_msg m;
		int fd;
		if (reg_recv(sv[0], &m, &fd) < 0) {
			fprintf(stderr, "gpx-bench-gpu: the exporting process stopped after %d handles\n", k);
			bad = 1;
			break;
		}
		if (m.kind == 'I') {
			CUdeviceptr p;
			double t0 = bench_now();
			bad = !CK(cuIpcOpenMemHandle(&p, m.ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
			ipc_us[ni++] = (bench_now() - t0) * 1e6;
			if (!bad)
				cuIpcCloseMemHandle(p);
		} else {
			CUmemGenericAllocationHandle h;
			CUdeviceptr va = 0;
			double t0 = bench_now();
			bad = gbuf_import(fd, m.size, -1, &va, &h) < 0;
			vmm_us[nv++] = (bench_now() - t0) * 1e6;
			if (!bad) {
				cuMemUnmap(va, m.size);
				cuMemAddressFree(va, m.size);
				cuMemRelease(h);
			}
			close(fd);
		}
	}
	close(sv[0]);
	waitpid(pid, NULL, 0);
	return bad || ni != REG_N || nv != REG_N ? -1 : 0;
}

/* A 2 MiB buffer on GPU0: cuMemCreate memory exportable as a POSIX fd, or cuMemAlloc memory. */
static int
reg_alloc(bool vmm, struct gbuf *g)
{
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.location = { CU_MEM_LOCATION_TYPE_DEVICE, 0 },
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
	};
	CUmemAccessDesc a = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };

	memset(g, 0, sizeof(*g));
	g->len = REG_LEN;
	cuCtxSetCurrent(bench_gpu_ctx(0));
	if (!vmm)
		return CK(cuMemAlloc(&g->d, g->len)) ? 0 : -1;
	return CK(cuMemCreate(&g->h, g->len, &prop, 0)) && CK(cuMemAddressReserve(&g->d, g->len, 0, 0, 0)) &&
	    CK(cuMemMap(g->d, g->len, 0, g->h, 0)) && CK(cuMemSetAccess(g->d, g->len, &a, 1)) ? 0 : -1;
}

/*
 * gpx's cost for REG_N buffers of one kind: the first registration, the same buffer again on
 * the same connection, and on a second connection.  1 when gpxd refuses the kind's first
 * registration (legacy handles on a node that does not trust them), after saying why in why.
 */
static int
reg_gpx(struct bench_ctx *b, gpx_conn *c2, bool vmm, double *first, double *again, double *other,
    char *why, size_t whylen)
{
	for (int i = 0; i < REG_N; i++) {
		struct gbuf g;
		gpx_region r1, r2, r3;
		int r;
		if (reg_alloc(vmm, &g) < 0)
			return -1;
		double t0 = bench_now();
		if ((r = gpx_register_cuda(b->conn, (void *)g.d, g.len, 0, &r1)) < 0) {
			gbuf_release(&g);
			if (!vmm && i == 0) {            /* e.g. EACCES: the node does not trust them */
				snprintf(why, whylen, "%s", gpx_last_error(b->conn));
				return 1;
			}
			return bench_fail(b, r, "gpx_register_cuda");
		}
		double t1 = bench_now();
		if ((r = gpx_register_cuda(b->conn, (void *)g.d, g.len, 0, &r2)) < 0)
			return bench_fail(b, r, "gpx_register_cuda (again)");
		double t2 = bench_now();
		if ((r = gpx_register_cuda(c2, (void *)g.d, g.len, 0, &r3)) < 0)
			return bench_fail(b, r, "gpx_register_cuda (second connection)");
		double t3 = bench_now();
		gpx_deregister(c2, r3);
		gpx_deregister(b->conn, r2);
		gpx_deregister(b->conn, r1);
		gbuf_release(&g);
		first[i] = (t1 - t0) * 1e6;
		again[i] = (t2 - t1) * 1e6;
		other[i] = (t3 - t2) * 1e6;
	}
	return 0;
}

/*
 * The client's own steps of a VMM registration, timed by making the same driver calls here on
 * REG_N fresh buffers: what libgpxclient asks of the pointer (one cuPointerGetAttributes), the
 * export of its piece (retain, export as a POSIX fd, release), and the last close of that fd,
 * which tears down the open of /dev/nvidiactl that every export is.  The daemon's steps
 * (import, map and access, its close of the fds, the hops to and from its task threads) are
 * in gpxd's log at log_level debug.
 */
static int
reg_steps(double *attrs, double *export, double *closing)
{
	for (int i = 0; i < REG_N; i++) {
		CUmemGenericAllocationHandle h;
		CUdeviceptr base = 0;
		size_t size = 0;
		unsigned long long id = 0;
		unsigned int mt = 0;
		int fd = -1, ord = -1;
		struct gbuf g;
		CUpointer_attribute at[] = {
			CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
			CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
			CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID,
		};
		void *val[] = { &mt, &ord, &base, &size, &id };

		if (reg_alloc(true, &g) < 0)
			return -1;
		double t0 = bench_now();
		bool ok = CK(cuPointerGetAttributes(5, at, val, g.d));
		double t1 = bench_now();
		ok = ok && CK(cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)g.d));
		ok = ok && CK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
		cuMemRelease(h);
		double t2 = bench_now();
		if (fd >= 0)
			close(fd);
		double t3 = bench_now();
		gbuf_release(&g);
		if (!ok)
			return -1;
		attrs[i] = (t1 - t0) * 1e6;
		export[i] = (t2 - t1) * 1e6;
		closing[i] = (t3 - t2) * 1e6;
	}
	return 0;
}

static int
mode_register(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-register", 1);
	static double dipc[REG_N], dvmm[REG_N], first[REG_N], again[REG_N], other[REG_N];
	static double sattr[REG_N], sexport[REG_N], sclose[REG_N];
	char why[256] = "", note[1024];
	double legacy_other = NAN;
	gpx_conn *c2;

	if (r)
		return r;
	if (reg_direct(dipc, dvmm) < 0) {
		fprintf(stderr, "gpx-bench-gpu: gpu-register: the direct opens failed\n");
		return -1;
	}
	if ((r = gpx_connect(b->socket, "gpx-bench-register-2", &c2)) < 0)
		return bench_fail(b, r, "gpx_connect (second connection)");
	bench_table_begin(b, "gpu-register", "registering a 2 MiB buffer of another connection's memory kind: "
	    "the driver's own open (direct) vs gpx");
	if ((r = reg_gpx(b, c2, false, first, again, other, why, sizeof(why))) < 0) {
		gpx_close(c2);
		return -1;
	}
	double ipc50 = pct(dipc, REG_N, 50), ipc99 = pct(dipc, REG_N, 99);
	if (r == 0) {
		bench_gpu_row(b, "legacy IPC, first registration", "us p50", ipc50, pct(first, REG_N, 50), true, 0);
		bench_gpu_row(b, "legacy IPC, first registration", "us p99", ipc99, pct(first, REG_N, 99), true, 0);
		bench_gpu_row(b, "legacy IPC, 2nd connection (held)", "us p50", ipc50, pct(other, REG_N, 50), true, 0);
		bench_gpu_row(b, "legacy IPC, 2nd connection (held)", "us p99", ipc99, pct(other, REG_N, 99), true, 0);
		legacy_other = pct(other, REG_N, 50);
	} else {
		bench_gpu_row(b, "cuIpcOpenMemHandle (gpx: refused)", "us p50", ipc50, NAN, true, 0);
		fprintf(b->json ? stderr : stdout, "  (legacy handles not measured: %s)\n", why);
	}
	if (reg_gpx(b, c2, true, first, again, other, why, sizeof(why)) < 0) {
		gpx_close(c2);
		return -1;
	}
	double v50 = pct(dvmm, REG_N, 50), v99 = pct(dvmm, REG_N, 99);
	bench_gpu_row(b, "VMM, first registration", "us p50", v50, pct(first, REG_N, 50), true, 0);
	bench_gpu_row(b, "VMM, first registration", "us p99", v99, pct(first, REG_N, 99), true, 0);
	bench_gpu_row(b, "VMM, same connection again (held)", "us p50", v50, pct(again, REG_N, 50), true, 0);
	bench_gpu_row(b, "VMM, same connection again (held)", "us p99", v99, pct(again, REG_N, 99), true, 0);
	bench_gpu_row(b, "VMM, 2nd connection (imported anew)", "us p50", v50, pct(other, REG_N, 50), true, 0);
	bench_gpu_row(b, "VMM, 2nd connection (imported anew)", "us p99", v99, pct(other, REG_N, 99), true, 0);
	gpx_close(c2);
	if (reg_steps(sattr, sexport, sclose) == 0) {
		bench_gpu_row(b, "VMM client step: pointer attributes", "us p50", pct(sattr, REG_N, 50), NAN, true, 0);
		bench_gpu_row(b, "VMM client step: retain, export, release", "us p50", pct(sexport, REG_N, 50), NAN,
		    true, 0);
		bench_gpu_row(b, "VMM client step: retain, export, release", "us p99", pct(sexport, REG_N, 99), NAN,
		    true, 0);
		bench_gpu_row(b, "VMM client step: last close of the export", "us p50", pct(sclose, REG_N, 50), NAN,
		    true, 0);
		bench_gpu_row(b, "VMM client step: last close of the export", "us p99", pct(sclose, REG_N, 99), NAN,
		    true, 0);
	}
	/* reg.cached: what the second connection to present the same memory pays */
	char vlegacy[200] = "legacy IPC not measured", vvmm[200];
	if (!isnan(legacy_other))
		bench_verdict("reg.cached", legacy_other, vlegacy, sizeof(vlegacy));
	bench_verdict("reg.cached", pct(other, REG_N, 50), vvmm, sizeof(vvmm));
	snprintf(note, sizeof(note), "direct: cuIpcOpenMemHandle, and cuMemImportFromShareableHandle + "
	    "cuMemAddressReserve + cuMemMap + cuMemSetAccess, of another process's handles, in this "
	    "process; gpx: gpx_register_cuda of this process's buffers, %d of each; 2nd connection, legacy "
	    "IPC: %s; VMM: %s", REG_N, vlegacy, vvmm);
	bench_table_end(b, note);
	return 0;
}

static const struct bench_mode host_modes[] = {
	{ "gpu-host", "pinned host <-> GPU copies >= 64 MiB", mode_host },
	{ "gpu-register", "registration cost against the driver's own open, first and held", mode_register },
};
BENCH_MODES(host_modes)
