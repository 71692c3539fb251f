/*
 * A probe, not a test: how one context's streams share a GPU's copy engines.  Long copies
 * within GPU0 (8 GiB in all) are queued on one or two "bulk" streams in pieces of 1 GiB down
 * to 4 MiB, with or without a cuStreamWriteValue64 after each piece (gpxd's completion word),
 * while this thread times 4 KiB copies on a third stream, one at a time, submit to
 * cuStreamSynchronize.  With an argument the third stream has the greatest priority.  It
 * prints the long copies' GB/s and the small ones' p50, p99 and max.  What it found on an H100
 * decided gpxd's streams (daemon/gpu/gpu-copy.c): at equal priority a small copy waits for the
 * long copy under way to end; at greater priority it does not, and the long copy is no slower.
 *
 *   ce-probe [priority]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <cuda.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *n_ = "?"; \
	cuGetErrorName(r_, &n_); fprintf(stderr, "%s: %s\n", #x, n_); exit(1); } } while (0)

static double
now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static int
cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

#define NLAT 200000

int
main(int argc, char **argv)
{
	CUdevice d;
	CUcontext c;
	CUstream bulk[2], quick;
	CUdeviceptr a, b, s1, s2, word;
	const size_t G = 1ull << 30, total = 8ull << 30;
	static const size_t pieces[] = { 1ull << 30, 256u << 20, 64u << 20, 32u << 20, 16u << 20, 8u << 20, 4u << 20 };
	static double lat[NLAT];
	int least, greatest;

	(void)argv;
	CK(cuInit(0));
	CK(cuDeviceGet(&d, 0));
	CK(cuDevicePrimaryCtxRetain(&c, d));
	CK(cuCtxSetCurrent(c));
	CK(cuStreamCreate(&bulk[0], CU_STREAM_NON_BLOCKING));
	CK(cuStreamCreate(&bulk[1], CU_STREAM_NON_BLOCKING));
	CK(cuCtxGetStreamPriorityRange(&least, &greatest));
	CK(cuStreamCreateWithPriority(&quick, CU_STREAM_NON_BLOCKING, argc > 1 ? greatest : least));
	printf("small copies on a stream of priority %d (range %d..%d)\n", argc > 1 ? greatest : least, least, greatest);
	CK(cuMemAlloc(&a, G));
	CK(cuMemAlloc(&b, G));
	CK(cuMemAlloc(&s1, 4096));
	CK(cuMemAlloc(&s2, 4096));
	CK(cuMemAlloc(&word, 64));
	CK(cuMemsetD8(a, 1, G));
	CK(cuCtxSynchronize());
	printf("%-8s %-6s %-7s %9s %9s %9s %9s\n", "piece", "signal", "streams", "GB/s", "p50 us", "p99 us", "max us");
	for (int mode = -1; mode < 7 * 4; mode++) {
		size_t piece = mode < 0 ? 0 : pieces[mode / 4];
		int sig = mode >= 0 && (mode % 4) & 1, two = mode >= 0 && (mode % 4) >> 1, n = 0;
		for (int rep = 0; rep < 2; rep++) {      /* the first is a warm-up */
			double t0 = now(), tq;
			uint64_t seq = 0;
			CUevent e[2];
			n = 0;
			for (size_t off = 0; piece && off < total; off += piece) {
				CUstream s = bulk[two ? (off / piece) & 1 : 0];
				CK(cuMemcpyAsync(b + off % G, a + off % G, piece, s));
				if (sig)
					CK(cuStreamWriteValue64(s, word, ++seq, 0));
			}
			tq = now();
			for (int k = 0; k < 2; k++) {
				CK(cuEventCreate(&e[k], CU_EVENT_DEFAULT));
				CK(cuEventRecord(e[k], bulk[k]));
			}
			while (n < NLAT && (piece == 0 ? now() - tq < 0.2 : cuEventQuery(e[0]) == CUDA_ERROR_NOT_READY ||
			    cuEventQuery(e[1]) == CUDA_ERROR_NOT_READY)) {
				double t = now();
				CK(cuMemcpyAsync(s2, s1, 4096, quick));
				CK(cuStreamSynchronize(quick));
				lat[n++] = (now() - t) * 1e6;
			}
			CK(cuCtxSynchronize());
			double secs = now() - t0;
			if (rep == 1) {
				qsort(lat, n, sizeof(double), cmp);
				printf("%-8zu %-6s %-7d %9.1f %9.2f %9.2f %9.2f  (%d small copies)\n", piece >> 20,
				    sig ? "yes" : "no", two + 1, piece ? total / secs / 1e9 : 0, n ? lat[n / 2] : 0,
				    n ? lat[n * 99 / 100] : 0, n ? lat[n - 1] : 0, n);
			}
			cuEventDestroy(e[0]);
			cuEventDestroy(e[1]);
		}
	}
	return 0;
}
