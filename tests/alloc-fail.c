/*
 * gpxd when one of its allocations fails (tests/failalloc.c, preloaded into gpxd, fails the
 * one allocation it is told to).  For each kind of query gpxctl makes, and each kind of
 * request a client makes (connect, register, copies of every shape, export and import), the
 * first, second, third ... allocation gpxd makes for it fails in turn, until one needs fewer
 * allocations than that: each time the request ends whole (a query's reply decodes with every
 * entry an unarmed one has, a copy's bytes are in place) or refused ENOMEM, never left without an answer and never cut short;
 * gpxd lives on, the same request unarmed ends whole after, and at the end gpxd holds no
 * descriptor more than before.  For the queries a client holds 40 regions, an export and a
 * copy of 1 TiB in flight, so that the lists are long enough to grow and the regions' reply
 * too large for the stack buffer of its send, and gpxd has a fabric with one peer down.
 * Across the fabric, a second gpxd B (unarmed, peered over TCP with the same key): this gpxd
 * exports a region to the fabric and B's client imports it and copies into and out of it, then
 * this gpxd's client imports B's export by "NODE:name" and copies both ways, each copy that
 * says 0 checked byte for byte; at the end B counts no importer of its export (every Release
 * came).
 *
 * With --cluster (tests/alloc-fail-cluster.test, which starts an etcd and names it in
 * GPX_ETCD): this gpxd (A) and an unarmed one (B) are nodes of that etcd, with leases of 300 s
 * (no keep-alive within a check).  gpxctl cluster's query is whole only with every node and
 * each lease's time left fresh (a node key "ghost", put again under a lease of a new TTL
 * before each armed query, must show that TTL); an export to the cluster is whole only with
 * its name in etcd, imported by the bare name on B and copied both ways, refused only with
 * the name not left in etcd, and its unexport must take the name out of etcd; A imports B's
 * cluster name by the bare name and copies both ways.  Before those, gpxd started again and
 * again as a node of that etcd (keys under a prefix of their own), with its 1st, 2nd, ...
 * allocation below cluster_start failing (tests/failalloc.c's GPX_FAILALLOC_UNDER): each
 * of the first 80 but libcurl's global setup's (thousands of OpenSSL's), then every 7th, and
 * every 211th of them all, libcurl's among them (each start takes up to a second: all would
 * take many minutes); each start either comes up, joins the cluster with its record whole
 * and stops cleanly, or exits non-zero with a line saying it found no memory, never by a
 * signal, and etcd is left no node's record cut short.  After A's checks, a third gpxd C whose
 * allocations count only below kv_seen (a key of a range or of the watch), connected with B
 * by an import: a key of its watch finds no memory (ghost's, put again), which has every key
 * read again, with C's 1st, 2nd, ... allocation in that range failing in turn
 * (tests/failalloc.c's second count): C takes no node for gone and its connection with B
 * stands, the same epoch.
 *
 * The admin group's lookup (without --cluster): a gpxd of its own whose getgrnam finds no
 * memory when armed (glibc's finds the group all the same after any one failed allocation,
 * so every allocation below it fails: GPX_FAILALLOC_ALL_UNDER).  admin_group changed by a
 * reload while armed: the new group's member is refused ENOMEM, not EPERM, and answered on
 * the same connection once memory is back; the old group's member is refused.  Not covered:
 * the lookup made again after a minute under the same name (the test would wait a minute).
 *
 * Skipped in a sanitizer build, whose runtime must come first in gpxd's libraries.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/wait.h>
#include <grp.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/util.h"

#define NREGIONS 40
#define TRIES_MAX 200
static int tries_max = TRIES_MAX;         /* the cluster's requests make more (curl's) */
#define BUSY_LEN (16u << 20)
#define BUSY_SEGS 65536                   /* of BUSY_LEN each: a copy of 1 TiB, minutes long */
#define BUSY_TAG 4242

static _Atomic int32_t *countdown;
static const char *volatile asking = "none";     /* the kind of query in flight */
static volatile int failing;                      /* and the allocation of gpxd's failed in it */

/* A query left without an answer hangs in gpx_query: the test bails out naming it. */
static void
on_alarm(int sig)
{
	static const char head[] = "Bail out! no answer within 60 s to a query of kind ";
	const char *k = asking;
	char n[40];

	(void)sig;
	snprintf(n, sizeof(n), " (allocation %d failed)\n", failing);   /* (no lock taken: safe here) */
	if (write(1, head, sizeof(head) - 1) < 0 || write(1, k, strlen(k)) < 0 || write(1, n, strlen(n)) < 0)
		_exit(2);
	_exit(1);
}

static bool
gpxd_alive(struct harness *h)
{
	int st;

	if (h->pid > 0 && waitpid(h->pid, &st, WNOHANG) == h->pid) {
		if (WIFSIGNALED(st))
			diag("gpxd died of signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
		else
			diag("gpxd exited with status %d", WEXITSTATUS(st));
		harness_dump_log(h);
		h->pid = -1;
	}
	return h->pid > 0;
}

/* One query: 0 if its reply decodes, with *entries (may be NULL) the entries of its lists. */
static int
query_n(gpx_conn *c, enum gpx_query what, size_t *entries)
{
	void *buf = NULL;
	size_t len = 0;
	int r = gpx_query(c, what, &buf, &len);

	if (r == 0) {
		Gpx__QueryReply *q = gpx__query_reply__unpack(NULL, len, buf);
		r = q != NULL ? 0 : -GPX_EPROTO;
		if (q != NULL && entries != NULL)
			*entries = q->n_clients + q->n_regions + q->n_exports + q->n_transfers + q->n_paths +
			    q->n_devices + q->n_links + q->n_nics + q->n_peers;
		if (q != NULL)
			gpx__query_reply__free_unpacked(q, NULL);
	}
	free(buf);
	return r;
}

static int
query(gpx_conn *c, enum gpx_query what)
{
	return query_n(c, what, NULL);
}

/* A port of 127.0.0.1 free a moment ago, or -1. */
static int
free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), port = -1;

	if (s >= 0 && bind(s, (struct sockaddr *)&a, sizeof(a)) == 0 && getsockname(s, (struct sockaddr *)&a, &len) == 0)
		port = ntohs(a.sin_port);
	if (s >= 0)
		close(s);
	return port;
}

/* The fabric's key: 32 random bytes in base64, mode 0600.  0 or -1. */
static int
write_key(const char *path)
{
	static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
	unsigned char raw[33] = { 0 };
	char text[48];
	size_t n = 0;
	int fd;

	if (getentropy(raw, 32) < 0)
		return -1;
	for (size_t i = 0; i < 33; i += 3) {
		uint32_t v = (uint32_t)raw[i] << 16 | (uint32_t)raw[i + 1] << 8 | raw[i + 2];
		for (int k = 3; k >= 0; k--)
			text[n++] = b64[(v >> (6 * k)) & 63];
	}
	text[43] = '=';
	text[44] = '\n';
	if ((fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0)
		return -1;
	bool good = write(fd, text, 45) == 45;
	close(fd);
	return good ? 0 : -1;
}

struct qarg {
	gpx_conn *c;
	enum gpx_query what;
	size_t entries;                   /* in its lists, asked unarmed */
};

/* A query answered whole: as many entries as unarmed; one with fewer is cut short (EPROTO). */
static int
op_query(void *arg)
{
	struct qarg *a = arg;
	size_t n = 0;
	int r = query_n(a->c, a->what, &n);

	return r == 0 && n != a->entries ? -GPX_EPROTO : r;
}

/*
 * Fails the 1st, 2nd, ... allocation gpxd makes for fn in turn, until fn needs fewer: each
 * time fn must end whole (0) or refused ENOMEM, gpxd must live, and fn unarmed must end whole
 * after.  One check; false when gpxd died.
 */
static bool
fail_each(struct harness *h, const char *name, int (*fn)(void *), void *arg)
{
	int n, whole = 0, refused = 0, other = 0, last_other = 0, after_bad = 0, last_after = 0;
	bool alive = true, done = false;

	asking = name;
	for (n = 1; n <= tries_max && alive && !done; n++) {
		atomic_store(countdown, n);
		failing = n;
		alarm(60);
		int r = fn(arg);
		done = atomic_exchange(countdown, 0) > 0;     /* fn took fewer than n */
		if (r != 0 && r != -GPX_ENOMEM)
			usleep(200000);          /* a gpxd that dropped the connection as it died: gone by now */
		alive = gpxd_alive(h);
		if (done)
			break;
		if (r == 0)
			whole++;
		else if (r == -GPX_ENOMEM)
			refused++;
		else {
			other++;
			last_other = r;
		}
		if (alive && (r = fn(arg)) != 0) {
			after_bad++;
			last_after = r;
		}
		alarm(0);
	}
	alarm(0);
	alive = alive && gpxd_alive(h);
	ok(alive && done && other == 0 && after_bad == 0,
	    "%s: each of its %d allocations failed in turn: whole %d times, ENOMEM %d times "
	    "(other ends %d%s%s), %s, unarmed whole after each (%d not%s%s)",
	    name, n - 1, whole, refused, other, other ? ", the last: " : "", other ? gpx_strerror(last_other) : "",
	    alive ? "gpxd alive" : "gpxd DIED", after_bad, after_bad ? ", the last: " : "",
	    after_bad ? gpx_strerror(last_after) : "");
	return alive;
}

/* ---- requests: each kind a client sends, under one failed allocation ---- */

struct rq {
	struct harness *h;
	gpx_conn *c, *other;              /* the requester, and a second connection that imports */
	gpx_region a, b;                  /* two 1 MiB host regions of c */
	int fa, fb;
	unsigned char *pa, *pb;
	uint64_t tag;
	unsigned seed;
};

/* A copy's result, waited for: 0, or its error. */
static int
rq_wait(struct rq *q, int r)
{
	struct gpx_completion done;

	if (r < 0)
		return r;
	r = gpx_wait_tag(q->c, q->tag, &done, 20000);
	return r < 0 ? r : done.status;
}

/* The bytes of b are a's, after a copy of a fresh pattern: for the copies that said 0. */
static void
rq_pattern(struct rq *q)
{
	q->seed++;
	for (size_t i = 0; i < (1u << 20); i++)
		q->pa[i] = (unsigned char)(i * 31 + q->seed);
	memset(q->pb, 0, 1u << 20);
}

static int
op_connect(void *arg)
{
	struct rq *q = arg;
	gpx_conn *c = NULL;
	int r = gpx_connect(q->h->sock, "alloc-fail-connect", &c);

	if (r == 0)
		gpx_close(c);
	return r;
}

static int
op_register(void *arg)
{
	struct rq *q = arg;
	gpx_region r2;
	int r = gpx_register_host(q->c, q->fa, 0, 4096, 0, &r2);

	if (r == 0)
		r = gpx_deregister(q->c, r2);
	return r;
}

static int
op_copy(void *arg)
{
	struct rq *q = arg;
	rq_pattern(q);
	int r = rq_wait(q, gpx_copy(q->c, q->a, 0, q->b, 0, 1u << 20, ++q->tag));
	return r == 0 && memcmp(q->pa, q->pb, 1u << 20) != 0 ? -GPX_EIO : r;
}

/* The 1 MiB of a as n segments, laid in b in reverse order: 0, or the copy's error. */
static int
rq_copyv_reversed(struct rq *q, int n)
{
	static struct gpx_seg s[4096];
	const uint64_t len = (1u << 20) / n;

	rq_pattern(q);
	for (int i = 0; i < n; i++)
		s[i] = (struct gpx_seg){ i * len, (n - 1 - i) * len, len };
	int r = rq_wait(q, gpx_copyv(q->c, q->a, q->b, s, n, ++q->tag));
	for (int i = 0; r == 0 && i < n; i++)
		if (memcmp(q->pa + i * len, q->pb + (n - 1 - i) * len, len) != 0)
			r = -GPX_EIO;
	return r;
}

/* 64 segments of 16 KiB. */
static int
op_copyv(void *arg)
{
	return rq_copyv_reversed(arg, 64);
}

/* 4,096 segments of 256 bytes: a list long enough for the segment area. */
static int
op_copyv_area(void *arg)
{
	return rq_copyv_reversed(arg, 4096);
}

/* A copy of 1 GiB between two regions of 1 MiB each (1,024 segments), cancelled at once. */
static int
op_cancel(void *arg)
{
	struct rq *q = arg;
	static struct gpx_seg s[1024];
	struct gpx_completion done;

	for (int i = 0; i < 1024; i++)
		s[i] = (struct gpx_seg){ 0, 0, 1u << 20 };
	int r = gpx_copyv(q->c, q->a, q->b, s, 1024, ++q->tag);
	if (r < 0)
		return r;
	r = gpx_cancel(q->c, q->tag);
	int w = gpx_wait_tag(q->c, q->tag, &done, 20000);
	if (w < 0)
		return w;
	if (r < 0 && r != -GPX_ENOENT)
		return r;
	/* ended by the cancel, or done before it came */
	return done.status == -GPX_ECANCELED || done.status == 0 ? 0 : done.status;
}

static int
op_batch(void *arg)
{
	struct rq *q = arg;
	struct gpx_pair p[8];
	struct gpx_seg s[8];

	rq_pattern(q);
	for (int i = 0; i < 8; i++) {
		p[i] = (struct gpx_pair){ q->a, q->b, (uint64_t)i << 17, (uint64_t)i << 17, (uint32_t)i, 1 };
		s[i] = (struct gpx_seg){ 0, 0, 1u << 17 };
	}
	int r = rq_wait(q, gpx_copy_batch(q->c, p, 8, s, 8, ++q->tag));
	return r == 0 && memcmp(q->pa, q->pb, 1u << 20) != 0 ? -GPX_EIO : r;
}

static int
op_pages(void *arg)
{
	struct rq *q = arg;
	uint32_t sp[64], dp[64];

	rq_pattern(q);
	for (uint32_t i = 0; i < 64; i++) {
		sp[i] = i;
		dp[i] = 255 - i;
	}
	int r = rq_wait(q, gpx_copy_pages(q->c, q->a, 0, q->b, 0, 4096, sp, dp, 64, ++q->tag));
	for (int i = 0; r == 0 && i < 64; i++)
		if (memcmp(q->pa + (size_t)i * 4096, q->pb + (size_t)(255 - i) * 4096, 4096) != 0)
			r = -GPX_EIO;
	return r;
}

static int
op_export(void *arg)
{
	struct rq *q = arg;
	struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };
	gpx_region imp;
	uint64_t len;
	int r = gpx_export(q->c, q->a, "alloc-fail.req", &o);

	if (r < 0)
		return r;
	r = gpx_import(q->other, "alloc-fail.req", &imp, &len);
	if (r == 0)
		r = gpx_deregister(q->other, imp);
	int u = gpx_unexport(q->c, "alloc-fail.req");
	return r < 0 ? r : u;
}

/* A reload (gpxctl reload, SIGHUP): applied, or refused with the configuration as it was. */
static int
op_reload(void *arg)
{
	struct rq *q = arg;
	char text[512];

	return gpx_admin(q->c, GPX_ADMIN_RELOAD, 0, NULL, text, sizeof(text));
}

/* ---- the admin group's lookup out of memory (a gpxd of its own: every allocation of getgrnam fails) ---- */

/* gpxd's configuration file with its admin_group line naming name: 0 or -1. */
static int
ag_write(struct harness *h, const char *name)
{
	char text[4096], out[4200];
	FILE *f = fopen(h->conf, "r");
	size_t n = f != NULL ? fread(text, 1, sizeof(text) - 1, f) : 0;
	char *line;

	if (f == NULL || fclose(f) != 0 || (text[n] = '\0', line = strstr(text, "admin_group = ")) == NULL)
		return -1;
	snprintf(out, sizeof(out), "%.*sadmin_group = %s%s", (int)(line - text), text, name, strchr(line, '\n'));
	return (f = fopen(h->conf, "w")) != NULL && fputs(out, f) >= 0 && fclose(f) == 0 ? 0 : -1;
}

/* An administrative request (the log level) on c: 0 answered, 1 EPERM, 2 ENOMEM, 3 anything else. */
static int
ag_request(gpx_conn *c)
{
	char lvl[64];
	int r = gpx_admin(c, GPX_ADMIN_LOG_LEVEL, 0, NULL, lvl, sizeof(lvl));

	return r == 0 ? 0 : r == -GPX_EPERM ? 1 : r == -GPX_ENOMEM ? 2 : 3;
}

struct asker {
	pid_t pid;
	int result, go;                   /* the first answer comes on result; a byte on go asks again */
};

/*
 * A child, uid nobody with gid as its only group, connected to sock: it makes an
 * administrative request, sends what came (ag_request's number) and, once told to go, asks
 * again on the same connection; its exit status is the second answer.  0 or -1.
 */
static int
ag_spawn(struct asker *a, const char *sock, gid_t gid)
{
	int res[2], go[2];

	if (pipe(res) < 0 || pipe(go) < 0 || (a->pid = fork()) < 0)
		return -1;
	if (a->pid == 0) {
		gpx_conn *c;
		char first, b;
		close(res[0]);
		close(go[1]);
		if (setgroups(0, NULL) < 0 || setgid(gid) < 0 || setuid(65534) < 0 ||
		    gpx_connect(sock, "alloc-fail-admin", &c) < 0)
			_exit(3);
		first = (char)ag_request(c);
		if (write(res[1], &first, 1) != 1 || read(go[0], &b, 1) < 0)
			_exit(3);
		_exit(ag_request(c));
	}
	close(res[1]);
	close(go[0]);
	a->result = res[0];
	a->go = go[1];
	return 0;
}

/* The child's first answer (3 when none came). */
static int
ag_first(struct asker *a)
{
	char r = 3;

	return read(a->result, &r, 1) == 1 ? r : 3;
}

/* The child told to ask again: its second answer (3 when it failed). */
static int
ag_second(struct asker *a)
{
	int st;

	if (write(a->go, "g", 1) != 1)
		kill(a->pid, SIGKILL);
	close(a->go);
	close(a->result);
	return waitpid(a->pid, &st, 0) == a->pid && WIFEXITED(st) ? WEXITSTATUS(st) : 3;
}

static const char *const ag_said[] = { "answered", "refused EPERM", "refused ENOMEM", "FAILED" };

/*
 * admin_group changed by a reload from nogroup to daemon while every allocation of getgrnam
 * fails (GPX_FAILALLOC_ALL_UNDER): the reload's lookup and that at each accept find no
 * memory.  A member of daemon must be refused ENOMEM (a try-again, not EPERM) and, on the
 * same connection once memory is back, answered; a member of nogroup (admin no more) must be
 * refused both times.  Before the reload, unarmed: nogroup's member answered, daemon's EPERM.
 */
static void
admin_group_check(const char *shim, const char *path)
{
	struct harness hg;
	struct asker m, o;
	struct group *gr;
	gid_t gn, gd;
	gpx_conn *c;
	char text[512];

	if ((gr = getgrnam("nogroup")) == NULL)
		tap_bail("no group nogroup here");
	gn = gr->gr_gid;
	if ((gr = getgrnam("daemon")) == NULL)
		tap_bail("no group daemon here");
	gd = gr->gr_gid;
	atomic_store(countdown, 0);
	setenv("LD_PRELOAD", shim, 1);
	setenv("GPX_FAILALLOC", path, 1);
	setenv("GPX_FAILALLOC_ALL_UNDER", "getgrnam", 1);
	int started = harness_start(&hg, "[daemon]\nadmin_group = nogroup\n");
	unsetenv("LD_PRELOAD");
	unsetenv("GPX_FAILALLOC");
	unsetenv("GPX_FAILALLOC_ALL_UNDER");
	if (started < 0 || gpx_connect(hg.sock, "alloc-fail-admin-root", &c) < 0)
		tap_bail("a gpxd whose getgrnam finds no memory when armed");

	if (ag_spawn(&m, hg.sock, gn) < 0 || ag_spawn(&o, hg.sock, gd) < 0)
		tap_bail("fork: %s", strerror(errno));
	int m1 = ag_first(&m), o1 = ag_first(&o), m2 = ag_second(&m), o2 = ag_second(&o);
	ok(m1 == 0 && m2 == 0 && o1 == 1 && o2 == 1,
	    "admin_group nogroup: its member's administrative requests %s, %s; daemon's %s, %s",
	    ag_said[m1], ag_said[m2], ag_said[o1], ag_said[o2]);

	atomic_store(countdown, 1);
	int r = ag_write(&hg, "daemon") < 0 ? -GPX_EIO : gpx_admin(c, GPX_ADMIN_RELOAD, 0, NULL, text, sizeof(text));
	if (ag_spawn(&m, hg.sock, gd) < 0 || ag_spawn(&o, hg.sock, gn) < 0)
		tap_bail("fork: %s", strerror(errno));
	m1 = ag_first(&m);
	o1 = ag_first(&o);
	atomic_store(countdown, 0);
	m2 = ag_second(&m);
	o2 = ag_second(&o);
	bool logged = harness_log_has(&hg, "no such group");
	ok(r == 0 && m1 == 2 && m2 == 0 && (o1 == 1 || o1 == 2) && o2 == 1 && !logged,
	    "admin_group changed to daemon while getgrnam finds no memory (reload: %s): daemon's member refused "
	    "ENOMEM, then answered on the same connection once memory is back (%s, %s); nogroup's member refused "
	    "(%s, %s); %s", r == 0 ? "applied" : gpx_strerror(r), ag_said[m1], ag_said[m2], ag_said[o1], ag_said[o2],
	    logged ? "a lookup out of memory was LOGGED as no such group" : "no lookup taken for a missing group");
	gpx_close(c);
	harness_finish(&hg);
}

/* ---- across the fabric: B, a second gpxd (unarmed), peered with the armed one (A) ---- */

#define RM_LEN (1u << 20)

struct rm {
	struct harness *hb;
	gpx_conn *ca, *cb;                /* a client of A, and one of B */
	gpx_region la, lb, bx;            /* 1 MiB of host memory each: A's, B's, and B's export af.b */
	int fa, fb, fx;
	unsigned char *pa, *pb, *px;
	uint64_t tag;
	unsigned seed;
};

static int
rm_copy(gpx_conn *c, uint64_t *tag, gpx_region from, gpx_region to)
{
	struct gpx_completion done;
	int r = gpx_copy(c, from, 0, to, 0, RM_LEN, ++*tag);

	if (r < 0)
		return r;
	r = gpx_wait_tag(c, *tag, &done, 20000);
	return r < 0 ? r : done.status;
}

/*
 * c's local region (its bytes at pl) copied into the remote one (its bytes, on the other
 * node, at pr), then a fresh pattern back: each copy that says 0 checked byte for byte.
 */
static int
rm_both_ways(struct rm *m, gpx_conn *c, gpx_region loc, unsigned char *pl, gpx_region rem, unsigned char *pr)
{
	int r;

	m->seed++;
	for (size_t i = 0; i < RM_LEN; i++)
		pl[i] = (unsigned char)(i * 7 + m->seed);
	memset(pr, 0, RM_LEN);
	if ((r = rm_copy(c, &m->tag, loc, rem)) != 0)
		return r;
	if (memcmp(pl, pr, RM_LEN) != 0)
		return -GPX_EIO;
	for (size_t i = 0; i < RM_LEN; i++)
		pr[i] = (unsigned char)(i * 13 + m->seed);
	memset(pl, 0, RM_LEN);
	if ((r = rm_copy(c, &m->tag, rem, loc)) != 0)
		return r;
	return memcmp(pl, pr, RM_LEN) != 0 ? -GPX_EIO : 0;
}

/* A (armed) exports a region to the fabric; B's client imports it and copies both ways. */
static int
op_export_remote(void *arg)
{
	struct rm *m = arg;
	struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };
	gpx_region imp;
	uint64_t len;
	int r = gpx_export_remote(m->ca, m->la, "af.a", &o, NULL);

	if (r < 0)
		return r;
	if ((r = gpx_import(m->cb, "alloc-fail:af.a", &imp, &len)) == 0) {
		r = rm_both_ways(m, m->cb, m->lb, m->pb, imp, m->pa);
		int d = gpx_deregister(m->cb, imp);
		r = r < 0 ? r : d;
	}
	int u = gpx_unexport(m->ca, "af.a");
	return r < 0 ? r : u;
}

/* A's client imports B's region by name and copies both ways. */
static int
rm_import_both_ways(struct rm *m, const char *name)
{
	gpx_region imp;
	uint64_t len;
	int r = gpx_import(m->ca, name, &imp, &len);

	if (r < 0)
		return r;
	r = rm_both_ways(m, m->ca, m->la, m->pa, imp, m->px);
	int d = gpx_deregister(m->ca, imp);
	return r < 0 ? r : d;
}

/* A's client imports B's export by "NODE:name" and copies both ways. */
static int
op_import_remote(void *arg)
{
	return rm_import_both_ways(arg, "alloc-fail-b:af.b");
}

/* The importers B counts on its export af.b, or -1. */
static int
rm_importers(struct rm *m)
{
	void *buf = NULL;
	size_t len = 0;
	int n = -1;

	if (gpx_query(m->cb, GPX_Q_EXPORTS, &buf, &len) == 0) {
		Gpx__QueryReply *q = gpx__query_reply__unpack(NULL, len, buf);
		for (size_t i = 0; q != NULL && i < q->n_exports; i++)
			if (strcmp(q->exports[i]->name, "af.b") == 0)
				n = (int)q->exports[i]->importers;
		if (q != NULL)
			gpx__query_reply__free_unpacked(q, NULL);
	}
	free(buf);
	return n;
}

/*
 * A client of A (on sock_a) and one of B (on sock_b), their regions, and B's export of bx as
 * exported: 0, or -1.
 */
static int
rm_clients(struct rm *m, const char *sock_a, const char *sock_b, const char *exported)
{
	struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };

	return gpx_connect(sock_a, "alloc-fail-remote-a", &m->ca) < 0 || gpx_connect(sock_b, "alloc-fail-remote-b", &m->cb) < 0 ||
	    gpx_host_alloc(RM_LEN, &m->fa, (void **)&m->pa) < 0 || gpx_host_alloc(RM_LEN, &m->fb, (void **)&m->pb) < 0 ||
	    gpx_host_alloc(RM_LEN, &m->fx, (void **)&m->px) < 0 ||
	    gpx_register_host(m->ca, m->fa, 0, RM_LEN, 0, &m->la) < 0 ||
	    gpx_register_host(m->cb, m->fb, 0, RM_LEN, 0, &m->lb) < 0 ||
	    gpx_register_host(m->cb, m->fx, 0, RM_LEN, 0, &m->bx) < 0 ||
	    gpx_export_remote(m->cb, m->bx, exported, &o, NULL) < 0 ? -1 : 0;
}

/* A's client imports name (waiting up to tries tenths of a second for it to be known), and lets it go: 0 or the error. */
static int
rm_first_import(struct rm *m, const char *name, int tries)
{
	gpx_region imp;
	uint64_t len;
	int r;

	for (int i = 0; (r = gpx_import(m->ca, name, &imp, &len)) == -GPX_ENOENT && i < tries; i++)
		usleep(100000);
	return r < 0 ? r : gpx_deregister(m->ca, imp);
}

/*
 * B started, peered with A (port_a) by a key of the same file; a client of each with its
 * regions, B's export af.b.  0, or -1 with why.
 */
static int
rm_open(struct rm *m, struct harness *a, struct harness *hb, int port_a, const char *key)
{
	char extra[512];

	snprintf(extra, sizeof(extra), "[fabric]\nnode = alloc-fail-b\nlisten = 127.0.0.1:%d\n"
	    "peers = 127.0.0.1:%d\nkey_file = %s\ntimeout = 300\nretry_interval = 0.3\n", free_port(), port_a, key);
	m->hb = hb;
	if (harness_start(hb, extra) < 0)
		return -1;
	if (rm_clients(m, a->sock, hb->sock, "af.b") < 0) {
		diag("the clients of A and B: %s", gpx_last_error(m->cb));
		return -1;
	}
	/* B dials A at once; within 10 s A's client imports af.b */
	if (rm_first_import(m, "alloc-fail-b:af.b", 100) < 0) {
		diag("A never imported af.b of B: %s", gpx_last_error(m->ca));
		return -1;
	}
	return 0;
}

static void
rm_close(struct rm *m)
{
	gpx_close(m->ca);
	gpx_close(m->cb);
	gpx_host_free(m->fa, m->pa, RM_LEN);
	gpx_host_free(m->fb, m->pb, RM_LEN);
	gpx_host_free(m->fx, m->px, RM_LEN);
	harness_stop(m->hb);
	harness_cleanup(m->hb);
}

/* ---- the cluster (--cluster): A armed and B unarmed, both nodes of one etcd ---- */

#define CL_PREFIX "/gpx-af"

struct cl {
	struct rm m;                      /* A's and B's clients and regions; B's export afc.b */
	struct harness *ha;
	gpx_conn *cq;                     /* A's query-only connection */
	size_t nodes;                     /* in the cluster query, unarmed */
	int ghost_ttl;
};

/* etcdctl's output for args (against $GPX_ETCD) in out; 0 when it exits 0. */
static int
etcdctl(char *out, size_t len, const char *fmt, ...)
{
	char args[512], cmd[1024];
	va_list ap;
	size_t n = 0;
	FILE *p;

	va_start(ap, fmt);
	vsnprintf(args, sizeof(args), fmt, ap);
	va_end(ap);
	snprintf(cmd, sizeof(cmd), "ETCDCTL_API=3 '%s' --endpoints '%s' %s 2>&1",
	    getenv("ETCDCTL") ? getenv("ETCDCTL") : "etcdctl", getenv("GPX_ETCD"), args);
	if ((p = popen(cmd, "r")) == NULL)
		return -1;
	while (n + 1 < len && fgets(out + n, (int)(len - n), p) != NULL)
		n += strlen(out + n);
	out[n] = '\0';
	while (fgetc(p) != EOF)
		;
	return pclose(p) == 0 ? 0 : -1;
}

/* Whether etcd holds the cluster name (the key of A's, node afc-a): 1, 0, or -1 when not asked. */
static int
cl_claimed(const char *name)
{
	char out[512];

	if (etcdctl(out, sizeof(out), "get --print-value-only %s/names/%s", CL_PREFIX, name) < 0)
		return -1;
	return strstr(out, "\"node\":\"afc-a\"") != NULL;
}

/*
 * The key of name absent from etcd within 10 s (a withdrawal's delete is sent after its
 * answer, and etcd on a loaded machine's disk may take seconds); if not, what etcd holds
 * there (its lease among it) is said, or that etcdctl did not answer.
 */
static bool
cl_unclaimed(const char *name)
{
	char out[512];
	const double end = now() + 10;
	int r = 1;

	while ((r = cl_claimed(name)) != 0 && now() < end)
		usleep(100000);
	if (r < 0)
		diag("etcdctl did not answer for %s", name);
	else if (r > 0 && etcdctl(out, sizeof(out), "get -w fields %s/names/%s", CL_PREFIX, name) == 0) {
		for (char *q = out; *q != '\0'; q++)
			*q = *q == '\n' ? ' ' : *q;
		diag("etcd's record of %s after 10 s: %s", name, out);
	}
	return r == 0;
}

/* The cluster query's JSON (malloc'ed) on c: 0, or its error. */
static int
cl_json(gpx_conn *c, char **json)
{
	void *buf = NULL;
	size_t len = 0;
	int r = gpx_query(c, GPX_Q_CLUSTER, &buf, &len);

	*json = NULL;
	if (r == 0) {
		Gpx__QueryReply *q = gpx__query_reply__unpack(NULL, len, buf);
		r = q != NULL && q->cluster != NULL && q->cluster[0] != '\0' ? 0 : -GPX_EPROTO;
		if (r == 0 && (*json = strdup(q->cluster)) == NULL)
			r = -GPX_ENOMEM;
		if (q != NULL)
			gpx__query_reply__free_unpacked(q, NULL);
	}
	free(buf);
	return r;
}

/* Nodes in the JSON, each with its lease's time left; ghost's in *ghost (-100 if absent). */
static size_t
cl_nodes(const char *json, long *min_left, long *ghost)
{
	size_t n = 0;
	const char *p = json, *g = strstr(json, "\"name\":\"ghost\"");

	*min_left = 1L << 30;
	*ghost = -100;
	while ((p = strstr(p, "\"lease_left\":")) != NULL) {
		long v = strtol(p += 13, NULL, 10);
		if (v < *min_left)
			*min_left = v;
		if (g != NULL && p > g && *ghost == -100)
			*ghost = v;
		n++;
	}
	return n;
}

/*
 * The key of node "ghost" put again under a new lease of its own TTL, seen by A's watch: a
 * cluster query whose answer kept a lease's time left from an earlier one gives ghost the
 * TTL before.  Put again when A's watch, started anew, missed it (it read it instead).  0 or -1.
 */
static int
cl_ghost(struct cl *k)
{
	char out[512], lease[32];

	k->ghost_ttl = k->ghost_ttl >= 9000 ? 1000 : k->ghost_ttl + 10;
	for (int tries = 0; tries < 3; tries++) {
		double ev = harness_metric(k->ha, "gpx_cluster_watch_events_total");
		if (etcdctl(out, sizeof(out), "lease grant %d", k->ghost_ttl) < 0 || sscanf(out, "lease %31s", lease) != 1 ||
		    etcdctl(out, sizeof(out), "put --lease=%s %s/nodes/ghost '{\"name\":\"ghost\",\"listen\":[]}'",
		    lease, CL_PREFIX) < 0) {
			diag("etcdctl: %s", out);
			return -1;
		}
		for (int i = 0; i < 50; i++) {
			if (harness_metric(k->ha, "gpx_cluster_watch_events_total") > ev)
				return 0;
			usleep(10000);
		}
	}
	diag("A's watch never saw ghost's key put again");
	return -1;
}

/*
 * gpxctl cluster's query: whole when it has every node of the unarmed answer, each lease with
 * time left.  Armed, with ghost under a new lease first (put unarmed): ghost's is its new TTL.
 */
static int
op_cluster_query(void *arg)
{
	struct cl *k = arg;
	int32_t armed = atomic_exchange(countdown, 0);
	char *json;
	long left, ghost;

	if (armed > 0 && cl_ghost(k) < 0)
		return -GPX_EIO;
	atomic_store(countdown, armed);
	int r = cl_json(k->cq, &json);
	if (r < 0)
		return r;
	size_t n = cl_nodes(json, &left, &ghost);
	if (n != k->nodes || left <= 0 || (armed > 0 && (ghost < k->ghost_ttl - 3 || ghost > k->ghost_ttl))) {
		diag("cut short: %zu nodes of %zu, least time left %ld, ghost %ld of %d: %s", n, k->nodes, left,
		    ghost, k->ghost_ttl, json);
		r = -GPX_EPROTO;
	}
	free(json);
	return r;
}

/*
 * A's export to the cluster: whole when etcd holds its name and B imports it by the bare name
 * and copies both ways; refused, when etcd does not hold it.  Then its unexport: the name
 * leaves etcd.
 */
static int
op_cluster_export(void *arg)
{
	struct cl *k = arg;
	struct rm *m = &k->m;
	struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };
	gpx_region imp;
	uint64_t len;
	int r = gpx_export_remote(m->ca, m->la, "afc.a", &o, NULL), c;

	if (r < 0) {
		if (!cl_unclaimed("afc.a")) {
			diag("export refused (%s), but its name is claimed in etcd", gpx_strerror(r));
			return -GPX_EPROTO;
		}
		return r;
	}
	if ((c = cl_claimed("afc.a")) != 1) {
		diag("export answered whole, but etcd %s its name", c < 0 ? "was not asked for" : "does not hold");
		r = -GPX_EPROTO;
	}
	/* B's watch has it within 3 s */
	for (int i = 0; r == 0 && (r = gpx_import(m->cb, "afc.a", &imp, &len)) == -GPX_ENOENT && i < 30; i++)
		usleep(100000);
	if (r == 0) {
		r = rm_both_ways(m, m->cb, m->lb, m->pb, imp, m->pa);
		int d = gpx_deregister(m->cb, imp);
		r = r < 0 ? r : d;
	}
	int u = gpx_unexport(m->ca, "afc.a");
	if (u == 0 && !cl_unclaimed("afc.a")) {
		diag("unexport answered whole, but its name is still claimed in etcd");
		u = -GPX_EPROTO;
	}
	return r < 0 ? r : u;
}

/* A's client imports B's cluster name afc.b by its bare name and copies both ways. */
static int
op_cluster_import(void *arg)
{
	return rm_import_both_ways(&((struct cl *)arg)->m, "afc.b");
}

/*
 * A's [fabric] and [cluster] for node NODE, its keys under prefix; leases of 300 s, renewed
 * every 100 s: none within a check.
 */
static void
cl_conf_prefix(char *out, size_t len, const char *node, const char *key, const char *prefix)
{
	snprintf(out, len, "[daemon]\nmetrics = 127.0.0.1:0\n[fabric]\nnode = %s\nlisten = 127.0.0.1:%d\n"
	    "key_file = %s\ntimeout = 300\nretry_interval = 0.3\n[cluster]\netcd = %s\nprefix = %s\n"
	    "lease_ttl = 300\n", node, free_port(), key, getenv("GPX_ETCD"), prefix);
}

static void
cl_conf(char *out, size_t len, const char *node, const char *key)
{
	cl_conf_prefix(out, len, node, key, CL_PREFIX);
}

/* ---- the cluster's start: gpxd's allocations below cluster_start failing in turn ---- */

/* (a prefix of their own: a start given up may leave its node's key till its lease ends) */
#define CS_PREFIX "/gpx-afs"

/* Whether etcd's value of a node's key has every field of one (a record cut short lacks some). */
static bool
cs_record_whole(const char *v)
{
	static const char *const fields[] = {
		"\"name\":\"", "\"listen\":[\"127.0.0.1:", "\"transports\":[\"tcp\"", "\"fabric\":\"",
		"\"gpus\":", "\"proto\":1", "\"version\":\"", "\"start\":", "\"pid\":",
	};

	for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
		if (strstr(v, fields[i]) == NULL)
			return false;
	return true;
}

/* Every node's record etcd holds under CS_PREFIX (those of starts given up) whole; false with why. */
static bool
cs_no_cut_record(void)
{
	static char out[1 << 18];
	char *line, *save = NULL;

	if (etcdctl(out, sizeof(out), "get --print-value-only --prefix %s/nodes/", CS_PREFIX) < 0) {
		diag("etcdctl: %s", out);
		return false;
	}
	for (line = strtok_r(out, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save))
		if (!cs_record_whole(line)) {
			diag("etcd holds a node's record cut short: %s", line);
			return false;
		}
	return true;
}

/*
 * The cluster query of the gpxd on h: 0 when it is up in the cluster, its node's record (as
 * read back from etcd) whole, or -1 with why.
 */
static int
cs_up(struct harness *h, char *why, size_t len)
{
	struct gpx_connect_opts co = { .socket = h->sock, .name = "alloc-fail-start", .eventfd = -1, .no_ring = 1 };
	gpx_conn *c = NULL;
	char *json = NULL, *self;
	int r = -1;

	if (gpx_connect_opts(&co, &c) < 0 || cl_json(c, &json) < 0)
		snprintf(why, len, "gpxd up, but no answer to the cluster query: %s", gpx_last_error(c));
	else if (strstr(json, "\"state\":\"up\"") == NULL)
		snprintf(why, len, "gpxd up, but not up in the cluster: %.400s", json);
	else if ((self = strstr(json, "{\"name\":\"afs-")) == NULL)
		snprintf(why, len, "gpxd up in the cluster, but its node is not in its list: %.400s", json);
	else if (self[strcspn(self, "}")] = '\0', !cs_record_whole(self))
		snprintf(why, len, "gpxd up in the cluster, its record in etcd cut short: %.400s", self);
	else
		r = 0;
	gpx_close(c);
	free(json);
	return r;
}

/* gpxd (its files in h) started with the shim armed below cluster_start, skipping what skip names (may be NULL). */
static pid_t
cs_spawn(struct harness *h, const char *shim, const char *path, const char *skip)
{
	int fd = open(h->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	pid_t pid;

	if (fd < 0)
		return -1;
	fflush(NULL);
	if ((pid = fork()) == 0) {
		harness_child_fds(fd);
		setenv("LD_PRELOAD", shim, 1);
		setenv("GPX_FAILALLOC", path, 1);
		setenv("GPX_FAILALLOC_UNDER", "cluster_start", 1);
		if (skip != NULL)
			setenv("GPX_FAILALLOC_SKIP_UNDER", skip, 1);
		execl(getenv("GPXD"), "gpxd", "-f", "-s", h->sock, "-c", h->conf, (char *)NULL);
		_exit(127);
	}
	close(fd);
	return pid;
}

/*
 * gpxd started as node afs-N with the n-th allocation below cluster_start failing (the count
 * written before it starts; none under skip): 1 when it came up, was up in the cluster within
 * 5 s (a join that failed is tried again while local clients are served) and
 * stopped cleanly; 0 when it refused to start, exiting non-zero with a line saying it found
 * no memory; -1 otherwise (said why).  *left: the count left once it started or ended (more
 * than 0: the start made fewer than n allocations).
 */
static int
cs_start_once(const char *shim, const char *path, const char *key, const char *skip, int n, int32_t *left)
{
	struct harness h = { .pid = -1 };
	char conf[768], node[32], why[512];
	int st = 0, r = -1;

	snprintf(node, sizeof(node), "afs-%d%s", n, skip != NULL ? "s" : "");
	snprintf(h.dir, sizeof(h.dir), "%s/gpx-afs.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (mkdtemp(h.dir) == NULL)
		return -1;
	snprintf(h.sock, sizeof(h.sock), "%s/gpxd.sock", h.dir);
	snprintf(h.conf, sizeof(h.conf), "%s/gpxd.conf", h.dir);
	snprintf(h.log, sizeof(h.log), "%s/gpxd.log", h.dir);
	strcpy(conf, "[daemon]\nworkers = 2\nblocking_threads = 2\nring_entries = 64\nlog_level = info\n");
	cl_conf_prefix(conf + strlen(conf), sizeof(conf) - strlen(conf), node, key, CS_PREFIX);
	FILE *f = fopen(h.conf, "w");
	if (f == NULL || fputs(conf, f) < 0 || fclose(f) != 0) {
		diag("cannot write %s", h.conf);
		harness_cleanup(&h);
		return -1;
	}
	atomic_store(countdown, n);
	*left = 1;
	h.pid = cs_spawn(&h, shim, path, skip);
	/* Its socket listens before the cluster starts: up once the socket is there and Hello
	 * answered (a gpxd that gives up meanwhile closes the connection: said below). */
	alarm(60);
	for (int i = 0; i < 3000 && h.pid > 0; i++) {
		int s = harness_connect(&h);
		if (s >= 0) {
			close(s);
			/* a join that failed is tried again within a second: up within 5 s */
			for (int k = 0; k < 50 && h.pid > 0 && (r = cs_up(&h, why, sizeof(why)) == 0 ? 1 : -1) < 0; k++) {
				usleep(100000);
				if (waitpid(h.pid, &st, WNOHANG) == h.pid)
					h.pid = -1;
			}
			if (r < 0 && h.pid > 0)
				diag("%s", why);
			break;
		}
		if (waitpid(h.pid, &st, WNOHANG) == h.pid)
			h.pid = -1;
		else
			usleep(10000);
	}
	alarm(0);
	*left = atomic_exchange(countdown, 0);
	if (h.pid < 0) {
		r = -1;
		if (WIFSIGNALED(st))
			diag("gpxd died of signal %d (%s) at its start", WTERMSIG(st), strsignal(WTERMSIG(st)));
		else if (WEXITSTATUS(st) == 0)
			diag("gpxd exited 0 at its start");
		else if (!harness_log_has(&h, "out of memory"))
			diag("gpxd exited %d at its start, no line of its log saying it found no memory", WEXITSTATUS(st));
		else
			r = 0;
	}
	if (h.pid > 0 && (st = harness_stop(&h)) != 0) {
		diag("gpxd did not stop cleanly (exit %d)", st);
		r = -1;
	}
	if (r < 0)
		harness_dump_log(&h);
	harness_cleanup(&h);
	return r;
}

/*
 * gpxd's start as a node of the cluster with its allocations below cluster_start failing in
 * turn, those under skip (may be NULL) left out: each one up to the dense-th, then every
 * step-th (each start given up to a failed join takes a second: all of them would take
 * minutes), until the start makes fewer.  Each time gpxd either starts, is up in the cluster
 * with its record whole and stops cleanly, or exits non-zero with a line that says it found
 * no memory: never a signal.  At the end, no record cut short in etcd.  One check.
 */
static void
cs_start_each(const char *shim, const char *path, const char *key, const char *skip, int dense, int step,
    const char *what)
{
	int n, started = 0, refused = 0, bad = 0;
	int32_t left = 0;

	asking = "the cluster's start";
	for (n = 1; bad == 0 && n <= 100000; n += n < dense ? 1 : step) {
		failing = n;
		int r = cs_start_once(shim, path, key, skip, n, &left);
		if (left > 0 && r == 1)
			break;          /* it made fewer than n */
		started += r == 1;
		refused += r == 0;
		bad += r < 0;
		if (r < 0)
			diag("with allocation %d below cluster_start failing", n);
	}
	bool kept = cs_no_cut_record();
	ok(bad == 0 && left > 0 && started + refused >= 10 && kept,
	    "the cluster's start, %s: %d of its %d allocations failed in turn: started %d times, refused with a line "
	    "saying so %d times, %d other ends; %s", what, started + refused + bad, n - 1, started, refused, bad,
	    kept ? "no record cut short in etcd" : "a record CUT SHORT in etcd");
}

/* ---- every key read again: C's allocations below kv_seen failing in turn ---- */

/* A third gpxd, C, node afc-c, whose allocations count only below kv_seen (a key of the range or the watch). */
struct rr {
	struct harness hc;
	gpx_conn *c;                      /* a client of C */
	_Atomic int32_t *count;           /* C's: [0] the watch's key, [1] then the range's */
	char path[160];
};

/* Lines of h's log that hold needle. */
static int
log_lines(const struct harness *h, const char *needle)
{
	char line[2048];
	int n = 0;
	FILE *f = fopen(h->log, "re");

	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		n += strstr(line, needle) != NULL;
	if (f != NULL)
		fclose(f);
	return n;
}

/* The epoch of C's ready connection with node, or 0. */
static uint32_t
rr_epoch(struct rr *q, const char *node)
{
	void *buf = NULL;
	size_t len = 0;
	uint32_t e = 0;

	if (gpx_query(q->c, GPX_Q_PEERS, &buf, &len) == 0) {
		Gpx__QueryReply *r = gpx__query_reply__unpack(NULL, len, buf);
		for (size_t i = 0; r != NULL && i < r->n_peers; i++)
			if (strcmp(r->peers[i]->node, node) == 0 && strcmp(r->peers[i]->state, "ready") == 0)
				e = r->peers[i]->epoch;
		if (r != NULL)
			gpx__query_reply__free_unpacked(r, NULL);
	}
	free(buf);
	return e;
}

/* C started with its own count, a node of the cluster, connected with B by an import of afc.b: 0 or -1. */
static int
rr_open(struct rr *q, const char *shim, const char *key)
{
	char conf[512];
	gpx_region imp;
	uint64_t len;
	int fd, r;

	snprintf(q->path, sizeof(q->path), "%s/gpx-failalloc.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if ((fd = mkstemp(q->path)) < 0 || ftruncate(fd, 4096) < 0 ||
	    (q->count = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
		diag("C's count: %s", strerror(errno));
		return -1;
	}
	close(fd);
	cl_conf(conf, sizeof(conf), "afc-c", key);
	setenv("LD_PRELOAD", shim, 1);
	setenv("GPX_FAILALLOC", q->path, 1);
	setenv("GPX_FAILALLOC_UNDER", "kv_seen", 1);
	r = harness_start(&q->hc, conf);
	unsetenv("LD_PRELOAD");
	unsetenv("GPX_FAILALLOC");
	unsetenv("GPX_FAILALLOC_UNDER");
	if (r < 0 || gpx_connect(q->hc.sock, "alloc-fail-reread", &q->c) < 0) {
		diag("gpxd C: %s", gpx_last_error(NULL));
		return -1;
	}
	if ((r = gpx_import(q->c, "afc.b", &imp, &len)) < 0 || (r = gpx_deregister(q->c, imp)) < 0) {
		diag("C's import of afc.b: %s", gpx_strerror(r));
		return -1;
	}
	return 0;
}

/*
 * One key of C's watch finds no memory (ghost's, put again), which has every key read again,
 * with C's n-th allocation below kv_seen failing in that range: 1 when the range made fewer,
 * 0 when it is over (C's read again as often as the failures asked), -1 when the watch never
 * lost the key.  *lost: the nodes C took for gone meanwhile.
 */
static int
rr_once(struct rr *q, int n, int *lost)
{
	char out[512];
	int base = log_lines(&q->hc, "every key read again"), reads = base, quiet = 0;

	atomic_store(&q->count[1], n);
	atomic_store(&q->count[0], 1);
	if (etcdctl(out, sizeof(out), "put %s/nodes/ghost '{\"name\":\"ghost\",\"listen\":[]}'", CL_PREFIX) < 0)
		diag("etcdctl: %s", out);
	/* read again at C's next tick, and at the one after while a key of it found no memory:
	 * over once three ticks pass without */
	for (int i = 0; i < 100 && (reads == base || quiet < 3); i++) {
		usleep(100000);
		int k = log_lines(&q->hc, "every key read again");
		quiet = k > reads ? 0 : quiet + 1;
		reads = k;
	}
	int32_t left = atomic_exchange(&q->count[0], 0), second = atomic_exchange(&q->count[1], 0);
	*lost = log_lines(&q->hc, "gone while etcd was away");
	return second > 0 ? -1 : left > 0;
}

/*
 * C's 1st, 2nd, ... allocation below kv_seen in a range of every key (one its watch's lost key
 * set off) failing in turn, until the range makes fewer: each time C takes no node for gone
 * (a node's key it found no memory for is one it knows still) and its connection with B
 * stands, the same epoch, through it all.  One check.
 */
static void
rr_each(const char *shim, const char *key)
{
	struct rr q = { .c = NULL };
	int n, r = 0, lost = 0, first = 0;
	uint32_t e0 = 0, e;

	asking = "every key read again";
	if (rr_open(&q, shim, key) < 0 || (e0 = rr_epoch(&q, "afc-b")) == 0) {
		ok(false, "every key read again: no gpxd C connected with B");
		gpx_close(q.c);
		harness_cleanup(&q.hc);
		return;
	}
	for (n = 1; n <= 200; n++) {
		failing = n;
		alarm(60);
		r = rr_once(&q, n, &lost);
		alarm(0);
		if (first == 0 && (lost > 0 || rr_epoch(&q, "afc-b") != e0))
			first = n;
		if (r != 0)
			break;
	}
	e = rr_epoch(&q, "afc-b");
	if (first > 0)
		diag("with allocation %d below kv_seen failing first", first);
	ok(r == 1 && n - 1 >= 10 && lost == 0 && e == e0,
	    "every key read again after a key of the watch found no memory: each of C's %d allocations below "
	    "kv_seen in the range failed in turn: %d nodes taken for gone%s, C's connection with B %s (epoch %08x, "
	    "then %08x)", n - 1, lost, r < 0 ? ", the watch never lost its key" : "", e == e0 ? "kept" : "LOST",
	    e0, e);
	if (lost > 0 || e != e0 || r < 0)
		harness_dump_log(&q.hc);
	gpx_close(q.c);
	harness_stop(&q.hc);
	harness_cleanup(&q.hc);
	munmap((void *)q.count, 4096);
	unlink(q.path);
}

static int
cluster_main(const char *shim, const char *path, const char *key)
{
	struct harness ha, hb;
	struct cl k = { .ha = &ha, .ghost_ttl = 990 };
	struct rm *m = &k.m;
	char conf[512], *json;
	long left, ghost;

	tries_max = 1000;
	if (getenv("GPX_ETCD") == NULL)
		tap_bail("--cluster needs GPX_ETCD, an etcd's URL (tests/alloc-fail-cluster.test starts one)");
	/* (first: A's checks below are to end within its lease's first renewal, 100 s after it starts) */
	cs_start_each(shim, path, key, "curl_global_init", 80, 7,
	    "each of the first 80 allocations but libcurl's global setup's, then every 7th");
	cs_start_each(shim, path, key, NULL, 1, 211, "every 211th allocation, libcurl's global setup's among them");

	cl_conf(conf, sizeof(conf), "afc-a", key);
	setenv("LD_PRELOAD", shim, 1);
	setenv("GPX_FAILALLOC", path, 1);
	if (harness_start(&ha, conf) < 0)
		tap_bail("cannot start gpxd A");
	unsetenv("LD_PRELOAD");
	unsetenv("GPX_FAILALLOC");
	cl_conf(conf, sizeof(conf), "afc-b", key);
	m->hb = &hb;
	if (harness_start(&hb, conf) < 0)
		tap_bail("cannot start gpxd B");
	if (rm_clients(m, ha.sock, hb.sock, "afc.b") < 0)
		tap_bail("the clients of A and B: %s", gpx_last_error(m->cb));
	struct gpx_connect_opts co = { .socket = ha.sock, .name = "alloc-fail-cluster-q", .eventfd = -1, .no_ring = 1 };
	if (gpx_connect_opts(&co, &k.cq) < 0)
		tap_bail("connect: %s", gpx_last_error(NULL));
	if (cl_ghost(&k) < 0 || cl_json(k.cq, &json) < 0)
		tap_bail("the cluster query, unarmed: %s", gpx_last_error(k.cq));
	k.nodes = cl_nodes(json, &left, &ghost);
	free(json);
	if (k.nodes != 3 || left <= 0)
		tap_bail("the cluster query, unarmed: %zu nodes (A, B and ghost), least time left %ld", k.nodes, left);
	/* A's watch has B's name within 3 s */
	if (rm_first_import(m, "afc.b", 30) < 0)
		tap_bail("A never imported B's cluster name afc.b: %s", gpx_last_error(m->ca));

	if (fail_each(&ha, "the cluster query (gpxctl cluster), each lease asked of etcd", op_cluster_query, &k) &&
	    fail_each(&ha, "an export to the cluster, imported by name on B and copied both ways, unexported",
	    op_cluster_export, &k))
		fail_each(&ha, "an import of B's cluster name by its bare name, copied both ways", op_cluster_import, &k);
	json = NULL;
	ok(gpxd_alive(&ha) && cl_json(k.cq, &json) == 0 && cl_nodes(json, &left, &ghost) == k.nodes,
	    "A answers the cluster query after them all");
	free(json);
	rr_each(shim, key);
	gpx_close(k.cq);
	rm_close(m);
	munmap((void *)countdown, 4096);
	unlink(path);
	unlink(key);
	harness_finish(&ha);
	return tap_done();
}

int
main(int argc, char **argv)
{
	static const struct { enum gpx_query what; const char *name; } kinds[] = {
		{ GPX_Q_STATUS, "status" }, { GPX_Q_CLIENTS, "clients" }, { GPX_Q_REGIONS, "regions" },
		{ GPX_Q_EXPORTS, "exports" }, { GPX_Q_TRANSFERS, "transfers" }, { GPX_Q_STATS, "stats" },
		{ GPX_Q_TOPO, "topo" }, { GPX_Q_PEERS, "peers" },
	};
	const char *san = getenv("GPX_SAN_CFLAGS"), *builddir = getenv("GPX_BUILDDIR");
	char shim[512], path[160];
	struct harness h;
	gpx_conn *holder = NULL, *c = NULL;
	int fds[NREGIONS], fd;
	void *mem[NREGIONS];
	gpx_region regs[NREGIONS];

	signal(SIGALRM, on_alarm);
	if (san != NULL && san[0] != '\0') {
		printf("1..0 # SKIP a sanitizer build: its runtime must come before an allocator preloaded into gpxd\n");
		return 0;
	}
	snprintf(shim, sizeof(shim), "%s/tests/.libs/failalloc.so", builddir ? builddir : ".");
	if (access(shim, R_OK) != 0)
		tap_bail("no %s (make check builds it)", shim);
	snprintf(path, sizeof(path), "%s/gpx-failalloc.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if ((fd = mkstemp(path)) < 0 || ftruncate(fd, 4096) < 0)
		tap_bail("cannot make the countdown file: %s", strerror(errno));
	countdown = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (countdown == MAP_FAILED)
		tap_bail("mmap: %s", strerror(errno));
	/* A fabric listening on a port of its own, with a peer where nothing listens: the peers'
	 * list has an entry for it (retried once an hour, so that no dial falls within a check) */
	char key[200], extra[512];
	int port = free_port();
	snprintf(key, sizeof(key), "%s.key", path);
	if (port < 0 || write_key(key) < 0)
		tap_bail("a port and a key for the fabric: %s", strerror(errno));
	if (argc > 1 && strcmp(argv[1], "--cluster") == 0)
		return cluster_main(shim, path, key);
	snprintf(extra, sizeof(extra), "[fabric]\nnode = alloc-fail\nlisten = 127.0.0.1:%d\npeers = 127.0.0.1:%d\n"
	    "key_file = %s\nretry_interval = 3600\ntimeout = 300\n", port, free_port(), key);
	setenv("LD_PRELOAD", shim, 1);
	setenv("GPX_FAILALLOC", path, 1);
	if (harness_start(&h, extra) < 0)
		tap_bail("cannot start gpxd");
	unsetenv("LD_PRELOAD");
	unsetenv("GPX_FAILALLOC");

	if (gpx_connect(h.sock, "alloc-fail-holder", &holder) < 0)
		tap_bail("connect: %s", gpx_last_error(NULL));
	for (int i = 0; i < NREGIONS; i++)
		if (gpx_host_alloc(4096, &fds[i], &mem[i]) < 0 ||
		    gpx_register_host(holder, fds[i], 0, 4096, 0, &regs[i]) < 0)
			tap_bail("region %d: %s", i, gpx_last_error(holder));
	if (gpx_export(holder, regs[0], "alloc-fail.export", NULL) < 0)
		tap_bail("export: %s", gpx_last_error(holder));
	static struct gpx_seg segs[BUSY_SEGS];
	void *bmem[2];
	int bfd[2];
	gpx_region breg[2];
	for (int i = 0; i < 2; i++)
		if (gpx_host_alloc(BUSY_LEN, &bfd[i], &bmem[i]) < 0 ||
		    gpx_register_host(holder, bfd[i], 0, BUSY_LEN, 0, &breg[i]) < 0)
			tap_bail("a region for the long copy: %s", gpx_last_error(holder));
	for (int i = 0; i < BUSY_SEGS; i++)
		segs[i] = (struct gpx_seg){ 0, 0, BUSY_LEN };
	if (gpx_copyv(holder, breg[0], breg[1], segs, BUSY_SEGS, BUSY_TAG) < 0)
		tap_bail("the long copy: %s", gpx_last_error(holder));
	struct gpx_connect_opts o = { .socket = h.sock, .name = "alloc-fail-query", .eventfd = -1, .no_ring = 1 };
	if (gpx_connect_opts(&o, &c) < 0)
		tap_bail("connect: %s", gpx_last_error(NULL));

	for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
		struct qarg a = { c, kinds[k].what, 0 };
		if (query_n(c, kinds[k].what, &a.entries) < 0)
			tap_bail("the %s query, unarmed: %s", kinds[k].name, gpx_last_error(c));
		if (!fail_each(&h, kinds[k].name, op_query, &a))
			break;
	}
	ok(gpxd_alive(&h) && query(c, GPX_Q_REGIONS) == 0, "gpxd answers a query after them all");

	static const struct { int (*fn)(void *); const char *name; } ops[] = {
		{ op_connect, "connect (Hello, its ring and segment area)" },
		{ op_register, "register and deregister host memory" },
		{ op_copy, "a copy of 1 MiB" }, { op_copyv, "a copy of 64 segments" },
		{ op_copyv_area, "a copy of 4,096 segments (the segment area)" },
		{ op_cancel, "a copy of 1 GiB, cancelled" },
		{ op_batch, "a batch of 8 pairs" }, { op_pages, "a copy of 64 pages" },
		{ op_export, "export, import by another connection, unexport" },
		{ op_reload, "a reload of the configuration" },
	};
	struct rq q = { .h = &h };
	if (gpx_connect(h.sock, "alloc-fail-req", &q.c) < 0 || gpx_connect(h.sock, "alloc-fail-other", &q.other) < 0 ||
	    gpx_host_alloc(1u << 20, &q.fa, (void **)&q.pa) < 0 || gpx_host_alloc(1u << 20, &q.fb, (void **)&q.pb) < 0 ||
	    gpx_register_host(q.c, q.fa, 0, 1u << 20, 0, &q.a) < 0 || gpx_register_host(q.c, q.fb, 0, 1u << 20, 0, &q.b) < 0)
		tap_bail("the requests' connections and regions: %s", gpx_last_error(q.c));
	for (size_t k = 0; k < sizeof(ops) / sizeof(ops[0]); k++)
		if (!fail_each(&h, ops[k].name, ops[k].fn, &q))
			break;
	admin_group_check(shim, path);

	/* Across the fabric, A (this gpxd) the exporter, then the importer, of B's memory */
	struct harness hb;
	struct rm m = { 0 };
	if (rm_open(&m, &h, &hb, port, key) < 0)
		tap_bail("a second gpxd, peered with the first");
	if (fail_each(&h, "a remote export, imported by the other node, copied both ways", op_export_remote, &m) &&
	    fail_each(&h, "an import of the other node's export (NODE:name), copied both ways", op_import_remote, &m)) {
		int n = rm_importers(&m);
		for (int i = 0; n != 0 && i < 50; i++) {
			usleep(100000);
			n = rm_importers(&m);
		}
		ok(n == 0, "each import of B's export was let go: B counts %d importers of it", n);
	}
	rm_close(&m);
	gpx_close(q.other);
	gpx_close(q.c);
	gpx_host_free(q.fa, q.pa, 1u << 20);
	gpx_host_free(q.fb, q.pb, 1u << 20);
	struct gpx_completion done;
	int r = gpx_cancel(holder, BUSY_TAG);
	r = r == 0 || r == -GPX_ENOENT ? gpx_wait_tag(holder, BUSY_TAG, &done, 60000) : r;
	ok(r == 0, "the long copy ends once cancelled (%s)", r == 0 ? gpx_strerror(done.status) : gpx_strerror(r));

	gpx_close(c);
	gpx_close(holder);
	for (int i = 0; i < NREGIONS; i++)
		gpx_host_free(fds[i], mem[i], 4096);
	for (int i = 0; i < 2; i++)
		gpx_host_free(bfd[i], bmem[i], BUSY_LEN);
	int left = harness_wait_fds(&h, h.baseline, 10000);
	ok(left == h.baseline, "every client gone: gpxd's descriptors back to %d (%d)", h.baseline, left);
	munmap((void *)countdown, 4096);
	unlink(path);
	unlink(key);
	harness_finish(&h);
	return tap_done();
}
