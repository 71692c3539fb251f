/*
 * Integration tests against a real gpxd (started by harness.c on a private socket): clients
 * through libgpxclient moving checksummed data between memfds, single and vectored (up to
 * 65,536 segments), sharing buffers through exports, and every refusal the daemon owes them:
 * bounds, foreign region ids, export rules, read-only exports, credits, wrong descriptors.
 * Where libgpxclient cannot produce the bad input (wrong version, message before Hello,
 * oversized datagrams, too many descriptors, a corrupted ring) the test speaks the wire
 * protocol directly.  After each part the daemon's descriptor count must come back to what it
 * was, and at the end gpxd must stop cleanly on SIGTERM.
 *
 * Correctness never depends on timing: waits have generous limits and only turn a hang into a
 * failure; where a race decides between two legal outcomes (a cancel), both are accepted and
 * checked for what each promises.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "client-lib/gpx.h"
#include "proto/ring.h"
#include "tests/harness.h"
#include "tests/tclient.h"
#include "tests/tap.h"
#include "tests/util.h"

#define NCLIENTS 4
#define ROUNDS 25
#define BUFSZ (4u << 20)

struct harness H;

static int
daemon_fds_settle(int want)
{
	return harness_wait_fds(&H, want, WAIT_MS);
}

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

/* ---- several clients at once: random single and vectored copies, checksummed ---- */

struct worker {
	int id;
	uint64_t seed;
	int rounds_ok;
	int copies;
	int vectored;
	char err[256];
};

struct piece {
	uint64_t soff, doff, len;
};

/* Random disjoint destination pieces with random sources; returns how many fitted. */
static int
plan_pieces(struct piece *pc, int want, size_t size, uint64_t maxlen, uint64_t *seed)
{
	uint64_t cursor = rnd(seed) % 4096;
	int n = 0;

	while (n < want) {
		uint64_t len = 1 + rnd(seed) % maxlen;
		if (cursor + len > size)
			break;
		pc[n].doff = cursor;
		pc[n].len = len;
		pc[n].soff = rnd(seed) % (size - len + 1);
		cursor += len + rnd(seed) % 512;
		n++;
	}
	return n;
}

static void *
worker_main(void *arg)
{
	struct worker *w = arg;
	struct buf src, dst;
	static const int maxp = 600;
	struct piece *pc = calloc(maxp, sizeof(*pc));
	struct gpx_seg *segs = calloc(maxp, sizeof(*segs));
	unsigned char *shadow = malloc(BUFSZ);
	struct gpx_completion done[64];
	char name[32];
	gpx_conn *c;
	int r;

	snprintf(name, sizeof(name), "integ-worker-%d", w->id);
	if ((c = client(name)) == NULL) {
		snprintf(w->err, sizeof(w->err), "connect failed");
		goto out;
	}
	if (buf_new(&src, BUFSZ) < 0 || buf_new(&dst, BUFSZ) < 0 || buf_reg(c, &src, 0) < 0 ||
	    buf_reg(c, &dst, 0) < 0) {
		snprintf(w->err, sizeof(w->err), "buffers: %s", gpx_last_error(c));
		goto out_close;
	}
	fill_random(dst.p, BUFSZ, &w->seed);
	for (int round = 0; round < ROUNDS; round++) {
		bool vec = round % 3 == 2;
		int n;

		fill_random(src.p, BUFSZ, &w->seed);
		memcpy(shadow, dst.p, BUFSZ);
		if (vec) {
			/* One request of many small pieces: inline below 1,632 segments. */
			n = plan_pieces(pc, maxp, BUFSZ, 4096, &w->seed);
			for (int i = 0; i < n; i++) {
				segs[i] = (struct gpx_seg){ pc[i].soff, pc[i].doff, pc[i].len };
				memcpy(shadow + pc[i].doff, src.p + pc[i].soff, pc[i].len);
			}
			uint64_t tag = (uint64_t)round << 16 | 0xffff;
			if ((r = gpx_copyv(c, src.r, dst.r, segs, n, tag)) < 0) {
				snprintf(w->err, sizeof(w->err), "round %d: gpx_copyv: %s", round, gpx_strerror(r));
				goto out_close;
			}
			uint64_t bytes = 0, want = 0;
			for (int i = 0; i < n; i++)
				want += pc[i].len;
			if ((r = wait_tag(c, tag, &bytes)) != 0 || bytes != want) {
				snprintf(w->err, sizeof(w->err), "round %d: vectored copy of %d segments: %s, %llu of %llu bytes",
				    round, n, gpx_strerror(r), (unsigned long long)bytes, (unsigned long long)want);
				goto out_close;
			}
			w->vectored++;
		} else {
			/* Up to 32 transfers outstanding at once, of random sizes up to 256 KiB. */
			n = plan_pieces(pc, 1 + rnd(&w->seed) % 32, BUFSZ, 256 << 10, &w->seed);
			for (int i = 0; i < n; i++) {
				memcpy(shadow + pc[i].doff, src.p + pc[i].soff, pc[i].len);
				if ((r = gpx_copy(c, src.r, pc[i].soff, dst.r, pc[i].doff, pc[i].len,
				    (uint64_t)round << 16 | i)) < 0) {
					snprintf(w->err, sizeof(w->err), "round %d: gpx_copy: %s", round, gpx_strerror(r));
					goto out_close;
				}
			}
			bool seen[32] = { false };
			int got = 0;
			while (got < n) {
				int k = gpx_wait(c, done, 64, WAIT_MS);
				if (k <= 0) {
					snprintf(w->err, sizeof(w->err), "round %d: waiting: %s", round, gpx_strerror(k));
					goto out_close;
				}
				for (int i = 0; i < k; i++) {
					uint64_t t = done[i].tag;
					int idx = (int)(t & 0xffff);
					if ((t >> 16) != (uint64_t)round || idx >= n || seen[idx] || done[i].status != 0 ||
					    done[i].bytes != pc[idx].len) {
						snprintf(w->err, sizeof(w->err), "round %d: unexpected completion tag %#llx status %d bytes %llu",
						    round, (unsigned long long)t, done[i].status, (unsigned long long)done[i].bytes);
						goto out_close;
					}
					seen[idx] = true;
					got++;
				}
			}
			w->copies += n;
		}
		if (fnv(dst.p, BUFSZ) != fnv(shadow, BUFSZ)) {
			snprintf(w->err, sizeof(w->err), "round %d: destination checksum differs from the expected bytes", round);
			goto out_close;
		}
		w->rounds_ok++;
	}
out_close:
	gpx_close(c);
	buf_free(&src);
	buf_free(&dst);
out:
	free(pc);
	free(segs);
	free(shadow);
	return NULL;
}

static void
test_concurrent(void)
{
	pthread_t t[NCLIENTS];
	struct worker w[NCLIENTS];
	uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);

	diag("random seed %#llx", (unsigned long long)seed);
	for (int i = 0; i < NCLIENTS; i++) {
		memset(&w[i], 0, sizeof(w[i]));
		w[i].id = i;
		w[i].seed = seed + 0x9e3779b97f4a7c15ULL * (i + 1);
		pthread_create(&t[i], NULL, worker_main, &w[i]);
	}
	for (int i = 0; i < NCLIENTS; i++) {
		pthread_join(t[i], NULL);
		if (!ok(w[i].rounds_ok == ROUNDS, "client %d: %d rounds (%d copies, %d vectored requests) checksum-verified",
		    i, w[i].rounds_ok, w[i].copies, w[i].vectored))
			diag("client %d: %s", i, w[i].err);
	}
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline after %d clients", NCLIENTS);
}

/* ---- vectored requests with a segment table in a memfd ---- */

static void
test_big_vector(void)
{
	const uint32_t nseg = 65536, seg = 64;
	struct buf src, dst;
	struct gpx_seg *segs = calloc(nseg, sizeof(*segs));
	uint32_t *perm = calloc(nseg, sizeof(*perm));
	uint64_t seed = 0x1234567, bytes = 0;
	gpx_conn *c = client("integ-vector");
	bool same = true;

	if (c == NULL || buf_new(&src, (size_t)nseg * seg * 2) < 0 || buf_new(&dst, (size_t)nseg * seg) < 0 ||
	    buf_reg(c, &src, 0) < 0 || buf_reg(c, &dst, 0) < 0)
		tap_bail("cannot set up the vectored test");
	fill_random(src.p, src.len, &seed);
	memset(dst.p, 0, dst.len);
	/* Sources: a random permutation of the even slots of src, so every segment is distinct. */
	shuffle(perm, nseg, &seed);
	for (uint32_t i = 0; i < nseg; i++)
		segs[i] = (struct gpx_seg){ (uint64_t)perm[i] * seg * 2, (uint64_t)i * seg, seg };
	ok(gpx_copyv(c, src.r, dst.r, segs, nseg, 77) == 0, "a vectored request of %u segments is accepted", nseg);
	ok(wait_tag(c, 77, &bytes) == 0 && bytes == (uint64_t)nseg * seg,
	    "it completes with every byte moved (%llu bytes)", (unsigned long long)bytes);
	for (uint32_t i = 0; i < nseg && same; i++)
		same = memcmp(dst.p + (size_t)i * seg, src.p + (size_t)perm[i] * seg * 2, seg) == 0;
	ok(same, "each of the %u segments landed where it was sent", nseg);

	/* Just above what fits inline (memfd) and well below (inline), in one go. */
	for (int pass = 0; pass < 2; pass++) {
		uint32_t n = pass == 0 ? 1000 : 2000;
		memset(dst.p, 0, dst.len);
		for (uint32_t i = 0; i < n; i++)
			segs[i] = (struct gpx_seg){ (uint64_t)(n - 1 - i) * 128, (uint64_t)i * 100, 100 };
		ok(gpx_copyv(c, src.r, dst.r, segs, n, 78 + pass) == 0 && wait_tag(c, 78 + pass, &bytes) == 0 &&
		    bytes == (uint64_t)n * 100, "a vectored request of %u segments completes", n);
		same = true;
		for (uint32_t i = 0; i < n && same; i++)
			same = memcmp(dst.p + (size_t)i * 100, src.p + (size_t)(n - 1 - i) * 128, 100) == 0;
		ok(same, "its %u segments carry the right bytes", n);
	}

	/* A list made in place in the segment area (gpx_segs_reserve) goes without a copy. */
	struct gpx_seg *v = NULL;
	memset(dst.p, 0, dst.len);
	ok(gpx_segs_reserve(c, nseg, &v) == 0 && v != NULL, "room for %u segments in the segment area", nseg);
	for (uint32_t i = 0; v != NULL && i < nseg; i++)
		v[i] = (struct gpx_seg){ (uint64_t)perm[i] * seg * 2, (uint64_t)i * seg, seg };
	ok(v != NULL && gpx_copyv(c, src.r, dst.r, v, nseg, 80) == 0 && wait_tag(c, 80, &bytes) == 0 &&
	    bytes == (uint64_t)nseg * seg, "the list written there is accepted and completes");
	same = true;
	for (uint32_t i = 0; i < nseg && same; i++)
		same = memcmp(dst.p + (size_t)i * seg, src.p + (size_t)perm[i] * seg * 2, seg) == 0;
	ok(same, "each of its segments landed where it was sent");
	for (uint32_t n = 2; n <= 100; n += 98) {
		memset(dst.p, 0, 100 * seg);
		ok(gpx_segs_reserve(c, n, &v) == 0, "room for %u segments", n);
		for (uint32_t i = 0; i < n; i++)
			v[i] = (struct gpx_seg){ (uint64_t)i * seg * 2, (uint64_t)i * seg, seg };
		ok(gpx_copyv(c, src.r, dst.r, v, n - 1, 81) == 0 && wait_tag(c, 81, &bytes) == 0 &&
		    bytes == (uint64_t)(n - 1) * seg && memcmp(dst.p, src.p, seg) == 0 &&
		    dst.p[(n - 1) * seg] == 0, "fewer segments than reserved: only those are moved");
	}
	ok(gpx_segs_reserve(c, 1000, &v) == 0 && gpx_copyv(c, src.r, dst.r, v, 1001, 82) == -GPX_EINVAL,
	    "more segments than reserved are refused by the library");
	ok(gpx_segs_reserve(c, 1000, &v) == 0 && gpx_copy(c, src.r, 0, dst.r, 0, seg, 83) == 0 &&
	    wait_tag(c, 83, NULL) == 0 && gpx_copyv(c, src.r, dst.r, v, 1000, 84) == -GPX_EINVAL,
	    "another transfer ends the reservation: its room is no longer a list");
	ok(gpx_segs_reserve(c, 0, &v) == -GPX_EINVAL && v == NULL, "no room for 0 segments");
	/* Bad segments in a list made in place are refused by the daemon like any other. */
	ok(gpx_segs_reserve(c, 3, &v) == 0, "room for 3 segments");
	v[0] = (struct gpx_seg){ 0, 0, seg };
	v[1] = (struct gpx_seg){ 0, dst.len - seg + 1, seg };
	v[2] = (struct gpx_seg){ 0, 0, seg };
	ok(gpx_copyv(c, src.r, dst.r, v, 3, 85) == 0 && wait_tag(c, 85, NULL) == -GPX_ERANGE,
	    "a list made in place with a segment past the end is refused");
	gpx_close(c);
	buf_free(&src);
	buf_free(&dst);
	free(segs);
	free(perm);
}

/* ---- bounds, before any byte moves ---- */

static void
test_bounds(void)
{
	const size_t len = 65536;
	struct buf a, b;
	uint64_t seed = 99;
	gpx_conn *c = client("integ-bounds");

	if (c == NULL || buf_new(&a, len) < 0 || buf_new(&b, len) < 0 || buf_reg(c, &a, 0) < 0 ||
	    buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the bounds test");
	fill_random(a.p, len, &seed);
	fill_random(b.p, len, &seed);
	uint64_t before = fnv(b.p, len);
	static const struct {
		uint64_t soff, doff, n;
		const char *what;
	} bad[] = {
		{ 0, 65536, 1, "destination offset at the end, 1 byte" },
		{ 0, 65535, 2, "destination one byte past the end" },
		{ 65536 - 100, 0, 101, "source one byte past the end" },
		{ 1, 0, UINT64_MAX, "length 2^64-1 (offset + length overflows)" },
		{ 0, UINT64_MAX - 10, 20, "destination offset near 2^64 (offset + length wraps)" },
		{ UINT64_MAX, 0, 1, "source offset 2^64-1" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int r = gpx_copy_sync(c, a.r, bad[i].soff, b.r, bad[i].doff, bad[i].n);
		ok(r == -GPX_ERANGE, "%s: refused with ERANGE (got %s)", bad[i].what, gpx_strerror(r));
	}
	ok(fnv(b.p, len) == before, "the destination is unchanged after every refusal");

	/* One bad segment among good ones: the whole request is refused, the good ones too. */
	struct gpx_seg segs[2000];
	for (int i = 0; i < 2000; i++)
		segs[i] = (struct gpx_seg){ (uint64_t)i * 16, (uint64_t)i * 16, 16 };
	segs[1] = (struct gpx_seg){ 0, 65536 - 10, 11 };
	ok(gpx_copyv(c, a.r, b.r, segs, 2, 500) == 0 && wait_tag(c, 500, NULL) == -GPX_ERANGE,
	    "a vectored request with one segment a byte past the end is refused");
	segs[1] = (struct gpx_seg){ 16, 16, 16 };
	segs[1999] = (struct gpx_seg){ 0, 16, UINT64_MAX - 8 };
	ok(gpx_copyv(c, a.r, b.r, segs, 2000, 501) == 0 && wait_tag(c, 501, NULL) == -GPX_ERANGE,
	    "a 2,000-segment request (segment table in a memfd) whose last segment overflows is refused");
	ok(fnv(b.p, len) == before, "no byte of the refused vectored requests reached the destination");

	/* The exact fit is fine. */
	ok(gpx_copy_sync(c, a.r, 0, b.r, 65536 - 100, 100) == 0 && memcmp(b.p + 65436, a.p, 100) == 0,
	    "a copy ending exactly at the region's end succeeds");
	ok(gpx_copy_sync(c, a.r, 0, b.r, 0, 0) == 0, "a zero-length copy completes");
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
}

/* ---- page transfers (gpx_copy_pages) ---- */

static void
test_pages(void)
{
	const uint32_t n = 6000, page = 4096, slots = 8192;
	uint32_t *sp = malloc(n * sizeof(*sp)), *dp = malloc(n * sizeof(*dp));
	struct buf a, b;
	uint64_t seed = 4242, bytes = 0;
	gpx_conn *c = client("integ-pages");

	if (c == NULL || sp == NULL || dp == NULL || buf_new(&a, (size_t)slots * page) < 0 ||
	    buf_new(&b, (size_t)slots * page + 3) < 0 || buf_reg(c, &a, 0) < 0 || buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the page test");
	fill_random(a.p, a.len, &seed);
	memset(b.p, 0, b.len);
	/* Distinct destinations in a shuffled order, sources anywhere (repeats allowed). */
	shuffle(dp, n, &seed);
	for (uint32_t i = 0; i < n; i++)
		sp[i] = rnd(&seed) % slots;
	int r = gpx_copy_pages(c, a.r, 0, b.r, 3, page, sp, dp, n, 90);
	r = r < 0 ? r : wait_tag(c, 90, &bytes);
	ok(r == 0 && bytes == (uint64_t)n * page, "%u pages of 4 KiB by number complete (%llu bytes)", n,
	    (unsigned long long)bytes);
	bool same = true;
	for (uint32_t i = 0; i < n && same; i++)
		same = memcmp(b.p + 3 + (size_t)dp[i] * page, a.p + (size_t)sp[i] * page, page) == 0;
	ok(same, "each page landed at its destination page, 3 bytes into the region");

	/* Odd sizes and bases: pages of 1000 bytes from byte 17 on, to byte 5 on. */
	memset(b.p, 0, b.len);
	for (uint32_t i = 0; i < 3000; i++)
		sp[i] = (i * 7u) % 3000;
	ok(gpx_copy_pages(c, a.r, 17, b.r, 5, 1000, sp, dp, 3000, 91) == 0 && wait_tag(c, 91, &bytes) == 0 &&
	    bytes == 3000000, "3,000 pages of 1,000 bytes at odd bases complete");
	same = true;
	for (uint32_t i = 0; i < 3000 && same; i++)
		same = memcmp(b.p + 5 + (size_t)dp[i] * 1000, a.p + 17 + (size_t)sp[i] * 1000, 1000) == 0;
	ok(same, "their bytes are where page size and bases put them");

	/* The last page ends exactly at the end of the destination: fine; one byte further: refused. */
	sp[0] = 0;
	dp[0] = slots - 1;
	ok(gpx_copy_pages(c, a.r, 0, b.r, 3, page, sp, dp, 1, 92) == 0 && wait_tag(c, 92, NULL) == 0,
	    "a page ending exactly at the region's end is copied");
	fill_random(b.p, b.len, &seed);
	uint64_t before = fnv(b.p, b.len);
	static const struct {
		uint64_t soff, doff, size;
		uint32_t sp, dp;
		int status;
		const char *what;
	} bad[] = {
		{ 0, 4, 4096, 0, 8191, GPX__STATUS__ERANGE, "the last destination page one byte past the end" },
		{ 0, 0, 4096, 8192, 0, GPX__STATUS__ERANGE, "a source page number one past the region" },
		{ 0, 0, 4096, UINT32_MAX, 0, GPX__STATUS__ERANGE, "source page 2^32-1" },
		{ 0, 0, (1ull << 31) + 1, 0, 0, GPX__STATUS__ERANGE, "pages of 2 GiB + 1 byte" },
		{ UINT64_MAX - 10, 0, 16, 0, 0, GPX__STATUS__ERANGE, "a source base near 2^64" },
		{ 0, 1ull << 62, 16, 0, 0, GPX__STATUS__ERANGE, "a destination base of 2^62" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		/* The bad page last, after 99 good ones: the whole request is refused. */
		for (uint32_t k = 0; k < 99; k++)
			sp[k] = dp[k] = k;
		sp[99] = bad[i].sp;
		dp[99] = bad[i].dp;
		r = gpx_copy_pages(c, a.r, bad[i].soff, b.r, bad[i].doff, bad[i].size, sp, dp, 100, 93 + i);
		int st = r < 0 ? r : wait_tag(c, 93 + i, NULL);
		ok(st == -bad[i].status, "%s: refused with %s (got %s)", bad[i].what,
		    gpx_strerror(-bad[i].status), gpx_strerror(st));
	}
	ok(strstr(gpx_last_error(c), "page") != NULL, "the refusal says what was wrong (%s)", gpx_last_error(c));
	ok(fnv(b.p, b.len) == before, "no byte of the refused page transfers reached the destination");
	for (uint32_t k = 0; k < 99; k++)
		sp[k] = dp[k] = k;
	sp[99] = 8192;
	ok(gpx_copy_pages(c, a.r, 0, b.r, 0, page, sp, dp, 100, 110) == 0 && wait_tag(c, 110, NULL) == -GPX_ERANGE &&
	    strstr(gpx_last_error(c), "page 99 ") != NULL, "the message names the page: %s", gpx_last_error(c));
	/* A list long enough to be checked in two halves (the second perhaps on another core). */
	const uint32_t ln = 20000, lp = 64;
	uint32_t *ls = malloc(ln * sizeof(*ls)), *ld = malloc(ln * sizeof(*ld));
	if (ls == NULL || ld == NULL)
		tap_bail("out of memory");
	for (uint32_t i = 0; i < ln; i++) {
		ls[i] = rnd(&seed) % (a.len / lp);
		ld[i] = i;
	}
	uint64_t h0 = fnv(b.p, b.len);
	for (int k = 0; k < 2; k++) {
		uint32_t at = k ? ln - 1 : 3;
		char want[32];
		ld[at] = (uint32_t)(b.len / lp);      /* one past the destination's last whole page */
		snprintf(want, sizeof(want), "page %u ", at);
		ok(gpx_copy_pages(c, a.r, 0, b.r, 0, lp, ls, ld, ln, 120 + k) == 0 &&
		    wait_tag(c, 120 + k, NULL) == -GPX_ERANGE && strstr(gpx_last_error(c), want) != NULL,
		    "%u pages, page %u out (%s half): refused, named (%s)", ln, at, k ? "second" : "first",
		    gpx_last_error(c));
		ld[at] = at;
	}
	ok(fnv(b.p, b.len) == h0, "no byte of either reached the destination");
	r = gpx_copy_pages(c, a.r, 0, b.r, 0, lp, ls, ld, ln, 122);
	r = r < 0 ? r : wait_tag(c, 122, NULL);
	same = r == 0;
	for (uint32_t i = 0; i < ln && same; i++)
		same = memcmp(b.p + (size_t)i * lp, a.p + (size_t)ls[i] * lp, lp) == 0;
	ok(same, "the same %u pages, all in: verified", ln);
	free(ls);
	free(ld);
	/* A side of more than 2^31 pages: 1-byte pages of a sparse 3 GiB region, above page 2^31. */
	struct buf big;
	if (buf_new(&big, 3ull << 30) == 0 && buf_reg(c, &big, 0) == 0) {
		for (uint32_t k = 0; k < 100; k++) {
			sp[k] = (1u << 31) + 4096 * k;
			dp[k] = k;
			big.p[sp[k]] = (unsigned char)(k + 1);
		}
		memset(b.p, 0, 100);
		ok(gpx_copy_pages(c, big.r, 0, b.r, 0, 1, sp, dp, 100, 114) == 0 && wait_tag(c, 114, NULL) == 0 &&
		    b.p[0] == 1 && b.p[99] == 100, "1-byte pages above page 2^31 of a 3 GiB region are copied");
		sp[99] = 3u << 30;
		ok(gpx_copy_pages(c, big.r, 0, b.r, 0, 1, sp, dp, 100, 115) == 0 &&
		    wait_tag(c, 115, NULL) == -GPX_ERANGE, "page 3 Gi of it, one past its end, is refused");
		gpx_deregister(c, big.r);
		buf_free(&big);
	} else
		ok(false, "a sparse 3 GiB region for pages above 2^31");
	ok(gpx_copy_pages(c, a.r, 0, b.r, 0, 0, sp, dp, 1, 111) == -GPX_EINVAL, "page size 0 is refused by the library");
	ok(gpx_copy_pages(c, a.r, 0, b.r, 0, page, sp, NULL, 1, 112) == -GPX_EINVAL, "so is a missing list");
	ok(gpx_copy_pages(c, a.r, 0, b.r, 0, page, sp, dp, 0, 113) == -GPX_EINVAL, "and 0 pages");
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
	free(sp);
	free(dp);
}

/* ---- region ids are scoped to their connection ---- */

static bool
log_contains(const char *needle)
{
	char line[2048];
	bool hit = false;
	FILE *f = fopen(H.log, "r");

	if (f == NULL)
		return false;
	while (!hit && fgets(line, sizeof(line), f) != NULL)
		hit = strstr(line, needle) != NULL;
	fclose(f);
	return hit;
}

static void
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
	ok(log_contains("is not this connection's") && log_contains("refused client"),
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

static void
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
static void
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

static void
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

/* ---- cancel ---- */

static void
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

	/* Many cancels against a long queue: every tag ends once, whatever the race decided. */
	int n = 40, bad = 0;
	for (int t = 100; t < 100 + n; t++)
		if (gpx_copy(c, a.r, 0, b.r, 0, len / 8, t) < 0)
			bad++;
	for (int t = 100 + n - 1; t >= 100; t -= 2)
		(void)gpx_cancel(c, t);
	int seen[40] = { 0 };
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
				if (!(e[i].status == 0 && e[i].bytes == len / 8) &&
				    !(e[i].status == -GPX_ECANCELED && e[i].bytes < len / 8 && idx % 2 == 1))
					bad++;
			}
		}
	}
	for (int i = 0; i < n; i++)
		bad += seen[i] != 1;
	ok(bad == 0 && got == n, "40 queued copies, every other one cancelled: each ends exactly once, consistently");
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
}

/* ---- credits ---- */

static void
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

/* A raw client with a ring: Hello with an eventfd, the ring mapped, one memfd registered. */
struct raw {
	int sock;
	int efd;
	struct gpx_ring_hdr *ring;
	size_t ring_len;
	uint32_t entries;
	uint64_t region;
	struct buf mem;
	uint32_t seq;
};

static int
raw_open_v(struct raw *w, uint32_t version)
{
	int ring_fd;

	memset(w, 0, sizeof(*w));
	w->seq = 10;
	if ((w->sock = harness_connect(&H)) < 0 || (w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
		return -1;
	Gpx__DaemonMsg *m = harness_hello(w->sock, version, w->efd, &ring_fd);
	if (m == NULL || m->reply->status != 0 || ring_fd < 0 || m->reply->welcome->version != version) {
		if (m)
			gpx__daemon_msg__free_unpacked(m, NULL);
		return -1;
	}
	w->entries = m->reply->welcome->ring_entries;
	gpx__daemon_msg__free_unpacked(m, NULL);
	w->ring_len = gpx_ring_size(w->entries);
	w->ring = mmap(NULL, w->ring_len, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
	close(ring_fd);
	if (w->ring == MAP_FAILED || buf_new(&w->mem, 65536) < 0)
		return -1;

	Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
	Gpx__Register reg = GPX__REGISTER__INIT;
	reg.kind = GPX__MEM_KIND__MEM_HOST;
	reg.length = w->mem.len;
	cm.seq = ++w->seq;
	cm.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	cm.register_ = &reg;
	if (harness_send(w->sock, &cm, &w->mem.fd, 1) < 0 ||
	    (m = harness_recv(w->sock, WAIT_MS, NULL, NULL, NULL)) == NULL)
		return -1;
	int r = m->reply->status == 0 && m->reply->body_case == GPX__REPLY__BODY_REGISTERED ? 0 : -1;
	if (r == 0)
		w->region = m->reply->registered->region;
	gpx__daemon_msg__free_unpacked(m, NULL);
	return r;
}

static int
raw_open(struct raw *w)
{
	return raw_open_v(w, GPX_PROTO_VERSION);
}

static int
raw_transfer(struct raw *w, uint64_t tag)
{
	Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	Gpx__Segment s = GPX__SEGMENT__INIT, *sp = &s;

	s.src_offset = 0;
	s.dst_offset = 4096;
	s.length = 1;
	t.tag = tag;
	t.src_region = w->region;
	t.dst_region = w->region;
	t.n_segments = 1;
	t.segments = &sp;
	cm.seq = ++w->seq;
	cm.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	cm.transfer = &t;
	return harness_send(w->sock, &cm, NULL, 0);
}

static void
raw_close(struct raw *w)
{
	if (w->ring != NULL && w->ring != MAP_FAILED)
		munmap(w->ring, w->ring_len);
	if (w->sock >= 0)
		close(w->sock);
	if (w->efd >= 0)
		close(w->efd);
	if (w->mem.p != NULL)
		buf_free(&w->mem);
}

static uint64_t
ring_head(struct raw *w)
{
	return __atomic_load_n(&w->ring->head, __ATOMIC_ACQUIRE);
}

static bool
wait_head(struct raw *w, uint64_t want)
{
	for (int i = 0; i < WAIT_MS && ring_head(w) < want; i++) {
		struct pollfd p = { .fd = w->efd, .events = POLLIN };
		uint64_t v;
		if (poll(&p, 1, 1) == 1)
			(void)!read(w->efd, &v, sizeof(v));
	}
	return ring_head(w) == want;
}

static void
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

static void
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

/* ---- descriptors that are not what the message says ---- */

static void
test_bad_fds(void)
{
	gpx_conn *c = client("integ-badfd");
	gpx_region r;
	int with_c, pfd[2], sp[2];
	char path[256];

	if (c == NULL || pipe(pfd) < 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, sp) < 0)
		tap_bail("cannot set up the bad-fd test");
	with_c = harness_fds(&H);
	snprintf(path, sizeof(path), "%s/regular", H.dir);
	int file = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	(void)!ftruncate(file, 65536);
	int unsealed = memfd_create("integ-unsealed", MFD_ALLOW_SEALING);
	(void)!ftruncate(unsealed, 65536);
	int noseal = memfd_create("integ-noseal", 0);
	(void)!ftruncate(noseal, 65536);
	struct {
		const char *what;
		int fd;
	} bad[] = {
		{ "a pipe", pfd[0] },
		{ "/dev/null", open("/dev/null", O_RDWR) },
		{ "an eventfd", eventfd(0, 0) },
		{ "a socket", sp[0] },
		{ "a regular file", file },
		{ "a memfd without seals", unsealed },
		{ "a memfd that cannot be sealed", noseal },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int e = gpx_register_host(c, bad[i].fd, 0, 4096, 0, &r);
		ok(e == -GPX_EBADFD, "%s as host memory: EBADFD (%s)", bad[i].what, gpx_strerror(e));
		int n = harness_wait_fds(&H, with_c, WAIT_MS);
		ok(n == with_c, "  and gpxd closed it (%d descriptors, want %d)", n, with_c);
		close(bad[i].fd);
	}
	close(pfd[1]);
	close(sp[1]);
	unlink(path);

	struct buf b;
	if (buf_new(&b, 65536) < 0)
		tap_bail("memfd");
	ok(gpx_register_host(c, b.fd, 4096, 65536, 0, &r) == -GPX_ERANGE, "a range beyond the memfd's end: ERANGE");
	ok(gpx_register_host(c, b.fd, UINT64_MAX - 10, 100, 0, &r) == -GPX_EINVAL, "offset + length overflowing: EINVAL");
	ok(gpx_register_host(c, b.fd, 0, 0, 0, &r) == -GPX_EINVAL, "length 0: EINVAL");
	ok(harness_wait_fds(&H, with_c, WAIT_MS) == with_c, "none of those memfds stays open in gpxd");
	ok(gpx_register_host(c, b.fd, 4096, 8192, 0, &r) == 0 && harness_wait_fds(&H, with_c + 1, WAIT_MS) == with_c + 1,
	    "a good memfd is held while registered");
	ok(gpx_deregister(c, r) == 0 && harness_wait_fds(&H, with_c, WAIT_MS) == with_c, "and closed when deregistered");
	buf_free(&b);
	gpx_close(c);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");
}

/* ---- the wire protocol, spoken wrong ---- */

static Gpx__ClientMsg
query_msg(uint32_t seq, Gpx__Query *q)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;

	gpx__query__init(q);
	q->what = GPX__QUERY_WHAT__Q_STATUS;
	m.seq = seq;
	m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
	m.query = q;
	return m;
}

/* Sends raw bytes with any number of fds (wire_send refuses both what is too big and too many). */
static ssize_t
send_raw(int sock, const void *buf, size_t len, const int *fds, int nfds)
{
	size_t clen = CMSG_SPACE(nfds * sizeof(int));
	char *cbuf = calloc(1, clen ? clen : 1);
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	ssize_t n;

	if (nfds > 0) {
		mh.msg_control = cbuf;
		mh.msg_controllen = clen;
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
	}
	n = sendmsg(sock, &mh, MSG_NOSIGNAL);
	free(cbuf);
	return n;
}

static size_t
pack_query(uint8_t *buf, uint32_t seq)
{
	Gpx__Query q;
	Gpx__ClientMsg m = query_msg(seq, &q);

	return gpx__client_msg__pack(&m, buf);
}

/* A query-only raw connection past Hello. */
static int
raw_ready(void)
{
	int s = harness_connect(&H);
	Gpx__DaemonMsg *m = s >= 0 ? harness_hello(s, GPX_PROTO_VERSION, -1, NULL) : NULL;
	bool good = m != NULL && m->reply->status == 0;

	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	if (!good) {
		if (s >= 0)
			close(s);
		return -1;
	}
	return s;
}

/* A Query round trip: the reply's status, or -1 if none came. */
static int
query_status(int s, uint32_t seq, const int *fds, int nfds)
{
	uint8_t buf[256];
	size_t n = pack_query(buf, seq);

	if (send_raw(s, buf, n, fds, nfds) != (ssize_t)n)
		return -1;
	Gpx__DaemonMsg *m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
	int st = m != NULL ? (int)m->reply->status : -1;
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	return st;
}

static void
test_protocol(void)
{
	uint8_t *big = calloc(1, 3 * GPX_MSG_MAX);
	Gpx__DaemonMsg *m;
	int s, efd = eventfd(0, EFD_CLOEXEC);

	/* Wrong version: EVERSION, then closed. */
	s = harness_connect(&H);
	m = harness_hello(s, 99, efd, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EVERSION, "Hello with version 99 gets EVERSION");
	if (m != NULL) {
		ok(m->reply->message != NULL && strstr(m->reply->message, "99") != NULL,
		    "the refusal explains itself: \"%s\"", m->reply->message);
		gpx__daemon_msg__free_unpacked(m, NULL);
	} else
		ok(0, "the refusal explains itself");
	ok(harness_wait_eof(s, WAIT_MS), "and the connection is closed");
	close(s);

	/* Hello that promises a ring but brings no eventfd. */
	s = harness_connect(&H);
	Gpx__ClientMsg hm = GPX__CLIENT_MSG__INIT;
	Gpx__Hello h = GPX__HELLO__INIT;
	h.version = GPX_PROTO_VERSION;
	hm.seq = 1;
	hm.body_case = GPX__CLIENT_MSG__BODY_HELLO;
	hm.hello = &h;
	harness_send(s, &hm, NULL, 0);
	m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EBADFD && harness_wait_eof(s, WAIT_MS),
	    "Hello asking for a ring without an eventfd: EBADFD, closed");
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	close(s);
	/* Hello whose fd is not an eventfd. */
	s = harness_connect(&H);
	int notefd = memfd_create("integ-not-eventfd", MFD_CLOEXEC);
	m = harness_hello(s, GPX_PROTO_VERSION, notefd, NULL);
	ok(m != NULL && m->reply->status == GPX__STATUS__EBADFD && harness_wait_eof(s, WAIT_MS),
	    "Hello with a memfd for its eventfd: EBADFD, closed");
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	close(notefd);
	close(s);

	/* Anything before Hello closes the connection. */
	s = harness_connect(&H);
	ok(query_status(s, 1, NULL, 0) == GPX__STATUS__EPROTO && harness_wait_eof(s, WAIT_MS),
	    "a Query before Hello: EPROTO, closed");
	close(s);
	s = harness_connect(&H);
	ok(query_status(s, 1, &efd, 1) == GPX__STATUS__EPROTO && harness_wait_eof(s, WAIT_MS),
	    "a Query with an fd before Hello: EPROTO, closed");
	close(s);
	s = harness_connect(&H);
	ok(send_raw(s, "\x0a\xff\xff", 3, NULL, 0) == 3 && harness_wait_eof(s, WAIT_MS),
	    "undecodable bytes before Hello: closed");
	close(s);
	s = harness_connect(&H);
	{
		uint8_t hb[128];
		Gpx__ClientMsg m3 = GPX__CLIENT_MSG__INIT;
		Gpx__Hello h3 = GPX__HELLO__INIT;
		int three[3] = { efd, efd, efd };
		h3.version = GPX_PROTO_VERSION;
		m3.seq = 1;
		m3.body_case = GPX__CLIENT_MSG__BODY_HELLO;
		m3.hello = &h3;
		size_t hl = gpx__client_msg__pack(&m3, hb);
		ok(send_raw(s, hb, hl, three, 3) == (ssize_t)hl && harness_wait_eof(s, WAIT_MS),
		    "a Hello carrying three fds (it takes one): closed");
	}
	close(s);

	/* The size cap: exactly GPX_MSG_MAX is read, one byte more closes the connection. */
	for (int over = 0; over <= 1; over++) {
		s = raw_ready();
		size_t n = pack_query(big, 7);
		/* Pad with an unknown length-delimited field 15 to the exact size. */
		size_t want = GPX_MSG_MAX + over, pad = want - n - 1 - 3;
		big[n] = (15 << 3) | 2;
		big[n + 1] = 0x80 | (pad & 0x7f);
		big[n + 2] = 0x80 | ((pad >> 7) & 0x7f);
		big[n + 3] = (uint8_t)(pad >> 14);
		memset(big + n + 4, 'x', pad);
		ssize_t sent = send_raw(s, big, want, NULL, 0);
		if (!over) {
			m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
			ok(sent == (ssize_t)want && m != NULL && m->reply->status == 0 && m->reply->seq == 7,
			    "a datagram of exactly GPX_MSG_MAX (%d) bytes is answered", GPX_MSG_MAX);
			if (m != NULL)
				gpx__daemon_msg__free_unpacked(m, NULL);
		} else
			ok(sent == (ssize_t)want && harness_wait_eof(s, WAIT_MS),
			    "a datagram of GPX_MSG_MAX + 1 bytes closes the connection");
		close(s);
	}
	/* Three times the cap (the socket's send buffer permitting): the same, nothing read into memory. */
	s = raw_ready();
	int sndbuf = 1 << 20;
	setsockopt(s, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
	memset(big, 0, 3 * GPX_MSG_MAX);
	ok(send_raw(s, big, 3 * GPX_MSG_MAX, NULL, 0) == 3 * GPX_MSG_MAX && harness_wait_eof(s, WAIT_MS),
	    "a datagram of 3 x GPX_MSG_MAX closes the connection");
	close(s);
	s = raw_ready();
	ok(send_raw(s, "\x12\x01", 2, NULL, 0) == 2 && harness_wait_eof(s, WAIT_MS), "undecodable bytes after Hello: closed");
	close(s);
	s = raw_ready();
	uint8_t noBody[8];
	Gpx__ClientMsg nb = GPX__CLIENT_MSG__INIT;
	nb.seq = 3;
	size_t nbl = gpx__client_msg__pack(&nb, noBody);
	ok(send_raw(s, noBody, nbl, NULL, 0) == (ssize_t)nbl && harness_wait_eof(s, WAIT_MS),
	    "a message without a body (unknown type): closed");
	close(s);

	/* Descriptors the message does not take: refused, closed, connection kept. */
	s = raw_ready();
	int with_s = harness_fds(&H);
	int many[100];
	for (int i = 0; i < 100; i++)
		many[i] = efd;
	ok(query_status(s, 11, many, 1) == GPX__STATUS__EPROTO, "a Query carrying one fd: EPROTO");
	ok(query_status(s, 12, many, GPX_MAX_FDS + 1) == GPX__STATUS__EPROTO,
	    "a Query carrying GPX_MAX_FDS + 1 fds (more than any message takes): EPROTO");
	ok(query_status(s, 13, many, 100) == GPX__STATUS__EPROTO, "a Query carrying 100 fds (control data truncated): EPROTO");
	ok(query_status(s, 14, NULL, 0) == 0, "the connection still works");
	ok(harness_wait_fds(&H, with_s, WAIT_MS) == with_s, "every one of those fds was closed in gpxd");
	/* 10,000 times over, in bursts: the daemon never runs out of descriptors. */
	uint8_t qb[64];
	size_t ql = pack_query(qb, 0);
	int answered = 0, sent = 0;
	for (int burst = 0; burst < 200; burst++) {
		for (int i = 0; i < 50; i++)
			sent += send_raw(s, qb, ql, many, 2 + (i % 3)) == (ssize_t)ql;
		for (int i = 0; i < 50; i++) {
			m = harness_recv(s, WAIT_MS, NULL, NULL, NULL);
			if (m == NULL)
				break;
			answered += m->reply->status == GPX__STATUS__EPROTO;
			gpx__daemon_msg__free_unpacked(m, NULL);
		}
	}
	ok(sent == 10000 && answered == 10000, "10,000 messages with 2-4 unwanted fds each are all refused (%d)", answered);
	ok(query_status(s, 15, NULL, 0) == 0 && harness_wait_fds(&H, with_s, WAIT_MS) == with_s,
	    "the connection still works and gpxd holds none of those fds");
	close(s);
	close(efd);
	free(big);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");
}

/* ---- the doorbell: one wake per record, and a client that blocks it ---- */

static void
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
	ok(gpx_copy(c, a.r, 0, a.r, 4096, 64, 1) == 0, "a client with a full, blocking eventfd submits a copy");
	/* gpx_poll, not gpx_wait: a wait would read (and so empty) the counter itself. */
	int r = 0;
	for (int i = 0; i < WAIT_MS && r != -GPX_ECONN; i++) {
		r = gpx_poll(c, e, 64);
		if (r == 0)
			usleep(1000);
	}
	ok(r == -GPX_ECONN, "gpxd disconnects it instead of blocking on its doorbell (%s)", gpx_strerror(r));
	ok(gpx_copy_sync(good, b.r, 0, b.r, 100, 100) == 0, "the other client's copies keep completing");
	gpx_close(c);
	gpx_close(good);
	close(efd);
	buf_free(&a);
	buf_free(&b);
	ok(daemon_fds_settle(H.baseline) == H.baseline, "gpxd's descriptors back to baseline");
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

static void
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

	/* Idle connections: closed after idle_timeout, with or without Hello. */
	if (harness_start(&L, "[daemon]\nidle_timeout = 2\n") < 0)
		tap_bail("cannot start a third gpxd");
	int s1 = harness_connect(&L), s2 = harness_connect(&L);
	Gpx__DaemonMsg *m = harness_hello(s1, GPX_PROTO_VERSION, -1, NULL);
	ok(m != NULL && m->reply->status == 0 && harness_wait_eof(s1, WAIT_MS),
	    "a client that says nothing after Hello is closed after the idle timeout");
	if (m != NULL)
		gpx__daemon_msg__free_unpacked(m, NULL);
	ok(harness_wait_eof(s2, WAIT_MS), "so is one that never says Hello");
	close(s1);
	close(s2);
	ok(harness_wait_fds(&L, L.baseline, WAIT_MS) == L.baseline && harness_stop(&L) == 0,
	    "that gpxd returns to its baseline and stops cleanly");
	harness_cleanup(&L);
}

/* ---- SIGTERM with work in flight, a restart, and a SIGKILL ---- */

static void
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

int
main(void)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	if (harness_start(&H, NULL) < 0)
		tap_bail("cannot start gpxd");
	diag("gpxd pid %d on %s, %d descriptors at baseline", (int)H.pid, H.sock, H.baseline);

	test_concurrent();
	test_big_vector();
	test_bounds();
	test_pages();
	test_foreign_region();
	test_exports();
	test_revoke_running();
	test_export_rules();
	test_cancel();
	test_credits_lib();
	test_credits_raw();
	test_disconnect();
	test_bad_fds();
	test_protocol();
	test_doorbell();
	test_limits();

	ok(daemon_fds_settle(H.baseline) == H.baseline, "at the end gpxd holds exactly its baseline descriptors");
	test_stop_restart();
	if (tap_failed)
		harness_dump_log(&H);
	harness_cleanup(&H);
	return tap_done();
}
