/*
 * The integration tests' harness: a real gpxd (the binary named by $GPXD) on a private socket in
 * a fresh temporary directory, with a configuration file written here, started and stopped like
 * an operator would (SIGTERM), and its open descriptors counted through /proc/PID/fd so that
 * tests can check that everything a client brought in is gone again.  Also a few helpers that
 * speak the wire protocol directly (proto/wire.h and the generated protobuf-c code), for input
 * that libgpxclient would never produce.
 */
#ifndef GPX_TESTS_HARNESS_H
#define GPX_TESTS_HARNESS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto/gpx.pb-c.h"
#include "proto/wire.h"

struct harness {
	pid_t pid;
	char dir[64];           /* the private temporary directory */
	char sock[100];
	char conf[100];
	char log[100];          /* gpxd's stderr */
	int baseline;           /* gpxd's open fds with no client connected */
	int ring_entries;       /* as configured */
	int nofile;             /* RLIMIT_NOFILE (soft and hard) gpxd starts with; 0 = inherited */
};

/*
 * Writes the test configuration (plus `extra`, ini text appended verbatim, may be NULL), starts
 * gpxd, waits until it answers on its socket and measures the baseline.  0, or -1 with a reason
 * printed as a TAP comment.
 */
int harness_start(struct harness *h, const char *extra);
/* As harness_start, with gpxd's descriptor limit (soft and hard) set to nofile. */
int harness_start_nofile(struct harness *h, const char *extra, int nofile);
/* SIGTERM, then reaps it; returns its exit status, or -1 if it died by a signal or hung. */
int harness_stop(struct harness *h);
/*
 * Starts gpxd again, after harness_stop or a kill, with the same directory, socket path and
 * configuration, and measures the baseline anew.  0 or -1.
 */
int harness_respawn(struct harness *h);
/* In a child about to exec gpxd: stdin and stdout /dev/null, stderr log, every other descriptor closed. */
void harness_child_fds(int log);
/* Removes the temporary directory. */
void harness_cleanup(struct harness *h);
/* Whether a line of the daemon's log holds needle. */
bool harness_log_has(const struct harness *h, const char *needle);
/* Prints the daemon's log as TAP comments (after a failure). */
void harness_dump_log(const struct harness *h);
/* The page of gpxd's metrics endpoint (malloc'ed), from the port its log announced; NULL if none. */
char *harness_metrics(const struct harness *h);
/* The value of the sample of `page` whose name and labels are exactly `key` ("name{labels}"), or -1. */
double metrics_sample(const char *page, const char *key);
/* One sample of gpxd's metrics page now (metrics_sample of harness_metrics), or -1. */
double harness_metric(const struct harness *h, const char *key);
/* A program's last check: stops gpxd, one TAP line for a clean exit (the log shown if not), cleans up. */
void harness_finish(struct harness *h);

/* gpxd's open descriptors now, or -1. */
int harness_fds(const struct harness *h);
/*
 * Waits (up to timeout_ms) until gpxd has exactly `want` descriptors open; returns the last
 * count.  Cleanup after a disconnect runs asynchronously in the daemon, so tests wait for the
 * count to settle rather than sample it once; a leak shows as a count that never comes back.
 */
int harness_wait_fds(const struct harness *h, int want, int timeout_ms);

/* ---- the wire protocol, spoken directly ---- */

/* A connected SOCK_SEQPACKET socket to the daemon, or -1. */
int harness_connect(const struct harness *h);
/* Sends one ClientMsg with fds; 0 or -errno. */
int harness_send(int sock, Gpx__ClientMsg *m, const int *fds, int nfds);
/*
 * Receives one DaemonMsg (waiting up to timeout_ms); its fds land in fds/nfds (may be NULL:
 * then they are closed).  Returns the message, whose body is always a Reply (free it with
 * gpx__daemon_msg__free_unpacked(m, NULL)), or NULL on EOF, error or timeout; *eof (may be
 * NULL) tells EOF apart.
 */
Gpx__DaemonMsg *harness_recv(int sock, int timeout_ms, int *fds, int *nfds, bool *eof);
/*
 * Hello with `version`; with efd < 0 a query-only (no_ring) Hello.  Returns the answer (Welcome
 * or refusal); the ring memfd of a Welcome lands in *ring_fd (may be NULL: then it is closed).
 */
Gpx__DaemonMsg *harness_hello(int sock, uint32_t version, int efd, int *ring_fd);
/*
 * A new connection says Hello and registers a made-up legacy CUDA IPC handle of 4096 bytes;
 * returns gpxd's reply (free it), or NULL when none came within 5 s.  The connection is closed.
 */
Gpx__DaemonMsg *harness_register_legacy(const struct harness *h);
/*
 * A raw client that said Hello with `version` (and an eventfd, closed here) and handed over a
 * segment area of len bytes, mapped writable at *area (munmap it); the socket, or -1.  For
 * requests whose lists live in the area, built by hand.
 */
int harness_area_client(const struct harness *h, uint32_t version, unsigned char **area, size_t len);
/*
 * Sends m and waits up to timeout_ms for its answer: the Reply's status, or -1 when none came.
 * With reply non-NULL the message itself lands there (free it with
 * gpx__daemon_msg__free_unpacked(*reply, NULL)).
 */
int harness_request(int sock, Gpx__ClientMsg *m, const int *fds, int nfds, int timeout_ms, Gpx__DaemonMsg **reply);
/* What the daemon's status counts (the asking connection is one of the clients). */
struct harness_status {
	int clients;
	int regions;
	int exports;
	int inflight;
	/* the handle cache: allocations held open (legacy IPC, pool), VMM pieces, opens, hits */
	unsigned cache_ipc, cache_pool, cache_vmm;
	unsigned long long cache_opens, cache_hits;
};
/* Asks for the daemon's status on a fresh query-only connection; 0 or -1. */
int harness_status(const struct harness *h, struct harness_status *st);
/* Asks for the daemon's status on a fresh query-only connection: clients connected, or -1. */
int harness_clients(const struct harness *h);
/* Waits up to timeout_ms for the daemon to close the connection (recv returns 0). */
bool harness_wait_eof(int sock, int timeout_ms);

#endif
