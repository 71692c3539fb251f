/*
 * gpx-bench-gpu's modes of host memory and registration: copies between pinned host memory and
 * a GPU, and what registering a GPU buffer with gpxd costs.
 *
 *   gpu-host     pinned host <-> GPU0, >= 64 MiB
 *   gpu-register registering a buffer: the first time (driver import) and again (cached)
 */
#include "config.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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

static int
mode_register(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-register", 1);
	enum { N = 200 };
	double first[N], again[N];

	if (r)
		return r;
	for (int i = 0; i < N; i++) {
		struct gbuf g;
		gpx_region r2;
		if (gbuf_alloc(0, 2 << 20, &g) < 0)
			return -1;
		double t0 = bench_now();
		if ((r = gpx_register_cuda(b->conn, (void *)g.d, g.len, 0, &g.region)) < 0)
			return bench_fail(b, r, "gpx_register_cuda");
		double t1 = bench_now();
		if ((r = gpx_register_cuda(b->conn, (void *)g.d, g.len, 0, &r2)) < 0)
			return bench_fail(b, r, "gpx_register_cuda");
		double t2 = bench_now();
		gpx_deregister(b->conn, r2);
		gbuf_free(b, &g);
		first[i] = (t1 - t0) * 1e6;
		again[i] = (t2 - t1) * 1e6;
	}
	qsort(first, N, sizeof(double), bench_cmp_double);
	qsort(again, N, sizeof(double), bench_cmp_double);
	bench_table_begin(b, "gpu-register", "registering a 2 MiB VMM buffer: first time vs already held by gpxd");
	bench_gpu_row(b, "first (export + daemon import and map), p50", "us", NAN, first[N / 2], true, 0);
	bench_gpu_row(b, "again (served from the mapping cache), p50", "us", NAN, again[N / 2], true, 0);
	bench_gpu_row(b, "again, p99", "us", NAN, again[N * 99 / 100], true, 0);
	bench_table_end(b, "anchor: cuIpcOpenMemHandle 120 us, VMM import+map 131 us; DESIGN target cached <= 10 us");
	return 0;
}

static const struct bench_mode host_modes[] = {
	{ "gpu-host", "pinned host <-> GPU copies >= 64 MiB", mode_host },
	{ "gpu-register", "registration cost, first and cached", mode_register },
};
BENCH_MODES(host_modes)
