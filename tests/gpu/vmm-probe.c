/*
 * vmm-probe: how far the CUDA driver lets a process recognise two presentations of one VMM
 * allocation (POSIX-fd exports), which bounds what gpxd can share between connections.
 *
 *   vmm-probe
 *
 * A child exports allocation A twice (two fds) and allocation B once, and sends the three fds
 * to the parent, which prints, one "key: value" line each:
 *   fstat         whether the fds' st_dev/st_ino/st_rdev tell A's exports from B's
 *   kcmp          whether A's two exports are one open file (kcmp KCMP_FILE)
 *   import        the handles of importing A's first fd twice, A's second fd, and B's fd, and
 *                 which of them are equal
 *   release       with equal handles: whether one release leaves the other usable
 *   block_id      CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID and BUFFER_ID of A mapped through
 *                 each of its two imports, and whether the bytes are shared
 *   retain        cuMemRetainAllocationHandle at each mapping
 *   cost          p50 over 50 runs of import, reserve, map and set access, separately (us)
 * gpxd keys a VMM piece by what its connection says (the owner's memory block id) and holds it
 * per connection, since none of the above recognises an allocation before it is imported
 * (daemon/gpu/vmm.c); this program is what to run on a new driver to see whether that changed.
 * Not part of the test suite.
 */
#include "config.h"

#include <cuda.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/kcmp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = "?"; \
	cuGetErrorName(r_, &s_); fprintf(stderr, "%s: %s\n", #x, s_); exit(2); } } while (0)
#define RUNS 50

static CUmemAllocationProp prop = {
	.type = CU_MEM_ALLOCATION_TYPE_PINNED,
	.location = { CU_MEM_LOCATION_TYPE_DEVICE, 0 },
	.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
};

static void
ctx0(void)
{
	CUdevice d;
	CUcontext c;

	CK(cuInit(0));
	CK(cuDeviceGet(&d, 0));
	CK(cuDevicePrimaryCtxRetain(&c, d));
	CK(cuCtxSetCurrent(c));
}

static size_t
granule(void)
{
	size_t g;

	CK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	return g;
}

static void
send_fds(int s, const int *fds, int n)
{
	char cbuf[CMSG_SPACE(8 * sizeof(int))] = { 0 }, b = 'x';
	struct iovec iov = { &b, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
		.msg_controllen = CMSG_SPACE(n * sizeof(int)) };
	struct cmsghdr *c = CMSG_FIRSTHDR(&mh);

	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(n * sizeof(int));
	memcpy(CMSG_DATA(c), fds, n * sizeof(int));
	if (sendmsg(s, &mh, 0) != 1)
		exit(3);
}

static int
recv_fds(int s, int *fds, int n)
{
	char cbuf[CMSG_SPACE(8 * sizeof(int))], b;
	struct iovec iov = { &b, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	struct cmsghdr *c;

	if (recvmsg(s, &mh, 0) != 1 || (c = CMSG_FIRSTHDR(&mh)) == NULL ||
	    c->cmsg_len != CMSG_LEN(n * sizeof(int)))
		return -1;
	memcpy(fds, CMSG_DATA(c), n * sizeof(int));
	return 0;
}

/* The exporter: A twice, B once, RUNS more exports of A for the timings; waits for EOF. */
static int
exporter(int s)
{
	CUmemGenericAllocationHandle a, b;
	int fds[3], more, x;
	size_t g;

	ctx0();
	g = granule();
	CK(cuMemCreate(&a, g, &prop, 0));
	CK(cuMemCreate(&b, g, &prop, 0));
	CK(cuMemExportToShareableHandle(&fds[0], a, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	CK(cuMemExportToShareableHandle(&fds[1], a, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	CK(cuMemExportToShareableHandle(&fds[2], b, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	send_fds(s, fds, 3);
	for (int i = 0; i < RUNS; i++) {
		CUmemGenericAllocationHandle h;
		CK(cuMemCreate(&h, g, &prop, 0));
		CK(cuMemExportToShareableHandle(&more, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
		send_fds(s, &more, 1);
		close(more);
	}
	while (read(s, &x, 1) > 0)
		;
	return 0;
}

static double
now_us(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int
cmp(const void *x, const void *y)
{
	double a = *(const double *)x, b = *(const double *)y;

	return a < b ? -1 : a > b;
}

static double
p50(double *v)
{
	qsort(v, RUNS, sizeof(double), cmp);
	return v[RUNS / 2];
}

static CUdeviceptr
map(CUmemGenericAllocationHandle h, size_t g)
{
	CUmemAccessDesc acc = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	CUdeviceptr va;

	CK(cuMemAddressReserve(&va, g, 0, 0, 0));
	CK(cuMemMap(va, g, 0, h, 0));
	CK(cuMemSetAccess(va, g, &acc, 1));
	return va;
}

static CUmemGenericAllocationHandle
import(int fd)
{
	CUmemGenericAllocationHandle h;

	CK(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
	return h;
}

static int
importer(int s, pid_t child)
{
	CUmemAccessDesc acc = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	struct stat st[3];
	int fds[3];
	size_t g;

	if (recv_fds(s, fds, 3) < 0)
		return 3;
	ctx0();
	g = granule();
	for (int i = 0; i < 3; i++)
		fstat(fds[i], &st[i]);
	printf("fstat: A1 %u:%u ino %llu rdev %u:%u, A2 ino %llu, B ino %llu: %s\n", major(st[0].st_dev),
	    minor(st[0].st_dev), (unsigned long long)st[0].st_ino, major(st[0].st_rdev), minor(st[0].st_rdev),
	    (unsigned long long)st[1].st_ino, (unsigned long long)st[2].st_ino,
	    st[0].st_ino == st[2].st_ino && st[0].st_dev == st[2].st_dev ?
	    "A and B look alike (no identity)" : "A and B differ");
	pid_t me = getpid();
	long k12 = syscall(SYS_kcmp, me, me, KCMP_FILE, fds[0], fds[1]);
	long k13 = syscall(SYS_kcmp, me, me, KCMP_FILE, fds[0], fds[2]);
	printf("kcmp: A1 vs A2 %ld, A1 vs B %ld (0: one open file)\n", k12, k13);

	CUmemGenericAllocationHandle h1 = import(fds[0]), h1b = 0, h2 = import(fds[1]), h3 = import(fds[2]);
	/* The same fd twice may be refused: that is an answer too. */
	CUresult e1b = cuMemImportFromShareableHandle(&h1b, (void *)(uintptr_t)fds[0],
	    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	const char *n1b = "CUDA_SUCCESS";
	cuGetErrorName(e1b, &n1b);
	printf("import: A1 %#llx, A1 again %#llx (%s), A2 %#llx, B %#llx; A1==A1again %s, A1==A2 %s, A1==B %s\n",
	    (unsigned long long)h1, (unsigned long long)h1b, n1b, (unsigned long long)h2, (unsigned long long)h3,
	    e1b == CUDA_SUCCESS && h1 == h1b ? "yes" : "no", h1 == h2 ? "yes" : "no", h1 == h3 ? "yes" : "no");

	CUdeviceptr v1 = map(h1, g), v2 = map(h2, g);
	unsigned char got = 0;
	unsigned long long blk1 = 0, blk2 = 0, buf1 = 0, buf2 = 0;
	CK(cuMemsetD8(v1, 0xa5, g));
	CK(cuMemcpyDtoH(&got, v2 + 17, 1));
	cuPointerGetAttribute(&blk1, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID, v1);
	cuPointerGetAttribute(&blk2, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID, v2);
	cuPointerGetAttribute(&buf1, CU_POINTER_ATTRIBUTE_BUFFER_ID, v1);
	cuPointerGetAttribute(&buf2, CU_POINTER_ATTRIBUTE_BUFFER_ID, v2);
	printf("block_id: through A1 %llu, through A2 %llu; buffer_id %llu, %llu; bytes shared: %s\n", blk1, blk2,
	    buf1, buf2, got == 0xa5 ? "yes" : "no");
	CUmemGenericAllocationHandle r1 = 0, r2 = 0;
	CK(cuMemRetainAllocationHandle(&r1, (void *)v1));
	CK(cuMemRetainAllocationHandle(&r2, (void *)v2));
	printf("retain: at A1's mapping %#llx (%s A1's import), at A2's %#llx (%s A2's)\n", (unsigned long long)r1,
	    r1 == h1 ? "=" : "!=", (unsigned long long)r2, r2 == h2 ? "=" : "!=");
	CK(cuMemRelease(r1));
	CK(cuMemRelease(r2));

	if (e1b != CUDA_SUCCESS) {
		printf("release: no second import of one fd to release\n");
	} else if (h1 == h1b) {
		CUmemAllocationProp p;
		CK(cuMemRelease(h1b));
		CUresult e = cuMemGetAllocationPropertiesFromHandle(&p, h1);
		printf("release: one of two equal handles released, the other %s\n",
		    e == CUDA_SUCCESS ? "still answers (references counted)" : "no longer answers");
	} else {
		CK(cuMemRelease(h1b));
		printf("release: the two imports are distinct handles, each released on its own\n");
	}
	CK(cuMemUnmap(v1, g));
	CK(cuMemUnmap(v2, g));
	CK(cuMemAddressFree(v1, g));
	CK(cuMemAddressFree(v2, g));
	CK(cuMemRelease(h1));
	CK(cuMemRelease(h2));
	CK(cuMemRelease(h3));

	double ti[RUNS], tr[RUNS], tm[RUNS], ta[RUNS];
	for (int i = 0; i < RUNS; i++) {
		int fd;
		CUdeviceptr va;
		CUmemGenericAllocationHandle h;
		if (recv_fds(s, &fd, 1) < 0)
			return 3;
		double t0 = now_us();
		h = import(fd);
		double t1 = now_us();
		CK(cuMemAddressReserve(&va, g, 0, 0, 0));
		double t2 = now_us();
		CK(cuMemMap(va, g, 0, h, 0));
		double t3 = now_us();
		CK(cuMemSetAccess(va, g, &acc, 1));
		double t4 = now_us();
		ti[i] = t1 - t0, tr[i] = t2 - t1, tm[i] = t3 - t2, ta[i] = t4 - t3;
		CK(cuMemUnmap(va, g));
		CK(cuMemAddressFree(va, g));
		CK(cuMemRelease(h));
		close(fd);
	}
	printf("cost: import %.1f us, reserve %.1f us, map %.1f us, set access %.1f us (p50 of %d, %zu KiB)\n",
	    p50(ti), p50(tr), p50(tm), p50(ta), RUNS, g >> 10);
	close(s);
	waitpid(child, NULL, 0);
	return 0;
}

int
main(void)
{
	int sv[2];

	if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) < 0)
		return 2;
	/* Before any CUDA call: a child of a process that initialised CUDA may not use it. */
	pid_t pid = fork();
	if (pid < 0)
		return 2;
	if (pid == 0) {
		close(sv[0]);
		return exporter(sv[1]);
	}
	close(sv[1]);
	setvbuf(stdout, NULL, _IOLBF, 0);
	return importer(sv[0], pid);
}
