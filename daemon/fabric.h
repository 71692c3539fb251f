/*
 * gpxd to gpxd: the interfaces of the fabric subsystem, shared by its files only.
 *   hmac.c    SHA-256 and HMAC-SHA256 for the peers' mutual authentication
 *   peer.c    peer connections over TCP: connect and accept, authenticate, negotiate the
 *             version, keepalive, remote imports and the handles peers hold on our exports
 *   fabric.c  the engine path PATH_FABRIC: remote regions (memory kind `remote`), chunks of
 *             transfers sent as Write/Read to the peer, answers, owner notifications, timeouts;
 *             and the serving side of Write/Read/Notify for our exports
 * The rest of the daemon sees only the hooks declared at the end of daemon/gpxd.h.
 *
 * Threads: everything here runs on the loop thread, except mem_remote_ops.close, which may run
 * on a copy worker and only queues a Release for the loop.
 *
 * Where it stands: the control plane (peering, authentication, versions, remote exports and
 * imports, epochs, keepalive) and the tcp data transport are done and tested by
 * tests/fabric-tcp.test.  The RDMA data plane (fabric-rdma.c: librdmacm, shared RC queue pairs,
 * RDMA WRITE/READ, write with immediate for notifications, dma-buf / peermem / staged GPU
 * registration, NIC choice by PCI distance) is not written yet: transport = rdma refuses to
 * start and auto means tcp, said in the log and in gpxctl status and peers.  GPU memory is
 * refused on both sides of a remote copy (ENOTSUP, with the reason).  GPU memory over RDMA
 * (GPUDirect) cannot be run on any machine available to this project: the GPU machines have
 * no RDMA NIC and the Soft-RoCE guests (tests/vm) have no GPU, so that path can only be shown
 * on real hardware.
 */
#ifndef GPX_FABRIC_H
#define GPX_FABRIC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/gpxd.h"
#include "proto/peer.pb-c.h"

struct evbuffer;
struct bufferevent;

/* ---- hmac.c ---- */
#define SHA256_LEN 32
struct sha256 {
	uint32_t h[8];
	uint64_t len;
	uint8_t buf[64];
	size_t nbuf;
};
struct hmac {
	struct sha256 inner, outer;
};
void sha256_init(struct sha256 *);
void sha256_update(struct sha256 *, const void *, size_t);
void sha256_final(struct sha256 *, uint8_t out[SHA256_LEN]);
void hmac_init(struct hmac *, const void *key, size_t keylen);
void hmac_update(struct hmac *, const void *, size_t);
void hmac_final(struct hmac *, uint8_t out[SHA256_LEN]);
void hmac_sha256(const void *key, size_t keylen, const void *data, size_t len, uint8_t out[SHA256_LEN]);
bool hmac_equal(const uint8_t *a, const uint8_t *b, size_t len);

/* ---- wire limits of proto/peer.proto ---- */
#define PEER_PROTO_MIN 1
#define PEER_PROTO_MAX 1
#define PEER_MAGIC 0x47505850u          /* "GPXP" */
#define PEER_HDR_LEN 12
#define PEER_MSG_MAX (64 * 1024)        /* a packed PeerMsg, once authenticated */
#define PEER_PREAUTH_MAX 1024           /* ... before: Hello, Challenge, Auth, Ready, Bye */
#define PEER_DATA_MAX (16u << 20)       /* raw data after one message */
#define PEER_NONCE_LEN 32
#define PEER_NAME_MAX 64

/* ---- peer.c ---- */
enum peer_state { PEER_CONNECTING, PEER_HELLO, PEER_AUTH, PEER_READY, PEER_DEAD };

/* A handle a peer holds on one of our exports (it imported it). */
struct phandle {
	TAILQ_ENTRY(phandle) entry;
	uint64_t id;                 /* epoch << 32 | serial */
	struct region *r;            /* a reference */
	char export_name[65];
	bool read_only;
};

struct peer {
	TAILQ_ENTRY(peer) entry;
	struct bufferevent *bev;
	enum peer_state state;
	bool outbound;
	struct ptarget *target;      /* the configured address we dialled, outbound only */
	char addr[96];
	char node[PEER_NAME_MAX + 1];
	uint8_t nonce_local[PEER_NONCE_LEN], nonce_remote[PEER_NONCE_LEN];
	uint32_t version;
	uint32_t epoch;
	double t_start, t_ready, t_rx, t_tx;
	TAILQ_HEAD(, phandle) handles;
	uint32_t next_serial;
	uint32_t nimports;           /* remote regions we hold through this connection */
	uint64_t bytes_tx, bytes_rx, ops, errors;
	uint32_t inflight;           /* our requests waiting for an answer */
	char why[160];               /* why it went down, or the last error */
};
TAILQ_HEAD(peer_list, peer);
extern struct peer_list peers;

/* Sends one framed message (and data, which may be NULL).  0, or -1 if the peer is gone. */
int peer_send(struct peer *, const Gpxpeer__PeerMsg *, const void *data, size_t len);
/* The ready connection to node `name`, or NULL. */
struct peer *peer_by_node(const char *name);
struct phandle *peer_handle(struct peer *, uint64_t id);
void peer_kill(struct peer *, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- fabric.c ---- */
extern const struct mem_ops mem_remote_ops;
struct remote {                  /* r->priv of a `remote` region */
	char node[PEER_NAME_MAX + 1];
	uint32_t epoch;              /* of the connection it was imported through */
	uint64_t handle;
	bool notify;                 /* the export notifies its owner: send Notify at a transfer's end */
};
int fabric_init(struct event_base *);
void fabric_shutdown(void);
struct region *fabric_remote_region(struct peer *, uint64_t handle, uint64_t length, bool read_only);
/* Loop thread: a Write, Read, Notify or Done arrived; consumes exactly datalen bytes of in. */
void fabric_on_msg(struct peer *, const Gpxpeer__PeerMsg *, struct evbuffer *in, size_t datalen);
/* The peer is gone: everything waiting on it fails now. */
void fabric_peer_down(struct peer *);
/* Loop thread, about every 100 ms: requests past their deadline fail. */
void fabric_tick(double now);
void fabric_release(const char *node, uint32_t epoch, uint64_t handle);

#endif
