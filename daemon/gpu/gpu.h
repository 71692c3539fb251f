/*
 * The GPU back end (gpu/), as the layers above see it: devices by UUID and the peer matrix
 * (gpu.c), the memory kinds cuda-ipc and cuda-pool (gpu-map.c) and cuda-vmm (vmm.c), the copy
 * workers, one per GPU, and the page arena of the copy kernel (gpu-copy.c), NVLinks (nvml.c)
 * and the driver behind plain C types (cuda.c, the only file that includes cuda.h).  Built
 * without CUDA, gpu-none.c keeps this interface and says why nothing runs.
 *
 * It uses the core alone.  The copy workers take their chunks from the engine through the
 * chunk source engine_init hands down (gpu_chunks_from) and lend an idle core to the function
 * levent.c registers (gpu_on_idle); they call nothing above them.  The fabric, above, stages
 * GPU memory through the few driver calls at the end of this header.  internal.h is the
 * folder's own header.
 */
#ifndef GPX_GPU_GPU_H
#define GPX_GPU_GPU_H

#include "daemon/gpxd.h"

/* ---- gpu.c: devices, start and stop, topology ---- */
int gpu_init(char *why, size_t whylen);
int gpu_count(void);
const char *gpu_status(void);
/* What an idle copy worker lends its core to (xfer_help: a long page list's check), set at start. */
void gpu_on_idle(void (*fn)(void));
/* Where the copy workers take their chunks from: the engine's, set by engine_init. */
void gpu_chunks_from(const struct chunk_source *);
uint64_t gpu_naps(void);      /* naps of the copy workers through long copies, since start */
uint64_t gpu_batched(void);   /* small chunks issued with others in one launch, since start */
uint64_t gpu_split(void);     /* chunks split between copy engines and the kernel */
bool gpu_topo(Gpx__QueryReply *);     /* false: out of memory, the lists cut short */
void gpu_topo_free(Gpx__QueryReply *);
const char *gpu_pci(int dev);                /* its PCI bus id, NULL for none */
void gpu_host_register(struct region *);     /* pins a host mapping for DMA, best effort */
/* The node's cache of opened GPU handles (gpu-map.c, vmm.c), for gpxctl status. */
struct gpu_cache {
	uint32_t ipc, pool;      /* allocations held open: legacy IPC (node-wide), pool */
	uint32_t vmm;            /* VMM pieces held (per connection) */
	uint64_t opens;          /* driver opens and imports */
	uint64_t hits;           /* registrations served from what was held, no driver call */
};
void gpu_cache_stats(struct gpu_cache *s);
bool gpu_released(struct region *r);        /* the driver has let go of r's memory */
bool gpu_vmm_fd_ok(int fd, char *err, size_t errlen);  /* cheap type check before any driver call */
int gpu_dev_by_uuid(const uint8_t uuid[16]);            /* -1: no such GPU here */
/*
 * A page transfer of npairs pairs that the copy kernel would run: room for its page list (n
 * struct gpx_wire_page) in pinned memory the kernel reads in place, followed by the pairs'
 * addresses (filled in here from their regions and bases), and in *dev the GPU whose worker
 * runs it; else NULL (then the pages go as plain segments).  Freed with gpu_pages_free.
 * With list (a client's page list in GPU memory, at list_off of that region), no room for
 * records: the pairs, then the word the kernel sets for a page out of its region (*oob,
 * cleared), and in *list_addr where that GPU's kernel reads the list; NULL where no such
 * kernel can (nor a mapping of list on its GPU), and NULL with *dev set where it could but the
 * arena has no room: *refused -ENOSPC (no free run that long) or -EDQUOT (u, the uid the
 * transfer is charged to, would hold more than its share, half the arena).
 */
struct gpx_wire_page *gpu_pages_alloc(const struct jpair *pairs, uint32_t npairs, uint64_t page_size,
    uint32_t n, const struct region *list, uint64_t list_off, uint64_t *list_addr, volatile uint32_t **oob,
    struct user *u, int *dev, int *refused);
void gpu_pages_free(struct gpx_wire_page *);
/* The arena: its size (0: none), grain and one uid's share in bytes, takes refused for room and for share. */
struct gpu_arena {
	uint64_t size, grain, share;
	uint64_t refused[2];
};
void gpu_pages_stats(struct gpu_arena *);

/* ---- vmm.c: cuda-vmm memory, mirrors of clients' reservations (mem_cuda_vmm_ops) ---- */
int vmm_check(const struct region *r, char *err, size_t errlen);
int vmm_bind(struct region *r, uint32_t *missing, uint32_t *nmissing, char *err, size_t errlen);
int vmm_import(uint64_t owner, int dev, uint64_t res, uint64_t res_size, const struct gpx_wire_piece *pc,
    const int *fds, uint32_t n, char *err, size_t errlen);
void vmm_sweep(uint64_t owner);
void vmm_park(uint64_t owner, const int *fds, uint32_t n);   /* a Pieces message's fds, closed later */
uint64_t vmm_stats(uint64_t *hits, uint32_t *pieces);    /* imports; hits and pieces held */
void gpu_host_unpin(void *map);         /* undoes gpu_host_register; may block */
void gpu_shutdown(void);

/* ---- gpu-map.c, vmm.c: the GPU memory kinds ---- */
extern const struct mem_ops mem_cuda_ipc_ops;
extern const struct mem_ops mem_cuda_vmm_ops;
extern const struct mem_ops mem_cuda_pool_ops;

/* ---- cuda.c: the driver calls the fabric stages GPU memory with (fabric/stage.c, rdma-mr.c) ---- */
const char *cuda_errstr(int code);
int cuda_use(int dev);
int cuda_stream_new(void **s);
void cuda_stream_free(void *s);
int cuda_stream_sync(void *s);
int cuda_copy(void *s, uint64_t dst, uint64_t src, uint64_t n);
int cuda_host_alloc(void **p, size_t n);
void cuda_host_free(void *p);
int cuda_dmabuf(uint64_t dptr, uint64_t len, uint64_t *off, uint64_t *size);   /* fd, or -CUresult */

#endif
