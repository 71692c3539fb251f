/*
 * The tenants' floods (tests/tenants.c runs them): connections that never say Hello, from four
 * processes of one uid, against connections_per_uid and a gpxd limited to 1,024 descriptors;
 * the daemon-wide cap on connections waiting for Hello (hello_max); and the descriptor reserve
 * with the table full (where a message's descriptor gpxd cannot take is refused busy under the
 * message's own request).  All along another uid connects and copies (a well-behaved tenant),
 * root's status queries are answered within a deadline, gpxd's CPU and descriptors stay
 * bounded and its log stays short.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/tenants.h"
#include "tests/util.h"

/* ---- the flood: connections that never say Hello ---- */

struct flood_arg {
	const char *sock;
	int hold;               /* connections each flooder keeps open */
	int churn;              /* then closes and reopens this many every 10 ms (0: just holds) */
};

struct flood_res {
	long connects;          /* connect() calls that succeeded */
	int held;               /* connections open at the peak */
};

/* Opens arg->hold connections as fast as gpxd lets it, then churns them until told to stop. */
static void
flooder(void *p, int out, int stop)
{
	struct flood_arg *a = p;
	struct flood_res r = { 0 };
	int *fds = calloc(a->hold, sizeof(int)), n = 0, head = 0;

	while (!stopped(stop)) {
		if (n == a->hold) {
			if (a->churn == 0) {
				msleep(10);
				continue;
			}
			for (int i = 0; i < a->churn; i++) {
				close(fds[head]);
				head = (head + 1) % a->hold;
				n--;
			}
		}
		int burst = n + (a->churn ? a->churn : 64) < a->hold ? (a->churn ? a->churn : 64) : a->hold - n;
		for (int i = 0; i < burst; i++) {
			int s = sock_to(a->sock, true);
			if (s < 0) {
				msleep(1);     /* backlog full (EAGAIN) or out of descriptors */
				break;
			}
			fds[(head + n) % a->hold] = s;
			n++;
			r.connects++;
		}
		if (n > r.held)
			r.held = n;
		if (n == a->hold && a->churn)
			msleep(10);
	}
	(void)!write(out, &r, sizeof(r));
}

/* ---- a well-behaved tenant that connects, registers, copies and leaves, again and again ---- */

struct victim_arg {
	const char *sock;
	double secs;
	int expect;             /* 0: success expected; else the refusal status expected (GPX_E*) */
};

struct victim_res {
	int rounds, bad;
	double worst_ms;        /* the slowest round, connect to close */
	int last_err;
	char err[160];
};

static void
victim(void *p, int out, int stop)
{
	struct victim_arg *a = p;
	struct victim_res r = { 0 };
	unsigned char *pa, *pb;
	int fa, fb;
	double end = now() + a->secs;

	(void)stop;
	if (gpx_host_alloc(65536, &fa, (void **)&pa) < 0 || gpx_host_alloc(65536, &fb, (void **)&pb) < 0)
		_exit(97);
	while (now() < end) {
		double t0 = now();
		gpx_conn *c;
		gpx_region ra, rb;
		int e = gpx_connect(a->sock, "victim", &c);
		if (e == 0) {
			memset(pa, r.rounds & 0xff, 4096);
			pa[17] = 0x5a;
			memset(pb, 0, 4096);
			if ((e = gpx_register_host(c, fa, 0, 65536, 0, &ra)) == 0 &&
			    (e = gpx_register_host(c, fb, 0, 65536, 0, &rb)) == 0 &&
			    (e = gpx_copy_sync(c, ra, 0, rb, 0, 4096)) == 0 && memcmp(pa, pb, 4096) != 0)
				e = -GPX_EIO;
			if (e < 0)
				snprintf(r.err, sizeof(r.err), "%s", gpx_last_error(c));
			gpx_close(c);
		} else
			snprintf(r.err, sizeof(r.err), "connect: %s", gpx_strerror(e));
		double ms = (now() - t0) * 1e3;
		if (ms > r.worst_ms)
			r.worst_ms = ms;
		if (e != 0)
			r.last_err = e;
		if (e == -a->expect)
			r.rounds++;
		else
			r.bad++;
		msleep(20);
	}
	(void)!write(out, &r, sizeof(r));
}

/* ---- root's view: a status query within a deadline ---- */

/* Connects, says Hello (queries only) and asks for the status, all within timeout_ms; 0 or -1. */
static int
root_status(const struct harness *h, int timeout_ms)
{
	struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Hello hello = GPX__HELLO__INIT;
	Gpx__Query q = GPX__QUERY__INIT;
	double end = now() + timeout_ms / 1e3;
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0), r = -1;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", h->sock);
	/* SO_SNDTIMEO bounds a connect that waits for room in a full backlog. */
	setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		close(s);
		return -1;
	}
	hello.version = GPX_PROTO_VERSION;
	hello.name = (char *)"root-query";
	hello.no_ring = true;
	m.seq = 1;
	m.body_case = GPX__CLIENT_MSG__BODY_HELLO;
	m.hello = &hello;
	Gpx__DaemonMsg *d = NULL;
	if (harness_send(s, &m, NULL, 0) == 0 &&
	    (d = harness_recv(s, (int)((end - now()) * 1e3) + 1, NULL, NULL, NULL)) != NULL &&
	    d->reply->status == 0) {
		gpx__daemon_msg__free_unpacked(d, NULL);
		q.what = GPX__QUERY_WHAT__Q_STATUS;
		m.seq = 2;
		m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
		m.query = &q;
		if (harness_send(s, &m, NULL, 0) == 0 &&
		    (d = harness_recv(s, (int)((end - now()) * 1e3) + 1, NULL, NULL, NULL)) != NULL)
			r = d->reply->status == 0 && d->reply->query != NULL && d->reply->query->status != NULL ? 0 : -1;
	}
	if (d != NULL)
		gpx__daemon_msg__free_unpacked(d, NULL);
	close(s);
	return r;
}

static int
log_lines(const struct harness *h)
{
	FILE *f = fopen(h->log, "r");
	int n = 0, ch;

	if (f == NULL)
		return -1;
	while ((ch = getc(f)) != EOF)
		n += ch == '\n';
	fclose(f);
	return n;
}

static int
log_count(const struct harness *h, const char *needle)
{
	char line[2048];
	FILE *f = fopen(h->log, "r");
	int n = 0;

	if (f == NULL)
		return -1;
	while (fgets(line, sizeof(line), f) != NULL)
		n += strstr(line, needle) != NULL;
	fclose(f);
	return n;
}

/* The lines of gpxd's log that contain needle, as comments. */
static void
log_show(const struct harness *h, const char *needle)
{
	char line[2048];
	FILE *f = fopen(h->log, "r");

	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		if (strstr(line, needle) != NULL)
			diag("%.*s", (int)strcspn(line, "\n"), line);
	if (f != NULL)
		fclose(f);
}

/* CPU seconds gpxd has used (utime + stime of /proc/PID/stat). */
static double
daemon_cpu(const struct harness *h)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)h->pid);
	long t = proc_stat_ticks(path, NULL);
	return t < 0 ? -1 : (double)t / sysconf(_SC_CLK_TCK);
}

/*
 * Watches a flood for `secs`: gpxd's descriptor peak, and root's status queries (one every
 * 300 ms, each within 2 s).  Returns the peak.
 */
static int
watch(const struct harness *h, double secs, int *queries, int *answered)
{
	double end = now() + secs, next = now();
	int peak = 0;

	*queries = *answered = 0;
	while (now() < end) {
		int n = harness_fds(h);
		if (n > peak)
			peak = n;
		if (now() >= next) {
			(*queries)++;
			*answered += root_status(h, 2000) == 0;
			next = now() + 0.3;
		}
		msleep(5);
	}
	return peak;
}

/* The flood: 4 x 3,000 silent connections of one uid against connections_per_uid = 8. */
void
test_flood(void)
{
	struct harness F;
	struct child fl[4], vi;
	struct flood_arg fa = { .hold = 3000, .churn = 50 };
	struct victim_arg va = { .secs = 3.0 };
	struct flood_res fr[4];
	struct victim_res vr;
	const int limit = 8;
	int queries, answered;

	if (harness_start_nofile(&F, "[limits]\nconnections_per_uid = 8\n", 1024) < 0)
		tap_bail("cannot start gpxd");
	int lines0 = log_lines(&F);
	fa.sock = va.sock = F.sock;
	for (int i = 0; i < 4; i++)
		child_start(&fl[i], UID_A, UID_A, NULL, 0, 4096, flooder, &fa);
	msleep(200);
	child_start(&vi, UID_B, UID_B, NULL, 0, 0, victim, &va);
	int peak = watch(&F, 4.0, &queries, &answered);
	bool vgot = child_wait(&vi, &vr, sizeof(vr), 15000);
	long connects = 0;
	int held = 0;
	for (int i = 0; i < 4; i++) {
		child_stop(&fl[i]);
		if (child_wait(&fl[i], &fr[i], sizeof(fr[i]), 10000)) {
			connects += fr[i].connects;
			held += fr[i].held;
		}
	}
	diag("flood: %ld connections opened by uid %d (%d held at once); gpxd's descriptors peaked at %d "
	    "(baseline %d, limit 1024)", connects, UID_A, held, peak, F.baseline);
	ok(held >= 12000, "four processes of uid %d held %d connections that never said Hello", UID_A, held);
	ok(peak <= F.baseline + 2 * limit + 32, "gpxd's descriptors stayed bounded: peak %d, baseline %d + 2 x %d "
	    "connections + 32", peak, F.baseline, limit);
	ok(vgot && vr.bad == 0 && vr.rounds >= 10, "meanwhile uid %d connected, registered and copied %d times "
	    "(%d failed%s%s)", UID_B, vgot ? vr.rounds : 0, vgot ? vr.bad : -1, vgot && vr.bad ? ": " : "",
	    vgot && vr.bad ? vr.err : "");
	ok(vgot && vr.worst_ms < 1000, "each of its rounds took under a second (slowest %.1f ms)",
	    vgot ? vr.worst_ms : -1.0);
	ok(queries > 0 && answered == queries, "root's status queries were answered within 2 s: %d of %d",
	    answered, queries);
	int settled = harness_wait_fds(&F, F.baseline, 10000);
	ok(settled == F.baseline, "after the flood gpxd is back to its baseline descriptors (%d)", settled);
	int lines = log_lines(&F) - lines0;
	ok(lines <= 150, "gpxd wrote %d log lines during the flood (at most 150)", lines);
	for (int i = 0; i < 80 && log_count(&F, "lines suppressed") < 1; i++)
		msleep(100);
	ok(log_count(&F, "lines suppressed") >= 1, "and said how many it suppressed");
	log_show(&F, "lines suppressed");
	ok(harness_stop(&F) == 0, "gpxd stops cleanly");
	if (tap_failed)
		harness_dump_log(&F);
	harness_cleanup(&F);
}

/* One uid with a high connection limit holds hundreds of silent connections: hello_max. */
void
test_hello_max(void)
{
	struct harness F;
	struct child fl, vi;
	struct flood_arg fa = { .hold = 900, .churn = 0 };
	struct victim_arg va = { .secs = 2.0 };
	struct flood_res fr;
	struct victim_res vr;
	int queries, answered;

	if (harness_start_nofile(&F, "[limits]\nconnections_per_uid = 4096\nhello_max = 16\n", 1024) < 0)
		tap_bail("cannot start gpxd");
	fa.sock = va.sock = F.sock;
	child_start(&fl, UID_A, UID_A, NULL, 0, 4096, flooder, &fa);
	msleep(300);
	child_start(&vi, UID_B, UID_B, NULL, 0, 0, victim, &va);
	int peak = watch(&F, 3.0, &queries, &answered);
	bool vgot = child_wait(&vi, &vr, sizeof(vr), 15000);
	child_stop(&fl);
	bool fgot = child_wait(&fl, &fr, sizeof(fr), 10000);
	ok(fgot && fr.held >= 900, "uid %d held %d silent connections (connections_per_uid 4096, hello_max 16)",
	    UID_A, fgot ? fr.held : -1);
	ok(peak <= F.baseline + 2 * 16 + 32, "gpxd's descriptors stayed bounded: peak %d, baseline %d + 2 x 16 + 32",
	    peak, F.baseline);
	ok(vgot && vr.bad == 0 && vr.rounds >= 10, "uid %d still connected and copied %d times (%d failed%s%s)",
	    UID_B, vgot ? vr.rounds : 0, vgot ? vr.bad : -1, vgot && vr.bad ? ": " : "", vgot && vr.bad ? vr.err : "");
	ok(queries > 0 && answered == queries, "root's status queries were answered: %d of %d", answered, queries);
	ok(harness_wait_fds(&F, F.baseline, 10000) == F.baseline && harness_stop(&F) == 0,
	    "gpxd returns to its baseline and stops cleanly");
	if (tap_failed)
		harness_dump_log(&F);
	harness_cleanup(&F);
}

/* The table full: root is answered from the reserve, others refused at once, accept backs off. */
void
test_reserve(void)
{
	struct harness F;
	struct child fl, vi;
	struct flood_arg fa = { .hold = 1000, .churn = 0 };
	struct victim_arg va = { .secs = 1.0, .expect = GPX_EBUSY };
	struct flood_res fr;
	struct victim_res vr;
	int queries, answered, held[48], nheld = 0;

	if (harness_start_nofile(&F, "[limits]\nconnections_per_uid = 100000\nhello_max = 100000\n", 256) < 0)
		tap_bail("cannot start gpxd");
	int lines0 = log_lines(&F);
	fa.sock = va.sock = F.sock;
	child_start(&fl, UID_A, UID_A, NULL, 0, 4096, flooder, &fa);
	msleep(500);
	watch(&F, 1.5, &queries, &answered);
	ok(queries > 0 && answered == queries, "with gpxd's descriptor table full, root's status queries are answered "
	    "(%d of %d within 2 s)", answered, queries);
	/* Root's client, in through the reserve, with a memfd to register once the table is full. */
	gpx_conn *rc = NULL;
	void *hp = NULL;
	int hfd = -1;
	if (gpx_connect(F.sock, "reserve-root", &rc) < 0 || gpx_host_alloc(4096, &hfd, &hp) < 0)
		tap_bail("root's client or its memfd");
	child_start(&vi, UID_B, UID_B, NULL, 0, 0, victim, &va);
	bool vgot = child_wait(&vi, &vr, sizeof(vr), 15000);
	ok(vgot && vr.rounds >= 1 && vr.bad == 0 && vr.worst_ms < 1000, "another uid is refused at once with EBUSY, "
	    "not left waiting (%d refusals, slowest %.1f ms, last: %s)", vgot ? vr.rounds : 0, vgot ? vr.worst_ms : -1.0,
	    vgot ? vr.err : "no answer");
	/* Root takes every reserved descriptor, and more: then accept has nothing left and backs off. */
	for (nheld = 0; nheld < 48; nheld++)
		if ((held[nheld] = sock_to(F.sock, true)) < 0)
			break;
	msleep(300);
	double cpu0 = daemon_cpu(&F), t0 = now();
	msleep(1500);
	double cpu = (daemon_cpu(&F) - cpu0) / (now() - t0);
	ok(cpu >= 0 && cpu < 0.25, "with nothing left to accept with, gpxd does not spin: %.0f%% of a CPU", cpu * 100);
	/* A message whose descriptor gpxd has no slot for is refused under its own request, at once. */
	gpx_region reg;
	double r0 = now();
	int rr = gpx_register_host(rc, hfd, 0, 4096, 0, &reg);
	double rms = (now() - r0) * 1e3;
	ok(rr == -GPX_EBUSY && strstr(gpx_last_error(rc), "out of file descriptors") != NULL && rms < 5000,
	    "root's registration, its memfd with no slot left in gpxd's table, is refused busy in %.0f ms, not left "
	    "waiting (%s)", rms, rr < 0 ? gpx_last_error(rc) : "registered");
	child_stop(&fl);
	bool fgot = child_wait(&fl, &fr, sizeof(fr), 10000);
	diag("uid %d held %d connections", UID_A, fgot ? fr.held : -1);
	for (int i = 0; i < nheld; i++)
		close(held[i]);
	ok(gpx_register_host(rc, hfd, 0, 4096, 0, &reg) == 0, "the same registration succeeds once descriptors are "
	    "free (%s)", gpx_last_error(rc));
	gpx_close(rc);
	gpx_host_free(hfd, hp, 4096);
	ok(harness_wait_fds(&F, F.baseline, 10000) == F.baseline, "after the flood gpxd is back to its baseline "
	    "descriptors (the reserve held again)");
	int lines = log_lines(&F) - lines0;
	int acc = log_count(&F, "out of file descriptors (limit") + log_count(&F, "Too many open files");
	log_show(&F, "file descriptors (limit");
	log_show(&F, "Too many open files");
	log_show(&F, "descriptors free again");
	ok(acc >= 1 && acc <= 4, "the shortage was logged %d times, not once per attempt (%d lines in all)", acc, lines);
	va.expect = 0;
	va.secs = 0.5;
	child_start(&vi, UID_B, UID_B, NULL, 0, 0, victim, &va);
	vgot = child_wait(&vi, &vr, sizeof(vr), 15000);
	ok(vgot && vr.rounds >= 1 && vr.bad == 0, "then another uid is admitted again and copies (%d rounds, %d failed%s%s)",
	    vgot ? vr.rounds : 0, vgot ? vr.bad : -1, vgot && vr.bad ? ": " : "", vgot && vr.bad ? vr.err : "");
	ok(harness_stop(&F) == 0, "gpxd stops cleanly");
	if (tap_failed)
		harness_dump_log(&F);
	harness_cleanup(&F);
}
