/*
 * What gpxd refuses or survives on a GPU node (tests/gpu/gpu-test.c runs them): forged legacy
 * IPC handles and descriptors that are not VMM exports, legacy IPC memory on a multi-tenant
 * node (a daemon of its own), and a sticky CUDA error in the daemon's context (a daemon of its
 * own, with fault injection), which must end gpxd with a clear line and the client's wait with
 * ECONN.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/gpu/gpu-test.h"
#include "tests/tap.h"
#include "tests/gpu/gpu-util.h"

/* Sends a Register the library would never send; returns the reply's status (-1: none). */
static int
raw_register(int sock, Gpx__MemKind kind, const uint8_t *handle, const uint8_t uuid[16], uint64_t size, int fd)
{
	Gpx__Register reg = GPX__REGISTER__INIT;

	reg.kind = kind;
	reg.length = 4096;
	reg.alloc_size = size;
	reg.alloc_id = 99;
	reg.device_uuid.data = (uint8_t *)uuid;
	reg.device_uuid.len = 16;
	if (handle != NULL) {
		reg.handle.data = (uint8_t *)handle;
		reg.handle.len = 64;
	}
	return raw_send_register(sock, &reg, fd);
}

/* Forged legacy handles and fds that are not VMM exports: an error each, nothing leaked. */
void
test_forged(struct harness *h)
{
	CUdevice d0;
	CUuuid uuid;
	CUdeviceptr real;
	CUipcMemHandle ih;
	uint8_t hb[64];
	int fds0 = harness_fds(h), before = regions_now(), errors = 0, opened = 0;
	int sock = harness_connect(h), efd = eventfd(0, EFD_CLOEXEC), ring = -1;

	CK(cuDeviceGet(&d0, 0));
	CK(cuDeviceGetUuid(&uuid, d0));
	Gpx__DaemonMsg *w = harness_hello(sock, GPX_PROTO_VERSION, efd, &ring);
	if (w != NULL)
		gpx__daemon_msg__free_unpacked(w, NULL);
	for (int i = 0; i < 32; i++) {
		rnd_fill(hb, sizeof(hb));
		int st = raw_register(sock, GPX__MEM_KIND__MEM_CUDA_IPC, hb, (uint8_t *)uuid.bytes, 1 << 20, -1);
		errors += st > 0;
	}
	ok(errors == 32, "32 random legacy handles: an error each (%d)", errors);
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&real, 1 << 20));
	CK(cuIpcGetMemHandle(&ih, real));
	int st = raw_register(sock, GPX__MEM_KIND__MEM_CUDA_IPC, (uint8_t *)ih.reserved, (uint8_t *)uuid.bytes, 1 << 20, -1);
	ok(st == 0, "the real handle registers (status %d)", st);
	int held0 = log_count(h, "already open under another handle");
	for (int i = 0; i < 64; i++) {
		memcpy(hb, ih.reserved, 64);
		hb[i] ^= 0x01;               /* one bit changed, in each byte in turn */
		st = raw_register(sock, GPX__MEM_KIND__MEM_CUDA_IPC, hb, (uint8_t *)uuid.bytes, 1 << 20, -1);
		opened += st == 0;
	}
	diag("a real handle with one bit changed: %d of 64 variants opened something (legacy handles are "
	    "bearer tokens; this is why a multi-tenant node refuses them)", opened);
	/*
	 * Most variants map the real handle's allocation again; the driver corrupts its heap
	 * when such a mapping is closed, so gpxd refuses them and never closes them.  Whether it
	 * got that right shows at the end, when gpxd stops cleanly (or aborts).
	 */
	int held = log_count(h, "already open under another handle") - held0;
	ok(held > 0, "64 altered real handles: %d refused as mapping the open allocation", held);
	static const char *paths[] = { "/dev/null", "/etc/hostname" };
	int bad = 0, n = 0;
	for (int i = 0; i < 5; i++) {
		int fd = -1, p[2] = { -1, -1 };
		if (i < 2)
			fd = open(paths[i], O_RDONLY | O_CLOEXEC);
		else if (i == 2 && pipe(p) == 0)
			fd = p[0];
		else if (i == 3)
			fd = eventfd(0, EFD_CLOEXEC);
		else
			fd = memfd_create("not-vmm", MFD_CLOEXEC);
		if (fd < 0)
			continue;
		n++;
		bad += raw_register(sock, GPX__MEM_KIND__MEM_CUDA_VMM, NULL, (uint8_t *)uuid.bytes, 2 << 20, fd) ==
		    GPX__STATUS__EBADFD;
		close(fd);
		if (p[1] >= 0)
			close(p[1]);
	}
	ok(bad == n, "/dev/null, a file, a pipe, an eventfd, a memfd as a VMM handle: EBADFD each (%d of %d)", bad, n);
	close(sock);
	close(efd);
	if (ring >= 0)
		close(ring);
	cuMemFree(real);
	int k = regions_now();
	ok(k == before, "no region left behind (%d, before %d)", k, before);
	ok(harness_wait_fds(h, fds0, 5000) == fds0, "gpxd's descriptors back to %d", fds0);
}

/* A sticky CUDA error in the daemon's context: gpxd exits non-zero with a clear line. */
void
test_sticky(void)
{
	struct harness h;
	gpx_conn *c = NULL;
	CUdeviceptr a, b;
	gpx_region ra, rb;
	struct gpx_completion d;

	setenv("GPXD_FAULT_INJECT", "sticky", 1);
	int e = harness_start(&h, "[cuda]\ntrust_legacy_ipc = yes\n");
	unsetenv("GPXD_FAULT_INJECT");
	if (e < 0) {
		ok(0, "daemon with fault injection started");
		return;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&a, 1 << 20));
	CK(cuMemAlloc(&b, 1 << 20));
	int r = gpx_connect(h.sock, "sticky", &c);
	if (r == 0 && (r = gpx_register_cuda(c, (void *)a, 1 << 20, 0, &ra)) == 0 &&
	    (r = gpx_register_cuda(c, (void *)b, 1 << 20, 0, &rb)) == 0) {
		gpx_copy(c, ra, 0, rb, 0, 4096, 1);
		r = gpx_wait(c, &d, 1, 10000);
	}
	ok(r == -GPX_ECONN, "after a sticky error the client's wait ends with ECONN (%s)", gpx_strerror(r));
	int st = harness_stop(&h);
	FILE *f = fopen(h.log, "re");
	char line[512];
	bool said = false;
	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		said |= strstr(line, "sticky error") != NULL;
	if (f != NULL)
		fclose(f);
	ok(st != 0 && said, "gpxd exited non-zero (%d) with a line naming the sticky error", st);
	if (r != -GPX_ECONN)
		harness_dump_log(&h);
	gpx_close(c);
	harness_cleanup(&h);
	cuMemFree(a);
	cuMemFree(b);
}

void
test_multitenant(void)
{
	struct harness h;
	gpx_conn *c;
	CUdeviceptr d;
	gpx_region r;

	if (harness_start(&h, NULL) < 0) {
		ok(0, "second daemon (multi-tenant) started");
		return;
	}
	CK(cuCtxSetCurrent(ctx[0]));
	CK(cuMemAlloc(&d, 1 << 20));
	if (gpx_connect(h.sock, "mt", &c) == 0) {
		int e = gpx_register_cuda(c, (void *)d, 1 << 20, 0, &r);
		ok(e == -GPX_EACCES && strstr(gpx_last_error(c), "trust") != NULL,
		    "legacy IPC memory refused on a multi-tenant node: %s", gpx_last_error(c));
		gpx_close(c);
	} else
		ok(0, "connect to the multi-tenant daemon");
	cuMemFree(d);
	harness_stop(&h);
	harness_cleanup(&h);
}
