/*
 * Internal interface between the parts of libgpxclient (not installed).
 */
#ifndef GPX_CLIENT_H
#define GPX_CLIENT_H

#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"

int client_register(gpx_conn *c, Gpx__Register *reg, int fd, gpx_region *out);
int client_error(gpx_conn *c, int code, const char *msg);

/*
 * For the Python module, which links the library's objects rather than libgpxclient.so (these
 * are not exported from it).  client_last_region: what the daemon said of the last region
 * registered or imported on c, its kind as gpxctl names it ("host", "cuda-ipc", "cuda-vmm",
 * "cuda-pool", "remote") and whether it is read-only.  client_refusal_hook: fn hears, from
 * inside the call that reads it, the daemon's reason for each transfer it refuses before it
 * runs (reason NULL when it gave none), before that refusal becomes a completion.
 */
const char *client_last_region(const gpx_conn *c, int *read_only);
void client_refusal_hook(gpx_conn *c, void (*fn)(void *arg, uint64_t tag, const char *reason), void *arg);

#endif
