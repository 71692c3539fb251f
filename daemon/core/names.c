/*
 * The names every layer checks: an export's (what clients and peers import by) and a node's
 * (the fabric's peers, export peer lists, the cluster).  They keep the export_ prefix they
 * have always had, after the thing they name; they live in the core because the
 * configuration, the fabric and the cluster check them as well as the connections.
 */
#include "config.h"

#include <string.h>

#include "daemon/gpxd.h"

/* 1..64 bytes of [A-Za-z0-9._:/-]: printable in logs and safe in JSON and metrics labels. */
bool
export_name_ok(const char *name)
{
	size_t n = strlen(name);

	if (n == 0 || n > 64)
		return false;
	return strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-") == n;
}

/* 1..64 of [A-Za-z0-9._-]; no ':', which separates NODE from name in imports of NODE:name. */
bool
export_node_name_ok(const char *n)
{
	size_t l = n ? strlen(n) : 0;

	return l > 0 && l <= 64 &&
	    strspn(n, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") == l;
}
