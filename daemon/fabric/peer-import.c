/*
 * Imports between nodes, both ways.  Serving: a peer asks for one of our exports by name; if
 * the export is remote and its rule admits that node (export_admits_peer), the peer gets a
 * handle (struct phandle) that carries the connection's epoch, and, over RDMA, a registration
 * of the export for this import alone (rdma-mr.c); the handle holds a reference on the region
 * until the peer releases it or the connection ends.  Asking: a local client imports
 * "NODE:name" from a ready peer, or "@HOST:PORT/name" (IPv6 as [ADDR]:PORT) from the daemon at
 * an address: the configured peer of that address if there is one, else, only with [fabric]
 * dial_on_demand, a connection dialled then for the import (peer-dial.c), authenticated exactly
 * like the others.  The import waits for that connection without blocking the loop (a pimport
 * with a target and no peer yet) and fails with the reason as soon as the attempt fails, or
 * after [fabric] timeout; the peer's answer becomes a region of kind `remote` (remote.c).
 *
 * Every import is answered exactly once, through the fabric_import_fn the asker handed in
 * (conn.c's), never by a call into the asker: errors at once, the rest when the peer answers.
 */
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/fabric/internal.h"

/* An import a local client asked for, waiting for its peer to be ready or for its answer. */
struct pimport {
	TAILQ_ENTRY(pimport) entry;
	uint64_t id;
	struct peer *p;                  /* asked through this one, NULL while waiting for t */
	struct ptarget *t;               /* the address whose connection it waits for */
	fabric_import_fn done;           /* the asker's answer (conn.c), called once */
	void *arg;
	uid_t uid;                       /* the asker's */
	double deadline;
	char name[65];                   /* the export's name on the peer */
	char want[PEER_NAME_MAX + 1];    /* cluster: the node that must answer at t's address */
};

static TAILQ_HEAD(, pimport) pimports = TAILQ_HEAD_INITIALIZER(pimports);
static uint64_t next_import;

#define PEER_MAX_HANDLES 65536          /* handles one peer may hold on our exports */

static void import_fail(struct pimport *, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- serving: peers' imports of our exports ---- */

static void
phandle_drop(struct phandle *h)
{
	fabric_rdma_unexport(h);
	fabric_exports->import_end(h->r);
	region_unref(h->r);
	free(h);
}

void
peer_import_req(struct peer *p, const Gpxpeer__ImportReq *q)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__ImportRep rep = GPXPEER__IMPORT_REP__INIT;
	struct export *e = NULL;
	struct region *er = NULL;
	bool read_only = false, notify = false;
	int st = q->name != NULL && export_name_ok(q->name) ?
	    fabric_exports->find(q->name, p->node, &e, &er, &read_only, &notify) : -GPX__STATUS__ENOENT;
	uint32_t n = 0, rkeys[FABRIC_RDMA_DEVS] = { 0 };
	struct phandle *h;
	char msg[256] = "";

	TAILQ_FOREACH(h, &p->handles, entry)
		n++;
	rep.id = q->id;
	if (st == -GPX__STATUS__ENOENT) {
		rep.status = GPX__STATUS__ENOENT;
		snprintf(msg, sizeof(msg), "no export of that name on %s", peer_self);
	} else if (st == -GPX__STATUS__EACCES) {
		rep.status = GPX__STATUS__EACCES;
		snprintf(msg, sizeof(msg), "export %s on %s is not open to peer %s", q->name, peer_self, p->node);
		log_info("fabric: peer %s: import of %s refused by the export's remote rule", p->node, q->name);
	} else if (st < 0) {
		rep.status = -st;
		snprintf(msg, sizeof(msg), "export %s was withdrawn", q->name);
	} else if (n >= PEER_MAX_HANDLES) {
		rep.status = GPX__STATUS__EQUOTA;
		snprintf(msg, sizeof(msg), "peer %s holds too many imports", p->node);
	} else if ((h = calloc(1, sizeof(*h))) == NULL) {
		rep.status = GPX__STATUS__ENOMEM;
		snprintf(msg, sizeof(msg), "out of memory on %s", peer_self);
	} else {
		h->id = (uint64_t)p->epoch << 32 | ++p->next_serial;
		h->r = er;
		region_ref(er);
		h->read_only = read_only;
		snprintf(h->export_name, sizeof(h->export_name), "%s", q->name);
		TAILQ_INSERT_TAIL(&p->handles, h, entry);
		fabric_exports->import_begin(e);
		rep.handle = h->id;
		rep.length = er->length;
		rep.read_only = h->read_only;
		rep.notify = notify;
		rep.rdma = fabric_rdma_export(p, h, &rep.rdma_addr, rkeys);
		rep.rdma_rkey = rkeys[0];
		rep.n_rdma_rkeys = rep.rdma ? FABRIC_RDMA_DEVS : 0;
		rep.rdma_rkeys = rkeys;
		log_debug("fabric", "peer %s imports %s as %#llx", p->node, q->name, (unsigned long long)h->id);
	}
	rep.message = msg;
	m.body_case = GPXPEER__PEER_MSG__BODY_IMPORT_REP;
	m.import_rep = &rep;
	if (peer_send(p, &m, NULL, 0) != -ENOMEM)
		return;
	/* No memory for the answer: the handle goes, refused ENOMEM (the asker waits for one) */
	if (rep.status == 0) {
		TAILQ_REMOVE(&p->handles, h, entry);
		phandle_drop(h);
	}
	rep = (Gpxpeer__ImportRep)GPXPEER__IMPORT_REP__INIT;
	rep.id = q->id;
	rep.status = GPX__STATUS__ENOMEM;
	if (peer_send(p, &m, NULL, 0) < 0)
		peer_kill(p, "out of memory for its answers");
}

void
peer_import_release(struct peer *p, const Gpxpeer__Release *r)
{
	struct phandle *h;

	/*
	 * The peer's last note for this handle went by RDMA and completed before it let go of
	 * the import, but it may still wait in our completion queue while this message, which
	 * took the other road, is already here: the notes first, then the handle goes.
	 */
	if (p->rdma != NULL) {
		fabric_rdma_drain();
		if (p->state != PEER_READY)
			return;
	}
	if ((h = peer_handle(p, r->handle)) == NULL)
		return;          /* released twice or from an older epoch: nothing to do */
	TAILQ_REMOVE(&p->handles, h, entry);
	phandle_drop(h);
}

/* ---- asking: our imports of peers' exports ---- */

/* A line about an import, within the asker's share of the log. */
static void __attribute__((format(printf, 3, 4)))
log_asker(const struct logwho *w, int level, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	log_vwho(w, level, fmt, ap);
	va_end(ap);
}

/* A waiting import of export `name` for the asker rq; NULL (and rq answered) without memory. */
static struct pimport *
import_new(const struct fabric_import *rq, const char *name)
{
	struct pimport *pi = calloc(1, sizeof(*pi));

	if (pi == NULL) {
		rq->done(rq->arg, GPX__STATUS__ENOMEM, "out of memory", NULL, false);
		return NULL;
	}
	pi->id = ++next_import;
	pi->done = rq->done;
	pi->arg = rq->arg;
	pi->uid = rq->uid;
	pi->deadline = now_s() + cfg->fabric_timeout_s;
	snprintf(pi->name, sizeof(pi->name), "%s", name);
	TAILQ_INSERT_TAIL(&pimports, pi, entry);
	return pi;
}

/* Asks ready peer p for the export; its answer is due within the timeout. */
static void
import_send(struct pimport *pi, struct peer *p)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__ImportReq q = GPXPEER__IMPORT_REQ__INIT;

	pi->p = p;
	pi->t = NULL;
	pi->deadline = now_s() + cfg->fabric_timeout_s;
	q.id = pi->id;
	q.name = pi->name;
	m.body_case = GPXPEER__PEER_MSG__BODY_IMPORT_REQ;
	m.import_req = &q;
	/* (a send that killed p failed pi with it) */
	if (peer_send(p, &m, NULL, 0) == -ENOMEM)
		import_fail(pi, GPX__STATUS__ENOMEM, "out of memory");
}

/* Answers an import no longer on the list, and forgets it. */
static void
import_answer(struct pimport *pi, int status, const char *msg, struct region *r, bool read_only)
{
	pi->done(pi->arg, status, msg, r, read_only);
	free(pi);
}

/* Answers an import with an error and forgets it. */
static void
import_fail(struct pimport *pi, int status, const char *fmt, ...)
{
	char err[320];
	va_list ap;

	TAILQ_REMOVE(&pimports, pi, entry);
	va_start(ap, fmt);
	vsnprintf(err, sizeof(err), fmt, ap);
	va_end(ap);
	import_answer(pi, status, err, NULL, false);
}

void
peer_import_target_ready(struct ptarget *t, struct peer *p)
{
	struct pimport *pi;

	for (;;) {
		/* From the top each time: a failed send kills p, which rewrites the list. */
		TAILQ_FOREACH(pi, &pimports, entry)
			if (pi->t == t)
				break;
		if (pi == NULL)
			return;
		if (pi->want[0] != '\0' && strcmp(pi->want, p->node) != 0)
			import_fail(pi, GPX__STATUS__EACCES, "the cluster store gives %s as node %s's address, "
			    "but node %s answers there", t->addr, pi->want, p->node);
		else if (p->state != PEER_READY)
			import_fail(pi, GPX__STATUS__EIO, "peer %s went down: %s", p->node, p->why);
		else
			import_send(pi, p);
	}
}

void
peer_import_target_down(struct ptarget *t, const char *why)
{
	int st = strstr(why, "authentication failed") ? GPX__STATUS__EACCES : GPX__STATUS__EIO;
	struct pimport *pi, *pt;

	TAILQ_FOREACH_SAFE(pi, &pimports, entry, pt)
		if (pi->t == t)
			import_fail(pi, st, "peer at %s not reached: %s", t->addr, why);
}

bool
peer_import_waits_for(const struct ptarget *t)
{
	struct pimport *pi;

	TAILQ_FOREACH(pi, &pimports, entry)
		if (pi->t == t)
			return true;
	return false;
}

/* Addresses as clients may write them: what getaddrinfo takes, printable in logs and JSON. */
static bool
addr_chars_ok(const char *a)
{
	return strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%") ==
	    strlen(a);
}

/*
 * "@HOST:PORT/name", a past the '@': through the configured peer at that address, else one
 * dialled now if dial_on_demand allows it; the import waits for it (see the top of the file).
 */
static void
import_by_addr(const struct fabric_import *rq, const char *a)
{
	const char *slash = strchr(a, '/');
	char addr[96], host[80], port[16];
	struct ptarget *t;
	struct pimport *pi;
	struct peer *p;
	char err[256];
	int st;

	if (slash != NULL && (size_t)(slash - a) < sizeof(addr))
		snprintf(addr, sizeof(addr), "%.*s", (int)(slash - a), a);
	if (slash == NULL || (size_t)(slash - a) >= sizeof(addr) || !addr_chars_ok(addr) ||
	    !peer_dial_split(addr, host, sizeof(host), port, sizeof(port)) || host[0] == '\0' ||
	    strtoul(port, NULL, 10) - 1 >= 65535) {
		rq->done(rq->arg, GPX__STATUS__EINVAL, "an import by address is @HOST:PORT/name or "
		    "@[IPV6]:PORT/name", NULL, false);
		return;
	}
	if (!export_name_ok(slash + 1)) {
		rq->done(rq->arg, GPX__STATUS__EINVAL, "export names are 1..64 bytes of [A-Za-z0-9._:/-]",
		    NULL, false);
		return;
	}
	if ((t = peer_dial_target(addr, false, &st, err, sizeof(err))) == NULL) {
		rq->done(rq->arg, st, err, NULL, false);
		return;
	}
	if ((pi = import_new(rq, slash + 1)) == NULL)
		return;          /* a fresh target with no import is forgotten at the next tick */
	if (t->node[0] != '\0' && (p = peer_by_node(t->node)) != NULL) {
		import_send(pi, p);
		return;
	}
	pi->t = t;
	if (t->p == NULL && !t->resolving) {
		if (t->on_demand)
			log_asker(rq->log_as, LOG_L_INFO, "fabric: dialling %s on demand, for an import by uid %u",
			    addr, (unsigned)rq->uid);
		peer_dial(t);
	}
}

/*
 * A cluster name: the export on node rq->node, whose address etcd gives (rq->addr).  Through
 * the node's connection when one stands, else one dialled now; the node that answers there
 * must be the one etcd named (its key proves it is of the cluster, not that it is that node).
 */
static void
import_by_hint(const struct fabric_import *rq)
{
	struct ptarget *t;
	struct pimport *pi;
	struct peer *p;
	char err[256];
	int st;

	if (!export_name_ok(rq->export_name)) {
		rq->done(rq->arg, GPX__STATUS__EINVAL, "export names are 1..64 bytes of [A-Za-z0-9._:/-]",
		    NULL, false);
		return;
	}
	if ((p = peer_by_node(rq->node)) != NULL) {
		if ((pi = import_new(rq, rq->export_name)) != NULL)
			import_send(pi, p);
		return;
	}
	if ((t = peer_dial_target(rq->addr, true, &st, err, sizeof(err))) == NULL) {
		rq->done(rq->arg, st, err, NULL, false);
		return;
	}
	if ((pi = import_new(rq, rq->export_name)) == NULL)
		return;
	pi->t = t;
	snprintf(pi->want, sizeof(pi->want), "%s", rq->node);
	if (t->node[0] != '\0' && (p = peer_by_node(t->node)) != NULL) {
		peer_import_target_ready(t, p);
		return;
	}
	if (t->p == NULL && !t->resolving) {
		log_asker(rq->log_as, LOG_L_INFO, "fabric: dialling node %s at %s (from the cluster store), "
		    "for an import by uid %u", rq->node, rq->addr, (unsigned)rq->uid);
		peer_dial(t);
	}
}

bool
peer_import(const struct fabric_import *rq)
{
	const char *name = rq->name, *colon = strchr(name, ':');
	char n[PEER_NAME_MAX + 1], err[256];
	struct pimport *pi;
	struct peer *p;

	if (rq->addr != NULL) {
		import_by_hint(rq);
		return true;
	}
	/* '@' is in neither node nor export names: "@..." is an address, never NODE:name. */
	if (name[0] == '@') {
		import_by_addr(rq, name + 1);
		return true;
	}
	if (colon == NULL || colon == name || colon - name > PEER_NAME_MAX)
		return false;
	snprintf(n, sizeof(n), "%.*s", (int)(colon - name), name);
	if (!export_node_name_ok(n) || strcmp(n, peer_self) == 0)
		return false;
	if ((p = peer_by_node(n)) == NULL) {
		snprintf(err, sizeof(err), "no local export %s, and no connected peer named %s", name, n);
		rq->done(rq->arg, GPX__STATUS__ENOENT, err, NULL, false);
		return true;
	}
	if (!export_name_ok(colon + 1)) {
		rq->done(rq->arg, GPX__STATUS__EINVAL, "export names are 1..64 bytes of [A-Za-z0-9._:/-]",
		    NULL, false);
		return true;
	}
	if ((pi = import_new(rq, colon + 1)) != NULL)
		import_send(pi, p);
	return true;
}

int
peer_import_let_go(struct peer *p, uint64_t handle)
{
	Gpxpeer__PeerMsg m = GPXPEER__PEER_MSG__INIT;
	Gpxpeer__Release r = GPXPEER__RELEASE__INIT;

	r.handle = handle;
	m.body_case = GPXPEER__PEER_MSG__BODY_RELEASE;
	m.release = &r;
	return peer_send(p, &m, NULL, 0);
}

void
peer_import_rep(struct peer *p, const Gpxpeer__ImportRep *rep)
{
	struct pimport *pi;
	char err[256];

	TAILQ_FOREACH(pi, &pimports, entry)
		if (pi->p == p && pi->id == rep->id)
			break;
	if (pi == NULL) {
		peer_kill(p, "answer to an import it was not asked for");
		return;
	}
	TAILQ_REMOVE(&pimports, pi, entry);
	if (rep->status == 0 && ((uint32_t)(rep->handle >> 32) != p->epoch || rep->length == 0)) {
		peer_kill(p, "malformed import answer");
		import_answer(pi, GPX__STATUS__EIO, "the peer answered the import with nonsense", NULL, false);
		return;
	}
	if (rep->status != 0) {
		int st = rep->status <= GPX__STATUS__EPERM ? (int)rep->status : GPX__STATUS__EPROTO;
		snprintf(err, sizeof(err), "%s: %s", p->node,
		    rep->message && rep->message[0] ? rep->message : "import refused");
		for (char *s = err; *s; s++)
			if (*s < 0x20 || *s > 0x7e)
				*s = '?';
		import_answer(pi, st, err, NULL, false);
		return;
	}
	/* An asker gone meanwhile drops the region at once, which sends the Release. */
	struct region *r = remote_region(p, rep->handle, rep->length, rep->read_only);
	if (r == NULL) {
		peer_import_let_go(p, rep->handle);
		import_answer(pi, GPX__STATUS__ENOMEM, "out of memory", NULL, false);
		return;
	}
	if (rep->notify)
		((struct remote *)r->priv)->notify = true;
	if (rep->rdma) {
		/* Trusted no further than its NIC: the registration bounds what the key reaches. */
		((struct remote *)r->priv)->rdma = true;
		struct remote *rm = r->priv;
		rm->raddr = rep->rdma_addr;
		/* A peer that sends one key has one device: it is the key at every queue pair's end. */
		rm->rkeys[0] = rep->rdma_rkey;
		for (size_t i = 0; i < rep->n_rdma_rkeys && i < FABRIC_RDMA_DEVS; i++)
			rm->rkeys[i] = rep->rdma_rkeys[i];
	}
	r->uid = pi->uid;
	import_answer(pi, 0, NULL, r, rep->read_only);
}

/* ---- a connection going, deadlines, stop ---- */

void
peer_import_down(struct peer *p)
{
	struct pimport *pi, *pt;
	struct phandle *h;

	TAILQ_FOREACH_SAFE(pi, &pimports, entry, pt)
		if (pi->p == p)
			import_fail(pi, GPX__STATUS__EIO, "peer %s went down during the import: %s", p->node,
			    p->why);
	while ((h = TAILQ_FIRST(&p->handles)) != NULL) {
		TAILQ_REMOVE(&p->handles, h, entry);
		phandle_drop(h);
	}
}

void
peer_import_tick(double now)
{
	double to = cfg->fabric_timeout_s;
	struct pimport *pi, *pit;
	struct ptarget *t;

	TAILQ_FOREACH_SAFE(pi, &pimports, entry, pit) {
		if (now <= pi->deadline)
			continue;
		if (pi->p == NULL) {
			t = pi->t;
			import_fail(pi, GPX__STATUS__EIO, "peer at %s not ready within %.1f s: %s", t->addr,
			    to, t->resolving ? "its name is not resolved yet" : t->p == NULL ? "not connected" :
			    t->p->state == PEER_CONNECTING ? "no TCP connection" : "no answer to the handshake");
			continue;
		}
		peer_kill(pi->p, "no answer to an import within %.1f s", to);
		break;      /* the kill rewrote the list */
	}
}

/* After every peer is down: those still resolving a name. */
void
peer_import_stop(void)
{
	struct pimport *pi;

	while ((pi = TAILQ_FIRST(&pimports)) != NULL)
		import_fail(pi, GPX__STATUS__ESHUTDOWN, "the daemon is stopping");
}
