/*
 * Answers to gpxctl: Query (status, clients, regions, exports, transfers, stats, topology) and
 * the administrative requests (reload, drain, log level), which only root or members of the
 * configured admin group may make.  Any client may query; the answers show ids, uids and sizes,
 * never memory contents or handles.
 *
 * Each user sees what is theirs: for anyone but root and the admin group, clients, regions and
 * transfers are those of connections of the caller's uid, and exports those it may import
 * (export_allows: its own, and others' whose rule admits it).  What describes the node rather
 * than a user is the same for everyone: status (counts of clients, regions, exports and
 * transfers, bytes moved), the per-path counters, the topology and the peer daemons.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#include "daemon/client/client.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/gpu.h"
#include "daemon/cluster/cluster.h"
#include "daemon/fabric/fabric.h"

static const char *state_names[] = { "hello", "ready", "draining", "dead" };

static void
q_status(Gpx__QueryReply *q, Gpx__DaemonStatus *s)
{
	struct conn *c;
	uint32_t regions = 0;

	TAILQ_FOREACH(c, &conns, entry)
		regions += c->nhandles;
	s->version = (char *)GPXD_VERSION;
	s->proto = GPX_PROTO_VERSION;
	s->pid = getpid();
	s->uptime_s = now_s() - gpxd_start_time;
	s->socket = (char *)gpxd_socket_path;
	s->clients = conn_count();
	s->regions = regions;
	s->exports = export_count();
	s->inflight = engine_inflight();
	s->workers = cfg->workers;
	s->chunk_size = cfg->chunk_size;
	s->cuda = (char *)gpu_status();
	s->trust_legacy = cfg->trust_legacy_ipc;
	s->config = cfg->path ? cfg->path : (char *)"(defaults)";
	s->fabric = fabric != NULL ? (char *)fabric->status() : (char *)"off";
	struct gpu_cache gc;
	gpu_cache_stats(&gc);
	s->cache_ipc = gc.ipc;
	s->cache_pool = gc.pool;
	s->cache_vmm = gc.vmm;
	s->cache_opens = gc.opens;
	s->cache_hits = gc.hits;
	s->budget_used = budget_used();
	s->budget_entries = budget_entries();
	s->budget_total = cfg->budget_total;
	s->budget_uid = cfg->budget_uid;
	s->budget_connection = cfg->budget_connection;
	s->budget_request = cfg->budget_request;
	for (int b = 0; b < NBUDGETS; b++) {
		s->budget_refused_busy += budget_refused(b, true);
		s->budget_refused_large += budget_refused(b, false);
	}
	s->loop_max_s = loop_turn_max();
	s->loop_list_max = loop_turn_list_max();
	s->loop_cpu_max_s = loop_turn_cpu_max();
	s->loop_work_max = loop_turn_work_max();
	s->maps_used = maps_used();
	s->maps_limit = cfg->max_mappings;
	s->maps_refused = maps_refused();
	if (loop_turn_cpu_top() != NULL) {
		s->loop_cpu_top_s = (double *)loop_turn_cpu_top();
		s->n_loop_cpu_top_s = LOOP_TURN_TOP;
	}
	for (int p = 0; p < NPATHS; p++) {
		uint64_t x, b, e;
		engine_path_stats(p, &x, &b, &e);
		s->transfers += x;
		s->bytes += b;
	}
	q->status = s;
}

/* Whether the asking connection may see what the connections of uid do. */
static bool
sees(const struct conn *asker, uid_t uid)
{
	return asker->admin || asker->uid == uid;
}

/*
 * The lists of a reply are built piece by piece, each counted in the reply as it is added, so
 * that ctl_query frees what was built either way.  A builder returns false when a piece could
 * not be allocated: the list is cut short, and ctl_query answers ENOMEM rather than send it.
 */
static bool
q_clients(Gpx__QueryReply *q, const struct conn *asker)
{
	struct conn *c;

	if ((q->clients = calloc(conn_count() + 1, sizeof(*q->clients))) == NULL)
		return false;
	TAILQ_FOREACH(c, &conns, entry) {
		if (!sees(asker, c->uid))
			continue;
		Gpx__ClientInfo *i = malloc(sizeof(*i));
		if (i == NULL)
			return false;
		gpx__client_info__init(i);
		i->id = c->id;
		i->uid = c->uid;
		i->gid = c->gid;
		i->pid = c->pid;
		i->name = c->name;
		i->state = (char *)state_names[c->state];
		i->regions = c->nhandles;
		if (c->cq != NULL) {
			pthread_mutex_lock(&c->cq->lock);
			i->inflight = c->cq->inflight;
			pthread_mutex_unlock(&c->cq->lock);
			i->bytes = atomic_load(&c->cq->bytes);
			i->transfers = atomic_load(&c->cq->transfers);
			i->errors = atomic_load(&c->cq->errors);
		}
		i->connected_s = now_s() - c->t_connect;
		q->clients[q->n_clients++] = i;
	}
	return true;
}

static const char *
export_of(const struct region *r)
{
	struct export *e;

	TAILQ_FOREACH(e, &exports, entry)
		if (e->r == r)
			return e->name;
	return "";
}

static bool
q_regions(Gpx__QueryReply *q, const struct conn *asker)
{
	struct conn *c;
	size_t cap = 16;
	Gpx__RegionInfo **a;

	if ((q->regions = malloc(cap * sizeof(*q->regions))) == NULL)
		return false;
	TAILQ_FOREACH(c, &conns, entry)
		for (uint32_t s = 0; sees(asker, c->uid) && s < c->hcap; s++)
			for (struct rhandle *h = c->htab[s]; h != NULL; h = h->next) {
				if (q->n_regions == cap) {
					if ((a = realloc(q->regions, 2 * cap * sizeof(*a))) == NULL)
						return false;
					q->regions = a;
					cap *= 2;
				}
				Gpx__RegionInfo *i = malloc(sizeof(*i));
				if (i == NULL)
					return false;
				gpx__region_info__init(i);
				i->id = h->id;
				i->client = c->id;
				i->kind = (char *)(h->r->ops ? h->r->ops->name : "?");
				i->length = h->r->length;
				i->imported = h->imported;
				i->export_name = (char *)export_of(h->r);
				i->device = (char *)(h->r->dev == DEV_HOST ? "host" : "gpu");
				i->read_only = h->read_only || h->r->read_only;
				q->regions[q->n_regions++] = i;
			}
	return true;
}

struct cvisit {
	Gpx__QueryReply *q;
	bool admin;
	uid_t uid;
	size_t cap;
	bool cut;                         /* a name could not be added: out of memory */
};

/* A cluster name of another node, as gpxctl exports lists it: marked with its node. */
static void
cluster_export(const char *name, const char *node, uid_t uid, void *arg)
{
	struct cvisit *v = arg;
	Gpx__ExportInfo *i, **a;

	if (v->cut || (!v->admin && uid != v->uid))
		return;
	if (v->q->n_exports + 1 >= v->cap) {
		if ((a = realloc(v->q->exports, 2 * v->cap * sizeof(*a))) == NULL) {
			v->cut = true;
			return;
		}
		v->q->exports = a;
		v->cap *= 2;
	}
	if ((i = malloc(sizeof(*i))) == NULL) {
		v->cut = true;
		return;
	}
	gpx__export_info__init(i);
	i->name = (char *)name;
	i->node = (char *)node;
	i->uid = uid;
	i->rule = (char *)"-";
	i->remote = true;
	v->q->exports[v->q->n_exports++] = i;
}

static bool
q_exports(Gpx__QueryReply *q, const struct conn *asker)
{
	static const char *rules[] = { "uid", "gid", "any" };
	struct export *e;

	if ((q->exports = calloc(export_count() + 1, sizeof(*q->exports))) == NULL)
		return false;
	struct creds who = conn_creds(asker);
	TAILQ_FOREACH(e, &exports, entry) {
		if (!asker->admin && !export_allows(e, &who))
			continue;
		Gpx__ExportInfo *i = malloc(sizeof(*i));
		if (i == NULL)
			return false;
		gpx__export_info__init(i);
		i->name = e->name;
		i->client = e->owner;
		i->region = e->owner_region;
		i->rule = (char *)rules[e->rule];
		i->uid = e->uid;
		i->gid = e->gid;
		i->importers = e->importers;
		i->notify = e->notify;
		i->read_only = e->read_only;
		i->remote = e->remote;
		i->peers = e->peers ? e->peers : (char *)"";
		i->gpudirect = e->remote && e->r->host == NULL ? e->r->gdr : (char *)"";
		const char *node = e->remote ? cluster_name_node(e->name) : NULL;
		i->node = node != NULL ? (char *)node : (char *)"";
		q->exports[q->n_exports++] = i;
	}
	/* cluster: the other nodes' names this asker's uid holds (all, for an administrator) */
	struct cvisit v = { .q = q, .admin = asker->admin, .uid = asker->uid, .cap = export_count() + 1 };
	cluster_names_visit(cluster_export, &v);
	return !v.cut;
}

/* GPU memory between nodes, by path (daemon/fabric/): zeros without the fabric. */
static void
q_fabric_gpu(Gpx__QueryReply *q, Gpx__FabricGpu *g)
{
	struct fabric_gpu_stats s = { 0 };

	if (fabric != NULL)
		fabric->gpu_stats(&s);
	g->direct_bytes = s.direct_bytes;
	g->staged_bytes = s.staged_bytes;
	g->staged_copies = s.staged_copies;
	g->heap_copies = s.heap_copies;
	g->pool_bytes = s.pool_bytes;
	g->dmabuf_regs = s.dmabuf_regs;
	g->peermem_regs = s.peermem_regs;
	g->unregistrable = s.unregistrable;
	q->fabric_gpu = g;
}

struct tvisit {
	Gpx__QueryReply *q;
	const struct conn *asker;
	size_t cap;
	double now;
	bool cut;                         /* a transfer could not be added: out of memory */
};

static void
visit_job(const struct job *j, void *arg)
{
	struct tvisit *v = arg;
	Gpx__QueryReply *q = v->q;
	Gpx__TransferInfo **a, *i;

	if (v->cut || !sees(v->asker, j->user->uid))
		return;
	if (q->n_transfers == v->cap) {
		if ((a = realloc(q->transfers, (v->cap * 2 + 16) * sizeof(*a))) == NULL) {
			v->cut = true;
			return;
		}
		q->transfers = a;
		v->cap = v->cap * 2 + 16;
	}
	if ((i = malloc(sizeof(*i))) == NULL) {
		v->cut = true;
		return;
	}
	gpx__transfer_info__init(i);
	i->client = j->client;
	i->tag = j->tag;
	i->path = (char *)engine_path_name(j->path);
	i->segments = j->nseg;
	i->bytes = j->total;
	i->done = j->done;
	i->age_s = v->now - j->t_submit;
	q->transfers[q->n_transfers++] = i;
}

static bool
q_stats(Gpx__QueryReply *q)
{
	int np = PATH_GPU0 + gpu_count();

	if ((q->paths = calloc(np + 1, sizeof(*q->paths))) == NULL)
		return false;
	for (int i = 0; i <= np; i++) {
		int p = i < np ? i : PATH_FABRIC;     /* fabric: after the GPUs this node has */
		Gpx__PathStats *s = malloc(sizeof(*s));
		if (s == NULL)
			return false;
		gpx__path_stats__init(s);
		s->path = (char *)engine_path_name(p);
		engine_path_stats(p, &s->transfers, &s->bytes, &s->errors);
		q->paths[q->n_paths++] = s;
	}
	return true;
}

static void
free_list(void **v, size_t n)
{
	for (size_t i = 0; i < n; i++)
		free(v[i]);
	free(v);
}

/* Sends a reply that may be larger than a datagram: then it travels in a sealed memfd. */
static void
send_query_reply(struct conn *c, uint32_t seq, Gpx__QueryReply *q)
{
	Gpx__Reply rep = GPX__REPLY__INIT;

	rep.body_case = GPX__REPLY__BODY_QUERY;
	rep.query = q;
	if (gpx__query_reply__get_packed_size(q) + 64 <= GPX_MSG_MAX) {
		conn_reply(c, seq, 0, NULL, &rep, NULL, 0);
		return;
	}
	size_t len = gpx__query_reply__get_packed_size(q);
	uint8_t *buf = malloc(len);
	int fd = memfd_create("gpx-query", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	bool ok = buf != NULL && fd >= 0;
	if (ok) {
		gpx__query_reply__pack(q, buf);
		ok = write(fd, buf, len) == (ssize_t)len &&
		    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) == 0;
	}
	free(buf);
	if (!ok) {
		if (fd >= 0)
			close(fd);
		conn_reply(c, seq, GPX__STATUS__ENOMEM, "cannot build the reply", NULL, NULL, 0);
		return;
	}
	Gpx__Reply small = GPX__REPLY__INIT;
	small.query_in_fd = true;
	conn_reply(c, seq, 0, NULL, &small, &fd, 1);
	close(fd);
}

struct cwait {
	struct conn *c;
	uint32_t seq;
};

/* Q_CLUSTER's answer (cluster.h): json NULL when this node is in no cluster, or refused. */
static void
cluster_answered(void *arg, int status, const char *why, char *json)
{
	struct cwait *w = arg;
	Gpx__QueryReply q = GPX__QUERY_REPLY__INIT;

	conn_settle(w->c);
	if (w->c->state != CONN_DEAD && status != 0)
		conn_reply(w->c, w->seq, status, why, NULL, NULL, 0);
	else if (w->c->state != CONN_DEAD) {
		q.cluster = json != NULL ? json : (char *)"";
		send_query_reply(w->c, w->seq, &q);
	}
	free(json);
	free(w);
}

void
ctl_query(struct conn *c, uint32_t seq, const Gpx__Query *m)
{
	Gpx__QueryReply q = GPX__QUERY_REPLY__INIT;
	Gpx__DaemonStatus st = GPX__DAEMON_STATUS__INIT;
	Gpx__FabricGpu fg = GPX__FABRIC_GPU__INIT;
	struct tvisit v = { .q = &q, .asker = c, .now = now_s() };
	bool whole = true;

	switch (m->what) {
	case GPX__QUERY_WHAT__Q_STATUS:
		q_status(&q, &st);
		break;
	case GPX__QUERY_WHAT__Q_CLIENTS:
		whole = q_clients(&q, c);
		break;
	case GPX__QUERY_WHAT__Q_REGIONS:
		whole = q_regions(&q, c);
		break;
	case GPX__QUERY_WHAT__Q_EXPORTS:
		whole = q_exports(&q, c);
		break;
	case GPX__QUERY_WHAT__Q_TRANSFERS:
		engine_visit(visit_job, &v);
		whole = !v.cut;
		break;
	case GPX__QUERY_WHAT__Q_STATS:
		whole = q_stats(&q);
		break;
	case GPX__QUERY_WHAT__Q_TOPO:
		whole = gpu_topo(&q) && nic_topo(&q);
		break;
	case GPX__QUERY_WHAT__Q_PEERS:
		if (fabric != NULL)
			whole = fabric->peers(&q);
		q_fabric_gpu(&q, &fg);
		break;
	case GPX__QUERY_WHAT__Q_CLUSTER: {
		/* answered when etcd has told each lease's time left */
		struct cwait *w = malloc(sizeof(*w));
		if (w == NULL) {
			conn_reply(c, seq, GPX__STATUS__ENOMEM, "out of memory", NULL, NULL, 0);
			return;
		}
		w->c = c;
		w->seq = seq;
		c->pending++;
		cluster_nodes_query(cluster_answered, w);
		return;
	}
	default:
		conn_reply(c, seq, GPX__STATUS__EINVAL, "unknown query", NULL, NULL, 0);
		return;
	}
	if (whole)
		send_query_reply(c, seq, &q);
	else
		conn_reply(c, seq, GPX__STATUS__ENOMEM, "out of memory building the reply", NULL, NULL, 0);
	free_list((void **)q.clients, q.n_clients);
	free_list((void **)q.regions, q.n_regions);
	free_list((void **)q.exports, q.n_exports);
	free_list((void **)q.transfers, q.n_transfers);
	free_list((void **)q.paths, q.n_paths);
	nic_topo_free(&q);
	gpu_topo_free(&q);
	if (fabric != NULL)
		fabric->peers_free(&q);
}

void
ctl_admin(struct conn *c, uint32_t seq, const Gpx__Admin *m)
{
	char err[1024];

	switch (conn_admin(c)) {
	case 1:
		break;
	case 0:
		log_audit(c, "administrative request from a non-administrator");
		conn_reply(c, seq, GPX__STATUS__EPERM, "administrative requests need root or the admin group",
		    NULL, NULL, 0);
		return;
	default:
		/* not a refusal: a member asking again once memory is back is served */
		conn_reply(c, seq, GPX__STATUS__ENOMEM, "the admin group's lookup found no memory: "
		    "cannot tell whether this request may be made; try again", NULL, NULL, 0);
		return;
	}
	switch (m->op) {
	case GPX__ADMIN__OP__RELOAD:
		/* the reply's text: what the reload applied and what waits for a restart */
		switch (conn_loop->reload(err, sizeof(err))) {
		case 0:
			conn_reply(c, seq, 0, err, NULL, NULL, 0);
			break;
		case -ENOMEM:
			conn_reply(c, seq, GPX__STATUS__ENOMEM, err, NULL, NULL, 0);
			break;
		default:
			conn_reply(c, seq, GPX__STATUS__EINVAL, err, NULL, NULL, 0);
		}
		return;
	case GPX__ADMIN__OP__DRAIN: {
		struct conn *t = conn_by_id(m->arg);
		if (t == NULL || t->state != CONN_READY) {
			conn_reply(c, seq, GPX__STATUS__ENOENT, "no such client (or it is not ready)", NULL, NULL, 0);
			return;
		}
		t->state = CONN_DRAINING;
		log_info("client %llu is drained by uid %u: new transfers are refused",
		    (unsigned long long)t->id, (unsigned)c->uid);
		conn_reply(c, seq, 0, NULL, NULL, NULL, 0);
		return;
	}
	case GPX__ADMIN__OP__LOG_LEVEL:
		if (m->text == NULL || m->text[0] == '\0') {
			conn_reply(c, seq, 0, log_get_level(), NULL, NULL, 0);
			return;
		}
		if (log_set_level(m->text) < 0) {
			conn_reply(c, seq, GPX__STATUS__EINVAL, "levels: error, warning, info, debug [subsystems]",
			    NULL, NULL, 0);
			return;
		}
		log_info("log level set to %s by uid %u", log_get_level(), (unsigned)c->uid);
		conn_reply(c, seq, 0, log_get_level(), NULL, NULL, 0);
		return;
	default:
		conn_reply(c, seq, GPX__STATUS__EINVAL, "unknown administrative request", NULL, NULL, 0);
	}
}
