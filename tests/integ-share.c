/*
 * The integration tests' sharing (tests/integ.c runs them): region ids scoped to their
 * connection, exports and imports between clients with notifications, read-only exports,
 * withdrawal and revocation (also with copies running), and the export rules across uids
 * (root only: the children change uid).
 */
#include "config.h"

#include <errno.h>
#include <grp.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/integ.h"
#include "tests/tclient.h"
#include "tests/tap.h"
#include "tests/util.h"

/* Turns a call that must return into a bail-out, not a hung test, if it does not. */
static pthread_t watchdog;
static const char *watchdog_what;

static void *
watchdog_main(void *arg)
{
	struct timespec ts = { WAIT_MS / 1000, 0 };

	(void)arg;
	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
	printf("Bail out! %s\n", watchdog_what);
	fflush(stdout);
	_exit(1);
}

static void
watchdog_arm(const char *what)
{
	watchdog_what = what;
	pthread_create(&watchdog, NULL, watchdog_main, NULL);
}

static void
watchdog_disarm(void)
{
	pthread_cancel(watchdog);
	pthread_join(watchdog, NULL);
}

/* ---- region ids are scoped to their connection ---- */

void
test_foreign_region(void)
{
	struct buf a, b;
	uint64_t seed = 7;
	gpx_conn *ca = client("integ-owner-a"), *cb = client("integ-victim-b");

	if (ca == NULL || cb == NULL || buf_new(&a, 65536) < 0 || buf_new(&b, 65536) < 0 ||
	    buf_reg(ca, &a, 0) < 0 || buf_reg(cb, &b, 0) < 0)
		tap_bail("cannot set up the foreign-region test");
	fill_random(a.p, a.len, &seed);
	fill_random(b.p, b.len, &seed);
	uint64_t ha = fnv(a.p, a.len), hb = fnv(b.p, b.len);
	int r = gpx_copy_sync(ca, a.r, 0, b.r, 0, 4096);
	ok(r == -GPX_EACCES, "a copy into another connection's region id is refused (%s)", gpx_strerror(r));
	ok(fnv(b.p, b.len) == hb, "the other client's bytes are unchanged");
	r = gpx_copy_sync(ca, b.r, 0, a.r, 0, 4096);
	ok(r == -GPX_EACCES, "a copy out of another connection's region id is refused (%s)", gpx_strerror(r));
	ok(fnv(a.p, a.len) == ha, "and nothing was copied out of it");
	ok(harness_log_has(&H, "is not this connection's") && harness_log_has(&H, "refused client"),
	    "gpxd logged the refusal, naming the offender");
	gpx_region forged = (a.r & ~0xffffffffULL) | 0xfffff;
	ok(gpx_copy_sync(ca, a.r, 0, forged, 0, 1) == -GPX_ENOENT, "an unknown region id of this connection: ENOENT");
	ok(gpx_copy_sync(ca, a.r, 0, 0, 0, 1) == -GPX_ENOENT, "region id 0: ENOENT");
	ok(gpx_deregister(cb, a.r) == -GPX_ENOENT, "deregistering another connection's region is refused");
	ok(gpx_copy_sync(ca, a.r, 0, a.r, 4096, 4096) == 0 && memcmp(a.p, a.p + 4096, 4096) == 0,
	    "the owner's own region still works");
	gpx_region gone = a.r;
	ok(gpx_deregister(ca, gone) == 0 && gpx_copy_sync(ca, gone, 0, gone, 0, 1) == -GPX_ENOENT,
	    "a deregistered region id is refused");
	gpx_close(ca);
	gpx_close(cb);
	buf_free(&a);
	buf_free(&b);
}

/* ---- exports and imports ---- */

void
test_exports(void)
{
	struct buf src, bn, bp, bro, rox;
	uint64_t seed = 11, len = 0;
	gpx_conn *ca = client("integ-importer-a"), *cb = client("integ-exporter-b");
	gpx_region in_n, in_p, in_ro;
	struct gpx_completion e[80];

	if (ca == NULL || cb == NULL || buf_new(&src, 65536) < 0 || buf_new(&bn, 65536) < 0 ||
	    buf_new(&bp, 65536) < 0 || buf_new(&bro, 65536) < 0 || buf_new(&rox, 65536) < 0 ||
	    buf_reg(ca, &src, 0) < 0 || buf_reg(cb, &bn, 0) < 0 || buf_reg(cb, &bp, 0) < 0 ||
	    buf_reg(cb, &bro, 0) < 0 || buf_reg(ca, &rox, GPX_REG_READONLY) < 0)
		tap_bail("cannot set up the export test");
	fill_random(src.p, src.len, &seed);
	fill_random(bro.p, bro.len, &seed);
	memset(bn.p, 0, bn.len);
	memset(bp.p, 0, bp.len);

	struct gpx_export_opts notify = { .rule = GPX_EXPORT_ANY, .notify = 1, .notify_tag = 0xb0b };
	struct gpx_export_opts plain = { .rule = GPX_EXPORT_ANY };
	struct gpx_export_opts ro = { .rule = GPX_EXPORT_ANY, .read_only = 1 };
	ok(gpx_export(cb, bn.r, "integ.b.notify", &notify) == 0, "B exports a buffer asking for notifications");
	ok(gpx_export(cb, bp.r, "integ.b.plain", &plain) == 0, "B exports a buffer without notifications");
	ok(gpx_export(cb, bro.r, "integ.b.ro", &ro) == 0, "B exports a buffer read-only");
	ok(gpx_export(cb, bp.r, "integ.b.notify", &plain) == -GPX_EEXIST, "a second export under a taken name: EEXIST");
	ok(gpx_export(cb, bp.r, "bad name!", &plain) == -GPX_EINVAL, "an export name with a space and '!': EINVAL");
	ok(gpx_export(cb, bp.r, "", &plain) == -GPX_EINVAL, "an empty export name: EINVAL");
	ok(gpx_import(ca, "integ.nonexistent", &in_n, NULL) == -GPX_ENOENT, "importing an unknown name: ENOENT");
	ok(gpx_import(ca, "integ.b.notify", &in_n, &len) == 0 && len == bn.len, "A imports the notifying export");
	ok(gpx_import(ca, "integ.b.plain", &in_p, NULL) == 0, "A imports the plain export");
	ok(gpx_import(ca, "integ.b.ro", &in_ro, NULL) == 0, "A imports the read-only export");
	ok(gpx_export(ca, in_p, "integ.a.reexport", &plain) == -GPX_EACCES, "A cannot re-export an imported region");
	ok(gpx_unexport(ca, "integ.b.plain") == -GPX_EACCES, "A cannot withdraw B's export");

	/* A copies into B's plain buffer: done, and B is told nothing. */
	ok(gpx_copy_sync(ca, src.r, 0, in_p, 100, 5000) == 0 && memcmp(bp.p + 100, src.p, 5000) == 0,
	    "A's copy into B's exported buffer lands in B's memory");
	/* Then into the notifying one: B gets exactly one notification, with its tag. */
	ok(gpx_copy_sync(ca, src.r, 1000, in_n, 0, 3000) == 0 && memcmp(bn.p, src.p + 1000, 3000) == 0,
	    "A's copy into B's notifying buffer lands in B's memory");
	int n = gpx_wait(cb, e, 8, WAIT_MS);
	ok(n == 1 && (e[0].flags & GPX_COMP_NOTIFY) && e[0].tag == 0xb0b && e[0].bytes == 3000 && e[0].status == 0,
	    "B gets one GPX_COMP_NOTIFY completion with its tag and the byte count");
	n = gpx_copy_sync(cb, bn.r, 0, bn.r, 8192, 16);
	ok(n == 0 && gpx_poll(cb, e, 8) == 0, "B's own copies do not notify it, and no other record is queued");

	/* A notification that carries the tag B waits for is not B's transfer: the wait times out. */
	ok(gpx_copy_sync(ca, src.r, 0, in_n, 0, 10) == 0, "another copy into B's notifying buffer");
	watchdog_arm("gpx_wait_tag spun on a notification with its tag");
	n = gpx_wait_tag(cb, 0xb0b, e, 300);
	watchdog_disarm();
	ok(n == -GPX_ETIMEDOUT, "gpx_wait_tag for the notification's tag times out (%s)", gpx_strerror(n));
	n = gpx_poll(cb, e, 8);
	ok(n == 1 && (e[0].flags & GPX_COMP_NOTIFY) && e[0].bytes == 10, "and the notification stays for gpx_poll");

	/* B does not read: its ring fills with notifications, the rest are counted as dropped. */
	int copies = H.ring_entries + 6, okc = 0;
	for (int i = 0; i < copies; i++)
		okc += gpx_copy_sync(ca, src.r, 0, in_n, 0, 1 + i) == 0;
	for (int i = 0; i < WAIT_MS && gpx_dropped(cb) < 6; i++)
		usleep(1000);
	ok(okc == copies && gpx_dropped(cb) == 6, "%d copies into a non-reading owner: %d notifications dropped",
	    copies, (int)gpx_dropped(cb));
	n = drain(cb, e, 64, 0);
	bool all_notes = n == H.ring_entries;
	for (int i = 0; i < n; i++)
		all_notes = all_notes && (e[i].flags & GPX_COMP_NOTIFY) && e[i].tag == 0xb0b;
	ok(all_notes && gpx_poll(cb, e, 8) == 0, "its ring holds exactly %d notifications (%d)", H.ring_entries, n);
	ok(gpx_copy_sync(cb, bn.r, 0, bn.r, 100, 1) == 0, "and once read, the owner's own transfers go through");

	/* Notifications belong to the export: withdrawn with it, and possible again with a new one. */
	struct gpx_export_opts n1 = { .rule = GPX_EXPORT_ANY, .notify = 1, .notify_tag = 0x111 };
	struct gpx_export_opts n2 = { .rule = GPX_EXPORT_ANY, .notify = 1, .notify_tag = 0x222 };
	gpx_region in_z;
	ok(gpx_export(cb, bp.r, "integ.b.renotify1", &n1) == 0 && gpx_unexport(cb, "integ.b.renotify1") == 0 &&
	    gpx_export(cb, bp.r, "integ.b.renotify2", &n2) == 0,
	    "after withdrawing a notifying export, the buffer can be exported with notifications again");
	ok(gpx_import(ca, "integ.b.renotify2", &in_z, NULL) == 0 && gpx_copy_sync(ca, src.r, 0, in_z, 0, 7) == 0 &&
	    gpx_wait(cb, e, 8, WAIT_MS) == 1 && e[0].tag == 0x222 && (e[0].flags & GPX_COMP_NOTIFY),
	    "a copy into it notifies with the new export's tag");
	ok(gpx_unexport(cb, "integ.b.renotify2") == 0 && gpx_copy_sync(ca, src.r, 0, in_z, 0, 8) == 0 &&
	    gpx_copy_sync(ca, src.r, 0, in_n, 0, 9) == 0 && gpx_wait(cb, e, 8, WAIT_MS) == 1 && e[0].tag == 0xb0b &&
	    e[0].bytes == 9 && gpx_poll(cb, e, 8) == 0,
	    "once that export is withdrawn, copies through an earlier import no longer notify");

	/* Read-only export: writes refused before anything moves, reads fine. */
	uint64_t h = fnv(bro.p, bro.len);
	ok(gpx_copy_sync(ca, src.r, 0, in_ro, 0, 4096) == -GPX_EACCES, "a copy into a read-only export is refused");
	ok(fnv(bro.p, bro.len) == h, "the read-only export is unchanged");
	ok(gpx_copy_sync(ca, in_ro, 0, src.r, 0, 4096) == 0 && memcmp(src.p, bro.p, 4096) == 0,
	    "a copy out of a read-only export works");
	h = fnv(rox.p, rox.len);
	ok(gpx_copy_sync(ca, src.r, 0, rox.r, 0, 64) == -GPX_EACCES && fnv(rox.p, rox.len) == h,
	    "a region registered read-only cannot be a destination");

	/* Withdrawal: the name goes away; deregistration revokes what importers hold. */
	ok(gpx_unexport(cb, "integ.b.plain") == 0 && gpx_import(ca, "integ.b.plain", &in_p, NULL) == -GPX_ENOENT,
	    "after B withdraws an export it cannot be imported");
	ok(gpx_deregister(cb, bn.r) == 0 && gpx_copy_sync(ca, src.r, 0, in_n, 0, 1) == -GPX_EREVOKED,
	    "after B deregisters the buffer, A's imported handle gives EREVOKED");
	ok(gpx_import(ca, "integ.b.notify", &in_n, NULL) == -GPX_ENOENT, "and its export is gone");
	gpx_close(ca);
	gpx_close(cb);
	buf_free(&src);
	buf_free(&bn);
	buf_free(&bp);
	buf_free(&bro);
	buf_free(&rox);
}

/* The owner withdraws a buffer while copies out of it run: each ends, none hurts gpxd. */
void
test_revoke_running(void)
{
	const size_t len = 32u << 20;
	struct buf a, b;
	struct gpx_completion e[16];
	uint64_t seed = 3;
	gpx_conn *ca = client("integ-reader"), *cb = client("integ-withdrawer");
	gpx_region imp;
	int with_a;

	struct gpx_export_opts any = { .rule = GPX_EXPORT_ANY };
	if (ca == NULL || cb == NULL || buf_new(&a, len) < 0 || buf_new(&b, len) < 0 || buf_reg(ca, &a, 0) < 0)
		tap_bail("cannot set up the withdrawal test");
	with_a = harness_fds(&H);
	if (buf_reg(cb, &b, 0) < 0 || gpx_export(cb, b.r, "integ.withdrawn", &any) < 0 ||
	    gpx_import(ca, "integ.withdrawn", &imp, NULL) < 0)
		tap_bail("cannot set up the withdrawal test");
	fill_random(b.p, len, &seed);
	int sent = 0;
	for (int t = 0; t < 8; t++)
		sent += gpx_copy(ca, imp, 0, a.r, 0, len, t) == 0;
	int d = gpx_deregister(cb, b.r);
	int got = 0, bad = 0, complete = 0, r;
	while (got < sent && (r = gpx_wait(ca, e, 16, WAIT_MS)) > 0)
		for (int i = 0; i < r; i++, got++) {
			if (e[i].status == 0 && e[i].bytes == len)
				complete++;
			else if (e[i].status != -GPX_EREVOKED)
				bad++;
		}
	ok(sent == 8 && d == 0 && got == 8 && bad == 0,
	    "the owner deregisters while 8 copies out of it are queued: %d complete, %d EREVOKED", complete, got - complete);
	ok(complete == 0 || memcmp(a.p, b.p, len) == 0, "the completed ones carry the right bytes");
	ok(gpx_copy_sync(ca, imp, 0, a.r, 0, 1) == -GPX_EREVOKED, "afterwards the import is revoked");
	int n = harness_wait_fds(&H, with_a, WAIT_MS);
	ok(n == with_a, "gpxd closed the withdrawn memfd once the last copy let go (%d, want %d)", n, with_a);
	gpx_close(ca);
	gpx_close(cb);
	buf_free(&a);
	buf_free(&b);
}

/* ---- export rules across uids (root only: the children change uid) ---- */

struct as_user {
	uid_t uid;
	gid_t gid;
	gid_t extra;              /* a supplementary group, or 0 */
	const char *names[4];     /* exports to import */
};

/* In a child with the given credentials: import each name; the statuses come back through a pipe. */
static void
import_as(const struct as_user *u, int *res, int nres)
{
	int p[2];
	pid_t pid;

	for (int i = 0; i < nres; i++)
		res[i] = 1000;
	if (pipe(p) < 0)
		return;
	fflush(NULL);
	if ((pid = fork()) == 0) {
		gpx_conn *c = NULL;
		close(p[0]);
		if (setgroups(u->extra ? 1 : 0, &u->extra) < 0 || setgid(u->gid) < 0 || setuid(u->uid) < 0)
			_exit(3);
		int r = gpx_connect(H.sock, "integ-other-uid", &c);
		for (int i = 0; i < nres; i++) {
			gpx_region reg;
			int v = r < 0 ? r : gpx_import(c, u->names[i], &reg, NULL);
			(void)!write(p[1], &v, sizeof(v));
		}
		gpx_close(c);
		_exit(0);
	}
	close(p[1]);
	for (int i = 0; i < nres; i++)
		if (read(p[0], &res[i], sizeof(res[i])) != sizeof(res[i]))
			break;
	close(p[0]);
	waitpid(pid, NULL, 0);
}

void
test_export_rules(void)
{
	struct buf b;
	gpx_conn *c;
	int res[4];

	if (geteuid() != 0) {
		tap_skip(9, "export rules across uids need root to start clients as other users");
		return;
	}
	if ((c = client("integ-rules-owner")) == NULL || buf_new(&b, 8192) < 0 || buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the export-rule test");
	struct gpx_export_opts ru = { .rule = GPX_EXPORT_UID }, rg = { .rule = GPX_EXPORT_GID, .gid = 2000 },
	    ra = { .rule = GPX_EXPORT_ANY };
	if (gpx_export(c, b.r, "integ.rule.uid", &ru) < 0 || gpx_export(c, b.r, "integ.rule.gid", &rg) < 0 ||
	    gpx_export(c, b.r, "integ.rule.any", &ra) < 0)
		tap_bail("cannot export for the rule test: %s", gpx_last_error(c));

	struct as_user stranger = { 1002, 1002, 0, { "integ.rule.uid", "integ.rule.gid", "integ.rule.any" } };
	import_as(&stranger, res, 3);
	ok(res[0] == -GPX_EACCES, "uid rule: another uid is refused (%s)", gpx_strerror(res[0]));
	ok(res[1] == -GPX_EACCES, "gid rule: a uid outside the group is refused (%s)", gpx_strerror(res[1]));
	ok(res[2] == 0, "any rule: another uid imports (%s)", gpx_strerror(res[2]));
	struct as_user member = { 1003, 2000, 0, { "integ.rule.gid", "integ.rule.uid" } };
	import_as(&member, res, 2);
	ok(res[0] == 0, "gid rule: a client whose primary group matches imports (%s)", gpx_strerror(res[0]));
	ok(res[1] == -GPX_EACCES, "uid rule: that client is still refused the uid export");
	struct as_user supp = { 1004, 1004, 2000, { "integ.rule.gid" } };
	import_as(&supp, res, 1);
	ok(res[0] == 0, "gid rule: a supplementary group counts (%s)", gpx_strerror(res[0]));

	/* A non-root owner: its own uid may import its uid-rule export, another uid may not. */
	int go[2], rep[2];
	if (pipe(go) < 0 || pipe(rep) < 0)
		tap_bail("pipe");
	fflush(NULL);
	pid_t owner = fork();
	if (owner == 0) {
		gpx_conn *o = NULL, *same = NULL;
		struct buf ob;
		gpx_region reg;
		int v = -1;
		char x;
		close(go[1]);
		close(rep[0]);
		if (setgroups(0, NULL) == 0 && setgid(1005) == 0 && setuid(1005) == 0 &&
		    gpx_connect(H.sock, "integ-uid-owner", &o) == 0 && buf_new(&ob, 4096) == 0 &&
		    buf_reg(o, &ob, 0) == 0 && gpx_export(o, ob.r, "integ.rule.uid1005", &ru) == 0 &&
		    gpx_connect(H.sock, "integ-uid-same", &same) == 0)
			v = gpx_import(same, "integ.rule.uid1005", &reg, NULL);
		(void)!write(rep[1], &v, sizeof(v));
		(void)!read(go[0], &x, 1);     /* hold the export until the parent is done */
		_exit(0);
	}
	close(go[0]);
	close(rep[1]);
	int v = 1000;
	(void)!read(rep[0], &v, sizeof(v));
	ok(v == 0, "uid rule: a second connection of the owner's (non-root) uid imports (%s)", gpx_strerror(v));
	struct as_user other = { 1006, 1006, 0, { "integ.rule.uid1005" } };
	import_as(&other, res, 1);
	ok(res[0] == -GPX_EACCES, "uid rule: a different non-root uid is refused (%s)", gpx_strerror(res[0]));
	gpx_region reg;
	ok(gpx_import(c, "integ.rule.uid1005", &reg, NULL) == 0, "root may import any export");
	close(go[1]);
	close(rep[0]);
	waitpid(owner, NULL, 0);
	gpx_close(c);
	buf_free(&b);
}
