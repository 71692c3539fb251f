/*
 * The integration tests' copies (tests/integ.c runs them): several clients at once moving
 * checksummed data with random single and vectored copies, vectored requests up to 65,536
 * segments (inline, in the segment area, and written in place with gpx_segs_reserve), the
 * bounds every segment is checked against before any byte moves, and page transfers by
 * number (gpx_copy_pages) with their refusals.
 */
#include "config.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include "client-lib/gpx.h"
#include "proto/wire.h"
#include "tests/harness.h"
#include "tests/integ.h"
#include "tests/tclient.h"
#include "tests/tap.h"
#include "tests/util.h"

#define NCLIENTS 4
#define ROUNDS 25
#define BUFSZ (4u << 20)

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

void
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

void
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

void
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

void
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

/*
 * Page lists in GPU memory (gpx_copy_pages_table, protocol 4): every refusal a machine
 * without a GPU can see.  The table's bounds are checked before whether it is GPU memory, so
 * that a host region of 800 bytes shows them: 100 pages (two uint32_t each) fit from offset 0,
 * 99 from offset 4, 100 from 4 do not.  The copies themselves are the GPU tests'.
 */
void
test_pages_table(void)
{
	const uint32_t page = 4096, slots = 64;
	struct buf a, b, t;
	uint64_t seed = 77;
	gpx_conn *c = client("integ-pages-table");

	if (c == NULL || buf_new(&a, (size_t)slots * page) < 0 || buf_new(&b, (size_t)slots * page) < 0 ||
	    buf_new(&t, 800) < 0 || buf_reg(c, &a, 0) < 0 || buf_reg(c, &b, 0) < 0 || buf_reg(c, &t, 0) < 0)
		tap_bail("cannot set up the page table test");
	uint32_t *tab = (uint32_t *)t.p;
	for (uint32_t i = 0; i < 100; i++)
		tab[i] = tab[100 + i] = i % slots;
	fill_random(a.p, a.len, &seed);
	fill_random(b.p, b.len, &seed);
	const uint64_t before = fnv(b.p, b.len);
	static const struct {
		uint64_t off;
		uint32_t n;
		int status;
		const char *say, *what;
	} cases[] = {
		{ 0, 100, GPX_EINVAL, "GPU memory", "a table in host memory" },
		{ 4, 99, GPX_EINVAL, "GPU memory", "99 pages from offset 4 (the table's last byte): in bounds, host memory" },
		{ 0, 101, GPX_ERANGE, "inside its region", "101 pages (808 bytes) of an 800-byte table" },
		{ 4, 100, GPX_ERANGE, "inside its region", "100 pages from offset 4, 4 bytes past its end" },
		{ 2, 10, GPX_ERANGE, "aligned", "a table at an offset that is not a multiple of 4" },
		{ UINT64_MAX - 3, 1, GPX_ERANGE, "inside its region", "an offset that wraps" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int r = gpx_copy_pages_table(c, a.r, 0, b.r, 0, page, t.r, cases[i].off, cases[i].n, 300 + i);
		r = r < 0 ? r : wait_tag(c, 300 + i, NULL);
		ok(r == -cases[i].status && strstr(gpx_last_error(c), cases[i].say) != NULL, "%s: %s (%s)", cases[i].what,
		    gpx_strerror(r), gpx_last_error(c));
	}
	int r = gpx_copy_pages_table(c, a.r, 0, b.r, 0, page, t.r + 1000, 0, 10, 310);
	ok((r < 0 ? r : wait_tag(c, 310, NULL)) == -GPX_ENOENT, "a table region that does not exist: ENOENT");
	ok(fnv(b.p, b.len) == before, "no byte of the refused transfers reached the destination");
	/* A batch's table: the same checks, and the same refusal of host memory. */
	struct gpx_pair pr[2] = { { .src = a.r, .dst = b.r }, { .src = a.r, .dst = b.r, .dst_offset = 4096 } };
	r = gpx_copy_pages_batch_table(c, pr, 2, page, t.r, 0, 100, 314);
	r = r < 0 ? r : wait_tag(c, 314, NULL);
	ok(r == -GPX_EINVAL && strstr(gpx_last_error(c), "GPU memory") != NULL, "a batch's table in host memory: %s (%s)",
	    gpx_strerror(r), gpx_last_error(c));
	r = gpx_copy_pages_batch_table(c, pr, 2, page, t.r, 4, 100, 315);
	r = r < 0 ? r : wait_tag(c, 315, NULL);
	ok(r == -GPX_ERANGE && strstr(gpx_last_error(c), "inside its region") != NULL,
	    "a batch's table 4 bytes past its region: %s (%s)", gpx_strerror(r), gpx_last_error(c));
	ok(gpx_copy_pages_batch_table(c, pr, 2, page, 0, 0, 10, 316) == -GPX_EINVAL,
	    "the library refuses a batch's table of region 0");
	ok(gpx_copy_pages_table(c, a.r, 0, b.r, 0, 0, t.r, 0, 10, 311) == -GPX_EINVAL &&
	    gpx_copy_pages_table(c, a.r, 0, b.r, 0, page, 0, 0, 10, 312) == -GPX_EINVAL &&
	    gpx_copy_pages_table(c, a.r, 0, b.r, 0, page, t.r, 0, 0, 313) == -GPX_EINVAL,
	    "the library refuses page size 0, table 0 and 0 pages");

	/* On the wire: what the library never sends. */
	unsigned char *area;
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer x = GPX__TRANSFER__INIT;
	m.seq = 5;
	m.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	m.transfer = &x;
	static const struct {
		uint32_t version;
		uint64_t page_size, list_region, list_offset, area_offset;
		uint32_t pair_count;
		const char *what;
	} wire[] = {
		{ 3, 4096, 7, 0, 0, 0, "a table on a protocol 3 connection" },
		{ GPX_PROTO_VERSION, 0, 7, 0, 0, 0, "a table without a page size" },
		{ GPX_PROTO_VERSION, 4096, 0, 8, 0, 0, "a table offset without its region" },
		{ GPX_PROTO_VERSION, 4096, 7, 0, 64, 0, "a table and a list in the segment area" },
		{ 3, 4096, 7, 0, 0, 1, "a table in a batch on a protocol 3 connection" },
		{ GPX_PROTO_VERSION, 4096, 7, 0, 64, 1, "a batch's table and a list in the segment area" },
		{ GPX_PROTO_VERSION, 0, 7, 0, 0, 1, "a batch's table without a page size" },
	};
	for (size_t i = 0; i < sizeof(wire) / sizeof(wire[0]); i++) {
		int s = harness_area_client(&H, wire[i].version, &area, 1 << 16);
		if (s < 0)
			tap_bail("cannot set up a raw client");
		x.tag = 320 + i;
		x.src_region = x.dst_region = 5;
		x.seg_count = 10;
		x.page_size = wire[i].page_size;
		x.list_region = wire[i].list_region;
		x.list_offset = wire[i].list_offset;
		x.area_offset = wire[i].area_offset;
		x.pair_count = wire[i].pair_count;
		if (x.pair_count > 0)
			x.src_region = x.dst_region = 0;
		ok(harness_request(s, &m, NULL, 0, 5000, NULL) == GPX__STATUS__EPROTO, "%s: EPROTO", wire[i].what);
		close(s);
		munmap(area, 1 << 16);
	}
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
	buf_free(&t);
}

static long
minor_faults(void)
{
	struct rusage u;

	return getrusage(RUSAGE_SELF, &u) == 0 ? u.ru_minflt : -1;
}

/*
 * The segment area is faulted in when the library makes it, not one page per list as the
 * lists go round it for the first time: on a virtual machine a fault of a fresh page took 12-30
 * us, and each page list of a few KiB paid one (a Python client's submit of 256 pages took 34
 * us until the area had gone round once, 9.5 after).  256 lists of 4 KiB each, one at a time,
 * after the first made the 2 MiB area: this process takes next to no page faults meanwhile.
 */
void
test_area_faulted(void)
{
	const uint32_t n = 512, page = 64, rounds = 256;     /* 512 records of 8 bytes: 4 KiB */
	uint32_t sp[512], dp[512];
	struct buf a, b;
	bool good = true;
	gpx_conn *c = client("integ-area");

	if (c == NULL || buf_new(&a, (size_t)n * page) < 0 || buf_new(&b, (size_t)n * page) < 0 ||
	    buf_reg(c, &a, 0) < 0 || buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the area test");
	for (uint32_t i = 0; i < n; i++) {
		sp[i] = i;
		dp[i] = n - 1 - i;
	}
	good = gpx_copy_pages(c, a.r, 0, b.r, 0, page, sp, dp, n, 1) == 0 && wait_tag(c, 1, NULL) == 0;
	const long before = minor_faults();
	for (uint32_t k = 0; k < rounds && good; k++)
		good = gpx_copy_pages(c, a.r, 0, b.r, 0, page, sp, dp, n, 2 + k) == 0 && wait_tag(c, 2 + k, NULL) == 0;
	const long faults = minor_faults() - before;
	ok(good && memcmp(b.p, a.p + (size_t)(n - 1) * page, page) == 0, "%u lists of %u pages (4 KiB each) copied",
	    rounds, n);
	ok(before >= 0 && faults < (long)rounds / 4, "the client took %ld page faults over them (each list on a "
	    "page of the area not touched before: fewer than %u)", faults, rounds / 4);
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
}
