/*
 * What the test programs that drive a real gpxd through libgpxclient share: a random
 * generator and fills from it, host buffers gpxd accepts, a connected client, waits for a
 * transfer's completion, and the start and end of such a program.  Each program defines H, the daemon it started (tests/harness.h).
 */
#ifndef GPX_TESTS_TCLIENT_H
#define GPX_TESTS_TCLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"

#define WAIT_MS 30000          /* a hang, not a slow machine, is what this limit catches */

extern struct harness H;

uint64_t rnd(uint64_t *s);
/* p[0..n) becomes 0..n-1 in a random order. */
void shuffle(uint32_t *p, uint32_t n, uint64_t *seed);
void fill_random(void *p, size_t n, uint64_t *seed);

/* A host buffer gpxd accepts, optionally registered on a connection. */
struct buf {
	int fd;
	unsigned char *p;
	size_t len;
	gpx_region r;
};
int buf_new(struct buf *b, size_t len);
int buf_reg(gpx_conn *c, struct buf *b, unsigned flags);
void buf_free(struct buf *b);

/* A client of H, connected and settled (see tclient.c), or NULL. */
gpx_conn *client(const char *name);
/* Status of one tag's completion (0 or -GPX_E*), or the wait's own error. */
int wait_tag(gpx_conn *c, uint64_t tag, uint64_t *bytes);
/* Collects every completion already delivered or arriving within ms. */
int drain(gpx_conn *c, struct gpx_completion *out, int max, int ms);
/* gpxd's status, unpacked (free with gpx__query_reply__free_unpacked); NULL if it did not answer. */
Gpx__QueryReply *status_query(gpx_conn *c);

/*
 * A raw client with a ring, for what the library would not do: Hello with an eventfd, the ring
 * mapped, one memfd of 64 KiB registered (region); ring_head is the records gpxd posted,
 * wait_head waits until there are want of them.
 */
struct raw {
	int sock;
	int efd;
	struct gpx_ring_hdr *ring;
	size_t ring_len;
	uint32_t entries;
	uint64_t region;
	struct buf mem;
	uint32_t seq;
};
int raw_open_on(struct raw *w, const struct harness *h, uint32_t version);     /* a daemon other than H */
int raw_open_v(struct raw *w, uint32_t version);
int raw_open(struct raw *w);
void raw_close(struct raw *w);
/* Sends a Register of len bytes of host memory fd on w (its reply is the caller's to read): its seq, or 0. */
uint32_t raw_send_register(struct raw *w, int fd, uint64_t len);
/* Publishes w's submission queue up to tail and sends SqKick, as the library does when gpxd sleeps: 0 or -1. */
int raw_kick(struct raw *w, uint64_t tail);
uint64_t ring_head(struct raw *w);
bool wait_head(struct raw *w, uint64_t want);

/* Starts H with the tests' configuration, stdout line-buffered, SIGPIPE ignored; bails out if it cannot. */
void start_gpxd(void);
void start_gpxd_with(const char *extra);     /* the same, with configuration added (harness_start) */
/* The end of a program: gpxd's log after a failure, its directory removed, the plan; the exit status. */
int finish(void);

#endif
