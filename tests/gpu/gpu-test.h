/*
 * What the files of tests/gpu/gpu-test share: the buffers of every kind it copies between,
 * the state of the program (the devices' contexts, the daemon), the helpers the parts use,
 * and the parts themselves, by file, in the order gpu-test.c runs them.
 */
#ifndef GPX_TESTS_GPU_TEST_H
#define GPX_TESTS_GPU_TEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"
#include "tests/gpu/gpu-util.h"
#include "tests/harness.h"

#define BUF (16u << 20)

/* A buffer of one kind, with a host mirror of what it should hold. */
struct buf {
	const char *name;
	int dev;                  /* -1: host memfd */
	int vmm;
	CUdeviceptr d;
	CUmemGenericAllocationHandle h;
	size_t alloc;
	int fd;
	unsigned char *host;      /* host kind: the mapping */
	unsigned char *mirror;
	gpx_region region;
};

extern CUcontext ctx[GPU_MAX];
extern struct harness *the_harness;   /* the main daemon */
extern int ndev;

/* ---- gpu-test.c: what the parts share ---- */

uint64_t rnd(void);
/* p[0..n) from rnd(). */
void rnd_fill(unsigned char *p, size_t n);
/* Makes a buffer of one kind (dev -1: host memory; vmm: cuMemCreate), filled, and registers it on c. */
void buf_init(struct buf *b, const char *name, int dev, int vmm, gpx_conn *c);
void buf_write(struct buf *b, size_t off, const void *src, size_t n);
void buf_read(struct buf *b, size_t off, void *dst, size_t n);
/* One random copy a -> b through the daemon, checked with guard bytes on both sides. */
bool random_copy(gpx_conn *c, struct buf *a, struct buf *b);
/* The primary context of every device into ctx, their count into ndev. */
void init_cuda(void);
/* Regions the test's daemon holds (over a connection of its own), or -1. */
int regions_now(void);
/* Lines of a daemon's log that contain `what`. */
int log_count(const struct harness *h, const char *what);
/* Sends a Register (and fd, if >= 0); returns the reply's status (-1: none). */
int raw_send_register(int sock, Gpx__Register *reg, int fd);

/* ---- gpu-test-copy.c ---- */

void test_matrix(gpx_conn *c, struct buf *bufs, int nb);
void test_small_batched(gpx_conn *c, struct buf *a, struct buf *b, size_t size, size_t depth);
void test_done_after_bytes(gpx_conn *c, struct buf *a, struct buf *h);
void test_done_after_bytes_waves(void);
void test_loop_early_wake(gpx_conn *c);
void test_wake_after_spin(const char *sock, gpx_conn *c);
void test_prewake(gpx_conn *c, struct buf *a, struct buf *b);
void test_vectored(gpx_conn *c, struct buf *a, struct buf *b, size_t page, int n, bool odd);
void test_link_split(gpx_conn *c, struct buf *a, struct buf *b);
void test_pages(gpx_conn *c, struct buf *a, struct buf *b, size_t page, uint32_t n, size_t so, size_t dof);
void test_pages_big(gpx_conn *c);
void test_pages_table(gpx_conn *c, struct buf *a, struct buf *b, int tdev, size_t page, uint32_t n);
void test_interior(gpx_conn *c, struct buf *src);
void test_cached_registration(gpx_conn *c, struct buf *b);
void test_cache_shared(const char *sock, struct buf *ipc, struct buf *vmm);

/* ---- gpu-test-procs.c: the child roles (argv[1] names one) and the tests that run them ---- */

int child_owner(const char *sock, const char *name, int dev);
int child_victim(const char *sock, int dev);
int child_freer(const char *sock, const char *name, int dev);
int child_hog(const char *sock, int dev, const char *mode, bool same_uid);
int child_arena(const char *sock);
void test_two_processes(const char *self, const char *sock, gpx_conn *c, int dev);
void test_client_dies(const char *self, const char *sock, gpx_conn *c, struct buf *a, struct buf *b, int dev);
void test_owner_frees(const char *self, const char *sock, gpx_conn *c, struct buf *dst, int dev);
void test_small_under_load(const char *self, const char *sock, gpx_conn *c, struct buf *a, struct buf *b, int dev);
void test_arena_share(const char *self, const char *sock, gpx_conn *c);

/* ---- gpu-test-refuse.c ---- */

void test_forged(struct harness *h);
void test_multitenant(void);
void test_sticky(void);

/* ---- gpu-test-pool.c ---- */

void test_pool(void);

#endif
