/*
 * gpx-bench-gpu's tensor mode: a weight push, many separate tensors in one request.
 *
 *   gpu-tensors  the 338 bf16 tensors of a Qwen2-1.5B-shaped model (2.88 GiB, each its own
 *                allocation, as PyTorch's caching allocator gives large tensors) within GPU0,
 *                or GPU0 -> GPU1 on two GPUs, in one gpx_copy_batch; against one flat copy of
 *                the same bytes (what a perfect push would take: the target's baseline), the
 *                program's own multi-tensor copy kernel (tests/bench-gather.cu), one
 *                cuMemcpyAsync per tensor on one stream and on two, and cuMemcpyBatchAsync
 *
 * It shows what each way pays for a tensor being its own copy, which the PyTorch weights bench
 * (python3 -m gpx.bench weights) cannot take apart.
 */
#include "config.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>

#include "tests/bench.h"
#include "tests/bench-gpu.h"

extern const unsigned char bench_gather_fatbin[];

#define TILE (32u << 10)              /* the program's kernel cuts tensors into tiles of this */

struct tile {                         /* struct bench_tile of tests/bench-gather.cu */
	uint64_t src, dst, len;
};

struct tensors {
	struct bench_ctx *b;
	size_t n;
	uint64_t total;
	struct gbuf *src, *dst;           /* tensor i: its own buffers, len[i] bytes used */
	size_t *len;
	CUdeviceptr *bsrc, *bdst;         /* the same, as cuMemcpyBatchAsync takes them */
	struct gbuf flat_src, flat_dst;   /* total bytes each */
	CUfunction kfn;
	unsigned kblocks;
	CUdeviceptr tiles;
	uint32_t ntiles;
	CUstream second;                  /* the source GPU's second stream */
	struct gpx_pair *pairs;
	struct gpx_seg *segs;
	uint64_t tag;
	char batch_why[128];
};

/* Qwen2-1.5B: hidden 1536, MLP 8960, 28 layers, 2 KV heads of 128, vocabulary 151,936; bf16. */
static size_t
model_shapes(size_t *len)
{
	const size_t h = 1536, mlp = 8960, kv = 256, vocab = 151936;
	size_t n = 0;

	len[n++] = vocab * h * 2;
	for (int l = 0; l < 28; l++) {
		const size_t layer[] = { h * h * 2, h * 2, kv * h * 2, kv * 2, kv * h * 2, kv * 2, h * h * 2,
			mlp * h * 2, mlp * h * 2, h * mlp * 2, h * 2, h * 2 };
		for (size_t k = 0; k < sizeof(layer) / sizeof(layer[0]); k++)
			len[n++] = layer[k];
	}
	len[n++] = h * 2;
	return n;
}
#define MODEL_TENSORS 338

static int
t_flat(void *arg)
{
	struct tensors *o = arg;
	const int d = o->src[0].dev;

	cuCtxSetCurrent(bench_gpu_ctx(d));
	if (cuMemcpyAsync(o->flat_dst.d, o->flat_src.d, o->total, bench_gpu_stream(d)) != CUDA_SUCCESS)
		return -GPX_EIO;
	return cuStreamSynchronize(bench_gpu_stream(d)) == CUDA_SUCCESS ? 0 : -GPX_EIO;
}

static int
t_kernel(void *arg)
{
	struct tensors *o = arg;
	const int d = o->src[0].dev;
	void *args[] = { &o->tiles, &o->ntiles };

	cuCtxSetCurrent(bench_gpu_ctx(d));
	if (cuLaunchKernel(o->kfn, o->kblocks, 1, 1, 256, 1, 1, 0, bench_gpu_stream(d), args, NULL) != CUDA_SUCCESS)
		return -GPX_EIO;
	return cuStreamSynchronize(bench_gpu_stream(d)) == CUDA_SUCCESS ? 0 : -GPX_EIO;
}

/* One cuMemcpyAsync per tensor, dealt over nstreams streams (1 or 2) of the source's GPU. */
static int
t_each(struct tensors *o, int nstreams)
{
	const int d = o->src[0].dev;
	CUstream st[2] = { bench_gpu_stream(d), o->second };

	cuCtxSetCurrent(bench_gpu_ctx(d));
	for (size_t i = 0; i < o->n; i++)
		if (cuMemcpyAsync(o->dst[i].d, o->src[i].d, o->len[i], st[i % nstreams]) != CUDA_SUCCESS)
			return -GPX_EIO;
	for (int k = 0; k < nstreams; k++)
		if (cuStreamSynchronize(st[k]) != CUDA_SUCCESS)
			return -GPX_EIO;
	return 0;
}

static int
t_each1(void *arg)
{
	return t_each(arg, 1);
}

static int
t_each2(void *arg)
{
	return t_each(arg, 2);
}

static int
t_batch(void *arg)
{
	struct tensors *o = arg;

	return bench_gpu_batch(o->src[0].dev, o->dst[0].dev, o->bdst, o->bsrc, o->len, o->n, o->batch_why,
	    sizeof(o->batch_why));
}

static int
t_gpx(void *arg)
{
	struct tensors *o = arg;
	struct gpx_completion c;
	int r = gpx_copy_batch(o->b->conn, o->pairs, o->n, o->segs, o->n, ++o->tag);

	if (r < 0)
		return r;
	while ((r = gpx_poll(o->b->conn, &c, 1)) == 0)
		;
	return r < 0 ? r : c.status;
}

/* Every tensor after op, against the pattern its source holds: a way that loses a byte fails. */
static int
t_check(struct tensors *o, bench_op op, const char *name, unsigned char *want, unsigned char *got)
{
	cuCtxSetCurrent(bench_gpu_ctx(o->dst[0].dev));
	for (size_t i = 0; i < o->n; i++)
		if (!CK(cuMemsetD8(o->dst[i].d, 0, o->len[i])))
			return -1;
	if (!CK(cuCtxSynchronize()) || op(o) < 0) {
		fprintf(stderr, "gpx-bench-gpu: gpu-tensors: %s failed\n", name);
		return -1;
	}
	cuCtxSetCurrent(bench_gpu_ctx(o->dst[0].dev));
	for (size_t i = 0; i < o->n; i++) {
		bench_fill(want, o->len[i], 100 + i);
		if (!CK(cuMemcpyDtoH(got, o->dst[i].d, o->len[i])))
			return -1;
		if (memcmp(got, want, o->len[i]) != 0) {
			fprintf(stderr, "gpx-bench-gpu: gpu-tensors: %s: tensor %zu (%zu bytes) did not arrive intact\n",
			    name, i, o->len[i]);
			return -1;
		}
	}
	return 0;
}

static int
t_setup(struct tensors *o, int dd, unsigned char *buf)
{
	struct bench_ctx *b = o->b;
	CUmodule m;
	CUdevice d;
	int sms = 0;

	for (size_t i = 0; i < o->n; i++) {
		if (gbuf_new(b, 0, o->len[i], &o->src[i]) < 0 || gbuf_new(b, dd, o->len[i], &o->dst[i]) < 0)
			return -1;
		bench_fill(buf, o->len[i], 100 + i);
		cuCtxSetCurrent(bench_gpu_ctx(0));
		if (!CK(cuMemcpyHtoD(o->src[i].d, buf, o->len[i])))
			return -1;
		o->bsrc[i] = o->src[i].d;
		o->bdst[i] = o->dst[i].d;
		o->pairs[i] = (struct gpx_pair){ .src = o->src[i].region, .dst = o->dst[i].region, .seg_first = (uint32_t)i,
			.seg_count = 1 };
		o->segs[i] = (struct gpx_seg){ 0, 0, o->len[i] };
		o->total += o->len[i];
		o->ntiles += (uint32_t)((o->len[i] + TILE - 1) / TILE);
	}
	if (gbuf_alloc(0, o->total, &o->flat_src) < 0 || gbuf_alloc(dd, o->total, &o->flat_dst) < 0)
		return -1;
	struct tile *t = malloc(o->ntiles * sizeof(*t));
	if (t == NULL)
		return bench_fail(b, -GPX_ENOMEM, "the tile list");
	uint32_t k = 0;
	for (size_t i = 0; i < o->n; i++)
		for (uint64_t at = 0; at < o->len[i]; at += TILE)
			t[k++] = (struct tile){ o->src[i].d + at, o->dst[i].d + at, o->len[i] - at < TILE ? o->len[i] - at : TILE };
	cuCtxSetCurrent(bench_gpu_ctx(0));
	bool ok = CK(cuModuleLoadData(&m, bench_gather_fatbin)) && CK(cuModuleGetFunction(&o->kfn, m, "bench_tensors")) &&
	    CK(cuCtxGetDevice(&d)) && CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d)) &&
	    CK(cuMemAlloc(&o->tiles, o->ntiles * sizeof(*t))) && CK(cuMemcpyHtoD(o->tiles, t, o->ntiles * sizeof(*t))) &&
	    CK(cuStreamCreate(&o->second, CU_STREAM_NON_BLOCKING));
	free(t);
	/* Eight blocks of 256 threads per SM: every SM full, as a program launches it on an idle GPU. */
	o->kblocks = (unsigned)sms * 8;
	return ok ? 0 : -1;
}

static void
t_free(struct tensors *o)
{
	for (size_t i = 0; i < o->n; i++) {
		if (o->src[i].d)
			gbuf_free(o->b, &o->src[i]);
		if (o->dst[i].d)
			gbuf_free(o->b, &o->dst[i]);
	}
	if (o->flat_src.d)
		gbuf_release(&o->flat_src);
	if (o->flat_dst.d)
		gbuf_release(&o->flat_dst);
	cuCtxSetCurrent(bench_gpu_ctx(0));
	if (o->tiles)
		cuMemFree(o->tiles);
	if (o->second)
		cuStreamDestroy(o->second);
}

static int
mode_tensors(struct bench_ctx *b)
{
	int r = bench_gpu_setup(b, "gpu-tensors", 1);
	static size_t len[MODEL_TENSORS];
	static struct gbuf src[MODEL_TENSORS], dst[MODEL_TENSORS];
	static CUdeviceptr bsrc[MODEL_TENSORS], bdst[MODEL_TENSORS];
	static struct gpx_pair pairs[MODEL_TENSORS];
	static struct gpx_seg segs[MODEL_TENSORS];
	char title[640], what[96], sz[32];

	if (r)
		return r;
	const int dd = bench_gpu_count() > 1 ? 1 : 0;
	struct tensors o = { .b = b, .n = model_shapes(len), .src = src, .dst = dst, .len = len, .bsrc = bsrc,
		.bdst = bdst, .pairs = pairs, .segs = segs };
	size_t most = 0;
	for (size_t i = 0; i < o.n; i++)
		most = len[i] > most ? len[i] : most;
	unsigned char *want = malloc(most), *got = malloc(most);
	memset(src, 0, sizeof(src));
	memset(dst, 0, sizeof(dst));
	if (want == NULL || got == NULL || t_setup(&o, dd, want) < 0)
		goto fail;
	const bool batch = t_batch(&o) == 0;
	if (!batch)
		fprintf(stderr, "gpx-bench-gpu: gpu-tensors: %s\n", o.batch_why);
	if (t_check(&o, t_kernel, "the program's kernel", want, got) < 0 ||
	    t_check(&o, t_each2, "cuMemcpyAsync per tensor", want, got) < 0 ||
	    (batch && t_check(&o, t_batch, "cuMemcpyBatchAsync", want, got) < 0) ||
	    t_check(&o, t_gpx, "gpx_copy_batch", want, got) < 0)
		goto fail;
	snprintf(title, sizeof(title), "a Qwen2-1.5B-shaped model's %zu bf16 tensors (%s, each its own allocation) %s "
	    "in one request: one flat copy of the same bytes, the program's multi-tensor kernel, one cuMemcpyAsync "
	    "per tensor and cuMemcpyBatchAsync (direct) vs gpx_copy_batch", o.n,
	    bench_size_str(o.total, sz, sizeof(sz)), dd ? "GPU0 -> GPU1" : "within GPU0");
	bench_table_begin(b, "gpu-tensors", title);
	const struct {
		const char *what;
		bench_op direct;
		const char *target;
	} rows[] = {
		{ "vs one flat copy", t_flat, "weights.flat" },
		{ "vs the program's kernel", t_kernel, NULL },
		{ "vs one copy per tensor, 2 streams", t_each2, NULL },
		{ "vs one copy per tensor, 1 stream", t_each1, NULL },
		{ "vs cuMemcpyBatchAsync", batch ? t_batch : NULL, NULL },
	};
	for (size_t k = 0; k < sizeof(rows) / sizeof(rows[0]); k++) {
		struct bench_pair p;
		snprintf(what, sizeof(what), "%zu tensors, %s", o.n, rows[k].what);
		if (rows[k].direct == NULL) {
			bench_gpu_row(b, what, "GB/s", NAN, NAN, false, o.total);
			continue;
		}
		if (bench_pair_measure(b, rows[k].direct, t_gpx, &o, &p) < 0)
			goto fail;
		bench_gpu_row_t(b, what, "GB/s", o.total / p.direct / 1e9, o.total / p.gpx / 1e9, false, o.total,
		    rows[k].target);
		bench_pair_free(&p);
	}
	snprintf(title, sizeof(title), "direct: flat = one cuMemcpyAsync of %s between two buffers; kernel = one "
	    "launch of the program's own multi-tensor copy kernel over %u tiles of %u KiB (tests/bench-gather.cu, "
	    "%u blocks of 256); per tensor = one cuMemcpyAsync each, on the program's stream or dealt over two; "
	    "batch = cuMemcpyBatchAsync%s%s.  Every way but flat checked byte for byte first",
	    bench_size_str(o.total, sz, sizeof(sz)), o.ntiles, TILE >> 10, o.kblocks, batch ? "" : ": ",
	    batch ? "" : o.batch_why);
	bench_table_end(b, title);
	t_free(&o);
	free(want);
	free(got);
	return 0;
fail:
	t_free(&o);
	free(want);
	free(got);
	return -1;
}

static const struct bench_mode tensor_modes[] = {
	{ "gpu-tensors", "a weight push: 338 separate tensors in one request vs flat, kernel, per-tensor copies", mode_tensors },
};
BENCH_MODES(tensor_modes)
