/*
 * The Prometheus endpoint: an HTTP server (libevent's evhttp, on the event loop thread) on the
 * address and port named by [daemon] metrics in gpxd.conf, off by default and refused on a
 * non-loopback address unless [daemon] metrics_allow_remote says so.  GET /metrics answers in
 * the text exposition format (0.0.4): transfers, bytes and errors by status, and a latency
 * histogram (submit to completion), per client, per path and per device, and a few gauges.
 *
 * Whoever finishes a transfer reports it with metrics_job_done(), from any thread, before the
 * client can see the completion; a transfer refused before it became a job (a segment out of
 * bounds, a region not the client's) is reported with metrics_refused() and counts as an
 * error of its client, by status.  The counters live here under one mutex.  A scrape copies
 * them out under the mutex and formats without it.  Per-client series exist while the client
 * is connected: entries of clients that left are pruned on each scrape and once a minute, so
 * the table stays bounded by the connections the daemon allows.
 */
#include "config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/util.h>

#include "daemon/client/client.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/gpu.h"
#include "daemon/cluster/cluster.h"
#include "daemon/fabric/fabric.h"

#define NBUCKETS 19                  /* finite bucket bounds; +Inf is the count */
#define NSTATUS 32                   /* gpx.Status values; larger ones count as the last */
#define NDEVS 65                     /* host, then GPUs 0..63 */
#define CLIENT_HASH 256

static const double bounds[NBUCKETS] = {
	10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
	0.1, 0.25, 0.5, 1, 2.5, 5, 10,
};

struct series {
	uint64_t transfers;
	uint64_t bytes;
	uint64_t errors[NSTATUS];
	uint64_t buckets[NBUCKETS + 1];  /* per bucket, not cumulative; the last is above all */
	double seconds;
};

struct cseries {
	struct cseries *next;
	uint64_t client;
	uid_t uid;
	struct series s;
};

enum { DIR_READ, DIR_WRITE };

static pthread_mutex_t mlock = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool recording;
static struct series path_s[NPATHS];
static struct series dev_s[NDEVS][2];
static struct cseries *clients[CLIENT_HASH];
static uint64_t refused[NSTATUS];

static struct event_base *mbase;
static struct evhttp *http;
static struct event *prune_ev;
static char listen_text[160];        /* what the configuration said, to notice a change */
static char served[160];             /* where it really listens (the port chosen, if 0) */
static bool started;
static bool served_remote;          /* it listens on an address that is not loopback */

static void
series_add(struct series *s, int status, uint64_t bytes, double dt, int bucket)
{
	s->transfers++;
	s->bytes += bytes;
	if (status != 0)
		s->errors[status < NSTATUS ? status : NSTATUS - 1]++;
	s->buckets[bucket]++;
	s->seconds += dt;
}

static int
dev_slot(int dev)
{
	if (dev == DEV_HOST || dev < 0)
		return 0;
	return dev + 1 < NDEVS ? dev + 1 : NDEVS - 1;
}

/* Under mlock: the series of a client, made on first use (NULL if out of memory). */
static struct cseries *
client_series(uint64_t id, uid_t uid)
{
	struct cseries **head = &clients[id % CLIENT_HASH], *c;

	for (c = *head; c != NULL && c->client != id; c = c->next)
		;
	if (c == NULL && (c = calloc(1, sizeof(*c))) != NULL) {
		c->client = id;
		c->uid = uid;
		c->next = *head;
		*head = c;
	}
	return c;
}

/* Any thread, once per finished transfer, before its completion is posted. */
void
metrics_job_done(const struct job *j, int status)
{
	if (!atomic_load_explicit(&recording, memory_order_relaxed))
		return;
	double dt = now_s() - j->t_submit;
	int b = 0;
	while (b < NBUCKETS && dt > bounds[b])
		b++;
	if (status < 0)
		status = -status;

	pthread_mutex_lock(&mlock);
	if ((unsigned)j->path < NPATHS)
		series_add(&path_s[j->path], status, j->done, dt, b);
	if (j->src != NULL)
		series_add(&dev_s[dev_slot(j->src->dev)][DIR_READ], status, j->done, dt, b);
	if (j->dst != NULL)
		series_add(&dev_s[dev_slot(j->dst->dev)][DIR_WRITE], status, j->done, dt, b);
	struct cseries *c = client_series(j->client, j->user != NULL ? j->user->uid : (uid_t)-1);
	if (c != NULL)
		series_add(&c->s, status, j->done, dt, b);
	pthread_mutex_unlock(&mlock);
}

void
metrics_refused(const struct conn *cn, int status)
{
	if (!atomic_load_explicit(&recording, memory_order_relaxed))
		return;
	if (status < 0)
		status = -status;
	if (status == 0)
		return;
	int i = status < NSTATUS ? status : NSTATUS - 1;
	pthread_mutex_lock(&mlock);
	refused[i]++;
	struct cseries *c = client_series(cn->id, cn->uid);
	if (c != NULL)
		c->s.errors[i]++;
	pthread_mutex_unlock(&mlock);
}

/* Loop thread: forgets the clients that are no longer connected. */
static void
prune(void)
{
	pthread_mutex_lock(&mlock);
	for (int i = 0; i < CLIENT_HASH; i++) {
		struct cseries **pp = &clients[i];
		while (*pp != NULL) {
			struct cseries *c = *pp;
			if (conn_by_id(c->client) == NULL) {
				*pp = c->next;
				free(c);
			} else
				pp = &c->next;
		}
	}
	pthread_mutex_unlock(&mlock);
}

static void
prune_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	prune();
}

/* ---- the exposition format ---- */

static const char *
status_name(int s)
{
	const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&gpx__status__descriptor, s);

	return v != NULL ? v->name : "other";
}

/* A label value: backslash, double quote and newline escaped, other control bytes dropped. */
static void
put_label(struct evbuffer *b, const char *v)
{
	for (; *v != '\0'; v++) {
		unsigned char ch = (unsigned char)*v;
		if (ch == '\\' || ch == '"')
			evbuffer_add_printf(b, "\\%c", ch);
		else if (ch == '\n')
			evbuffer_add(b, "\\n", 2);
		else if (ch >= 0x20 && ch != 0x7f)
			evbuffer_add(b, v, 1);
	}
}

static void
head(struct evbuffer *b, const char *name, const char *type, const char *help)
{
	evbuffer_add_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A family of one sample, without labels. */
static void
single(struct evbuffer *b, const char *name, const char *type, const char *help, uint64_t v)
{
	head(b, name, type, help);
	evbuffer_add_printf(b, "%s %llu\n", name, (unsigned long long)v);
}

/*
 * The series of one family for one label set.  `labels` is the text inside the braces,
 * already escaped; what is printed depends on `what`.
 */
enum family { F_TRANSFERS, F_BYTES, F_ERRORS, F_SECONDS };

static void
put_series(struct evbuffer *b, const char *name, enum family what, const char *labels,
    const struct series *s)
{
	switch (what) {
	case F_TRANSFERS:
		evbuffer_add_printf(b, "%s{%s} %llu\n", name, labels, (unsigned long long)s->transfers);
		break;
	case F_BYTES:
		evbuffer_add_printf(b, "%s{%s} %llu\n", name, labels, (unsigned long long)s->bytes);
		break;
	case F_ERRORS:
		for (int i = 1; i < NSTATUS; i++)
			if (s->errors[i] != 0)
				evbuffer_add_printf(b, "%s{%s,status=\"%s\"} %llu\n", name, labels,
				    status_name(i), (unsigned long long)s->errors[i]);
		break;
	case F_SECONDS: {
		uint64_t cum = 0;
		for (int i = 0; i < NBUCKETS; i++) {
			cum += s->buckets[i];
			evbuffer_add_printf(b, "%s_bucket{%s,le=\"%g\"} %llu\n", name, labels, bounds[i],
			    (unsigned long long)cum);
		}
		cum += s->buckets[NBUCKETS];
		evbuffer_add_printf(b, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, labels,
		    (unsigned long long)cum);
		evbuffer_add_printf(b, "%s_sum{%s} %.9f\n", name, labels, s->seconds);
		evbuffer_add_printf(b, "%s_count{%s} %llu\n", name, labels, (unsigned long long)cum);
		break;
	}
	}
}

static const struct {
	const char *suffix;
	enum family what;
	const char *type;
	const char *help;
} families[] = {
	{ "transfers_total", F_TRANSFERS, "counter", "Transfers finished, whatever their status." },
	{ "bytes_total", F_BYTES, "counter", "Bytes moved by finished transfers." },
	{ "errors_total", F_ERRORS, "counter",
	    "Transfers that ended with an error, by status (per client: refused ones too)." },
	{ "transfer_seconds", F_SECONDS, "histogram", "Time from submission to completion." },
};

struct snapshot {
	uint64_t refused[NSTATUS];
	struct series path[NPATHS];
	struct series dev[NDEVS][2];
	struct cseries *clients;         /* a flat array */
	size_t nclients;
};

static bool
take_snapshot(struct snapshot *sn)
{
	size_t n = 0, i = 0;

	pthread_mutex_lock(&mlock);
	for (int h = 0; h < CLIENT_HASH; h++)
		for (struct cseries *c = clients[h]; c != NULL; c = c->next)
			n++;
	sn->clients = calloc(n ? n : 1, sizeof(*sn->clients));
	if (sn->clients == NULL) {
		pthread_mutex_unlock(&mlock);
		return false;
	}
	for (int h = 0; h < CLIENT_HASH; h++)
		for (struct cseries *c = clients[h]; c != NULL; c = c->next)
			sn->clients[i++] = *c;
	sn->nclients = n;
	memcpy(sn->refused, refused, sizeof(refused));
	memcpy(sn->path, path_s, sizeof(path_s));
	memcpy(sn->dev, dev_s, sizeof(dev_s));
	pthread_mutex_unlock(&mlock);
	return true;
}

static int
by_client(const void *a, const void *b)
{
	const struct cseries *x = a, *y = b;

	return x->client < y->client ? -1 : x->client > y->client;
}

static void
uid_budget(struct user *u, void *arg)
{
	uint64_t held = atomic_load(&u->charged);

	if (held > 0)
		evbuffer_add_printf(arg, "gpx_budget_uid_bytes{uid=\"%u\"} %llu\n", (unsigned)u->uid,
		    (unsigned long long)held);
}

struct arena_out {
	struct evbuffer *b;
	uint64_t grain;
};

static void
uid_arena(struct user *u, void *arg)
{
	const struct arena_out *o = arg;
	unsigned held = atomic_load(&u->pooled);

	if (held > 0)
		evbuffer_add_printf(o->b, "gpx_page_arena_uid_bytes{uid=\"%u\"} %llu\n", (unsigned)u->uid,
		    (unsigned long long)(held * o->grain));
}

/* The page kernel's pinned arena (gpu-copy.c): its size, one uid's share, what each uid holds. */
static void
render_arena(struct evbuffer *b)
{
	struct gpu_arena a;

	gpu_pages_stats(&a);
	if (a.size == 0)
		return;
	struct arena_out o = { b, a.grain };
	single(b, "gpx_page_arena_bytes", "gauge", "The page kernel's pinned arena for page lists in flight.", a.size);
	single(b, "gpx_page_arena_share_bytes", "gauge", "The most of it one uid's transfers hold.", a.share);
	head(b, "gpx_page_arena_uid_bytes", "gauge", "What a uid's page transfers in flight hold of the arena.");
	user_visit(uid_arena, &o);
	head(b, "gpx_page_arena_refused_total", "counter", "Page lists the arena did not take: full (no free run "
	    "that long) or share (the uid's share would be passed); lists in host memory then go as segments.");
	evbuffer_add_printf(b, "gpx_page_arena_refused_total{reason=\"full\"} %llu\n", (unsigned long long)a.refused[0]);
	evbuffer_add_printf(b, "gpx_page_arena_refused_total{reason=\"share\"} %llu\n", (unsigned long long)a.refused[1]);
}

/* The budgets (user.c): what is held against them, their limits, the requests refused by each. */
static void
render_budgets(struct evbuffer *b)
{
	single(b, "gpx_budget_bytes", "gauge", "Bytes of gpxd's memory that transfers in flight and clients' "
	    "table entries hold, in all.", budget_used());
	single(b, "gpx_budget_entry_bytes", "gauge", "Of them, what table entries hold: regions, imports, exports, "
	    "requests waiting for their reply.", budget_entries());
	head(b, "gpx_budget_uid_bytes", "gauge", "Bytes of gpxd's memory that a uid's transfers and entries hold.");
	user_visit(uid_budget, b);
	head(b, "gpx_budget_limit_bytes", "gauge", "The budgets ([limits] request_budget, connection_budget, "
	    "uid_budget, total_budget).");
	for (int i = 0; i < NBUDGETS; i++)
		evbuffer_add_printf(b, "gpx_budget_limit_bytes{budget=\"%s\"} %llu\n", budget_name(i),
		    (unsigned long long)budget_limit(i));
	head(b, "gpx_budget_refused_total", "counter", "Requests refused by a budget: busy (would fit once "
	    "transfers end or entries go) or too_large (never fits).");
	for (int i = 0; i < NBUDGETS; i++)
		for (int busy = 1; busy >= 0; busy--)
			evbuffer_add_printf(b, "gpx_budget_refused_total{budget=\"%s\",reason=\"%s\"} %llu\n",
			    budget_name(i), busy ? "busy" : "too_large", (unsigned long long)budget_refused(i, busy));
	single(b, "gpx_mappings", "gauge", "Mappings of clients' memory gpxd holds: host regions, completion "
	    "rings, segment areas.", maps_used());
	single(b, "gpx_mappings_limit", "gauge", "Their limit ([limits] mappings).", cfg->max_mappings);
	single(b, "gpx_mappings_refused_total", "counter", "Requests refused because gpxd held its limit of "
	    "mappings.", maps_refused());
}

static void
render(struct evbuffer *b, struct snapshot *sn)
{
	char labels[512];

	head(b, "gpx_build_info", "gauge", "The gpxd version and protocol; always 1.");
	evbuffer_add_printf(b, "gpx_build_info{version=\"%s\",protocol=\"%d\"} 1\n", GPXD_VERSION,
	    GPX_PROTO_VERSION);
	head(b, "gpx_uptime_seconds", "gauge", "Seconds since gpxd started.");
	evbuffer_add_printf(b, "gpx_uptime_seconds %.3f\n", now_s() - gpxd_start_time);
	single(b, "gpx_clients", "gauge", "Connected clients.", conn_count());
	single(b, "gpx_exports", "gauge", "Exported regions.", export_count());
	single(b, "gpx_transfers_in_flight", "gauge", "Transfers accepted and not yet completed.", engine_inflight());
	head(b, "gpx_event_loop_max_seconds", "gauge", "The event loop's longest turn since start: the most "
	    "one of its callbacks took.");
	evbuffer_add_printf(b, "gpx_event_loop_max_seconds %.6f\n", loop_turn_max());
	single(b, "gpx_event_loop_max_list_bytes", "gauge", "The most bytes of request lists the event loop "
	    "copied and checked in one turn since start.", loop_turn_list_max());
	single(b, "gpx_event_loop_max_work", "gauge", "The most requests the event loop took from a connection's "
	    "socket or queue, and handles of a gone client it gave back, in one turn since start.",
	    loop_turn_work_max());
	uint64_t naps, wakes, early_wakes;
	loop_nap_counts(&naps, &wakes, &early_wakes);
	single(b, "gpx_event_loop_naps_total", "counter", "Times the event loop napped instead of polling "
	    "(daemon.busy_poll_us) while clients only waited for transfers in flight.", naps);
	single(b, "gpx_event_loop_nap_wakes_total", "counter", "Naps of the event loop that the end of a "
	    "transfer ended.", wakes);
	single(b, "gpx_event_loop_early_wakes_total", "counter", "Naps of the event loop that a GPU's copy "
	    "worker ended a little before a long copy's end, so that the loop polls when the client's "
	    "next request comes.", early_wakes);
	single(b, "gpx_gpu_naps_total", "counter", "Times a GPU's copy worker napped through copies it "
	    "predicted to run long, instead of polling for their end.", gpu_naps());
	single(b, "gpx_gpu_prewakes_total", "counter", "Requests whose check woke their GPU's idle copy worker "
	    "before their job was queued, so that its wake-up overlapped the check.", engine_prewakes());
	single(b, "gpx_gpu_batched_chunks_total", "counter", "Small copies a GPU's copy worker issued together "
	    "with others queued behind them, in one launch of its copy kernel.", gpu_batched());
	single(b, "gpx_gpu_split_chunks_total", "counter", "Chunks of many large segments that copy engines and the "
	    "copy kernel moved side by side (between two GPUs or within one).", gpu_split());
	uint64_t kept, taken;
	xfer_pairs_counts(&kept, &taken);
	single(b, "gpx_batch_pairs_kept_total", "counter", "Batches whose pairs gpxd kept resolved for their "
	    "connection's next (the same records twice running).", kept);
	single(b, "gpx_batch_pairs_taken_total", "counter", "Batches that took their pairs from those kept, "
	    "with no lookup or hold of each region.", taken);
	uint64_t rung, skipped, early, writes;
	cq_doorbell_stats(&rung, &skipped, &early, &writes);
	single(b, "gpx_doorbells_total", "counter", "Completion records whose client's eventfd gpxd raised "
	    "(by one each).", rung);
	single(b, "gpx_doorbell_writes_total", "counter", "Eventfd writes for those records: records posted "
	    "together (a copy worker's of one look at its GPU) share one write, of their number.", writes);
	single(b, "gpx_doorbells_skipped_total", "counter", "Completion records posted while a thread of "
	    "their client said it was looking at the ring, so that no eventfd write was needed.", skipped);
	single(b, "gpx_doorbells_early_total", "counter", "Eventfd writes with no record, a little before a "
	    "long transfer's end, to a client thread asleep in a wait, so that it spins when the record comes.",
	    early);
	if (loop_turn_cpu_max() >= 0) {
		head(b, "gpx_event_loop_max_cpu_seconds", "gauge", "The most CPU time of the event loop's thread "
		    "one turn took since start (with GPXD_LOOP_CLOCKS=1).");
		evbuffer_add_printf(b, "gpx_event_loop_max_cpu_seconds %.6f\n", loop_turn_cpu_max());
	}
	render_budgets(b);
	render_arena(b);

	struct fabric_gpu_stats st = { 0 };
	if (fabric != NULL)
		fabric->gpu_stats(&st);
	uint64_t reg[3] = { st.dmabuf_regs, st.peermem_regs, st.unregistrable };
	head(b, "gpx_fabric_gpu_bytes_total", "counter",
	    "GPU memory moved to or from other nodes: by the NIC itself (gpudirect) or through host buffers (staged).");
	evbuffer_add_printf(b, "gpx_fabric_gpu_bytes_total{path=\"gpudirect\"} %llu\n",
	    (unsigned long long)st.direct_bytes);
	evbuffer_add_printf(b, "gpx_fabric_gpu_bytes_total{path=\"staged\"} %llu\n",
	    (unsigned long long)st.staged_bytes);
	head(b, "gpx_fabric_gpu_registrations_total", "counter",
	    "GPU memory registered with the RDMA NIC, by how: dmabuf, peermem, or none (staged).");
	for (int i = 0; i < 3; i++)
		evbuffer_add_printf(b, "gpx_fabric_gpu_registrations_total{how=\"%s\"} %llu\n",
		    (const char *[]){ "dmabuf", "peermem", "none" }[i], (unsigned long long)reg[i]);

	cluster_metrics(b);          /* the cluster's, when it runs (daemon/cluster/) */

	head(b, "gpx_transfers_refused_total", "counter",
	    "Transfers refused before any byte moved (bounds, rights, regions), by status.");
	for (int i = 1; i < NSTATUS; i++)
		if (sn->refused[i] != 0)
			evbuffer_add_printf(b, "gpx_transfers_refused_total{status=\"%s\"} %llu\n",
			    status_name(i), (unsigned long long)sn->refused[i]);

	/* Per path: every path that exists in this build, busy or not. */
	for (size_t f = 0; f < sizeof(families) / sizeof(families[0]); f++) {
		char name[64];
		snprintf(name, sizeof(name), "gpx_path_%s", families[f].suffix);
		head(b, name, families[f].type, families[f].help);
		for (int p = 0; p < NPATHS; p++) {
			if (p != PATH_HOST && sn->path[p].transfers == 0)
				continue;
			const char *pn = engine_path_name(p);
			snprintf(labels, sizeof(labels), "path=\"%s\"", pn != NULL ? pn : "other");
			put_series(b, name, families[f].what, labels, &sn->path[p]);
		}
	}

	/* Per device and direction: read = source of the copy, write = destination. */
	for (size_t f = 0; f < sizeof(families) / sizeof(families[0]); f++) {
		char name[64];
		snprintf(name, sizeof(name), "gpx_device_%s", families[f].suffix);
		head(b, name, families[f].type, families[f].help);
		for (int d = 0; d < NDEVS; d++)
			for (int dir = 0; dir < 2; dir++) {
				if (sn->dev[d][dir].transfers == 0)
					continue;
				char dev[16];
				if (d == 0)
					snprintf(dev, sizeof(dev), "host");
				else
					snprintf(dev, sizeof(dev), "gpu%d", d - 1);
				snprintf(labels, sizeof(labels), "device=\"%s\",direction=\"%s\"", dev,
				    dir == DIR_READ ? "read" : "write");
				put_series(b, name, families[f].what, labels, &sn->dev[d][dir]);
			}
	}

	/* Per connected client: its id, uid, pid and the name it gave in Hello. */
	qsort(sn->clients, sn->nclients, sizeof(*sn->clients), by_client);
	for (size_t f = 0; f < sizeof(families) / sizeof(families[0]); f++) {
		char name[64];
		snprintf(name, sizeof(name), "gpx_client_%s", families[f].suffix);
		head(b, name, families[f].type, families[f].help);
		for (size_t i = 0; i < sn->nclients; i++) {
			const struct cseries *c = &sn->clients[i];
			const struct conn *cn = conn_by_id(c->client);
			if (cn == NULL)
				continue;
			struct evbuffer *nb = evbuffer_new();
			if (nb == NULL)
				continue;
			put_label(nb, cn->name);
			size_t nl = evbuffer_get_length(nb);
			char *nm = (char *)evbuffer_pullup(nb, -1);
			snprintf(labels, sizeof(labels), "client=\"%llu\",uid=\"%u\",pid=\"%d\",name=\"%.*s\"",
			    (unsigned long long)c->client, (unsigned)cn->uid, (int)cn->pid, (int)nl,
			    nm != NULL ? nm : "");
			evbuffer_free(nb);
			put_series(b, name, families[f].what, labels, &c->s);
		}
	}
}

/*
 * Where transfers' time goes inside gpxd (engine_stage_stats): one histogram per stage, of
 * successful transfers since start.  Read at the scrape, not copied into the snapshot: the
 * engine keeps them lock-free, so a count and its sum may be one transfer apart.
 */
static void
render_stages(struct evbuffer *b)
{
	head(b, "gpx_stage_seconds", "histogram", "Time of each transfer in each of gpxd's stages: check (received "
	    "to checked), queue (to a worker's taking it), launch (to its first chunk queued on the GPU), gpu_wait "
	    "(to the GPU's start, with GPXD_STAGE_CLOCKS=1), copy (to its last byte), post (to its completion "
	    "written and the doorbell rung).");
	for (int st = 0; st < NSTAGES; st++) {
		uint64_t count, buckets[STAGE_BUCKETS + 1], cum = 0;
		double seconds;
		const char *name = engine_stage_name(st);
		engine_stage_stats(st, &count, &seconds, buckets);
		for (int i = 0; i < STAGE_BUCKETS; i++) {
			cum += buckets[i];
			evbuffer_add_printf(b, "gpx_stage_seconds_bucket{stage=\"%s\",le=\"%g\"} %llu\n", name,
			    engine_stage_bounds[i], (unsigned long long)cum);
		}
		evbuffer_add_printf(b, "gpx_stage_seconds_bucket{stage=\"%s\",le=\"+Inf\"} %llu\n", name,
		    (unsigned long long)count);
		evbuffer_add_printf(b, "gpx_stage_seconds_sum{stage=\"%s\"} %.9f\n", name, seconds);
		evbuffer_add_printf(b, "gpx_stage_seconds_count{stage=\"%s\"} %llu\n", name, (unsigned long long)count);
	}
}

static void
metrics_cb(struct evhttp_request *req, void *arg)
{
	struct evbuffer *b = evbuffer_new();
	struct snapshot *sn = calloc(1, sizeof(*sn));

	(void)arg;
	if (b == NULL || sn == NULL || !take_snapshot(sn)) {
		evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
		goto out;
	}
	prune();
	render(b, sn);
	render_stages(b);
	evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
	    "text/plain; version=0.0.4; charset=utf-8");
	evhttp_send_reply(req, HTTP_OK, "OK", b);
out:
	if (sn != NULL)
		free(sn->clients);
	free(sn);
	if (b != NULL)
		evbuffer_free(b);
}

static void
other_cb(struct evhttp_request *req, void *arg)
{
	struct evbuffer *b = evbuffer_new();

	(void)arg;
	if (b == NULL) {
		evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
		return;
	}
	evbuffer_add_printf(b, "gpxd: metrics are at /metrics\n");
	evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain");
	evhttp_send_reply(req, HTTP_NOTFOUND, "Not Found", b);
	evbuffer_free(b);
}

/* ---- the listener ---- */

static bool
is_loopback(const struct sockaddr *sa)
{
	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
		return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
	}
	if (sa->sa_family == AF_INET6) {
		const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
		if (IN6_IS_ADDR_LOOPBACK(a))
			return true;
		return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
	}
	return false;
}

/* "A.B.C.D:PORT", "[V6]:PORT" or "localhost:PORT"; port 0 lets the kernel choose (tests). */
static int
parse_addr(const char *spec, struct sockaddr_storage *ss, int *len)
{
	char host[INET6_ADDRSTRLEN + 2];
	const char *colon = strrchr(spec, ':'), *h = spec;
	size_t hl;
	char *end;

	memset(ss, 0, sizeof(*ss));
	if (colon == NULL || colon[1] == '\0')
		return -1;
	unsigned long port = strtoul(colon + 1, &end, 10);
	if (*end != '\0' || port > 65535)
		return -1;
	hl = (size_t)(colon - spec);
	if (spec[0] == '[') {
		if (hl < 2 || spec[hl - 1] != ']')
			return -1;
		h = spec + 1;
		hl -= 2;
	}
	if (hl == 0 || hl >= sizeof(host))
		return -1;
	memcpy(host, h, hl);
	host[hl] = '\0';
	if (strcmp(host, "localhost") == 0)
		strcpy(host, "127.0.0.1");
	struct sockaddr_in *s4 = (struct sockaddr_in *)ss;
	struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ss;
	if (inet_pton(AF_INET, host, &s4->sin_addr) == 1) {
		s4->sin_family = AF_INET;
		s4->sin_port = htons((uint16_t)port);
		*len = sizeof(*s4);
	} else if (inet_pton(AF_INET6, host, &s6->sin6_addr) == 1) {
		s6->sin6_family = AF_INET6;
		s6->sin6_port = htons((uint16_t)port);
		*len = sizeof(*s6);
	} else
		return -1;
	return 0;
}

static bool
metrics_off(const char *spec)
{
	return spec == NULL || spec[0] == '\0' || strcmp(spec, "off") == 0 || strcmp(spec, "no") == 0;
}

/* Checks an address as serve would take it; for conf.c, which checks a file before it is used. */
int
metrics_check(const char *spec, bool allow_remote, char *err, size_t errlen)
{
	struct sockaddr_storage ss;
	int sslen = sizeof(ss);

	if (metrics_off(spec))
		return 0;
	if (parse_addr(spec, &ss, &sslen) < 0) {
		snprintf(err, errlen, "not ADDRESS:PORT (e.g. 127.0.0.1:9464)");
		return -1;
	}
	if (!is_loopback((struct sockaddr *)&ss) && !allow_remote) {
		snprintf(err, errlen, "not a loopback address; the endpoint shows who moves what, so "
		    "serving it elsewhere needs metrics_allow_remote = yes");
		return -1;
	}
	return 0;
}

/* A new server for `spec` ("127.0.0.1:9464", "[::1]:9464"), or NULL with err set. */
static struct evhttp *
serve(const char *spec, bool allow_remote, char *where, size_t wherelen, char *err, size_t errlen)
{
	struct sockaddr_storage ss;
	int sslen = sizeof(ss), fd, one = 1;
	char host[INET6_ADDRSTRLEN], why[200];
	struct evhttp *h;

	if (metrics_check(spec, allow_remote, why, sizeof(why)) < 0 || parse_addr(spec, &ss, &sslen) < 0) {
		snprintf(err, errlen, "metrics = %s: %s", spec, why);
		return NULL;
	}
	if ((fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0) {
		snprintf(err, errlen, "metrics = %s: socket: %s", spec, strerror(errno));
		return NULL;
	}
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (ss.ss_family == AF_INET6)
		setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&ss, sslen) < 0 || listen(fd, 16) < 0) {
		snprintf(err, errlen, "metrics = %s: %s", spec, strerror(errno));
		close(fd);
		return NULL;
	}
	socklen_t l = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &l);
	if (ss.ss_family == AF_INET6) {
		const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)&ss;
		inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
		snprintf(where, wherelen, "[%s]:%u", host, ntohs(s6->sin6_port));
	} else {
		const struct sockaddr_in *s4 = (const struct sockaddr_in *)&ss;
		inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
		snprintf(where, wherelen, "%s:%u", host, ntohs(s4->sin_port));
	}
	if ((h = evhttp_new(mbase)) == NULL || evhttp_accept_socket_with_handle(h, fd) == NULL) {
		snprintf(err, errlen, "metrics = %s: cannot start the HTTP server", spec);
		if (h != NULL)
			evhttp_free(h);
		close(fd);
		return NULL;
	}
	/* A scrape is one small GET: bound everything else. */
	evhttp_set_allowed_methods(h, EVHTTP_REQ_GET | EVHTTP_REQ_HEAD);
	evhttp_set_max_headers_size(h, 8192);
	evhttp_set_max_body_size(h, 0);
	evhttp_set_timeout(h, 10);
	evhttp_set_cb(h, "/metrics", metrics_cb, NULL);
	evhttp_set_gencb(h, other_cb, NULL);
	return h;
}

void
metrics_stop(void)
{
	atomic_store(&recording, false);
	if (http != NULL)
		evhttp_free(http);
	http = NULL;
	if (prune_ev != NULL)
		event_free(prune_ev);
	prune_ev = NULL;
	listen_text[0] = '\0';
	pthread_mutex_lock(&mlock);
	for (int i = 0; i < CLIENT_HASH; i++)
		while (clients[i] != NULL) {
			struct cseries *c = clients[i];
			clients[i] = c->next;
			free(c);
		}
	pthread_mutex_unlock(&mlock);
}

/*
 * Starts, moves or stops the endpoint to match configuration c; -1 with err set when the new
 * endpoint cannot be served, and then the running one (if any) is kept.
 */
static int
apply(const struct conf *c, char *err, size_t errlen)
{
	const char *want = c->metrics_listen;

	if (metrics_off(want)) {
		if (http != NULL)
			log_info("metrics endpoint closed");
		metrics_stop();
		return 0;
	}
	/* the same address, and still allowed where it listens */
	if (http != NULL && strcmp(want, listen_text) == 0 && (!served_remote || c->metrics_allow_remote))
		return 0;
	char where[sizeof(served)];
	struct evhttp *h = serve(want, c->metrics_allow_remote, where, sizeof(where), err, errlen);
	if (h == NULL)
		return -1;
	if (http != NULL)
		evhttp_free(http);
	http = h;
	snprintf(listen_text, sizeof(listen_text), "%s", want);
	snprintf(served, sizeof(served), "%s", where);
	served_remote = metrics_check(want, false, where, sizeof(where)) < 0;
	if (prune_ev == NULL) {
		struct timeval tv = { 60, 0 };
		prune_ev = event_new(mbase, -1, EV_PERSIST, prune_cb, NULL);
		event_add(prune_ev, &tv);
	}
	atomic_store(&recording, true);
	log_info("metrics endpoint on http://%s/metrics", served);
	return 0;
}

/* At start: a bad address is fatal (the operator asked for metrics and would not get them). */
int
metrics_start(struct event_base *base)
{
	char err[256];

	started = true;
	mbase = base;
	if (apply(cfg, err, sizeof(err)) < 0)
		fatalx("%s", err);
	return 0;
}

/* At a reload, before n is published: a failure refuses the reload and keeps the endpoint. */
int
metrics_reload(const struct conf *n, char *err, size_t errlen)
{
	if (!started)
		return 0;
	return apply(n, err, errlen);
}
