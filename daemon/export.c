/*
 * Exports: a region published under a name with an access rule, so that another client can
 * import it and copy into or out of it without the two processes sharing anything directly.
 * The rule is checked against the importer's kernel credentials, never against anything the
 * importer says about itself.
 */
#include "config.h"

#include <stdlib.h>
#include <string.h>

#include "gpxd.h"

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

/* 1..64 bytes of [A-Za-z0-9._:/-]: printable in logs and safe in JSON and metrics labels. */
bool
export_name_ok(const char *name)
{
	size_t n = strlen(name);

	if (n == 0 || n > 64)
		return false;
	return strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-") == n;
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
	if (e->notify)
		atomic_store(&e->r->notify_on, false);     /* the queue itself goes with the mapping */
	struct user *u = user_get(e->uid);
	u->exports--;
	region_unref(e->r);
	free(e->peers);     /* fabric */
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
