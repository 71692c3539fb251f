/*
 * The integration tests' completion ring and credit (tests/integ.c runs them): cancel, the
 * credit of a ring's slots as libgpxclient keeps it and as gpxd enforces it on a raw client
 * that never reads its ring (with the lists and page lists such a client may send wrong, a
 * ring tail it corrupts, and protocol 1), and the doorbell: one wake per record, and a client
 * whose eventfd blocks.
 */
#include "config.h"

#include <dirent.h>
#include <poll.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#include "client-lib/gpx.h"
#include "proto/ring.h"
#include "tests/harness.h"
#include "tests/integ.h"
#include "tests/tclient.h"
#include "tests/tap.h"
#include "tests/util.h"

/* ---- cancel ---- */

void
test_cancel(void)
{
	const size_t len = 32u << 20;
	struct buf a, b;
	gpx_conn *c = client("integ-cancel");
	struct gpx_completion e[16];
	uint64_t seed = 5;

	if (c == NULL || buf_new(&a, len) < 0 || buf_new(&b, len) < 0 || buf_reg(c, &a, 0) < 0 ||
	    buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the cancel test");
	fill_random(a.p, len, &seed);
	int subm = 0;
	for (int t = 1; t <= 4; t++)
		subm += gpx_copy(c, a.r, 0, b.r, 0, len, t) == 0;
	int r = gpx_cancel(c, 4);
	ok(subm == 4 && (r == 0 || r == -GPX_ENOENT), "four 32 MiB copies queued; cancelling the last: %s",
	    r == 0 ? "accepted" : "it had already finished");
	int count[5] = { 0 }, status4 = 1;
	uint64_t bytes4 = 0;
	bool others_ok = true;
	int got = 0;
	while (got < 4) {
		int k = gpx_wait(c, e, 16, WAIT_MS);
		if (k <= 0)
			break;
		for (int i = 0; i < k; i++, got++) {
			if (e[i].tag < 1 || e[i].tag > 4) {
				others_ok = false;
				continue;
			}
			count[e[i].tag]++;
			if (e[i].tag == 4) {
				status4 = e[i].status;
				bytes4 = e[i].bytes;
			} else if (e[i].status != 0 || e[i].bytes != len)
				others_ok = false;
		}
	}
	ok(got == 4 && count[1] == 1 && count[2] == 1 && count[3] == 1 && count[4] == 1 && others_ok,
	    "each transfer completes exactly once; the others are untouched");
	ok((status4 == -GPX_ECANCELED && bytes4 < len) || (status4 == 0 && bytes4 == len),
	    "the cancelled one ends either cancelled with fewer bytes, or complete (%s, %llu bytes)",
	    gpx_strerror(status4), (unsigned long long)bytes4);
	if (status4 == 0)
		ok(memcmp(a.p, b.p, len) == 0, "it completed: the destination holds the source");
	else
		ok(r == 0, "it was cancelled, and the cancel request said so");
	/* A round trip through the engine, then nothing else may be waiting. */
	ok(gpx_copy_sync(c, a.r, 0, b.r, 0, 1) == 0 && gpx_poll(c, e, 16) == 0 && gpx_outstanding(c) == 0,
	    "no second completion for any of them");
	ok(gpx_cancel(c, 12345) == -GPX_ENOENT, "cancelling an unknown tag: ENOENT");

	/*
	 * Many cancels against a long queue: every tag ends once, whatever the race decided.  The
	 * engine serves a connection's copies round-robin, so none of 40 copies of 32 MiB has all
	 * its chunks handed out before most of the 1.25 GiB has moved, long after the cancels:
	 * cancelled ones must end cancelled.  (A cancel that does nothing would let all of them
	 * complete; of up to six rounds, one without a single cancelled copy counts as such.  A
	 * slow gpxd, under memcheck, takes the 40 from its queue a few a turn, and the first
	 * ones end before the cancels come: a round there saw 0 or 3 of them still running.)
	 */
	int n = 40, bad = 0, cancelled = 0, accepted = 0, round;
	for (round = 0; round < 6 && cancelled == 0; round++) {
		int seen[40] = { 0 };
		accepted = 0;
		for (int t = 100; t < 100 + n; t++)
			if (gpx_copy(c, a.r, 0, b.r, 0, len, t) < 0)
				bad++;
		for (int t = 100 + n - 1; t >= 100; t -= 2)
			accepted += gpx_cancel(c, t) == 0;
		got = 0;
		while (got < n) {
			int k = gpx_wait(c, e, 16, WAIT_MS);
			if (k <= 0)
				break;
			for (int i = 0; i < k; i++, got++) {
				int idx = (int)e[i].tag - 100;
				if (idx < 0 || idx >= n)
					bad++;
				else {
					seen[idx]++;
					if (e[i].status == -GPX_ECANCELED && e[i].bytes < len && idx % 2 == 1)
						cancelled++;
					else if (!(e[i].status == 0 && e[i].bytes == len))
						bad++;
				}
			}
		}
		for (int i = 0; i < n; i++)
			bad += seen[i] != 1;
		bad += got != n;
	}
	ok(bad == 0, "40 queued copies of 32 MiB, every other one cancelled: each ends exactly once, consistently");
	ok(cancelled > 0 && cancelled <= accepted, "cancelled copies end cancelled: %d of the 20 (%d cancels accepted, "
	    "round %d of 6)", cancelled, accepted, round);
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
}

/* ---- credits ---- */

void
test_credits_lib(void)
{
	const size_t len = 8u << 20;
	struct buf a, b;
	gpx_conn *c = client("integ-credits");
	struct gpx_completion e[64];
	int accepted = 0;

	if (c == NULL || buf_new(&a, len) < 0 || buf_new(&b, len) < 0 || buf_reg(c, &a, 0) < 0 ||
	    buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the credit test");
	for (int t = 0; t < H.ring_entries; t++)
		accepted += gpx_copy(c, a.r, 0, b.r, 0, len, t) == 0;
	int r = gpx_copy(c, a.r, 0, b.r, 0, len, 9999);
	ok(accepted == H.ring_entries && r == -GPX_EBUSY,
	    "%d transfers outstanding fill the ring; one more is refused at once with EBUSY", accepted);
	int got = drain(c, e, 64, WAIT_MS);
	bool all = got == H.ring_entries;
	for (int i = 0; i < got; i++)
		all = all && e[i].status == 0 && e[i].tag != 9999;
	ok(all, "the %d accepted transfers all complete, the refused one leaves no record", got);
	ok(gpx_copy_sync(c, a.r, 0, b.r, 0, 1) == 0, "credit is back once the completions were collected");
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
}

/* A Transfer of one byte, offset 0 to 4096 of the raw client's memfd, with flags. */
static int
raw_transfer_flags(struct raw *w, uint64_t tag, uint32_t flags)
{
	Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	Gpx__Segment s = GPX__SEGMENT__INIT, *sp = &s;

	s.src_offset = 0;
	s.dst_offset = 4096;
	s.length = 1;
	t.tag = tag;
	t.flags = flags;
	t.src_region = w->region;
	t.dst_region = w->region;
	t.n_segments = 1;
	t.segments = &sp;
	cm.seq = ++w->seq;
	cm.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	cm.transfer = &t;
	return harness_send(w->sock, &cm, NULL, 0);
}

static int
raw_transfer(struct raw *w, uint64_t tag)
{
	return raw_transfer_flags(w, tag, 0);
}

/*
 * No transfer flag is defined yet: a Transfer or a submission with any bit of flags set is
 * refused EINVAL, so that a flag added later is never ignored by a gpxd that does not know it.
 */
void
test_transfer_flags(void)
{
	struct raw w;
	Gpx__DaemonMsg *m;

	if (raw_open(&w) < 0)
		tap_bail("cannot set up a raw client");
	raw_transfer_flags(&w, 8100, 1);
	m = harness_recv(w.sock, WAIT_MS, NULL, NULL, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EINVAL && m->reply->tag == 8100 && m->reply->message != NULL &&
	    strstr(m->reply->message, "flag") != NULL, "a Transfer with flags 0x1 is refused EINVAL (%s)",
	    m != NULL && m->reply->message != NULL ? m->reply->message : "no reply");
	if (m)
		gpx__daemon_msg__free_unpacked(m, NULL);
	*gpx_sq_slot(w.ring, w.entries, 0) = (struct gpx_sqe){ .tag = 8101, .src_region = w.region,
	    .dst_region = w.region, .dst_offset = 4096, .length = 1, .flags = 0x80000000u };
	raw_kick(&w, 1);
	m = harness_recv(w.sock, WAIT_MS, NULL, NULL, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EINVAL && m->reply->tag == 8101,
	    "a submission with flags 0x80000000 is refused EINVAL (%s)",
	    m != NULL && m->reply->message != NULL ? m->reply->message : "no reply");
	if (m)
		gpx__daemon_msg__free_unpacked(m, NULL);
	ok(ring_head(&w) == 0 && raw_transfer(&w, 8102) == 0 && wait_head(&w, 1) &&
	    gpx_ring_slot(w.ring, 0)->tag == 8102 && gpx_ring_slot(w.ring, 0)->status == 0,
	    "neither ran; the next Transfer, flags 0, runs");
	raw_close(&w);
}

void
test_credits_raw(void)
{
	struct raw w;

	if (raw_open(&w) < 0)
		tap_bail("cannot set up a raw client");
	/* Nothing is ever consumed: entries transfers take every slot, the next one is refused. */
	int sent = 0;
	for (uint32_t t = 1; t <= w.entries + 1; t++)
		sent += raw_transfer(&w, t) == 0;
	Gpx__DaemonMsg *m = harness_recv(w.sock, WAIT_MS, NULL, NULL, NULL);
	ok(sent == (int)w.entries + 1 && m != NULL && m->reply->status == GPX__STATUS__EBUSY &&
	    m->reply->tag == w.entries + 1, "daemon side: transfer %u of a %u-entry ring that is never read is refused BUSY",
	    w.entries + 1, w.entries);
	if (m)
		gpx__daemon_msg__free_unpacked(m, NULL);
	ok(wait_head(&w, w.entries), "the %u accepted transfers fill the ring exactly (head %llu)", w.entries,
	    (unsigned long long)ring_head(&w));
	/* Two workers: records come in completion order, not submission order. */
	bool seen_all = true;
	uint8_t *seen = calloc(w.entries + 2, 1);
	for (uint64_t i = 0; i < w.entries; i++) {
		const struct gpx_cqe *e = gpx_ring_slot(w.ring, i);
		seen_all = seen_all && e->tag >= 1 && e->tag <= w.entries && !seen[e->tag] && e->status == 0 &&
		    e->bytes == 1;
		if (e->tag <= w.entries)
			seen[e->tag] = 1;
	}
	free(seen);
	ok(seen_all, "their records carry each tag once, status OK");
	/* Consume everything: credit comes back. */
	__atomic_store_n(&w.ring->tail, ring_head(&w), __ATOMIC_RELEASE);
	ok(raw_transfer(&w, 5000) == 0 && wait_head(&w, w.entries + 1) &&
	    gpx_ring_slot(w.ring, w.entries)->tag == 5000, "after the tail moves, a transfer is accepted again");
	/* Segment tables in a memfd that do not hold what the message claims. */
	static const struct {
		uint32_t count;
		int kind;           /* 0: small memfd, 1: pipe, 2: memfd plus inline segments */
		int status;
		const char *what;
	} tables[] = {
		{ 100000, 0, GPX__STATUS__EINVAL, "seg_count 100,000 with a 4 KiB table" },
		{ 10, 1, GPX__STATUS__EBADFD, "a pipe as the segment table" },
		{ 10, 2, GPX__STATUS__EPROTO, "a table and inline segments at once" },
	};
	for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
		Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
		Gpx__Transfer t = GPX__TRANSFER__INIT;
		Gpx__Segment sg = GPX__SEGMENT__INIT, *sgp = &sg;
		int fd, p[2] = { -1, -1 };
		if (tables[i].kind == 1) {
			if (pipe(p) < 0)
				tap_bail("pipe");
			fd = p[0];
		} else {
			fd = memfd_create("integ-segs", MFD_CLOEXEC);
			(void)!ftruncate(fd, 4096);
		}
		t.tag = 6000 + i;
		t.src_region = t.dst_region = w.region;
		t.seg_count = tables[i].count;
		if (tables[i].kind == 2) {
			t.n_segments = 1;
			t.segments = &sgp;
		}
		cm.seq = ++w.seq;
		cm.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
		cm.transfer = &t;
		harness_send(w.sock, &cm, &fd, 1);
		close(fd);
		if (p[1] >= 0)
			close(p[1]);
		m = harness_recv(w.sock, WAIT_MS, NULL, NULL, NULL);
		ok(m != NULL && (int)m->reply->status == tables[i].status && m->reply->tag == 6000 + i,
		    "%s: refused (%s)", tables[i].what, m ? m->reply->message : "no reply");
		if (m)
			gpx__daemon_msg__free_unpacked(m, NULL);
	}

	/* Page transfers come only as records in the segment area, which this client has none of. */
	static const struct {
		int kind;           /* 0: no area, 1: a memfd, 2: inline segments */
		int status;
		const char *what;
	} pages[] = {
		{ 0, GPX__STATUS__EINVAL, "a page list with no segment area" },
		{ 1, GPX__STATUS__EPROTO, "a page list in a memfd" },
		{ 2, GPX__STATUS__EPROTO, "pages as inline segments" },
	};
	for (size_t i = 0; i < sizeof(pages) / sizeof(pages[0]); i++) {
		Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
		Gpx__Transfer t = GPX__TRANSFER__INIT;
		Gpx__Segment sg = GPX__SEGMENT__INIT, *sgp = &sg;
		int fd = pages[i].kind == 1 ? memfd_create("integ-pages", MFD_CLOEXEC) : -1;
		if (fd >= 0)
			(void)!ftruncate(fd, 4096);
		t.tag = 6100 + i;
		t.src_region = t.dst_region = w.region;
		t.page_size = 16;
		if (pages[i].kind == 2) {
			t.n_segments = 1;
			t.segments = &sgp;
		} else
			t.seg_count = 4;
		cm.seq = ++w.seq;
		cm.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
		cm.transfer = &t;
		harness_send(w.sock, &cm, fd >= 0 ? &fd : NULL, fd >= 0);
		if (fd >= 0)
			close(fd);
		m = harness_recv(w.sock, WAIT_MS, NULL, NULL, NULL);
		ok(m != NULL && (int)m->reply->status == pages[i].status && m->reply->tag == 6100 + i,
		    "%s: refused (%s)", pages[i].what, m ? m->reply->message : "no reply");
		if (m)
			gpx__daemon_msg__free_unpacked(m, NULL);
	}

	/* A tail that runs ahead of head is a broken client: refused, then disconnected. */
	__atomic_store_n(&w.ring->tail, ring_head(&w) + 3, __ATOMIC_RELEASE);
	raw_transfer(&w, 5001);
	m = harness_recv(w.sock, WAIT_MS, NULL, NULL, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EPROTO && m->reply->tag == 5001,
	    "a transfer after the client corrupted its ring tail is refused EPROTO");
	if (m)
		gpx__daemon_msg__free_unpacked(m, NULL);
	ok(harness_wait_eof(w.sock, WAIT_MS), "and gpxd closes that connection");
	raw_close(&w);

	/* A client of protocol 1 is still served, and a page transfer on it is refused. */
	if (raw_open_v(&w, 1) < 0)
		tap_bail("cannot set up a raw client of protocol 1");
	ok(raw_transfer(&w, 7000) == 0 && wait_head(&w, 1) && gpx_ring_slot(w.ring, 0)->status == 0,
	    "a client speaking protocol 1 is welcomed as such, and its copies run");
	Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	t.tag = 7001;
	t.src_region = t.dst_region = w.region;
	t.page_size = 16;
	t.seg_count = 4;
	cm.seq = ++w.seq;
	cm.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	cm.transfer = &t;
	harness_send(w.sock, &cm, NULL, 0);
	m = harness_recv(w.sock, WAIT_MS, NULL, NULL, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EPROTO && m->reply->tag == 7001,
	    "a page transfer on it is refused EPROTO (%s)", m ? m->reply->message : "no reply");
	if (m)
		gpx__daemon_msg__free_unpacked(m, NULL);
	raw_close(&w);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");
}

/*
 * Records that end together ring one doorbell.  Submissions the loop takes in one pass over
 * the queue go to the engine together, and zero-byte copies end as they are handed over: their
 * records are posted together, with one write that raises the client's eventfd by their
 * number (gpx_doorbell_writes_total counts it).  The queue is filled while the loop sleeps
 * (sq_wakeup set), then kicked once, so one pass takes it whole.  (A copy worker's completions
 * of one look at its GPU are posted the same way.)  A pass ends at the turn's slice, which a
 * slow gpxd (under memcheck) can reach within the eight: such a round rings once per pass, so
 * up to four rounds are tried; a gpxd that rings once per record fails every one.
 */
void
test_doorbell_together(void)
{
	enum { N = 8, ROUNDS = 4 };
	struct raw w;
	uint64_t v = 0, wakes = 0, base = 0;
	double writes = -1;
	bool all = true;
	int round;

	if (raw_open(&w) < 0)
		tap_bail("cannot set up a raw client");
	for (round = 0; round < ROUNDS && all && writes != 1; round++, base += N) {
		for (int i = 0; i < WAIT_MS && !__atomic_load_n(&w.ring->sq_wakeup, __ATOMIC_ACQUIRE); i++)
			usleep(1000);
		(void)!read(w.efd, &v, sizeof(v));     /* (nothing is expected: the last round's were read) */
		const double writes0 = harness_metric(&H, "gpx_doorbell_writes_total");
		for (uint64_t i = base; i < base + N; i++)
			*gpx_sq_slot(w.ring, w.entries, i) = (struct gpx_sqe){ .tag = 700 + i, .src_region = w.region,
			    .dst_region = w.region, .src_offset = 0, .dst_offset = 4096, .length = 0 };
		if (raw_kick(&w, base + N) < 0)
			tap_bail("SqKick");
		for (int i = 0; i < WAIT_MS && ring_head(&w) < base + N; i++)
			usleep(1000);     /* (not wait_head: it reads the eventfd this test counts) */
		all = ring_head(&w) == base + N;
		for (uint64_t i = base; all && i < base + N; i++) {
			const struct gpx_cqe *e = gpx_ring_slot(w.ring, i);
			all = e->tag == 700 + i && e->status == 0 && e->bytes == 0;
		}
		usleep(100000);      /* a doorbell trails its record: any late one is counted too */
		wakes = read(w.efd, &v, sizeof(v)) == sizeof(v) ? v : 0;
		writes = writes0 >= 0 ? harness_metric(&H, "gpx_doorbell_writes_total") - writes0 : -1;
	}
	ok(all, "%d zero-byte copies queued while gpxd slept, then one kick: %llu records, in order, status OK",
	    N, (unsigned long long)(ring_head(&w) - (base - N)));
	ok(wakes == N, "the client's eventfd was raised by one per record (%llu)", (unsigned long long)wakes);
	ok(writes == 1, "posted together, in one write (gpx_doorbell_writes_total rose by %.0f; round %d of %d)",
	    writes, round, ROUNDS);
	raw_close(&w);
}

/* ---- the doorbell: one wake per record, and a client that blocks it ---- */

void
test_doorbell(void)
{
	const int total = 20000;
	struct buf a;
	struct gpx_completion e[64];
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct gpx_connect_opts o = { .socket = H.sock, .name = "integ-doorbell", .eventfd = efd };
	gpx_conn *c = NULL;
	int sent = 0, got = 0, bad = 0;

	if (gpx_connect_opts(&o, &c) < 0 || buf_new(&a, 65536) < 0 || buf_reg(c, &a, 0) < 0)
		tap_bail("cannot set up the doorbell test");
	/* Waits only look at readiness, so the counter keeps every doorbell. */
	while (got < total) {
		while (sent < total && gpx_outstanding(c) < (unsigned)H.ring_entries)
			bad += gpx_copy(c, a.r, 0, a.r, 4096, 64, sent++) != 0;
		struct pollfd p = { .fd = efd, .events = POLLIN };
		if (poll(&p, 1, WAIT_MS) != 1)
			break;
		int k = gpx_poll(c, e, 64);
		if (k < 0)
			break;
		for (int i = 0; i < k; i++)
			bad += e[i].status != 0 || e[i].bytes != 64;
		got += k;
	}
	/* A record is published before its doorbell is rung: the last doorbells may trail. */
	uint64_t wakes = 0, v;
	for (int i = 0; i < WAIT_MS && wakes < (uint64_t)total; i++) {
		if (read(efd, &v, sizeof(v)) == sizeof(v))
			wakes += v;
		else
			usleep(1000);
	}
	if (read(efd, &v, sizeof(v)) == sizeof(v))
		wakes += v;
	ok(got == total && bad == 0, "%d transfers through the client's own eventfd all complete", got);
	ok(wakes == (uint64_t)total, "the eventfd counted exactly one doorbell per completion (%llu)",
	    (unsigned long long)wakes);
	gpx_close(c);
	close(efd);

	/* Another client makes its eventfd blocking and fills the counter. */
	gpx_conn *good = client("integ-bystander");
	struct buf b;
	efd = eventfd(0, EFD_CLOEXEC);
	o.eventfd = efd;
	o.name = "integ-doorbell-full";
	if (good == NULL || buf_new(&b, 65536) < 0 || buf_reg(good, &b, 0) < 0 || gpx_connect_opts(&o, &c) < 0 ||
	    buf_reg(c, &a, 0) < 0)
		tap_bail("cannot set up the blocked-doorbell test");
	uint64_t max = 0xfffffffffffffffeULL;
	(void)!write(efd, &max, sizeof(max));
	double t0 = now(), worst = 0, gone = 0;
	ok(gpx_copy(c, a.r, 0, a.r, 4096, 64, 1) == 0, "a client with a full, blocking eventfd submits a copy");
	/* gpx_poll, not gpx_wait: a wait would read (and so empty) the counter itself.  Meanwhile
	 * the other client copies, each of its copies timed, until the first is gone. */
	int r = 0, during = 0;
	bad = 0;
	while (r != -GPX_ECONN && now() - t0 < WAIT_MS / 1e3) {
		r = gpx_poll(c, e, 64);
		if (r == -GPX_ECONN)
			gone = now() - t0;
		double t1 = now();
		if (gpx_copy_sync(good, b.r, 0, b.r, 100, 100) == 0)
			during++;
		else
			bad++;
		if (now() - t1 > worst)
			worst = now() - t1;
	}
	ok(r == -GPX_ECONN && gone < BYSTANDER_MAX_S,
	    "gpxd disconnects it instead of blocking on its doorbell (%s, after %.1f ms, bound %.0f)", gpx_strerror(r),
	    gone * 1e3, BYSTANDER_MAX_S * 1e3);
	ok(bad == 0 && during > 0 && worst < BYSTANDER_MAX_S,
	    "the other client's copies kept completing meanwhile (%d, the slowest %.1f ms, bound %.0f)", during,
	    worst * 1e3, BYSTANDER_MAX_S * 1e3);
	gpx_close(c);
	gpx_close(good);
	close(efd);
	buf_free(&a);
	buf_free(&b);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");
}

/*
 * A wait for one tag that spins takes every record that comes meanwhile, and gpxd writes no
 * doorbell while it spins; the records of other transfers it puts aside must still make gpx_fd
 * readable, for an event loop that watches it and calls gpx_poll.
 */
void
test_backlog_doorbell(void)
{
	const size_t n = 16u << 20;
	struct buf s1, d1, s2, d2;
	gpx_conn *c;
	int rounds = 0, readable = 0;

	setenv("GPX_WAIT_SPIN_US", "200000", 1);     /* read as the connection is made */
	c = client("integ-backlog");
	unsetenv("GPX_WAIT_SPIN_US");
	if (c == NULL || buf_new(&s1, n) < 0 || buf_new(&d1, n) < 0 || buf_new(&s2, n) < 0 || buf_new(&d2, n) < 0 ||
	    buf_reg(c, &s1, 0) < 0 || buf_reg(c, &d1, 0) < 0 || buf_reg(c, &s2, 0) < 0 || buf_reg(c, &d2, 0) < 0)
		tap_bail("cannot set up the backlog doorbell test");
	for (; rounds < 20; rounds++) {
		uint64_t bytes = 0;
		struct gpx_completion e;
		struct pollfd p = { .fd = gpx_fd(c), .events = POLLIN };
		if (gpx_copy(c, s2.r, 0, d2.r, 0, n, 2 * rounds) < 0 || gpx_copy(c, s1.r, 0, d1.r, 0, n, 2 * rounds + 1) < 0 ||
		    wait_tag(c, 2 * rounds + 1, &bytes) != 0 || bytes != n)
			break;
		readable += poll(&p, 1, 2000) == 1;
		if (wait_tag(c, 2 * rounds, &bytes) != 0 || bytes != n)
			break;
		(void)gpx_wait(c, &e, 1, 0);     /* reads the doorbell, for the next round */
	}
	ok(rounds == 20 && readable == 20, "a wait that put other transfers' completions aside left gpx_fd "
	    "readable for them (%d of %d rounds)", readable, rounds);
	gpx_close(c);
	buf_free(&s1);
	buf_free(&d1);
	buf_free(&s2);
	buf_free(&d2);
}

/*
 * A client that sleeps in its wait through a host copy's last chunk only, having watched
 * that chunk begin: one worker, copies of two chunks of 32 MiB; the client waits (spinning
 * not at all) once the destination's second half begins to fill.  The worker calls a sleeping
 * client as the last chunk starts (engine_chunk_soon), finds this one not yet waiting, and
 * calls again as the chunk goes on, until it sleeps: each sleep is cut short before the
 * record comes (gpx_doorbells_early_total).  A worker that called once only left the record's
 * own doorbell to wake it (as it did a wait that spun its 1 ms and slept in the last chunk).
 */
void
test_host_wake_after_spin(void)
{
	enum { ROUNDS = 8 };
	const size_t n = 64u << 20;
	struct harness L;
	struct buf s, d;
	gpx_conn *c = NULL;
	double before, after;
	int good = 0, seen = 0;

	if (harness_start(&L, "[daemon]\nworkers = 1\nchunk_size = 32M\nmetrics = 127.0.0.1:0\n") < 0)
		tap_bail("wake test: no gpxd");
	setenv("GPX_WAIT_SPIN_US", "0", 1);     /* read as the connection is made */
	if (gpx_connect(L.sock, "integ-late-sleeper", &c) < 0 || buf_new(&s, n) < 0 || buf_new(&d, n) < 0 ||
	    buf_reg(c, &s, 0) < 0 || buf_reg(c, &d, 0) < 0)
		tap_bail("wake test: cannot set up the copies");
	unsetenv("GPX_WAIT_SPIN_US");
	before = harness_metric(&L, "gpx_doorbells_early_total");
	for (int i = 0; i < ROUNDS; i++) {
		uint64_t seed = 300 + i, bytes = 0;
		const volatile uint64_t *half = (const uint64_t *)(d.p + n / 2);
		fill_random(s.p, n, &seed);
		memset(d.p, 0, n);
		if (gpx_copy(c, s.r, 0, d.r, 0, n, 300 + i) < 0)
			break;
		for (double end = now() + WAIT_MS / 1e3; *half == 0 && now() < end;)
			;
		seen += *half != 0;
		good += wait_tag(c, 300 + i, &bytes) == 0 && bytes == n && memcmp(s.p, d.p, n) == 0;
	}
	after = harness_metric(&L, "gpx_doorbells_early_total");
	ok(good == ROUNDS, "%d copies of 64 MiB in two chunks, each waited for once its second half began to land "
	    "(%d seen so): %d in place", ROUNDS, seen, good);
	ok(before >= 0 && after - before >= ROUNDS / 2, "... the client's sleeps were cut short before the records came, "
	    "the worker calling again once it slept: %.0f early doorbells for %d copies", after - before, ROUNDS);
	gpx_close(c);
	buf_free(&s);
	buf_free(&d);
	ok(harness_stop(&L) == 0, "that gpxd stops cleanly");
	if (tap_failed)
		harness_dump_log(&L);
	harness_cleanup(&L);
}

/* Context switches of every thread of gpxd so far, voluntary or not; -1 if /proc does not say. */
static long
daemon_switches(void)
{
	char path[300], line[256];
	long n = 0, v;
	struct dirent *e;
	DIR *d;

	snprintf(path, sizeof(path), "/proc/%d/task", (int)H.pid);
	if ((d = opendir(path)) == NULL)
		return -1;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/%d/task/%s/status", (int)H.pid, e->d_name);
		FILE *f = fopen(path, "re");
		while (f != NULL && fgets(line, sizeof(line), f) != NULL)
			if (sscanf(line, "voluntary_ctxt_switches: %ld", &v) == 1 ||
			    sscanf(line, "nonvoluntary_ctxt_switches: %ld", &v) == 1)
				n += v;
		if (f != NULL)
			fclose(f);
	}
	closedir(d);
	return n;
}

/*
 * An idle gpxd sleeps.  After the doorbells above and a second and a half with no client
 * sending anything, its threads switch in and out of the CPU a few times a second at most:
 * the doorbell sentinel, which ticks every 5 ms while doorbells ring, parks after a second
 * without one (200 switches a second if it did not).  The next doorbell wakes it: it watches
 * doorbell writes again, ticking for a second after the last.
 */
void
test_idle_sleeps(void)
{
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct gpx_connect_opts o = { .socket = H.sock, .name = "integ-idle", .eventfd = efd };
	struct gpx_completion e;
	struct pollfd p = { .fd = efd, .events = POLLIN };
	gpx_conn *c = NULL;
	struct buf a;

	if (gpx_connect_opts(&o, &c) < 0 || buf_new(&a, 65536) < 0 || buf_reg(c, &a, 0) < 0)
		tap_bail("cannot set up the idle test");
	usleep(1500000);
	long s0 = daemon_switches();
	usleep(1000000);
	long s1 = daemon_switches();
	ok(s0 >= 0 && s1 >= 0 && s1 - s0 <= 20, "an idle gpxd's threads switched %ld times in a second (at most 20)",
	    s1 - s0);
	/* poll on the eventfd, not a wait that spins: the completion rings the doorbell */
	bool rung = gpx_copy(c, a.r, 0, a.r, 4096, 64, 1) == 0 && poll(&p, 1, WAIT_MS) == 1 && gpx_poll(c, &e, 1) == 1 &&
	    e.status == 0;
	s0 = daemon_switches();
	usleep(500000);
	s1 = daemon_switches();
	ok(rung && s1 - s0 >= 50, "a doorbell wakes the sentinel: %ld switches in the half second after it (at "
	    "least 50)", s1 - s0);
	gpx_close(c);
	close(efd);
	buf_free(&a);
}

/*
 * Order between the submission queue and messages: a copy the client put in the queue before
 * it sent a message is taken before that message, even when it was published after gpxd's
 * last look at the queue.  gpxd waits 20 ms between its look and each read after a turn's
 * first (GPXD_TEST_READ_DELAY_US); a raw client (it never kicks) has a cancel of nothing
 * answered, then queues two copies within its region and deregisters the region at once, all
 * in that wait.  The turn's slice has passed by the time gpxd reads the message, so it takes
 * the first copy, keeps the message, and sends it on after the second (conn_poll_all).  Taken
 * in the wrong order, a copy finds the region gone.
 */
#define ORDER_ROUNDS 8

/* Sends one message of w's and reads its reply's status (or -1000). */
static int
raw_rpc(struct raw *w, Gpx__ClientMsg *cm)
{
	cm->seq = ++w->seq;
	if (harness_send(w->sock, cm, NULL, 0) < 0)
		return -1000;
	Gpx__DaemonMsg *m = harness_recv(w->sock, 5000, NULL, NULL, NULL);
	int st = m != NULL && m->body_case == GPX__DAEMON_MSG__BODY_REPLY ? (int)m->reply->status : -1000;
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	return st;
}

/* What gpxd's status says is held against its budgets; UINT64_MAX if it did not answer. */
static uint64_t
budget_used(gpx_conn *q)
{
	Gpx__QueryReply *r = status_query(q);
	uint64_t u = r != NULL ? r->status->budget_used : UINT64_MAX;

	if (r != NULL)
		gpx__query_reply__free_unpacked(r, NULL);
	return u;
}

/*
 * A message kept behind queued submissions when its connection is killed: its descriptors
 * closed, its charge given back (conn_kill).  In gpxd's wait a raw client queues a full ring of
 * 4 KiB copies and sends a Register with a memfd of its own; gpxd takes a copy, keeps the
 * Register (the turn's slice is over) and goes on with the queue a slice a turn.  Once a copy
 * has completed the client moves its queue's tail out of range, and gpxd kills the connection
 * with the Register still kept: no answer comes to it.
 */
#define HELD_ROUNDS 4

void
test_sq_held_kill(void)
{
	struct harness Lh, *L = &Lh;
	gpx_conn *q = NULL;
	int held = 0, fds0, fds1 = -1;
	uint64_t used0, used1 = UINT64_MAX;

	/* (a ring of 16,384 copies: gpxd takes them for some 100 ms after it kept the message) */
	setenv("GPXD_TEST_READ_DELAY_US", "20000", 1);
	int e = harness_start(L, "[daemon]\nring_entries = 16384\n");
	unsetenv("GPXD_TEST_READ_DELAY_US");
	if (e < 0)
		tap_bail("held test: no gpxd");
	if (gpx_connect(L->sock, "held-watcher", &q) < 0)
		tap_bail("held test: no watcher");
	used0 = budget_used(q);
	fds0 = harness_fds(L);
	/* (a round whose client was late for gpxd's wait keeps nothing: it is tried again) */
	for (int k = 0; k < 3 * HELD_ROUNDS && held < HELD_ROUNDS; k++) {
		struct raw w;
		if (raw_open_on(&w, L, GPX_PROTO_VERSION) < 0)
			tap_bail("held test: no raw client");
		Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
		Gpx__Cancel x = GPX__CANCEL__INIT;
		x.tag = 999;
		cm.body_case = GPX__CLIENT_MSG__BODY_CANCEL;
		cm.cancel = &x;
		(void)raw_rpc(&w, &cm);
		for (uint32_t i = 0; i < w.entries; i++)
			*gpx_sq_slot(w.ring, w.entries, i) = (struct gpx_sqe){ .tag = 1 + i, .src_region = w.region,
			    .dst_region = w.region, .src_offset = 0, .dst_offset = 32768, .length = 4096 };
		__atomic_store_n(&w.ring->sq_tail, w.entries, __ATOMIC_RELEASE);
		struct buf rb;
		uint32_t rseq;
		if (buf_new(&rb, 4096) < 0 || (rseq = raw_send_register(&w, rb.fd, rb.len)) == 0)
			tap_bail("held test: a Register with a memfd");
		buf_free(&rb);
		for (int i = 0; i < 5000 && ring_head(&w) == 0; i++)
			usleep(1000);
		bool started = ring_head(&w) > 0 && ring_head(&w) < w.entries;
		__atomic_store_n(&w.ring->sq_tail, 3ull * w.entries, __ATOMIC_RELEASE);
		bool answered = false, eof = false;
		for (int i = 0; i < 5000 && !eof; i++) {
			Gpx__DaemonMsg *m = harness_recv(w.sock, 1, NULL, NULL, &eof);
			if (m != NULL && m->reply->seq == rseq)
				answered = true;
			if (m != NULL)
				gpx__daemon_msg__free_unpacked(m, NULL);
		}
		if (started && !answered && eof)
			held++;
		else
			diag("round %d not kept to the end: %llu copies had completed, the Register %sanswered, %s", k + 1,
			    (unsigned long long)ring_head(&w), answered ? "" : "not ", eof ? "then the connection ended" :
			    "no end seen");
		raw_close(&w);
	}
	fds1 = harness_wait_fds(L, fds0, 2000);
	for (int i = 0; i < 200 && (used1 = budget_used(q)) != used0; i++)
		usleep(10000);
	ok(held == HELD_ROUNDS && fds1 == fds0 && used1 == used0 && harness_log_has(L, "submission queue corrupted"),
	    "a message kept behind queued copies goes with its connection when that is killed: %d rounds of %d kept "
	    "to the end, gpxd's descriptors back to %d (%d, the message's memfd closed), %llu bytes held against the budgets "
	    "(%llu before)", held, HELD_ROUNDS, fds1, fds0, (unsigned long long)used1, (unsigned long long)used0);
	gpx_close(q);
	ok(harness_stop(L) == 0, "that gpxd stops cleanly");
	if (tap_failed)
		harness_dump_log(L);
	harness_cleanup(L);
}

void
test_sq_order(void)
{
	struct harness L;
	int good = 0, bytes_ok = 0, first = 0;
	uint64_t seed = 11;

	setenv("GPXD_TEST_READ_DELAY_US", "20000", 1);
	int e = harness_start(&L, NULL);
	unsetenv("GPXD_TEST_READ_DELAY_US");
	if (e < 0)
		tap_bail("order test: no gpxd");
	for (int k = 0; k < ORDER_ROUNDS; k++) {
		struct raw w;
		if (raw_open_on(&w, &L, GPX_PROTO_VERSION) < 0)
			tap_bail("order test: no raw client");
		fill_random(w.mem.p, 4096, &seed);
		memset(w.mem.p + 4096, 0, 4096);
		Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
		Gpx__Cancel x = GPX__CANCEL__INIT;
		x.tag = 999;
		cm.body_case = GPX__CLIENT_MSG__BODY_CANCEL;
		cm.cancel = &x;
		int c0 = raw_rpc(&w, &cm);
		for (int i = 0; i < 2; i++)
			*gpx_sq_slot(w.ring, w.entries, i) = (struct gpx_sqe){ .tag = 1 + i, .src_region = w.region,
			    .dst_region = w.region, .src_offset = 2048 * i, .dst_offset = 4096 + 2048 * i, .length = 2048 };
		__atomic_store_n(&w.ring->sq_tail, 2, __ATOMIC_RELEASE);
		Gpx__ClientMsg dm = GPX__CLIENT_MSG__INIT;
		Gpx__Deregister d = GPX__DEREGISTER__INIT;
		d.region = w.region;
		dm.body_case = GPX__CLIENT_MSG__BODY_DEREGISTER;
		dm.deregister = &d;
		int d0 = raw_rpc(&w, &dm);
		/* Their records, or (taken after the region went) a refusal, a message of its own. */
		int st = -1000;
		for (int i = 0; i < 5000 && st == -1000; i++) {
			if (ring_head(&w) >= 2)
				st = (int)gpx_ring_slot(w.ring, 0)->status | (int)gpx_ring_slot(w.ring, 1)->status;
			else {
				Gpx__DaemonMsg *m = harness_recv(w.sock, 1, NULL, NULL, NULL);
				if (m != NULL && m->body_case == GPX__DAEMON_MSG__BODY_REPLY && m->reply->tag >= 1)
					st = m->reply->status;
				if (m != NULL)
					gpx__daemon_msg__free_unpacked(m, NULL);
			}
		}
		good += c0 == GPX__STATUS__ENOENT && d0 == 0 && st == 0;
		bytes_ok += st == 0 && memcmp(w.mem.p, w.mem.p + 4096, 4096) == 0;
		if (st != 0 && first == 0)
			first = st;
		raw_close(&w);
	}
	ok(good == ORDER_ROUNDS && bytes_ok == ORDER_ROUNDS, "two copies queued before their region was deregistered "
	    "by the next message are taken first, even published after gpxd looked at the queue and past the turn's "
	    "slice: %d of %d rounds done, %d byte-exact (first status %d)", good, ORDER_ROUNDS, bytes_ok, first);
	ok(harness_stop(&L) == 0, "that gpxd stops cleanly");
	if (tap_failed)
		harness_dump_log(&L);
	harness_cleanup(&L);
}
