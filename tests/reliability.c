/*
 * Reliability rules of gpxd that need a real daemon and more than one well-behaved client:
 *
 *  - a client that clears O_NONBLOCK on its eventfd and fills the counter can never block the
 *    daemon: it is disconnected, and another client's transfers keep completing meanwhile;
 *  - 1,000,000 transfers with an EFD_SEMAPHORE eventfd give exactly 1,000,000 wakes, and every
 *    per-transfer status and byte count matches;
 *  - the engine serves clients round-robin: a client's 1 MiB copies complete while another
 *    client's 1 GiB copy is still running;
 *  - a client whose ring tail is corrupted is disconnected without disturbing others.
 *
 * GPX_TEST_SCALE (default 1) scales the transfer counts down for slow runs (sanitizers).
 */
#include "config.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include "client-lib/gpx.h"
#include "proto/ring.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/util.h"

static struct harness H;
static double scale = 1;

struct hbuf {
	int fd;
	unsigned char *p;
	size_t len;
	gpx_region r;
};

static void
hbuf_new(gpx_conn *c, struct hbuf *b, size_t len)
{
	if (gpx_host_alloc(len, &b->fd, (void **)&b->p) < 0)
		tap_bail("gpx_host_alloc");
	b->len = len;
	memset(b->p, 0x11, len);
	if (gpx_register_host(c, b->fd, 0, len, 0, &b->r) < 0)
		tap_bail("register: %s", gpx_last_error(c));
}

static void
hbuf_free(struct hbuf *b)
{
	gpx_host_free(b->fd, b->p, b->len);
}

/* ---- a steady client that keeps copying while something else goes on ---- */

struct steady {
	atomic_bool stop;
	atomic_int done, bad;
	_Atomic long long last_us, max_gap_us;   /* its last completion; the longest gap since reset */
};

static long long
now_us(void)
{
	return (long long)(now() * 1e6);
}

/* The longest the steady client has gone without a completion since max_gap_us was reset,
 * counting the gap still open now: a client stuck at this moment counts too. */
static double
steady_gap(struct steady *s)
{
	long long open = now_us() - atomic_load(&s->last_us), max = atomic_load(&s->max_gap_us);

	return (open > max ? open : max) / 1e6;
}

static void *
steady_main(void *arg)
{
	struct steady *s = arg;
	gpx_conn *c;
	struct hbuf a, b;

	if (gpx_connect(H.sock, "steady", &c) < 0) {
		atomic_fetch_add(&s->bad, 1);
		return NULL;
	}
	hbuf_new(c, &a, 1 << 20);
	hbuf_new(c, &b, 1 << 20);
	atomic_store(&s->last_us, now_us());
	while (!atomic_load(&s->stop)) {
		a.p[0]++;
		if (gpx_copy_sync(c, a.r, 0, b.r, 0, 65536) != 0 || b.p[0] != a.p[0])
			atomic_fetch_add(&s->bad, 1);
		long long t = now_us(), gap = t - atomic_load(&s->last_us);
		if (gap > atomic_load(&s->max_gap_us))
			atomic_store(&s->max_gap_us, gap);
		atomic_store(&s->last_us, t);
		atomic_fetch_add(&s->done, 1);
	}
	gpx_close(c);
	hbuf_free(&a);
	hbuf_free(&b);
	return NULL;
}

/* A client with its own eventfd that it turns blocking and fills to the brim. */
static void
test_eventfd_attack(void)
{
	struct steady s = { 0 };
	pthread_t t;
	gpx_conn *c;
	struct hbuf a, b;
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct gpx_connect_opts o = { .socket = H.sock, .name = "attacker", .eventfd = efd };
	int before = harness_clients(&H);

	pthread_create(&t, NULL, steady_main, &s);
	if (gpx_connect_opts(&o, &c) < 0)
		tap_bail("attacker connect");
	hbuf_new(c, &a, 1 << 20);
	hbuf_new(c, &b, 1 << 20);
	/* The library duplicated our eventfd: same file description, so we control it. */
	uint64_t fill = 0xfffffffffffffffeULL;
	int fl = fcntl(efd, F_GETFL);
	fcntl(efd, F_SETFL, fl & ~O_NONBLOCK);
	ok(write(efd, &fill, sizeof(fill)) == sizeof(fill), "attacker fills its eventfd counter and makes it blocking");
	/* The steady client is measured from here on, while the attacker is active. */
	while (atomic_load(&s.done) == 0 && atomic_load(&s.bad) == 0)
		usleep(1000);
	atomic_store(&s.max_gap_us, 0);
	int before_attack = atomic_load(&s.done);
	int e = 0;
	for (int i = 0; i < 50 && e == 0; i++)
		e = gpx_copy(c, a.r, 0, b.r, 0, 4096, i);
	struct gpx_completion d;
	int r = 0;
	double t0 = now();
	while (now() - t0 < 5 && (r = gpx_poll(c, &d, 1)) >= 0)
		usleep(1000);
	double gap = steady_gap(&s);
	int during = atomic_load(&s.done) - before_attack;
	ok(r == -GPX_ECONN, "the attacker is disconnected (%s, after %.1f ms)", gpx_strerror(r), (now() - t0) * 1e3);
	ok(gap < BYSTANDER_MAX_S && atomic_load(&s.bad) == 0,
	    "another client kept copying while the attacker was active (%d copies, longest gap %.1f ms, bound %.0f)",
	    during, gap * 1e3, BYSTANDER_MAX_S * 1e3);
	usleep(200000);
	int mid = atomic_load(&s.done);
	usleep(300000);
	atomic_store(&s.stop, true);
	pthread_join(t, NULL);
	ok(atomic_load(&s.bad) == 0 && atomic_load(&s.done) > mid,
	    "and after it was gone (%d copies in all, %d bad)", atomic_load(&s.done), atomic_load(&s.bad));
	gpx_close(c);
	hbuf_free(&a);
	hbuf_free(&b);
	close(efd);
	int n = 0;
	for (int i = 0; i < 300 && (n = harness_clients(&H)) != before; i++)
		usleep(10000);
	ok(n == before, "the daemon is back to %d clients", before);
}

/* A client that scribbles over its ring's tail is cut off; others go on. */
static void
test_corrupt_tail(void)
{
	gpx_conn *c;
	struct hbuf a, b;
	struct gpx_completion d;

	if (gpx_connect(H.sock, "scribbler", &c) < 0)
		tap_bail("connect");
	hbuf_new(c, &a, 65536);
	hbuf_new(c, &b, 65536);
	ok(gpx_copy_sync(c, a.r, 0, b.r, 0, 4096) == 0, "a copy before the ring is corrupted");
	/* The library keeps the ring only as a mapping: find it in /proc/self/maps. */
	FILE *f = fopen("/proc/self/maps", "re");
	char line[512];
	unsigned long lo = 0;
	int r = 0;
	while (f != NULL && fgets(line, sizeof(line), f) != NULL)
		if (strstr(line, "gpx-completions") != NULL && sscanf(line, "%lx-", &lo) == 1)
			break;
	if (f != NULL)
		fclose(f);
	if (lo != 0) {
		volatile uint64_t *tail = (uint64_t *)(lo + offsetof(struct gpx_ring_hdr, tail));
		*tail += 1000000;
	}
	ok(lo != 0, "found the completion ring mapping and moved its tail far ahead of its head");
	for (int i = 0; i < 3; i++)
		gpx_copy(c, a.r, 0, b.r, 0, 4096, 100 + i);
	double t0 = now();
	while (now() - t0 < 5 && (r = gpx_poll(c, &d, 1)) >= 0)
		usleep(1000);
	ok(r == -GPX_ECONN || r == -GPX_EPROTO, "a corrupted ring tail gets the client disconnected (%s)",
	    gpx_strerror(r));
	gpx_close(c);
	hbuf_free(&a);
	hbuf_free(&b);
}

/* Exactly one doorbell per completion, counted on a semaphore eventfd. */
static void
test_semaphore_wakes(void)
{
	long total = (long)(1000000 * scale);
	int efd = eventfd(0, EFD_SEMAPHORE | EFD_NONBLOCK | EFD_CLOEXEC);
	struct gpx_connect_opts o = { .socket = H.sock, .name = "semaphore", .eventfd = efd };
	struct gpx_completion d[64];
	gpx_conn *c;
	struct hbuf a, b;
	long sent = 0, got = 0, wakes = 0, bad = 0;
	double t0 = now();

	if (gpx_connect_opts(&o, &c) < 0)
		tap_bail("connect");
	hbuf_new(c, &a, 1 << 16);
	hbuf_new(c, &b, 1 << 16);
	while (got < total) {
		while (sent < total && gpx_outstanding(c) < 48) {
			/* Sizes vary with the tag, so each completion can be checked against it. */
			if (gpx_copy(c, a.r, 0, b.r, 0, 1 + sent % 4096, sent) < 0)
				break;
			sent++;
		}
		struct pollfd p = { .fd = efd, .events = POLLIN };
		if (poll(&p, 1, 5000) != 1)
			break;
		uint64_t v;
		while (read(efd, &v, sizeof(v)) == sizeof(v))
			wakes += v;   /* a semaphore read is always 1 */
		int n = gpx_poll(c, d, 64);
		if (n < 0)
			break;
		for (int i = 0; i < n; i++) {
			if (d[i].status != 0 || d[i].bytes != 1 + d[i].tag % 4096)
				bad++;
			got++;
		}
	}
	/* Late doorbells of the last completions. */
	for (int i = 0; i < 100 && wakes < got; i++) {
		uint64_t v;
		while (read(efd, &v, sizeof(v)) == sizeof(v))
			wakes += v;
		usleep(1000);
	}
	uint64_t v;
	long extra = 0;
	while (read(efd, &v, sizeof(v)) == sizeof(v))
		extra += v;
	double dt = now() - t0;
	ok(got == total && bad == 0, "%ld transfers on a semaphore eventfd: %ld completions, %ld with a wrong status or size",
	    total, got, bad);
	ok(wakes + extra == total, "exactly one wake per transfer: %ld wakes for %ld transfers", wakes + extra, total);
	diag("%.0f transfers/s", got / dt);
	gpx_close(c);
	hbuf_free(&a);
	hbuf_free(&b);
	close(efd);
}

/* Round-robin between clients: 1 MiB copies of one overtake another client's 1 GiB copy. */
static void
test_round_robin(void)
{
	gpx_conn *x, *y;
	struct hbuf xa, xb, ya, yb;
	struct gpx_completion d;
	size_t big = 1u << 30;

	if (gpx_connect(H.sock, "streamer", &x) < 0 || gpx_connect(H.sock, "small", &y) < 0)
		tap_bail("connect");
	hbuf_new(x, &xa, big);
	hbuf_new(x, &xb, big);
	hbuf_new(y, &ya, 1 << 20);
	hbuf_new(y, &yb, 1 << 20);
	if (gpx_copy(x, xa.r, 0, xb.r, 0, big, 1) < 0)
		tap_bail("big copy");
	int small_done = 0, before_big = 0;
	bool big_done = false;
	for (int i = 0; i < 8; i++) {
		if (gpx_copy_sync(y, ya.r, 0, yb.r, 0, 1 << 20) == 0)
			small_done++;
		if (!big_done && gpx_poll(x, &d, 1) == 1)
			big_done = true;
		if (!big_done)
			before_big++;
	}
	ok(small_done == 8 && before_big >= 1, "copies of 1 MiB by one client complete while another's %zu MiB copy "
	    "runs (%d of 8 before it ended)", big >> 20, before_big);
	ok(gpx_wait(x, &d, 1, 60000) == 1 || big_done, "and the big copy completes afterwards");
	gpx_close(x);
	gpx_close(y);
	hbuf_free(&xa);
	hbuf_free(&xb);
	hbuf_free(&ya);
	hbuf_free(&yb);
}

/* A legacy CUDA IPC handle on a node not configured as one trust domain: refused with why. */
static void
test_legacy_refused(void)
{
	Gpx__DaemonMsg *r = harness_register_legacy(&H);

	ok(r != NULL && r->reply->status == GPX__STATUS__EACCES && strstr(r->reply->message, "trust") != NULL,
	    "a legacy IPC handle on a multi-tenant node: EACCES, saying why (%s)", r ? r->reply->message : "no reply");
	if (r != NULL)
		gpx__daemon_msg__free_unpacked(r, NULL);
}

/* A client that keeps asking and never reads the answers is cut off, not buffered forever. */
static void
test_never_reads(void)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Query q = GPX__QUERY__INIT;
	int s = harness_connect(&H), sent = 0;
	bool eof = false;
	Gpx__DaemonMsg *r = harness_hello(s, GPX_PROTO_VERSION, -1, NULL);

	if (r != NULL)
		gpx__daemon_msg__free_unpacked(r, NULL);
	q.what = GPX__QUERY_WHAT__Q_CLIENTS;
	m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
	m.query = &q;
	uint8_t buf[256];
	size_t len = gpx__client_msg__pack(&m, buf);
	double t0 = now();
	while (now() - t0 < 20) {
		ssize_t k = send(s, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (k < 0 && errno == EAGAIN) {
			usleep(1000);
			continue;
		}
		if (k < 0) {
			eof = true;     /* the daemon closed it */
			break;
		}
		sent++;
	}
	ok(eof, "a client that sends %d queries and reads no reply is disconnected", sent);
	close(s);
	int n = 0;
	gpx_conn *c;
	ok((n = gpx_connect(H.sock, "after", &c)) == 0, "and others are still served");
	if (n == 0)
		gpx_close(c);
}

int
main(void)
{
	const char *s = getenv("GPX_TEST_SCALE");

	if (s != NULL && atof(s) > 0)
		scale = atof(s);
	if (harness_start(&H, "[daemon]\nring_entries = 64\n") < 0)
		tap_bail("cannot start gpxd");
	test_legacy_refused();
	test_never_reads();
	test_eventfd_attack();
	test_corrupt_tail();
	test_round_robin();
	test_semaphore_wakes();
	ok(harness_wait_fds(&H, H.baseline, 5000) == H.baseline, "gpxd's descriptors back to their baseline");
	ok(harness_stop(&H) == 0, "gpxd stops cleanly");
	harness_cleanup(&H);
	return tap_done();
}
