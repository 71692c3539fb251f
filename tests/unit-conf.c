/*
 * Unit tests of gpxd's configuration and export names (tests/unit.c runs them): the parser of
 * gpxd.conf (daemon/conf.c) with its defaults, errors that name the line, and limits; the
 * names and access rules of exports (daemon/export.c).
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "daemon/gpxd.h"
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
