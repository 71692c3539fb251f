/*
 * ipc-probe: what the CUDA driver does with one-bit variants of a legacy IPC handle, in a
 * process other than the exporter, and whether the importer's heap survives closing them.
 *
 *   ipc-probe LO HI [real]
 *
 * The parent exports a 1 MiB cudaMalloc allocation; the child opens the handle with one bit
 * of byte i changed, for i in [LO, HI), and closes each mapping at once; with "real" it opens
 * the real handle first and closes it last.  It prints, per byte, what the open gave: r (the
 * real handle's mapping), n (a new mapping), M (CUDA_ERROR_ALREADY_MAPPED), H (invalid handle),
 * V (invalid value), E (another error); then malloc and free churn the heap.  Run it under
 * glibc's checking (LD_PRELOAD=libc_malloc_debug.so.0 GLIBC_TUNABLES=glibc.malloc.check=3):
 * a driver that corrupts its heap ends the child with SIGABRT.  This is why gpxd refuses a
 * handle that maps an allocation already open under other bytes (daemon/gpu/gpu.c, ipc_held).
 * Not part of the test suite: on the drivers it was written against, some ranges abort.
 */
#include <cuda.h>
#include <malloc.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = "?"; \
	cuGetErrorName(r_, &s_); fprintf(stderr, "%s: %s\n", #x, s_); exit(2); } } while (0)

static void
churn(void)
{
	void *p[512] = { 0 };

	for (int i = 0; i < 100000; i++) {
		int k = rand() % 512;
		free(p[k]);
		p[k] = malloc(rand() % 4096 + 1);
	}
	for (int k = 0; k < 512; k++)
		free(p[k]);
	malloc_trim(0);
}

static char
verdict(CUresult r, CUdeviceptr p, CUdeviceptr real)
{
	switch (r) {
	case CUDA_SUCCESS: return p == real ? 'r' : 'n';
	case CUDA_ERROR_ALREADY_MAPPED: return 'M';
	case CUDA_ERROR_INVALID_HANDLE: return 'H';
	case CUDA_ERROR_INVALID_VALUE: return 'V';
	default: return 'E';
	}
}

static int
importer(int rfd, int lo, int hi, bool real)
{
	CUipcMemHandle h;
	CUdevice d;
	CUcontext c;
	CUdeviceptr p, rp = 0;
	char line[65] = "";

	if (read(rfd, &h, sizeof(h)) != sizeof(h))
		return 2;
	CK(cuInit(0));
	CK(cuDeviceGet(&d, 0));
	CK(cuDevicePrimaryCtxRetain(&c, d));
	CK(cuCtxSetCurrent(c));
	if (real)
		CK(cuIpcOpenMemHandle(&rp, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
	for (int i = lo; i < hi; i++) {
		CUipcMemHandle x = h;
		x.reserved[i] ^= 1;
		CUresult r = cuIpcOpenMemHandle(&p, x, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
		line[i - lo] = verdict(r, p, rp);
		if (r == CUDA_SUCCESS)
			CK(cuIpcCloseMemHandle(p));
	}
	printf("bytes %d-%d: %s\n", lo, hi - 1, line);
	fflush(stdout);
	if (real)
		CK(cuIpcCloseMemHandle(rp));
	churn();
	return 0;
}

int
main(int argc, char **argv)
{
	int lo = argc > 2 ? atoi(argv[1]) : -1, hi = argc > 2 ? atoi(argv[2]) : -1, p[2], st;
	bool real = argc > 3 && strcmp(argv[3], "real") == 0;
	CUdevice d;
	CUcontext c;
	CUdeviceptr a;
	CUipcMemHandle h;

	if (lo < 0 || hi > 64 || lo >= hi) {
		fprintf(stderr, "usage: ipc-probe LO HI [real]   (0 <= LO < HI <= 64)\n");
		return 2;
	}
	if (pipe(p) < 0)
		return 2;
	pid_t pid = fork();
	if (pid == 0) {
		close(p[1]);
		return importer(p[0], lo, hi, real);
	}
	close(p[0]);
	CK(cuInit(0));
	CK(cuDeviceGet(&d, 0));
	CK(cuDevicePrimaryCtxRetain(&c, d));
	CK(cuCtxSetCurrent(c));
	CK(cuMemAlloc(&a, 1 << 20));
	CK(cuIpcGetMemHandle(&h, a));
	if (write(p[1], &h, sizeof(h)) != sizeof(h))
		return 2;
	waitpid(pid, &st, 0);
	if (WIFSIGNALED(st))
		printf("importer killed by signal %d: the driver corrupted its heap\n", WTERMSIG(st));
	else
		printf("importer exited %d%s\n", WEXITSTATUS(st), WEXITSTATUS(st) == 0 ? ", heap intact" : "");
	return WIFSIGNALED(st) ? 1 : WEXITSTATUS(st);
}
