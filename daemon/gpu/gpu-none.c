/*
 * The GPU back end of a build without CUDA (configure --with-cuda=no, or no toolkit found):
 * gpxd serves host memory only and says why.
 */
#include "config.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "daemon/gpu/gpu.h"

const struct mem_ops mem_cuda_ipc_ops = { .name = "cuda-ipc" };
const struct mem_ops mem_cuda_vmm_ops = { .name = "cuda-vmm" };
const struct mem_ops mem_cuda_pool_ops = { .name = "cuda-pool" };

int
gpu_init(char *why, size_t whylen)
{
	snprintf(why, whylen, "gpxd was built without CUDA support");
	return -1;
}

int gpu_count(void) { return 0; }
const char *gpu_status(void) { return "unavailable: gpxd was built without CUDA support"; }
void gpu_shutdown(void) { }
bool gpu_topo(Gpx__QueryReply *q) { (void)q; return true; }
uint64_t gpu_naps(void) { return 0; }
uint64_t gpu_batched(void) { return 0; }
uint64_t gpu_split(void) { return 0; }
void gpu_topo_free(Gpx__QueryReply *q) { (void)q; }
const char *gpu_pci(int dev) { (void)dev; return NULL; }
void gpu_host_register(struct region *r) { (void)r; }
void gpu_host_unpin(void *map) { (void)map; }
void gpu_cache_stats(struct gpu_cache *s) { memset(s, 0, sizeof(*s)); }
bool gpu_released(struct region *r) { (void)r; return true; }
struct gpx_wire_page *gpu_pages_alloc(const struct jpair *s, uint32_t np, uint64_t ps, uint32_t n,
    const struct region *l, uint64_t lo, uint64_t *la, volatile uint32_t **oob, struct user *u, int *dev,
    int *refused)
{ (void)s; (void)np; (void)ps; (void)n; (void)l; (void)lo; (void)la; (void)oob; (void)u; (void)dev; *refused = 0; return NULL; }
void gpu_pages_free(struct gpx_wire_page *p) { (void)p; }
void gpu_pages_stats(struct gpu_arena *s) { memset(s, 0, sizeof(*s)); }
bool gpu_vmm_fd_ok(int fd, char *err, size_t errlen) { (void)fd; snprintf(err, errlen, "no GPU support"); return false; }
int vmm_check(const struct region *r, char *err, size_t errlen) { (void)r; snprintf(err, errlen, "no GPU support"); return -GPX__STATUS__ENOTSUP; }
int vmm_bind(struct region *r, uint32_t *m, uint32_t *nm, char *err, size_t errlen)
{ (void)r; (void)m; *nm = 0; snprintf(err, errlen, "no GPU support"); return -GPX__STATUS__ENOTSUP; }
int vmm_import(uint64_t o, int d, uint64_t res, uint64_t rs, const struct gpx_wire_piece *p, const int *fds, uint32_t n,
    char *err, size_t errlen)
{ (void)o; (void)d; (void)res; (void)rs; (void)p; (void)fds; (void)n; snprintf(err, errlen, "no GPU support"); return -GPX__STATUS__ENOTSUP; }
void vmm_sweep(uint64_t owner) { (void)owner; }
/* No VMM memory here: a Pieces message's fds are closed at once (vmm.c parks them a while). */
void vmm_park(uint64_t owner, const int *fds, uint32_t n)
{ (void)owner; for (uint32_t i = 0; i < n; i++) close(fds[i]); }
uint64_t vmm_stats(uint64_t *hits, uint32_t *pieces) { *hits = 0; *pieces = 0; return 0; }
int gpu_dev_by_uuid(const uint8_t uuid[16]) { (void)uuid; return -1; }
void gpu_on_idle(void (*fn)(void)) { (void)fn; }
void gpu_chunks_from(const struct chunk_source *s) { (void)s; }
