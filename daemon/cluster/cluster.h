/*
 * The cluster, as the rest of the daemon sees it: this header is all that may be called of
 * daemon/cluster/ from outside it (internal.h is the folder's own).
 *
 * One etcd holds the membership and the names of every gpxd of a cluster: each node keeps a
 * lease and, under it, one key for itself and one per export that peers may import.  gpxd
 * starts the cluster once, at start, when gpxd.conf's [cluster] names an etcd; without it (or
 * built without libcurl) none of this code runs and exports and imports are the node's own.
 * A reload checks [cluster] like every section, but its values take effect at restart.
 *
 * Everything here runs on the loop thread.  Calls into the cluster come from levent.c
 * (start, the stop's beginning, stop), main.c (the keys, through conf_add_section),
 * client/conn-export.c (exports by name, imports by bare name), client/export.c (a name
 * withdrawn), ctl.c and metrics.c; the cluster calls down only: the fabric's hooks, the GPU
 * back end (how many GPUs) and the core (names, log, conf, the clock).  Its answers to a
 * connection go through the callbacks handed down with a request.
 */
#ifndef GPX_CLUSTER_CLUSTER_H
#define GPX_CLUSTER_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/gpxd.h"          /* struct cluster_conf, in struct conf */

struct event_base;
struct conn;
struct evbuffer;

/* One key of [cluster]: 0, or -1 with why (the caller names the file and line). */
int cluster_conf_key(struct cluster_conf *, const char *key, const char *v, char *why, size_t whylen);
void cluster_conf_free(struct cluster_conf *);
/* main.c, before the first load: [cluster] is read by this folder's code (conf_add_section). */
void cluster_conf_register(void);

/*
 * levent.c, after the fabric: joins the cluster.  It waits (running the loop) for the first
 * answer of etcd, at most a few seconds longer than the lease: -1 (logged) when this node's
 * name is held by another live node or the configuration cannot work; 0 otherwise, also when
 * etcd does not answer (gpxd then retries, and local service goes on).
 */
int cluster_start(struct event_base *);
void cluster_stop(void);     /* at exit: the lease is revoked, our keys go with it */
bool cluster_running(void);

/*
 * conn-export.c: an export open to peers becomes a cluster name.  The answer comes through
 * done (status 0, or a gpx status and why), exactly once, maybe before this returns.  A
 * withdrawal of the export while it waits (cluster_name_drop) answers it at once,
 * GPX__STATUS__EREVOKED: done is never called after the drop.
 */
typedef void (*cluster_done_fn)(void *arg, int status, const char *msg);
void cluster_name_add(const char *name, uid_t uid, cluster_done_fn done, void *arg);
/* export.c: the export of that name is gone: its cluster key goes (if it is ours). */
void cluster_name_drop(const char *name);

/*
 * conn-export.c: an import of a name no local export has.  A bare name held by another node,
 * or "NODE:name" of a node in the cluster, is handed to the fabric with that node's address;
 * false: not the cluster's (the caller goes on as without it).  True: answered through the
 * fabric_import_fn in *rq (daemon/fabric/fabric.h), now or later.
 */
struct fabric_import;
bool cluster_import(struct fabric_import *rq);

/* metrics.c: the cluster's lines (Prometheus text) appended to out. */
void cluster_metrics(struct evbuffer *out);
/* ctl.c: the nodes for gpxctl cluster, as JSON text (malloc'ed; NULL when off), with each
 * lease's time left asked of etcd first: done gets it with status 0, or a status and why and
 * no text (GPX__STATUS__ENOMEM: an allocation failed on the way; GPX__STATUS__ESHUTDOWN:
 * gpxd is stopping); once, maybe before this returns. */
void cluster_nodes_query(void (*done)(void *arg, int status, const char *why, char *json), void *arg);
/* levent.c, as the stop begins (clients still connected): the queries of cluster_nodes_query
 * and the exports of cluster_name_add waiting for etcd are answered GPX__STATUS__ESHUTDOWN now,
 * and those that come later at once. */
void cluster_stopping(void);
/* The node holding a cluster name, NULL when none (gpxctl exports). */
const char *cluster_name_node(const char *name);
/* Every cluster name held by another node (gpxctl exports); fn may not change the names. */
void cluster_names_visit(void (*fn)(const char *name, const char *node, uid_t uid, void *arg), void *arg);
const char *cluster_self(void);   /* this node's name in the cluster ("" when off) */

#endif
