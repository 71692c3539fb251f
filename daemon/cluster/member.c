/*
 * This node's session with etcd, and what it knows of the others.
 *
 * Joining: a lease of [cluster] lease_ttl seconds, this node's key under it (created only
 * where no one holds it: a transaction on create_revision 0, so two daemons cannot be one
 * node), our names again under the lease, then a range of the whole prefix and a watch from
 * the revision after it.  Kept: a keep-alive every third of the lease.  Lost: a call that
 * cannot reach etcd, a watch that ends, or a lease etcd no longer knows take the session down;
 * local service is untouched, cluster calls fail at once with why, and the tick joins again
 * with a backoff of 0.5 s doubling to 5 s.  A lease still alive is kept (etcd restarted
 * quickly: our keys are still there); one that expired is replaced and every key put again.
 *
 * Death of others: their lease expires, etcd deletes their keys, the watch tells; the
 * fabric then drops its connection to that node, which fails every import and transfer
 * through it (even a node stopped with SIGSTOP, whose TCP connections stay open).
 */
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <event2/event.h>

#include "daemon/cluster/internal.h"
#include "daemon/fabric/fabric.h"

struct member mb;
struct cnode_list cnodes = TAILQ_HEAD_INITIALIZER(cnodes);

static struct event_base *base;
static struct event *tick_ev;
static struct etcd_call *step_call, *ka_call, *watch_call;
static char *node_value;                 /* our node key's JSON */
static double backoff = 0.5, t_retry, t_keepalive;
static bool starting;                    /* cluster_start waits for the first answer */
static int start_result;
static double start_deadline;
static bool running;
static bool lost;                        /* member_lost: a range of every key is due */

#define BACKOFF_MAX 5.0

static void join(void);
static void go_down(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Keys written by others are logged, but at most ten lines every ten seconds. */
static void
hostile(const char *fmt, ...)
{
	static double window;
	static unsigned lines;
	char buf[300];
	va_list ap;

	if (now_s() - window > 10) {
		window = now_s();
		lines = 0;
	}
	if (lines++ >= 10)
		return;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	log_warnx("cluster: ignored: %s", buf);
}

static char *
key_of(const char *kind, const char *name)
{
	char *k;

	if (asprintf(&k, "%s/%s/%s", mb.prefix, kind, name) < 0)
		return NULL;
	return k;
}

/* "P/" and "P0": the range of every key under the prefix. */
static void
prefix_range(char **k0, char **k1)
{
	if (asprintf(k0, "%s/", mb.prefix) < 0)
		*k0 = NULL;
	if (asprintf(k1, "%s0", mb.prefix) < 0)
		*k1 = NULL;
}

/*
 * A key as etcd's JSON has it (base64), or NULL when an allocation failed, here or in the
 * making of key (NULL too: key_of's answer goes straight to the requests built on it).
 */
static struct json_object *
jkey(const char *key)
{
	char *b = key != NULL ? b64_enc(key, strlen(key)) : NULL;
	struct json_object *o = b != NULL ? json_object_new_string(b) : NULL;

	free(b);
	return o;
}

/* ---- the nodes known ---- */

struct cnode *
member_node(const char *name)
{
	struct cnode *n;

	TAILQ_FOREACH(n, &cnodes, entry)
		if (strcmp(n->name, name) == 0)
			return n;
	return NULL;
}

static void
node_del(struct cnode *n, const char *why)
{
	TAILQ_REMOVE(&cnodes, n, entry);
	log_info("cluster: node %s left: %s", n->name, why);
	if (fabric != NULL && fabric->node_gone != NULL)
		fabric->node_gone(n->name, why);
	free(n->value);
	free(n);
}

/* Addresses as the fabric dials them: what getaddrinfo takes, printable. */
static bool
addr_ok(const char *a)
{
	return a[0] != '\0' && strlen(a) < 96 &&
	    strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%") == strlen(a);
}

static void
node_put(const char *name, const char *v, size_t len, int64_t lease)
{
	struct json_object *o, *l, *a;
	struct cnode *n;

	if (len > CLUSTER_VALUE_MAX) {
		hostile("node %s: a value of %zu bytes", name, len);
		return;
	}
	bool nomem;
	if ((o = js_parse(v, &nomem)) == NULL || !json_object_is_type(o, json_type_object)) {
		if (nomem)
			member_lost();
		else
			hostile("node %s: its value is not a JSON object", name);
		json_object_put(o);
		return;
	}
	const char *nm = js_str(o, "name");
	if (nm == NULL || strcmp(nm, name) != 0) {
		hostile("node %s: its value names %s", name, nm ? nm : "no node");
		json_object_put(o);
		return;
	}
	const char *addr = "";
	if (json_object_object_get_ex(o, "listen", &l) && json_object_is_type(l, json_type_array) &&
	    json_object_array_length(l) > 0 && (a = json_object_array_get_idx(l, 0)) != NULL &&
	    json_object_is_type(a, json_type_string))
		addr = json_object_get_string(a);
	if (addr[0] != '\0' && !addr_ok(addr)) {
		hostile("node %s: listen address is not HOST:PORT", name);
		json_object_put(o);
		return;
	}
	if ((n = member_node(name)) == NULL) {
		if ((n = calloc(1, sizeof(*n))) == NULL) {
			json_object_put(o);
			member_lost();
			return;
		}
		snprintf(n->name, sizeof(n->name), "%s", name);
		TAILQ_INSERT_TAIL(&cnodes, n, entry);
		mb.nodes_seen++;
		if (strcmp(name, mb.self) != 0)
			log_info("cluster: node %s joined%s%s", name, addr[0] ? " at " : "", addr);
	} else if (strcmp(n->addr, addr) != 0 && fabric != NULL && fabric->node_gone != NULL &&
	    strcmp(name, mb.self) != 0)
		fabric->node_gone(name, "its address in the cluster changed");
	snprintf(n->addr, sizeof(n->addr), "%s", addr);
	n->lease = lease;
	n->stale = false;
	free(n->value);
	if ((n->value = strdup(v)) == NULL)
		member_lost();
	json_object_put(o);
}

/*
 * Our key is gone from etcd: our lease ended (we were stopped or cut off longer than it) or
 * someone deleted it.  Join again, with a new lease if it is gone.
 */
static void
self_deleted(void)
{
	struct cnode *n = member_node(mb.self);

	if (n != NULL) {
		TAILQ_REMOVE(&cnodes, n, entry);
		free(n->value);
		free(n);
	}
	go_down(0, "this node's key was deleted");
}

/* A key of the prefix, put (v) or deleted (v NULL), from the range or the watch. */
static void
key_seen(const char *key, const char *v, size_t len, int64_t lease)
{
	size_t pl = strlen(mb.prefix);
	const char *rest;

	if (strncmp(key, mb.prefix, pl) != 0 || key[pl] != '/')
		return;
	rest = key + pl + 1;
	if (strncmp(rest, "names/", 6) == 0) {
		names_seen(rest + 6, v, len);
		return;
	}
	if (strncmp(rest, "nodes/", 6) != 0) {
		hostile("key %s: neither nodes/ nor names/", key);
		return;
	}
	rest += 6;
	if (!export_node_name_ok(rest) || strlen(rest) > CLUSTER_NODE_MAX) {
		hostile("key %s: not a node name", key);
		return;
	}
	if (v != NULL) {
		node_put(rest, v, len, lease);
		return;
	}
	struct cnode *n = member_node(rest);
	if (strcmp(rest, mb.self) == 0) {
		if (mb.state == M_UP)
			self_deleted();
		return;
	}
	if (n != NULL)
		node_del(n, "its lease ended or its key was deleted");
}

/* A kv of etcd's JSON: {"key","value","lease"} in base64. */
static void
kv_seen(struct json_object *kv, bool deleted)
{
	const char *k64 = js_str(kv, "key"), *v64 = js_str(kv, "value");
	size_t kl, vl = 0;
	char *k, *v = NULL;

	if (k64 == NULL || (k = b64_dec(k64, &kl)) == NULL) {
		if (k64 != NULL && errno == ENOMEM)
			member_lost();
		return;
	}
	if (strlen(k) != kl) {
		free(k);
		return;
	}
	if (!deleted) {
		if ((v = b64_dec(v64 ? v64 : "", &vl)) == NULL && errno == ENOMEM)
			member_lost();
		else if (v == NULL || strlen(v) != vl)
			hostile("key %s: a value that is not text", k);
		if (v == NULL || strlen(v) != vl) {
			free(v);
			free(k);
			return;
		}
	}
	key_seen(k, v, vl, js_int(kv, "lease"));
	free(v);
	free(k);
}

/* ---- the session ---- */

/* The session is lost (err: the ETCD_* of the call that lost it, or 0): retry later. */
static void
go_down(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(mb.why, sizeof(mb.why), fmt, ap);
	va_end(ap);
	if (mb.state == M_UP)
		log_warnx("cluster: %s; local service goes on, cluster calls fail until etcd answers again",
		    mb.why);
	else if (mb.state == M_JOINING && !starting)
		log_debug("cluster", "cannot join: %s", mb.why);
	mb.state = M_DOWN;
	etcd_cancel(step_call);
	etcd_cancel(watch_call);
	etcd_cancel(ka_call);
	step_call = watch_call = ka_call = NULL;
	names_fail_waiting(mb.why);
	t_retry = now_s() + backoff;
	backoff = backoff * 2 > BACKOFF_MAX ? BACKOFF_MAX : backoff * 2;
	if (starting && (err == ETCD_UNREACHABLE || err == ETCD_TIMEDOUT))
		log_warnx("cluster: etcd at %s not reached: %s; serving local clients, joining when it answers",
		    etcd_endpoint(), mb.why);
	else if (starting)
		log_warnx("cluster: cannot join through etcd at %s: %s; serving local clients, trying again",
		    etcd_endpoint(), mb.why);
	starting = false;
}

static void
on_watch_msg(void *arg, struct json_object *m)
{
	struct json_object *r, *evs, *ev, *kv;

	(void)arg;
	if (!json_object_object_get_ex(m, "result", &r)) {
		const char *e = js_str(m, "error");
		go_down(0, "the watch failed: %s", e ? e : "an answer without a result");
		return;
	}
	struct json_object *t;
	if ((json_object_object_get_ex(r, "canceled", &t) && json_object_get_boolean(t))) {
		const char *cr = js_str(r, "cancel_reason");
		go_down(0, "etcd cancelled the watch%s%s", cr ? ": " : "", cr ? cr : "");
		return;
	}
	if (!json_object_object_get_ex(r, "events", &evs) || !json_object_is_type(evs, json_type_array))
		return;
	for (size_t i = 0; i < json_object_array_length(evs); i++) {
		ev = json_object_array_get_idx(evs, i);
		const char *type = js_str(ev, "type");
		if (!json_object_object_get_ex(ev, "kv", &kv))
			continue;
		mb.watch_events++;
		kv_seen(kv, type != NULL && strcmp(type, "DELETE") == 0);
		if (mb.state != M_UP)
			return;      /* go_down freed the stream */
	}
}

static void sync_all(void);

static void
on_watch_end(void *arg, int err, struct json_object *r, const char *why)
{
	(void)arg;
	(void)r;
	watch_call = NULL;
	/* Ended for want of memory here, etcd still there: everything read again, then watched
	 * from there, the session kept. */
	if (err == ETCD_NOMEM && mb.state == M_UP) {
		log_warnx("cluster: the watch ended: %s; reading every key again", why);
		lost = true;
		return;
	}
	go_down(err, "the watch ended: %s", why);
}

static void
on_range(void *arg, int err, struct json_object *r, const char *why)
{
	struct json_object *kvs, *hdr, *body;
	struct cnode *n, *nt;

	(void)arg;
	step_call = NULL;
	if (err == ETCD_NOMEM && mb.state == M_UP) {
		lost = true;             /* (read again at the next tick) */
		return;
	}
	if (err < 0) {
		go_down(err, "%s", why);
		return;
	}
	/* Forgotten only now, every key in hand: till here an import finds what it knew. */
	TAILQ_FOREACH(n, &cnodes, entry)
		n->stale = true;
	names_forget_all();
	lost = false;                /* this range is every key: set again by one it loses */
	if (json_object_object_get_ex(r, "kvs", &kvs) && json_object_is_type(kvs, json_type_array))
		for (size_t i = 0; i < json_object_array_length(kvs); i++)
			kv_seen(json_object_array_get_idx(kvs, i), false);
	/* Our key not among every key: deleted while the watch lost that event, or before this
	 * range of a join; as the watch's delete of it. */
	if (!lost && ((n = member_node(mb.self)) == NULL || n->stale)) {
		self_deleted();
		return;
	}
	/* A node whose key found no memory here is not gone: the next range tells (its
	 * connections, and the transfers through them, stand meanwhile). */
	TAILQ_FOREACH_SAFE(n, &cnodes, entry, nt)
		if (n->stale && !lost)
			node_del(n, "gone while etcd was away");
	int64_t rev = json_object_object_get_ex(r, "header", &hdr) ? js_int(hdr, "revision") : 0;
	char *k0, *k1;
	prefix_range(&k0, &k1);
	struct json_object *cr = json_object_new_object();
	body = json_object_new_object();
	if (k0 == NULL || k1 == NULL || !js_add(cr, "key", jkey(k0)) || !js_add(cr, "range_end", jkey(k1)) ||
	    !js_add(cr, "start_revision", json_object_new_int64(rev + 1)) ||
	    !js_add(body, "create_request", json_object_get(cr))) {
		json_object_put(body);
		body = NULL;
	}
	json_object_put(cr);
	free(k0);
	free(k1);
	if (body == NULL || (watch_call = etcd_stream("/v3/watch", body, on_watch_msg, on_watch_end, NULL)) == NULL) {
		if (mb.state == M_UP)
			lost = true;     /* read again (the session kept) at the next tick */
		else
			go_down(0, "cannot start the watch: out of memory");
		return;
	}
	bool again = mb.state == M_UP;      /* read again (member_lost), the session kept */
	mb.state = M_UP;
	mb.why[0] = '\0';
	backoff = 0.5;
	t_keepalive = now_s() + mb.ttl / 3.0;
	if (again)
		log_info("cluster: every key read again");
	else if (mb.rejoins++ > 0)
		log_info("cluster: joined again as node %s (lease %lld)", mb.self, (long long)mb.lease);
	else
		log_info("cluster: node %s joined through %s (lease %lld, %u s)", mb.self, etcd_endpoint(),
		    (long long)mb.lease, mb.ttl);
	starting = false;
}

static void
sync_all(void)
{
	char *k0, *k1;
	struct json_object *b = json_object_new_object();

	prefix_range(&k0, &k1);
	if (k0 == NULL || k1 == NULL || !js_add(b, "key", jkey(k0)) || !js_add(b, "range_end", jkey(k1))) {
		json_object_put(b);
		b = NULL;
	}
	free(k0);
	free(k1);
	if (b != NULL && (step_call = etcd_post("/v3/kv/range", b, 10, on_range, NULL)) != NULL)
		return;
	if (mb.state == M_UP)
		lost = true;             /* a read again: tried at the next tick */
	else
		go_down(0, "out of memory");
}

/*
 * A claim in flight: listed, so that one etcd_shutdown leaves unanswered is freed at the stop.
 * Its key and value are kept for the transactions after the first.
 */
struct claim {
	TAILQ_ENTRY(claim) entry;
	char *key, *value;
	unsigned tries;              /* transactions sent */
	etcd_fn done;
	void *arg;
};
static TAILQ_HEAD(, claim) claims = TAILQ_HEAD_INITIALIZER(claims);

/*
 * Transactions of one claim at most: each after the first follows a change of the key that
 * came between (an earlier claim's delete, or its late put, carried out meanwhile).
 */
#define CLAIM_TRIES 4

static void
claim_free(struct claim *cl)
{
	free(cl->key);
	free(cl->value);
	free(cl);
}

/* The claim is answered: err 0, or CLAIM_HELD with the holder's value in why, or another error. */
static void
claim_end(struct claim *cl, int err, struct json_object *r, const char *why)
{
	etcd_fn done = cl->done;
	void *darg = cl->arg;

	TAILQ_REMOVE(&claims, cl, entry);
	claim_free(cl);
	done(darg, err, r, why);
}

/* {"NAME": {"key": KEY}}: one request of a transaction's list, or NULL (no memory). */
static struct json_object *
txn_op(const char *name, const char *key)
{
	struct json_object *o = json_object_new_object(), *rq = json_object_new_object();

	if (!js_add(rq, "key", jkey(key)) || !js_add(o, name, rq)) {
		json_object_put(o);
		return NULL;
	}
	return o;
}

/*
 * list with {"key": KEY, "target": TARGET, FIELD: VALUE} added: a transaction's compares, all
 * of which must hold; NULL when list or value is, or an allocation failed (list is freed).
 */
static struct json_object *
compare(struct json_object *list, const char *key, const char *target, const char *field, const char *value)
{
	struct json_object *c = json_object_new_object();
	bool good = list != NULL && value != NULL && js_add(c, "key", jkey(key)) &&
	    js_add(c, "target", json_object_new_string(target)) && js_add(c, field, json_object_new_string(value));

	if (good && js_push(list, c))
		return list;
	if (!good)
		json_object_put(c);
	json_object_put(list);
	return NULL;
}

/* {"compare": COMPARES, "success": [OP], "failure": [OP]}, all three taken over (failure may
 * be NULL); NULL when compares or success is, or an allocation failed. */
static struct json_object *
txn(struct json_object *compares, struct json_object *success, struct json_object *failure)
{
	struct json_object *b = json_object_new_object(), *sa = json_object_new_array();
	struct json_object *fa = failure != NULL ? json_object_new_array() : NULL;
	bool good = compares != NULL && js_add(b, "compare", json_object_get(compares)) &&
	    js_push(sa, json_object_get(success)) && js_add(b, "success", json_object_get(sa)) &&
	    (failure == NULL || (js_push(fa, json_object_get(failure)) && js_add(b, "failure", json_object_get(fa))));

	json_object_put(sa);
	json_object_put(fa);
	json_object_put(compares);
	json_object_put(success);
	json_object_put(failure);
	if (!good) {
		json_object_put(b);
		return NULL;
	}
	return b;
}

static void on_claim(void *, int, struct json_object *, const char *);

/*
 * The claim's transaction: its key put under our lease where no one holds it (rev 0), or where
 * it is still as it was at revision rev (a key of ours, of another value: taken over); else
 * the key as it is.  false when it found no memory.
 */
static bool
claim_send(struct claim *cl, int64_t rev)
{
	struct json_object *put = txn_op("request_put", cl->key), *p = NULL, *b;
	char *v = b64_enc(cl->value, strlen(cl->value)), r[32];

	snprintf(r, sizeof(r), "%lld", (long long)rev);
	if (put != NULL && json_object_object_get_ex(put, "request_put", &p) &&
	    (v == NULL || !js_add(p, "value", json_object_new_string(v)) ||
	    !js_add(p, "lease", json_object_new_int64(mb.lease))))
		p = NULL;
	b = txn(compare(json_object_new_array(), cl->key, rev ? "MOD" : "CREATE",
	    rev ? "mod_revision" : "create_revision", r), p != NULL ? put : NULL, txn_op("request_range", cl->key));
	if (p == NULL)
		json_object_put(put);
	free(v);
	cl->tries++;
	return b != NULL && etcd_post("/v3/kv/txn", b, 5, on_claim, cl) != NULL;
}

/*
 * A claim's transaction answered.  The key held: by this claim already (claimed again under the
 * same lease), by another node, or by this node under another value, left by an earlier claim
 * of the key that is done with here, whose delete etcd may still carry out (a delete given up
 * here, or refused) or whose put came late: taken over, so that no delete of that claim, which
 * holds on its value, can take the key from this one.  Gone since the last try: claimed again.
 */
static void
on_claim(void *arg, int err, struct json_object *r, const char *why)
{
	struct claim *cl = arg;
	struct json_object *t, *rs, *rr, *kvs, *kv = NULL;
	const char *v64;
	char *v = NULL, msg[400];
	size_t vl;

	if (err < 0) {
		claim_end(cl, err, NULL, why);
		return;
	}
	if (json_object_object_get_ex(r, "succeeded", &t) && json_object_get_boolean(t)) {
		claim_end(cl, 0, r, "");
		return;
	}
	if (json_object_object_get_ex(r, "responses", &rs) && json_object_array_length(rs) > 0 &&
	    json_object_object_get_ex(json_object_array_get_idx(rs, 0), "response_range", &rr) &&
	    json_object_object_get_ex(rr, "kvs", &kvs) && json_object_array_length(kvs) > 0)
		kv = json_object_array_get_idx(kvs, 0);
	if ((v64 = js_str(kv, "value")) != NULL && (v = b64_dec(v64, &vl)) == NULL && errno == ENOMEM) {
		claim_end(cl, ETCD_NOMEM, NULL, "out of memory");
		return;
	}
	bool ours = kv != NULL && mb.lease != 0 && js_int(kv, "lease") == mb.lease;
	if (ours && v != NULL && strcmp(v, cl->value) == 0)
		claim_end(cl, 0, r, "");
	else if (kv != NULL && !ours)
		claim_end(cl, CLAIM_HELD, NULL, v != NULL ? v : "");
	else if (cl->tries >= CLAIM_TRIES) {
		snprintf(msg, sizeof(msg), "its key %s changed under each of %u tries", cl->key, cl->tries);
		claim_end(cl, CLAIM_CHANGED, NULL, msg);
	} else {
		if (kv != NULL)
			log_debug("cluster", "%s: this node's, of an earlier claim: taken over", cl->key);
		if (!claim_send(cl, kv != NULL ? js_int(kv, "mod_revision") : 0))
			claim_end(cl, ETCD_NOMEM, NULL, "out of memory");
	}
	free(v);
}

void
member_claim(const char *key, const char *value, etcd_fn done, void *arg)
{
	struct claim *cl = calloc(1, sizeof(*cl));

	if (cl == NULL || (cl->key = strdup(key)) == NULL || (cl->value = strdup(value)) == NULL) {
		if (cl != NULL)
			claim_free(cl);
		done(arg, ETCD_NOMEM, NULL, "out of memory");
		return;
	}
	cl->done = done;
	cl->arg = arg;
	TAILQ_INSERT_TAIL(&claims, cl, entry);     /* (its answer comes in a later turn) */
	if (!claim_send(cl, 0))
		claim_end(cl, ETCD_NOMEM, NULL, "out of memory");
}

struct etcd_call *
member_unput(const char *key, const char *value, etcd_fn done, void *arg)
{
	char id[32], *v = b64_enc(value, strlen(value));
	struct json_object *b;

	/*
	 * only while it is ours and still this claim's: a key claimed again meanwhile, by another
	 * node or by a later claim of this node (which may come before etcd carries this out), stays
	 */
	snprintf(id, sizeof(id), "%lld", (long long)mb.lease);
	b = txn(compare(compare(json_object_new_array(), key, "LEASE", "lease", id), key, "VALUE", "value", v),
	    txn_op("request_delete_range", key), NULL);
	free(v);
	return b != NULL ? etcd_post("/v3/kv/txn", b, 5, done, arg) : NULL;
}

static void
on_node_claim(void *arg, int err, struct json_object *r, const char *why)
{
	struct json_object *o;
	const char *addr = NULL;

	(void)arg;
	(void)r;
	step_call = NULL;
	if (err < 0 && err != CLAIM_HELD) {
		go_down(err, "%s", why);
		return;
	}
	if (err < 0) {
		o = json_tokener_parse(why);
		if (o != NULL) {
			struct json_object *l;
			if (json_object_object_get_ex(o, "listen", &l) && json_object_array_length(l) > 0)
				addr = json_object_get_string(json_object_array_get_idx(l, 0));
		}
		snprintf(mb.why, sizeof(mb.why), "node name %s is held by a live node%s%s (another gpxd "
		    "with [fabric] node = %s); two daemons cannot be one node", mb.self, addr ? " at " : "",
		    addr ? addr : "", mb.self);
		json_object_put(o);
		if (starting && now_s() < start_deadline) {
			/* Maybe our own earlier life, killed before its lease ended: wait it out. */
			mb.state = M_DOWN;
			t_retry = now_s() + 0.5;
			return;
		}
		if (starting) {
			start_result = -1;
			starting = false;
			log_warnx("cluster: %s", mb.why);
			return;
		}
		log_warnx("cluster: %s", mb.why);
		mb.state = M_DOWN;
		t_retry = now_s() + BACKOFF_MAX;
		return;
	}
	names_reclaim();
	sync_all();
}

static void
on_grant(void *arg, int err, struct json_object *r, const char *why)
{
	(void)arg;
	step_call = NULL;
	if (err < 0 || js_int(r, "ID") == 0) {
		go_down(err < 0 ? err : ETCD_REFUSED, "lease grant: %s", err < 0 ? why : "no lease in the answer");
		return;
	}
	mb.lease = js_int(r, "ID");
	mb.t_renewed = now_s();
	char *k = key_of("nodes", mb.self);
	member_claim(k, node_value, on_node_claim, NULL);
	free(k);
}

static void
grant(void)
{
	struct json_object *b = json_object_new_object();

	if (!js_add(b, "TTL", json_object_new_int64(mb.ttl))) {
		json_object_put(b);
		b = NULL;
	}
	if (b == NULL || (step_call = etcd_post("/v3/lease/grant", b, 5, on_grant, NULL)) == NULL)
		go_down(0, "out of memory");
}

/* A keep-alive's answer: {"result":{"ID","TTL"}}; TTL absent or 0: the lease is gone. */
static int64_t
ka_ttl(struct json_object *r)
{
	struct json_object *res;

	if (r == NULL || !json_object_object_get_ex(r, "result", &res))
		return 0;
	return js_int(res, "TTL");
}

static void
on_probe(void *arg, int err, struct json_object *r, const char *why)
{
	(void)arg;
	step_call = NULL;
	if (err == ETCD_UNREACHABLE || err == ETCD_TIMEDOUT) {
		go_down(err, "%s", why);
		return;
	}
	if (err == 0 && ka_ttl(r) > 0) {
		/* Still ours: the keys are there; put them again all the same, cheaply idempotent. */
		mb.t_renewed = now_s();
		char *k = key_of("nodes", mb.self);
		member_claim(k, node_value, on_node_claim, NULL);
		free(k);
		return;
	}
	log_info("cluster: lease %lld ended while etcd was away: a new one, and every key again",
	    (long long)mb.lease);
	mb.lease = 0;
	grant();
}

static void
keepalive_call(int64_t lease, etcd_fn fn, struct etcd_call **slot)
{
	struct json_object *b = json_object_new_object();
	char id[32];

	snprintf(id, sizeof(id), "%lld", (long long)lease);
	*slot = NULL;
	if (js_add(b, "ID", json_object_new_string(id)))
		*slot = etcd_post("/v3/lease/keepalive", b, mb.ttl / 2.0 > 1 ? mb.ttl / 2.0 : 1, fn, NULL);
	else
		json_object_put(b);
}

/* Whether our lease is still etcd's (a join after etcd was away). */
static void
probe(void)
{
	keepalive_call(mb.lease, on_probe, &step_call);
	if (step_call == NULL)
		go_down(0, "out of memory");
}

static void
on_auth(void *arg, int err, struct json_object *r, const char *why)
{
	(void)arg;
	(void)r;
	step_call = NULL;
	if (err < 0) {
		go_down(err, "%s", why);
		return;
	}
	if (mb.lease != 0)
		probe();
	else
		grant();
}

static void
join(void)
{
	mb.state = M_JOINING;
	if (etcd_auth_user() != NULL) {
		if ((step_call = etcd_authenticate(on_auth, NULL)) == NULL)
			go_down(ETCD_UNREACHABLE, "out of memory");
	} else if (mb.lease != 0)
		probe();
	else
		grant();
}

static void
on_keepalive(void *arg, int err, struct json_object *r, const char *why)
{
	(void)arg;
	ka_call = NULL;
	/* A slow answer (etcd busy) while the lease still has time: ask again at once rather than
	 * drop the session; only a lease surely ended, or etcd not reached at all, takes it down. */
	if ((err == ETCD_TIMEDOUT || err == ETCD_NOMEM) && now_s() - mb.t_renewed < mb.ttl) {
		log_debug("cluster", "lease keep-alive: %s; asking again", why);
		t_keepalive = now_s();
		return;
	}
	if (err == ETCD_UNREACHABLE || err == ETCD_TIMEDOUT) {
		go_down(err, "lease keep-alive: %s", why);
		return;
	}
	if (err < 0 || ka_ttl(r) <= 0) {
		log_warnx("cluster: lease %lld is gone (%s): joining again with a new one", (long long)mb.lease,
		    err < 0 ? why : "etcd no longer knows it");
		mb.lease = 0;
		go_down(0, "the lease ended");
		t_retry = now_s();
		return;
	}
	mb.renewals++;
	mb.t_renewed = now_s();
}

static void
on_tick(evutil_socket_t fd, short what, void *arg)
{
	double now = now_s();

	(void)fd;
	(void)what;
	(void)arg;
	if (!running)
		return;
	if (mb.state == M_DOWN && now >= t_retry)
		join();
	else if (mb.state == M_UP && ka_call == NULL && now >= t_keepalive) {
		t_keepalive = now + mb.ttl / 3.0;
		keepalive_call(mb.lease, on_keepalive, &ka_call);
		if (ka_call == NULL)
			t_keepalive = now;       /* no memory for it: the next tick asks again */
	}
	if (mb.state == M_UP && lost && step_call == NULL) {
		/* (a new watch from the range's revision: the old one's later events come again) */
		lost = false;
		log_warnx("cluster: a key from etcd found no memory: reading every key again");
		etcd_cancel(watch_call);
		watch_call = NULL;
		sync_all();
	}
	if (mb.state == M_UP)
		names_tick();
}

void
member_lost(void)
{
	lost = true;
}

bool
member_rereading(void)
{
	/* (up, step_call is only that range: the steps of a join are done) */
	return mb.state == M_UP && (lost || step_call != NULL);
}

/* ---- start and stop ---- */

/*
 * This node's key: name, fabric address, transports, GPUs, protocol, version, start.  NULL
 * when an allocation failed: a record missing a field (its listen address, say) would send
 * the other nodes' dials nowhere, so none is made rather than one cut short.
 */
static char *
node_json(void)
{
	struct json_object *o = json_object_new_object(), *ls = json_object_new_array();
	struct json_object *tr = json_object_new_array();
	const char *st = fabric != NULL ? fabric->status() : "";
	char host[128] = "", addr[160] = "", *s = NULL;

	if (cfg->fabric_listen != NULL) {
		snprintf(addr, sizeof(addr), "%s", cfg->fabric_listen);
		/* A wildcard is no address to dial: the host's name stands for it. */
		if (strncmp(addr, "0.0.0.0:", 8) == 0 || strncmp(addr, "[::]:", 5) == 0 || addr[0] == ':') {
			gethostname(host, sizeof(host) - 1);
			snprintf(addr, sizeof(addr), "%s:%s", host, strrchr(cfg->fabric_listen, ':') + 1);
		}
	}
	bool good = ls != NULL && tr != NULL &&
	    (addr[0] == '\0' || js_push(ls, json_object_new_string(addr))) &&
	    js_push(tr, json_object_new_string("tcp")) &&
	    (strstr(st, "transport rdma") == NULL || js_push(tr, json_object_new_string("rdma"))) &&
	    js_add(o, "name", json_object_new_string(mb.self)) && js_add(o, "listen", json_object_get(ls)) &&
	    js_add(o, "transports", json_object_get(tr)) && js_add(o, "fabric", json_object_new_string(st)) &&
	    js_add(o, "gpus", json_object_new_int(gpu_count())) && js_add(o, "proto", json_object_new_int(1)) &&
	    js_add(o, "version", json_object_new_string(GPXD_VERSION)) &&
	    js_add(o, "start", json_object_new_int64((int64_t)gpxd_start_time)) &&
	    js_add(o, "pid", json_object_new_int(getpid()));

	if (good)
		s = js_text(o);
	json_object_put(ls);
	json_object_put(tr);
	json_object_put(o);
	return s;
}

int
cluster_start(struct event_base *b)
{
	const struct cluster_conf *cc = &cfg->cluster;
	struct timeval tv = { 0, 100000 };
	char why[256];

	base = b;
	if (fabric == NULL) {
		log_warnx("cluster: [cluster] needs the fabric: [fabric] key_file and listen");
		return -1;
	}
	if (cfg->fabric_node != NULL)
		snprintf(mb.self, sizeof(mb.self), "%s", cfg->fabric_node);
	else {
		gethostname(mb.self, sizeof(mb.self) - 1);
		mb.self[strcspn(mb.self, ".")] = '\0';
	}
	snprintf(mb.prefix, sizeof(mb.prefix), "%s", cc->prefix ? cc->prefix : "/gpx");
	mb.ttl = cc->lease_ttl ? cc->lease_ttl : 10;
	if (etcd_init(b, cc, why, sizeof(why)) < 0) {
		log_warnx("cluster: %s", why);
		return -1;
	}
	/* Out of memory here, gpxd does not start: a node that left the cluster out would serve
	 * its local clients while every other node looked for it in vain. */
	if ((node_value = node_json()) == NULL)
		log_warnx("cluster: out of memory building this node's record");
	else if ((tick_ev = event_new(b, -1, EV_PERSIST, on_tick, NULL)) == NULL)
		log_warnx("cluster: out of memory starting its timer");
	if (node_value == NULL || tick_ev == NULL) {
		free(node_value);
		node_value = NULL;
		etcd_shutdown();
		return -1;
	}
	event_add(tick_ev, &tv);
	running = true;
	/* The first answer decides whether this daemon may be this node: wait for it. */
	starting = true;
	start_deadline = now_s() + mb.ttl + 1;
	join();
	while (starting)
		event_base_loop(b, EVLOOP_ONCE);
	if (start_result < 0)
		cluster_stop();
	return start_result;
}

bool
cluster_running(void)
{
	return running;
}

static void
on_revoked(void *arg, int err, struct json_object *r, const char *why)
{
	(void)r;
	(void)err;
	(void)why;
	*(bool *)arg = true;
}

void
cluster_stop(void)
{
	struct cnode *n;
	struct claim *cl;
	bool done = false;

	if (!running)
		return;
	running = false;
	etcd_cancel(step_call);
	etcd_cancel(watch_call);
	etcd_cancel(ka_call);
	step_call = watch_call = ka_call = NULL;
	/* Our keys go now rather than at the lease's end: the others see us leave at once. */
	if (mb.lease != 0 && mb.state == M_UP) {
		struct json_object *b = json_object_new_object();
		char id[32];
		snprintf(id, sizeof(id), "%lld", (long long)mb.lease);
		if (!js_add(b, "ID", json_object_new_string(id))) {
			json_object_put(b);
			b = NULL;
		}
		if (b != NULL && etcd_post("/v3/lease/revoke", b, 1, on_revoked, &done) != NULL)
			while (!done)
				event_base_loop(base, EVLOOP_ONCE);
	}
	event_free(tick_ev);
	tick_ev = NULL;
	/*
	 * The names' records go once no call of theirs can be answered: freed before the
	 * revoke, a record whose claim or delete was answered while the revoke was waited for
	 * was used and freed again.  etcd_shutdown drops the calls still in flight, unanswered:
	 * their member_claim records are freed here.
	 */
	etcd_shutdown();
	names_stop();
	while ((cl = TAILQ_FIRST(&claims)) != NULL) {
		TAILQ_REMOVE(&claims, cl, entry);
		claim_free(cl);
	}
	while ((n = TAILQ_FIRST(&cnodes)) != NULL) {
		TAILQ_REMOVE(&cnodes, n, entry);
		free(n->value);
		free(n);
	}
	free(node_value);
	node_value = NULL;
}
