/*
 * The integration tests' lifetimes (tests/integ.c runs them): a client that leaves or is
 * killed with work queued and what gpxd gives back, the per-uid limits and the idle timeout
 * (on daemons of their own), and gpxd itself stopped with work in flight, restarted on the
 * same socket, and killed.
 */
#include "config.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#include "client-lib/gpx.h"
#include "proto/ring.h"
#include "tests/harness.h"
#include "tests/integ.h"
#include "tests/tclient.h"
#include "tests/tap.h"
#include "tests/util.h"

/* ---- disconnect cleanup ---- */

static bool
export_listed(const char *name)
{
	gpx_conn *q = NULL;
	struct gpx_connect_opts o = { .socket = H.sock, .name = "integ-query", .eventfd = -1, .no_ring = 1 };
	void *buf;
	size_t len;
	bool found = false;

	if (gpx_connect_opts(&o, &q) < 0)
		return true;
	if (gpx_query(q, GPX_Q_EXPORTS, &buf, &len) == 0) {
		Gpx__QueryReply *r = gpx__query_reply__unpack(NULL, len, buf);
		for (size_t i = 0; r != NULL && i < r->n_exports; i++)
			found = found || strcmp(r->exports[i]->name, name) == 0;
		if (r != NULL)
			gpx__query_reply__free_unpacked(r, NULL);
		free(buf);
	} else
		found = true;
	gpx_close(q);
	return found;
}

static bool
wait_unlisted(const char *name)
{
	for (int i = 0; i < WAIT_MS / 10; i++) {
		if (!export_listed(name))
			return true;
		usleep(10000);
	}
	return false;
}

/* Registrations, exports (one notifying), queued work: everything a client can hold. */
static int
load_client(gpx_conn *c, struct buf *b, int nb, const char *prefix)
{
	char name[64];

	for (int i = 0; i < nb; i++)
		if (buf_new(&b[i], 8u << 20) < 0 || buf_reg(c, &b[i], 0) < 0)
			return -1;
	struct gpx_export_opts n = { .rule = GPX_EXPORT_ANY, .notify = 1, .notify_tag = 1 };
	struct gpx_export_opts p = { .rule = GPX_EXPORT_ANY };
	snprintf(name, sizeof(name), "%s.notify", prefix);
	if (gpx_export(c, b[0].r, name, &n) < 0)
		return -1;
	snprintf(name, sizeof(name), "%s.plain", prefix);
	if (gpx_export(c, b[1].r, name, &p) < 0)
		return -1;
	for (int t = 0; t < 40; t++)
		if (gpx_copy(c, b[t % nb].r, 0, b[(t + 1) % nb].r, 0, b[0].len, t) < 0)
			return -1;
	return 0;
}

void
test_disconnect(void)
{
	struct buf bx[3];
	char name[64];
	gpx_conn *y = client("integ-survivor"), *x;
	gpx_region imp;

	/* Y stays connected and imports X's notifying export, holding a reference to X's region. */
	int with_y = harness_fds(&H);
	if (y == NULL || (x = client("integ-leaver")) == NULL || load_client(x, bx, 3, "integ.leaver") < 0)
		tap_bail("cannot set up the disconnect test");
	ok(gpx_import(y, "integ.leaver.notify", &imp, NULL) == 0, "a second client imports the leaver's export");
	ok(export_listed("integ.leaver.notify") && export_listed("integ.leaver.plain"), "the leaver's exports are listed");
	gpx_close(x);
	for (int i = 0; i < 3; i++)
		buf_free(&bx[i]);
	ok(wait_unlisted("integ.leaver.notify") && wait_unlisted("integ.leaver.plain"),
	    "after it closes with queued work, its exports are gone from gpx_query");
	int n = harness_wait_fds(&H, with_y, WAIT_MS);
	ok(n == with_y, "gpxd holds none of its descriptors, though another client still imports its region (%d, want %d)",
	    n, with_y);
	ok(gpx_copy_sync(y, imp, 0, imp, 0, 1) == -GPX_EREVOKED, "the importer's handle is revoked");
	gpx_close(y);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");

	/* The same, killed with SIGKILL in the middle of its work. */
	int p[2];
	if (pipe(p) < 0)
		tap_bail("pipe");
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		struct buf bk[3];
		gpx_conn *k = client("integ-killed");
		char v = k != NULL && load_client(k, bk, 3, "integ.killed") == 0;
		(void)!write(p[1], &v, 1);
		for (;;)
			pause();
	}
	close(p[1]);
	char v = 0;
	(void)!read(p[0], &v, 1);
	close(p[0]);
	ok(v == 1 && export_listed("integ.killed.plain"), "a child client registers, exports and queues work");
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	snprintf(name, sizeof(name), "integ.killed.notify");
	ok(wait_unlisted(name) && wait_unlisted("integ.killed.plain"), "after SIGKILL its exports are gone");
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline after SIGKILL");
	ok(harness_clients(&H) == 1, "gpxd counts no client but the asking one");
}

/* ---- per-uid limits and the idle timeout, on daemons of their own ---- */

static int
connect_to(const struct harness *h, gpx_conn **c)
{
	int r = gpx_connect(h->sock, "integ-limits", c);

	if (r == 0)
		(void)gpx_cancel(*c, UINT64_MAX);
	return r;
}

void
test_limits(void)
{
	struct harness L;
	struct buf b[6];
	gpx_conn *c[4] = { NULL };
	gpx_region r5, imp;
	int r[4];

	if (harness_start(&L, "[limits]\nconnections_per_uid = 3\nregions_per_uid = 4\n"
	    "region_bytes_per_uid = 256K\nexports_per_uid = 1\n") < 0)
		tap_bail("cannot start a second gpxd");
	for (int i = 0; i < 4; i++)
		r[i] = connect_to(&L, &c[i]);
	ok(r[0] == 0 && r[1] == 0 && r[2] == 0 && r[3] == -GPX_EQUOTA,
	    "3 connections per uid: the 4th is refused (%s)", gpx_strerror(r[3]));
	if (geteuid() == 0) {
		int p[2], v = 1000;
		if (pipe(p) < 0)
			tap_bail("pipe");
		fflush(NULL);
		pid_t pid = fork();
		if (pid == 0) {
			gpx_conn *o = NULL;
			int e = setgid(1010) < 0 || setuid(1010) < 0 ? -1000 : gpx_connect(L.sock, "integ-other", &o);
			(void)!write(p[1], &e, sizeof(e));
			_exit(0);
		}
		close(p[1]);
		(void)!read(p[0], &v, sizeof(v));
		close(p[0]);
		waitpid(pid, NULL, 0);
		ok(v == 0, "meanwhile another uid connects (%s)", gpx_strerror(v));
	} else
		tap_skip(1, "another uid: needs root");
	if (c[0] == NULL || c[1] == NULL)
		tap_bail("limit test: no connection");
	for (int i = 0; i < 6; i++)
		if (buf_new(&b[i], i < 4 ? 32768 : 200 << 10) < 0)
			tap_bail("memfd");
	int good = 0;
	for (int i = 0; i < 4; i++)
		good += buf_reg(c[i % 2], &b[i], 0) == 0;
	ok(good == 4, "4 regions over two connections of one uid");
	ok(gpx_register_host(c[1], b[4].fd, 0, 4096, 0, &r5) == -GPX_EQUOTA, "a 5th region of that uid is refused EQUOTA");
	struct gpx_export_opts any = { .rule = GPX_EXPORT_ANY };
	ok(gpx_export(c[0], b[0].r, "integ.quota.1", &any) == 0 && gpx_import(c[1], "integ.quota.1", &imp, NULL) == -GPX_EQUOTA,
	    "an import counts as a region: refused at the limit");
	ok(gpx_export(c[0], b[2].r, "integ.quota.2", &any) == -GPX_EQUOTA, "a second export of the uid is refused EQUOTA");
	ok(gpx_deregister(c[0], b[2].r) == 0 && gpx_register_host(c[0], b[4].fd, 0, 200 << 10, 0, &r5) == -GPX_EQUOTA,
	    "after a deregistration, 200 KiB more would pass the 256 KiB limit: EQUOTA");
	ok(gpx_register_host(c[0], b[5].fd, 0, 160 << 10, 0, &r5) == 0, "160 KiB more reaches the limit exactly: allowed");
	ok(gpx_register_host(c[1], b[4].fd, 0, 1, 0, &r5) == -GPX_EQUOTA, "and then not one byte more");
	gpx_close(c[0]);
	c[0] = NULL;
	for (int i = 0; i < WAIT_MS / 10 && (r[3] = connect_to(&L, &c[3])) == -GPX_EQUOTA; i++)
		usleep(10000);
	ok(r[3] == 0, "a closed connection gives its quota back: a new one connects");
	ok(gpx_register_host(c[3], b[5].fd, 0, 160 << 10, 0, &r5) == 0 && gpx_export(c[3], r5, "integ.quota.3", &any) == 0,
	    "and its regions, bytes and export are back too");
	for (int i = 0; i < 4; i++)
		gpx_close(c[i]);
	for (int i = 0; i < 6; i++)
		buf_free(&b[i]);
	ok(harness_wait_fds(&L, L.baseline, WAIT_MS) == L.baseline && harness_stop(&L) == 0,
	    "that gpxd returns to its baseline and stops cleanly");
	harness_cleanup(&L);

	/*
	 * Idle connections: closed after idle_timeout, with or without Hello, while a client that
	 * keeps copying stays.  gpxd looks once a second, so a close comes between the timeout and
	 * a second after it (and a margin for a slow machine); a connection without Hello is
	 * closed so before the Hello timeout (5 s) could do it.
	 */
	const double idle = 2, late = 2;
	if (harness_start(&L, "[daemon]\nidle_timeout = 2\n[limits]\ninflight_per_uid = 2\n") < 0)
		tap_bail("cannot start a third gpxd");
	gpx_conn *busy = NULL;
	struct buf bb;
	if (gpx_connect(L.sock, "integ-busy", &busy) < 0 || buf_new(&bb, 65536) < 0 || buf_reg(busy, &bb, 0) < 0)
		tap_bail("cannot set up the busy client");
	double t2 = now();
	int s2 = harness_connect(&L), s1 = harness_connect(&L);
	Gpx__DaemonMsg *m = harness_hello(s1, GPX_PROTO_VERSION, -1, NULL);
	double t1 = now(), gone1 = 0, gone2 = 0, next = t1;
	ok(m != NULL && m->reply->status == 0, "a client says Hello, then nothing");
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	int copies = 0, failed = 0;
	while ((gone1 == 0 || gone2 == 0 || now() - t1 < 2 * idle + late) && now() - t1 < 4 * idle) {
		bool eof = false;
		if (gone1 == 0) {
			if ((m = harness_recv(s1, 20, NULL, NULL, &eof)) != NULL)
				gpx__daemon_msg__free_unpacked(m, NULL);
			if (eof)
				gone1 = now() - t1;
		}
		if (gone2 == 0) {
			eof = false;
			if ((m = harness_recv(s2, 20, NULL, NULL, &eof)) != NULL)
				gpx__daemon_msg__free_unpacked(m, NULL);
			if (eof)
				gone2 = now() - t2;
		}
		if (now() >= next) {
			bb.p[0]++;
			failed += gpx_copy_sync(busy, bb.r, 0, bb.r, 4096, 1) != 0 || bb.p[4096] != bb.p[0];
			copies++;
			next += 0.25;
		}
	}
	ok(gone1 >= idle - 0.05 && gone1 < idle + late,
	    "it is closed after the idle timeout: %.2f s after its Hello (idle_timeout %.0f s, bound %.1f s)", gone1,
	    idle, idle + late);
	ok(gone2 >= idle - 0.05 && gone2 < idle + late,
	    "so is one that never says Hello: %.2f s after it connected (before the 5 s Hello timeout)", gone2);
	ok(copies > 0 && failed == 0 && gpx_copy_sync(busy, bb.r, 0, bb.r, 8192, 1) == 0,
	    "a client that copies every 250 ms stays connected over %.0f s (%d copies, %d failed)", now() - t1, copies,
	    failed);

	/*
	 * inflight_per_uid = 2: three copies of 8 GiB (8,192 segments of 1 MiB) in a row, and the
	 * third is refused with EBUSY: they come in that order over the socket, and the first two
	 * run for seconds, far longer than the submissions take.  (A single-segment copy would
	 * come through the submission queue, which gpxd may read first; done at once, it would
	 * leave its place free.)
	 */
	struct buf lb;
	static struct gpx_seg many[8192];
	struct gpx_completion lc;
	int refused = 0, other = 0;
	if (buf_new(&lb, 2 << 20) < 0 || buf_reg(busy, &lb, 0) < 0)
		tap_bail("cannot set up the inflight test");
	for (int i = 0; i < 8192; i++)
		many[i] = (struct gpx_seg){ 0, 1 << 20, 1 << 20 };
	int sub = (gpx_copyv(busy, lb.r, lb.r, many, 8192, 501) == 0) + (gpx_copyv(busy, lb.r, lb.r, many, 8192, 502) == 0) +
	    (gpx_copyv(busy, lb.r, lb.r, many, 8192, 503) == 0);
	/* The third's answer is taken before any cancel is sent (so no cancel can make room for
	 * it, whatever gpxd's order), and what each ended with is said (under memcheck on a loaded
	 * machine this once read no refusal, and nothing said why). */
	const int w503 = gpx_wait_tag(busy, 503, &lc, WAIT_MS);
	const int s503 = w503 == 0 ? lc.status : w503;
	refused = w503 == 0 && lc.status == -GPX_EBUSY;
	for (uint64_t t = 501; t <= 503; t++)
		(void)gpx_cancel(busy, t);
	for (uint64_t t = 501; t <= 503; t++) {
		if (t == 503 && w503 == 0)
			continue;
		int w = gpx_wait_tag(busy, t, &lc, WAIT_MS);
		if (w != 0 || (lc.status != 0 && lc.status != -GPX_ECANCELED)) {
			other++;
			diag("copy %llu ended: %s", (unsigned long long)t, gpx_strerror(w != 0 ? w : lc.status));
		}
	}
	ok(sub == 3 && refused == 1 && other == 0,
	    "inflight_per_uid = 2: of three long copies submitted together the third is refused with EBUSY "
	    "(%d submitted, the third: %s; %d others ended otherwise than whole or cancelled)", sub,
	    s503 == 0 ? "whole" : gpx_strerror(s503), other);
	buf_free(&lb);

	/*
	 * A client that sends nothing while a copy of its runs is not idle: a copy of 256 GiB
	 * (8,192 segments of 32 MiB, tens of seconds for two copy workers) is left running for
	 * idle_timeout and a margin, then cancelled; the cancel must reach gpxd and the copy end
	 * cancelled (or whole), not with the connection gone.
	 */
	static struct gpx_seg huge[8192];
	struct buf hb;
	if (buf_new(&hb, 64 << 20) < 0 || buf_reg(busy, &hb, 0) < 0)
		tap_bail("cannot set up the long copy");
	for (int i = 0; i < 8192; i++)
		huge[i] = (struct gpx_seg){ 0, 32 << 20, 32 << 20 };
	int hsub = gpx_copyv(busy, hb.r, hb.r, huge, 8192, 601);
	usleep((useconds_t)((idle + late) * 1e6));
	int hcancel = hsub == 0 ? gpx_cancel(busy, 601) : hsub;
	int hw = hsub == 0 ? gpx_wait_tag(busy, 601, &lc, WAIT_MS) : hsub;
	ok(hsub == 0 && hcancel == 0 && hw == 0 && (lc.status == 0 || lc.status == -GPX_ECANCELED),
	    "a client silent for %.0f s while its copy runs is not idle: the copy is cancelled then, not cut off "
	    "(submit: %s, cancel: %s, the copy: %s)", idle + late, gpx_strerror(hsub), gpx_strerror(hcancel),
	    gpx_strerror(hw != 0 ? hw : lc.status));
	buf_free(&hb);
	gpx_close(busy);
	buf_free(&bb);
	close(s1);
	close(s2);
	ok(harness_wait_fds(&L, L.baseline, WAIT_MS) == L.baseline && harness_stop(&L) == 0,
	    "that gpxd returns to its baseline and stops cleanly");
	harness_cleanup(&L);
}

/* ---- SIGTERM with work in flight, a restart, and a SIGKILL ---- */

/*
 * SIGTERM while a client's submission queue holds more than one turn of the loop takes: gpxd
 * takes every queued submission before it closes the connection, so that each ends once and
 * none goes unanswered with the connection.  The 16,384 here copy nothing, and end at their
 * check, so none is ever in flight: gpxd's wait for transfers in flight does not keep it up
 * meanwhile (test_stop_restart checks 32 copies, which one turn takes).
 */
void
test_stop_drains_queue(void)
{
	struct harness Lh, *L = &Lh;
	struct raw w;
	int twice = 0, strange = 0;

	if (harness_start(L, "[daemon]\nring_entries = 16384\n") < 0 || raw_open_on(&w, L, GPX_PROTO_VERSION) < 0)
		tap_bail("drain test: no gpxd or no raw client");
	uint8_t *seen = calloc(w.entries + 1, 1);
	for (uint32_t i = 0; i < w.entries; i++)
		*gpx_sq_slot(w.ring, w.entries, i) = (struct gpx_sqe){ .tag = 1 + i, .src_region = w.region,
		    .dst_region = w.region, .src_offset = 0, .dst_offset = 32768, .length = 0 };
	if (raw_kick(&w, w.entries) < 0)
		tap_bail("drain test: the kick");
	/* SIGTERM once gpxd has begun: one turn takes a few thousand. */
	for (int i = 0; i < 25000 && ring_head(&w) == 0; i++)
		usleep(200);
	const uint64_t at_term = ring_head(&w);
	int st = harness_stop(L);
	const uint64_t records = ring_head(&w);
	for (uint64_t i = 0; i < records && i < w.entries; i++) {
		const struct gpx_cqe *e = gpx_ring_slot(w.ring, i);
		if (e->tag < 1 || e->tag > w.entries || e->status != 0)
			strange++;
		else
			twice += seen[e->tag]++ > 0;
	}
	ok(st == 0 && at_term < w.entries && records == w.entries && twice == 0 && strange == 0, "SIGTERM with %llu of "
	    "%u queued submissions taken: each ended once before the connection closed (%llu records, %d twice, %d "
	    "strange; status %d)", (unsigned long long)at_term, w.entries, (unsigned long long)records, twice, strange,
	    st);
	free(seen);
	raw_close(&w);
	if (tap_failed)
		harness_dump_log(L);
	harness_cleanup(L);
}

void
test_stop_restart(void)
{
	const size_t len = 8u << 20;
	const int n = 32;
	struct buf a, b;
	struct gpx_completion e[64];
	gpx_conn *c = client("integ-at-stop");
	gpx_region old;

	if (c == NULL || buf_new(&a, len) < 0 || buf_new(&b, len) < 0 || buf_reg(c, &a, 0) < 0 ||
	    buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the stop test");
	old = a.r;
	int sent = 0;
	for (int t = 0; t < n; t++)
		sent += gpx_copy(c, a.r, 0, b.r, 0, len, t) == 0;
	int st = harness_stop(&H);
	ok(sent == n && st == 0, "gpxd stops on SIGTERM with %d transfers queued, status 0 (got %d)", n, st);
	int seen[32] = { 0 }, got = 0, bad = 0, r;
	while ((r = gpx_wait(c, e, 64, WAIT_MS)) > 0)
		for (int i = 0; i < r; i++, got++) {
			if (e[i].tag >= (uint64_t)n || (e[i].status != 0 && e[i].status != -GPX_ESHUTDOWN))
				bad++;
			else
				seen[e[i].tag]++;
		}
	for (int i = 0; i < n; i++)
		bad += seen[i] != 1;
	ok(got == n && bad == 0, "each queued transfer ended once, complete or ESHUTDOWN (%d of %d)", got, n);
	ok(r == -GPX_ECONN, "then the client learns the daemon is gone (%s)", gpx_strerror(r));
	ok(gpx_copy(c, a.r, 0, b.r, 0, 1, 99) == -GPX_ECONN, "and further requests fail with ECONN");
	gpx_close(c);

	if (harness_respawn(&H) < 0)
		tap_bail("cannot restart gpxd");
	c = client("integ-after-restart");
	ok(c != NULL && buf_reg(c, &a, 0) == 0, "after a restart on the same socket a client reconnects and registers");
	int e1 = gpx_copy_sync(c, old, 0, a.r, 0, 1), e2 = gpx_copy_sync(c, a.r, 0, old, 0, 1);
	ok((e1 == -GPX_EACCES || e1 == -GPX_ENOENT) && (e2 == -GPX_EACCES || e2 == -GPX_ENOENT),
	    "region ids from before the restart are refused (%s, %s)", gpx_strerror(e1), gpx_strerror(e2));
	ok(buf_reg(c, &b, 0) == 0 && gpx_copy(c, a.r, 0, b.r, 0, len, 1) == 0 && gpx_copy(c, a.r, 0, b.r, 0, len, 2) == 0,
	    "new transfers are queued");
	kill(H.pid, SIGKILL);
	waitpid(H.pid, NULL, 0);
	H.pid = -1;
	got = 0;
	while ((r = gpx_wait(c, e, 64, WAIT_MS)) > 0)
		got += r;
	ok(r == -GPX_ECONN && got <= 2, "after gpxd is SIGKILLed a waiting client gets ECONN, not a hang (%s)",
	    gpx_strerror(r));
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
}
