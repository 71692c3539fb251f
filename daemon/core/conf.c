/*
 * gpxd.conf: an ini file parsed with inih.  One table (keys[] below) names every key: its
 * section, type, field, default, range and whether a reload applies it or it waits for a
 * restart.  The table drives the parser, the defaults, the report of a reload and the test
 * that holds gpxd.conf(5) to the code.  Unknown sections or keys and malformed values are
 * errors that name the file, the line and the key, so a typo never silently changes
 * behaviour.  A section of another subsystem is parsed by its own code (conf_add_section).
 *
 * A loaded configuration is never changed: threads other than the loop read a snapshot they
 * hold a reference to (conf_hold), and a reload publishes a new one (conf_publish); the old
 * one is freed when its last holder lets it go.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <sys/stat.h>
#include <ini.h>

#include "daemon/gpxd.h"

struct conf *cfg;

#define F(field) offsetof(struct conf, field)

/*
 * Every key, one a line.  def is the default as the file would write it (NULL: unset, or set
 * by code where the default depends on the machine), lo and hi the range of a number as the
 * manual writes it (hi NULL: no upper bound).
 */
const struct conf_key conf_keys[] = {
	{ "daemon", "socket", K_ABSPATH, F(socket_path), GPX_DEFAULT_SOCKET, NULL, NULL, CONF_RESTART },
	{ "daemon", "socket_mode", K_MODE, F(socket_mode), "0660", NULL, NULL, CONF_RESTART },
	{ "daemon", "socket_group", K_STR, F(socket_group), NULL, NULL, NULL, CONF_RESTART },
	{ "daemon", "admin_group", K_STR, F(admin_group), "gpx-admin", NULL, NULL, CONF_LIVE },
	{ "daemon", "workers", K_INT, F(workers), "2", "1", "256", CONF_RESTART },
	{ "daemon", "blocking_threads", K_INT, F(blocking_threads), "2", "1", "64", CONF_RESTART },
	{ "daemon", "chunk_size", K_U64, F(chunk_size), "2M", "4K", "1G", CONF_RESTART },
	{ "daemon", "ring_entries", K_POW2, F(ring_entries), "4096", "8", "1M", CONF_RESTART },
	{ "daemon", "max_segments", K_U32, F(max_segs), "1M", "1", "16M", CONF_LIVE },
	{ "daemon", "log_level", K_LOGLEVEL, F(log_level), "info", NULL, NULL, CONF_LIVE },
	{ "daemon", "idle_timeout", K_SECONDS, F(idle_timeout_s), "0", "0", "31536000", CONF_LIVE },
	{ "daemon", "busy_poll_us", K_U32, F(busy_poll_us), NULL, "0", "1000000", CONF_LIVE },
	{ "daemon", "metrics", K_STR, F(metrics_listen), NULL, NULL, NULL, CONF_LIVE },
	{ "daemon", "metrics_allow_remote", K_BOOL, F(metrics_allow_remote), "no", NULL, NULL, CONF_LIVE },
	{ "cuda", "enable", K_BOOL, F(cuda), "yes", NULL, NULL, CONF_RESTART },
	{ "cuda", "trust_legacy_ipc", K_BOOL, F(trust_legacy_ipc), "no", NULL, NULL, CONF_LIVE },
	{ "cuda", "sm_copy", K_BOOL, F(sm_copy), "yes", NULL, NULL, CONF_LIVE },
	{ "cuda", "sm_copy_blocks", K_INT, F(sm_copy_blocks), "65535", "1", "65535", CONF_LIVE },
	{ "limits", "connections_per_uid", K_U32, F(max_conns_per_uid), "256", "1", "1M", CONF_LIVE },
	/* A third of the mappings a default kernel leaves gpxd (limits.mappings): one uid's regions
	 * cannot use them all. */
	{ "limits", "regions_per_uid", K_U32, F(max_regions_per_uid), "16384", "1", "16M", CONF_LIVE },
	{ "limits", "region_bytes_per_uid", K_U64, F(max_region_bytes_per_uid), "0", "0", NULL, CONF_LIVE },
	{ "limits", "exports_per_uid", K_U32, F(max_exports_per_uid), "4096", "0", "1M", CONF_LIVE },
	{ "limits", "inflight_per_uid", K_U32, F(max_inflight_per_uid), "65536", "1", "16M", CONF_LIVE },
	{ "limits", "mappings", K_U32, F(max_mappings), NULL, "16", "16M", CONF_LIVE },
	/*
	 * Budgets (user.c): the largest request the protocol allows fits one request's budget
	 * (a vectored copy of max_segments: 24 MiB; a page batch of 16,384 pairs: 9 MiB), and the
	 * total keeps 256 busy connections, with gpxd's own few MiB, under 2 GiB.
	 */
	{ "limits", "request_budget", K_U64, F(budget_request), "64M", "64K", "1T", CONF_LIVE },
	{ "limits", "connection_budget", K_U64, F(budget_connection), "256M", "64K", "1T", CONF_LIVE },
	{ "limits", "uid_budget", K_U64, F(budget_uid), "512M", "64K", "1T", CONF_LIVE },
	{ "limits", "total_budget", K_U64, F(budget_total), "1536M", "64K", "1T", CONF_LIVE },
	/* A client says Hello at once: more than a few waiting is a burst, hundreds are a flood. */
	{ "limits", "hello_max", K_U32, F(hello_max), "128", "1", "1M", CONF_LIVE },
	{ "limits", "reserved_fds", K_U32, F(reserved_fds), "32", "0", "1024", CONF_LIVE },
	/* [fabric] (daemon/fabric/): started once, so most of it waits for a restart */
	{ "fabric", "node", K_NODE, F(fabric_node), NULL, NULL, NULL, CONF_RESTART },
	{ "fabric", "listen", K_HOSTPORT, F(fabric_listen), NULL, NULL, NULL, CONF_RESTART },
	{ "fabric", "peers", K_HOSTPORTS, F(fabric_peers), NULL, NULL, NULL, CONF_RESTART },
	/* clients may not point the daemon at any address unless asked */
	{ "fabric", "dial_on_demand", K_BOOL, F(fabric_dial_on_demand), "no", NULL, NULL, CONF_LIVE },
	{ "fabric", "key_file", K_ABSPATH, F(fabric_key_file), NULL, NULL, NULL, CONF_RESTART },
	{ "fabric", "transport", K_TRANSPORT, F(fabric_transport), "auto", NULL, NULL, CONF_RESTART },
	{ "fabric", "rdma_device", K_STR, F(fabric_rdma_device), NULL, NULL, NULL, CONF_RESTART },
	{ "fabric", "nic_for_gpuN", K_NICS, F(fabric_nic_for_gpu), NULL, NULL, NULL, CONF_RESTART },
	{ "fabric", "timeout", K_DOUBLE, F(fabric_timeout_s), "10", "0.1", "3600", CONF_LIVE },
	{ "fabric", "retry_interval", K_DOUBLE, F(fabric_retry_s), "2", "0.1", "3600", CONF_LIVE },
	{ "fabric", "chunk_size", K_U64, F(fabric_chunk), "1M", "4K", "16M", CONF_RESTART },  /* PEER_DATA_MAX */
	{ NULL },
};

#undef F

#define CONF_SECTIONS_MAX 8
#define CONF_KEYS_MAX 256            /* lines remembered for errors found after the file */
static struct conf_section sections[CONF_SECTIONS_MAX];
static int nsections;

static pthread_mutex_t conf_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_uint conf_gen;
static int (*metrics_ok)(const char *, bool, char *, size_t);

void
conf_metrics_check(int (*fn)(const char *spec, bool allow_remote, char *err, size_t errlen))
{
	metrics_ok = fn;
}

int
conf_add_section(const struct conf_section *s)
{
	if (nsections == CONF_SECTIONS_MAX)
		return -1;
	sections[nsections++] = *s;
	return 0;
}

static void *
field(const struct conf *c, const struct conf_key *k)
{
	return (char *)c + k->off;
}

/* ---- values ---- */

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

/*
 * A count or size: decimal, or hexadecimal after 0x, with an optional K, M, G or T suffix
 * (powers of 1024).  Never octal: "010" is ten, as the manual says.
 */
int
conf_parse_u64(const char *v, uint64_t *out)
{
	char *end;
	unsigned long long n;
	int base = 10;

	if (!isdigit((unsigned char)*v))
		return -1;
	if (v[0] == '0' && (v[1] == 'x' || v[1] == 'X')) {
		base = 16;
		v += 2;
		if (!isxdigit((unsigned char)*v))
			return -1;
	}
	errno = 0;
	n = strtoull(v, &end, base);
	if (errno != 0)
		return -1;
	int shift = 0;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	case 't': case 'T': shift = 40; end++; break;
	}
	if (*end != '\0' || (shift && n > (~0ULL >> shift)))
		return -1;
	*out = n << shift;
	return 0;
}

static int
parse_num(const struct conf_key *k, const char *v, uint64_t *out, char *why, size_t whylen)
{
	uint64_t lo = 0, hi = ~0ULL;

	if (k->lo != NULL)
		conf_parse_u64(k->lo, &lo);
	if (k->hi != NULL)
		conf_parse_u64(k->hi, &hi);
	if (conf_parse_u64(v, out) < 0 || *out < lo || *out > hi) {
		if (k->hi != NULL)
			snprintf(why, whylen, "a number from %s to %s", k->lo, k->hi);
		else
			snprintf(why, whylen, "a number");
		return -1;
	}
	return 0;
}

/* "error|warning|info|debug [sub,sub]", as log_set_level takes it. */
static int
check_log_level(const char *v)
{
	static const char *names[] = { "error", "warning", "info", "debug" };
	size_t w = strcspn(v, " \t");
	const char *s = v + w + strspn(v + w, " \t");

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (strlen(names[i]) == w && strncmp(v, names[i], w) == 0) {
			if (strlen(s) > 255)
				return -1;
			for (; *s; s++)
				if (!isalnum((unsigned char)*s) && *s != ',' && *s != '_' && *s != '-')
					return -1;
			return 0;
		}
	return -1;
}

/* "HOST:PORT" or "[V6]:PORT", port 0 to 65535. */
static bool
hostport_ok(const char *v, size_t len)
{
	const char *colon = memrchr(v, ':', len);
	size_t hl;

	if (colon == NULL || colon + 1 == v + len)
		return false;
	for (const char *p = colon + 1; p < v + len; p++)
		if (!isdigit((unsigned char)*p))
			return false;
	if (strtoul(colon + 1, NULL, 10) > 65535 || v + len - colon > 6)
		return false;
	hl = (size_t)(colon - v);
	if (v[0] == '[')
		return hl > 2 && v[hl - 1] == ']';
	return hl > 0 && memchr(v, ',', hl) == NULL && memchr(v, ' ', hl) == NULL;
}

/* 0, or -ENOMEM (*dst unchanged). */
static int
set_str(char **dst, const char *v)
{
	char *s = strdup(v);

	if (s == NULL)
		return -ENOMEM;
	free(*dst);
	*dst = s;
	return 0;
}

/* The key of the table that (sec, name) is, or NULL. */
static const struct conf_key *
key_find(const char *sec, const char *name, int *nic)
{
	for (const struct conf_key *k = conf_keys; k->sec != NULL; k++) {
		if (strcmp(sec, k->sec) != 0)
			continue;
		if (k->type == K_NICS) {
			/* nic_for_gpu0 .. nic_for_gpu15 (daemon/fabric/nic.c) */
			char *end;
			if (strncmp(name, "nic_for_gpu", 11) != 0 || !isdigit((unsigned char)name[11]))
				continue;
			unsigned long g = strtoul(name + 11, &end, 10);
			if (*end != '\0' || g >= CONF_NICS || (name[11] == '0' && name[12] != '\0'))
				continue;
			*nic = (int)g;
			return k;
		}
		if (strcmp(name, k->name) == 0)
			return k;
	}
	return NULL;
}

/* Sets one key of c from v; -1 with the reason in why, or -ENOMEM (why empty). */
static int
key_set(struct conf *c, const struct conf_key *k, int nic, const char *v, char *why, size_t whylen)
{
	void *p = field(c, k);
	uint64_t n;
	char *end;

	why[0] = '\0';
	switch (k->type) {
	case K_BOOL:
		if (parse_bool(v, p) < 0) {
			snprintf(why, whylen, "yes or no");
			return -1;
		}
		return 0;
	case K_INT:
		if (parse_num(k, v, &n, why, whylen) < 0)
			return -1;
		*(int *)p = (int)n;
		return 0;
	case K_U32:
		if (parse_num(k, v, &n, why, whylen) < 0)
			return -1;
		*(uint32_t *)p = (uint32_t)n;
		return 0;
	case K_POW2:
		if (parse_num(k, v, &n, why, whylen) < 0 || (n & (n - 1)) != 0) {
			snprintf(why, whylen, "a power of two from %s to %s", k->lo, k->hi);
			return -1;
		}
		*(uint32_t *)p = (uint32_t)n;
		return 0;
	case K_U64:
		if (parse_num(k, v, &n, why, whylen) < 0)
			return -1;
		*(uint64_t *)p = n;
		return 0;
	case K_SECONDS:
		if (parse_num(k, v, &n, why, whylen) < 0)
			return -1;
		*(double *)p = (double)n;
		return 0;
	case K_DOUBLE: {
		double d = strtod(v, &end), lo = strtod(k->lo, NULL), hi = strtod(k->hi, NULL);
		if (end == v || *end != '\0' || !(d >= lo && d <= hi)) {
			snprintf(why, whylen, "seconds from %s to %s", k->lo, k->hi);
			return -1;
		}
		*(double *)p = d;
		return 0;
	}
	case K_MODE: {
		unsigned long m = strtoul(v, &end, 8);
		if (*v < '0' || *v > '7' || end == v || *end != '\0' || m > 0777) {
			snprintf(why, whylen, "octal permissions, 0 to 0777");
			return -1;
		}
		*(unsigned *)p = (unsigned)m;
		return 0;
	}
	case K_ABSPATH:
		if (v[0] != '/') {
			snprintf(why, whylen, "an absolute path");
			return -1;
		}
		return set_str(p, v);
	case K_LOGLEVEL:
		if (check_log_level(v) < 0) {
			snprintf(why, whylen, "error, warning, info or debug, then optionally subsystems");
			return -1;
		}
		return set_str(p, v);
	case K_TRANSPORT:
		if (strcmp(v, "auto") && strcmp(v, "rdma") && strcmp(v, "tcp")) {
			snprintf(why, whylen, "auto, rdma or tcp");
			return -1;
		}
		return set_str(p, v);
	case K_NODE:
		if (!export_node_name_ok(v)) {
			snprintf(why, whylen, "1 to 64 of [A-Za-z0-9._-]");
			return -1;
		}
		return set_str(p, v);
	case K_HOSTPORT:
		if (!hostport_ok(v, strlen(v))) {
			snprintf(why, whylen, "ADDRESS:PORT");
			return -1;
		}
		return set_str(p, v);
	case K_HOSTPORTS:
		for (const char *s = v; *s;) {
			size_t l = strcspn(s, ",");
			if (!hostport_ok(s, l)) {
				snprintf(why, whylen, "HOST:PORT[,HOST:PORT...]");
				return -1;
			}
			s += l + (s[l] == ',');
		}
		return set_str(p, v);
	case K_NICS:
		if (v[0] == '\0') {
			snprintf(why, whylen, "an RDMA device name");
			return -1;
		}
		return set_str(&((char **)p)[nic], v);
	case K_STR:
		if (v[0] == '\0') {
			snprintf(why, whylen, "not empty");
			return -1;
		}
		return set_str(p, v);
	}
	return -1;
}

/* ---- a whole configuration ---- */

int
conf_defaults(struct conf *c)
{
	char why[128];
	int nic = 0;

	memset(c, 0, sizeof(*c));
	for (const struct conf_key *k = conf_keys; k->sec != NULL; k++) {
		int r = k->def != NULL ? key_set(c, k, nic, k->def, why, sizeof(why)) : 0;
		if (r == -ENOMEM)
			return -1;
		if (r < 0)
			fatalx("default of %s.%s: %s", k->sec, k->name, why);
	}
	/* Busy polling needs a core to spare: on small machines it would take one from the copies. */
	c->busy_poll_us = sysconf(_SC_NPROCESSORS_ONLN) >= 8 ? 5000 : 0;
	/* The rest of the kernel's vm.max_map_count is gpxd's own: libraries, threads, CUDA. */
	c->max_mappings = maps_default();
	return 0;
}

void
conf_free(struct conf *c)
{
	for (const struct conf_key *k = conf_keys; k->sec != NULL; k++) {
		void *p = field(c, k);
		if (k->type == K_NICS)
			for (int i = 0; i < CONF_NICS; i++)
				free(((char **)p)[i]);
		else if (k->type >= K_STR)
			free(*(char **)p);
	}
	for (int i = 0; i < nsections; i++)
		if (sections[i].free != NULL)
			sections[i].free(c);
	free(c->path);
	memset(c, 0, sizeof(*c));
}

struct conf *
conf_new(void)
{
	struct conf *c = malloc(sizeof(*c));

	if (c == NULL)
		return NULL;
	if (conf_defaults(c) < 0) {
		conf_free(c);
		free(c);
		return NULL;
	}
	atomic_init(&c->refs, 1);
	return c;
}

struct parse {
	struct conf *c;
	const char *path;
	char *err;
	size_t errlen;
	int lines[CONF_KEYS_MAX];    /* where each key of the table was set last (0: not set) */
	bool oom;                    /* a value could not be copied */
};

static const struct conf_section *
section_find(const char *sec)
{
	for (int i = 0; i < nsections; i++)
		if (strcmp(sec, sections[i].name) == 0)
			return &sections[i];
	return NULL;
}

static bool
section_known(const char *sec)
{
	for (const struct conf_key *k = conf_keys; k->sec != NULL; k++)
		if (strcmp(sec, k->sec) == 0)
			return true;
	return section_find(sec) != NULL;
}

/* inih calls this for every key; returning 0 makes ini_parse_file report the line. */
static int
on_key(void *user, const char *sec, const char *name, const char *v)
{
	struct parse *p = user;
	const struct conf_section *s = section_find(sec);
	const struct conf_key *k;
	char why[160];
	int nic = 0;

	if (p->err[0] != '\0')
		return 0;
	if (s != NULL) {
		why[0] = '\0';
		if (s->key(p->c, name, v, why, sizeof(why)) < 0) {
			if (why[0] != '\0')
				snprintf(p->err, p->errlen, "bad value '%s' for %s.%s: %s", v, sec, name, why);
			else
				snprintf(p->err, p->errlen, "unknown key '%s' in [%s]", name, sec);
			return 0;
		}
		return 1;
	}
	if ((k = key_find(sec, name, &nic)) == NULL) {
		snprintf(p->err, p->errlen, "unknown key '%s' in [%s]", name, sec);
		return 0;
	}
	int r = key_set(p->c, k, nic, v, why, sizeof(why));
	if (r < 0) {
		if (r == -ENOMEM) {
			p->oom = true;
			snprintf(p->err, p->errlen, "out of memory for %s.%s", sec, name);
		} else
			snprintf(p->err, p->errlen, "bad value '%s' for %s.%s%s%s", v, sec, name, why[0] ? ": " : "", why);
		return 0;
	}
	return 1;
}

/*
 * inih says nothing of a section without keys and numbers lines only on error: read the file
 * once more for its section and key lines, so that an unknown section is an error even when
 * empty, and an error found only after the whole file can still name its key's line.
 */
static int
scan_lines(FILE *f, struct parse *p)
{
	char line[512], sec[64] = "";
	int n = 0, nic = 0;

	rewind(f);
	while (fgets(line, sizeof(line), f) != NULL) {
		char *s = line + strspn(line, " \t"), *e;
		const struct conf_key *k;
		n++;
		if (*s == '[' && (e = strchr(s, ']')) != NULL) {
			*e = '\0';
			if (!section_known(s + 1)) {
				snprintf(p->err, p->errlen, "%d: unknown section [%s]", n, s + 1);
				return -1;
			}
			snprintf(sec, sizeof(sec), "%s", s + 1);
		} else if (s == line && (e = strchr(s, '=')) != NULL) {
			while (e > s && (e[-1] == ' ' || e[-1] == '\t'))
				e--;
			*e = '\0';
			if ((k = key_find(sec, s, &nic)) != NULL && k - conf_keys < CONF_KEYS_MAX)
				p->lines[k - conf_keys] = n;
		}
	}
	return 0;
}

/* The line where key `name` of the table was set, for errors found after the whole file. */
static int
line_of(const struct parse *p, const char *sec, const char *name)
{
	int nic = 0;
	const struct conf_key *k = key_find(sec, name, &nic);

	return k != NULL && k - conf_keys < CONF_KEYS_MAX ? p->lines[k - conf_keys] : 0;
}

/* What only the whole file tells: keys that depend on each other, files a key names. */
static int
check_whole(struct parse *p)
{
	const struct conf *c = p->c;
	char why[256];
	struct stat st;

	if (c->metrics_listen != NULL && metrics_ok != NULL &&
	    metrics_ok(c->metrics_listen, c->metrics_allow_remote, why, sizeof(why)) < 0) {
		snprintf(p->err, p->errlen, "%d: bad value '%s' for daemon.metrics: %s",
		    line_of(p, "daemon", "metrics"), c->metrics_listen, why);
		return -1;
	}
	if (c->fabric_listen == NULL && c->fabric_peers == NULL && !c->fabric_dial_on_demand)
		return 0;
	/* the fabric is on: its peers authenticate with the key */
	if (c->fabric_key_file == NULL) {
		int l = line_of(p, "fabric", "listen");
		if (l == 0)
			l = line_of(p, "fabric", "peers");
		if (l == 0)
			l = line_of(p, "fabric", "dial_on_demand");
		snprintf(p->err, p->errlen, "%d: [fabric] key_file is required: peers authenticate with it", l);
		return -1;
	}
	if (stat(c->fabric_key_file, &st) < 0)
		snprintf(why, sizeof(why), "%s", strerror(errno));
	else if (!S_ISREG(st.st_mode) || (st.st_mode & 077) != 0 || st.st_size < 16)
		snprintf(why, sizeof(why), "a regular file of 16 bytes or more, readable by its owner only "
		    "(chmod 0600)");
	else
		return 0;
	snprintf(p->err, p->errlen, "%d: bad value '%s' for fabric.key_file: %s",
	    line_of(p, "fabric", "key_file"), c->fabric_key_file, why);
	return -1;
}

int
conf_load(struct conf *c, const char *path, char *err, size_t errlen)
{
	struct parse p = { .c = c, .path = path, .err = err, .errlen = errlen };
	char tmp[512];
	FILE *f;
	int r;

	err[0] = '\0';
	if ((f = fopen(path, "re")) == NULL) {
		int e = errno;
		snprintf(err, errlen, "%s: %s", path, strerror(e));
		return e == ENOMEM ? -ENOMEM : -1;
	}
	if (scan_lines(f, &p) < 0) {
		fclose(f);
		snprintf(tmp, sizeof(tmp), "%s:%s", path, err);
		snprintf(err, errlen, "%s", tmp);
		return -1;
	}
	rewind(f);
	r = ini_parse_file(f, on_key, &p);
	fclose(f);
	if (r == -2) {
		snprintf(err, errlen, "%s: out of memory", path);      /* (inih's line buffer) */
		return -ENOMEM;
	}
	if (r != 0) {
		snprintf(tmp, sizeof(tmp), "%s:%d: %s", path, r, err[0] ? err : "syntax error");
		snprintf(err, errlen, "%s", tmp);
		return p.oom ? -ENOMEM : -1;
	}
	if (check_whole(&p) < 0) {
		snprintf(tmp, sizeof(tmp), "%s:%s", path, err);
		snprintf(err, errlen, "%s", tmp);
		return -1;
	}
	for (int i = 0; i < nsections; i++)
		if (sections[i].check != NULL && sections[i].check(c, tmp, sizeof(tmp)) < 0) {
			snprintf(err, errlen, "%s: [%s]: %s", path, sections[i].name, tmp);
			return -1;
		}
	if (set_str(&c->path, path) < 0) {
		snprintf(err, errlen, "%s: out of memory", path);
		return -ENOMEM;
	}
	return 0;
}

char *
conf_abspath(const char *path)
{
	char cwd[PATH_MAX], *s;

	if (path[0] == '/')
		return strdup(path);
	if (getcwd(cwd, sizeof(cwd)) == NULL)
		return NULL;
	if (asprintf(&s, "%s/%s", strcmp(cwd, "/") == 0 ? "" : cwd, path) < 0)
		return NULL;
	return s;
}

/* ---- the running snapshot ---- */

/*
 * The lock only makes "read cfg, take a reference" one step against conf_publish; a worker
 * takes it once per reload, not per chunk (conf_refresh).
 */
const struct conf *
conf_hold(void)
{
	struct conf *c;

	pthread_mutex_lock(&conf_lock);
	c = cfg;
	atomic_fetch_add(&c->refs, 1);
	pthread_mutex_unlock(&conf_lock);
	return c;
}

void
conf_drop(const struct conf *c)
{
	struct conf *m = (struct conf *)c;

	if (m != NULL && atomic_fetch_sub(&m->refs, 1) == 1) {
		conf_free(m);
		free(m);
	}
}

const struct conf *
conf_refresh(const struct conf *held)
{
	static _Thread_local unsigned gen;
	unsigned now = atomic_load_explicit(&conf_gen, memory_order_acquire);

	if (held != NULL && gen == now)
		return held;
	conf_drop(held);
	gen = now;
	return conf_hold();
}

void
conf_publish(struct conf *n)
{
	struct conf *old;

	pthread_mutex_lock(&conf_lock);
	old = cfg;
	cfg = n;
	atomic_fetch_add_explicit(&conf_gen, 1, memory_order_release);
	pthread_mutex_unlock(&conf_lock);
	conf_drop(old);
}

/* ---- what a reload changes ---- */

static size_t
field_size(enum conf_type t)
{
	switch (t) {
	case K_BOOL: return sizeof(bool);
	case K_INT: return sizeof(int);
	case K_U32: case K_POW2: return sizeof(uint32_t);
	case K_MODE: return sizeof(unsigned);
	case K_U64: return sizeof(uint64_t);
	case K_SECONDS: case K_DOUBLE: return sizeof(double);
	default: return 0;
	}
}

static bool
str_same(const char *a, const char *b)
{
	return a == b || (a != NULL && b != NULL && strcmp(a, b) == 0);
}

static bool
key_same(const struct conf *a, const struct conf *b, const struct conf_key *k)
{
	const void *pa = field(a, k), *pb = field(b, k);

	if (k->type == K_NICS) {
		for (int i = 0; i < CONF_NICS; i++)
			if (!str_same(((char *const *)pa)[i], ((char *const *)pb)[i]))
				return false;
		return true;
	}
	if (k->type >= K_STR)
		return str_same(*(char *const *)pa, *(char *const *)pb);
	return memcmp(pa, pb, field_size(k->type)) == 0;
}

/* 0, or -1: out of memory (*dst then NULL). */
static int
str_copy(char **dst, const char *src)
{
	free(*dst);
	*dst = src != NULL ? strdup(src) : NULL;
	return src != NULL && *dst == NULL ? -1 : 0;
}

/* n's key takes old's value.  0, or -1: out of memory. */
static int
key_keep(const struct conf *old, struct conf *n, const struct conf_key *k)
{
	void *pn = field(n, k);
	const void *po = field(old, k);
	int r = 0;

	if (k->type == K_NICS)
		for (int i = 0; i < CONF_NICS; i++)
			r |= str_copy(&((char **)pn)[i], ((char *const *)po)[i]);
	else if (k->type >= K_STR)
		r = str_copy(pn, *(char *const *)po);
	else
		memcpy(pn, po, field_size(k->type));
	return r;
}

static void
list_add(char *list, size_t len, const char *sec, const char *name)
{
	size_t l = strlen(list);

	snprintf(list + l, len - l, "%s%s%s%s", l ? " " : "", sec, name ? "." : "", name ? name : "");
}

static bool
word_in(const char *words, const char *sec, const char *name)
{
	char w[96];
	size_t l = (size_t)snprintf(w, sizeof(w), "%s.%s", sec, name);

	for (const char *s = words; s != NULL && (s = strstr(s, w)) != NULL; s += l)
		if ((s == words || s[-1] == ' ') && (s[l] == '\0' || s[l] == ' '))
			return true;
	return false;
}

int
conf_diff(const struct conf *old, struct conf *n, const char *fixed, char *live, char *restart,
    char *overridden, size_t len)
{
	int r = 0;

	/* The fabric is started once: turned on or off, all of it waits for a restart. */
	bool fab_old = old->fabric_listen != NULL || old->fabric_peers != NULL || old->fabric_dial_on_demand;
	bool fab_new = n->fabric_listen != NULL || n->fabric_peers != NULL || n->fabric_dial_on_demand;

	live[0] = restart[0] = overridden[0] = '\0';
	for (const struct conf_key *k = conf_keys; k->sec != NULL; k++) {
		if (key_same(old, n, k))
			continue;
		if (word_in(fixed, k->sec, k->name)) {
			r |= key_keep(old, n, k);
			list_add(overridden, len, k->sec, k->name);
		} else if (k->when == CONF_RESTART || (fab_old != fab_new && strcmp(k->sec, "fabric") == 0)) {
			r |= key_keep(old, n, k);
			list_add(restart, len, k->sec, k->name);
		} else
			list_add(live, len, k->sec, k->name);
	}
	for (int i = 0; i < nsections; i++)
		if (sections[i].same != NULL && !sections[i].same(old, n))
			list_add(sections[i].live ? live : restart, len, sections[i].name, NULL);
	return r;
}
