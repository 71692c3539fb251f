/*
 * Batches against a real gpxd (gpx_copy_batch, gpx_copy_pages_batch): many region pairs in one
 * request, checked whole before any byte moves and completed once.  Host memory here, so it
 * runs everywhere; tests/gpu/gpu-test.c runs the same shapes on GPUs.  Every copy is checked
 * byte for byte against the source; every refusal leaves every destination as it was.
 */
#include "config.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#include "client-lib/gpx.h"
#include "proto/ring.h"
#include "tests/harness.h"
#include "tests/tap.h"
#include "tests/tclient.h"
#include "tests/util.h"

struct harness H;

#define NP 16                  /* pairs of the main tests */

/* NP source and NP destination buffers of different sizes, registered on c. */
struct set {
	struct buf src[NP], dst[NP];
};

static void
set_new(struct set *s, gpx_conn *c, size_t base, uint64_t *seed)
{
	for (int k = 0; k < NP; k++) {
		size_t len = base + (size_t)k * 4096 + 8 * k;
		if (buf_new(&s->src[k], len) < 0 || buf_new(&s->dst[k], len + 100) < 0 ||
		    buf_reg(c, &s->src[k], 0) < 0 || buf_reg(c, &s->dst[k], 0) < 0)
			tap_bail("cannot set up the buffers");
		fill_random(s->src[k].p, s->src[k].len, seed);
		memset(s->dst[k].p, 0, s->dst[k].len);
	}
}

static void
set_free(struct set *s)
{
	for (int k = 0; k < NP; k++) {
		buf_free(&s->src[k]);
		buf_free(&s->dst[k]);
	}
}

/* The checksum of every destination, to see that a refused batch moved nothing. */
static uint64_t
dst_sum(const struct set *s)
{
	uint64_t h = 0;

	for (int k = 0; k < NP; k++)
		h = h * 31 + fnv(s->dst[k].p, s->dst[k].len);
	return h;
}

/* Whether pair k's segments landed: each of segs[first, first + n) at its bases. */
static bool
pair_landed(const struct set *s, int k, const struct gpx_pair *p, const struct gpx_seg *segs)
{
	for (uint32_t i = p->seg_first; i < p->seg_first + p->seg_count; i++) {
		const struct gpx_seg *g = &segs[i];
		if (memcmp(s->dst[k].p + p->dst_offset + g->dst_offset, s->src[k].p + p->src_offset + g->src_offset,
		    g->length) != 0)
			return false;
	}
	return true;
}

/* ---- segments ---- */

static void
test_segments(void)
{
	struct set s;
	struct gpx_pair pr[NP];
	struct gpx_seg segs[NP * 8];
	uint64_t seed = 7, bytes = 0, want = 0;
	gpx_conn *c = client("batch-segs");

	if (c == NULL)
		tap_bail("cannot connect");
	set_new(&s, c, 65536, &seed);
	/*
	 * Pair k: 8 segments of random length at random, non-overlapping destination places (the
	 * k-th eighth of its buffer each), from random source places, with bases of k and 2k
	 * bytes.  Pair NP-1 shares pair 0's run; one segment of pair 3 is empty.
	 */
	uint32_t n = 0;
	for (int k = 0; k < NP; k++) {
		size_t slot = 60000 / 8;
		pr[k] = (struct gpx_pair){ s.src[k].r, s.dst[k].r, (uint64_t)k, 2 * (uint64_t)k, n, 8 };
		if (k == NP - 1) {
			pr[k].seg_first = 0;
			pr[k].src_offset = pr[k].dst_offset = 0;
		} else
			for (int i = 0; i < 8; i++, n++) {
				uint64_t len = 1 + rnd(&seed) % (slot - 1);
				segs[n] = (struct gpx_seg){ rnd(&seed) % (60000 - len), i * slot, len };
				if (k == 3 && i == 5)
					segs[n].length = 0;
			}
	}
	for (int k = 0; k < NP; k++)
		for (uint32_t i = pr[k].seg_first; i < pr[k].seg_first + 8; i++)
			want += segs[i].length;
	int r = gpx_copy_batch(c, pr, NP, segs, n, 500);
	r = r < 0 ? r : wait_tag(c, 500, &bytes);
	ok(r == 0 && bytes == want,
	    "a batch of %d pairs, %u segments (one run shared, one segment empty) completes once with "
	    "every pair's bytes (%llu of %llu)", NP, n, (unsigned long long)bytes, (unsigned long long)want);
	bool all = true;
	for (int k = 0; k < NP; k++)
		all &= pair_landed(&s, k, &pr[k], segs);
	ok(all, "every segment of every pair landed at its pair's bases, byte for byte");
	struct gpx_completion e[4];
	ok(gpx_poll(c, e, 4) == 0 && gpx_outstanding(c) == 0, "and nothing else completed: one completion per batch");

	/* Whole regions, one segment each: a weight push. */
	struct gpx_seg whole[NP];
	want = 0;
	for (int k = 0; k < NP; k++) {
		memset(s.dst[k].p, 0, s.dst[k].len);
		whole[k] = (struct gpx_seg){ 0, 0, s.src[k].len };
		pr[k] = (struct gpx_pair){ s.src[k].r, s.dst[k].r, 0, 100, k, 1 };
		want += s.src[k].len;
	}
	r = gpx_copy_batch(c, pr, NP, whole, NP, 501);
	r = r < 0 ? r : wait_tag(c, 501, &bytes);
	ok(r == 0 && bytes == want,
	    "a batch of whole regions completes (%llu bytes)", (unsigned long long)bytes);
	all = true;
	for (int k = 0; k < NP; k++)
		all &= memcmp(s.dst[k].p + 100, s.src[k].p, s.src[k].len) == 0 && s.dst[k].p[99] == 0;
	ok(all, "each landed whole, 100 bytes in, nothing before it touched");

	/* Refusals: each refuses the whole batch, and no destination changes. */
	fill_random(s.dst[0].p, s.dst[0].len, &seed);
	uint64_t before = dst_sum(&s);
	struct gpx_pair bad[NP];
	struct {
		int k;                 /* the pair made bad */
		int what;
		int status;
		const char *why;
	} cases[] = {
		{ NP - 1, 0, -GPX_ERANGE, "the last pair's segment one byte past its destination" },
		{ 5, 1, -GPX_ERANGE, "a source base that puts a segment past its region" },
		{ 7, 2, -GPX_ERANGE, "a destination base near 2^64" },
		{ 9, 3, -GPX_EINVAL, "a pair naming segments past the end of the list" },
		{ 2, 4, -GPX_ENOENT, "a pair with a region id of this connection that does not exist" },
		{ 11, 5, -GPX_EINVAL, "a pair naming no segments" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		memcpy(bad, pr, sizeof(bad));
		struct gpx_seg wl[NP];
		memcpy(wl, whole, sizeof(wl));
		struct gpx_pair *b = &bad[cases[i].k];
		switch (cases[i].what) {
		case 0: b->dst_offset = s.dst[cases[i].k].len - s.src[cases[i].k].len + 1; break;
		case 1: b->src_offset = 1; break;
		case 2: b->dst_offset = UINT64_MAX - 10; break;
		case 3: b->seg_first = NP - 1; b->seg_count = 2; break;
		case 4: b->src = (pr[0].src & ~0xffffffffull) | 0xfffff; break;
		case 5: b->seg_count = 0; break;
		}
		r = gpx_copy_batch(c, bad, NP, wl, NP, 510 + i);
		r = r < 0 ? r : wait_tag(c, 510 + i, NULL);
		ok(r == cases[i].status && dst_sum(&s) == before, "refused whole (%s): %s; no destination changed",
		    gpx_strerror(r), cases[i].why);
		if (r != cases[i].status)
			diag("reason: %s", gpx_last_error(c));
	}
	ok(gpx_copy_batch(c, pr, 0, whole, NP, 520) == -GPX_EINVAL, "no pairs: EINVAL at once");
	ok(gpx_copy_batch(c, pr, GPX_PAIRS_MAX + 1, whole, NP, 521) == -GPX_EINVAL,
	    "GPX_PAIRS_MAX + 1 pairs: EINVAL at once");
	ok(gpx_copy_batch(c, pr, NP, NULL, NP, 522) == -GPX_EINVAL, "no segment list: EINVAL at once");
	gpx_close(c);
	set_free(&s);
}

/* ---- pages: a KV handoff's shape ---- */

static void
test_pages(void)
{
	const uint32_t blocks = 256, bs = 512, n = 200;
	struct buf src[NP], dst[NP];
	struct gpx_pair pr[NP];
	uint32_t sp[200], dp[256];
	uint64_t seed = 99, bytes = 0;
	gpx_conn *c = client("batch-pages");

	if (c == NULL)
		tap_bail("cannot connect");
	/* NP "layers", one cache tensor each side; the decode side's blocks start 64 bytes in. */
	for (int k = 0; k < NP; k++) {
		if (buf_new(&src[k], blocks * bs) < 0 || buf_new(&dst[k], blocks * bs + 64) < 0 ||
		    buf_reg(c, &src[k], 0) < 0 || buf_reg(c, &dst[k], 0) < 0)
			tap_bail("cannot set up the caches");
		fill_random(src[k].p, src[k].len, &seed);
		memset(dst[k].p, 0, dst[k].len);
		pr[k] = (struct gpx_pair){ src[k].r, dst[k].r, 0, 64, 0, 0 };
	}
	shuffle(dp, blocks, &seed);
	for (uint32_t i = 0; i < n; i++)
		sp[i] = rnd(&seed) % blocks;
	int r = gpx_copy_pages_batch(c, pr, NP, bs, sp, dp, n, 600);
	r = r < 0 ? r : wait_tag(c, 600, &bytes);
	ok(r == 0 && bytes == (uint64_t)NP * n * bs,
	    "the same %u blocks out of %d tensors in one request: complete (%llu bytes)", n, NP,
	    (unsigned long long)bytes);
	bool all = true;
	for (int k = 0; k < NP; k++)
		for (uint32_t i = 0; i < n && all; i++)
			all = memcmp(dst[k].p + 64 + (size_t)dp[i] * bs, src[k].p + (size_t)sp[i] * bs, bs) == 0;
	ok(all, "every block of every tensor landed at its destination block");

	/* One tensor a block short: its last block is out, and the whole batch is refused. */
	struct buf shortb;
	if (buf_new(&shortb, (blocks - 1) * bs + 64) < 0 || buf_reg(c, &shortb, 0) < 0)
		tap_bail("cannot set up the short tensor");
	for (int k = 0; k < NP; k++)
		memset(dst[k].p, 0, dst[k].len);
	pr[NP / 2].dst = shortb.r;
	dp[0] = blocks - 1;
	r = gpx_copy_pages_batch(c, pr, NP, bs, sp, dp, n, 601);
	r = r < 0 ? r : wait_tag(c, 601, NULL);
	all = true;
	for (int k = 0; k < NP; k++)
		for (size_t i = 0; i < dst[k].len && all; i++)
			all = dst[k].p[i] == 0;
	ok(r == -GPX_ERANGE && all, "a page past one pair's region refuses the whole batch (%s): %s",
	    gpx_strerror(r), gpx_last_error(c));
	pr[NP / 2].dst = dst[NP / 2].r;
	ok(gpx_copy_pages_batch(c, pr, NP, 0, sp, dp, n, 602) == -GPX_EINVAL, "page size 0: EINVAL at once");
	r = gpx_copy_pages_batch(c, pr, NP, (1ull << 31) + 1, sp, dp, 1, 603);
	ok((r < 0 ? r : wait_tag(c, 603, NULL)) == -GPX_ERANGE, "pages over 2 GiB: ERANGE");
	pr[3].src_offset = 1ull << 62;
	r = gpx_copy_pages_batch(c, pr, NP, bs, sp, dp, n, 604);
	ok((r < 0 ? r : wait_tag(c, 604, NULL)) == -GPX_ERANGE, "a pair's base of 2^62: ERANGE");
	gpx_close(c);
	for (int k = 0; k < NP; k++) {
		buf_free(&src[k]);
		buf_free(&dst[k]);
	}
	buf_free(&shortb);
}

/* ---- two clients: an exporter's regions filled by an importer's batch ---- */

static void
test_exports(void)
{
	struct buf own[4], mine[4];
	struct gpx_pair pr[4];
	struct gpx_seg seg = { 0, 0, 8192 };
	struct gpx_export_opts notify = { .rule = GPX_EXPORT_UID, .notify = 1, .notify_tag = 77 };
	struct gpx_export_opts ro = { .rule = GPX_EXPORT_UID, .read_only = 1 };
	gpx_region imp[4];
	uint64_t seed = 5, bytes;
	gpx_conn *a = client("batch-owner"), *b = client("batch-importer");
	char name[32];

	if (a == NULL || b == NULL)
		tap_bail("cannot connect");
	for (int k = 0; k < 4; k++) {
		if (buf_new(&own[k], 8192) < 0 || buf_new(&mine[k], 8192) < 0 || buf_reg(a, &own[k], 0) < 0 ||
		    buf_reg(b, &mine[k], 0) < 0)
			tap_bail("cannot set up the buffers");
		memset(own[k].p, 0, 8192);
		fill_random(mine[k].p, 8192, &seed);
		snprintf(name, sizeof(name), "batch.kv.%d", k);
		if (gpx_export(a, own[k].r, name, k == 0 ? &notify : k == 3 ? &ro : NULL) < 0 ||
		    gpx_import(b, name, &imp[k], NULL) < 0)
			tap_bail("cannot export and import");
		pr[k] = (struct gpx_pair){ mine[k].r, imp[k], 0, 0, 0, 1 };
	}
	/* Three writable imports: fine, and the owner hears of the one that notifies. */
	int r = gpx_copy_batch(b, pr, 3, &seg, 1, 700);
	ok(r == 0 && wait_tag(b, 700, &bytes) == 0 && bytes == 3 * 8192, "a batch into 3 imported regions completes");
	bool all = true;
	for (int k = 0; k < 3; k++)
		all &= memcmp(own[k].p, mine[k].p, 8192) == 0;
	ok(all, "the owner's buffers hold the importer's bytes");
	struct gpx_completion e[4];
	int got = gpx_wait(a, e, 4, WAIT_MS);
	ok(got == 1 && (e[0].flags & GPX_COMP_NOTIFY) && e[0].tag == 77 && e[0].bytes == 8192,
	    "the owner got one notification for its notifying export, with that pair's bytes");
	/* Adding the read-only import refuses the batch, and nothing lands anywhere. */
	for (int k = 0; k < 4; k++)
		memset(own[k].p, 0, 8192);
	r = gpx_copy_batch(b, pr, 4, &seg, 1, 701);
	r = r < 0 ? r : wait_tag(b, 701, NULL);
	all = true;
	for (int k = 0; k < 4; k++)
		for (int i = 0; i < 8192 && all; i++)
			all = own[k].p[i] == 0;
	ok(r == -GPX_EACCES && all, "a read-only import as one destination refuses the whole batch (%s)",
	    gpx_strerror(r));
	/* Another connection's region id in a pair: refused as not this connection's. */
	pr[1].dst = own[1].r;
	r = gpx_copy_batch(b, pr, 2, &seg, 1, 702);
	ok((r < 0 ? r : wait_tag(b, 702, NULL)) == -GPX_EACCES, "another connection's region id in a pair: EACCES");
	/* The owner withdraws one export's region: the batch naming it is refused, REVOKED. */
	pr[1].dst = imp[1];
	gpx_deregister(a, own[2].r);
	r = gpx_copy_batch(b, pr, 3, &seg, 1, 703);
	ok((r < 0 ? r : wait_tag(b, 703, NULL)) == -GPX_EREVOKED, "a withdrawn region in a pair: EREVOKED");
	gpx_close(b);
	gpx_close(a);
	for (int k = 0; k < 4; k++) {
		buf_free(&own[k]);
		buf_free(&mine[k]);
	}
}

/* ---- the same pairs again: kept resolved, never past what they name ---- */

/*
 * A program that pushes the same tensors sends the same pair records each time, and gpxd keeps
 * the last batch's pairs resolved to take them from there (xfer.c).  What it keeps must follow
 * every change: a shorter list, a region deregistered, one withdrawn by its owner.
 */
static void
test_kept(void)
{
	struct set s;
	struct gpx_pair pr[NP];
	struct gpx_seg segs[NP];
	struct buf own;
	gpx_region imp;
	uint64_t seed = 11, bytes = 0;
	gpx_conn *c = client("batch-kept"), *o = client("batch-kept-owner");
	int r = 0;

	if (c == NULL || o == NULL)
		tap_bail("cannot connect");
	set_new(&s, c, 8192, &seed);
	for (int k = 0; k < NP; k++) {
		segs[k] = (struct gpx_seg){ (uint64_t)k, 2 * (uint64_t)k, 4000 + (uint64_t)k };
		pr[k] = (struct gpx_pair){ s.src[k].r, s.dst[k].r, 0, 0, (uint32_t)k, 1 };
	}
	bool all = true;
	for (int round = 0; round < 3 && r == 0; round++) {
		for (int k = 0; k < NP; k++)
			fill_random(s.src[k].p, s.src[k].len, &seed);
		r = gpx_copy_batch(c, pr, NP, segs, NP, 1000 + round);
		r = r < 0 ? r : wait_tag(c, 1000 + round, &bytes);
		for (int k = 0; k < NP; k++)
			all &= pair_landed(&s, k, &pr[k], segs);
	}
	ok(r == 0 && all, "the same %d pair records three times, the sources refilled each time: each lands whole",
	    NP);
	/* The same records with half the list: the last pairs' runs now pass its end. */
	uint64_t before = dst_sum(&s);
	r = gpx_copy_batch(c, pr, NP, segs, NP / 2, 1010);
	r = r < 0 ? r : wait_tag(c, 1010, NULL);
	ok(r == -GPX_EINVAL && strstr(gpx_last_error(c), "names segments") != NULL && dst_sum(&s) == before,
	    "the same records with a list of %d segments: refused (%s), nothing moved", NP / 2, gpx_last_error(c));
	r = gpx_copy_batch(c, pr, NP, segs, NP, 1011);
	ok((r < 0 ? r : wait_tag(c, 1011, NULL)) == 0, "and with the whole list again: done");
	/* As many records, one of them other: pair 3's destination base moves 100 bytes on. */
	pr[3].dst_offset = 100;
	memset(s.dst[3].p, 0, s.dst[3].len);
	r = gpx_copy_batch(c, pr, NP, segs, NP, 1016);
	r = r < 0 ? r : wait_tag(c, 1016, NULL);
	ok(r == 0 && pair_landed(&s, 3, &pr[3], segs) && s.dst[3].p[6 + 99] == 0,
	    "as many records with pair 3's base 100 bytes on: it lands there");
	pr[3].dst_offset = 0;
	r = gpx_copy_batch(c, pr, NP, segs, NP, 1017);
	ok((r < 0 ? r : wait_tag(c, 1017, NULL)) == 0, "and with it back: done");
	/* One destination deregistered: the same records name a handle that is gone. */
	gpx_deregister(c, s.dst[5].r);
	before = dst_sum(&s);
	r = gpx_copy_batch(c, pr, NP, segs, NP, 1012);
	r = r < 0 ? r : wait_tag(c, 1012, NULL);
	ok(r == -GPX_ENOENT && dst_sum(&s) == before, "the same records after pair 5's destination was "
	    "deregistered: refused whole (%s), nothing moved", gpx_strerror(r));
	/* Pair 5 into another connection's export, kept; then its owner withdraws it. */
	if (buf_new(&own, 8192) < 0 || buf_reg(o, &own, 0) < 0 || gpx_export(o, own.r, "batch.kept", NULL) < 0 ||
	    gpx_import(c, "batch.kept", &imp, NULL) < 0)
		tap_bail("cannot export and import");
	memset(own.p, 0, own.len);
	pr[5].dst = imp;
	for (int i = 0; i < 2 && r <= 0; i++) {
		r = gpx_copy_batch(c, pr, NP, segs, NP, 1013 + i);
		r = r < 0 ? r : wait_tag(c, 1013 + i, NULL);
	}
	ok(r == 0 && memcmp(own.p + 10, s.src[5].p + 5, 4005) == 0, "pair 5 into another's export, twice: done");
	/* This connection lets go of its import (the export stays): the same records name a gone handle. */
	gpx_deregister(c, imp);
	r = gpx_copy_batch(c, pr, NP, segs, NP, 1020);
	r = r < 0 ? r : wait_tag(c, 1020, NULL);
	ok(r == -GPX_ENOENT, "the same records after the import was let go of: %s", gpx_strerror(r));
	if (gpx_import(c, "batch.kept", &imp, NULL) < 0)
		tap_bail("cannot import again");
	pr[5].dst = imp;
	for (int i = 0; i < 2 && r <= 0; i++) {
		r = gpx_copy_batch(c, pr, NP, segs, NP, 1021 + i);
		r = r < 0 ? r : wait_tag(c, 1021 + i, NULL);
	}
	ok(r == 0, "imported again, twice: done");
	gpx_deregister(o, own.r);
	before = dst_sum(&s);
	r = gpx_copy_batch(c, pr, NP, segs, NP, 1015);
	r = r < 0 ? r : wait_tag(c, 1015, NULL);
	ok(r == -GPX_EREVOKED && dst_sum(&s) == before, "the same records once the owner withdrew it: refused whole "
	    "(%s), nothing moved", gpx_strerror(r));
	gpx_close(c);
	gpx_close(o);
	buf_free(&own);
	set_free(&s);
}

/* ---- the limits: the most pairs, credits, cancel ---- */

static void
test_limits(void)
{
	const uint32_t np = GPX_PAIRS_MAX;
	struct buf a, b;
	struct gpx_pair *pr = calloc(np, sizeof(*pr));
	struct gpx_seg seg = { 0, 0, 64 };
	uint64_t seed = 3, bytes;
	gpx_conn *c = client("batch-limits");

	if (c == NULL || pr == NULL || buf_new(&a, (size_t)np * 64) < 0 || buf_new(&b, (size_t)np * 64) < 0 ||
	    buf_reg(c, &a, 0) < 0 || buf_reg(c, &b, 0) < 0)
		tap_bail("cannot set up the limits test");
	fill_random(a.p, a.len, &seed);
	memset(b.p, 0, b.len);
	/* GPX_PAIRS_MAX pairs of one region pair each 64 bytes further: reversed order. */
	for (uint32_t k = 0; k < np; k++)
		pr[k] = (struct gpx_pair){ a.r, b.r, (uint64_t)k * 64, (uint64_t)(np - 1 - k) * 64, 0, 1 };
	int r = gpx_copy_batch(c, pr, np, &seg, 1, 800);
	ok(r == 0 && wait_tag(c, 800, &bytes) == 0 && bytes == (uint64_t)np * 64,
	    "GPX_PAIRS_MAX (%u) pairs sharing one segment complete", np);
	bool all = true;
	for (uint32_t k = 0; k < np && all; k++)
		all = memcmp(b.p + (size_t)(np - 1 - k) * 64, a.p + (size_t)k * 64, 64) == 0;
	ok(all, "each pair's 64 bytes are in their place");

	/* A batch takes one credit, however many pairs: fill the ring with batches. */
	int sent = 0;
	while ((r = gpx_copy_batch(c, pr, 64, &seg, 1, 900 + sent)) == 0)
		sent++;
	ok(r == -GPX_EBUSY && sent == H.ring_entries, "a batch takes one credit: %d batches of 64 pairs fill a ring "
	    "of %d", sent, H.ring_entries);
	struct gpx_completion *e = calloc(sent + 8, sizeof(*e));
	int got = drain(c, e, sent + 8, 2000);
	int bad = 0;
	for (int i = 0; i < got; i++)
		bad += e[i].status != 0 || e[i].bytes != 64 * 64;
	ok(got == sent && bad == 0, "and each completes once, whole (%d of %d)", got, sent);
	free(e);

	/*
	 * Cancel: the one completion says cancelled, or done if it finished first.  A batch of
	 * 1 GiB (16 pairs of 64 MiB) is still running when a cancel sent right after it arrives;
	 * of up to three tries one must end cancelled, or the cancel did nothing.
	 */
	struct buf big, big2;
	if (buf_new(&big, 64u << 20) < 0 || buf_new(&big2, 64u << 20) < 0 || buf_reg(c, &big, 0) < 0 ||
	    buf_reg(c, &big2, 0) < 0)
		tap_bail("cannot set up the cancel test");
	struct gpx_seg chunks[64];
	for (int i = 0; i < 64; i++)
		chunks[i] = (struct gpx_seg){ (uint64_t)i << 20, (uint64_t)i << 20, 1u << 20 };
	struct gpx_pair sixteen[16];
	for (int i = 0; i < 16; i++)
		sixteen[i] = i % 2 ? (struct gpx_pair){ big2.r, big.r, 0, 0, 0, 64 } :
		    (struct gpx_pair){ big.r, big2.r, 0, 0, 0, 64 };
	struct gpx_completion one = { 0 };
	int cr = 0, q = 0, tries = 0, consistent = 1;
	for (tries = 0; tries < 3 && one.status != -GPX_ECANCELED; tries++) {
		q += gpx_copy_batch(c, sixteen, 16, chunks, 64, 950) == 0;
		cr = gpx_cancel(c, 950);
		r = gpx_wait_tag(c, 950, &one, WAIT_MS);
		consistent &= r == 0 && (cr == 0 || cr == -GPX_ENOENT) && gpx_poll(c, &(struct gpx_completion){ 0 }, 1) == 0 &&
		    ((one.status == -GPX_ECANCELED && one.bytes < (1ull << 30) && cr == 0) ||
		    (one.status == 0 && one.bytes == (1ull << 30)));
	}
	ok(q == tries, "batches of 1 GiB are queued (%d)", q);
	ok(consistent, "each ends with one completion, cancelled with fewer bytes or complete, and no second one");
	ok(one.status == -GPX_ECANCELED, "cancelled: %s (%llu bytes, try %d of 3)", gpx_strerror(one.status),
	    (unsigned long long)one.bytes, tries);
	gpx_close(c);
	buf_free(&a);
	buf_free(&b);
	buf_free(&big);
	buf_free(&big2);
	free(pr);
}

/* ---- bad batches on the wire: what libgpxclient never sends ---- */

/* Sends t and returns the status of its refusal (a Reply naming its tag), or 0 if none came. */
static int
raw_transfer(int s, Gpx__Transfer *t)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__DaemonMsg *d;
	int st = 0;

	m.seq = 9;
	m.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	m.transfer = t;
	if (harness_send(s, &m, NULL, 0) < 0)
		return -1;
	if ((d = harness_recv(s, 2000, NULL, NULL, NULL)) != NULL) {
		st = d->reply->tag == t->tag ? (int)d->reply->status : -2;
		gpx__daemon_msg__free_unpacked(d, NULL);
	}
	return st;
}

static void
test_wire(void)
{
	unsigned char *area;
	int s = harness_area_client(&H, GPX_PROTO_VERSION, &area, 1 << 20);
	Gpx__Transfer t = GPX__TRANSFER__INIT;

	if (s < 0)
		tap_bail("cannot set up a raw client");
	memset(area, 0, 1 << 20);
	t.tag = 1;
	t.pair_count = 1;
	t.pair_offset = 0;
	t.seg_count = 1;
	t.area_offset = sizeof(struct gpx_wire_pair);
	t.src_region = 5;
	ok(raw_transfer(s, &t) == GPX__STATUS__EPROTO, "a batch that also names a source region: EPROTO");
	t.src_region = 0;
	t.pair_offset = (1 << 20) - 8;
	ok(raw_transfer(s, &t) == GPX__STATUS__EINVAL, "pairs running past the end of the segment area: EINVAL");
	t.pair_offset = 4;
	ok(raw_transfer(s, &t) == GPX__STATUS__EINVAL, "pairs at an offset that is not 8-byte aligned: EINVAL");
	t.pair_offset = 0;
	t.pair_count = GPX_PAIRS_MAX + 1;
	ok(raw_transfer(s, &t) == GPX__STATUS__EPROTO, "GPX_PAIRS_MAX + 1 pairs: EPROTO");
	t.pair_count = 1;
	t.seg_count = 0;
	ok(raw_transfer(s, &t) == GPX__STATUS__EPROTO, "a batch without its list: EPROTO");
	t.seg_count = 1;
	ok(raw_transfer(s, &t) == GPX__STATUS__ENOENT, "a pair of region ids 0: ENOENT");
	close(s);
	munmap(area, 1 << 20);
	/* A protocol 2 connection: batches are protocol 3. */
	if ((s = harness_area_client(&H, 2, &area, 1 << 20)) < 0)
		tap_bail("cannot set up a protocol 2 client");
	ok(raw_transfer(s, &t) == GPX__STATUS__EPROTO, "a batch on a protocol 2 connection: EPROTO");
	close(s);
	munmap(area, 1 << 20);
}

int
main(void)
{
	start_gpxd();
	test_segments();
	test_pages();
	test_exports();
	test_kept();
	test_limits();
	test_wire();
	ok(harness_wait_fds(&H, H.baseline, WAIT_MS) == H.baseline, "gpxd is back to its baseline descriptors");
	ok(harness_stop(&H) == 0, "gpxd stops cleanly");
	return finish();
}
