/*
 * Reloads against a real gpxd, on the host path:
 *
 *  - a storm: 300 reloads by SIGHUP, each waited for in the log, while clients copy between
 *    memfd regions (single copies and vectored ones) and check every byte; the files change
 *    every key a reload applies, and one in 25 holds a bad value that must be refused.  Run
 *    under ASan/UBSan (GPX_SANITIZE=1) this is what shows a snapshot freed under a thread.
 *  - refused values: each bad value is refused with the file, its line and its key in the
 *    error, and the running configuration stays (its max_segments still admits a list that
 *    the refused file would have refused);
 *  - the reply of a reload: the keys applied and those waiting for a restart, whose running
 *    value stays.
 *
 * tests/gpu/gpu-reload.c is the same storm on GPU copies.
 */
#include "config.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/reload-util.h"
#include "tests/tap.h"
#include "tests/tclient.h"

struct harness H;

#define STORM_RELOADS 300
#define STORM_BAD_EVERY 25
#define BUF_LEN (4u << 20)
#define COPIERS 2

static atomic_bool storm_over;

struct copier {
	int id;
	long copies, wrong, failed;
	char why[256];
};

/* One client copying until the storm is over: random spans, every byte checked. */
static void *
copier_main(void *arg)
{
	struct copier *w = arg;
	uint64_t seed = 0x9e3779b97f4a7c15ULL * (w->id + 1);
	struct buf s, d;
	struct gpx_seg segs[256];
	gpx_conn *c = client("reload-storm");

	if (c == NULL || buf_new(&s, BUF_LEN) < 0 || buf_new(&d, BUF_LEN) < 0 || buf_reg(c, &s, 0) < 0 ||
	    buf_reg(c, &d, 0) < 0) {
		snprintf(w->why, sizeof(w->why), "setup: %s", c ? gpx_last_error(c) : "no connection");
		w->failed++;
		return NULL;
	}
	for (uint64_t tag = 1; !atomic_load(&storm_over); tag++) {
		int r;
		if (tag % 2) {
			/* one copy of a random span, 1 byte to 4 MiB: up to 64 chunks of 64K */
			uint64_t len = 1 + rnd(&seed) % BUF_LEN;
			uint64_t so = rnd(&seed) % (BUF_LEN - len + 1), dof = rnd(&seed) % (BUF_LEN - len + 1);
			fill_random(s.p + so, len, &seed);
			r = gpx_copy_sync(c, s.r, so, d.r, dof, len);
			if (r == 0 && memcmp(s.p + so, d.p + dof, len) != 0)
				w->wrong++;
		} else {
			/* 256 segments of up to 8K, disjoint on both sides */
			fill_random(s.p, BUF_LEN, &seed);
			for (int i = 0; i < 256; i++) {
				uint64_t len = 1 + rnd(&seed) % 8192;
				segs[i] = (struct gpx_seg){ (uint64_t)i * 16384, (uint64_t)(255 - i) * 16384, len };
			}
			r = gpx_copyv(c, s.r, d.r, segs, 256, tag);
			if (r >= 0)
				r = wait_tag(c, tag, NULL);
			for (int i = 0; r == 0 && i < 256; i++)
				if (memcmp(s.p + segs[i].src_offset, d.p + segs[i].dst_offset, segs[i].length) != 0) {
					w->wrong++;
					break;
				}
		}
		if (r < 0) {
			if (w->failed++ == 0)
				snprintf(w->why, sizeof(w->why), "%s: %s", gpx_strerror(r), gpx_last_error(c));
		} else
			w->copies++;
	}
	gpx_close(c);
	buf_free(&s);
	buf_free(&d);
	return NULL;
}

/* The i-th file of the storm: every key a reload applies moves; some files are bad. */
static void
storm_file(int i)
{
	char text[1024];

	snprintf(text, sizeof(text),
	    "busy_poll_us = %d\n"
	    "idle_timeout = %d\n"
	    "max_segments = %d\n"
	    "log_level = %s\n"
	    "%s"
	    "[cuda]\n"
	    "sm_copy = %s\n"
	    "sm_copy_blocks = %d\n"
	    "trust_legacy_ipc = %s\n"
	    "[limits]\n"
	    "inflight_per_uid = %d\n"
	    "regions_per_uid = %d\n"
	    "reserved_fds = %d\n",
	    (i % 4) * 250, i % 2 ? 3600 : 0, 4096 + i, i % 2 ? "info" : "info conn,engine",
	    i % STORM_BAD_EVERY == STORM_BAD_EVERY - 1 ? "log_level = shouting\n" : "",
	    i % 3 ? "yes" : "no", 1 + i % 128, i % 2 ? "yes" : "no", 1024 + i, 256 + i, i % 2 ? 32 : 0);
	reload_write(&H, text);
}

static void
test_storm(void)
{
	struct copier w[COPIERS] = { 0 };
	pthread_t t[COPIERS];
	int seen = reload_count(&H), start = seen, lost = 0;
	long copies = 0, wrong = 0, failed = 0;

	for (int i = 0; i < COPIERS; i++) {
		w[i].id = i;
		if (pthread_create(&t[i], NULL, copier_main, &w[i]) != 0)
			tap_bail("pthread_create");
	}
	for (int i = 0; i < STORM_RELOADS; i++) {
		storm_file(i);
		if (!reload_hup(&H, &seen))
			lost++;
	}
	atomic_store(&storm_over, true);
	for (int i = 0; i < COPIERS; i++) {
		pthread_join(t[i], NULL);
		copies += w[i].copies;
		wrong += w[i].wrong;
		failed += w[i].failed;
		if (w[i].failed)
			diag("copier %d: %ld failed, first: %s", i, w[i].failed, w[i].why);
	}
	ok(lost == 0 && seen - start == STORM_RELOADS, "storm: %d reloads by SIGHUP, each answered in the log "
	    "(%d answered, %d lost)", STORM_RELOADS, seen - start, lost);
	ok(copies > 0 && wrong == 0 && failed == 0, "storm: %ld copies during the reloads, %ld with wrong bytes, "
	    "%ld failed", copies, wrong, failed);

	int refused = 0;
	char line[2048];
	FILE *f = fopen(H.log, "re");
	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		refused += strstr(line, "reload refused") != NULL && strstr(line, "daemon.log_level") != NULL;
	if (f != NULL)
		fclose(f);
	ok(refused == STORM_RELOADS / STORM_BAD_EVERY, "storm: the %d bad files were refused, naming the key (%d)",
	    STORM_RELOADS / STORM_BAD_EVERY, refused);
	ok(harness_clients(&H) == 1, "storm: gpxd still answers, with no client left");
}

/* ---- refused values ---- */

static int
lines_in(const char *s)
{
	int n = 0;

	for (; *s; s++)
		n += *s == '\n';
	return n;
}

/* A copyv of n one-byte segments: 0 when gpxd took and completed it. */
static int
copyv_n(gpx_conn *c, gpx_region s, gpx_region d, int n)
{
	struct gpx_seg *segs = calloc(n, sizeof(*segs));
	static uint64_t tag = 1 << 20;
	int r;

	for (int i = 0; i < n; i++)
		segs[i] = (struct gpx_seg){ i, i, 1 };
	r = gpx_copyv(c, s, d, segs, n, ++tag);
	if (r >= 0)
		r = wait_tag(c, tag, NULL);
	free(segs);
	return r;
}

static void
test_refused(void)
{
	char key_open[128], text[1024], reply[1024], want[160];
	struct buf s, d;
	gpx_conn *c = client("reload-refused");
	FILE *f;

	snprintf(key_open, sizeof(key_open), "%s/open.key", H.dir);
	if ((f = fopen(key_open, "w")) == NULL)
		tap_bail("cannot write %s", key_open);
	fputs("0123456789abcdef0123456789abcdef\n", f);
	fclose(f);
	chmod(key_open, 0644);
	if (c == NULL || buf_new(&s, 4096) < 0 || buf_new(&d, 4096) < 0 || buf_reg(c, &s, 0) < 0 ||
	    buf_reg(c, &d, 0) < 0)
		tap_bail("refused: setup");

	/* The running configuration admits 100 segments; each bad file would admit 5. */
	reload_write(&H, "max_segments = 100\n");
	int r = gpx_admin(c, GPX_ADMIN_RELOAD, 0, NULL, reply, sizeof(reply));
	ok(r == 0 && copyv_n(c, s.r, d.r, 100) == 0 && copyv_n(c, s.r, d.r, 101) < 0,
	    "refused: a good file applies max_segments = 100 (%s)", r < 0 ? gpx_last_error(c) : "ok");

	static const struct {
		const char *text;
		int line;             /* of the text, the one the error must name */
		const char *key;      /* what the error must name */
	} bad[] = {
		{ "log_level = shouting\n", 1, "daemon.log_level" },
		{ "log_level = info engine extra\n", 1, "daemon.log_level" },
		{ "metrics = here\n", 1, "daemon.metrics" },
		{ "metrics = 0.0.0.0:9464\n", 1, "daemon.metrics" },
		{ "workers = 0\n", 1, "daemon.workers" },
		{ "chunk_size = 1.5M\n", 1, "daemon.chunk_size" },
		{ "ring_entries = 100\n", 1, "daemon.ring_entries" },
		{ "socket = relative.sock\n", 1, "daemon.socket" },
		{ "socket_mode = 0999\n", 1, "daemon.socket_mode" },
		{ "max_segments = 010x\n", 1, "daemon.max_segments" },
		{ "[cuda]\nsm_copy_blocks = 0\n", 2, "cuda.sm_copy_blocks" },
		{ "[cuda]\nsm_copy_blocks = 65536\n", 2, "cuda.sm_copy_blocks" },
		{ "[cuda]\nsm_copy = maybe\n", 2, "cuda.sm_copy" },
		{ "[limits]\nreserved_fds = 1025\n", 2, "limits.reserved_fds" },
		{ "[limits]\nhello_max = 0\n", 2, "limits.hello_max" },
		{ "[fabric]\nnode = two words\n", 2, "fabric.node" },
		{ "[fabric]\ntransport = pigeon\n", 2, "fabric.transport" },
		{ "[fabric]\nlisten = 127.0.0.1\n", 2, "fabric.listen" },
		{ "[fabric]\npeers = a:1,b\n", 2, "fabric.peers" },
		{ "[fabric]\nkey_file = relative.key\n", 2, "fabric.key_file" },
		{ "[fabric]\ntimeout = 0\n", 2, "fabric.timeout" },
		{ "[fabric]\nnic_for_gpu16 = mlx5_0\n", 2, "nic_for_gpu16" },
		{ "[fabric]\nlisten = 127.0.0.1:0\n", 2, "key_file is required" },
		{ "[fabric]\nlisten = 127.0.0.1:0\nkey_file = %s\n", 3, "fabric.key_file" },
		{ "[colour]\n", 1, "unknown section [colour]" },
		{ "colour = blue\n", 1, "unknown key 'colour'" },
	};
	int base = lines_in(reload_base) + 1;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char body[512];
		snprintf(body, sizeof(body), bad[i].text, key_open);
		snprintf(text, sizeof(text), "max_segments = 5\n%s", body);
		reload_write(&H, text);
		r = gpx_admin(c, GPX_ADMIN_RELOAD, 0, NULL, reply, sizeof(reply));
		const char *err = gpx_last_error(c);
		snprintf(want, sizeof(want), "%s:%d:", H.conf, base + bad[i].line);
		ok(r == -GPX_EINVAL && strstr(err, want) != NULL && strstr(err, bad[i].key) != NULL,
		    "refused: %.*s: the error names %s, line %d and %s (%s)", (int)strcspn(body + (bad[i].line > 1 ?
		    strcspn(body, "\n") + 1 : 0), "\n"), body + (bad[i].line > 1 ? strcspn(body, "\n") + 1 : 0),
		    "the file", base + bad[i].line, bad[i].key, r == 0 ? "accepted" : err);
		ok(copyv_n(c, s.r, d.r, 100) == 0, "refused: %s: the running max_segments (100) stays", bad[i].key);
	}
	/* Numbers are decimal unless 0x: "010" is ten, as gpxd.conf(5) says, not eight. */
	reload_write(&H, "max_segments = 010\n");
	r = gpx_admin(c, GPX_ADMIN_RELOAD, 0, NULL, reply, sizeof(reply));
	ok(r == 0 && copyv_n(c, s.r, d.r, 10) == 0 && copyv_n(c, s.r, d.r, 11) < 0,
	    "max_segments = 010 is ten segments, not eight");
	gpx_close(c);
	buf_free(&s);
	buf_free(&d);
}

/* ---- the reply ---- */

static void status_json(char *out, size_t len);

static void
test_reply(void)
{
	char reply[1024], want[300];
	gpx_conn *c = client("reload-reply");
	int r;

	if (c == NULL)
		tap_bail("reply: no connection");
	reload_write(&H, "workers = 3\nchunk_size = 128K\nidle_timeout = 600\n[cuda]\nsm_copy_blocks = 7\n"
	    "[fabric]\nretry_interval = 5\n");
	r = gpx_admin(c, GPX_ADMIN_RELOAD, 0, NULL, reply, sizeof(reply));
	snprintf(want, sizeof(want), "from %s\n", H.conf);
	ok(r == 0 && strncmp(reply, want, strlen(want)) == 0, "reply: names the file (%s)", reply);
	ok(r == 0 && strstr(reply, "\napplied daemon.max_segments daemon.idle_timeout cuda.sm_copy_blocks "
	    "fabric.retry_interval\n") != NULL, "reply: lists the keys applied");
	ok(r == 0 && strstr(reply, "\nrestart daemon.workers daemon.chunk_size\n") != NULL,
	    "reply: lists the keys that wait for a restart");
	char st[4096];
	status_json(st, sizeof(st));
	ok(strstr(st, "\"workers\":2,") != NULL && strstr(st, "\"chunk_size\":65536,") != NULL,
	    "reply: workers and chunk_size keep their running values until a restart");
	/* -s is given by the harness: the file's socket is not used, and the reply says so. */
	reload_write(&H, "socket = /nonexistent/gpxd.sock\n");
	r = gpx_admin(c, GPX_ADMIN_RELOAD, 0, NULL, reply, sizeof(reply));
	ok(r == 0 && strstr(reply, "\ncommand-line daemon.socket") != NULL && strstr(reply, "\nrestart \n") != NULL,
	    "reply: a socket in the file that -s overrides is listed as the command line's, not as a restart");
	gpx_close(c);
}

/* What `gpxctl -j status` prints, or "". */
static void
status_json(char *out, size_t len)
{
	char cmd[300];
	FILE *p;
	size_t n = 0;

	snprintf(cmd, sizeof(cmd), "'%s' -j -s '%s' status", getenv("GPXCTL"), H.sock);
	if ((p = popen(cmd, "r")) != NULL) {
		n = fread(out, 1, len - 1, p);
		pclose(p);
	}
	out[n] = '\0';
}

int
main(void)
{
	start_gpxd();
	reload_init(&H);
	test_storm();
	test_refused();
	test_reply();
	ok(harness_stop(&H) == 0, "gpxd stops cleanly");
	return finish();
}
