/*
 * Exports: a region published under a name with an access rule, so that another client can
 * import it and copy into or out of it without the two processes sharing anything directly.
 * The rule is checked against the importer's kernel credentials, never against anything the
 * importer says about itself.  An export may also be open to other nodes' daemons (remote,
 * all of them or those its list names): that rule is kept and checked here too, for the
 * fabric (daemon/fabric/), which asks export_admits_peer when a peer imports.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/client/client.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/gpu.h"
#include "daemon/cluster/cluster.h"
#include "daemon/fabric/fabric.h"

struct export_list exports = TAILQ_HEAD_INITIALIZER(exports);

struct export *
export_find(const char *name)
{
	struct export *e;

	TAILQ_FOREACH(e, &exports, entry)
		if (strcmp(e->name, name) == 0)
			return e;
	return NULL;
}

int
export_remote_opts(struct export *e, const Gpx__Export *m, char *err, size_t errlen)
{
	size_t len = 0;

	e->remote = m->remote;
	e->peers = NULL;
	if (m->n_peers == 0)
		return 0;
	if (!m->remote) {
		snprintf(err, errlen, "a list of peers only applies to a remote export");
		return -GPX__STATUS__EINVAL;
	}
	if (m->n_peers > 256) {
		snprintf(err, errlen, "at most 256 peers per export");
		return -GPX__STATUS__EINVAL;
	}
	for (size_t i = 0; i < m->n_peers; i++) {
		if (!export_node_name_ok(m->peers[i])) {
			snprintf(err, errlen, "peer names are 1..64 bytes of [A-Za-z0-9._-]");
			return -GPX__STATUS__EINVAL;
		}
		len += strlen(m->peers[i]) + 1;
	}
	if ((e->peers = malloc(len)) == NULL) {
		snprintf(err, errlen, "out of memory");
		return -GPX__STATUS__ENOMEM;
	}
	e->peers[0] = '\0';
	for (size_t i = 0; i < m->n_peers; i++) {
		if (i > 0)
			strcat(e->peers, ",");
		strcat(e->peers, m->peers[i]);
	}
	return 0;
}

/* Whether export e admits peer node n: remote, and n in its list when it has one. */
bool
export_admits_peer(const struct export *e, const char *n)
{
	if (!e->remote)
		return false;
	if (e->peers == NULL)
		return true;
	size_t l = strlen(n);
	for (const char *s = e->peers; *s;) {
		size_t k = strcspn(s, ",");
		if (k == l && strncmp(s, n, l) == 0)
			return true;
		s += k + (s[k] == ',');
	}
	return false;
}

bool
export_allows(const struct export *e, const struct creds *c)
{
	if (c->uid == 0 || c->uid == e->uid)
		return true;
	switch (e->rule) {
	case GPX__EXPORT_RULE__EXPORT_ANY:
		return true;
	case GPX__EXPORT_RULE__EXPORT_GID:
		return creds_in_group(c, e->gid);
	default:
		return false;
	}
}

void
export_remove(struct export *e)
{
	TAILQ_REMOVE(&exports, e, entry);
	if (e->remote)
		cluster_name_drop(e->name);   /* its cluster name, if it has one, goes too */
	if (e->notify)
		atomic_store(&e->r->notify_on, false);     /* the queue itself goes with the mapping */
	struct user *u = user_get(e->uid);
	u->exports--;
	if (e->charged_to != NULL)
		budget_entry_release(e->charged_to, u, e->charged);
	region_unref(e->r);
	free(e->peers);
	free(e);
}

void
export_remove_region(struct region *r)
{
	struct export *e, *t;

	TAILQ_FOREACH_SAFE(e, &exports, entry, t)
		if (e->r == r)
			export_remove(e);
}

uint32_t
export_count(void)
{
	struct export *e;
	uint32_t n = 0;

	TAILQ_FOREACH(e, &exports, entry)
		n++;
	return n;
}

/* ---- our exports as peers import them, through the fabric (fabric_exports_from) ---- */

static int
peer_find(const char *name, const char *node, struct export **out, struct region **r, bool *read_only,
    bool *notify)
{
	struct export *e = export_find(name);

	if (e == NULL)
		return -GPX__STATUS__ENOENT;
	if (!export_admits_peer(e, node))
		return -GPX__STATUS__EACCES;
	if (atomic_load(&e->r->revoked))
		return -GPX__STATUS__EREVOKED;
	*out = e;
	*r = e->r;
	*read_only = e->read_only;
	*notify = e->notify;
	return 0;
}

static void
peer_import_begin(struct export *e)
{
	e->importers++;
}

static void
peer_import_end(struct region *r)
{
	struct export *e;

	TAILQ_FOREACH(e, &exports, entry)
		if (e->r == r && e->importers > 0) {
			e->importers--;
			break;
		}
}

const struct fabric_exports export_peer_ops = {
	.find = peer_find,
	.import_begin = peer_import_begin,
	.import_end = peer_import_end,
};
