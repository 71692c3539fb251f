/*
 * gpxd to gpxd: the interfaces of the fabric's files, shared by them only (the rest of the
 * daemon sees daemon/fabric/fabric.h: fabric_init and its hooks).  By job:
 *
 *   fabric.c       the front door: fabric_init and the table of hooks the core calls
 *   peer.c         peer connections and their lifetime: framing, dispatch of messages to the
 *                  files below, keepalive, the tick, start and stop, gpxctl status and peers
 *   peer-dial.c    how connections come to be: the listener, configured addresses and those
 *                  dialled on demand, name resolution
 *   peer-auth.c    the handshake: versions and the mutual HMAC-SHA256 challenge, Ready
 *   peer-import.c  imports both ways: peers' handles on our exports, our imports of theirs
 *   hmac.c         SHA-256 and HMAC-SHA256 for that challenge
 *   remote.c       other nodes' memory as regions (memory kind `remote`), their Releases
 *   request.c      our requests to peers, the engine's PATH_FABRIC: chunks sent as Write/Read
 *                  or posted by RDMA, the window, answers, owners' notes, deadlines
 *   serve.c        peers' requests to us: Write, Read and Notify against their handles
 *   stage.c        GPU memory the NIC cannot reach: staged through pinned host buffers; the
 *                  dma-buf probe of exported GPU memory
 *   nic.c, nic.h   the node's RDMA NICs from sysfs, and the NIC of each GPU
 *   rdma-*.c       the RDMA transport (devices, queue pairs, registrations, data path, notes),
 *                  behind its private header rdma.h, the only one that includes
 *                  <infiniband/verbs.h> and <rdma/rdma_cma.h>; rdma-none.c without rdma-core
 *
 * Threads: everything here runs on the loop thread, except the `remote` kind's close (any
 * thread; it only queues a Release for the loop), fabric_rdma_region_gone (any thread, under
 * the registration lock), the kick hook (any thread) and stage.c's copies (its own thread).
 *
 * Where it stands: the control plane (peering, authentication, versions, remote exports and
 * imports, epochs, keepalive) and the tcp data transport are done and tested by
 * tests/fabric-tcp.test.  The RDMA data transport (librdmacm, RC queue pairs shared per
 * peer, RDMA WRITE/READ, per-import registrations of exports, a registration cache for local
 * regions) is tested with host memory between two Soft-RoCE guests by tests/vm-rdma.test; the
 * owner's notification after RDMA WRITEs is an RDMA WRITE with immediate data into the peer's
 * mailbox on a queue pair.  GPU memory on either side: registered with the NIC from a dma-buf
 * (ibv_reg_dmabuf_mr), else the device pointer (ibv_reg_mr, nvidia-peermem), else staged
 * (stage.c), each only when the one before is impossible; the staged path over tcp runs on the
 * GPU machines (tests/fabric-gpu.test), the registrations need a GPU and an RDMA NIC in one
 * machine, which this project has never had.  The NIC of each GPU is chosen by PCI distance
 * from sysfs (nic.c, shown by gpxctl topo, overridden by [fabric] nic_for_gpuN); rdma-dev.c
 * opens every device with an active port (or those [fabric] rdma_device names), host memory
 * and staged buffers are striped over all of them, and a GPU's memory is registered only on
 * its own NIC.
 */
#ifndef GPX_FABRIC_INTERNAL_H
#define GPX_FABRIC_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/gpxd.h"
#include "daemon/fabric/fabric.h"
#include "daemon/gpu/gpu.h"
#include "daemon/host/host.h"
#include "proto/peer.pb-c.h"

/*
 * Calls out of the fabric go down: into regions, exports, the engine's chunks, completion
 * queues, defer, log, conf and the wire arena.  The one upward by file is now_s(), the
 * daemon's clock, which lives in levent.c: reading a clock is not a call into the loop, and a
 * callback for it would only hide that.  Answers to the core go through its callbacks
 * (fabric_import_fn).
 */

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
#define PEER_FILL_MAX (1u << 20)        /* read or written a turn of the loop, at most */
#define PEER_NONCE_LEN 32
#define PEER_NAME_MAX 64              /* node names: export_node_name_ok (export.c) */
/* Why the node that decides closes the newer of two connections (peer-auth.c): the Bye's reason
 * and the kill's, which neither side logs as a peer going down. */
#define PEER_DUPLICATE "duplicate connection"

/* ---- peer.c: peer connections and their lifetime ---- */
enum peer_state { PEER_CONNECTING, PEER_HELLO, PEER_AUTH, PEER_READY, PEER_DEAD };

/* A handle a peer holds on one of our exports (it imported it). */
struct phandle {
	TAILQ_ENTRY(phandle) entry;
	uint64_t id;                 /* epoch << 32 | serial */
	struct region *r;            /* a reference */
	char export_name[65];
	bool read_only;
};

struct rpeer;

struct peer {
	TAILQ_ENTRY(peer) entry;
	struct bufferevent *bev;
	enum peer_state state;
	bool outbound;
	struct ptarget *target;      /* the address we dialled (configured or on demand), outbound only */
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
	uint64_t notes_imm_tx, notes_imm_rx;   /* owners' notifications by RDMA write with immediate */
	uint64_t notes_msg_tx, notes_msg_rx;   /* ... as messages (Write with notify, Notify) */
	uint32_t inflight;           /* our requests waiting for an answer */
	bool read_again;             /* reading found no memory: read again at the tick */
	char why[160];               /* why it went down, or the last error */
	struct rpeer *rdma;          /* its queue pairs (rdma-qp.c), NULL over tcp */
};
TAILQ_HEAD(peer_list, peer);
extern struct peer_list peers;
extern char peer_self[PEER_NAME_MAX + 1];    /* this node's name */

int peer_start(struct event_base *);         /* fabric_init: after engine_init */
void peer_stop(void);                        /* fails what waits on peers; before engine_shutdown */
/* The hooks of the same names (fabric.h). */
bool peer_query(Gpx__QueryReply *);          /* Q_PEERS; false: cut short, out of memory */
void peer_query_free(Gpx__QueryReply *);
const char *peer_status(void);               /* one line for status */

/* A connection on bev (connecting when outbound), from or to addr; NULL without memory. */
struct peer *peer_new(struct bufferevent *bev, bool outbound, const char *addr);
/*
 * Sends one framed message (and data, which may be NULL).  0; -1 if the peer is gone (or went
 * for it); -ENOMEM if no memory held the frame: nothing of it was queued, p stands.
 */
int peer_send(struct peer *, const Gpxpeer__PeerMsg *, const void *data, size_t len);
/* Says why in a Bye, on the wire at once: the connection is killed next. */
void peer_bye(struct peer *, const char *why);
/* The ready connection to node `name`, or NULL. */
struct peer *peer_by_node(const char *name);
struct peer *peer_by_epoch(const char *name, uint32_t epoch);
void peer_node_gone(const char *node, const char *why);    /* the hooks of the same names */
bool peer_node_up(const char *node);
struct phandle *peer_handle(struct peer *, uint64_t id);
void peer_kill(struct peer *, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- peer-auth.c: the handshake, versions and mutual authentication ---- */
int peer_auth_init(void);                    /* loads the key file; -1 (logged) when it cannot */
void peer_auth_forget(void);                 /* wipes the key */
/*
 * One side's proof under key: HMAC(key, label | version | nonce of the connecting side | nonce
 * of the answering side | its node name | the other's node name), names length-prefixed.
 */
void peer_auth_proof(const void *key, size_t keylen, const char *label, uint32_t version,
    const uint8_t *nonce_i, const uint8_t *nonce_r, const char *node_i, const char *node_r,
    uint8_t out[SHA256_LEN]);
void peer_auth_hello(struct peer *);         /* outbound, once connected: the first message */
/* A message before the connection is ready: Hello, Challenge, Auth or Ready, else it dies. */
void peer_auth_msg(struct peer *, const Gpxpeer__PeerMsg *);

/* ---- peer-dial.c: how connections come to be: the listener, the addresses we dial ---- */
/*
 * A peer address: a configured one is dialled until a connection to it is up; one dialled on
 * demand, for imports by address or of cluster names (hinted: the cluster gave the address;
 * no dial_on_demand needed), only when an import asks for it, and forgotten at the next
 * tick once no connection reaches its node and no import waits for it.
 */
struct ptarget {
	TAILQ_ENTRY(ptarget) entry;
	char addr[96];
	char node[PEER_NAME_MAX + 1];    /* learned at the first handshake */
	struct peer *p;                  /* the outbound connection, while there is one */
	bool resolving;
	bool on_demand;
	double t_next;
	char why[160];
};
int peer_dial_start(struct event_base *);    /* [fabric] listen and peers; -1 (logged) if bad */
void peer_dial_stop(void);
void peer_dial_tick(double now);             /* dials configured addresses, forgets others */
/* "HOST:PORT" or "[V6]:PORT" into host and port; false if malformed. */
bool peer_dial_split(const char *a, char *host, size_t hl, char *port, size_t pl);
/*
 * The address for an import by address: the configured one (or one dialled already), else a
 * new one to dial on demand when [fabric] dial_on_demand allows or the cluster gave it
 * (hinted); NULL with a gpx status and why otherwise.
 */
struct ptarget *peer_dial_target(const char *addr, bool hinted, int *status, char *err, size_t errlen);
void peer_dial(struct ptarget *);            /* resolves t's name, then connects */
void peer_dial_lost(struct peer *);          /* p, dialled, is dead: its address waits or retries */
const char *peer_dial_listening(void);       /* [fabric] listen, or "" */
size_t peer_dial_count(void);                /* addresses known */
bool peer_dial_query(Gpx__QueryReply *);     /* appends those with no connection now */

/* ---- peer-import.c: imports, ours of peers' exports and peers' of ours ---- */
extern const struct fabric_exports *fabric_exports;   /* the connections' layer's (fabric.c) */
bool peer_import(const struct fabric_import *);     /* the hook (fabric.h) */
void peer_import_req(struct peer *, const Gpxpeer__ImportReq *);     /* a peer imports */
void peer_import_release(struct peer *, const Gpxpeer__Release *);   /* ... and lets go */
void peer_import_rep(struct peer *, const Gpxpeer__ImportRep *);     /* a peer answered ours */
int peer_import_let_go(struct peer *, uint64_t handle);   /* sends Release: we let go of it (peer_send) */
/* The connection for t is ready, p or the node's one kept instead: its waiting imports go out. */
void peer_import_target_ready(struct ptarget *t, struct peer *p);
/* The attempt to reach t failed: the imports waiting for it fail now, with the reason. */
void peer_import_target_down(struct ptarget *t, const char *why);
bool peer_import_waits_for(const struct ptarget *t);
void peer_import_down(struct peer *);        /* its imports fail, its handles on ours go */
void peer_import_tick(double now);           /* imports past their deadline fail */
void peer_import_stop(void);                 /* those still waiting fail */

#define FABRIC_RDMA_DEVS 8           /* RDMA devices a gpxd opens (its NICs, the rails) */

/* ---- remote.c: other nodes' memory as regions (memory kind `remote`) ---- */
struct remote {                  /* r->priv of a `remote` region */
	TAILQ_ENTRY(remote) rel;     /* once let go: queued for its Release (remote.c) */
	char node[PEER_NAME_MAX + 1];
	uint32_t epoch;              /* of the connection it was imported through */
	uint64_t handle;
	bool notify;                 /* the export notifies its owner: send Notify at a transfer's end */
	bool rdma;                   /* the owner registered the export for this import: */
	uint64_t raddr;              /* ... RDMA address of its first byte */
	uint32_t rkeys[FABRIC_RDMA_DEVS];   /* ... and the key on each of its devices (0: none);
	                                       bounds and rights enforced by its NIC */
};
/* The region of an import that peer p answered with handle; NULL without memory. */
struct region *remote_region(struct peer *p, uint64_t handle, uint64_t length, bool read_only);
/* The hook xfer_check: a transfer with a remote side is possible (connection alive)? */
int remote_xfer_check(const struct region *src, const struct region *dst, char *err, size_t errlen);
/* Loop thread: tells the peer that we let go of handle (if that connection still stands); 0,
 * or -ENOMEM when no memory held the message. */
int remote_release(const char *node, uint32_t epoch, uint64_t handle);
void remote_flush(void);                     /* loop thread: sends the Releases queued */
void remote_start(void);                     /* Releases may be queued from now on */
void remote_stop(void);                      /* ... no longer: those queued are dropped */

/* ---- request.c: our requests to peers, the engine's PATH_FABRIC ---- */
extern const struct chunk_source *fabric_chunks;   /* the engine's (fabric.c) */
int request_init(struct event_base *);
void request_shutdown(void);
void request_kick(void);                     /* any thread (the kick hook): new work, or Releases */
/* Loop thread: a Done arrived; consumes exactly dlen bytes of in (a Read's). */
void request_done(struct peer *, const Gpxpeer__Done *, struct evbuffer *in, size_t dlen);
/* The peer is gone: everything waiting on it fails now. */
void request_peer_down(struct peer *);
/* Loop thread, about every 100 ms: requests past their deadline fail. */
void request_tick(double now);
/* Loop thread: an RDMA work request posted for request id completed. */
void request_rdma_done(uint64_t id, bool ok, const char *why);

/* ---- serve.c: peers' requests to us, against their handles on our exports ---- */
/* Loop thread: a Write, Read or Notify arrived; consumes exactly datalen bytes of in. */
void serve_msg(struct peer *, const Gpxpeer__PeerMsg *, struct evbuffer *in, size_t datalen);
/* Loop thread: the peer's note arrived by RDMA: a transfer of bytes into its import handle ended. */
void serve_rdma_note(struct peer *, uint64_t handle, uint64_t bytes);

/* ---- rdma-*.c, the RDMA transport (private header rdma.h; rdma-none.c without rdma-core) ---- */
#define FABRIC_RDMA_TOKEN 32
/* 1: rdma is on; 0: tcp (why says why); -1: transport = rdma and it cannot be. */
int fabric_rdma_init(struct event_base *, char *why, size_t whylen);
void fabric_rdma_shutdown(void);
const char *fabric_rdma_device(void);        /* "rxe0 port 1, rxe1 port 1", NULL when off */
/*
 * Inbound side, before Ready: the rdma_cm port, a fresh token and our devices (index and
 * address, at most FABRIC_RDMA_DEVS) to announce; false: none.
 */
struct peer_rdev {
	uint32_t index;
	char addr[64];
};
bool fabric_rdma_offer(struct peer *, uint32_t *port, uint8_t token[FABRIC_RDMA_TOKEN],
    struct peer_rdev devs[FABRIC_RDMA_DEVS], size_t *ndevs);
/* Outbound side, after Ready: opens the queue pairs the peer announced, a pool per pair of devices. */
void fabric_rdma_connect(struct peer *, uint32_t port, const uint8_t *token, size_t tokenlen,
    const struct peer_rdev *devs, size_t ndevs);
/* The peer is going down: its queue pairs go first, before its chunks fail. */
void fabric_rdma_peer_down(struct peer *);
uint32_t fabric_rdma_qps(const struct peer *);     /* connected queue pairs */
uint32_t fabric_rdma_regs(const struct peer *);    /* registrations of our exports it holds */
/* An import of one of our exports: registers it for this import alone, on each device that
 * may carry it (its key by device index, 0 where not); false: tcp only. */
bool fabric_rdma_export(struct peer *, struct phandle *, uint64_t *addr, uint32_t rkeys[FABRIC_RDMA_DEVS]);
void fabric_rdma_unexport(struct phandle *);
/* Any thread: r's mapping is about to close; its RDMA registrations go first. */
void fabric_rdma_region_gone(struct region *);
/*
 * The owner's notification of a transfer into an export, by RDMA: a write with immediate
 * data into the peer's mailbox on a queue pair, after the transfer's bytes on that pair.
 */
struct fabric_note {
	uint64_t handle;             /* the import written into */
	uint64_t bytes;              /* the transfer's */
};
/*
 * Posts one RDMA WRITE (local -> remote) or READ (remote -> local) of len bytes at offset off
 * of the local region, host or GPU memory, and after a WRITE the note when there is one;
 * 0, 1: posted without the note (no queue pair could carry it), or -1: not by RDMA (over
 * tcp, or staged first).
 */
int fabric_rdma_post(struct peer *, uint64_t id, bool write, struct region *local, uint64_t off, uint64_t len,
    uint64_t raddr, const uint32_t rkeys[FABRIC_RDMA_DEVS], const struct fabric_note *);
/* The note alone, for request id; -1: no queue pair can carry it (send a Notify). */
int fabric_rdma_note(struct peer *, uint64_t id, const struct fabric_note *);
/* Handles every completion waiting: the notes that arrived before what the loop does next. */
void fabric_rdma_drain(void);
/* GPU memory registered with the NIC so far: from a dma-buf, through peermem, neither. */
void fabric_rdma_gpu_regs(uint64_t *dmabuf, uint64_t *peermem, uint64_t *none);

/* ---- stage.c ---- */
typedef void (*stage_fn)(void *arg, bool ok);
int stage_init(struct event_base *);         /* after gpu_init; nothing without a GPU */
void stage_shutdown(void);                   /* after the queue pairs are down */
/* Loop thread: a buffer for len bytes (pinned when one of the pool is free); NULL: no memory. */
void *stage_get(size_t len);
void stage_put(void *buf);
/* The pool's host region when buf is one of its buffers, with buf's offset in it. */
struct region *stage_pool(const void *buf, uint64_t *off);
/* Loop thread: copies len bytes between GPU memory (dev, dptr) and buf; done(arg, ok) later on it. */
void stage_copy(bool to_gpu, int dev, uint64_t dptr, void *buf, uint64_t len, stage_fn done, void *arg);
void stage_count_direct(uint64_t bytes);
/* Its part of the counters: the bytes by path, the copies, the pool. */
void stage_stats(struct fabric_gpu_stats *);
/* Loop thread: an export peers may import; of GPU memory, its dma-buf is obtained and checked
 * (on the stage thread), the verdict in r->gdr. */
void stage_probe(struct region *r);

#endif
