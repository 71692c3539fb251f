/*
 * Unit tests of a transfer's way into the engine (tests/unit.c runs them): the check of a
 * segment list against its regions, edge values and overflows included (daemon/engine/xfer.c), and
 * the engine's cutting of a job into chunks, against a model of what it must produce
 * (daemon/engine/engine.c).
 */
#include "config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#include "daemon/gpxd.h"
#include "daemon/engine/engine.h"
#include "tests/tap.h"
#include "tests/unit.h"

/* ---- xfer.c and engine.c: checking a segment list, cutting the job into chunks ---- */

#define SEGS_TOP (1ull << 62)    /* what xfer.c refuses: any byte count from 2^62 on */

/* A client's two handles, as the connection's table would give them to xfer_build. */
struct fake_handle {
	uint64_t id;
	struct region *r;
};

struct fake_conn {
	struct xfer_from c;
	struct fake_handle hs, hd;
	struct logrl log;
	unsigned char *area;
};

static struct region *
fake_region(void *arg, uint64_t id, bool *read_only)
{
	struct fake_conn *f = arg;

	*read_only = false;
	return id == f->hs.id ? f->hs.r : id == f->hd.id ? f->hd.r : NULL;
}

/* A connection with two regions of the given lengths and a segment area, without a socket. */
static void
fake_conn_init(struct fake_conn *f, uint64_t slen, uint64_t dlen, size_t area_len)
{
	struct user *u = user_get(getuid());

	memset(f, 0, sizeof(*f));
	f->c.epoch = 7;
	f->c.user = u;
	/* refusals are logged in the uid's share, not limited (the many this test causes) */
	f->c.who = (struct logwho){ .uid = getuid(), .operator = true, .mine = &f->log, .uid_share = &u->log };
	f->c.region = fake_region;
	f->c.arg = f;
	f->hs = (struct fake_handle){ .id = 7ull << 32 | 1, .r = region_new() };
	f->hd = (struct fake_handle){ .id = 7ull << 32 | 2, .r = region_new() };
	f->hs.r->length = slen;
	f->hd.r->length = dlen;
	f->area = mmap(NULL, area_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	f->c.area = f->area;
	f->c.area_len = area_len;
}

static void
fake_conn_free(struct fake_conn *f)
{
	munmap(f->area, f->c.area_len);
	region_unref(f->hs.r);
	region_unref(f->hd.r);
}

/* Builds a job from n segments written into the area (offset 8, so not 16-aligned). */
static int
fake_build(struct fake_conn *f, const struct gpx_wire_seg *segs, uint32_t n, struct job **j)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	char err[512];

	memcpy(f->area + 8, segs, (size_t)n * sizeof(*segs));
	t.src_region = f->hs.id;
	t.dst_region = f->hd.id;
	t.seg_count = n;
	t.area_offset = 8;
	return xfer_build(&f->c, &t, NULL, j, NULL, err, sizeof(err));
}

/* What the rules say, one segment at a time: inside both regions, no sum reaching 2^62. */
static bool
segs_valid(const struct gpx_wire_seg *g, uint32_t n, uint64_t slen, uint64_t dlen)
{
	uint64_t total = 0;

	slen = slen < SEGS_TOP ? slen : SEGS_TOP - 1;
	dlen = dlen < SEGS_TOP ? dlen : SEGS_TOP - 1;
	for (uint32_t i = 0; i < n; i++) {
		if (g[i].src_offset > slen || g[i].length > slen - g[i].src_offset ||
		    g[i].dst_offset > dlen || g[i].length > dlen - g[i].dst_offset)
			return false;
		total += g[i].length;
		if (total >= SEGS_TOP)
			return false;
	}
	return true;
}

static uint64_t
unit_rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/* A random value from 0 to max. */
static uint64_t
upto(uint64_t *seed, uint64_t max)
{
	uint64_t r = unit_rnd(seed);

	return max == UINT64_MAX ? r : r % (max + 1);
}

/* A value near one of the edges the check must get right. */
static uint64_t
edge_value(uint64_t *seed, uint64_t len)
{
	static const uint64_t edges[] = { 0, 1, SEGS_TOP - 1, SEGS_TOP, 1ull << 63, UINT64_MAX };
	uint64_t r = unit_rnd(seed);

	switch (r % 4) {
	case 0:
		return edges[(r >> 8) % 6] - (r >> 16) % 3;
	case 1:
		return len - (r >> 8) % 3 + 1;
	default:
		return upto(seed, len);
	}
}

void
test_xfer_check(void)
{
	static struct conf conf;
	struct fake_conn f;
	struct job *j = NULL;
	uint64_t seed = 0x5eed;
	bool same = true;

	conf_defaults(&conf);
	cfg = &conf;
	fake_conn_init(&f, 1 << 20, 1 << 20, 4 << 20);
	struct gpx_wire_seg *g = calloc(100000, sizeof(*g));
	/* Counts around the block size, each segment different, all inside. */
	static const uint32_t counts[] = { 1, 63, 64, 65, 129, 100000 };
	for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++) {
		uint32_t n = counts[k];
		uint64_t total = 0;
		for (uint32_t i = 0; i < n; i++) {
			g[i] = (struct gpx_wire_seg){ unit_rnd(&seed) % 4096, unit_rnd(&seed) % 4096, i % 7 * 100 };
			total += g[i].length;
		}
		int r = fake_build(&f, g, n, &j);
		bool blocks_ok = r == 0;
		for (uint32_t b = 0, t = 0; r == 0 && b < (n + SEG_BLOCK - 1) / SEG_BLOCK; b++) {
			uint64_t want = 0;
			for (uint32_t i = 0; i < (b + 1) * SEG_BLOCK && i < n; i++)
				want += g[i].length;
			blocks_ok &= j->blocks[b] == want;
			t++;
		}
		ok(r == 0 && j->nseg == n && j->total == total && memcmp(j->segs, g, n * sizeof(*g)) == 0 &&
		    blocks_ok, "%u segments from the area: accepted, copied, counted, blocks[] right", n);
		if (r == 0)
			engine_free_job(j);
	}
	/* Random lists with values at the edges, each compared with the rules segment by segment. */
	static const uint64_t lens[] = { 1 << 20, SEGS_TOP - 1, SEGS_TOP, UINT64_MAX };
	int agree = 0, refused = 0, trials = 3000;
	for (int k = 0; k < trials; k++) {
		uint64_t slen = lens[k % 4], dlen = lens[k / 4 % 4];
		uint32_t n = 1 + unit_rnd(&seed) % 150, edges = unit_rnd(&seed) % 4;
		uint64_t lim = slen < dlen ? slen : dlen;
		f.hs.r->length = slen;
		f.hd.r->length = dlen;
		for (uint32_t i = 0; i < n; i++) {
			g[i].length = upto(&seed, lim / n);
			g[i].src_offset = upto(&seed, slen - g[i].length);
			g[i].dst_offset = upto(&seed, dlen - g[i].length);
		}
		/* Up to three values at an edge, anywhere: most lists have none or one. */
		for (uint32_t e = 0; e < edges; e++) {
			struct gpx_wire_seg *h = &g[unit_rnd(&seed) % n];
			switch (unit_rnd(&seed) % 3) {
			case 0: h->length = edge_value(&seed, lim); break;
			case 1: h->src_offset = edge_value(&seed, slen); break;
			default: h->dst_offset = edge_value(&seed, dlen); break;
			}
		}
		bool want = segs_valid(g, n, slen, dlen);
		int r = fake_build(&f, g, n, &j);
		if ((r == 0) == want && (want || r == -GPX__STATUS__ERANGE))
			agree++;
		else if (same) {
			diag("trial %d: %u segments, regions %llu and %llu: got %d, the rules say %s", k, n,
			    (unsigned long long)slen, (unsigned long long)dlen, r, want ? "accept" : "refuse");
			same = false;
		}
		refused += !want;
		if (r == 0)
			engine_free_job(j);
	}
	ok(agree == trials, "%d random lists with values at the edges (%d to refuse): the check agrees "
	    "with the rules every time", trials, refused);
	f.hs.r->length = f.hd.r->length = 1ull << 61;
	g[0] = g[1] = (struct gpx_wire_seg){ 0, 0, 1ull << 61 };
	ok(fake_build(&f, g, 1, &j) == 0 && j->total == 1ull << 61, "a segment of 2^61 bytes is accepted");
	engine_free_job(j);
	ok(fake_build(&f, g, 2, &j) == -GPX__STATUS__ERANGE, "two of them, 2^62 bytes in all, are refused");
	free(g);
	fake_conn_free(&f);
}

/* The chunks a job of these lengths should be cut into, one at a time, as the engine's contract. */
struct model {
	const uint64_t *len;
	uint32_t n, seg;
	uint64_t off, left;
};

static bool
model_next(struct model *m, uint64_t max_bytes, uint32_t max_segs, struct chunk *c)
{
	if (m->left == 0)
		return false;
	while (m->off == 0 && m->len[m->seg] == 0)
		m->seg++;
	uint32_t first = m->seg, lastbyte = m->seg;
	c->seg = m->seg;
	c->off = m->off;
	c->bytes = 0;
	while (m->seg < m->n && m->seg - first < max_segs && c->bytes < max_bytes) {
		uint64_t take = m->len[m->seg] - m->off;
		if (take > max_bytes - c->bytes)
			take = max_bytes - c->bytes;
		if (take > 0)
			lastbyte = m->seg;
		c->bytes += take;
		if (m->off + take == m->len[m->seg]) {
			m->seg++;
			m->off = 0;
		} else
			m->off += take;
	}
	c->pieces = lastbyte - first + 1;
	m->left -= c->bytes;
	return true;
}

void
test_engine_chunks(void)
{
	struct fake_conn f;
	char err[128];
	uint64_t seed = 0xc0ffee;
	int jobs = 0, agree = 0, chunks = 0;
	uint64_t *len = calloc(5000, sizeof(*len));
	struct gpx_wire_seg *g = calloc(5000, sizeof(*g));
	struct cq *q = cq_new(64, eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), 9, err, sizeof(err));

	engine_init(0, 2 << 20);       /* no workers: the test takes the chunks itself */
	fake_conn_init(&f, 1ull << 40, 1ull << 40, 1 << 20);
	for (int k = 0; k < 400; k++) {
		/* Lengths of every kind: zero (leading, inner, trailing), small, larger than a chunk. */
		uint64_t max_bytes = (uint64_t[]){ 1, 4096, 2 << 20, 1ull << 30, UINT64_MAX }[k % 5];
		uint32_t max_segs = (uint32_t[]){ 1, 3, 64, 8192, UINT32_MAX }[k / 5 % 5];
		/* Some segments longer than a chunk, but not so many chunks that the test takes long. */
		uint64_t big = max_bytes == 1 ? 8 : max_bytes == 4096 ? 20000 : 3 << 20;
		uint32_t n = 1 + unit_rnd(&seed) % (k % 4 == 0 ? 4000 : 200);
		uint64_t total = 0;
		for (uint32_t i = 0; i < n; i++) {
			uint64_t r = unit_rnd(&seed);
			len[i] = r % 5 == 0 ? 0 : r % 5 == 1 ? r % 7 : r % 5 == 2 ? (r >> 8) % big : (r >> 8) % 5000;
			if (k % 10 == 0 && (i < 70 || i + 70 > n))
				len[i] = 0;       /* zero-length runs longer than a block, at both ends */
			g[i] = (struct gpx_wire_seg){ 0, 0, len[i] };
			total += len[i];
		}
		if (total == 0)
			continue;
		struct job *j;
		if (fake_build(&f, g, n, &j) < 0 || cq_reserve(q) < 0)
			break;
		j->path = PATH_GPU0 + 7;   /* a path no worker serves */
		j->cq = q;
		j->user = user_get(getuid());
		cq_ref(q);
		atomic_fetch_add(&j->user->inflight, 1);
		engine_submit(j);
		jobs++;
		struct model m = { .len = len, .n = n, .left = total };
		struct chunk c, w;
		bool same = true;
		uint64_t moved = 0;
		while (model_next(&m, max_bytes, max_segs, &w)) {
			if (!engine_next_chunk(PATH_GPU0 + 7, &c, false, max_bytes, max_segs) || c.job != j ||
			    c.seg != w.seg || c.off != w.off || c.bytes != w.bytes || c.pieces != w.pieces) {
				if (same)
					diag("job %d (%u segments, chunks of %llu bytes, %u segments): chunk %llu+%llu "
					    "at %u+%llu in %u pieces, the model says %llu at %u+%llu in %u", k, n,
					    (unsigned long long)max_bytes, max_segs, (unsigned long long)moved,
					    (unsigned long long)c.bytes, c.seg, (unsigned long long)c.off, c.pieces,
					    (unsigned long long)w.bytes, w.seg, (unsigned long long)w.off, w.pieces);
				same = false;
				break;
			}
			moved += c.bytes;
			chunks++;
			engine_chunk_done(&c, true);     /* the last one finishes the job */
		}
		same &= !engine_next_chunk(PATH_GPU0 + 7, &c, false, max_bytes, max_segs);
		agree += same;
		__atomic_store_n(&q->ring->tail, q->ring->head, __ATOMIC_RELEASE);   /* records read */
		if (!same)
			break;
	}
	ok(jobs > 300 && agree == jobs, "%d jobs cut into %d chunks exactly as the model cuts them (zero-length "
	    "segments anywhere, chunks from 1 byte to unlimited, 1 to unlimited segments)", jobs, chunks);
	ok(engine_inflight() == 0, "every job finished with its last chunk");
	engine_shutdown();
	fake_conn_free(&f);
	cq_unref(q);
	free(len);
	free(g);
}

/*
 * A small job queued behind larger ones of the same path: engine_next_small_chunks takes it
 * first, ahead of the round robin (a GPU worker whose bulk streams are full asks for small
 * work only, and gathers small copies into one launch so), and takes nothing when no small
 * job waits; the round robin then gives the others in their order.
 */
void
test_engine_small_first(void)
{
	static const uint64_t lens[] = { 4 << 20, 4 << 20, 4096, 4 << 20 };
	const enum path_kind path = PATH_GPU0 + 7;      /* a path no worker serves */
	struct fake_conn f;
	struct job *j[4];
	struct chunk c;
	char err[128];
	int n = 0;
	struct cq *q = cq_new(64, eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), 9, err, sizeof(err));

	engine_init(0, 2 << 20);
	fake_conn_init(&f, 1ull << 30, 1ull << 30, 1 << 20);
	for (int i = 0; i < 4; i++) {
		const struct gpx_wire_seg g = { 0, 0, lens[i] };
		if (fake_build(&f, &g, 1, &j[i]) < 0 || cq_reserve(q) < 0)
			break;
		j[i]->path = path;
		j[i]->cq = q;
		j[i]->user = user_get(getuid());
		cq_ref(q);
		atomic_fetch_add(&j[i]->user->inflight, 1);
		engine_submit(j[i]);
		n++;
	}
	int got = engine_next_small_chunks(path, &c, 1, UINT32_MAX);
	ok(n == 4 && got == 1 && c.job == j[2] && c.bytes == 4096 && c.last,
	    "a 4 KiB job queued third, behind two of 4 MiB, is taken first as small work");
	if (got == 1)
		engine_chunk_done(&c, true);
	ok(engine_next_small_chunks(path, &c, 1, UINT32_MAX) == 0, "with no small job left, none is taken");
	bool order = true;
	for (int i = 0; i < 4; i++) {
		if (i == 2)
			continue;
		bool took = engine_next_chunk(path, &c, false, 1ull << 30, UINT32_MAX);
		order &= took && c.job == j[i] && c.last;
		if (took)
			engine_chunk_done(&c, true);
	}
	ok(order && !engine_next_chunk(path, &c, false, 1ull << 30, UINT32_MAX) && engine_inflight() == 0,
	    "the round robin then gives the 4 MiB jobs in their order, each whole, and all finish");
	__atomic_store_n(&q->ring->tail, q->ring->head, __ATOMIC_RELEASE);   /* records read */
	engine_shutdown();
	fake_conn_free(&f);
	cq_unref(q);
}

/*
 * A pool the uids share (user.c, the page kernel's arena): one uid holds at most its share,
 * so another finds the rest; a take that finds no free run that long is told apart from one
 * past the share; what is given back is the uid's again.
 */
void
test_pool_shares(void)
{
	uint16_t len[16] = { 0 };
	struct user *owner[16] = { NULL };
	bool used[16] = { false };
	struct pool p = { 16, 8, len, owner, used, { 0, 0 } };
	struct user *a = user_get(5001), *b = user_get(5002), *c = user_get(5003), *d = user_get(5004);

	ok(pool_take(&p, 4, a) == 0 && pool_take(&p, 4, a) == 4 && atomic_load(&a->pooled) == 8,
	    "a uid takes runs up to its share (8 of 16 grains)");
	ok(pool_take(&p, 1, a) == -EDQUOT && p.refused[1] == 1 && atomic_load(&a->pooled) == 8,
	    "one grain more is past its share: -EDQUOT, counted, nothing taken");
	ok(pool_take(&p, 8, b) == 8 && atomic_load(&b->pooled) == 8, "another uid takes the other half whole");
	ok(pool_take(&p, 1, c) == -ENOSPC && p.refused[0] == 1 && atomic_load(&c->pooled) == 0,
	    "a third finds no free grain: -ENOSPC, counted");
	pool_give(&p, 0);
	ok(atomic_load(&a->pooled) == 4 && !used[0] && !used[3] && used[4], "a run given back is free, and off its uid");
	ok(pool_take(&p, 5, c) == -ENOSPC, "a run longer than any free one is not found");
	ok(pool_take(&p, 4, c) == 0 && atomic_load(&c->pooled) == 4, "one that fits the free run is");
	ok(pool_take(&p, 4, a) == -ENOSPC, "a uid within its share is still told when the pool is full");
	pool_give(&p, 0);
	pool_give(&p, 4);
	pool_give(&p, 8);
	bool any = false;
	for (int i = 0; i < 16; i++)
		any |= used[i] || len[i] != 0 || owner[i] != NULL;
	ok(!any && atomic_load(&a->pooled) == 0 && atomic_load(&b->pooled) == 0 && atomic_load(&c->pooled) == 0,
	    "all given back: the pool is empty and no uid holds a grain");
	ok(pool_take(&p, 9, a) == -E2BIG && p.refused[1] == 1, "a run longer than the share is refused as never "
	    "fitting (-E2BIG), not counted");
	ok(pool_take(&p, 8, a) == 0, "and one of the whole share taken");
	pool_give(&p, 0);

	/* Free runs of 6 (grains 0-5) and 2 (8-9): a take of 2 goes to the hole that fits it. */
	ok(pool_take(&p, 6, b) == 0 && pool_take(&p, 2, c) == 6 && pool_take(&p, 2, c) == 8 &&
	    pool_take(&p, 6, d) == 10, "runs at 0, 6, 8 and 10");
	pool_give(&p, 0);
	pool_give(&p, 8);
	ok(pool_take(&p, 2, a) == 8, "a short run goes to the shortest free run that holds it (grain 8), not the first");
	ok(pool_take(&p, 6, a) == 0, "so a long one still finds the long run whole");
	pool_give(&p, 0);
	pool_give(&p, 6);
	pool_give(&p, 8);
	pool_give(&p, 10);
	ok(atomic_load(&a->pooled) == 0 && atomic_load(&b->pooled) == 0 && atomic_load(&c->pooled) == 0 &&
	    atomic_load(&d->pooled) == 0, "and all given back");
}
