/*
 * The internal interface of libgpxclient (not installed) that client-lib/cuda.c and the Python
 * module use.  The library's own files share more through client-private.h.
 */
#ifndef GPX_CLIENT_H
#define GPX_CLIENT_H

#include <stdbool.h>

#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"
#include "proto/ring.h"

int client_register(gpx_conn *c, Gpx__Register *reg, int fd, gpx_region *out);
/*
 * A VMM Register naming the n pieces under its range (proto/ring.h struct gpx_wire_piece).
 * -GPX_ENOENT with *nmissing > 0: the daemon lacks those pieces (indexes into pieces, in
 * missing[], which holds GPX_MISSING_MAX): send them with client_send_pieces and ask again.
 */
int client_register_pieces(gpx_conn *c, Gpx__Register *reg, const struct gpx_wire_piece *pieces, size_t n,
    gpx_region *out, uint32_t *missing, size_t *nmissing);
/* Pieces of a reservation with their fds (at most GPX_PIECES_MAX); the fds are not taken. */
int client_send_pieces(gpx_conn *c, const uint8_t uuid[16], uint64_t res, uint64_t res_size,
    const struct gpx_wire_piece *pieces, const int *fds, size_t n);
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
/*
 * The CUDA driver's entry points, by name (client-lib/cuda.c; only in builds with CUDA): loads
 * libcuda.so.1 and sets *fns[i] to names[i]'s, 0 or -1 with err saying why.  A file lists its
 * functions once, FUNCS(X) as X(cuFoo) X(cuBar), and passes { FUNCS(CLIENT_CUDA_NAME) } and
 * { FUNCS(CLIENT_CUDA_SLOT) } for its pointers p_cuFoo, p_cuBar.
 */
int client_cuda_resolve(const char *const names[], void **const fns[], size_t n, char *err, size_t errlen);
#define CLIENT_CUDA_NAME(f) #f,
#define CLIENT_CUDA_SLOT(f) (void **)&p_##f,

/* Whether completion records wait in c's ring (no system call): what a spinning wait looks at. */
bool client_ring_ready(const gpx_conn *c);
/*
 * How long a wait looks at the ring before it sleeps, seconds: GPX_WAIT_SPIN_US when set
 * (0 .. 1,000,000), else CLIENT_WAIT_SPIN_S, or CLIENT_WAIT_SPIN_BIG_S on a machine of
 * CLIENT_SPIN_BIG_CPUS or more CPUs (as a CUDA synchronize spins where cores are plenty).
 * A spinning thread brackets its looks with client_spin_begin/end (each once however often
 * it is called, until the other); after the end it looks once more before it sleeps.
 */
double client_wait_spin(const gpx_conn *c);
void client_spin_begin(gpx_conn *c);
void client_spin_end(gpx_conn *c);
/*
 * The caller's eventfd of c is a doorbell only, whose writes nobody counts (the Python
 * module's, which it writes too, to wake its own waiters): as with the library's own, gpxd
 * writes none while a wait spins and may write one early for a sleeping wait.
 */
void client_doorbell_plain(gpx_conn *c);
/* A thread about to sleep on c's fd, and awake again: gpxd may wake it a little before a long
 * transfer's record (cq_sleepers), and then it should spin afresh. */
void client_sleep_begin(gpx_conn *c);
void client_sleep_end(gpx_conn *c);
#define CLIENT_WAIT_SPIN_S 30e-6
#define CLIENT_WAIT_SPIN_BIG_S 1e-3
#define CLIENT_SPIN_BIG_CPUS 8
/* A long spin reads the socket (refusals) at least this often. */
#define CLIENT_SPIN_SLICE_S 20e-6

#endif
