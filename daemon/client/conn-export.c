/*
 * Exports and imports: Export names a region for others (its access rule, and whether the
 * fabric may offer it to other nodes), Unexport withdraws it, Import gives the asker a handle
 * on an export of this node or, through the fabric's one hook, of another node.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/client/conn-private.h"
#include "daemon/cluster/cluster.h"
#include "daemon/fabric/fabric.h"

/* ---- exports ---- */

/* cluster: an export waiting for etcd to make its name the cluster's. */
struct cexport {
	struct conn *c;
	uint32_t seq;
	struct export *e;
	char name[65];
};

/* cluster: the name is ours in the cluster (status 0), or the export is undone with why. */
static void
export_claimed(void *arg, int status, const char *msg)
{
	struct cexport *ce = arg;
	struct conn *c = ce->c;
	struct export *e = export_find(ce->name);

	conn_settle(c);
	conn_uncharge(c, sizeof(*ce));
	if (status != 0 && e == ce->e && e->owner == c->id)
		export_remove(e);
	if (c->state != CONN_DEAD)
		reply_err(c, ce->seq, status, msg);
	free(ce);
}

void
req_export(struct conn *c, uint32_t seq, const Gpx__Export *m)
{
	struct rhandle *h = conn_handle(c, m->region);
	struct export *e;

	if (h == NULL || h->imported) {
		reply_err(c, seq, h ? GPX__STATUS__EACCES : GPX__STATUS__ENOENT,
		    h ? "only a region's owner can export it" : "no such region on this connection");
		return;
	}
	if (m->name == NULL || !export_name_ok(m->name)) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "export names are 1..64 bytes of [A-Za-z0-9._:/-]");
		return;
	}
	if (export_find(m->name) != NULL) {
		reply_err(c, seq, GPX__STATUS__EEXIST, "an export of that name exists");
		return;
	}
	if (m->rule > GPX__EXPORT_RULE__EXPORT_ANY) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "unknown export rule");
		return;
	}
	if (c->user->exports >= cfg->max_exports_per_uid) {
		log_audit(c, "export limit reached");
		reply_err(c, seq, GPX__STATUS__EQUOTA, "uid is at its export limit");
		return;
	}
	if (m->notify && atomic_load(&h->r->notify_on)) {
		reply_err(c, seq, GPX__STATUS__EEXIST, "the region already notifies through another export");
		return;
	}
	if (m->notify && c->cq == NULL) {
		reply_err(c, seq, GPX__STATUS__EINVAL, "notifications need a completion ring");
		return;
	}
	/*
	 * The export with its list of peers, and for a cluster name the wait for etcd, against the
	 * budgets (the list's length is its claim; export_remote_opts checks its names).
	 */
	char err[256];
	bool claim = m->remote && cluster_running();
	struct cexport *ce = NULL;
	uint64_t cost = sizeof(*e) + (claim ? sizeof(*ce) : 0);
	int r;
	for (size_t i = 0; i < m->n_peers && i <= 256; i++)
		cost += strnlen(m->peers[i], 65) + 1;
	if ((r = conn_charge(c, cost, "export", err, sizeof(err))) < 0) {
		reply_err(c, seq, -r, err);
		return;
	}
	/* (the wait for etcd made first: an export answered without it would not be the cluster's) */
	if ((claim && (ce = calloc(1, sizeof(*ce))) == NULL) || (e = calloc(1, sizeof(*e))) == NULL) {
		free(ce);
		conn_uncharge(c, cost);
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return;
	}
	snprintf(e->name, sizeof(e->name), "%s", m->name);
	e->r = h->r;
	region_ref(h->r);
	e->owner = c->id;
	e->owner_region = h->id;
	e->uid = c->uid;
	e->rule = m->rule;
	e->gid = m->gid;
	e->read_only = m->read_only || h->r->read_only;
	e->notify = m->notify;
	/* fabric: whether other nodes may import it, and which (export.c keeps that rule) */
	char ferr[160];
	int fe = export_remote_opts(e, m, ferr, sizeof(ferr));
	if (fe < 0) {
		region_unref(h->r);
		free(e);
		free(ce);
		conn_uncharge(c, cost);
		reply_err(c, seq, -fe, ferr);
		return;
	}
	/* Given back when it goes (export_remove); the wait for etcd, when that ends. */
	e->charged_to = &c->entries;
	e->charged = cost - (claim ? sizeof(*ce) : 0);
	if (m->notify) {
		h->r->notify_tag = m->notify_tag;
		if (h->r->notify_cq == NULL) {
			/* Set once (the owner's queue is always this one): workers read it unlocked. */
			cq_ref(c->cq);
			h->r->notify_cq = c->cq;
		}
		atomic_store(&h->r->notify_on, true);
	}
	c->user->exports++;
	TAILQ_INSERT_TAIL(&exports, e, entry);
	if (e->remote && fabric != NULL)
		fabric->probe(h->r);     /* GPU memory: what a peer's NIC would get */
	else if (e->remote && h->r->host == NULL && h->r->dev >= 0)
		/* No fabric to probe it: what the fabric says when it cannot. */
		snprintf(h->r->gdr, sizeof(h->r->gdr), "staging: GPU memory cannot be probed now");
	log_debug("export", "client %llu exports %#llx as %s", (unsigned long long)c->id,
	    (unsigned long long)h->id, e->name);
	/* cluster: the name must be the cluster's too; answered once etcd has said so */
	if (claim) {
		ce->c = c;
		ce->seq = seq;
		ce->e = e;
		snprintf(ce->name, sizeof(ce->name), "%s", e->name);
		c->pending++;
		cluster_name_add(e->name, e->uid, export_claimed, ce);
		return;
	}
	reply_err(c, seq, 0, NULL);
}

void
req_unexport(struct conn *c, uint32_t seq, const Gpx__Unexport *m)
{
	struct export *e = m->name ? export_find(m->name) : NULL;

	if (e == NULL) {
		reply_err(c, seq, GPX__STATUS__ENOENT, "no such export");
		return;
	}
	if (e->owner != c->id) {
		log_audit(c, "unexport of %s, which it does not own", e->name);
		reply_err(c, seq, GPX__STATUS__EACCES, "only the exporting connection can withdraw an export");
		return;
	}
	export_remove(e);
	reply_err(c, seq, 0, NULL);
}

/* fabric: an import the fabric answers later through import_answered, with c kept alive. */
struct rimport {
	struct conn *c;
	uint32_t seq;
};

static void import_answered(void *arg, int status, const char *msg, struct region *r, bool read_only);

/* What an import of another node's export holds: its wait for the answer, then its handle and region. */
#define RIMPORT_BYTES (sizeof(struct rimport) + HANDLE_BYTES + REGION_BYTES(0))

/* fabric: hands an import of a name no local export has to the fabric; false: not its kind. */
static bool
import_remote(struct conn *c, uint32_t seq, const char *name)
{
	struct logwho who = conn_who(c);
	struct fabric_import rq = { .name = name, .uid = c->uid, .log_as = &who, .done = import_answered };
	struct rimport *ri;
	char err[256];
	int r;

	if (fabric == NULL) {
		if (name[0] != '@')
			return false;
		reply_err(c, seq, GPX__STATUS__EACCES, "importing by address needs the fabric: "
		    "[fabric] dial_on_demand = yes in gpxd.conf");
		return true;
	}
	/* (charged for the region the answer brings too: it is made before the answer comes back) */
	if ((r = conn_charge(c, RIMPORT_BYTES, "import", err, sizeof(err))) < 0) {
		reply_err(c, seq, -r, err);
		return true;
	}
	if ((ri = malloc(sizeof(*ri))) == NULL) {
		conn_uncharge(c, RIMPORT_BYTES);
		reply_err(c, seq, GPX__STATUS__ENOMEM, "out of memory");
		return true;
	}
	ri->c = c;
	ri->seq = seq;
	rq.arg = ri;
	c->pending++;                /* import_answered settles it, maybe before this returns */
	/* cluster: a bare name etcd knows, or "NODE:name" of a node in it; else the fabric's forms */
	if (cluster_import(&rq) || fabric->import(&rq))
		return true;
	c->pending--;
	free(ri);
	conn_uncharge(c, RIMPORT_BYTES);
	return false;
}

void
req_import(struct conn *c, uint32_t seq, const Gpx__Import *m)
{
	struct export *e = m->name ? export_find(m->name) : NULL;
	struct rhandle *h;

	if (e == NULL) {
		/* fabric: "NODE:name" or "@HOST:PORT/name" is answered by the fabric, maybe later */
		if (m->name != NULL && import_remote(c, seq, m->name))
			return;
		reply_err(c, seq, GPX__STATUS__ENOENT, "no such export");
		return;
	}
	struct creds who = conn_creds(c);
	if (!export_allows(e, &who)) {
		log_audit(c, "import of %s denied by its rule", e->name);
		reply_err(c, seq, GPX__STATUS__EACCES, "the export's access rule does not admit this client");
		return;
	}
	if (c->user->regions >= cfg->max_regions_per_uid) {
		log_audit(c, "region limit reached on import");
		reply_err(c, seq, GPX__STATUS__EQUOTA, "uid is at its region limit");
		return;
	}
	char err[256];
	int r;
	if ((r = conn_charge(c, HANDLE_BYTES, "import", err, sizeof(err))) < 0) {
		reply_err(c, seq, -r, err);
		return;
	}
	if ((h = handle_add(c, e->r, true, e->read_only, HANDLE_BYTES, "import", err, sizeof(err))) == NULL) {
		conn_uncharge(c, HANDLE_BYTES);
		reply_err(c, seq, strncmp(err, "busy", 4) == 0 ? GPX__STATUS__EBUSY : GPX__STATUS__ENOMEM, err);
		return;
	}
	region_ref(e->r);
	c->user->regions++;
	e->importers++;
	reply_registered(c, seq, h);
}

/*
 * fabric: the answer to an import of another node's export (fabric.h's fabric_import_fn): a
 * handle on r, which arrives with one reference, or the error.  An asker gone meanwhile drops r.
 */
static void
import_answered(void *arg, int status, const char *msg, struct region *r, bool read_only)
{
	struct rimport *ri = arg;
	struct conn *c = ri->c;
	uint32_t seq = ri->seq;
	struct rhandle *h = NULL;
	char err[256];

	free(ri);
	conn_settle(c);
	/* The wait is over; the handle and its region keep the rest. */
	conn_uncharge(c, sizeof(*ri));
	if (c->state == CONN_DEAD || status != 0) {
		conn_uncharge(c, RIMPORT_BYTES - sizeof(*ri));
		if (r != NULL) {
			region_revoke(r);      /* its closing tells the peer */
			region_unref(r);
		}
		if (c->state != CONN_DEAD)
			reply_err(c, seq, status, msg);
		return;
	}
	if (c->user->regions >= cfg->max_regions_per_uid) {
		snprintf(err, sizeof(err), "uid is at its region limit");
		h = NULL;
	} else
		h = handle_add(c, r, true, read_only, RIMPORT_BYTES - sizeof(*ri), "import", err, sizeof(err));
	if (h == NULL) {
		reply_err(c, seq, c->user->regions >= cfg->max_regions_per_uid ? GPX__STATUS__EQUOTA :
		    strncmp(err, "busy", 4) == 0 ? GPX__STATUS__EBUSY : GPX__STATUS__ENOMEM, err);
		conn_uncharge(c, RIMPORT_BYTES - sizeof(*ri));
		region_revoke(r);
		region_unref(r);
		return;
	}
	c->user->regions++;
	reply_registered(c, seq, h);
}

