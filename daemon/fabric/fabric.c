/*
 * The fabric's front door: fabric_init, the one call gpxd makes to start it (and only when
 * gpxd.conf turns it on), and the table of hooks through which the rest of the daemon reaches
 * it (daemon/fabric/fabric.h).  Each hook is a function of the file that does that job; this
 * file only names them, so that a reader finds here where every way into the fabric leads.
 */
#include "config.h"

#include <string.h>

#include "daemon/fabric/fabric.h"
#include "daemon/fabric/internal.h"

/* GPU memory between nodes: staging's counters and the NICs' registrations together. */
static void
gpu_stats(struct fabric_gpu_stats *g)
{
	memset(g, 0, sizeof(*g));
	stage_stats(g);
	fabric_rdma_gpu_regs(&g->dmabuf_regs, &g->peermem_regs, &g->unregistrable);
}

/* The hooks, set by levent.c from fabric_init: NULL while the fabric is off. */
const struct fabric_ops *fabric;
/* Our exports, for peers' imports (peer-import.c), set by the connections' layer at start. */
const struct fabric_exports *fabric_exports;

void
fabric_exports_from(const struct fabric_exports *e)
{
	fabric_exports = e;
}

/* The engine's chunks of PATH_FABRIC (request.c takes them), set by engine_init. */
const struct chunk_source *fabric_chunks;

void
fabric_chunks_from(const struct chunk_source *s)
{
	fabric_chunks = s;
}

static const struct fabric_ops ops = {
	.import = peer_import,                       /* peer.c */
	.probe = stage_probe,                        /* stage.c */
	.xfer_check = remote_xfer_check,             /* remote.c */
	.kick = request_kick,                        /* request.c */
	.status = peer_status,                       /* peer.c */
	.peers = peer_query,
	.peers_free = peer_query_free,
	.gpu_stats = gpu_stats,
	.stop = peer_stop,
	.node_gone = peer_node_gone,
	.node_up = peer_node_up,
};

const struct fabric_ops *
fabric_init(struct event_base *b)
{
	if (peer_start(b) < 0)
		return NULL;
	region_on_gone(fabric_rdma_region_gone);     /* rdma-mr.c */
	return &ops;
}
