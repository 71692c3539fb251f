/*
 * Unit tests of gpxd's configuration and export names (tests/unit.c runs them): the parser of
 * gpxd.conf (daemon/core/conf.c) with its defaults, errors that name the line, and limits; the
 * names and access rules of exports (daemon/client/export.c).
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "daemon/gpxd.h"
#include "daemon/client/client.h"
#include "daemon/cluster/cluster.h"
#include "tests/tap.h"
#include "tests/unit.h"

/* ---- conf.c ---- */

static const char *
conf_file(const char *text)
{
	static char path[128];
	static int n;
	FILE *f;

	snprintf(path, sizeof(path), "%s/gpxd-%d.conf", tmpdir, n++);
	if ((f = fopen(path, "w")) == NULL)
		tap_bail("cannot write %s", path);
	fputs(text, f);
	fclose(f);
	return path;
}

/* Loads text into a fresh conf; returns conf_load's result, the conf stays in *c. */
static int
load(struct conf *c, const char *text, char *err, size_t errlen)
{
	conf_defaults(c);
	return conf_load(c, conf_file(text), err, errlen);
}

static void test_conf_manual(void);
static void test_conf_section(void);

void
test_conf(void)
{
	struct conf c;
	char err[512];

	conf_defaults(&c);
	ok(strcmp(c.socket_path, GPX_DEFAULT_SOCKET) == 0 && c.socket_mode == 0660 && c.ring_entries == 4096 &&
	    c.workers == 2 && c.chunk_size == 2u << 20 && !c.trust_legacy_ipc && c.path == NULL,
	    "conf_defaults: documented defaults");
	conf_free(&c);

	int r = load(&c,
	    "# a comment\n"
	    "[daemon]\n"
	    "socket = /run/test/gpxd.sock\n"
	    "socket_mode = 0640\n"
	    "socket_group = gpx\n"
	    "admin_group = wheel\n"
	    "workers = 4\n"
	    "blocking_threads = 3\n"
	    "chunk_size = 4M\n"
	    "ring_entries = 1024\n"
	    "max_segments = 1000\n"
	    "log_level = debug\n"
	    "idle_timeout = 30\n"
	    "metrics = 127.0.0.1:9464\n"
	    "[cuda]\n"
	    "enable = no\n"
	    "trust_legacy_ipc = yes\n"
	    "sm_copy = off\n"
	    "sm_copy_blocks = 16\n"
	    "[limits]\n"
	    "connections_per_uid = 10\n"
	    "regions_per_uid = 100\n"
	    "region_bytes_per_uid = 2G\n"
	    "exports_per_uid = 5\n"
	    "inflight_per_uid = 1000\n", err, sizeof(err));
	ok(r == 0, "conf_load: a file setting every key loads (%s)", r ? err : "ok");
	ok(strcmp(c.socket_path, "/run/test/gpxd.sock") == 0 && c.socket_mode == 0640 &&
	    strcmp(c.socket_group, "gpx") == 0 && strcmp(c.admin_group, "wheel") == 0,
	    "conf_load: [daemon] socket, mode (octal), groups");
	ok(c.workers == 4 && c.blocking_threads == 3 && c.chunk_size == 4u << 20 && c.ring_entries == 1024 &&
	    c.max_segs == 1000 && strcmp(c.log_level, "debug") == 0 && c.idle_timeout_s == 30 &&
	    strcmp(c.metrics_listen, "127.0.0.1:9464") == 0, "conf_load: [daemon] numbers, with a size suffix");
	ok(!c.cuda && c.trust_legacy_ipc && !c.sm_copy && c.sm_copy_blocks == 16, "conf_load: [cuda] booleans");
	ok(c.max_conns_per_uid == 10 && c.max_regions_per_uid == 100 && c.max_region_bytes_per_uid == 2ULL << 30 &&
	    c.max_exports_per_uid == 5 && c.max_inflight_per_uid == 1000, "conf_load: [limits]");
	ok(c.path != NULL && strstr(c.path, tmpdir) == c.path, "conf_load: remembers the file it came from");
	conf_free(&c);

	static const struct {
		const char *text;
		uint64_t want;
	} sizes[] = {
		{ "[daemon]\nchunk_size = 64k\n", 64 << 10 },
		{ "[daemon]\nchunk_size = 64K\n", 64 << 10 },
		{ "[daemon]\nchunk_size = 1G\n", 1 << 30 },
		{ "[daemon]\nchunk_size = 8192\n", 8192 },
		{ "[daemon]\nchunk_size = 0x10000\n", 0x10000 },
		{ "[daemon]\nchunk_size = 3m\n", 3 << 20 },
	};
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		r = load(&c, sizes[i].text, err, sizeof(err));
		ok(r == 0 && c.chunk_size == sizes[i].want, "size suffix: %.*s -> %llu",
		    (int)strcspn(sizes[i].text + 9, "\n"), sizes[i].text + 9, (unsigned long long)sizes[i].want);
		conf_free(&c);
	}

	static const char *bad[] = {
		"[daemon]\nworkers = 0\n",
		"[daemon]\nworkers = 257\n",
		"[daemon]\nworkers = four\n",
		"[daemon]\nworkers = -1\n",
		"[daemon]\nworkers = 4X\n",
		"[daemon]\nworkers =\n",
		"[daemon]\nring_entries = 100\n",
		"[daemon]\nring_entries = 4\n",
		"[daemon]\nchunk_size = 1K\n",
		"[daemon]\nchunk_size = 2G\n",
		"[daemon]\nchunk_size = 99999999999999999G\n",
		"[daemon]\nchunk_size = 1.5M\n",
		"[daemon]\nsocket = relative/gpxd.sock\n",
		"[daemon]\nsocket_mode = 0999\n",
		"[daemon]\nsocket_mode = 1777\n",
		"[daemon]\nsocket_mode =\n",
		"[daemon]\nidle_timeout = 1.5\n",
		"[cuda]\nenable = maybe\n",
		"[limits]\nregion_bytes_per_uid = 18446744073709551616\n",
		"[limits]\nconnections_per_uid = 0\n",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		const char *kv = strchr(bad[i], '\n') + 1;
		int len = (int)strcspn(kv, "\n");
		r = load(&c, bad[i], err, sizeof(err));
		ok(r < 0 && strstr(err, ":2:") != NULL && strstr(err, "bad value") != NULL,
		    "bad value refused, naming line 2: %.*s (%s)", len, kv, r < 0 ? err : "accepted");
		conf_free(&c);
	}

	r = load(&c, "[daemon]\nworkers = 2\ncolour = blue\n", err, sizeof(err));
	ok(r < 0 && strstr(err, "unknown key 'colour'") != NULL && strstr(err, ":3:") != NULL,
	    "an unknown key is an error naming it and its line (%s)", err);
	conf_free(&c);
	r = load(&c, "[nonsense]\nworkers = 2\n", err, sizeof(err));
	ok(r < 0 && strstr(err, "unknown section [nonsense]") != NULL && strstr(err, ":1:") != NULL,
	    "a known key in an unknown section is an error naming the section and its line (%s)", err);
	conf_free(&c);
	r = load(&c, "[daemon\nworkers = 2\n", err, sizeof(err));
	ok(r < 0 && strstr(err, ":1:") != NULL, "a syntax error is an error naming its line (%s)", err);
	conf_free(&c);
	conf_defaults(&c);
	r = conf_load(&c, "/nonexistent/gpxd.conf", err, sizeof(err));
	ok(r < 0 && strstr(err, "/nonexistent/gpxd.conf") != NULL && strstr(err, strerror(ENOENT)) != NULL,
	    "a missing file is an error naming it (%s)", err);
	conf_free(&c);
	r = load(&c, "", err, sizeof(err));
	ok(r == 0 && c.ring_entries == 4096, "an empty file keeps the defaults");
	conf_free(&c);
	r = load(&c, "[daemon]\nmax_segments = 010\nchunk_size = 0x10000\n", err, sizeof(err));
	ok(r == 0 && c.max_segs == 10 && c.chunk_size == 0x10000, "numbers are decimal or 0x: 010 is ten");
	conf_free(&c);
	r = load(&c, "[daemon]\nworkers = 2\n[empty]\n", err, sizeof(err));
	ok(r < 0 && strstr(err, ":3:") != NULL && strstr(err, "unknown section [empty]") != NULL,
	    "an empty unknown section is an error naming its line (%s)", err);
	conf_free(&c);
	conf_defaults(&c);
	ok(c.sm_copy_blocks == 65535 && c.fabric_chunk == 1 << 20 && strcmp(c.log_level, "info") == 0,
	    "conf_defaults: sm_copy_blocks 65535 (a block for every 8 items), fabric chunk_size 1M, log_level info");
	conf_free(&c);
	test_conf_manual();
	test_conf_section();
}

/* ---- export.c ---- */

void
test_exports(void)
{
	char name[80];

	ok(export_name_ok("kv.cache/prefill-0:layer_3"), "export_name_ok: letters, digits and ._:/-");
	memset(name, 'a', 64);
	name[64] = '\0';
	ok(export_name_ok(name), "export_name_ok: 64 bytes");
	name[64] = 'a';
	name[65] = '\0';
	ok(!export_name_ok(name), "export_name_ok: 65 bytes refused");
	ok(!export_name_ok(""), "export_name_ok: empty refused");
	ok(!export_name_ok("a b"), "export_name_ok: space refused");
	ok(!export_name_ok("a\nb"), "export_name_ok: newline refused");
	ok(!export_name_ok("\"quote\""), "export_name_ok: quotes refused");
	ok(!export_name_ok("caf\xc3\xa9"), "export_name_ok: non-ASCII refused");
	ok(!export_name_ok("a%s"), "export_name_ok: '%%' refused");

	struct export e = { .uid = 1000, .gid = 0 };
	gid_t groups[2];
	struct creds c = { .uid = 1000, .gid = 1000, .groups = groups };
	e.rule = GPX__EXPORT_RULE__EXPORT_UID;
	ok(export_allows(&e, &c), "uid rule admits the owner's uid");
	c.uid = 1001;
	ok(!export_allows(&e, &c), "uid rule refuses another uid");
	c.uid = 0;
	ok(export_allows(&e, &c), "uid rule admits root");
	c.uid = 1001;
	e.rule = GPX__EXPORT_RULE__EXPORT_GID;
	e.gid = 2000;
	ok(!export_allows(&e, &c), "gid rule refuses a client outside the group");
	groups[0] = 3000;
	groups[1] = 2000;
	c.ngroups = 2;
	ok(export_allows(&e, &c), "gid rule admits a supplementary member");
	c.ngroups = 0;
	c.gid = 2000;
	ok(export_allows(&e, &c), "gid rule admits a primary member");
	c.gid = 1001;
	e.rule = GPX__EXPORT_RULE__EXPORT_ANY;
	ok(export_allows(&e, &c), "any rule admits anyone");
	e.rule = (Gpx__ExportRule)7;
	ok(!export_allows(&e, &c), "an unknown rule admits no one but the owner and root");
}

/* ---- gpxd.conf(5) against conf.c's table ---- */

/*
 * The text of one item of the manual (from its .It line to the next item, the end of its
 * list or its section), with the macros' names taken out: "Default:\n.Cm info ." becomes
 * "Default: info.".  Empty when the section has no such item.
 */
static void
man_item(char **lines, int n, const char *sec, const char *name, char *out, size_t len, int *pos)
{
	static const char *macros[] = { ".Cm", ".Pa", ".Li", ".Pq", ".Po", ".Pc", ".Ar", ".Ql", ".Xr", ".Sx",
	    ".Er", ".Dv", ".Op", ".Ic", ".Nm", ".Fl", ".Vt", ".Fn", "No", "Ns", "Cm", "Pa", "Li", "Ar", "Op", "Er" };
	char shead[64], item[96];
	int i = 0, depth = 0;
	size_t o = 0;

	out[0] = '\0';
	snprintf(shead, sizeof(shead), ".Sh %s SECTION", sec);
	for (char *p = shead + 4; *p; p++)
		*p = (char)toupper((unsigned char)*p);
	snprintf(item, sizeof(item), ".It Cm %s ", name);
	while (i < n && strcmp(lines[i], shead) != 0)
		i++;
	while (i < n && strncmp(lines[i], item, strlen(item)) != 0)
		if (++i < n && strncmp(lines[i], ".Sh", 3) == 0)
			return;
	/* items documented together (.It, .It, ..., then their text) share that text; *pos is
	 * this one's place among them */
	for (*pos = 0; i - *pos > 0 && strncmp(lines[i - *pos - 1], ".It Cm ", 7) == 0; (*pos)++)
		;
	for (i++; i < n && strncmp(lines[i], ".It Cm ", 7) == 0; i++)
		;
	for (; i < n; i++) {
		if (strncmp(lines[i], ".Bl", 3) == 0)
			depth++;
		if (strncmp(lines[i], ".El", 3) == 0 && depth-- == 0)
			break;
		if ((depth == 0 && strncmp(lines[i], ".It", 3) == 0) || strncmp(lines[i], ".Sh", 3) == 0)
			break;
		char word[256];
		for (const char *s = lines[i]; *s; ) {
			size_t wl = strcspn(s, " ");
			bool macro = false;
			snprintf(word, sizeof(word), "%.*s", (int)wl, s);
			for (size_t m = 0; m < sizeof(macros) / sizeof(macros[0]) && lines[i][0] == '.'; m++)
				macro |= strcmp(word, macros[m]) == 0;
			if (!macro && wl > 0) {
				/* a lone "." or "," closes the word before it */
				bool punct = (wl == 1 && (word[0] == '.' || word[0] == ',')) && o > 0;
				o += snprintf(out + o, o < len ? len - o : 0, "%s%s", punct || o == 0 ? "" : " ", word);
			}
			s += wl + (s[wl] == ' ');
		}
		if (o >= len)
			break;
	}
}

static void
test_conf_manual(void)
{
	const char *src = getenv("GPX_SRCDIR");
	char path[512], *text = NULL, *lines[4096], item[8192], want[256];
	int n = 0;
	size_t len = 0;
	FILE *f;

	snprintf(path, sizeof(path), "%s/man/gpxd.conf.5.in", src ? src : ".");
	if ((f = fopen(path, "re")) == NULL) {
		ok(0, "gpxd.conf(5): cannot read %s", path);
		return;
	}
	if (getdelim(&text, &len, '\0', f) < 0)
		tap_bail("reading %s", path);
	fclose(f);
	for (char *s = strtok(text, "\n"); s != NULL && n < 4096; s = strtok(NULL, "\n"))
		lines[n++] = s;

	for (const struct conf_key *k = conf_keys; k->sec != NULL; k++) {
		const char *name = k->type == K_NICS ? "nic_for_gpu0" : k->name;
		int pos = 0;
		man_item(lines, n, k->sec, name, item, sizeof(item), &pos);
		if (!ok(item[0] != '\0', "gpxd.conf(5) documents %s.%s", k->sec, name))
			continue;
		if (k->def != NULL) {
			/* "Default: 2M." or, for items documented together, "Defaults: 64M, 256M and ..." */
			const char *d = strstr(item, "Defaults: ");
			char nth[64] = "";
			snprintf(want, sizeof(want), "Default: %s.", k->def);
			/* the pos-th of "A, B, C and D." */
			for (int j = 0; d != NULL && j <= pos; j++) {
				d += j == 0 ? 10 : strncmp(d, " and ", 5) == 0 ? 5 : 2;
				size_t l = strcspn(d, ",.");
				const char *a = strstr(d, " and ");
				if (a != NULL && (size_t)(a - d) < l)
					l = (size_t)(a - d);
				snprintf(nth, sizeof(nth), "%.*s", (int)l, d);
				d += l;
			}
			ok(strstr(item, want) != NULL || strcmp(nth, k->def) == 0, "gpxd.conf(5): %s.%s: \"%s\"%s%s%s",
			    k->sec, name, want, nth[0] ? " (listed: " : "", nth, nth[0] ? ")" : "");
		} else
			ok(strstr(item, "Default:") != NULL, "gpxd.conf(5): %s.%s: says its default", k->sec, name);
		if (k->lo != NULL && k->hi != NULL) {
			snprintf(want, sizeof(want), "%s to %s", k->lo, k->hi);
			ok(strstr(item, want) != NULL, "gpxd.conf(5): %s.%s: the range \"%s\"", k->sec, name, want);
		}
		const char *when = k->when == CONF_LIVE ? "A reload applies" : "Changes take effect at restart.";
		ok(strstr(item, when) != NULL, "gpxd.conf(5): %s.%s: \"%s\"", k->sec, name, when);
	}
	/* and the other way: every key the manual documents is one gpxd reads */
	char sec[32] = "";
	for (int i = 0; i < n; i++) {
		char name[64];
		if (sscanf(lines[i], ".Sh %31s SECTION", sec) == 1 && strstr(lines[i], " SECTION") != NULL) {
			for (char *p = sec; *p; p++)
				*p = (char)tolower((unsigned char)*p);
			continue;
		}
		if (strncmp(lines[i], ".Sh", 3) == 0)
			sec[0] = '\0';
		if (sec[0] == '\0' || sscanf(lines[i], ".It Cm %63s", name) != 1 || strstr(lines[i], " = ") == NULL)
			continue;
		bool known = false;
		for (const struct conf_key *k = conf_keys; k->sec != NULL && !known; k++)
			known = strcmp(k->sec, sec) == 0 &&
			    strcmp(k->type == K_NICS ? "nic_for_gpu0" : k->name, name) == 0;
		if (strcmp(sec, "cluster") == 0) {
			/* parsed by daemon/cluster/conf.c: a key it knows refuses a bad value saying why */
			struct cluster_conf cc = { 0 };
			char why[160] = "";
			known = cluster_conf_key(&cc, name, "\x01", why, sizeof(why)) < 0 && why[0] != '\0';
			cluster_conf_free(&cc);
		}
		ok(known, "gpxd.conf(5) documents [%s] %s, a key gpxd reads", sec, name);
	}
	free(text);
}

/* ---- a section parsed by another file's code (conf_add_section) ---- */

/* The test section keeps its one key in max_segs; a real section adds fields of its own. */
static int
test_key(struct conf *c, const char *key, const char *v, char *why, size_t whylen)
{
	uint64_t n;

	if (strcmp(key, "size") != 0)
		return -1;                   /* why empty: an unknown key */
	if (conf_parse_u64(v, &n) < 0 || n == 0 || n > 100) {
		snprintf(why, whylen, "a number from 1 to 100");
		return -1;
	}
	c->max_segs = (uint32_t)n;
	return 0;
}

static bool
test_same(const struct conf *a, const struct conf *b)
{
	return a->max_segs == b->max_segs;
}

static void
test_conf_section(void)
{
	static const struct conf_section sec = { .name = "testsec", .key = test_key, .same = test_same };
	struct conf a, b;
	char err[512], live[512], restart[512], over[128];
	int r;

	ok(conf_add_section(&sec) == 0, "conf_add_section: a section of another file's code");
	r = load(&a, "[daemon]\nworkers = 2\n[testsec]\nsize = 7\n", err, sizeof(err));
	ok(r == 0 && a.max_segs == 7, "a registered section's key is parsed by its code (%s)", r ? err : "ok");
	conf_free(&a);
	r = load(&a, "[testsec]\n\nsize = 700\n", err, sizeof(err));
	ok(r < 0 && strstr(err, ":3:") != NULL && strstr(err, "bad value '700' for testsec.size: a number from 1 to 100"),
	    "its bad value names the line, the section and why (%s)", err);
	conf_free(&a);
	r = load(&a, "[testsec]\ncolour = red\n", err, sizeof(err));
	ok(r < 0 && strstr(err, ":2:") != NULL && strstr(err, "unknown key 'colour' in [testsec]"),
	    "its unknown key is an error (%s)", err);
	conf_free(&a);
	r = load(&a, "[testsec]\n", err, sizeof(err));
	ok(r == 0, "an empty registered section is no error");
	conf_free(&a);
	load(&a, "[testsec]\nsize = 7\n", err, sizeof(err));
	load(&b, "[testsec]\nsize = 9\n[daemon]\nworkers = 3\nidle_timeout = 5\n", err, sizeof(err));
	conf_diff(&a, &b, "", live, restart, over, sizeof(live));
	ok(strstr(live, "daemon.idle_timeout") != NULL && strstr(live, "workers") == NULL &&
	    strstr(restart, "daemon.workers") != NULL && strstr(restart, "testsec") != NULL && b.workers == 2,
	    "conf_diff: live and restart keys, the section named, restart values kept (live '%s', restart '%s')",
	    live, restart);
	conf_free(&a);
	conf_free(&b);
}
