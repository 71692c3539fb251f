/*
 * vm-rdma-client: the two client halves of tests/vm-rdma.test, one in each guest, since a
 * client can reach only its own node's gpxd.
 *
 *   vm-rdma-client owner SOCK PIDFILE RESTART   (node A)
 *     Exports kv (8 MiB, pattern 1, notifying, tag 77) and ctl (4 KiB, notifying, tag 78)
 *     to peers and prints a line for every notification: "notify kv bytes=N fnv=X" with
 *     the checksum of all of kv as it is then.  A write into ctl is a command from the user
 *     half: "K<ms>" kills this node's gpxd (SIGKILL, pid from PIDFILE) that many ms later,
 *     restarts it with the command RESTART and exports again; "Q" ends.
 *   vm-rdma-client user SOCK NODE                (node B; TAP on stdout)
 *     Imports NODE:kv and NODE:ctl, then kv by its bare name (the nodes are in one cluster:
 *     the name's node comes from etcd) and reads it whole; VM_CONNECTED, a shell command, runs
 *     then, the connection to NODE being up.  Copies across: RDMA READ and WRITE whole, at odd
 *     offsets, vectored, past the end; has A's gpxd killed in the middle of a stream of
 *     copies (every copy must end within FABRIC_BOUND s, default 8), then imports again.
 *     Prints "# rate read|write MiB/s" lines for the record, and "# owner-expect notify kv
 *     bytes=N fnv=X" for each write into kv whose notification A's owner must print: the
 *     bytes of the write and the checksum kv must have by then (the note came after them).
 *     VM_SNAPSHOT: a shell command run before A's gpxd is killed.  VM_LINK_DOWN: a command
 *     that takes the link of one rail down, run in the middle of another stream of copies
 *     after the restart; then VM_SNAPSHOT2 and VM_LINK_UP.
 */
#include "config.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client-lib/gpx.h"
#include "tests/tap.h"
#include "tests/util.h"

#define SZ (8u << 20)
#define CTL 4096

/* ---- node A ---- */

static int
owner(const char *sock, const char *pidfile, const char *restart)
{
	struct gpx_export_opts kvo = { .rule = GPX_EXPORT_UID, .notify = 1, .notify_tag = 77 };
	struct gpx_export_opts cto = { .rule = GPX_EXPORT_UID, .notify = 1, .notify_tag = 78 };
	int fa, fc;
	void *pa, *pc;

	if (gpx_host_alloc(SZ, &fa, &pa) < 0 || gpx_host_alloc(CTL, &fc, &pc) < 0)
		return 99;
	for (;;) {
		gpx_conn *c = NULL;
		gpx_region ra, rc;
		double end = now() + 30;
		while (gpx_connect(sock, "vm-owner", &c) < 0 && now() < end)
			usleep(100000);
		if (c == NULL)
			return 1;
		fill(pa, SZ, 1);
		memset(pc, 0, CTL);
		if (gpx_register_host(c, fa, 0, SZ, 0, &ra) < 0 || gpx_register_host(c, fc, 0, CTL, 0, &rc) < 0 ||
		    gpx_export_remote(c, ra, "kv", &kvo, NULL) < 0 || gpx_export_remote(c, rc, "ctl", &cto, NULL) < 0) {
			printf("export failed: %s\n", gpx_last_error(c));
			return 1;
		}
		printf("exported kv fnv=%016llx\n", (unsigned long long)fnv(pa, SZ));
		fflush(stdout);
		for (;;) {
			struct gpx_completion comp;
			int n = gpx_wait(c, &comp, 1, 1000);
			if (n == -GPX_ETIMEDOUT)
				continue;
			if (n < 0)
				break;           /* the daemon went away: connect again */
			if (n == 0 || !(comp.flags & GPX_COMP_NOTIFY))
				continue;
			if (comp.tag == 77) {
				printf("notify kv bytes=%llu fnv=%016llx\n", (unsigned long long)comp.bytes,
				    (unsigned long long)fnv(pa, SZ));
				fflush(stdout);
				continue;
			}
			if (comp.tag != 78)
				continue;
			char cmd[32];
			memcpy(cmd, pc, sizeof(cmd) - 1);
			cmd[sizeof(cmd) - 1] = '\0';
			printf("command %.8s\n", cmd);
			fflush(stdout);
			if (cmd[0] == 'Q') {
				gpx_close(c);
				return 0;
			}
			if (cmd[0] == 'K') {
				FILE *f = fopen(pidfile, "r");
				int pid = 0;
				usleep((useconds_t)atoi(cmd + 1) * 1000);
				if (f != NULL && fscanf(f, "%d", &pid) == 1 && pid > 0) {
					kill(pid, SIGKILL);
					printf("killed gpxd %d\n", pid);
				}
				if (f != NULL)
					fclose(f);
				fflush(stdout);
				gpx_close(c);
				c = NULL;
				usleep(300000);
				if (system(restart) != 0)
					printf("restart failed\n");
				break;
			}
		}
		if (c != NULL)
			gpx_close(c);
	}
}

/* ---- node B ---- */

static int
import_retry(gpx_conn *c, const char *name, gpx_region *r, uint64_t *len, double secs)
{
	double end = now() + secs;
	int e;

	while (((e = gpx_import(c, name, r, len)) == -GPX_ENOENT || e == -GPX_EIO) && now() < end)
		usleep(200000);
	return e;
}

/* Waits (up to a minute) for n completions: how many came, ok and failed; when the last came. */
/* Submits n copies of SZ from src to dst with tags tag0..; a busy answer is retried for up to
 * 2 s, any other error ends the stream with a line saying why.  Returns how many went in. */
static int
stream_start(gpx_conn *c, gpx_region src, gpx_region dst, int n, uint64_t tag0)
{
	int i, e = 0;

	for (i = 0; i < n; i++) {
		double t0 = now();
		while ((e = gpx_copy(c, src, 0, dst, 0, SZ, tag0 + i)) == -GPX_EBUSY && now() - t0 < 2)
			usleep(10000);
		if (e < 0) {
			diag("copy %d of %d not submitted: %s (%s)", i + 1, n, gpx_strerror(e), gpx_last_error(c));
			break;
		}
	}
	return i;
}

static double
stream_end(gpx_conn *c, int n, int *okc, int *errc, int *got)
{
	struct gpx_completion comp;
	double t0 = now(), tlast = t0;

	*okc = *errc = *got = 0;
	while (*got < n && now() - t0 < 60)
		if (gpx_wait(c, &comp, 1, 200) == 1) {
			(*got)++;
			tlast = now();
			if (comp.status == 0)
				(*okc)++;
			else
				(*errc)++;
		}
	return tlast;
}

static int
command(gpx_conn *c, gpx_region local, void *lp, gpx_region rctl, const char *cmd)
{
	memset(lp, 0, CTL);
	snprintf(lp, CTL, "%s", cmd);
	return gpx_copy_sync(c, local, 0, rctl, 0, CTL);
}

static int
user(const char *sock, const char *peer)
{
	gpx_conn *c;
	gpx_region rb, rd, rt, rkv, rctl;
	int fb, fd, ft;
	void *pb, *pd, *pt;
	uint64_t len;
	char name[128];
	int e, n;
	double bound = getenv("FABRIC_BOUND") ? atof(getenv("FABRIC_BOUND")) : 8;
	struct gpx_completion comp;

	if (gpx_connect(sock, "vm-user", &c) < 0 || gpx_host_alloc(SZ, &fb, &pb) < 0 ||
	    gpx_host_alloc(SZ, &fd, &pd) < 0 || gpx_host_alloc(CTL, &ft, &pt) < 0 ||
	    gpx_register_host(c, fb, 0, SZ, 0, &rb) < 0 || gpx_register_host(c, fd, 0, SZ, 0, &rd) < 0 ||
	    gpx_register_host(c, ft, 0, CTL, 0, &rt) < 0) {
		printf("Bail out! cannot connect or register\n");
		return 99;
	}
	snprintf(name, sizeof(name), "%s:kv", peer);
	e = import_retry(c, name, &rkv, &len, 90);
	ok(e == 0 && len == SZ, "imports %s (%s)", name, e ? gpx_last_error(c) : "ok");
	snprintf(name, sizeof(name), "%s:ctl", peer);
	e = e ? e : import_retry(c, name, &rctl, &len, 10);
	if (e != 0) {
		printf("1..%d\n", tap_count);
		return 1;
	}
	/* The bare name: which node holds it, only the cluster's names say. */
	gpx_region rbare;
	fill(pd, SZ, 1);
	memset(pb, 0, SZ);
	e = import_retry(c, "kv", &rbare, &len, 10);
	ok(e == 0 && len == SZ && gpx_copy_sync(c, rbare, 0, rb, 0, SZ) == 0 && fnv(pb, SZ) == fnv(pd, SZ),
	    "imports kv by its bare name and reads it whole: checksum %016llx (%s)", (unsigned long long)fnv(pb, SZ),
	    e ? gpx_last_error(c) : "ok");
	if (getenv("VM_CONNECTED") != NULL && system(getenv("VM_CONNECTED")) != 0)
		diag("VM_CONNECTED failed");

	/* What kv holds after each of our writes, for the notifications A's owner prints. */
	char *shadow = malloc(SZ);
	if (shadow == NULL)
		return 99;

	/* RDMA READ, then WRITE and read back; A's owner prints its checksum when notified. */
	fill(pd, SZ, 1);
	double t0 = now();
	e = gpx_copy_sync(c, rkv, 0, rb, 0, SZ);
	double dt = now() - t0;
	ok(e == 0 && fnv(pb, SZ) == fnv(pd, SZ), "8 MiB read across: checksum %016llx", (unsigned long long)fnv(pb, SZ));
	printf("# rate read %.1f MiB/s (one 8 MiB copy)\n", 8 / dt);
	fill(pb, SZ, 2);
	t0 = now();
	e = gpx_copy_sync(c, rb, 0, rkv, 0, SZ);
	dt = now() - t0;
	ok(e == 0, "8 MiB written across (%s)", e ? gpx_strerror(e) : "ok");
	printf("# rate write %.1f MiB/s (one 8 MiB copy)\n", 8 / dt);
	memcpy(shadow, pb, SZ);
	printf("# owner-expect notify kv bytes=%u fnv=%016llx\n", SZ, (unsigned long long)fnv(shadow, SZ));
	memset(pd, 0, SZ);
	e = gpx_copy_sync(c, rkv, 0, rd, 0, SZ);
	ok(e == 0 && memcmp(pb, pd, SZ) == 0, "read back what was written: same");

	fill(pt, 4096, 3);
	e = gpx_copy_sync(c, rt, 0, rkv, 12345, 4096);
	memset(pd, 0, 8192);
	ok(e == 0 && gpx_copy_sync(c, rkv, 12345, rd, 1, 4096) == 0 && memcmp((char *)pd + 1, pt, 4096) == 0,
	    "4 KiB written at an odd offset, read back to another odd offset");
	/* one chunk: its note rides right behind its bytes on one queue pair */
	memcpy(shadow + 12345, pt, 4096);
	printf("# owner-expect notify kv bytes=4096 fnv=%016llx\n", (unsigned long long)fnv(shadow, SZ));
	struct gpx_seg segs[3] = {
		{ .src_offset = 1, .dst_offset = 3 << 20, .length = 100000 },
		{ .src_offset = 2 << 20, .dst_offset = 7, .length = (3 << 20) - 100 },
		{ .src_offset = 5 << 20, .dst_offset = (7 << 20) + 5, .length = 1 },
	};
	fill(pb, SZ, 4);
	e = gpx_copyv(c, rb, rkv, segs, 3, 501);
	n = e == 0 ? gpx_wait_tag(c, 501, &comp, 20000) : e;
	ok(n >= 0 && comp.status == 0, "vectored write of 3 segments across (status %d)", comp.status);
	for (int i = 0; i < 3; i++)
		memcpy(shadow + segs[i].dst_offset, (char *)pb + segs[i].src_offset, segs[i].length);
	printf("# owner-expect notify kv bytes=%u fnv=%016llx\n", 100000 + (3u << 20) - 100 + 1,
	    (unsigned long long)fnv(shadow, SZ));
	for (int i = 0; i < 3; i++) {
		uint64_t t = segs[i].src_offset;
		segs[i].src_offset = segs[i].dst_offset;
		segs[i].dst_offset = t;
	}
	memset(pd, 0, SZ);
	e = gpx_copyv(c, rkv, rd, segs, 3, 502);
	n = e == 0 ? gpx_wait_tag(c, 502, &comp, 20000) : e;
	bool same = n >= 0 && comp.status == 0;
	for (int i = 0; i < 3; i++)
		same &= memcmp((char *)pd + segs[i].dst_offset, (char *)pb + segs[i].dst_offset, segs[i].length) == 0;
	ok(same, "vectored read of 3 segments across returns what the vectored write put there");
	ok(gpx_copy_sync(c, rb, 0, rkv, SZ - 10, 11) == -GPX_ERANGE, "a copy one byte past the remote region: ERANGE");

	/* Several copies at once, shared queue pairs. */
	fill(pb, SZ, 6);
	t0 = now();
	for (int i = 0; i < 4; i++)
		gpx_copy(c, rb, 0, rkv, 0, SZ, 600 + i);
	int good = 0;
	for (int i = 0; i < 4; i++)
		good += gpx_wait_tag(c, 600 + i, &comp, 30000) >= 0 && comp.status == 0;
	dt = now() - t0;
	ok(good == 4, "4 concurrent 8 MiB writes (%d ok)", good);
	printf("# rate write %.1f MiB/s (4 concurrent 8 MiB copies)\n", 32 / dt);

	/* What this node's gpxd says of the peer now, before the connection is lost. */
	if (getenv("VM_SNAPSHOT") != NULL && system(getenv("VM_SNAPSHOT")) != 0)
		diag("VM_SNAPSHOT failed");

	/* A's gpxd is killed in the middle of a stream of copies. */
	enum { N = 16 };
	int okc, errc, got;
	e = command(c, rt, pt, rctl, "K700");
	ok(e == 0, "asked A's owner to kill A's gpxd in 0.7 s");
	double tc = now();
	int sent = stream_start(c, rb, rkv, N, 1000);
	ok(sent == N, "%d copies of 8 MiB submitted (%d)", N, sent);
	double tlast = stream_end(c, sent, &okc, &errc, &got);
	ok(got == sent, "all %d copies ended (%d ok, %d failed)", sent, okc, errc);
	ok(errc > 0, "copies cut off by the kill failed (%d)", errc);
	ok(tlast - tc < 0.7 + bound, "the last ended %.1f s after the kill was asked (bound 0.7 + %.0f s)",
	    tlast - tc, bound);
	e = gpx_copy_sync(c, rb, 0, rkv, 0, 4096);
	ok(e == -GPX_EREVOKED || e == -GPX_EIO, "a new copy on the old import is refused: %s", gpx_strerror(e));

	/* A is back (its owner restarted it): a new connection, a new epoch, a new import. */
	snprintf(name, sizeof(name), "%s:kv", peer);
	e = import_retry(c, name, &rkv, &len, 60);
	ok(e == 0, "imports %s again after A's restart (%s)", name, e ? gpx_last_error(c) : "ok");
	fill(pd, SZ, 1);
	ok(e == 0 && gpx_copy_sync(c, rkv, 0, rb, 0, SZ) == 0 && fnv(pb, SZ) == fnv(pd, SZ),
	    "8 MiB read across after the reconnection: checksum %016llx", (unsigned long long)fnv(pb, SZ));
	/* The link of one rail goes down in the middle of a stream of copies (VM_LINK_DOWN, run
	 * here): an error of its queue pairs or of its port ends the connection, every copy ends
	 * within the bound, and the peer comes back on the other rail. */
	const char *down = getenv("VM_LINK_DOWN");
	if (e == 0 && down != NULL) {
		fill(pb, SZ, 7);
		sent = stream_start(c, rb, rkv, N, 3000);
		ok(sent == N, "%d copies of 8 MiB submitted (%d)", N, sent);
		usleep(300000);
		ok(system(down) == 0, "the link of the second rail taken down during a stream of copies");
		tc = now();
		tlast = stream_end(c, sent, &okc, &errc, &got);
		ok(got == sent, "all %d copies ended (%d ok, %d failed)", sent, okc, errc);
		ok(errc > 0, "copies cut off by the link going down failed (%d)", errc);
		ok(tlast - tc < bound, "the last ended %.1f s after the link went down (bound %.0f s)", tlast - tc, bound);
		snprintf(name, sizeof(name), "%s:kv", peer);
		e = import_retry(c, name, &rkv, &len, 60);
		ok(e == 0, "imports %s again on the rail that is left (%s)", name, e ? gpx_last_error(c) : "ok");
		fill(pd, SZ, 8);
		ok(e == 0 && gpx_copy_sync(c, rd, 0, rkv, 0, SZ) == 0 && gpx_copy_sync(c, rkv, 0, rb, 0, SZ) == 0 &&
		    fnv(pb, SZ) == fnv(pd, SZ), "8 MiB written and read back across it: checksum %016llx",
		    (unsigned long long)fnv(pb, SZ));
		if (getenv("VM_SNAPSHOT2") != NULL && system(getenv("VM_SNAPSHOT2")) != 0)
			diag("VM_SNAPSHOT2 failed");
		if (getenv("VM_LINK_UP") != NULL && system(getenv("VM_LINK_UP")) != 0)
			diag("VM_LINK_UP failed");
	}

	snprintf(name, sizeof(name), "%s:ctl", peer);
	if (import_retry(c, name, &rctl, &len, 10) == 0)
		command(c, rt, pt, rctl, "Q");
	gpx_close(c);
	free(shadow);
	printf("1..%d\n", tap_count);
	return tap_failed ? 1 : 0;
}

int
main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 5 && strcmp(argv[1], "owner") == 0)
		return owner(argv[2], argv[3], argv[4]);
	if (argc == 4 && strcmp(argv[1], "user") == 0)
		return user(argv[2], argv[3]);
	fprintf(stderr, "usage: vm-rdma-client owner SOCK PIDFILE RESTART | user SOCK NODE\n");
	return 99;
}
