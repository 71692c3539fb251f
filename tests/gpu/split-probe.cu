/*
 * A probe, not a test: how a weight push within one GPU is best split between copy engines and
 * the SM copy kernel.  The 338 tensors of a Qwen2-1.5B-shaped model (bf16, 2.9 GiB), laid out
 * one after another at 512-byte steps in one allocation, are copied to another, against one
 * flat cudaMemcpyAsync of the same bytes: one copy per tensor on one stream and dealt over two;
 * the way gpxd took before (chunks of 1 GiB on two streams in turn, segments up to 32 MiB in
 * tiles to the kernel, a block for every 8 tiles, larger ones to a copy engine of the chunk's
 * stream); the kernel over the flat buffer itself; and segments of 16 MiB and more on copy
 * engines of two streams, dealt by bytes or one to each in turn, the kernel taking the rest on
 * one of those or on a third, in tiles sized for the chunk or for the kernel's share (the
 * last: what gpxd does now, SPLIT_LOCAL in daemon/gpu/gpu-copy.c).  Each way's median of 15,
 * timed with CUDA events; the last way's bytes are checked whole.
 *
 *   make tests/gpu/split-probe && tests/gpu/split-probe
 */
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
	fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

struct kseg { uint64_t src, dst, len; };
struct piece { uint64_t src, dst, len; };

/* gpxd's copy kernel (daemon/gpu/copy-kernel.cu), 16-byte steps: thread t of nt, 8 loads in flight */
static __device__ __forceinline__ void
copy_strided(const char *src, char *dst, uint64_t len, uint64_t t, uint64_t nt)
{
	const uint4 *s4 = (const uint4 *)src;
	uint4 *d4 = (uint4 *)dst;
	const uint64_t words = len >> 4;
	uint64_t i = t;

	for (; i + 7 * nt < words; i += 8 * nt) {
		uint4 v[8];
#pragma unroll
		for (int k = 0; k < 8; k++)
			v[k] = s4[i + k * nt];
#pragma unroll
		for (int k = 0; k < 8; k++)
			d4[i + k * nt] = v[k];
	}
	for (; i < words; i += nt)
		d4[i] = s4[i];
}

/* a warp per segment, as gpxd's gpx_copy_segments */
__global__ void __launch_bounds__(256)
warp_segs(const kseg *__restrict__ segs, uint32_t n)
{
	const uint32_t lane = threadIdx.x & 31, warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const uint32_t warps = (gridDim.x * blockDim.x) >> 5;

	for (uint32_t s = warp; s < n; s += warps)
		copy_strided((const char *)segs[s].src, (char *)segs[s].dst, segs[s].len, lane, 32);
}

/* a block per segment */
__global__ void __launch_bounds__(256)
block_segs(const kseg *__restrict__ segs, uint32_t n)
{
	for (uint32_t s = blockIdx.x; s < n; s += gridDim.x)
		copy_strided((const char *)segs[s].src, (char *)segs[s].dst, segs[s].len, threadIdx.x, blockDim.x);
}

/* Qwen2-1.5B: embedding, 28 layers of 12 tensors, the last norm; bytes of bf16 */
static std::vector<uint64_t>
shapes(void)
{
	const uint64_t h = 1536, f = 8960, v = 151936, kvh = 256;
	std::vector<uint64_t> s{ v * h };

	for (int l = 0; l < 28; l++)
		for (uint64_t e : { h * h, h, kvh * h, kvh, kvh * h, kvh, h * h, f * h, f * h, h * f, h, h })
			s.push_back(e);
	s.push_back(h);
	for (auto &e : s)
		e *= 2;
	return s;
}

static std::vector<kseg>
tile(const std::vector<piece> &p, uint64_t t)
{
	std::vector<kseg> k;

	for (auto &e : p)
		for (uint64_t at = 0; at < e.len; at += t)
			k.push_back({ e.src + at, e.dst + at, std::min(t, e.len - at) });
	return k;
}

/* gpxd's tile_size: at most `entries` tiles of bytes, in 32 KiB steps */
static uint64_t
tile_size(uint64_t bytes, uint32_t entries)
{
	const uint64_t m = 32 << 10, t = ((bytes + entries - 1) / entries + m - 1) / m * m;

	return t > m ? t : m;
}

static uint64_t
bytes_of(const std::vector<piece> &p)
{
	uint64_t n = 0;

	for (auto &e : p)
		n += e.len;
	return n;
}

static const int R = 15;
static float flat_ms;

static float
timeit(const char *name, const std::function<void()> &fn)
{
	cudaEvent_t a, b;
	std::vector<float> ms;

	CK(cudaEventCreate(&a));
	CK(cudaEventCreate(&b));
	fn();
	CK(cudaDeviceSynchronize());
	for (int r = 0; r < R; r++) {
		float m;
		CK(cudaEventRecord(a, 0));
		fn();
		CK(cudaEventRecord(b, 0));
		CK(cudaEventSynchronize(b));
		CK(cudaEventElapsedTime(&m, a, b));
		ms.push_back(m);
	}
	std::sort(ms.begin(), ms.end());
	printf("  %-78s %.3f ms (%.3f-%.3f)", name, ms[R / 2], ms[0], ms[R - 1]);
	if (flat_ms > 0)
		printf("  %.3fx of flat", flat_ms / ms[R / 2]);
	printf("\n");
	return ms[R / 2];
}

int
main(void)
{
	std::vector<piece> all;
	uint64_t total = 0, off = 0;
	char *src, *dst;
	int sms;
	cudaDeviceProp prop;

	for (uint64_t e : shapes()) {
		all.push_back({ off, off, e });
		off += (e + 511) / 512 * 512;
		total += e;
	}
	CK(cudaMalloc(&src, off));
	CK(cudaMalloc(&dst, off));
	for (auto &p : all) {
		p.src += (uint64_t)src;
		p.dst += (uint64_t)dst;
	}
	CK(cudaGetDeviceProperties(&prop, 0));
	CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
	printf("%s, %d SMs: %zu tensors, %.3f GiB, within GPU0\n", prop.name, sms, all.size(), total / 1073741824.0);

	/* random bytes in the source (a byte pattern per tensor would check little) */
	{
		std::vector<uint64_t> h(1 << 20);
		uint64_t x = 88172645463325252ull;
		for (uint64_t at = 0; at < off; at += h.size() * 8) {
			for (auto &w : h) {
				x ^= x << 13; x ^= x >> 7; x ^= x << 17;
				w = x;
			}
			CK(cudaMemcpy(src + at, h.data(), std::min<uint64_t>(h.size() * 8, off - at), cudaMemcpyHostToDevice));
		}
	}
	cudaStream_t st[3];
	for (auto &s : st)
		CK(cudaStreamCreate(&s));       /* blocking: ordered with the legacy stream the events are on */
	kseg *dlist[4], *hlist[4];
	for (int i = 0; i < 4; i++) {
		CK(cudaMalloc(&dlist[i], 1 << 22));
		CK(cudaMallocHost(&hlist[i], 1 << 22));
	}
	/* the kernel's list in pinned memory, read in place, as gpxd's */
	auto launch = [&](const std::vector<kseg> &k, int slot, cudaStream_t s) {
		memcpy(hlist[slot], k.data(), k.size() * sizeof(kseg));
		warp_segs<<<(k.size() + 7) / 8, 256, 0, s>>>(hlist[slot], (uint32_t)k.size());
	};
	/* gpxd's chunks: up to 1 GiB each, in order, a segment cut where a chunk ends */
	std::vector<std::vector<piece>> chunks(1);
	uint64_t in = 0;
	for (auto p : all)
		while (p.len > 0) {
			const uint64_t n = std::min<uint64_t>((1ull << 30) - in, p.len);
			chunks.back().push_back({ p.src, p.dst, n });
			p.src += n;
			p.dst += n;
			p.len -= n;
			if ((in += n) == 1ull << 30) {
				chunks.emplace_back();
				in = 0;
			}
		}
	if (chunks.back().empty())
		chunks.pop_back();

	flat_ms = timeit("one flat cudaMemcpyAsync of the same bytes", [&] {
		CK(cudaMemcpyAsync(dst, src, off, cudaMemcpyDeviceToDevice, 0));
	});
	for (int ns : { 1, 2 }) {
		char name[128];
		snprintf(name, sizeof(name), "one cudaMemcpyAsync per tensor, %d stream%s", ns, ns > 1 ? "s" : "");
		timeit(name, [&] {
			int i = 0;
			for (auto &p : all)
				CK(cudaMemcpyAsync((void *)p.dst, (void *)p.src, p.len, cudaMemcpyDeviceToDevice, st[i++ % ns]));
		});
	}
	timeit("gpxd before: 1 GiB chunks on 2 streams, tiles up to 32 MiB, larger on the chunk's CE", [&] {
		for (size_t c = 0; c < chunks.size(); c++) {
			const uint64_t t = tile_size(bytes_of(chunks[c]), 8192 - chunks[c].size());
			std::vector<piece> kp;
			for (auto &p : chunks[c])
				if (p.len > 32ull << 20)
					CK(cudaMemcpyAsync((void *)p.dst, (void *)p.src, p.len, cudaMemcpyDeviceToDevice, st[c & 1]));
				else
					kp.push_back(p);
			launch(tile(kp, t), c, st[c & 1]);
		}
	});
	{
		std::vector<piece> flat{ { (uint64_t)src, (uint64_t)dst, off } };
		auto k = tile(flat, 256 << 10);
		CK(cudaMemcpy(dlist[0], k.data(), k.size() * sizeof(kseg), cudaMemcpyHostToDevice));
		timeit("the kernel over the flat buffer, 256 KiB tiles, a block per tile", [&] {
			block_segs<<<k.size(), 256>>>(dlist[0], (uint32_t)k.size());
		});
	}
	/*
	 * Per chunk: segments >= 16 MiB dealt by bytes over st[0] and st[1], the kernel for the rest
	 * on st[ks], in tiles sized for the kernel's bytes (whole: for the chunk's, as before).
	 */
	auto split = [&](int ks, bool whole, bool turns, const char *name) {
		timeit(name, [&] {
			uint64_t turn = 0;     /* (over the chunks, as gpxd's) */
			for (size_t c = 0; c < chunks.size(); c++) {
				uint64_t kb = 0;
				for (auto &p : chunks[c])
					kb += p.len < 16ull << 20 ? p.len : 0;
				const uint64_t t = tile_size(whole ? bytes_of(chunks[c]) : kb, 8192 - chunks[c].size());
				std::vector<piece> kp;
				uint64_t side[2] = { 0, 0 };
				for (auto &p : chunks[c]) {
					if (p.len < 16ull << 20) {
						kp.push_back(p);
						continue;
					}
					const int b = turns ? (int)(turn++ & 1) : side[1] < side[0];
					CK(cudaMemcpyAsync((void *)p.dst, (void *)p.src, p.len, cudaMemcpyDeviceToDevice, st[b]));
					side[b] += p.len;
				}
				launch(tile(kp, t), c, st[ks]);
			}
		});
	};
	split(1, false, false, "1 GiB chunks: >= 16 MiB on CEs of 2 streams by bytes, the kernel on the second");
	split(2, true, false, "the same, the kernel on a third stream, tiles sized for the whole chunk");
	split(2, false, false, "the same, tiles for the kernel's share");
	split(1, false, true, "1 GiB chunks: >= 16 MiB on CEs of 2 streams in turn, the kernel on the second");
	CK(cudaMemset(dst, 0, off));
	split(2, false, true, "the same, the kernel on a third stream (gpxd now)");
	CK(cudaDeviceSynchronize());

	std::vector<char> a(64 << 20), b(64 << 20);
	bool same = true;
	for (uint64_t at = 0; at < off && same; at += a.size()) {
		const size_t n = std::min<uint64_t>(a.size(), off - at);
		CK(cudaMemcpy(a.data(), src + at, n, cudaMemcpyDeviceToHost));
		CK(cudaMemcpy(b.data(), dst + at, n, cudaMemcpyDeviceToHost));
		same = memcmp(a.data(), b.data(), n) == 0;
	}
	printf("the last way's copy, checked whole: %s\n", same ? "every byte in place" : "DIFFERENT");
	return same ? 0 : 1;
}
