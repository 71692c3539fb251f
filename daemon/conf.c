/*
 * gpxd.conf: an ini file parsed with inih.  Every key has a default here; unknown sections or
 * keys and malformed values are errors that name the line, so a typo never silently changes
 * behaviour.  Loading fills a fresh struct conf; the caller swaps it in only when it parsed.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <ini.h>

#include "gpxd.h"

struct conf *cfg;

void
conf_defaults(struct conf *c)
{
	memset(c, 0, sizeof(*c));
	c->socket_path = strdup(GPX_DEFAULT_SOCKET);
	c->socket_mode = 0660;
	c->socket_group = NULL;
	c->admin_group = strdup("gpx-admin");
	c->workers = 2;
	c->blocking_threads = 2;
	c->chunk_size = 2 << 20;
	c->ring_entries = 4096;
	c->max_segs = 1 << 20;
	c->trust_legacy_ipc = false;
	c->cuda = true;
	c->sm_copy = true;
	c->sm_copy_blocks = 128;
	c->max_conns_per_uid = 256;
	c->max_regions_per_uid = 65536;
	c->max_region_bytes_per_uid = 0;
	c->max_exports_per_uid = 4096;
	c->max_inflight_per_uid = 65536;
	/* A client says Hello at once: more than a few waiting is a burst, hundreds are a flood. */
	c->hello_max = 128;
	c->reserved_fds = 32;
	c->idle_timeout_s = 0;
	/* Busy polling needs a core to spare: on small machines it would take one from the copies. */
	c->busy_poll_us = sysconf(_SC_NPROCESSORS_ONLN) >= 8 ? 5000 : 0;
	c->log_level = strdup("info");
	c->metrics_listen = NULL;
	/* [fabric] (daemon/fabric/peer.c) */
	c->fabric_transport = strdup("auto");
	c->fabric_timeout_s = 10;
	c->fabric_retry_s = 2;
	c->fabric_dial_on_demand = false;    /* clients may not point the daemon at any address */
	c->fabric_chunk = 1 << 20;
}

void
conf_free(struct conf *c)
{
	free(c->socket_path);
	free(c->socket_group);
	free(c->admin_group);
	free(c->log_level);
	free(c->metrics_listen);
	free(c->path);
	free(c->fabric_node);
	free(c->fabric_listen);
	free(c->fabric_key_file);
	free(c->fabric_peers);
	free(c->fabric_transport);
	free(c->fabric_rdma_device);
	for (int i = 0; i < 16; i++)
		free(c->fabric_nic_for_gpu[i]);
	cluster_conf_free(&c->cluster);
	memset(c, 0, sizeof(*c));
}

struct parse {
	struct conf *c;
	char *err;
	size_t errlen;
};

static int
parse_bool(const char *v, bool *out)
{
	if (!strcasecmp(v, "yes") || !strcasecmp(v, "true") || !strcmp(v, "1") || !strcasecmp(v, "on"))
		*out = true;
	else if (!strcasecmp(v, "no") || !strcasecmp(v, "false") || !strcmp(v, "0") || !strcasecmp(v, "off"))
		*out = false;
	else
		return -1;
	return 0;
}

/* A count or size with an optional K, M or G suffix (powers of 1024). */
static int
parse_u64(const char *v, uint64_t max, uint64_t *out)
{
	char *end;
	unsigned long long n;

	errno = 0;
	if (*v == '-' || *v == '\0')
		return -1;
	n = strtoull(v, &end, 0);
	if (errno != 0)
		return -1;
	int shift = 0;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	}
	if (*end != '\0' || (shift && n > (~0ULL >> shift)))
		return -1;
	n <<= shift;
	if (n > max)
		return -1;
	*out = n;
	return 0;
}

static int
set_str(char **dst, const char *v)
{
	free(*dst);
	*dst = strdup(v);
	return *dst != NULL ? 0 : -1;
}

/* Sets *field from v when it lies in [lo, hi]; -1 otherwise. */
static int
num(const char *v, uint64_t lo, uint64_t hi, uint64_t *out)
{
	uint64_t n;

	if (parse_u64(v, hi, &n) < 0 || n < lo)
		return -1;
	*out = n;
	return 0;
}

/* inih calls this for every key; returning 0 makes ini_parse_file report the line. */
static int
on_key(void *user, const char *sec, const char *key, const char *v)
{
	struct parse *p = user;
	struct conf *c = p->c;
	uint64_t n;
	int bad = 0;

#define KEY(s, k) (!strcmp(sec, s) && !strcmp(key, k))
#define NUM(field, lo, hi) (num(v, lo, hi, &n) == 0 ? (field = n, 0) : -1)
	if (KEY("daemon", "socket"))
		bad = v[0] != '/' || set_str(&c->socket_path, v);
	else if (KEY("daemon", "socket_mode")) {
		char *end;
		unsigned long m = strtoul(v, &end, 8);
		bad = end == v || *end != '\0' || *v == '-' || m > 0777;
		c->socket_mode = m;
	} else if (KEY("daemon", "socket_group"))
		bad = set_str(&c->socket_group, v);
	else if (KEY("daemon", "admin_group"))
		bad = set_str(&c->admin_group, v);
	else if (KEY("daemon", "workers"))
		bad = NUM(c->workers, 1, 256);
	else if (KEY("daemon", "blocking_threads"))
		bad = NUM(c->blocking_threads, 1, 64);
	else if (KEY("daemon", "chunk_size"))
		bad = NUM(c->chunk_size, 4096, 1ULL << 30);
	else if (KEY("daemon", "ring_entries")) {
		bad = NUM(c->ring_entries, 8, 1 << 20);
		bad |= (c->ring_entries & (c->ring_entries - 1)) != 0;
	} else if (KEY("daemon", "max_segments"))
		bad = NUM(c->max_segs, 1, 1 << 24);
	else if (KEY("daemon", "log_level"))
		bad = set_str(&c->log_level, v);
	else if (KEY("daemon", "busy_poll_us"))
		bad = NUM(c->busy_poll_us, 0, 1000000);
	else if (KEY("daemon", "idle_timeout"))
		bad = NUM(c->idle_timeout_s, 0, 86400 * 365);
	else if (KEY("daemon", "metrics"))
		bad = set_str(&c->metrics_listen, v);
	else if (KEY("daemon", "metrics_allow_remote"))
		bad = parse_bool(v, &c->metrics_allow_remote);
	else if (KEY("cuda", "enable"))
		bad = parse_bool(v, &c->cuda);
	else if (KEY("cuda", "trust_legacy_ipc"))
		bad = parse_bool(v, &c->trust_legacy_ipc);
	else if (KEY("cuda", "sm_copy"))
		bad = parse_bool(v, &c->sm_copy);
	else if (KEY("cuda", "sm_copy_blocks"))
		bad = NUM(c->sm_copy_blocks, 1, 65535);
	else if (KEY("limits", "connections_per_uid"))
		bad = NUM(c->max_conns_per_uid, 1, 1 << 20);
	else if (KEY("limits", "regions_per_uid"))
		bad = NUM(c->max_regions_per_uid, 1, 1 << 24);
	else if (KEY("limits", "region_bytes_per_uid"))
		bad = NUM(c->max_region_bytes_per_uid, 0, ~0ULL);
	else if (KEY("limits", "exports_per_uid"))
		bad = NUM(c->max_exports_per_uid, 0, 1 << 20);
	else if (KEY("limits", "inflight_per_uid"))
		bad = NUM(c->max_inflight_per_uid, 1, 1 << 24);
	else if (KEY("limits", "hello_max"))
		bad = NUM(c->hello_max, 1, 1 << 20);
	else if (KEY("limits", "reserved_fds"))
		bad = NUM(c->reserved_fds, 0, RESERVED_FDS_MAX);
	/* [fabric]: values are checked again, with reasons, when the fabric starts (peer.c) */
	else if (KEY("fabric", "node"))
		bad = set_str(&c->fabric_node, v);
	else if (KEY("fabric", "listen"))
		bad = set_str(&c->fabric_listen, v);
	else if (KEY("fabric", "key_file"))
		bad = v[0] != '/' || set_str(&c->fabric_key_file, v);
	else if (KEY("fabric", "peers"))
		bad = set_str(&c->fabric_peers, v);
	else if (KEY("fabric", "dial_on_demand"))
		bad = parse_bool(v, &c->fabric_dial_on_demand);
	else if (KEY("fabric", "transport"))
		bad = (strcmp(v, "auto") && strcmp(v, "rdma") && strcmp(v, "tcp")) ||
		    set_str(&c->fabric_transport, v);
	else if (KEY("fabric", "rdma_device"))
		bad = set_str(&c->fabric_rdma_device, v);
	else if (!strcmp(sec, "fabric") && !strncmp(key, "nic_for_gpu", 11) && isdigit((unsigned char)key[11])) {
		/* nic_for_gpu0 .. nic_for_gpu15 (daemon/fabric/nic.c) */
		char *end;
		unsigned long g = strtoul(key + 11, &end, 10);
		bad = *end != '\0' || g >= 16 || (key[11] == '0' && key[12] != '\0') || v[0] == '\0' ||
		    set_str(&c->fabric_nic_for_gpu[g], v);
	} else if (KEY("fabric", "timeout")) {
		char *end;
		c->fabric_timeout_s = strtod(v, &end);
		bad = end == v || *end != '\0' || !(c->fabric_timeout_s >= 0.1 && c->fabric_timeout_s <= 3600);
	} else if (KEY("fabric", "retry_interval")) {
		char *end;
		c->fabric_retry_s = strtod(v, &end);
		bad = end == v || *end != '\0' || !(c->fabric_retry_s >= 0.1 && c->fabric_retry_s <= 3600);
	} else if (KEY("fabric", "chunk_size"))
		bad = NUM(c->fabric_chunk, 4096, 16 << 20);   /* PEER_DATA_MAX */
	else if (!strcmp(sec, "cluster")) {
		char why[160];
		if (cluster_conf_key(&c->cluster, key, v, why, sizeof(why)) < 0) {
			if (p->err[0] == '\0')
				snprintf(p->err, p->errlen, "bad value '%s' for cluster.%s: %s", v, key, why);
			return 0;
		}
	} else {
		if (p->err[0] == '\0')
			snprintf(p->err, p->errlen, "unknown key '%s' in [%s]", key, sec);
		return 0;
	}
#undef KEY
#undef NUM
	if (bad) {
		if (p->err[0] == '\0')
			snprintf(p->err, p->errlen, "bad value '%s' for %s.%s", v, sec, key);
		return 0;
	}
	return 1;
}

int
conf_load(struct conf *c, const char *path, char *err, size_t errlen)
{
	struct parse p = { .c = c, .err = err, .errlen = errlen };
	FILE *f;
	int r;

	err[0] = '\0';
	if ((f = fopen(path, "re")) == NULL) {
		snprintf(err, errlen, "%s: %s", path, strerror(errno));
		return -1;
	}
	r = ini_parse_file(f, on_key, &p);
	fclose(f);
	if (r != 0) {
		char tmp[512];
		snprintf(tmp, sizeof(tmp), "%s:%d: %s", path, r, err[0] ? err : "syntax error");
		snprintf(err, errlen, "%s", tmp);
		return -1;
	}
	set_str(&c->path, path);
	return 0;
}
