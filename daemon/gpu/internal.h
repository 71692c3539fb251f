/*
 * What the files of the GPU back end share, and nothing outside gpu/ includes: between gpu.c
 * (devices, mappings, copy workers) and cuda.c (the driver, behind plain C types).  Nothing
 * here names a CUDA type.  gpu.h is the folder's face.
 */
#ifndef GPXD_GPU_INTERNAL_H
#define GPXD_GPU_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/gpu/gpu.h"

struct region;

struct gpu_info {
	char name[128];
	char pci[32];
	uint8_t uuid[16];
	uint64_t memory;
	int copy_engines;
	int sms;
	bool vmm_fd;
};

struct gpu_link {
	bool access;
	int rank;
	bool atomics;
	int nvlinks;             /* NVLinks straight to the other GPU */
	bool nvswitch;           /* both GPUs have NVLinks to NVSwitches */
};

/* nvml.c: a GPU's NVLinks that are up, by where they lead (NVML; -1 where it cannot say). */
#define GPU_NVLINKS_MAX 32
struct gpu_nvlinks {
	int up, to_switch, ngpu;
	uint32_t gpu[GPU_NVLINKS_MAX];   /* the far GPU of each other link, as nvml_pci_key */
};
int nvml_nvlinks(const char *pci, struct gpu_nvlinks *out);
uint32_t nvml_pci_key(const char *pci);    /* "0000:18:00.0": domain, bus and device; 0 if not */

int cuda_load(char *why, size_t whylen);
int cuda_driver_version(void);
int cuda_device_info(int dev, struct gpu_info *);
int cuda_peer(int a, int b, struct gpu_link *);
int cuda_load_kernel(int dev);
int cuda_stream_new_urgent(void **s);    /* of the greatest priority: for small copies */
int cuda_stream_busy(void *s);
bool cuda_mps(int dev);                  /* shared through CUDA MPS */
int cuda_copy_peer(void *s, uint64_t dst, int dst_dev, uint64_t src, int src_dev, uint64_t n);
int cuda_signal(void *s, uint64_t word, uint64_t val);
struct gpu_kseg;
/* n segments listed in pinned host memory, which the kernel reads in place. */
int cuda_kernel_copy(int dev, void *s, const struct gpu_kseg *segs, uint32_t n, uint32_t blocks);
/*
 * n <= GPU_KFEW_MAX segments of `bytes` together, passed by value: no staging, no copy engine;
 * with word (pinned, else 0), seq written there when all of them are done (as cuda_signal).
 */
int cuda_kernel_copy_few(int dev, void *s, const struct gpu_kseg *segs, uint32_t n, uint64_t bytes, uint32_t blocks,
    uint64_t word, uint64_t seq);
/*
 * Where the page kernel reads a list of npages entries: entry e is page number sp[e * stride]
 * of the source and dp[e * stride] of the destination (uint32_t each).  gpxd's checked copy
 * (struct gpx_wire_page in pinned host memory: dp = sp + 4, stride 2, no limits, oob 0), or
 * a client's list in GPU memory (stride 1, checked by the kernel against lim_src / lim_dst,
 * which sets the word at oob for a page it leaves out).
 */
struct gpu_plist {
	uint64_t sp, dp;
	uint32_t stride;
	uint32_t lim_src, lim_dst;
	uint64_t oob;
};
/*
 * pages: the list as above and the pairs' struct gpu_kpair in pinned host memory, read by the
 * kernel in place; items [item0, item0 + nitems) of pairs x pages, bytes [head, head + bytes)
 * of them
 */
int cuda_kernel_pages(int dev, void *s, const struct gpu_plist *l, uint32_t npages, const void *pairs, uint32_t item0,
    uint32_t nitems, uint64_t size, uint64_t head, uint64_t bytes, uint32_t blocks);
int cuda_host_register(void *p, size_t n, bool read_only);
void cuda_host_unregister(void *p);
int cuda_ipc_open(int dev, const uint8_t handle[64], uint64_t *dptr);
void cuda_ipc_close(int dev, uint64_t dptr);
int cuda_addr_range(uint64_t dptr, uint64_t *base, uint64_t *size);
int cuda_pool_import(int owner, int fd, const uint8_t data[64], uint32_t access_mask, uint64_t *dptr,
    uint64_t *pool);
void cuda_pool_release(int owner, uint64_t dptr, uint64_t pool);
int cuda_vmm_reserve(uint64_t size, uint64_t *va);
void cuda_vmm_unreserve(uint64_t va, uint64_t size);
int cuda_vmm_import(int owner, int fd, uint64_t *handle);
int cuda_vmm_map(uint64_t va, uint64_t size, uint64_t handle, uint32_t access_mask);
void cuda_vmm_unmap(uint64_t va, uint64_t size);
void cuda_vmm_release(uint64_t handle);

/* gpu.c: the devices that can reach dev's memory; whether a's copies can reach b's memory. */
uint32_t gpu_access_mask(int dev);
bool gpu_peer_access(int a, int b);
/* gpu-map.c: an IPC region's address in GPU dev's context, 0 where it could not be opened. */
uint64_t gpu_map_addr_on(const struct region *r, int dev);
/* gpu-copy.c: the copy workers of GPUs 0..n-1 and the page arena. */
int gpu_workers_start(int n, char *why, size_t whylen);
void gpu_workers_stop(void);

/* One segment of an SM-kernel copy: absolute addresses (copy-kernel.cu has the same layout). */
struct gpu_kseg {
	uint64_t src;
	uint64_t dst;
	uint64_t len;
};

#define GPU_KFEW_MAX 32           /* segments of one gpx_copy_few launch (copy-kernel.cu) */

/* A page job's pair for the kernel: the addresses of page 0 of each side (copy-kernel.cu). */
struct gpu_kpair {
	uint64_t src;
	uint64_t dst;
};

#endif
