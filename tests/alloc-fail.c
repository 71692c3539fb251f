/*
 * gpxd when an allocation fails while it answers a query (tests/failalloc.c, preloaded into
 * gpxd, fails the one allocation it is told to).  For each kind of query gpxctl makes, the
 * first, second, third ... allocation gpxd makes for it fails in turn, until one query needs
 * fewer allocations than that: each time the query is answered, either whole (the reply
 * decodes) or refused ENOMEM, never left without an answer; gpxd lives on, and the same query
 * unarmed is answered whole.  A client holds 40 regions, an export and a copy of 1 TiB in
 * flight meanwhile, so that the lists are long enough to grow and the regions' reply too large
 * for the stack buffer of its send.  (The peers' list needs a fabric: not here.)
 *
 * Skipped in a sanitizer build, whose runtime must come first in gpxd's libraries.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "client-lib/gpx.h"
#include "tests/harness.h"
#include "tests/tap.h"

#define NREGIONS 40
#define TRIES_MAX 200
#define BUSY_LEN (16u << 20)
#define BUSY_SEGS 65536                   /* of BUSY_LEN each: a copy of 1 TiB, minutes long */
#define BUSY_TAG 4242

static _Atomic int32_t *countdown;
static const char *volatile asking = "none";     /* the kind of query in flight */

/* A query left without an answer hangs in gpx_query: the test bails out naming it. */
static void
on_alarm(int sig)
{
	static const char head[] = "Bail out! no answer within 60 s to a query of kind ";
	const char *k = asking;

	(void)sig;
	if (write(1, head, sizeof(head) - 1) < 0 || write(1, k, strlen(k)) < 0 || write(1, "\n", 1) < 0)
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

/* One query, whole: its reply decodes.  0, or the library's error. */
static int
query(gpx_conn *c, enum gpx_query what)
{
	void *buf = NULL;
	size_t len = 0;
	int r = gpx_query(c, what, &buf, &len);

	if (r == 0) {
		Gpx__QueryReply *q = gpx__query_reply__unpack(NULL, len, buf);
		r = q != NULL ? 0 : -GPX_EPROTO;
		if (q != NULL)
			gpx__query_reply__free_unpacked(q, NULL);
	}
	free(buf);
	return r;
}

int
main(void)
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
	setenv("LD_PRELOAD", shim, 1);
	setenv("GPX_FAILALLOC", path, 1);
	if (harness_start(&h, NULL) < 0)
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
		int n, whole = 0, refused = 0, other = 0, last_other = 0, after_bad = 0;
		bool alive = true, done = false;
		asking = kinds[k].name;
		for (n = 1; n <= TRIES_MAX && alive && !done; n++) {
			atomic_store(countdown, n);
			alarm(60);
			int r = query(c, kinds[k].what);
			done = atomic_exchange(countdown, 0) > 0;     /* the query took fewer than n */
			if (r != 0 && r != -GPX_ENOMEM)
				usleep(200000);          /* a gpxd that dropped the connection as it died: gone by now */
			alive = gpxd_alive(&h);
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
			if (alive && query(c, kinds[k].what) != 0)
				after_bad++;
			alarm(0);
		}
		alarm(0);
		alive = alive && gpxd_alive(&h);
		ok(alive && done && other == 0 && after_bad == 0,
		    "%s: each of its %d allocations failed in turn: answered whole %d times, ENOMEM %d times "
		    "(other answers %d%s%s), %s, the query unarmed whole after each (%d not)",
		    kinds[k].name, n - 1, whole, refused, other, other ? ", the last: " : "",
		    other ? gpx_strerror(last_other) : "", alive ? "gpxd alive" : "gpxd DIED", after_bad);
		if (!alive)
			break;
	}
	ok(gpxd_alive(&h) && query(c, GPX_Q_REGIONS) == 0, "gpxd answers a query after them all");
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
	munmap((void *)countdown, 4096);
	unlink(path);
	harness_finish(&h);
	return tap_done();
}
