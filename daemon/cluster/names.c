/*
 * Cluster names.  Ours: an export open to peers is claimed in etcd under our lease
 * (P/names/NAME, created only where no one holds it: etcd decides, in one transaction, never a
 * read before a write), withdrawn with the export, claimed again under a new lease after etcd
 * was away.  Each claim's value is its own ({"node","uid","claim"}, the claim's number in this
 * daemon), and a withdrawal deletes the key only while it holds that value: a delete etcd
 * carries out late never takes the key of a later claim of the name.  Everyone's: the watch
 * keeps a table of name -> node, from which an import of a bare name finds its node, and gpxd
 * dials that node's fabric address on demand.  The address is a hint: the fabric's handshake
 * still proves the shared key, and the node that answers must be the node that etcd named.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cluster/internal.h"
#include "daemon/fabric/fabric.h"
#include <event2/buffer.h>

/* ---- everyone's names, from the watch ---- */

struct cname {
	struct cname *next;          /* hash chain */
	char node[CLUSTER_NODE_MAX + 1];
	uid_t uid;
	char name[];
};

#define NBUCKETS 65536
static struct cname **table;
static size_t nnames;

static uint32_t
hash(const char *s)
{
	uint32_t h = 2166136261u;

	while (*s)
		h = (h ^ (unsigned char)*s++) * 16777619u;
	return h % NBUCKETS;
}

static struct cname **
slot(const char *name)
{
	struct cname **p;

	if (table == NULL && (table = calloc(NBUCKETS, sizeof(*table))) == NULL)
		return NULL;
	for (p = &table[hash(name)]; *p != NULL; p = &(*p)->next)
		if (strcmp((*p)->name, name) == 0)
			break;
	return p;
}

static void
count(const char *node, int d)
{
	struct cnode *n = member_node(node);

	if (n != NULL)
		n->names += d;
}

static void
unlink_name(struct cname **p)
{
	struct cname *c = *p;

	*p = c->next;
	count(c->node, -1);
	nnames--;
	free(c);
}

void
names_seen(const char *name, const char *v, size_t len)
{
	struct cname **p, *c;
	struct json_object *o = NULL;
	const char *node;

	if (!export_name_ok(name)) {
		log_warnx("cluster: ignored: names/%.80s: not an export name", name);
		return;
	}
	if ((p = slot(name)) == NULL) {
		member_lost();
		return;
	}
	if (v == NULL) {
		if (*p != NULL)
			unlink_name(p);
		return;
	}
	bool nomem = false;
	if (len > CLUSTER_VALUE_MAX || (o = js_parse(v, &nomem)) == NULL ||
	    (node = js_str(o, "node")) == NULL || !export_node_name_ok(node) || strlen(node) > CLUSTER_NODE_MAX) {
		if (nomem) {
			member_lost();
			return;
		}
		log_warnx("cluster: ignored: names/%s: %s", name, len > CLUSTER_VALUE_MAX ? "value too large" :
		    "not {\"node\": NODE, \"uid\": UID}");
		json_object_put(o);
		return;
	}
	if (*p != NULL)
		unlink_name(p);
	if ((c = calloc(1, sizeof(*c) + strlen(name) + 1)) != NULL) {
		strcpy(c->name, name);
		snprintf(c->node, sizeof(c->node), "%s", node);
		c->uid = (uid_t)js_int(o, "uid");
		c->next = NULL;
		*p = c;
		nnames++;
		count(node, +1);
	} else
		member_lost();
	json_object_put(o);
}

void
names_forget_all(void)
{
	struct cnode *n;

	for (size_t i = 0; table != NULL && i < NBUCKETS; i++)
		while (table[i] != NULL)
			unlink_name(&table[i]);
	TAILQ_FOREACH(n, &cnodes, entry)
		n->names = 0;
}

size_t
names_count(void)
{
	return nnames;
}

uint32_t
names_of_uid(uid_t uid)
{
	uint32_t k = 0;

	for (size_t i = 0; table != NULL && i < NBUCKETS; i++)
		for (struct cname *c = table[i]; c != NULL; c = c->next)
			k += c->uid == uid;
	return k;
}

const char *
cluster_name_node(const char *name)
{
	struct cname **p;

	if (!cluster_running() || table == NULL || (p = slot(name)) == NULL || *p == NULL)
		return NULL;
	return (*p)->node;
}

void
cluster_names_visit(void (*fn)(const char *name, const char *node, uid_t uid, void *arg), void *arg)
{
	for (size_t i = 0; cluster_running() && table != NULL && i < NBUCKETS; i++)
		for (struct cname *c = table[i]; c != NULL; c = c->next)
			if (strcmp(c->node, mb.self) != 0)
				fn(c->name, c->node, c->uid, arg);
}

const char *
cluster_self(void)
{
	return cluster_running() ? mb.self : "";
}

/* ---- ours ---- */

/*
 * MINE_WAIT: an export waiting for its claim's answer (or a claim again under a new lease);
 * MINE_HELD: claimed; MINE_DROPPED: withdrawn with its claim in flight, whose answer says
 * whether the key goes; MINE_UNPUT: withdrawn, its key still to be deleted (kept until etcd
 * has said so).  A name has one record of its export (waiting or held) at most, and one of
 * an earlier export still busy with etcd (dropped or unput) at most.
 */
enum mstate { MINE_WAIT, MINE_HELD, MINE_DROPPED, MINE_UNPUT };

/*
 * A claim that failed here (out of memory, etcd slow) may have reached etcd all the same, and
 * be carried out after the delete that withdraws it, which a new connection can overtake (the
 * delete, finding no key of its claim, does nothing): that delete is sent again, at every
 * tick, for this long.  (A claim failed by curl with its request sent left its name in etcd,
 * under this node's lease, for good, unless the name is claimed here again.)
 */
#define UNPUT_SETTLE_S 1.0
struct mine {
	TAILQ_ENTRY(mine) entry;
	enum mstate st;
	uid_t uid;
	uint64_t claim;              /* this export's claim, in its key's value: unique here */
	cluster_done_fn done;        /* while waiting: the exporter's answer (NULL once given) */
	void *arg;
	struct etcd_call *unput;     /* MINE_UNPUT: the delete in flight, NULL: to send */
	/*
	 * MINE_DROPPED, MINE_UNPUT: a new export of the name (MINE_WAIT, its claim not sent),
	 * claimed once this record is done with etcd.  Claimed at once behind a claim (a
	 * MINE_DROPPED record), its key could be lost: that claim, coming after it, finds the key
	 * this node's under another value and takes it over (member_claim), and the delete that
	 * follows removes it.  Behind a delete (MINE_UNPUT), which holds on this record's value,
	 * it would find this record's key still there and take it over: a transaction more, and a
	 * key that changes hands under the other nodes' eyes.  Withdrawn before that, it gives way
	 * (cluster_name_drop), so that the next export of the name waits here in its place.
	 */
	struct mine *then;
	double settle;               /* MINE_UNPUT: the delete is sent again until then (0: once) */
	char name[65];
};
static TAILQ_HEAD(, mine) mines = TAILQ_HEAD_INITIALIZER(mines);
static uint64_t claims;                  /* claims made: the last one's number */
static bool stopping;                    /* cluster_stopping: exports and queries answered ESHUTDOWN */

/* The record of the name's export, waiting or held: not one of an export withdrawn. */
static struct mine *
mine_find(const char *name)
{
	struct mine *m;

	TAILQ_FOREACH(m, &mines, entry)
		if ((m->st == MINE_WAIT || m->st == MINE_HELD) && strcmp(m->name, name) == 0)
			return m;
	return NULL;
}

static char *
name_key(const char *name)
{
	char *k;

	return asprintf(&k, "%s/names/%s", mb.prefix, name) < 0 ? NULL : k;
}

/* The value of m's key: this node, the exporter's uid, and m's claim, which no other has. */
static char *
name_value(const struct mine *m)
{
	char *v;

	return asprintf(&v, "{\"node\":\"%s\",\"uid\":%u,\"claim\":%llu}", mb.self, (unsigned)m->uid,
	    (unsigned long long)m->claim) < 0 ? NULL : v;
}

static void mine_claim(struct mine *m);

/* m is done with etcd: it goes, and the new claim of its name waiting behind it is sent. */
static void
mine_free(struct mine *m)
{
	struct mine *then = m->then;

	TAILQ_REMOVE(&mines, m, entry);
	free(m);
	if (then != NULL)
		mine_claim(then);
}

/*
 * The delete of a withdrawn name's key: done (also when the key was not this record's: not
 * there, or another claim's), or sent again at a later tick.  Unless the name is claimed anew
 * meanwhile: the claim goes instead, and takes over a key this record's claim leaves.  A
 * delete given up here may still be carried out by etcd, later: it takes nothing but this
 * record's key.
 */
static void
on_unput(void *arg, int err, struct json_object *r, const char *why)
{
	struct mine *m = arg;

	(void)r;
	m->unput = NULL;
	if (err == ETCD_REFUSED)
		log_warnx("cluster: name %s: etcd refused its delete: %s", m->name, why);
	else if (err < 0 && m->then == NULL) {
		log_debug("cluster", "name %s: delete: %s; again later", m->name, why);
		return;
	}
	else if (m->then == NULL && now_s() < m->settle)
		return;                     /* (sent again at the next tick) */
	mine_free(m);
}

/* A name withdrawn: its key goes from etcd now, or at a later tick when this finds no memory. */
static void
mine_unput(struct mine *m)
{
	char *k = name_key(m->name), *v = name_value(m);

	m->st = MINE_UNPUT;
	m->done = NULL;
	if (k != NULL && v != NULL)
		m->unput = member_unput(k, v, on_unput, m);
	free(k);
	free(v);
}

void
names_tick(void)
{
	struct mine *m, *t;

	TAILQ_FOREACH_SAFE(m, &mines, entry, t)
		if (m->st == MINE_UNPUT && m->unput == NULL)
			mine_unput(m);
}

/* The holder of a name, from its value as etcd gave it back. */
static void
holder(const char *v, char *node, size_t len)
{
	struct json_object *o = json_tokener_parse(v);
	const char *n = js_str(o, "node");

	snprintf(node, len, "%s", n != NULL && export_node_name_ok(n) ? n : "(unknown)");
	json_object_put(o);
}

static void
on_claimed(void *arg, int err, struct json_object *r, const char *why)
{
	struct mine *m = arg;
	char node[CLUSTER_NODE_MAX + 1], msg[400];
	cluster_done_fn done = m->done;
	void *darg = m->arg;

	(void)r;
	m->done = NULL;
	if (err == 0 && m->st == MINE_WAIT) {
		m->st = MINE_HELD;
		done(darg, 0, NULL);
		return;
	}
	if (err == CLAIM_HELD) {
		holder(why, node, sizeof(node));
		snprintf(msg, sizeof(msg), "the name %s is held in the cluster by node %s", m->name, node);
		mine_free(m);
		if (done != NULL)
			done(darg, GPX__STATUS__EEXIST, msg);
		return;
	}
	/*
	 * Withdrawn while etcd answered (its exporter has had its answer: cluster_name_drop), or
	 * the answer lost: the key may be ours now, and goes.
	 */
	if (err < 0)
		m->settle = now_s() + UNPUT_SETTLE_S;
	mine_unput(m);
	if (done == NULL)
		return;
	if (err == ETCD_NOMEM)
		done(darg, GPX__STATUS__ENOMEM, "out of memory");
	else if (err == CLAIM_CHANGED) {
		snprintf(msg, sizeof(msg), "the name %s was not claimed in the cluster: %s", m->name, why);
		done(darg, GPX__STATUS__EIO, msg);
	} else {
		snprintf(msg, sizeof(msg), "cluster store unreachable: %s", why);
		done(darg, GPX__STATUS__EIO, msg);
	}
}

void
cluster_name_add(const char *name, uid_t uid, cluster_done_fn done, void *arg)
{
	char msg[400];
	struct mine *m, *u;
	uint32_t n = names_of_uid(uid);

	if (stopping) {
		done(arg, GPX__STATUS__ESHUTDOWN, "gpxd is stopping");
		return;
	}
	if (mb.state != M_UP) {
		snprintf(msg, sizeof(msg), "cluster store unreachable: %s", mb.why[0] ? mb.why : "joining");
		done(arg, GPX__STATUS__EIO, msg);
		return;
	}
	TAILQ_FOREACH(m, &mines, entry)
		n += m->uid == uid && m->st == MINE_WAIT;
	if (n >= cfg->max_exports_per_uid) {
		snprintf(msg, sizeof(msg), "uid %u holds %u names in the cluster, its limit ([limits] "
		    "exports_per_uid)", (unsigned)uid, n);
		done(arg, GPX__STATUS__EQUOTA, msg);
		return;
	}
	if ((m = calloc(1, sizeof(*m))) == NULL) {
		done(arg, GPX__STATUS__ENOMEM, "out of memory");
		return;
	}
	snprintf(m->name, sizeof(m->name), "%s", name);
	m->uid = uid;
	m->claim = ++claims;
	m->done = done;
	m->arg = arg;
	TAILQ_INSERT_TAIL(&mines, m, entry);
	/*
	 * An earlier export of the name with a call to etcd in flight (its claim, or the delete
	 * of its key): claimed once that is done.  (Its then is free: an export waiting there
	 * is the name's export, and a second one is refused before it comes here.)
	 */
	TAILQ_FOREACH(u, &mines, entry)
		if ((u->st == MINE_DROPPED || u->st == MINE_UNPUT) && u->then == NULL &&
		    strcmp(u->name, name) == 0)
			break;
	if (u != NULL && (u->st == MINE_DROPPED || u->unput != NULL)) {
		u->then = m;
		return;
	}
	if (u != NULL) {
		TAILQ_REMOVE(&mines, u, entry);      /* (not sent: the claim takes its key over anyway) */
		free(u);
	}
	mine_claim(m);
}

/* The claim of a name of ours, answered through on_claimed (now, when it finds no memory). */
static void
mine_claim(struct mine *m)
{
	char *k = name_key(m->name), *v = name_value(m);

	if (k == NULL || v == NULL)
		on_claimed(m, ETCD_NOMEM, NULL, "out of memory");
	else
		member_claim(k, v, on_claimed, m);
	free(k);
	free(v);
}

/*
 * The export waiting in m is done with: its exporter (if it still waits) is answered st and
 * why, last, as that answer may withdraw the export (cluster_name_drop), which then finds no
 * record of it.
 */
static void
mine_give_up(struct mine *m, int st, const char *why)
{
	cluster_done_fn done = m->done;
	void *darg = m->arg;
	struct mine *u;

	m->done = NULL;
	TAILQ_FOREACH(u, &mines, entry)
		if (u->then == m)
			break;
	if (u != NULL) {
		/* its claim not sent: it gives way, the next export of the name waits behind u */
		u->then = NULL;
		TAILQ_REMOVE(&mines, m, entry);
		free(m);
	} else
		m->st = MINE_DROPPED;     /* its claim's answer says whether the key goes */
	if (done != NULL)
		done(darg, st, why);
}

/*
 * The export of the name is gone.  One still waiting for etcd has its answer now: its export
 * was withdrawn.  (The answer never comes after the drop: the exporter's record of the wait
 * names the export, which a new export of the name may replace.)
 */
void
cluster_name_drop(const char *name)
{
	struct mine *m;

	if (!cluster_running() || (m = mine_find(name)) == NULL)
		return;
	if (m->st == MINE_HELD)
		mine_unput(m);
	else if (m->st == MINE_WAIT)
		mine_give_up(m, GPX__STATUS__EREVOKED, "the export was withdrawn");
}

/* A name claimed again under a new lease: kept, or lost to another node meanwhile. */
static void
on_reclaimed(void *arg, int err, struct json_object *r, const char *why)
{
	struct mine *m = arg;
	char node[CLUSTER_NODE_MAX + 1];

	(void)r;
	if (err == CLAIM_HELD) {
		holder(why, node, sizeof(node));
		log_warnx("cluster: name %s was taken by node %s while etcd was away: %s", m->name, node,
		    m->st == MINE_DROPPED ? "its export here, since withdrawn, leaves it to that node" :
		    "the export stays, for this node only");
		mine_free(m);
	} else if (m->st == MINE_DROPPED)
		mine_unput(m);          /* (withdrawn while etcd answered, or did not) */
	else
		m->st = MINE_HELD;       /* unreachable again: the next join claims it again */
}

void
names_reclaim(void)
{
	struct mine *m;

	TAILQ_FOREACH(m, &mines, entry) {
		if (m->st != MINE_HELD)
			continue;
		char *k = name_key(m->name), *v = name_value(m);
		if (k != NULL && v != NULL) {
			m->st = MINE_WAIT;
			member_claim(k, v, on_reclaimed, m);
		}
		free(k);
		free(v);
	}
}

void
names_fail_waiting(const char *why)
{
	(void)why;       /* their calls fail by themselves, each within its timeout */
}

/*
 * At the stop, after etcd_shutdown: every call is gone (m->unput too), none will be answered.
 * No exporter waits here: cluster_stopping answered them all, and refused the exports after.
 */
void
names_stop(void)
{
	struct mine *m;

	while ((m = TAILQ_FIRST(&mines)) != NULL) {
		TAILQ_REMOVE(&mines, m, entry);
		free(m);
	}
	names_forget_all();
	free(table);
	table = NULL;
}

/* ---- imports ---- */

static bool
answer(struct fabric_import *rq, int st, const char *fmt, const char *a, const char *b)
{
	char msg[400];

	snprintf(msg, sizeof(msg), fmt, a, b);
	rq->done(rq->arg, st, msg, NULL, false);
	return true;
}

bool
cluster_import(struct fabric_import *rq)
{
	const char *name = rq->name, *colon;
	char node[CLUSTER_NODE_MAX + 1];
	struct cname **p;
	struct cnode *n;

	if (!cluster_running() || name[0] == '@' || fabric == NULL)
		return false;
	if (mb.state != M_UP)
		return answer(rq, GPX__STATUS__EIO, "no local export %s; cluster store unreachable: %s",
		    name, mb.why[0] ? mb.why : "joining");
	if ((p = slot(name)) != NULL && *p != NULL && strcmp((*p)->node, mb.self) != 0) {
		snprintf(node, sizeof(node), "%s", (*p)->node);
		rq->export_name = name;
	} else if ((colon = strchr(name, ':')) != NULL && colon - name <= CLUSTER_NODE_MAX && colon > name) {
		snprintf(node, sizeof(node), "%.*s", (int)(colon - name), name);
		if (member_node(node) == NULL || strcmp(node, mb.self) == 0)
			return false;        /* the fabric's: a configured peer, or its error */
		rq->export_name = colon + 1;
	} else if (member_rereading())
		/* (its key may be one that found no memory: not known missing till the range ends) */
		return answer(rq, GPX__STATUS__ENOMEM, "no export %s on this node; the cluster's names are being "
		    "read again after an allocation failure: retry%s", name, "");
	else
		return answer(rq, GPX__STATUS__ENOENT, "no export %s on this node or in the cluster%s", name, "");
	if ((n = member_node(node)) == NULL)
		return answer(rq, GPX__STATUS__EIO, "%s is held by node %s, which is not in the cluster now", name,
		    node);
	if (n->addr[0] == '\0')
		return answer(rq, GPX__STATUS__EIO, "%s is held by node %s, which gives no fabric address",
		    name, node);
	rq->node = n->name;
	rq->addr = n->addr;
	return fabric->import(rq);
}

/* ---- what gpxctl and the metrics show ---- */

/* The nodes as gpxctl cluster shows them (malloc'ed), or NULL when an allocation failed. */
static char *
nodes_json(void)
{
	struct json_object *o = json_object_new_object(), *a = json_object_new_array(), *v;
	struct cnode *n;
	char *s = NULL;
	bool good = js_add(o, "self", json_object_new_string(mb.self)) &&
	    js_add(o, "etcd", json_object_new_string(etcd_endpoint())) &&
	    js_add(o, "state", json_object_new_string(mb.state == M_UP ? "up" :
	    mb.state == M_JOINING ? "joining" : "unreachable")) &&
	    js_add(o, "why", json_object_new_string(mb.why)) && js_add(o, "lease", json_object_new_int64(mb.lease)) &&
	    js_add(o, "names", json_object_new_int64((int64_t)nnames)) && js_add(o, "nodes", json_object_get(a));

	TAILQ_FOREACH(n, &cnodes, entry) {
		if (!good)
			break;
		/* (its value was JSON when it came: one that does not parse now found no memory) */
		v = n->value ? json_tokener_parse(n->value) : json_object_new_object();
		good = js_add(v, "exports", json_object_new_int64(n->names)) &&
		    js_add(v, "lease_left", json_object_new_int64(n->ttl_left)) &&
		    js_add(v, "reachable", json_object_new_boolean(strcmp(n->name, mb.self) == 0 ||
		    (fabric->node_up != NULL && fabric->node_up(n->name)))) &&
		    js_add(v, "self", json_object_new_boolean(strcmp(n->name, mb.self) == 0));
		if (!good)
			json_object_put(v);
		else
			good = js_push(a, v);
	}
	if (good)
		s = js_text(o);
	json_object_put(a);
	json_object_put(o);
	return s;
}

static void
metric(struct evbuffer *b, const char *name, const char *type, const char *help, double v)
{
	evbuffer_add_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
	if (strcmp(type, "summary") != 0)
		evbuffer_add_printf(b, "%s %.9g\n", name, v);
}

/*
 * gpxctl cluster: every node's lease asked about at once, the answer when all have come.  The
 * queries waiting are listed, with their calls, so that the stop answers them.
 */
struct nask {
	TAILQ_ENTRY(nask) entry;
	struct nquery *q;
	struct etcd_call *call;
	char node[CLUSTER_NODE_MAX + 1];
};
struct nquery {
	TAILQ_ENTRY(nquery) entry;
	void (*done)(void *arg, int status, const char *why, char *json);
	void *arg;
	TAILQ_HEAD(, nask) asks;     /* the calls in flight */
	unsigned waiting;            /* the calls, and the query's own making */
	bool failed;                 /* an allocation failed: the answer is ENOMEM */
};
static TAILQ_HEAD(, nquery) nqueries = TAILQ_HEAD_INITIALIZER(nqueries);

/* One answer less to wait for: the last gives the nodes, or ENOMEM. */
static void
nquery_put(struct nquery *q)
{
	char *json;

	if (--q->waiting > 0)
		return;
	TAILQ_REMOVE(&nqueries, q, entry);
	json = q->failed ? NULL : nodes_json();
	q->done(q->arg, json != NULL ? 0 : GPX__STATUS__ENOMEM, json != NULL ? "" : "out of memory building the reply",
	    json);
	free(q);
}

static void
on_ttl(void *arg, int err, struct json_object *r, const char *why)
{
	struct nask *a = arg;
	struct nquery *q = a->q;
	struct cnode *n = member_node(a->node);

	(void)why;
	/* (an answer lost for want of memory here says nothing of the lease) */
	if (err == ETCD_NOMEM)
		q->failed = true;
	else if (n != NULL)
		n->ttl_left = err == 0 && js_int(r, "TTL") > 0 ? js_int(r, "TTL") : -1;
	TAILQ_REMOVE(&q->asks, a, entry);
	free(a);
	nquery_put(q);
}

void
cluster_nodes_query(void (*done)(void *arg, int status, const char *why, char *json), void *arg)
{
	struct nquery *q;
	struct cnode *n;

	if (!cluster_running()) {
		done(arg, 0, "", NULL);
		return;
	}
	if (stopping) {
		done(arg, GPX__STATUS__ESHUTDOWN, "gpxd is stopping", NULL);
		return;
	}
	if ((q = calloc(1, sizeof(*q))) == NULL) {
		done(arg, GPX__STATUS__ENOMEM, "out of memory building the reply", NULL);
		return;
	}
	q->done = done;
	q->arg = arg;
	q->waiting = 1;
	TAILQ_INIT(&q->asks);
	TAILQ_INSERT_TAIL(&nqueries, q, entry);
	/* (etcd away: the times left as last known) */
	TAILQ_FOREACH(n, &cnodes, entry) {
		if (mb.state != M_UP)
			break;
		struct nask *a = calloc(1, sizeof(*a));
		struct json_object *b = json_object_new_object();
		char id[32];
		snprintf(id, sizeof(id), "%lld", (long long)n->lease);
		if (a == NULL || !js_add(b, "ID", json_object_new_string(id))) {
			json_object_put(b);
			free(a);
			q->failed = true;
			break;
		}
		a->q = q;
		snprintf(a->node, sizeof(a->node), "%s", n->name);
		if ((a->call = etcd_post("/v3/lease/timetolive", b, 2, on_ttl, a)) == NULL) {
			free(a);
			q->failed = true;
			break;
		}
		TAILQ_INSERT_TAIL(&q->asks, a, entry);
		q->waiting++;
	}
	nquery_put(q);
}

void
cluster_stopping(void)
{
	struct nquery *q;
	struct nask *a;
	struct mine *m;

	stopping = true;
	/* Exports waiting for etcd: answered now, their claims given up as at a withdrawal.  An
	 * answer may withdraw its export and change the list: walked again from its head. */
	for (;;) {
		TAILQ_FOREACH(m, &mines, entry)
			if (m->st == MINE_WAIT && m->done != NULL)
				break;
		if (m == NULL)
			break;
		mine_give_up(m, GPX__STATUS__ESHUTDOWN, "gpxd is stopping");
	}
	while ((q = TAILQ_FIRST(&nqueries)) != NULL) {
		TAILQ_REMOVE(&nqueries, q, entry);
		while ((a = TAILQ_FIRST(&q->asks)) != NULL) {
			TAILQ_REMOVE(&q->asks, a, entry);
			etcd_cancel(a->call);
			free(a);
		}
		q->done(q->arg, GPX__STATUS__ESHUTDOWN, "gpxd is stopping", NULL);
		free(q);
	}
}

void
cluster_metrics(struct evbuffer *b)
{
	struct cnode *n;
	uint32_t k = 0;

	if (!cluster_running())
		return;
	TAILQ_FOREACH(n, &cnodes, entry)
		k++;
	metric(b, "gpx_cluster_up", "gauge", "Whether this node is joined to the cluster's etcd now.",
	    mb.state == M_UP);
	metric(b, "gpx_cluster_etcd_requests_total", "counter", "Calls made to etcd.", (double)etcd_stats.calls);
	metric(b, "gpx_cluster_etcd_unreachable_total", "counter", "Calls that did not reach etcd.",
	    (double)etcd_stats.failures);
	metric(b, "gpx_cluster_etcd_rtt_seconds", "summary", "Round trip of the calls etcd answered.", 0);
	evbuffer_add_printf(b, "gpx_cluster_etcd_rtt_seconds_sum %.9f\ngpx_cluster_etcd_rtt_seconds_count %llu\n",
	    etcd_stats.rtt_sum, (unsigned long long)etcd_stats.rtt_n);
	metric(b, "gpx_cluster_lease_renewals_total", "counter", "Keep-alives of this node's lease that etcd answered.",
	    (double)mb.renewals);
	metric(b, "gpx_cluster_watch_events_total", "counter", "Changes under the prefix that the watch reported.",
	    (double)mb.watch_events);
	metric(b, "gpx_cluster_nodes", "gauge", "Nodes in the cluster now.", k);
	metric(b, "gpx_cluster_nodes_seen_total", "counter", "Nodes that joined, as this node saw them.",
	    (double)mb.nodes_seen);
	metric(b, "gpx_cluster_names", "gauge", "Cluster names known, every node's.", (double)nnames);
}
