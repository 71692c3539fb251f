/*
 * gpxctl: look inside a running gpxd and steer it.  Shaped like iproute2: `gpxctl [-j] [-s PATH]
 * OBJECT [COMMAND]`.  Every object prints a text table, or JSON with -j (built with json-c).
 * Query objects are open to every client of the daemon; drain, log-level and reload need root
 * or the daemon's admin group, which the daemon checks from the connection's credentials.
 */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <json-c/json.h>

#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"

static bool json;
static gpx_conn *conn;

static void
usage(FILE *f)
{
	fprintf(f,
	    "usage: gpxctl [-j] [-s socket] OBJECT [COMMAND]\n"
	    "objects:\n"
	    "  status                 daemon version, uptime, counts, CUDA availability\n"
	    "  topo                   GPUs and the path gpxd uses between each pair\n"
	    "  clients                connected clients\n"
	    "  regions                registered and imported regions\n"
	    "  exports                exported regions and their access rules\n"
	    "  transfers              transfers in flight\n"
	    "  stats                  counters per path\n"
	    "  peers                  peer daemons of other nodes: state, transport, traffic\n"
	    "  cluster                the cluster's nodes from etcd: addresses, leases, names\n"
	    "  drain CLIENT           refuse new transfers from CLIENT, let its queue finish\n"
	    "  log-level [LEVEL [SUBSYSTEMS]]  show or set the daemon's log level\n"
	    "  reload                 reread the configuration file\n"
	    "options:\n"
	    "  -j, --json             JSON output\n"
	    "  -s, --socket PATH      daemon socket (default: $GPX_SOCKET or /run/gpx/gpxd.sock)\n"
	    "  -h, --help             this text\n"
	    "  -V, --version          print the version\n");
}

static void
fail(int err, const char *what)
{
	const char *detail = conn ? gpx_last_error(conn) : "";

	fprintf(stderr, "gpxctl: %s: %s%s%s\n", what, gpx_strerror(err),
	    detail[0] && strcmp(detail, gpx_strerror(err)) ? ": " : "", detail);
	exit(1);
}

static Gpx__QueryReply *
query(enum gpx_query what)
{
	void *buf;
	size_t len;
	int r = gpx_query(conn, what, &buf, &len);

	if (r < 0)
		fail(r, "query");
	Gpx__QueryReply *q = gpx__query_reply__unpack(NULL, len, buf);
	free(buf);
	if (q == NULL) {
		fprintf(stderr, "gpxctl: cannot decode the daemon's reply\n");
		exit(1);
	}
	return q;
}

static void
print_json(json_object *o)
{
	puts(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_NOSLASHESCAPE));
	json_object_put(o);
}

static const char *
human(double v, char *buf, size_t len)
{
	static const char *u[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB" };
	int i = 0;

	while (v >= 1024 && i < 5) {
		v /= 1024;
		i++;
	}
	snprintf(buf, len, i ? "%.1f %s" : "%.0f %s", v, u[i]);
	return buf;
}

#define J_ADD(o, k, v) json_object_object_add(o, k, v)
#define J_U64(v) json_object_new_uint64(v)
#define J_INT(v) json_object_new_int64(v)
static json_object *J_STR(const char *v) { return json_object_new_string(v ? v : ""); }
#define J_BOOL(v) json_object_new_boolean(v)
#define J_DBL(v) json_object_new_double(v)

static int
do_status(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_STATUS);
	Gpx__DaemonStatus *s = q->status;
	char b1[32];

	if (s == NULL)
		return 1;
	if (json) {
		json_object *o = json_object_new_object();
		J_ADD(o, "version", J_STR(s->version));
		J_ADD(o, "protocol", J_U64(s->proto));
		J_ADD(o, "pid", J_INT(s->pid));
		J_ADD(o, "uptime_s", J_DBL(s->uptime_s));
		J_ADD(o, "socket", J_STR(s->socket));
		J_ADD(o, "config", J_STR(s->config));
		J_ADD(o, "clients", J_U64(s->clients));
		J_ADD(o, "regions", J_U64(s->regions));
		J_ADD(o, "exports", J_U64(s->exports));
		J_ADD(o, "inflight", J_U64(s->inflight));
		J_ADD(o, "workers", J_U64(s->workers));
		J_ADD(o, "chunk_size", J_U64(s->chunk_size));
		J_ADD(o, "transfers", J_U64(s->transfers));
		J_ADD(o, "bytes", J_U64(s->bytes));
		J_ADD(o, "cuda", J_STR(s->cuda));
		J_ADD(o, "trust_legacy_ipc", J_BOOL(s->trust_legacy));
		J_ADD(o, "fabric", J_STR(s->fabric));
		json_object *lp = json_object_new_object();
		J_ADD(lp, "max_s", J_DBL(s->loop_max_s));
		J_ADD(lp, "max_list_bytes", J_U64(s->loop_list_max));
		J_ADD(lp, "max_work", J_U64(s->loop_work_max));
		if (s->loop_cpu_max_s >= 0)
			J_ADD(lp, "max_cpu_s", J_DBL(s->loop_cpu_max_s));
		if (s->n_loop_cpu_top_s > 0) {
			json_object *top = json_object_new_array();
			for (size_t i = 0; i < s->n_loop_cpu_top_s; i++)
				json_object_array_add(top, J_DBL(s->loop_cpu_top_s[i]));
			J_ADD(lp, "top_cpu_s", top);
		}
		J_ADD(o, "event_loop", lp);
		json_object *hc = json_object_new_object();
		J_ADD(hc, "ipc", J_U64(s->cache_ipc));
		J_ADD(hc, "pool", J_U64(s->cache_pool));
		J_ADD(hc, "vmm_pieces", J_U64(s->cache_vmm));
		J_ADD(hc, "opens", J_U64(s->cache_opens));
		J_ADD(hc, "hits", J_U64(s->cache_hits));
		J_ADD(o, "handle_cache", hc);
		json_object *b = json_object_new_object();
		J_ADD(b, "used", J_U64(s->budget_used));
		J_ADD(b, "entries", J_U64(s->budget_entries));
		J_ADD(b, "total", J_U64(s->budget_total));
		J_ADD(b, "uid", J_U64(s->budget_uid));
		J_ADD(b, "connection", J_U64(s->budget_connection));
		J_ADD(b, "request", J_U64(s->budget_request));
		J_ADD(b, "refused_busy", J_U64(s->budget_refused_busy));
		J_ADD(b, "refused_too_large", J_U64(s->budget_refused_large));
		J_ADD(o, "budgets", b);
		json_object *mp = json_object_new_object();
		J_ADD(mp, "used", J_U64(s->maps_used));
		J_ADD(mp, "limit", J_U64(s->maps_limit));
		J_ADD(mp, "refused", J_U64(s->maps_refused));
		J_ADD(o, "mappings", mp);
		print_json(o);
	} else {
		printf("gpxd %s (protocol %u), pid %d, up %.0f s\n", s->version, s->proto, s->pid, s->uptime_s);
		printf("socket:     %s\n", s->socket);
		printf("config:     %s\n", s->config);
		printf("clients:    %u\n", s->clients);
		printf("regions:    %u\n", s->regions);
		printf("exports:    %u\n", s->exports);
		printf("in flight:  %u transfers\n", s->inflight);
		printf("moved:      %llu transfers, %s\n", (unsigned long long)s->transfers,
		    human(s->bytes, b1, sizeof(b1)));
		printf("workers:    %u host copy threads\n", s->workers);
		printf("chunk size: %s\n", human(s->chunk_size, b1, sizeof(b1)));
		printf("cuda:       %s\n", s->cuda);
		printf("legacy IPC: %s\n", s->trust_legacy ? "accepted (one trust domain)" : "refused (multi-tenant)");
		printf("fabric:     %s\n", s->fabric[0] ? s->fabric : "off");
		printf("event loop: longest turn %.3f ms; most lists checked in one turn %s, most requests "
		    "and handles %u\n", s->loop_max_s * 1e3, human(s->loop_list_max, b1, sizeof(b1)), s->loop_work_max);
		printf("handles:    %u entries (%u cuda-ipc, %u cuda-pool, %u cuda-vmm pieces), "
		    "%llu driver opens, %llu hits\n", s->cache_ipc + s->cache_pool + s->cache_vmm, s->cache_ipc,
		    s->cache_pool, s->cache_vmm, (unsigned long long)s->cache_opens,
		    (unsigned long long)s->cache_hits);
		char b2[32], b3[32], b4[32], b5[32];
		char b6[32];
		printf("budgets:    %s of %s held (%s by regions, imports and exports); %s per uid, %s per "
		    "connection, %s per request\n", human(s->budget_used, b1, sizeof(b1)),
		    human(s->budget_total, b2, sizeof(b2)), human(s->budget_entries, b6, sizeof(b6)),
		    human(s->budget_uid, b3, sizeof(b3)), human(s->budget_connection, b4, sizeof(b4)),
		    human(s->budget_request, b5, sizeof(b5)));
		printf("refused:    %llu busy, %llu too large (budgets)\n", (unsigned long long)s->budget_refused_busy,
		    (unsigned long long)s->budget_refused_large);
		printf("mappings:   %u of %u held for clients (regions, rings, areas); %llu refused\n", s->maps_used,
		    s->maps_limit, (unsigned long long)s->maps_refused);
	}
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_clients(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_CLIENTS);
	json_object *a = json ? json_object_new_array() : NULL;
	char b1[32];

	if (!json)
		printf("%-6s %-6s %-6s %-8s %-16s %-9s %7s %8s %10s %10s %6s\n", "ID", "UID", "GID", "PID",
		    "NAME", "STATE", "REGIONS", "INFLIGHT", "TRANSFERS", "BYTES", "ERRORS");
	for (size_t i = 0; i < q->n_clients; i++) {
		Gpx__ClientInfo *c = q->clients[i];
		if (json) {
			json_object *o = json_object_new_object();
			J_ADD(o, "id", J_U64(c->id));
			J_ADD(o, "uid", J_U64(c->uid));
			J_ADD(o, "gid", J_U64(c->gid));
			J_ADD(o, "pid", J_INT(c->pid));
			J_ADD(o, "name", J_STR(c->name));
			J_ADD(o, "state", J_STR(c->state));
			J_ADD(o, "regions", J_U64(c->regions));
			J_ADD(o, "inflight", J_U64(c->inflight));
			J_ADD(o, "transfers", J_U64(c->transfers));
			J_ADD(o, "bytes", J_U64(c->bytes));
			J_ADD(o, "errors", J_U64(c->errors));
			J_ADD(o, "connected_s", J_DBL(c->connected_s));
			json_object_array_add(a, o);
		} else
			printf("%-6llu %-6u %-6u %-8d %-16.16s %-9s %7u %8u %10llu %10s %6llu\n",
			    (unsigned long long)c->id, c->uid, c->gid, c->pid, c->name[0] ? c->name : "-",
			    c->state, c->regions, c->inflight, (unsigned long long)c->transfers,
			    human(c->bytes, b1, sizeof(b1)), (unsigned long long)c->errors);
	}
	if (json)
		print_json(a);
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_regions(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_REGIONS);
	json_object *a = json ? json_object_new_array() : NULL;
	char b1[32];

	if (!json)
		printf("%-18s %-6s %-9s %-6s %12s %-8s %-4s %s\n", "REGION", "CLIENT", "KIND", "DEVICE",
		    "LENGTH", "IMPORTED", "MODE", "EXPORT");
	for (size_t i = 0; i < q->n_regions; i++) {
		Gpx__RegionInfo *r = q->regions[i];
		if (json) {
			json_object *o = json_object_new_object();
			char id[32];
			snprintf(id, sizeof(id), "%#llx", (unsigned long long)r->id);
			J_ADD(o, "id", J_STR(id));
			J_ADD(o, "client", J_U64(r->client));
			J_ADD(o, "kind", J_STR(r->kind));
			J_ADD(o, "device", J_STR(r->device));
			J_ADD(o, "length", J_U64(r->length));
			J_ADD(o, "imported", J_BOOL(r->imported));
			J_ADD(o, "read_only", J_BOOL(r->read_only));
			J_ADD(o, "export", J_STR(r->export_name));
			json_object_array_add(a, o);
		} else
			printf("%#-18llx %-6llu %-9s %-6s %12s %-8s %-4s %s\n", (unsigned long long)r->id,
			    (unsigned long long)r->client, r->kind, r->device, human(r->length, b1, sizeof(b1)),
			    r->imported ? "yes" : "no", r->read_only ? "ro" : "rw",
			    r->export_name[0] ? r->export_name : "-");
	}
	if (json)
		print_json(a);
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_exports(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_EXPORTS);
	json_object *a = json ? json_object_new_array() : NULL;

	if (!json)
		printf("%-24s %-6s %-18s %-5s %-6s %-6s %9s %-6s %s\n", "NAME", "CLIENT", "REGION", "RULE",
		    "UID", "GID", "IMPORTERS", "NOTIFY", "MODE");
	for (size_t i = 0; i < q->n_exports; i++) {
		Gpx__ExportInfo *e = q->exports[i];
		if (json) {
			json_object *o = json_object_new_object();
			char id[32];
			snprintf(id, sizeof(id), "%#llx", (unsigned long long)e->region);
			J_ADD(o, "name", J_STR(e->name));
			J_ADD(o, "client", J_U64(e->client));
			J_ADD(o, "region", J_STR(id));
			J_ADD(o, "rule", J_STR(e->rule));
			J_ADD(o, "uid", J_U64(e->uid));
			J_ADD(o, "gid", J_U64(e->gid));
			J_ADD(o, "importers", J_U64(e->importers));
			J_ADD(o, "notify", J_BOOL(e->notify));
			J_ADD(o, "read_only", J_BOOL(e->read_only));
			J_ADD(o, "remote", J_BOOL(e->remote));
			J_ADD(o, "peers", J_STR(e->peers));
			J_ADD(o, "gpudirect", J_STR(e->gpudirect));
			J_ADD(o, "node", J_STR(e->node));
			json_object_array_add(a, o);
		} else if (e->client == 0 && e->node != NULL && e->node[0] != '\0') {
			/* a cluster name another node holds */
			printf("%-24s %-6s %-18s %-5s %-6u %-6s %9s %-6s cluster, on node %s\n", e->name, "-", "-", "-",
			    e->uid, "-", "-", "-", e->node);
		} else {
			printf("%-24s %-6llu %#-18llx %-5s %-6u %-6u %9u %-6s %s%s%s%s\n", e->name,
			    (unsigned long long)e->client, (unsigned long long)e->region, e->rule, e->uid, e->gid,
			    e->importers, e->notify ? "yes" : "no", e->read_only ? "ro" : "rw",
			    e->remote ? ",remote" : "", e->remote && e->peers && e->peers[0] ? ":" : "",
			    e->remote && e->peers ? e->peers : "");
			if (e->node != NULL && e->node[0] != '\0')
				printf("%-24s cluster name, held by this node (%s)\n", "", e->node);
			if (e->gpudirect && e->gpudirect[0])
				printf("%-24s GPU memory to peers: %s\n", "", e->gpudirect);
		}
	}
	if (json)
		print_json(a);
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_transfers(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_TRANSFERS);
	json_object *a = json ? json_object_new_array() : NULL;
	char b1[32], b2[32];

	if (!json)
		printf("%-6s %-20s %-5s %8s %12s %12s %8s\n", "CLIENT", "TAG", "PATH", "SEGMENTS", "BYTES",
		    "DONE", "AGE");
	for (size_t i = 0; i < q->n_transfers; i++) {
		Gpx__TransferInfo *t = q->transfers[i];
		if (json) {
			json_object *o = json_object_new_object();
			J_ADD(o, "client", J_U64(t->client));
			J_ADD(o, "tag", J_U64(t->tag));
			J_ADD(o, "path", J_STR(t->path));
			J_ADD(o, "segments", J_U64(t->segments));
			J_ADD(o, "bytes", J_U64(t->bytes));
			J_ADD(o, "done", J_U64(t->done));
			J_ADD(o, "age_s", J_DBL(t->age_s));
			json_object_array_add(a, o);
		} else
			printf("%-6llu %-20llu %-5s %8u %12s %12s %7.3fs\n", (unsigned long long)t->client,
			    (unsigned long long)t->tag, t->path, t->segments, human(t->bytes, b1, sizeof(b1)),
			    human(t->done, b2, sizeof(b2)), t->age_s);
	}
	if (json)
		print_json(a);
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_stats(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_STATS);
	json_object *a = json ? json_object_new_array() : NULL;
	char b1[32];

	if (!json)
		printf("%-8s %12s %14s %8s\n", "PATH", "TRANSFERS", "BYTES", "ERRORS");
	for (size_t i = 0; i < q->n_paths; i++) {
		Gpx__PathStats *p = q->paths[i];
		if (json) {
			json_object *o = json_object_new_object();
			J_ADD(o, "path", J_STR(p->path));
			J_ADD(o, "transfers", J_U64(p->transfers));
			J_ADD(o, "bytes", J_U64(p->bytes));
			J_ADD(o, "errors", J_U64(p->errors));
			json_object_array_add(a, o);
		} else
			printf("%-8s %12llu %14s %8llu\n", p->path, (unsigned long long)p->transfers,
			    human(p->bytes, b1, sizeof(b1)), (unsigned long long)p->errors);
	}
	if (json)
		print_json(a);
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_topo(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_TOPO);
	char b1[32];

	if (json) {
		json_object *o = json_object_new_object(), *d = json_object_new_array(),
		    *l = json_object_new_array();
		for (size_t i = 0; i < q->n_devices; i++) {
			Gpx__DeviceInfo *g = q->devices[i];
			json_object *x = json_object_new_object();
			J_ADD(x, "index", J_U64(g->index));
			J_ADD(x, "uuid", J_STR(g->uuid));
			J_ADD(x, "name", J_STR(g->name));
			J_ADD(x, "pci", J_STR(g->pci));
			J_ADD(x, "memory", J_U64(g->memory));
			J_ADD(x, "copy_engines", J_U64(g->copy_engines));
			J_ADD(x, "sms", J_U64(g->sms));
			J_ADD(x, "nic", J_STR(g->nic));
			J_ADD(x, "nic_why", J_STR(g->nic_why));
			J_ADD(x, "nvml", J_BOOL(g->nvml));
			J_ADD(x, "nvlinks", J_U64(g->nvlinks));
			J_ADD(x, "nvswitch_links", J_U64(g->nvswitch_links));
			json_object_array_add(d, x);
		}
		json_object *ns = json_object_new_array();
		for (size_t i = 0; i < q->n_nics; i++) {
			Gpx__NicInfo *n = q->nics[i];
			json_object *x = json_object_new_object();
			J_ADD(x, "name", J_STR(n->name));
			J_ADD(x, "pci", J_STR(n->pci));
			J_ADD(x, "numa", J_INT(n->numa));
			J_ADD(x, "state", J_STR(n->state));
			J_ADD(x, "link_layer", J_STR(n->link_layer));
			J_ADD(x, "ports", J_U64(n->ports));
			json_object_array_add(ns, x);
		}
		for (size_t i = 0; i < q->n_links; i++) {
			Gpx__PeerLink *p = q->links[i];
			json_object *x = json_object_new_object();
			J_ADD(x, "src", J_U64(p->src));
			J_ADD(x, "dst", J_U64(p->dst));
			J_ADD(x, "access", J_BOOL(p->access));
			J_ADD(x, "rank", J_INT(p->rank));
			J_ADD(x, "atomics", J_BOOL(p->atomics));
			J_ADD(x, "path", J_STR(p->path));
			J_ADD(x, "nvlinks", J_U64(p->nvlinks));
			J_ADD(x, "fabric", J_STR(p->fabric));
			json_object_array_add(l, x);
		}
		J_ADD(o, "devices", d);
		J_ADD(o, "links", l);
		J_ADD(o, "nics", ns);
		print_json(o);
		gpx__query_reply__free_unpacked(q, NULL);
		return 0;
	}
	if (q->n_devices == 0) {
		Gpx__QueryReply *s = query(GPX_Q_STATUS);
		printf("no GPU: %s\n", s->status ? s->status->cuda : "?");
		gpx__query_reply__free_unpacked(s, NULL);
	}
	for (size_t i = 0; i < q->n_devices; i++) {
		Gpx__DeviceInfo *g = q->devices[i];
		printf("GPU%u  %s  %s  pci %s  %s  %u copy engines  %u SMs", g->index, g->uuid, g->name,
		    g->pci, human(g->memory, b1, sizeof(b1)), g->copy_engines, g->sms);
		if (!g->nvml)
			printf("  NVLinks unknown (no NVML)\n");
		else if (g->nvswitch_links > 0)
			printf("  %u NVLinks, %u to NVSwitches\n", g->nvlinks, g->nvswitch_links);
		else
			printf("  %u NVLinks\n", g->nvlinks);
	}
	if (q->n_devices > 0) {
		printf("\n%-6s", "");
		for (size_t j = 0; j < q->n_devices; j++)
			printf(" GPU%-13u", q->devices[j]->index);
		printf("\n");
		for (size_t i = 0; i < q->n_devices; i++) {
			printf("GPU%-3u", q->devices[i]->index);
			for (size_t j = 0; j < q->n_devices; j++) {
				const char *cell = i == j ? "X" : "-";
				char buf[48], fab[24];
				for (size_t k = 0; k < q->n_links; k++) {
					Gpx__PeerLink *p = q->links[k];
					if (p->src == q->devices[i]->index && p->dst == q->devices[j]->index) {
						fab[0] = '\0';
						if (strcmp(p->fabric, "nvlink") == 0)
							snprintf(fab, sizeof(fab), "NV%u/", p->nvlinks);
						else if (strcmp(p->fabric, "nvswitch") == 0)
							snprintf(fab, sizeof(fab), "NVS%u/", q->devices[i]->nvswitch_links);
						else if (strcmp(p->fabric, "pcie") == 0)
							snprintf(fab, sizeof(fab), "PCIe/");
						snprintf(buf, sizeof(buf), "%s%s/r%d%s", fab, p->path, p->rank, p->atomics ? "/a" : "");
						cell = buf;
					}
				}
				printf(" %-16s", cell);
			}
			printf("\n");
		}
		printf("\nrow to column: what a copy crosses (NVn: n NVLinks straight to the peer, NVSn: NVSwitches,\n"
		    "the row GPU's n NVLinks to them, as nvidia-smi topo -m counts them in its NVn; PCIe)\n"
		    "and how gpxd copies: p2p (contiguous copies on the row GPU's copy engines, lists of small\n"
		    "segments in its SM kernel, page lists in the column GPU's SM kernel, pulling), staged\n"
		    "through host memory where the driver gives no peer access; rN: the driver's performance\n"
		    "rank, a: native atomics\n");
	}
	if (q->n_nics > 0)
		printf("\n");
	for (size_t i = 0; i < q->n_nics; i++) {
		Gpx__NicInfo *n = q->nics[i];
		char numa[16] = "-";
		if (n->numa >= 0)
			snprintf(numa, sizeof(numa), "%d", n->numa);
		printf("NIC %-10s %-14s numa %-3s %s%s%s\n", n->name, n->pci, numa, n->state,
		    n->link_layer[0] ? " " : "", n->link_layer);
	}
	for (size_t i = 0; i < q->n_devices && q->n_nics > 0; i++)
		printf("GPU%u -> %s (%s)\n", q->devices[i]->index, q->devices[i]->nic[0] ? q->devices[i]->nic : "none",
		    q->devices[i]->nic_why);
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_drain(int argc, char **argv)
{
	char *end;
	int r;

	if (argc != 2) {
		fprintf(stderr, "usage: gpxctl drain CLIENT\n");
		return 2;
	}
	unsigned long long id = strtoull(argv[1], &end, 10);
	if (*end != '\0') {
		fprintf(stderr, "gpxctl: drain: '%s' is not a client id\n", argv[1]);
		return 2;
	}
	if ((r = gpx_admin(conn, GPX_ADMIN_DRAIN, id, NULL, NULL, 0)) < 0)
		fail(r, "drain");
	if (json)
		print_json(json_object_new_object());
	else
		printf("client %llu drained: new transfers are refused\n", id);
	return 0;
}

static int
do_log_level(int argc, char **argv)
{
	char spec[256] = "", reply[256];
	int r;

	for (int i = 1; i < argc; i++) {
		strncat(spec, argv[i], sizeof(spec) - strlen(spec) - 2);
		if (i + 1 < argc)
			strcat(spec, " ");
	}
	if ((r = gpx_admin(conn, GPX_ADMIN_LOG_LEVEL, 0, spec, reply, sizeof(reply))) < 0)
		fail(r, "log-level");
	if (json) {
		json_object *o = json_object_new_object();
		J_ADD(o, "log_level", J_STR(reply));
		print_json(o);
	} else
		printf("%s\n", reply);
	return 0;
}

/*
 * The daemon's report of a reload, four lines: "from FILE", then "applied", "restart" and
 * "command-line", each followed by the keys (section.key) it changed that way.
 */
static const char *
report_line(const char *rep, const char *word, char *out, size_t len)
{
	size_t wl = strlen(word);

	out[0] = '\0';
	for (const char *s = rep; s != NULL && *s; s = strchr(s, '\n') ? strchr(s, '\n') + 1 : NULL)
		if (strncmp(s, word, wl) == 0 && (s[wl] == ' ' || s[wl] == '\n' || s[wl] == '\0')) {
			s += wl + (s[wl] == ' ');
			snprintf(out, len, "%.*s", (int)strcspn(s, "\n"), s);
			break;
		}
	return out;
}

static json_object *
key_array(const char *keys)
{
	json_object *a = json_object_new_array();

	for (const char *s = keys; *s;) {
		size_t l = strcspn(s, " ");
		if (l > 0)
			json_object_array_add(a, json_object_new_string_len(s, (int)l));
		s += l + (s[l] == ' ');
	}
	return a;
}

static int
do_reload(int argc, char **argv)
{
	char rep[1024], from[256], live[1024], restart[1024], fixed[256];
	int r = gpx_admin(conn, GPX_ADMIN_RELOAD, 0, NULL, rep, sizeof(rep));

	if (r < 0)
		fail(r, "reload");
	report_line(rep, "from", from, sizeof(from));
	report_line(rep, "applied", live, sizeof(live));
	report_line(rep, "restart", restart, sizeof(restart));
	report_line(rep, "command-line", fixed, sizeof(fixed));
	if (json) {
		json_object *o = json_object_new_object();
		J_ADD(o, "config", J_STR(from));
		J_ADD(o, "applied", key_array(live));
		J_ADD(o, "restart", key_array(restart));
		J_ADD(o, "command_line", key_array(fixed));
		print_json(o);
		return 0;
	}
	printf("configuration reloaded from %s\n", from[0] ? from : "(unknown)");
	printf("applied now: %s\n", live[0] ? live : "none");
	printf("waiting for a restart: %s\n", restart[0] ? restart : "none");
	if (fixed[0])
		printf("kept from the command line: %s\n", fixed);
	return 0;
}

/* Peer daemons (the fabric): one line per connection, or configured address not reached. */
/* gpxctl cluster: the nodes this gpxd knows from etcd. */
static int
do_cluster(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_CLUSTER);
	json_object *o = q->cluster && q->cluster[0] ? json_tokener_parse(q->cluster) : NULL, *nodes, *v;

	(void)argc;
	(void)argv;
	if (o == NULL) {
		fprintf(stderr, "gpxctl: this gpxd is in no cluster ([cluster] etcd in gpxd.conf)\n");
		gpx__query_reply__free_unpacked(q, NULL);
		return 1;
	}
	if (json) {
		print_json(o);
		gpx__query_reply__free_unpacked(q, NULL);
		return 0;
	}
	#define S(obj, k) (json_object_object_get_ex(obj, k, &v) ? json_object_get_string(v) : "")
	printf("cluster: node %s, etcd %s, %s%s%s, %s names\n", S(o, "self"), S(o, "etcd"), S(o, "state"),
	    S(o, "why")[0] ? ": " : "", S(o, "why"), S(o, "names"));
	printf("%-16s %-22s %-10s %4s %6s %7s %-9s %s\n", "NODE", "ADDRESS", "TRANSPORT", "GPUS", "LEASE",
	    "EXPORTS", "REACHABLE", "VERSION");
	if (json_object_object_get_ex(o, "nodes", &nodes))
		for (size_t i = 0; i < json_object_array_length(nodes); i++) {
			json_object *n = json_object_array_get_idx(nodes, i), *l, *t;
			char tr[64] = "", lease[16];
			if (json_object_object_get_ex(n, "transports", &t))
				for (size_t k = 0; k < json_object_array_length(t); k++)
					snprintf(tr + strlen(tr), sizeof(tr) - strlen(tr), "%s%s", k ? "," : "",
					    json_object_get_string(json_object_array_get_idx(t, k)));
			int64_t left = json_object_object_get_ex(n, "lease_left", &v) ? json_object_get_int64(v) : 0;
			snprintf(lease, sizeof(lease), left > 0 ? "%llds" : left < 0 ? "gone" : "?", (long long)left);
			printf("%-16s %-22s %-10s %4s %6s %7s %-9s %s\n", S(n, "name"),
			    json_object_object_get_ex(n, "listen", &l) && json_object_array_length(l) > 0 ?
			    json_object_get_string(json_object_array_get_idx(l, 0)) : "-", tr[0] ? tr : "-",
			    S(n, "gpus"), lease, S(n, "exports"),
			    json_object_object_get_ex(n, "self", &v) && json_object_get_boolean(v) ? "self" :
			    json_object_object_get_ex(n, "reachable", &v) && json_object_get_boolean(v) ? "yes" : "no",
			    S(n, "version"));
		}
	#undef S
	json_object_put(o);
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static int
do_peers(int argc, char **argv)
{
	Gpx__QueryReply *q = query(GPX_Q_PEERS);
	json_object *a = json ? json_object_new_array() : NULL;
	char b1[32], b2[32], b3[32];

	if (!json)
		printf("%-16s %-22s %-10s %-5s %-6s %5s %5s %5s %5s %10s %10s %6s %s\n", "NODE", "ADDRESS",
		    "STATE", "TRANS", "DIR", "QPS", "REGS", "IMP", "EXP", "TX", "RX", "ERRORS", "EPOCH/WHY");
	for (size_t i = 0; i < q->n_peers; i++) {
		Gpx__PeerInfo *p = q->peers[i];
		if (json) {
			json_object *o = json_object_new_object();
			J_ADD(o, "node", J_STR(p->node));
			J_ADD(o, "address", J_STR(p->address));
			J_ADD(o, "state", J_STR(p->state));
			J_ADD(o, "transport", J_STR(p->transport));
			J_ADD(o, "outbound", J_BOOL(p->outbound));
			J_ADD(o, "on_demand", J_BOOL(p->on_demand));
			J_ADD(o, "version", J_U64(p->version));
			J_ADD(o, "epoch", J_U64(p->epoch));
			J_ADD(o, "queue_pairs", J_U64(p->queue_pairs));
			J_ADD(o, "registrations", J_U64(p->registrations));
			J_ADD(o, "imports", J_U64(p->imports));
			J_ADD(o, "exported", J_U64(p->exported));
			J_ADD(o, "bytes_tx", J_U64(p->bytes_tx));
			J_ADD(o, "bytes_rx", J_U64(p->bytes_rx));
			J_ADD(o, "ops", J_U64(p->ops));
			J_ADD(o, "errors", J_U64(p->errors));
			J_ADD(o, "notes_imm_tx", J_U64(p->notes_imm_tx));
			J_ADD(o, "notes_imm_rx", J_U64(p->notes_imm_rx));
			J_ADD(o, "notes_msg_tx", J_U64(p->notes_msg_tx));
			J_ADD(o, "notes_msg_rx", J_U64(p->notes_msg_rx));
			J_ADD(o, "inflight", J_U64(p->inflight));
			J_ADD(o, "connected_s", J_DBL(p->connected_s));
			J_ADD(o, "why", J_STR(p->why));
			json_object_array_add(a, o);
		} else {
			char tail[200];
			if (strcmp(p->state, "ready") == 0)
				snprintf(tail, sizeof(tail), "%08x", p->epoch);
			else
				snprintf(tail, sizeof(tail), "%s", p->why);
			/* DIR: how it came: we dialled it (configured, or on demand for an import by
			 * address), or it dialled us */
			printf("%-16s %-22s %-10s %-5s %-6s %5u %5u %5u %5u %10s %10s %6llu %s\n",
			    p->node[0] ? p->node : "-", p->address, p->state, p->transport,
			    p->on_demand ? "demand" : p->outbound ? "out" : "in", p->queue_pairs, p->registrations,
			    p->imports, p->exported,
			    human(p->bytes_tx, b1, sizeof(b1)), human(p->bytes_rx, b2, sizeof(b2)),
			    (unsigned long long)p->errors, tail);
		}
	}
	const Gpx__FabricGpu *g = q->fabric_gpu;
	if (json && g != NULL) {
		json_object *o = json_object_new_object(), *top = json_object_new_object();
		J_ADD(o, "direct_bytes", J_U64(g->direct_bytes));
		J_ADD(o, "staged_bytes", J_U64(g->staged_bytes));
		J_ADD(o, "staged_copies", J_U64(g->staged_copies));
		J_ADD(o, "heap_copies", J_U64(g->heap_copies));
		J_ADD(o, "dmabuf_registrations", J_U64(g->dmabuf_regs));
		J_ADD(o, "peermem_registrations", J_U64(g->peermem_regs));
		J_ADD(o, "unregistrable", J_U64(g->unregistrable));
		J_ADD(o, "staging_pool_bytes", J_U64(g->pool_bytes));
		J_ADD(top, "peers", a);
		J_ADD(top, "gpu_memory", o);
		a = top;
	}
	if (json)
		print_json(a);
	else if (q->n_peers == 0) {
		Gpx__QueryReply *s = query(GPX_Q_STATUS);
		printf("no peers (fabric: %s)\n", s->status && s->status->fabric[0] ? s->status->fabric : "off");
		gpx__query_reply__free_unpacked(s, NULL);
	}
	if (!json && g != NULL && g->pool_bytes + g->direct_bytes + g->staged_bytes + g->unregistrable > 0)
		printf("GPU memory: %s by the NIC (registrations: %llu dma-buf, %llu peermem, %llu neither); "
		    "%s staged in %llu copies (%llu through the heap), %s of pinned buffers\n",
		    human(g->direct_bytes, b1, sizeof(b1)), (unsigned long long)g->dmabuf_regs,
		    (unsigned long long)g->peermem_regs, (unsigned long long)g->unregistrable,
		    human(g->staged_bytes, b2, sizeof(b2)), (unsigned long long)g->staged_copies,
		    (unsigned long long)g->heap_copies, human(g->pool_bytes, b3, sizeof(b3)));
	gpx__query_reply__free_unpacked(q, NULL);
	return 0;
}

static const struct object {
	const char *name;
	int (*fn)(int, char **);
	int max_args;
} objects[] = {
	{ "status", do_status, 0 },
	{ "topo", do_topo, 0 },
	{ "clients", do_clients, 0 },
	{ "regions", do_regions, 0 },
	{ "exports", do_exports, 0 },
	{ "transfers", do_transfers, 0 },
	{ "stats", do_stats, 0 },
	{ "peers", do_peers, 0 },
	{ "cluster", do_cluster, 0 },
	{ "drain", do_drain, 1 },
	{ "log-level", do_log_level, 2 },
	{ "reload", do_reload, 0 },
};

int
main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "json", no_argument, NULL, 'j' },
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	const char *sock = NULL;
	int ch;

	while ((ch = getopt_long(argc, argv, "+js:hV", longopts, NULL)) != -1) {
		switch (ch) {
		case 'j': json = true; break;
		case 's': sock = optarg; break;
		case 'h': usage(stdout); return 0;
		case 'V': printf("gpxctl %s\n", PACKAGE_VERSION); return 0;
		default: usage(stderr); return 2;
		}
	}
	argc -= optind;
	argv += optind;
	if (argc < 1) {
		usage(stderr);
		return 2;
	}
	for (size_t i = 0; i < sizeof(objects) / sizeof(objects[0]); i++) {
		const struct object *o = &objects[i];
		/* Unambiguous prefixes work, as in iproute2 ("gpxctl cl" is clients). */
		if (strncmp(argv[0], o->name, strlen(argv[0])) != 0)
			continue;
		if (argc - 1 > o->max_args) {
			fprintf(stderr, "gpxctl: %s: too many arguments\n", o->name);
			return 2;
		}
		struct gpx_connect_opts co = { .socket = sock, .name = "gpxctl", .eventfd = -1, .no_ring = 1 };
		int r = gpx_connect_opts(&co, &conn);
		if (r < 0) {
			fprintf(stderr, "gpxctl: %s%s\n", gpx_last_error(NULL), r == -GPX_ECONN ? " (is gpxd running?)" : "");
			return 1;
		}
		r = o->fn(argc, argv);
		gpx_close(conn);
		return r;
	}
	fprintf(stderr, "gpxctl: unknown object '%s'; try gpxctl -h\n", argv[0]);
	return 2;
}
