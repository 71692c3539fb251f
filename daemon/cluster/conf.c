/*
 * [cluster] of gpxd.conf: which etcd, under which prefix, with which lease, over TLS and with
 * which credentials.  conf.c hands each key of the section here; a bad value is refused with
 * why, and conf.c names the file and line, at start and at reload alike.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/cluster/cluster.h"

static int
set(char **dst, const char *v)
{
	free(*dst);
	return (*dst = strdup(v)) != NULL ? 0 : -1;
}

/* "http://HOST:PORT" or "https://...", comma-separated, printable, no spaces inside. */
static bool
urls_ok(const char *v)
{
	const char *s = v;

	if (*v == '\0')
		return false;
	while (*s) {
		size_t k = strcspn(s, ",");
		if (!((k > 7 && strncmp(s, "http://", 7) == 0) || (k > 8 && strncmp(s, "https://", 8) == 0)))
			return false;
		for (size_t i = 0; i < k; i++)
			if (s[i] <= ' ' || s[i] > '~')
				return false;
		s += k;
		s += *s == ',';
	}
	return true;
}

static bool
prefix_ok(const char *v)
{
	size_t n = strlen(v);

	if (n < 2 || n > 100 || v[0] != '/' || v[n - 1] == '/')
		return false;
	return strspn(v, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/") == n;
}

int
cluster_conf_key(struct cluster_conf *cc, const char *key, const char *v, char *why, size_t whylen)
{
	if (!strcmp(key, "etcd")) {
		if (!urls_ok(v)) {
			snprintf(why, whylen, "etcd = URL[,URL...], each http://HOST:PORT or https://HOST:PORT");
			return -1;
		}
		return set(&cc->etcd, v);
	}
	if (!strcmp(key, "prefix")) {
		if (!prefix_ok(v)) {
			snprintf(why, whylen, "prefix is /NAME[/NAME...] of [A-Za-z0-9._-], at most 100 bytes");
			return -1;
		}
		return set(&cc->prefix, v);
	}
	if (!strcmp(key, "lease_ttl")) {
		char *end;
		unsigned long n = strtoul(v, &end, 10);
		if (end == v || *end != '\0' || *v == '-' || n < 2 || n > 300) {
			snprintf(why, whylen, "lease_ttl is 2..300 seconds");
			return -1;
		}
		cc->lease_ttl = (uint32_t)n;
		return 0;
	}
	char **path = !strcmp(key, "cacert") ? &cc->cacert : !strcmp(key, "cert") ? &cc->cert :
	    !strcmp(key, "key") ? &cc->key : !strcmp(key, "auth_file") ? &cc->auth_file : NULL;
	if (path == NULL) {
		why[0] = '\0';             /* an unknown key: conf.c says so, naming the section */
		return -1;
	}
	if (v[0] != '/') {
		snprintf(why, whylen, "%s is an absolute path", key);
		return -1;
	}
	return set(path, v);
}

void
cluster_conf_free(struct cluster_conf *cc)
{
	free(cc->etcd);
	free(cc->prefix);
	free(cc->cacert);
	free(cc->cert);
	free(cc->key);
	free(cc->auth_file);
	memset(cc, 0, sizeof(*cc));
}

/* ---- [cluster] as a section of gpxd.conf (conf_add_section): checked at reload, applied at restart ---- */

static int
section_key(struct conf *c, const char *key, const char *v, char *why, size_t whylen)
{
	return cluster_conf_key(&c->cluster, key, v, why, whylen);
}

static bool
str_same(const char *a, const char *b)
{
	return a == b || (a != NULL && b != NULL && strcmp(a, b) == 0);
}

static bool
section_same(const struct conf *a, const struct conf *b)
{
	const struct cluster_conf *x = &a->cluster, *y = &b->cluster;

	return str_same(x->etcd, y->etcd) && str_same(x->prefix, y->prefix) && x->lease_ttl == y->lease_ttl &&
	    str_same(x->cacert, y->cacert) && str_same(x->cert, y->cert) && str_same(x->key, y->key) &&
	    str_same(x->auth_file, y->auth_file);
}

static void
section_free(struct conf *c)
{
	cluster_conf_free(&c->cluster);
}

void
cluster_conf_register(void)
{
	static const struct conf_section s = {
		.name = "cluster", .key = section_key, .same = section_same, .free = section_free, .live = false,
	};
	conf_add_section(&s);
}
