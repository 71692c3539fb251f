/*
 * The fabric, gpxd to gpxd, as the rest of the daemon sees it: this header is all that may be
 * called of daemon/fabric/ from outside it (internal.h is the folder's own).
 *
 * gpxd calls fabric_init once, at start, and only when gpxd.conf turns the fabric on
 * (fabric_configured: [fabric] listen, peers or dial_on_demand).  It returns the table of hooks
 * below, which levent.c keeps in `fabric`; the core calls a hook only while `fabric` is set, and
 * otherwise does what a daemon without peers does (no such export, nothing remote, zeros).  So
 * without the fabric none of its code runs: no thread, socket, timer or RDMA device.  A reload
 * neither starts nor stops it, as before: turning it on or off takes effect at restart (the
 * keys it reads at each use, such as timeout, at once).  Once set, `fabric` stays set until
 * the process exits, so that kick, which other threads call, never sees it change; after stop
 * the hooks find nothing to do.  What the fabric must hear of regions (a mapping about to
 * close) it registers with the core at start (region_on_gone).
 *
 * One thing is not behind fabric_init: nic_topo, the node's RDMA NICs read from sysfs, which
 * gpxctl topo shows whether or not the fabric runs (daemon/fabric/nic.c; it reads files only).
 *
 * Results go up through callbacks the layers above hand down: an import's answer through the
 * fabric_import_fn that client/conn-export.c passes with it; the exports peers import through
 * the table client/ registers (fabric_exports_from); the engine's chunks through its chunk
 * source (fabric_chunks_from).  The fabric calls down only: into the core (regions,
 * completion queues, defer, log, conf, the clock), the GPU back end and host memory.
 */
#ifndef GPX_FABRIC_FABRIC_H
#define GPX_FABRIC_FABRIC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/gpxd.h"

/*
 * The answer to an import, exactly once, on the loop thread, possibly before the import hook
 * returns: status 0 with r, a region of kind `remote` holding one reference that the callee
 * takes over (r->uid is the asker's), or a gpx status and a message saying why.
 */
typedef void (*fabric_import_fn)(void *arg, int status, const char *msg, struct region *r, bool read_only);

/* A client's import of another node's export, as the fabric needs it. */
struct fabric_import {
	const char *name;            /* "NODE:name" or "@HOST:PORT/name" (borrowed for the call) */
	uid_t uid;                   /* the asker's: the region's uid, and named in the log */
	const struct logwho *log_as; /* the asker's share of the log (borrowed for the call) */
	fabric_import_fn done;
	void *arg;
	/* Set by the cluster (daemon/cluster/): the export's name on `node`, whose fabric address
	 * etcd gives as `addr`; dialled even without dial_on_demand, and the node that answers
	 * there must be `node`.  NULL otherwise. */
	const char *export_name, *node, *addr;
};

/* GPU memory between nodes, by path (stage.c, the RDMA registrations): gpxctl peers, metrics. */
struct fabric_gpu_stats {
	uint64_t direct_bytes;       /* moved by the NIC itself */
	uint64_t staged_bytes, staged_copies, heap_copies;
	uint64_t pool_bytes;         /* pinned staging buffers */
	uint64_t dmabuf_regs, peermem_regs, unregistrable;   /* registrations with a NIC, by how */
};

struct fabric_ops {
	/*
	 * conn.c: an import by a name that no local export has: "NODE:name" of a peer, or
	 * "@HOST:PORT/name".  false: not a name of the fabric's (done is not called); true: done
	 * answers it, now or when the peer has.
	 */
	bool (*import)(const struct fabric_import *);
	/* conn.c, loop thread: r was exported to peers; of GPU memory, its dma-buf is obtained and
	 * checked (stage.c), the verdict in r->gdr, shown by gpxctl exports. */
	void (*probe)(struct region *r);
	/* xfer.c: a transfer with a remote side is possible (one side local, its peer connection
	 * the one it was imported through)?  0, or a negative gpx status and why. */
	int (*xfer_check)(const struct region *src, const struct region *dst, char *err, size_t errlen);
	/* engine.c, any thread: PATH_FABRIC has new work. */
	void (*kick)(void);
	/* ctl.c: one line for status; the peers for Q_PEERS, and their freeing; metrics.c too: */
	const char *(*status)(void);
	bool (*peers)(Gpx__QueryReply *);     /* false: out of memory, the list cut short */
	void (*peers_free)(Gpx__QueryReply *);
	void (*gpu_stats)(struct fabric_gpu_stats *);
	/* levent.c, at exit: fails what waits on peers; before engine_shutdown. */
	void (*stop)(void);
	/* The cluster: node left it (its lease ended); its connections go, and with them every
	 * import and transfer through them, even when its TCP connections still stand. */
	void (*node_gone)(const char *node, const char *why);
	/* The cluster: whether a ready connection to node stands (gpxctl cluster). */
	bool (*node_up)(const char *node);
};

/* The hooks, set by levent.c from fabric_init; NULL while the fabric is off. */
extern const struct fabric_ops *fabric;

/* Whether the configuration turns the fabric on (a [fabric] section without any of these,
 * only a node name say, leaves it off). */
static inline bool
fabric_configured(const struct conf *c)
{
	return c->fabric_listen != NULL || c->fabric_peers != NULL || c->fabric_dial_on_demand;
}

/*
 * Our exports, as the fabric serves peers' imports of them: the connections' layer, which
 * keeps the exports, hands this table down at start (fabric_exports_from).
 */
struct export;
struct fabric_exports {
	/* Export `name`, if peer node `node` may import it: 0 with it, its region, whether it is
	 * read-only and whether its owner is notified; else a negative gpx status: ENOENT (none),
	 * EACCES (not open to that node) or EREVOKED (withdrawn).  Takes nothing. */
	int (*find)(const char *name, const char *node, struct export **e, struct region **r, bool *read_only,
	    bool *notify);
	/* A peer's import of e begins; one of region r ends (the export counts its importers). */
	void (*import_begin)(struct export *e);
	void (*import_end)(struct region *r);
};
void fabric_exports_from(const struct fabric_exports *);

/* Where the fabric's requests take the chunks of PATH_FABRIC from: set by engine_init. */
void fabric_chunks_from(const struct chunk_source *);

/* Loop thread, after engine_init and gpu_init: starts the fabric; NULL when it cannot (said
 * in the log). */
const struct fabric_ops *fabric_init(struct event_base *);

/* Q_TOPO, with or without the fabric: the NICs, and each GPU's NIC into the devices
 * gpu_topo filled (daemon/fabric/nic.c). */
bool nic_topo(Gpx__QueryReply *);      /* false: out of memory, the lists cut short */
void nic_topo_free(Gpx__QueryReply *);

#endif
