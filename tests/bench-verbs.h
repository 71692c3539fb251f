/*
 * The raw-verbs anchor of gpx-bench's remote-import mode: what a program that drives RDMA
 * itself would do, in its own process, with as many queue pairs and rails as gpxd keeps to a
 * peer.  One side (tests/bench-export.c, on the exporting node) serves a buffer: it accepts
 * connections through librdmacm on a port of all addresses and gives each its buffer's address
 * and rkey in the accept's private data.  The other side (gpx-bench) connects QPS queue pairs
 * to each address of a list (one address a rail) and moves bytes with one-sided RDMA READ and
 * WRITE, a copy cut into chunks posted round robin over every queue pair, as gpxd cuts it
 * (READs in 64 KiB requests, two in flight a queue pair: the pacing RoCE needs).
 */
#ifndef GPX_BENCH_VERBS_H
#define GPX_BENCH_VERBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct verbs_server;
struct verbs_client;

/* Serves buf on port until verbs_server_stop; NULL with why filled when it cannot. */
struct verbs_server *verbs_serve(uint16_t port, void *buf, size_t len, char *why, size_t whylen);
void verbs_server_stop(struct verbs_server *s);

/*
 * spec: "ADDR:PORT[,ADDR:PORT...]", one entry a rail; qps queue pairs to each.  local: this
 * side's buffer of len bytes.  NULL with why filled when it cannot.
 */
struct verbs_client *verbs_connect(const char *spec, int qps, void *local, size_t len, char *why,
    size_t whylen);
/* One copy of len bytes (READ from or WRITE to the server's buffer at 0), in chunks; 0 or -1
 * (also when its requests do not complete within 5 s). */
int verbs_copy(struct verbs_client *c, bool read, size_t len, size_t chunk);
/* The queue pairs and rails connected, for the printout. */
int verbs_queue_pairs(const struct verbs_client *c);
int verbs_rails(const struct verbs_client *c);
size_t verbs_remote_len(const struct verbs_client *c);
void verbs_close(struct verbs_client *c);

#endif
