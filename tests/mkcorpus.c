/*
 * Writes the seed corpus of the fuzz target (tests/corpus): one small file per scenario, made of
 * valid messages of every type, packed with the real protobuf-c code, in the frame format of
 * fuzz.h.  Run once by hand (`tests/mkcorpus DIR`); its output is committed, and the files the
 * fuzzer found later sit beside them.
 */
#include "config.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/gpx.pb-c.h"
#include "proto/ring.h"
#include "proto/wire.h"
#include "tests/fuzz.h"

static uint8_t file[1 << 20];
static size_t flen;
static uint32_t seq;

#define FD1(kind) (1 | (kind) << 2)
#define FD2(k1, k2) (2 | (k1) << 2 | (k2) << 4)
#define FD3(k1, k2, k3) (3 | (k1) << 2 | (k2) << 4 | (k3) << 6)

static void
frame_raw(uint8_t flags, const void *p, size_t len)
{
	file[flen++] = flags;
	file[flen++] = (uint8_t)len;
	file[flen++] = (uint8_t)(len >> 8);
	memcpy(file + flen, p, len);
	flen += len;
}

/* A write of shared memory (fuzz.h): len bytes at offset at of the segment area or the ring. */
static void
poke(uint8_t kind, uint32_t at, const void *p, size_t len)
{
	uint8_t b[4 + 4096];

	b[0] = (uint8_t)at;
	b[1] = (uint8_t)(at >> 8);
	b[2] = (uint8_t)(at >> 16);
	b[3] = (uint8_t)(at >> 24);
	memcpy(b + 4, p, len);
	frame_raw(kind, b, 4 + len);
}

/* Where the seeds find the submission queue: gpxd's default daemon.ring_entries. */
#define RING_ENTRIES 4096

static void
poke_ring64(size_t field, uint64_t v)
{
	poke(FUZZ_POKE_RING, (uint32_t)field, &v, sizeof(v));
}

/* Submissions i.. of the queue, then its tail published. */
static void
submit(uint32_t i, const struct gpx_sqe *e, uint32_t n)
{
	poke(FUZZ_POKE_RING, (uint32_t)gpx_sq_offset(RING_ENTRIES, i), e, n * sizeof(*e));
	poke_ring64(offsetof(struct gpx_ring_hdr, sq_tail), i + n);
}

static void
frame(uint8_t flags, Gpx__ClientMsg *m)
{
	static uint8_t buf[GPX_MSG_MAX];

	m->seq = ++seq;
	size_t n = gpx__client_msg__pack(m, buf);
	frame_raw(flags, buf, n);
}

static void
save(const char *dir, const char *name)
{
	char path[4096];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	if ((f = fopen(path, "wb")) == NULL || fwrite(file, 1, flen, f) != flen || fclose(f) != 0) {
		perror(path);
		exit(1);
	}
	flen = 0;
	seq = 0;
}

static void
hello(bool ring, uint32_t version)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Hello h = GPX__HELLO__INIT;

	h.version = version;
	h.name = (char *)"fuzz-seed";
	h.no_ring = !ring;
	m.body_case = GPX__CLIENT_MSG__BODY_HELLO;
	m.hello = &h;
	frame(ring ? FD1(FUZZ_FD_EVENTFD) : 0, &m);
}

static void
reg(int fdkind, uint64_t off, uint64_t len, bool ro)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Register r = GPX__REGISTER__INIT;

	r.kind = GPX__MEM_KIND__MEM_HOST;
	r.offset = off;
	r.length = len;
	r.access = ro ? GPX__ACCESS__ACCESS_RO : GPX__ACCESS__ACCESS_RW;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = &r;
	frame(FD1(fdkind), &m);
}

static void
reg_cuda(Gpx__MemKind kind)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Register r = GPX__REGISTER__INIT;
	static uint8_t handle[64], uuid[16];

	r.kind = kind;
	r.length = 1 << 20;
	r.alloc_size = 2 << 20;
	r.handle.data = handle;
	r.handle.len = kind == GPX__MEM_KIND__MEM_CUDA_IPC ? 64 : 0;
	r.device_uuid.data = uuid;
	r.device_uuid.len = 16;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = &r;
	frame(kind == GPX__MEM_KIND__MEM_CUDA_VMM ? FD1(FUZZ_FD_MEMFD) : 0, &m);
}

static void
dereg(uint64_t id)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Deregister d = GPX__DEREGISTER__INIT;

	d.region = id;
	m.body_case = GPX__CLIENT_MSG__BODY_DEREGISTER;
	m.deregister = &d;
	frame(0, &m);
}

static void
xfer(uint64_t tag, uint64_t src, uint64_t dst, size_t nseg, uint64_t seglen, uint32_t seg_count)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	Gpx__Segment segs[32], *ptrs[32];

	for (size_t i = 0; i < nseg && i < 32; i++) {
		gpx__segment__init(&segs[i]);
		segs[i].src_offset = i * seglen;
		segs[i].dst_offset = (nseg - 1 - i) * seglen;
		segs[i].length = seglen;
		ptrs[i] = &segs[i];
	}
	t.tag = tag;
	t.src_region = src;
	t.dst_region = dst;
	t.n_segments = nseg;
	t.segments = ptrs;
	t.seg_count = seg_count;
	m.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	m.transfer = &t;
	frame(seg_count ? FD1(FUZZ_FD_MEMFD) : 0, &m);
}

static void
seg_area(uint64_t len)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__SegArea a = GPX__SEG_AREA__INIT;

	a.length = len;
	m.body_case = GPX__CLIENT_MSG__BODY_SEG_AREA;
	m.seg_area = &a;
	frame(FD1(FUZZ_FD_MEMFD), &m);
}

/* A batch (protocol 3): pairs and list in the segment area, which the fuzzer's memfd fills with zeros. */
static void
batch(uint64_t tag, uint32_t pairs, uint64_t pair_off, uint32_t n, uint64_t list_off, uint64_t page_size,
    uint64_t src)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Transfer t = GPX__TRANSFER__INIT;

	t.tag = tag;
	t.pair_count = pairs;
	t.pair_offset = pair_off;
	t.seg_count = n;
	t.area_offset = list_off;
	t.page_size = page_size;
	t.src_region = src;
	m.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	m.transfer = &t;
	frame(0, &m);
}

/* A cuda-vmm Register naming n pieces in the segment area (protocol 3). */
static void
reg_pieces(uint32_t n, uint64_t area_off, uint64_t off, uint64_t len)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Register r = GPX__REGISTER__INIT;
	static uint8_t uuid[16];

	r.kind = GPX__MEM_KIND__MEM_CUDA_VMM;
	r.offset = off;
	r.length = len;
	r.alloc_id = 1ull << 40;
	r.alloc_size = 1ull << 30;
	r.device_uuid.data = uuid;
	r.device_uuid.len = 16;
	r.piece_count = n;
	r.area_offset = area_off;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = &r;
	frame(0, &m);
}

/* Pieces: n pieces described, with the fds of flags. */
static void
pieces(uint32_t n, uint8_t flags)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Pieces ps = GPX__PIECES__INIT;
	Gpx__Piece one[4], *ptr[4];
	static uint8_t uuid[16];

	for (uint32_t i = 0; i < n && i < 4; i++) {
		gpx__piece__init(&one[i]);
		one[i].id = 100 + i;
		one[i].offset = (uint64_t)i << 21;
		one[i].size = 2u << 20;
		ptr[i] = &one[i];
	}
	ps.device_uuid.data = uuid;
	ps.device_uuid.len = 16;
	ps.reservation = 1ull << 40;
	ps.reservation_size = 1ull << 30;
	ps.n_pieces = n;
	ps.pieces = ptr;
	m.body_case = GPX__CLIENT_MSG__BODY_PIECES;
	m.pieces = &ps;
	frame(flags, &m);
}

static void
cancel(uint64_t tag)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Cancel c = GPX__CANCEL__INIT;

	c.tag = tag;
	m.body_case = GPX__CLIENT_MSG__BODY_CANCEL;
	m.cancel = &c;
	frame(0, &m);
}

static void
export(uint64_t id, const char *name, Gpx__ExportRule rule, bool notify, bool ro)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Export e = GPX__EXPORT__INIT;

	e.region = id;
	e.name = (char *)name;
	e.rule = rule;
	e.gid = 1234;
	e.notify = notify;
	e.notify_tag = 77;
	e.read_only = ro;
	m.body_case = GPX__CLIENT_MSG__BODY_EXPORT;
	m.export = &e;
	frame(0, &m);
}

static void
unexport(const char *name)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Unexport u = GPX__UNEXPORT__INIT;

	u.name = (char *)name;
	m.body_case = GPX__CLIENT_MSG__BODY_UNEXPORT;
	m.unexport = &u;
	frame(0, &m);
}

static void
import(const char *name)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Import i = GPX__IMPORT__INIT;

	i.name = (char *)name;
	m.body_case = GPX__CLIENT_MSG__BODY_IMPORT;
	m.import = &i;
	frame(0, &m);
}

static void
query(Gpx__QueryWhat what)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Query q = GPX__QUERY__INIT;

	q.what = what;
	m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
	m.query = &q;
	frame(0, &m);
}

static void
admin(Gpx__Admin__Op op, uint64_t arg, const char *text)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Admin a = GPX__ADMIN__INIT;

	a.op = op;
	a.arg = arg;
	a.text = (char *)text;
	m.body_case = GPX__CLIENT_MSG__BODY_ADMIN;
	m.admin = &a;
	frame(0, &m);
}

int
main(int argc, char **argv)
{
	const char *dir = argc > 1 ? argv[1] : "tests/corpus";

	hello(true, GPX_PROTO_VERSION);
	save(dir, "seed-hello-ring");
	hello(false, GPX_PROTO_VERSION);
	save(dir, "seed-hello-noring");
	hello(true, 99);
	save(dir, "seed-hello-version");
	hello(true, GPX_PROTO_VERSION);
	hello(true, GPX_PROTO_VERSION);
	save(dir, "seed-hello-twice");
	/* The oldest protocol spoken: what came later is refused by version. */
	hello(true, GPX_PROTO_MIN);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	xfer(1, 1, 1, 1, 4096, 0);
	seg_area(FUZZ_MEMFD_SIZE);
	batch(2, 1, 0, 1, 40, 4096, 0);
	save(dir, "seed-hello-min");
	query(GPX__QUERY_WHAT__Q_STATUS);
	hello(true, GPX_PROTO_VERSION);
	save(dir, "seed-before-hello");

	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 4096, 8192, true);
	dereg(2);
	dereg(1);
	dereg(1);
	save(dir, "seed-register");

	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_PIPE, 0, 4096, false);
	reg(FUZZ_FD_UNSEALED, 0, 4096, false);
	reg(FUZZ_FD_EVENTFD, 0, 4096, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE + 1, false);
	reg(FUZZ_FD_MEMFD, UINT64_MAX, 2, false);
	reg_cuda(GPX__MEM_KIND__MEM_CUDA_IPC);
	reg_cuda(GPX__MEM_KIND__MEM_CUDA_VMM);
	save(dir, "seed-register-bad");

	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	xfer(1, 1, 2, 1, 4096, 0);
	xfer(2, 2, 1, 16, 1024, 0);
	xfer(3, 1, 2, 1, FUZZ_MEMFD_SIZE + 1, 0);
	xfer(4, 1, 2, 0, 0, 100);
	xfer(5, 1, 1ULL << 40, 1, 1, 0);
	xfer(6, 1, 2, 1, 0, 0);
	cancel(1);
	cancel(999);
	save(dir, "seed-transfer");

	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	for (int i = 0; i < 80; i++)
		xfer(100 + i, 1 + i % 2, 2 - i % 2, 4, 8192, 0);
	cancel(150);
	save(dir, "seed-transfer-credits");

	/* Protocol 3: batches in the segment area, and the pieces of a VMM range. */
	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	seg_area(FUZZ_MEMFD_SIZE);
	batch(1, 2, 0, 1, 80, 0, 0);
	batch(2, 4, 0, 16, 160, 4096, 0);
	batch(3, 1, 0, 1, 40, 0, 1);
	batch(4, 1, FUZZ_MEMFD_SIZE - 8, 1, 0, 0, 0);
	batch(5, 1, 4, 1, 40, 0, 0);
	batch(6, 16385, 0, 1, 0, 0, 0);
	batch(7, 1, 0, 0, 40, 0, 0);
	batch(8, 3, 0, 1u << 20, 120, 1u << 31, 0);
	save(dir, "seed-batch");

	hello(true, GPX_PROTO_VERSION);
	seg_area(FUZZ_MEMFD_SIZE);
	reg_pieces(3, 0, 100, 4096);
	reg_pieces(1, FUZZ_MEMFD_SIZE, 0, 1);
	reg_pieces(1u << 30, 0, 0, 1);
	pieces(2, FD2(FUZZ_FD_MEMFD, FUZZ_FD_PIPE));
	pieces(1, 0);
	pieces(3, FD3(FUZZ_FD_MEMFD, FUZZ_FD_MEMFD, FUZZ_FD_MEMFD));
	save(dir, "seed-pieces");

	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, true);
	export(1, "fuzz.notify", GPX__EXPORT_RULE__EXPORT_ANY, true, false);
	export(2, "fuzz.ro", GPX__EXPORT_RULE__EXPORT_GID, false, true);
	export(1, "fuzz.notify", GPX__EXPORT_RULE__EXPORT_UID, false, false);
	export(1, "bad name", GPX__EXPORT_RULE__EXPORT_UID, false, false);
	import("fuzz.notify");
	import("fuzz.ro");
	import("fuzz.missing");
	xfer(1, 2, 3, 1, 4096, 0);
	xfer(2, 1, 4, 1, 4096, 0);
	export(3, "fuzz.reexport", GPX__EXPORT_RULE__EXPORT_ANY, false, false);
	unexport("fuzz.ro");
	unexport("fuzz.missing");
	dereg(1);
	xfer(3, 2, 3, 1, 4096, 0);
	save(dir, "seed-export");

	hello(false, GPX_PROTO_VERSION);
	for (int w = GPX__QUERY_WHAT__Q_STATUS; w <= GPX__QUERY_WHAT__Q_TOPO; w++)
		query(w);
	query(42);
	xfer(1, 1, 2, 1, 1, 0);
	save(dir, "seed-query");

	hello(true, GPX_PROTO_VERSION);
	admin(GPX__ADMIN__OP__LOG_LEVEL, 0, "");
	admin(GPX__ADMIN__OP__LOG_LEVEL, 0, "debug conn,engine");
	admin(GPX__ADMIN__OP__LOG_LEVEL, 0, "loud");
	admin(GPX__ADMIN__OP__RELOAD, 0, "");
	admin(GPX__ADMIN__OP__DRAIN, 12345, "");
	admin(GPX__ADMIN__OP__DRAIN, 0, "");
	admin(9, 0, "");
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	xfer(1, 1, 1, 1, 16, 0);
	save(dir, "seed-admin");

	/* Framing abuse: fds the message does not take, too many, oversize, garbage. */
	hello(true, GPX_PROTO_VERSION);
	{
		Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
		Gpx__Query q = GPX__QUERY__INIT;
		m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
		m.query = &q;
		frame(FD1(FUZZ_FD_EVENTFD), &m);
		frame(FD3(FUZZ_FD_MEMFD, FUZZ_FD_PIPE, FUZZ_FD_EVENTFD), &m);
		frame(FD2(FUZZ_FD_MEMFD, FUZZ_FD_MEMFD), &m);
	}
	xfer(1, 1, 2, 0, 0, 4);
	frame_raw(0, "\x42\x03\x08\x01", 4);
	query(GPX__QUERY_WHAT__Q_STATUS);
	save(dir, "seed-fds");

	hello(true, GPX_PROTO_VERSION);
	file[flen++] = 0;
	file[flen++] = 0xff;
	file[flen++] = 0xff;
	save(dir, "seed-oversize");

	hello(true, GPX_PROTO_VERSION);
	frame_raw(0, "\x08\x01", 2);                   /* seq only: no body */
	save(dir, "seed-nobody");

	hello(true, GPX_PROTO_VERSION);
	frame_raw(0, "\xff\xff\xff\xff\xff", 5);
	save(dir, "seed-garbage");

	/* The submission queue, written in the ring as a client writes it; one entry of each kind of bad. */
	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	{
		const struct gpx_sqe e[] = {
			{ .tag = 10, .src_region = 1, .dst_region = 2, .length = 4096 },
			{ .tag = 11, .src_region = 2, .dst_region = 1, .src_offset = 8192, .dst_offset = 4096, .length = 8192 },
			{ .tag = 12, .src_region = 1, .dst_region = 2, .length = 0 },
			{ .tag = 13, .src_region = 99, .dst_region = 2, .length = 16 },
			{ .tag = 14, .src_region = 1, .dst_region = 2, .src_offset = FUZZ_MEMFD_SIZE - 8, .length = 16 },
			{ .tag = 15, .src_region = 1, .dst_region = 2, .src_offset = UINT64_MAX - 4, .length = 8 },
			{ .tag = 16, .src_region = 1, .dst_region = 2, .length = UINT64_MAX },
			{ .tag = 17, .src_region = 1, .dst_region = 2, .length = 64, .flags = 0xffffffffu, .pad = 1 },
		};
		submit(0, e, 8);
		submit(8, e, 3);
		submit(RING_ENTRIES - 1, e, 2);           /* (it wraps: entry 0 is not written) */
		xfer(1, 1, 2, 1, 4096, 0);
	}
	save(dir, "seed-ring-sq");

	/* A tail beyond the queue, and one behind its head. */
	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	poke_ring64(offsetof(struct gpx_ring_hdr, sq_tail), RING_ENTRIES + 1);
	save(dir, "seed-ring-tail-far");
	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	{
		const struct gpx_sqe e = { .tag = 1, .src_region = 1, .dst_region = 1, .length = 0 };
		submit(0, &e, 1);
		poke_ring64(offsetof(struct gpx_ring_hdr, sq_tail), 0);
		poke_ring64(offsetof(struct gpx_ring_hdr, sq_tail), UINT64_MAX);
	}
	save(dir, "seed-ring-tail-back");

	/* The header's other fields while completions are posted: consumed, spinners, sleepers, the daemon's own. */
	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	poke_ring64(offsetof(struct gpx_ring_hdr, cq_spinners), 0xffffffffffffffffull);
	xfer(1, 1, 2, 2, 1024, 0);
	poke_ring64(offsetof(struct gpx_ring_hdr, magic), 0);              /* magic, version */
	poke_ring64(offsetof(struct gpx_ring_hdr, entries), 0xffffffffull); /* entries, entry_size */
	poke_ring64(offsetof(struct gpx_ring_hdr, head), UINT64_MAX);
	poke_ring64(offsetof(struct gpx_ring_hdr, sq_head), 12345);
	xfer(2, 2, 1, 1, 4096, 0);
	poke_ring64(offsetof(struct gpx_ring_hdr, tail), 1ull << 40);      /* consumed more than posted: broken */
	xfer(3, 1, 2, 1, 4096, 0);
	save(dir, "seed-ring-header");

	/* A batch's pairs and segments written in the segment area, then written again under it. */
	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	seg_area(FUZZ_MEMFD_SIZE);
	{
		const struct gpx_wire_pair pr[] = {
			{ .src_region = 1, .dst_region = 2, .seg_first = 0, .seg_count = 2 },
			{ .src_region = 2, .dst_region = 1, .src_offset = 4096, .seg_first = 2, .seg_count = 1 },
			{ .src_region = 1, .dst_region = 2, .seg_first = 1, .seg_count = 0xffffffffu },
			{ .src_region = 1, .dst_region = 2, .src_offset = UINT64_MAX, .seg_first = 0, .seg_count = 1 },
		};
		const struct gpx_wire_seg sg[] = {
			{ 0, 4096, 1024 }, { 2048, 0, 512 }, { 100, 200, 300 }, { FUZZ_MEMFD_SIZE, 0, 1 },
		};
		poke(FUZZ_POKE_AREA, 0, pr, sizeof(pr));
		poke(FUZZ_POKE_AREA, 1024, sg, sizeof(sg));
		batch(1, 2, 0, 3, 1024, 0, 0);
		batch(2, 4, 0, 4, 1024, 0, 0);
		poke(FUZZ_POKE_AREA, 1024 + sizeof(sg[0]), &sg[3], sizeof(sg[3]));
		batch(3, 2, 0, 3, 1024, 0, 0);
		batch(4, 1, sizeof(pr[0]) * 3, 4, 1024, 0, 0);
	}
	save(dir, "seed-area-batch");

	/* Page lists in the segment area: in range, out of range, a list longer than the area holds. */
	hello(true, GPX_PROTO_VERSION);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	reg(FUZZ_FD_MEMFD, 0, FUZZ_MEMFD_SIZE, false);
	seg_area(FUZZ_MEMFD_SIZE);
	{
		const struct gpx_wire_pair pr[] = {
			{ .src_region = 1, .dst_region = 2 },
			{ .src_region = 2, .dst_region = 1, .src_offset = 4096, .dst_offset = 8192 },
		};
		const struct gpx_wire_page pg[] = { { 0, 1 }, { 3, 2 }, { 15, 0 }, { 16, 0 }, { 0, 0xffffffffu }, { 7, 7 } };
		poke(FUZZ_POKE_AREA, 0, pr, sizeof(pr));
		poke(FUZZ_POKE_AREA, 512, pg, sizeof(pg));
		batch(1, 2, 0, 3, 512, 4096, 0);
		batch(2, 2, 0, 6, 512, 4096, 0);
		batch(3, 1, 0, 2, 512, 1024, 0);
		batch(4, 2, 0, 1u << 16, 512, 4096, 0);
	}
	save(dir, "seed-area-pages");
	return 0;
}
