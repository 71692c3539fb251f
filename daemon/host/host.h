/*
 * Host memory (host/), as the layers above see it: memory kind host, sealed memfds mapped into
 * the daemon (mem-host.c), and the copy of a host-path chunk.  It uses the GPU back end (to pin
 * a mapping for DMA) and the core; nothing above it.
 */
#ifndef GPX_HOST_HOST_H
#define GPX_HOST_HOST_H

#include "daemon/gpxd.h"

/* ---- mem-host.c: memory kind host ---- */
extern const struct mem_ops mem_host_ops;
bool mem_host_fd_ok(int fd, char *err, size_t errlen);
/* memmove for a host-path chunk; streaming stores when the job (job_bytes) exceeds the caches. */
void mem_host_copy(void *dst, const void *src, size_t n, uint64_t job_bytes);
/* Its non-temporal copy from now on: 0 four pages interleaved, 1 line after line; -1 chooses
 * again, by timing both on the next large jobs' first chunks (as at start).  For tests. */
void mem_host_nt_way(int way);
/* The order in use, by name; NULL until chosen. */
const char *mem_host_nt_order(void);

#endif
