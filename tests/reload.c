/*
 * Reloads against a real gpxd, on the host path:
 *
 *  - a storm: 300 reloads by SIGHUP, each waited for in the log, while clients copy between
 *    memfd regions (single copies and vectored ones) and check every byte; the files change
 *    every key a reload applies, and one in 25 holds a bad value that must be refused.  Run
 *    under ASan/UBSan (GPX_SANITIZE=1) this is what shows a snapshot freed under a thread.
 *    The log level alternates between info and debug with a filter, so that the workers,
 *    which ask the level and the filter at the end of every transfer, read them while
 *    reloads rewrite them: built with -fsanitize=thread (a build of its own, configured
 *    with CFLAGS and LDFLAGS -fsanitize=thread), gpxd then reports any such read that is
 *    not ordered with the write.
 *  - refused values: each bad value is refused with the file, its line and its key in the
 *    error, and the running configuration stays (its max_segments still admits a list that
 *    the refused file would have refused);
 *  - each key a reload applies, changed and seen to take effect (sm_copy and sm_copy_blocks
 *    act only on GPUs: tests/gpu/gpu-reload.c; fabric.timeout and retry_interval only with
 *    peers, which this does not have);
 *  - the reply of a reload: the keys applied and those waiting for a restart, whose running
 *    value stays.
 *
 * tests/gpu/gpu-reload.c is the same storm on GPU copies.
 */
#include "config.h"

#include <grp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

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
			/* fill_random writes words: from the word the span starts in */
			uint64_t a = so & ~(uint64_t)7, b = (so + len + 7) & ~(uint64_t)7;
			fill_random(s.p + a, (b < BUF_LEN ? b : BUF_LEN) - a, &seed);
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

/*
 * The i-th file of the storm: every key a reload applies moves; some files are bad.  The
 * debug filter names subsystems the copies never log, so the log stays short.
 */
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
	    (i % 4) * 250, i % 2 ? 3600 : 0, 4096 + i, i % 2 ? "info" : "debug region,export",
	    i % STORM_BAD_EVERY == STORM_BAD_EVERY - 1 ? "log_level = shouting\n" : "",
	    i % 3 ? "yes" : "no", 1 + i % 128, i % 2 ? "yes" : "no", 1024 + i, 256 + i, i % 2 ? 32 : 0);
	reload_write(&H, text);
}

static void
test_storm(void)
{
	struct copier w[COPIERS] = { 0 };
	pthread_t t[COPIERS];
	int seen = reload_count(&H), start = seen, lost;
	long copies = 0, wrong = 0, failed = 0;

	for (int i = 0; i < COPIERS; i++) {
		w[i].id = i;
		if (pthread_create(&t[i], NULL, copier_main, &w[i]) != 0)
			tap_bail("pthread_create");
	}
	lost = reload_storm(&H, &seen, STORM_RELOADS, storm_file);
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

	int refused = reload_refused(&H, "daemon.log_level");
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

/* ---- each key a reload applies, and its effect ---- */

static gpx_conn *admin_conn;

/* The file with text, reloaded by request: the reply, and whether key is among those applied. */
static bool
apply(const char *text, const char *key)
{
	char reply[1024], *a;
	int r;

	reload_write(&H, text);
	r = gpx_admin(admin_conn, GPX_ADMIN_RELOAD, 0, NULL, reply, sizeof(reply));
	if (r < 0) {
		diag("reload refused: %s", gpx_last_error(admin_conn));
		return false;
	}
	if ((a = strstr(reply, "\napplied ")) == NULL)
		return false;
	a[strcspn(a + 1, "\n") + 1] = '\0';
	return strstr(a, key) != NULL;
}

static long
log_size(void)
{
	struct stat st;

	return stat(H.log, &st) == 0 ? (long)st.st_size : -1;
}

/* Whether the daemon's log holds what after offset at. */
static bool
log_since(long at, const char *what)
{
	char line[2048];
	FILE *f = fopen(H.log, "re");
	bool found = false;

	if (f == NULL || fseek(f, at, SEEK_SET) < 0) {
		if (f != NULL)
			fclose(f);
		return false;
	}
	while (!found && fgets(line, sizeof(line), f) != NULL)
		found = strstr(line, what) != NULL;
	fclose(f);
	return found;
}

/* Runs fn as uid and gid nobody (65534) in a child: its exit status, or -1. */
static int
as_nobody(int (*fn)(void))
{
	pid_t p = fork();
	int st;

	if (p == 0) {
		if (setgroups(0, NULL) < 0 || setgid(65534) < 0 || setuid(65534) < 0)
			_exit(99);
		_exit(fn());
	}
	if (p < 0 || waitpid(p, &st, 0) < 0 || !WIFEXITED(st))
		return -1;
	return WEXITSTATUS(st);
}

/* As nobody: 0 when an administrative request (the log level) is answered, 1 when refused. */
static int
nobody_admin(void)
{
	gpx_conn *c;
	char lvl[64];

	if (gpx_connect(H.sock, "reload-nobody", &c) < 0)
		return 2;
	int r = gpx_admin(c, GPX_ADMIN_LOG_LEVEL, 0, NULL, lvl, sizeof(lvl));
	gpx_close(c);
	return r == 0 ? 0 : r == -GPX_EPERM ? 1 : 3;
}

/* As nobody: 0 when a second connection that has not said Hello is refused with EBUSY. */
static int
nobody_hellos(void)
{
	int a = harness_connect(&H), b = harness_connect(&H);
	bool eof = false;
	Gpx__DaemonMsg *m = harness_recv(b, 5000, NULL, NULL, &eof);
	int r = m != NULL && m->reply->status == GPX__STATUS__EBUSY ? 0 : 1;

	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	close(a);
	close(b);
	return r;
}

/* gpxd's CPU time over the second after one request, in ticks. */
static long
cpu_after_request(void)
{
	long t0 = reload_cpu_ticks(&H);

	harness_clients(&H);
	usleep(1000000);
	return reload_cpu_ticks(&H) - t0;
}

/* A TCP port of 127.0.0.1 that nothing listens on now. */
static int
free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t l = sizeof(a);
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), port = 0;

	if (s >= 0 && bind(s, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    getsockname(s, (struct sockaddr *)&a, &l) == 0)
		port = ntohs(a.sin_port);
	if (s >= 0)
		close(s);
	return port;
}

/* Whether GET /metrics on addr:port answers 200. */
static bool
metrics_up(in_addr_t addr, int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = addr };
	char buf[64] = "";
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	bool up = false;

	if (s >= 0 && connect(s, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    write(s, "GET /metrics HTTP/1.0\r\n\r\n", 25) == 25 && read(s, buf, sizeof(buf) - 1) > 12)
		up = strncmp(buf, "HTTP/1.1 200", 12) == 0 || strncmp(buf, "HTTP/1.0 200", 12) == 0;
	if (s >= 0)
		close(s);
	return up;
}

/* A legacy IPC handle's Register: the status of the reply. */
static int
register_legacy(void)
{
	Gpx__DaemonMsg *r = harness_register_legacy(&H);
	int st = r != NULL ? (int)r->reply->status : -1;

	if (r != NULL)
		gpx__daemon_msg__free_unpacked(r, NULL);
	return st;
}

static void
test_live(void)
{
	char text[512];
	struct buf b[3];
	gpx_conn *c;
	int seen, r;

	if ((admin_conn = client("reload-admin")) == NULL)
		tap_bail("live: no connection");
	for (int i = 0; i < 3; i++)
		if (buf_new(&b[i], i == 2 ? 128 << 10 : 32 << 10) < 0)
			tap_bail("live: memfd");

	/* [daemon] */
	/* a connection learns max_segments in its Welcome: this one comes after the reload */
	bool on = apply("max_segments = 50\n", "daemon.max_segments");
	if ((c = client("reload-live")) == NULL)
		tap_bail("live: no connection");
	if (buf_reg(c, &b[0], 0) < 0 || buf_reg(c, &b[1], 0) < 0)
		tap_bail("live: register: %s", gpx_last_error(c));
	int r50 = copyv_n(c, b[0].r, b[1].r, 50), r51 = copyv_n(c, b[0].r, b[1].r, 51);
	ok(on && r50 == 0 && r51 < 0, "live: max_segments = 50 admits 50 segments (%d), refuses 51 (%d: %s)", r50, r51,
	    gpx_last_error(c));
	long at = log_size();
	ok(apply("log_level = debug\n", "daemon.log_level") && harness_clients(&H) >= 0 &&
	    log_since(at, "gpxd: conn: client"), "live: log_level = debug logs debug lines");
	ok(apply("log_level = warning\n", "daemon.log_level") && (at = log_size()) > 0 && harness_clients(&H) >= 0 &&
	    !log_since(at, "gpxd: conn: client"), "live: log_level = warning logs none");
	apply("", "daemon.log_level");

	on = apply("busy_poll_us = 1000000\n", "daemon.busy_poll_us");
	long spin = cpu_after_request();
	/* a polling loop takes what CPU it gets (on a busy machine, little); a sleeping one none */
	ok(on && spin >= 5, "live: busy_poll_us = 1000000: the loop polls after a request (%ld ticks of CPU "
	    "in 1 s)", spin);
	on = apply("busy_poll_us = 0\n", "daemon.busy_poll_us");
	long idle = cpu_after_request();
	ok(on && idle <= 3, "live: busy_poll_us = 0: the loop sleeps after a request (%ld ticks of CPU in 1 s)",
	    idle);

	int port = free_port(), port2 = free_port();
	snprintf(text, sizeof(text), "metrics = 127.0.0.1:%d\n", port);
	ok(apply(text, "daemon.metrics") && metrics_up(htonl(INADDR_LOOPBACK), port),
	    "live: metrics = 127.0.0.1:%d serves /metrics", port);
	snprintf(text, sizeof(text), "metrics = 0.0.0.0:%d\nmetrics_allow_remote = yes\n", port2);
	ok(apply(text, "daemon.metrics_allow_remote") && metrics_up(htonl(INADDR_LOOPBACK), port2) &&
	    !metrics_up(htonl(INADDR_LOOPBACK), port), "live: metrics_allow_remote = yes serves on 0.0.0.0:%d", port2);
	snprintf(text, sizeof(text), "metrics = 0.0.0.0:%d\nmetrics_allow_remote = no\n", port2);
	reload_write(&H, text);
	r = gpx_admin(admin_conn, GPX_ADMIN_RELOAD, 0, NULL, NULL, 0);
	ok(r < 0 && strstr(gpx_last_error(admin_conn), "daemon.metrics") != NULL && metrics_up(htonl(INADDR_LOOPBACK), port2),
	    "live: metrics_allow_remote = no with 0.0.0.0 is refused, the endpoint kept (%s)", gpx_last_error(admin_conn));
	ok(apply("", "daemon.metrics") && !metrics_up(htonl(INADDR_LOOPBACK), port2),
	    "live: no metrics closes the endpoint");

	ok(apply("admin_group = gpx-test-no-such-group\n", "daemon.admin_group") && as_nobody(nobody_admin) == 1,
	    "live: admin_group without nobody's group: nobody's administrative request is refused");
	struct group *g = getgrgid(65534);
	snprintf(text, sizeof(text), "admin_group = %s\n", g ? g->gr_name : "nogroup");
	ok(apply(text, "daemon.admin_group") && as_nobody(nobody_admin) == 0,
	    "live: admin_group = %s: nobody may make administrative requests", g ? g->gr_name : "nogroup");

	/* The baseline once the connections of the checks above are all gone from gpxd. */
	int fds = harness_fds(&H);
	for (int i = 0, was = -1; fds != was && i < 20; i++) {
		was = fds;
		usleep(100000);
		fds = harness_fds(&H);
	}
	ok(apply("[limits]\nreserved_fds = 100\n", "limits.reserved_fds") &&
	    harness_wait_fds(&H, fds + 68, 5000) == fds + 68, "live: reserved_fds = 100: gpxd holds 68 more descriptors");
	ok(apply("", "limits.reserved_fds") && harness_wait_fds(&H, fds, 5000) == fds,
	    "live: reserved_fds = 32 again: it gives them back");

	/* [cuda] */
	int before = register_legacy();
	on = apply("[cuda]\ntrust_legacy_ipc = yes\n", "cuda.trust_legacy_ipc");
	r = register_legacy();
	ok(before == GPX__STATUS__EACCES && on && r != GPX__STATUS__EACCES && r >= 0,
	    "live: trust_legacy_ipc = yes: a legacy IPC handle is no longer refused as untrusted (status %d, "
	    "then %d)", before, r);

	/* [limits]: root is counted like anyone; the admin and live connections are two */
	gpx_conn *more[2] = { NULL, NULL };
	ok(apply("[limits]\nconnections_per_uid = 3\n", "limits.connections_per_uid") &&
	    gpx_connect(H.sock, "reload-3", &more[0]) == 0 && gpx_connect(H.sock, "reload-4", &more[1]) == -GPX_EQUOTA,
	    "live: connections_per_uid = 3: the third connects, the fourth is refused");
	for (int i = 0; i < 2; i++)
		if (more[i] != NULL)
			gpx_close(more[i]);
	/* two regions of this uid are registered: b[0] and b[1] */
	ok(apply("[limits]\nregions_per_uid = 2\n", "limits.regions_per_uid") && buf_reg(c, &b[2], 0) == -GPX_EQUOTA,
	    "live: regions_per_uid = 2: a third region is refused");
	ok(apply("[limits]\nregion_bytes_per_uid = 96K\n", "limits.region_bytes_per_uid") &&
	    buf_reg(c, &b[2], 0) == -GPX_EQUOTA, "live: region_bytes_per_uid = 96K: 128K more is refused");
	ok(apply("[limits]\nregion_bytes_per_uid = 192K\n", "limits.region_bytes_per_uid") &&
	    buf_reg(c, &b[2], 0) == 0, "live: region_bytes_per_uid = 192K: then it is taken");
	struct gpx_export_opts eo = { .rule = GPX_EXPORT_UID };
	ok(apply("[limits]\nexports_per_uid = 0\n", "limits.exports_per_uid") &&
	    gpx_export(c, b[0].r, "reload.live", &eo) == -GPX_EQUOTA, "live: exports_per_uid = 0: an export is refused");
	ok(apply("[limits]\nexports_per_uid = 1\n", "limits.exports_per_uid") && gpx_export(c, b[0].r, "reload.live", &eo) == 0,
	    "live: exports_per_uid = 1: then it is taken");
	/* one transfer in flight per uid: of 32 copies submitted at once, some are refused as busy */
	int busy = 0;
	struct buf big;
	if (buf_new(&big, 32 << 20) < 0 || buf_reg(c, &big, 0) < 0)
		tap_bail("live: 32 MiB: %s", gpx_last_error(c));
	on = apply("[limits]\ninflight_per_uid = 1\n", "limits.inflight_per_uid");
	for (int i = 0; i < 32; i++)
		gpx_copy(c, big.r, 0, big.r, 16 << 20, 16 << 20, 5000 + i);
	for (int i = 0; i < 32; i++)
		busy += wait_tag(c, 5000 + i, NULL) == -GPX_EBUSY;
	ok(on && busy > 0, "live: inflight_per_uid = 1: %d of 32 copies of 16 MiB submitted at once were refused "
	    "as busy", busy);
	gpx_deregister(c, big.r);
	buf_free(&big);
	ok(apply("[limits]\nhello_max = 1\n", "limits.hello_max") && as_nobody(nobody_hellos) == 0,
	    "live: hello_max = 1: nobody's second connection without Hello is refused as busy");

	/* budgets: a list of 4096 segments (96K of the daemon's memory) over a 64K request budget */
	gpx_conn *c2 = client("reload-budget");
	struct buf x, y;
	if (c2 == NULL || buf_new(&x, 8192) < 0 || buf_new(&y, 8192) < 0 || buf_reg(c2, &x, 0) < 0 ||
	    buf_reg(c2, &y, 0) < 0)
		tap_bail("live: budget client");
	on = apply("[limits]\nrequest_budget = 64K\n", "limits.request_budget");
	r = copyv_n(c2, x.r, y.r, 4096);
	ok(on && r == -GPX_ENOMEM, "live: request_budget = 64K: a list of 4096 segments is refused as too large "
	    "(%s)", gpx_strerror(r));
	on = apply("", "limits.request_budget");
	r = copyv_n(c2, x.r, y.r, 4096);
	ok(on && r == 0, "live: request_budget = 64M again: the same list is taken (%s)", gpx_strerror(r));
	gpx_close(c2);
	buf_free(&x);
	buf_free(&y);

	/* [daemon] idle_timeout last: it closes the admin connection too */
	int s = harness_connect(&H);
	Gpx__DaemonMsg *m = s >= 0 ? harness_hello(s, GPX_PROTO_VERSION, -1, NULL) : NULL;
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	ok(apply("idle_timeout = 1\n", "daemon.idle_timeout") && harness_wait_eof(s, 5000),
	    "live: idle_timeout = 1 closes an idle connection");
	close(s);
	seen = reload_count(&H);
	reload_write(&H, "");
	ok(reload_hup(&H, &seen), "live: back to the harness's file");
	gpx_close(c);
	gpx_close(admin_conn);
	for (int i = 0; i < 3; i++)
		buf_free(&b[i]);
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
	ok(r == 0 && strstr(reply, "\napplied daemon.idle_timeout cuda.sm_copy_blocks fabric.retry_interval\n") != NULL,
	    "reply: lists the keys applied");
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
	test_live();
	test_reply();
	ok(harness_stop(&H) == 0, "gpxd stops cleanly");
	return finish();
}
