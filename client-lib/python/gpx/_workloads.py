"""The workloads of ``python3 -m gpx.bench``: kv, weights, pages and small.

Each runs what a PyTorch program does, two processes as in production, once through
PyTorch's own means and once through gpxd, from one run, and checks every result against the
source bytes before it is counted.

kv       a prefill process and a decode process, a vLLM-shaped paged cache: per layer a K and a
         V tensor ``[num_blocks, 16, 8, 128]`` bf16 (32 KiB a block).  A batch of requests'
         blocks moves from prefill block numbers to other decode block numbers.  PyTorch's way:
         the prefill tensors shared with torch.multiprocessing, then per tensor a gather on the
         source GPU, a copy to the destination and a scatter there.  gpx's way: one
         copy_pages_batch of every tensor pair (the pairs a Batch, parsed once as a program
         would: Conn.batch).  The strongest baseline: the program's own
         fused kernel, ONE launch over all 64 tensors (bench-kernels.cu, loaded through
         ctypes).  Also a flat copy of the same bytes, the bandwidth a perfect handoff would
         reach; each request after ~1 ms of the program's matmuls; and, for 1,024 blocks,
         both while the program's matmuls run, with the matmul step time of each.
weights  a trainer process pushes a whole model's weights into an inference process.  The
         model is built with transformers from a Qwen2-1.5B-shaped config (random weights,
         nothing downloaded), or, without transformers, the same list of shapes.  PyTorch's
         ways: NCCL broadcast tensor by tensor (two GPUs), CUDA IPC plus copy_ per tensor,
         torch._foreach_copy_; and one flat copy of the same bytes, the target's baseline.
         gpx: one copy_batch of every tensor (its pairs a Batch, parsed once).  Also the fixed
         cost of an update: the same tensors, 256 bytes of each.
pages    the scattered pages of one 256 MiB cache: 65,536 x 4 KiB and 8,192 x 32 KiB, back to
         back and each after 1 ms of the decode process's own GPU work, against PyTorch's
         gather / copy / scatter; and a flat 256 MiB copy against torch's copy_.
small    20,000 copies of 4 KiB with 64 in flight from Python against a torch copy_ loop, and
         one 4 KiB copy + wait against torch copy_ + synchronize and cuMemcpyAsync +
         cuStreamSynchronize (ctypes), within GPU 0.

Where the spawned (or --metrics) gpxd has a metrics endpoint, each gpx figure is followed by
the mean time per transfer of each of gpxd's stages (gpx_stage_seconds), and by gpxd's cores
busy while it ran (/proc/PID/stat); figures with a target end in met or NOT MET.

Without a GPU (or without torch) kv and weights run the same shapes, smaller, in host memory
(HostBuffers viewed through numpy, the baseline a numpy gather / scatter through the shared
memory), so that CI runs them as a test of function, not of speed.  There weights prints its
fixed cost too (the same 256 bytes of each tensor), with gpxd's stages: their CPU work is the
same as on a GPU, less the launch.
"""

import multiprocessing
import os
import stat
import statistics
import sys
import time

import gpx

BLOCK_SHAPE = (16, 8, 128)       # tokens per block, KV heads, head dim: 32 KiB in bf16
BLOCK_BYTES = 16 * 8 * 128 * 2

# Qwen2-1.5B: the shapes a weight push moves when transformers is not there to build it.
QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=32768)


# ---------------------------------------------------------------------------------------------
# The driver API through ctypes: the program's own fused kernel and raw copies, the strongest
# baselines, without a compiler or another package where the bench runs.

class _Driver:
    """libcuda.so.1, the few calls the baselines need; every failure ends the run with its name."""

    def __init__(self):
        import ctypes as ct
        self.ct = ct
        self.lib = ct.CDLL("libcuda.so.1")
        vp, u32, u64 = ct.c_void_p, ct.c_uint, ct.c_uint64
        sig = {
            "cuCtxGetCurrent": [ct.POINTER(vp)],
            "cuModuleLoadData": [ct.POINTER(vp), vp],
            "cuModuleGetFunction": [ct.POINTER(vp), vp, ct.c_char_p],
            "cuLaunchKernel": [vp, u32, u32, u32, u32, u32, u32, u32, vp, ct.POINTER(vp), ct.POINTER(vp)],
            "cuMemcpyAsync": [u64, u64, ct.c_size_t, vp],
            "cuStreamSynchronize": [vp],
            "cuGetErrorName": [ct.c_int, ct.POINTER(ct.c_char_p)],
        }
        for name, args in sig.items():
            f = getattr(self.lib, name)
            f.argtypes, f.restype = args, ct.c_int

    def check(self, r, what):
        if r != 0:
            name = self.ct.c_char_p()
            self.lib.cuGetErrorName(r, self.ct.byref(name))
            raise SystemExit(f"gpx.bench: {what}: {(name.value or b'?').decode()} ({r})")

    def current_ctx(self, torch, dev):
        """The context PyTorch made current for dev (its primary context)."""
        torch.cuda.set_device(dev)
        torch.cuda.current_stream(dev).synchronize()
        ctx = self.ct.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(self.ct.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise SystemExit(f"gpx.bench: no CUDA context current for GPU {dev}")
        return ctx.value


FATBIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bench_kernels.fatbin")


class _FusedCopy:
    """The program's own copy: ONE launch of bench-kernels.cu's gather-scatter kernel over every
    tensor pair, on device dev, with the tensors' addresses in device tables (as vLLM's
    copy_blocks).  Verified by its caller byte for byte against PyTorch before it is timed."""

    def __init__(self, torch, drv, dev, src, dst, block_bytes):
        ct = drv.ct
        self.torch, self.drv, self.dev = torch, drv, dev
        for t in list(src) + list(dst):
            if t.data_ptr() % 16 or not t.is_contiguous():
                raise SystemExit("gpx.bench: the fused kernel needs contiguous tensors on 16-byte boundaries")
        if block_bytes % 16:
            raise SystemExit("gpx.bench: the fused kernel moves blocks of a multiple of 16 bytes")
        with open(FATBIN, "rb") as f:
            self.image = f.read()
        drv.current_ctx(torch, dev)
        self.mod, self.fn = ct.c_void_p(), ct.c_void_p()
        drv.check(drv.lib.cuModuleLoadData(ct.byref(self.mod), self.image), "cuModuleLoadData (the bench's fatbin)")
        drv.check(drv.lib.cuModuleGetFunction(ct.byref(self.fn), self.mod, b"gpx_bench_copy_blocks"),
                  "cuModuleGetFunction gpx_bench_copy_blocks")
        d = f"cuda:{dev}"
        self.tables = (torch.tensor([t.data_ptr() for t in src], dtype=torch.int64, device=d),
                       torch.tensor([t.data_ptr() for t in dst], dtype=torch.int64, device=d))
        self.ntensors = len(src)
        self.block_bytes = block_bytes
        self.nblocks = 0

    def blocks(self, src_idx, dst_idx):
        """The block numbers of the next launches (int32 on the kernel's device)."""
        d = f"cuda:{self.dev}"
        self.idx = (src_idx.to(device=d, dtype=self.torch.int32).contiguous(),
                    dst_idx.to(device=d, dtype=self.torch.int32).contiguous())
        self.nblocks = len(src_idx)
        ct = self.drv.ct
        self.vals = [ct.c_uint64(self.tables[0].data_ptr()), ct.c_uint64(self.tables[1].data_ptr()),
                     ct.c_uint64(self.idx[0].data_ptr()), ct.c_uint64(self.idx[1].data_ptr()),
                     ct.c_uint64(self.block_bytes)]
        self.args = (ct.c_void_p * 5)(*[ct.cast(ct.byref(v), ct.c_void_p) for v in self.vals])

    def launch(self, stream=None):
        """Queues the copy of every tensor's blocks on stream (PyTorch's current by default)."""
        s = stream if stream is not None else self.torch.cuda.current_stream(self.dev)
        if self.torch.cuda.current_device() != self.dev:
            with self.torch.cuda.device(self.dev):     # the launch names the current context's function
                return self.launch(s)
        self.drv.check(self.drv.lib.cuLaunchKernel(self.fn, self.nblocks, self.ntensors, 1, 256, 1, 1, 0,
                                                   s.cuda_stream, self.args, None), "cuLaunchKernel")


def _under_mps():
    """Whether this process's CUDA clients run under MPS: the control daemon's endpoint (a
    named pipe or a socket, by version) is where the driver looks for it
    ($CUDA_MPS_PIPE_DIRECTORY, by default /tmp/nvidia-mps), as the C benches decide."""
    d = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    try:
        mode = os.stat(os.path.join(d, "control")).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _verdict(tid, value):
    from gpx import bench
    return bench.verdict(tid, value)


def _torch_gpus():
    """torch and the number of GPUs it sees, or (None, 0)."""
    try:
        import torch
    except ImportError:
        return None, 0
    return torch, torch.cuda.device_count() if torch.cuda.is_available() else 0


def _median_time(fn, runs, warm=0.2):
    """The median of `runs` timed calls of fn, after calls enough for `warm` seconds: a GPU
    left idle runs its first milliseconds of work at a fraction of its clock."""
    end = time.perf_counter() + warm
    while time.perf_counter() < end:
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _submit_time(submit, runs):
    """The median time a submission takes until it returns (its wait not timed): the client's
    own share of a round trip, the rest of its side being its wake-up."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        t = submit()
        times.append(time.perf_counter() - t0)
        t.wait()
    return statistics.median(times)


def _row(what, base_name, base, gpx_v, unit, extra=""):
    ratio = gpx_v / base if base and gpx_v else float("nan")
    print(f"  {what:<44} {base_name:>10} {base:10.2f}  gpx {gpx_v:10.2f} {unit:<5} {ratio:6.2f}x{extra}")


def _spawn(targets):
    """Starts each (function, args) in a process of its own (spawn); returns them."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=f, args=a, daemon=True) for f, a in targets]
    for p in procs:
        p.start()
    return procs


def _join(procs):
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise SystemExit(f"gpx.bench: a worker process failed (exit {p.exitcode})")


def _result(q, procs, timeout=1800):
    """What a worker put on q; a worker that died first ends the run instead of a wait."""
    import queue
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"gpx.bench: a worker process failed (exit {dead[0].exitcode}); "
                                 "its error is above")
    raise SystemExit("gpx.bench: the workers did not finish in time")


def _gpu_child(alloc, dev):
    """The start of every GPU worker: the allocator mode, torch, the device; returns (torch,
    a context in which the workload's tensors are allocated)."""
    import contextlib
    if alloc == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    torch.cuda.set_device(dev)
    if alloc == "pool":
        return torch, torch.cuda.use_mem_pool(gpx.torch_mem_pool(dev), device=dev)
    return torch, contextlib.nullcontext()


ALLOC_NAMES = {"default": "PyTorch's caching allocator (cuda-ipc)",
               "expandable": "expandable_segments:True (cuda-vmm, many pieces)",
               "pool": "gpx.torch_mem_pool() (cuda-vmm)"}


# ---------------------------------------------------------------------------------------------
# kv

def _kv_sizes(torch, devs, free_bytes, layers):
    """Blocks per cache tensor and the request sizes that fit the memory of the GPU(s)."""
    per_block = 2 * layers * BLOCK_BYTES          # K and V of every layer
    shared = devs[0] == devs[1]
    # Both caches, plus the flat reference and PyTorch's gather buffer (as large as a request).
    budget = free_bytes * 0.6
    for top in (4096, 2048, 1024, 256):
        need = per_block * (top + 256) * (2 if shared else 1) + 2 * per_block * top
        if need < budget:
            return top + 256, [n for n in (256, 1024, 4096) if n <= top]
    return 256 + 256, [256]


def _own_work(torch, dev, seconds=1e-3):
    """The program's own GPU work: bf16 matrix products, as many as take `seconds` here.
    Returns (queue them on the current stream, how many)."""
    a = torch.randn((4096, 4096), dtype=torch.bfloat16, device=dev)
    o = torch.empty_like(a)
    reps = 1
    while True:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, a, out=o)
        torch.cuda.synchronize(dev)
        if time.perf_counter() - t0 > seconds or reps > 4096:
            break
        reps *= 2

    def queue(n=reps):
        for _ in range(n):
            torch.mm(a, a, out=o)
    return queue, reps


def _under_load(torch, dev, queue, reps, way, rounds):
    """Copies by way() while the program's matmuls run on a stream of their own: rounds of
    `reps` products, and copies one after another as long as the products run (a copy that
    ended after them ran partly alone and is not counted).  Returns (median copy time or
    None, median time of one product)."""
    ms = torch.cuda.Stream(dev)
    copies, steps = [], []
    for _ in range(rounds):
        torch.cuda.synchronize(dev)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(ms):
            e0.record()
            queue(reps)
            e1.record()
        while not e0.query():
            pass
        while way is not None:
            t0 = time.perf_counter()
            way()
            t = time.perf_counter() - t0
            if e1.query():
                break
            copies.append(t)
        e1.synchronize()
        steps.append(e0.elapsed_time(e1) / 1e3 / reps)
    return (statistics.median(copies) if copies else None), statistics.median(steps)


def _kv_prefill(sock, devs, nblocks, layers, prefix, alloc, conn_q, done_q):
    torch, where = _gpu_child(alloc, devs[0])
    caches = []
    with where:
        for _ in range(2 * layers):
            t = torch.empty((nblocks,) + BLOCK_SHAPE, dtype=torch.bfloat16, device=f"cuda:{devs[0]}")
            t.view(torch.int16).random_(-32768, 32767)
            caches.append(t)
    with gpx.connect(sock, name="bench-kv-prefill") as c:
        for i, t in enumerate(caches):
            c.export(c.register(t, read_only=True), f"{prefix}.{i}")
        torch.cuda.synchronize()
        conn_q.put(caches)            # PyTorch's way: the same tensors, shared by CUDA IPC
        done_q.get()


def _kv_other(dev, layers, nh, conn):
    """A second process with the program's fused kernel over tensors of its own (the same
    shapes, nh blocks each), in its own CUDA context: what any copier outside the program pays
    on the same GPU, gpxd or not.  Serves the decode process over conn: ("blocks", n) takes
    n random blocks and checks one launch byte for byte; "go" launches and synchronizes."""
    torch, _ = _gpu_child("default", dev)
    d = f"cuda:{dev}"
    src = [torch.empty((nh,) + BLOCK_SHAPE, dtype=torch.bfloat16, device=d) for _ in range(2 * layers)]
    for t in src:
        t.view(torch.int16).random_(-32768, 32767)
    dst = [torch.zeros_like(t) for t in src]
    fused = _FusedCopy(torch, _Driver(), dev, src, dst, BLOCK_BYTES)
    stream = torch.cuda.current_stream(dev)
    g = torch.Generator().manual_seed(2)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "go":
            fused.launch(stream)
            stream.synchronize()
            conn.send(None)
        elif cmd[0] == "blocks":
            n = cmd[1]
            sp = torch.randperm(nh, generator=g)[:n].to(torch.int32)
            dp = torch.randperm(nh, generator=g)[:n].to(torch.int32)
            fused.blocks(sp, dp)
            for t in dst:
                t.zero_()
            fused.launch(stream)
            stream.synchronize()
            si, di = sp.long().to(d), dp.long().to(d)
            bad = sum(not torch.equal(b.index_select(0, di).view(torch.uint8), a.index_select(0, si).view(torch.uint8))
                      for a, b in zip(src, dst))
            conn.send(f"{bad} of {len(src)} tensors not what their source holds" if bad else None)
        else:
            return


def _kv_decode(sock, devs, nblocks, layers, prefix, sizes, runs, alloc, gpxd, metrics, conn_q, done_q, out_q,
               other=None, other_n=0):
    torch, where = _gpu_child(alloc, devs[1])
    from gpx import bench
    dev = f"cuda:{devs[1]}"
    src = conn_q.get()
    with where:
        dst = [torch.zeros((nblocks,) + BLOCK_SHAPE, dtype=torch.bfloat16, device=dev) for _ in range(2 * layers)]
    if devs[0] != devs[1]:
        # Peer access both ways, through PyTorch (which also maps its expandable segments to
        # the peer): the fused kernel on the prefill GPU writes this GPU's tensors.
        for a, b in ((devs[0], devs[1]), (devs[1], devs[0])):
            torch.ones(1, device=f"cuda:{b}").copy_(torch.ones(1, device=f"cuda:{a}"))
        torch.cuda.synchronize(devs[0])
        torch.cuda.synchronize(devs[1])
    # The program's kernel runs where its source is, as vLLM's copy_blocks does.
    kdev = devs[0]
    fused = None
    if os.path.exists(FATBIN):
        fused = _FusedCopy(torch, _Driver(), kdev, src, dst, BLOCK_BYTES)
        torch.cuda.set_device(devs[1])
    kstream = torch.cuda.current_stream(kdev)
    queue, reps = _own_work(torch, dev)
    cpu = bench.CpuMeter(gpxd) if gpxd else None
    mps = _under_mps()
    results = []
    if other is not None and (fused is None or not other.poll(300) or other.recv() != "ready"):
        other = None
    with gpx.connect(sock, name="bench-kv-decode") as c:
        theirs = [c.import_(f"{prefix}.{i}") for i in range(2 * layers)]
        mine = [c.register(t) for t in dst]
        pairs = list(zip(theirs, mine))
        g = torch.Generator().manual_seed(1)
        load_n = 1024 if 1024 in sizes else sizes[len(sizes) // 2]
        for n in sizes:
            sp = torch.randperm(nblocks, generator=g)[:n].to(torch.int32)
            dp = torch.randperm(nblocks, generator=g)[:n].to(torch.int32)
            s_idx, d_idx = sp.long().to(src[0].device), dp.long().to(dev)

            def check(what):
                # (as bytes: random bits hold NaNs, which equal nothing as bf16 values)
                for i, (a, b) in enumerate(zip(src, dst)):
                    got = b.index_select(0, d_idx).view(torch.uint8)
                    want = a.index_select(0, s_idx).to(dev).view(torch.uint8)
                    if not torch.equal(got, want):
                        bad = (got != want).reshape(n, -1).any(1)
                        raise SystemExit(f"gpx.bench kv: {what}: tensor {i}: {int(bad.sum())} of {n} blocks are "
                                         f"not what their source holds (first: {int(bad.nonzero()[0])}, all zero: "
                                         f"{not bool(got[bad].any())})")

            def torch_way():
                for a, b in zip(src, dst):
                    buf = a.index_select(0, s_idx)
                    b.index_copy_(0, d_idx, buf.to(dev, non_blocking=True))
                torch.cuda.synchronize(src[0].device)
                torch.cuda.synchronize(dev)

            batch = c.batch(pairs, pages=True)

            def gpx_way():
                c.copy_pages_batch(batch, BLOCK_BYTES, sp, dp).wait()

            def fused_way():
                fused.launch(kstream)
                kstream.synchronize()

            ways = [torch_way, gpx_way]
            if fused is not None:
                fused.blocks(sp, dp)
                ways.append(fused_way)
            for way in ways:
                for t in dst:
                    t.zero_()
                # gpxd's copies are not ordered with this process's streams: what it does on
                # the GPU must be done before a copy is asked for.
                torch.cuda.synchronize(dev)
                way()
                check(way.__name__)
            r = {"n": n, "bytes": 2 * layers * n * BLOCK_BYTES, "mps": mps}
            r["index"] = _median_time(torch_way, runs)
            if fused is not None:
                r["fused"] = _median_time(fused_way, runs)
            before = bench.scrape(metrics)
            if cpu:
                cpu.start()
            r["gpx"] = _median_time(gpx_way, runs)
            r["gpx_cpu"] = cpu.stop() if cpu else None
            r["stages"] = bench.stage_lines(before, bench.scrape(metrics), r["gpx"])
            # The client's side of a round trip: its submission until it returns, beside the
            # program's own launch until it returns; the rest of that side is its wake-up.
            r["submit"] = _submit_time(lambda: c.copy_pages_batch(batch, BLOCK_BYTES, sp, dp), runs * 10)
            if fused is not None:
                lt = []
                for _ in range(runs * 10):
                    t0 = time.perf_counter()
                    fused.launch(kstream)
                    lt.append(time.perf_counter() - t0)
                    kstream.synchronize()
                r["launch"] = statistics.median(lt)
            # Each request after ~1 ms of the program's own GPU work (finished first: gpxd's
            # copies are not ordered with the program's streams), fused and gpx in turn.
            after = {"fused": [], "gpx": []}
            before = bench.scrape(metrics)
            for _ in range(runs):
                for name, way in (("fused", fused_way), ("gpx", gpx_way)):
                    if name == "fused" and fused is None:
                        continue
                    queue()
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    way()
                    after[name].append(time.perf_counter() - t0)
            r["after"] = {k: statistics.median(v) for k, v in after.items() if v}
            r["stages_after"] = bench.stage_lines(before, bench.scrape(metrics), r["after"]["gpx"])
            other_way = None
            if other is not None and n <= other_n:
                # A second process's own fused kernel, back to back and after the same work.
                other.send(("blocks", n))
                bad = other.recv()
                if bad:
                    raise SystemExit(f"gpx.bench kv: the second process's fused kernel: {bad}")

                def other_way():
                    other.send("go")
                    other.recv()
                r["other"] = _median_time(other_way, runs)
                ot = []
                for _ in range(runs):
                    queue()
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    other_way()
                    ot.append(time.perf_counter() - t0)
                r["other_after"] = statistics.median(ot)
            # While the program's matmuls run: the fused kernel on a second stream, or gpx.
            if n == load_n and devs[0] == devs[1]:
                cs = torch.cuda.Stream(dev)

                def fused_side():
                    fused.launch(cs)
                    cs.synchronize()
                alone = r.get("fused", r["gpx"])
                burst = max(reps * 10, int(reps * 8 * alone / 1e-3) + 1)
                _, r["step_alone"] = _under_load(torch, dev, queue, burst, None, runs)
                if fused is not None:
                    r["load_fused"], r["step_fused"] = _under_load(torch, dev, queue, burst, fused_side, runs)
                r["load_gpx"], r["step_gpx"] = _under_load(torch, dev, queue, burst, gpx_way, runs)
                if other_way is not None:
                    r["load_other"], r["step_other"] = _under_load(torch, dev, queue, burst, other_way, runs)
            # A flat copy of the same bytes (beyond 2 GiB the bandwidth is that of 2 GiB).
            nbytes = r["bytes"]
            flat = min(nbytes, 2 << 30)
            fa = torch.empty(flat, dtype=torch.uint8, device=src[0].device)
            fb = torch.empty(flat, dtype=torch.uint8, device=dev)

            def flat_way():
                fb.copy_(fa)
                torch.cuda.synchronize(dev)
            flat_way()
            r["flat"] = _median_time(flat_way, runs) * nbytes / flat
            del fa, fb
            results.append(r)
    if other is not None:
        other.send(("end",))
    done_q.put(True)
    out_q.put((results, fused is not None, reps))


def _gbps(nbytes, t):
    return nbytes / 1e9 / t if t else float("nan")


def _kv_gpu(sock, torch, devs, layers, runs, alloc, gpxd=None, metrics=None):
    free = min(torch.cuda.mem_get_info(d)[0] for d in set(devs))
    nblocks, sizes = _kv_sizes(torch, devs, free, layers)
    ctx = multiprocessing.get_context("spawn")
    import torch.multiprocessing as tmp
    tctx = tmp.get_context("spawn")
    conn_q, done_q, out_q = tctx.Queue(), ctx.Queue(), ctx.Queue()
    prefix = f"bench.kv.{os.getpid()}"
    # Within one GPU, a third process with the fused kernel over tensors of its own: what a
    # copier in a context other than the program's pays, for the sizes up to 1,024 blocks.
    other_n = max([n for n in sizes if n <= 1024], default=0) if devs[0] == devs[1] and os.path.exists(FATBIN) else 0
    mine, theirs = ctx.Pipe() if other_n else (None, None)
    procs = [tctx.Process(target=_kv_prefill, args=(sock, devs, nblocks, layers, prefix, alloc, conn_q, done_q)),
             tctx.Process(target=_kv_decode, args=(sock, devs, nblocks, layers, prefix, sizes, runs, alloc, gpxd,
                                                   metrics, conn_q, done_q, out_q, mine, other_n))]
    if other_n:
        procs.append(ctx.Process(target=_kv_other, args=(devs[0], layers, other_n, theirs)))
    for p in procs:
        p.start()
    results, have_fused, reps = _result(out_q, procs)
    _join(procs)
    _kv_print(results, have_fused, reps, devs, layers, nblocks, alloc, runs)
    return results


def _kv_print(results, have_fused, reps, devs, layers, nblocks, alloc, runs):
    mps = any(r["mps"] for r in results)
    print(f"kv: {layers} layers x K and V [{nblocks}, 16, 8, 128] bf16, 32 KiB blocks, "
          f"GPU{devs[0]} (prefill) -> GPU{devs[1]} (decode), {ALLOC_NAMES[alloc]}, median of {runs}, "
          f"{'UNDER CUDA MPS' if mps else 'not under MPS'}")
    base = "fused" if have_fused else "index"
    if not have_fused:
        print("  (no fused kernel: the package was built without the CUDA toolkit; PyTorch's "
              "index_select / index_copy_ is the baseline)")
    for r in results:
        n, nb = r["n"], r["bytes"]
        ratio = r[base] / r["gpx"]
        print(f"  {n:5d} blocks x {2 * layers} tensors ({nb >> 20} MiB), back to back: {base} "
              f"{_gbps(nb, r[base]):7.1f} GB/s, gpx {_gbps(nb, r['gpx']):7.1f} GB/s, {ratio:.2f}x   "
              f"{_verdict('kv.back_to_back', ratio) if have_fused else ''}")
        print(f"        index_select/index_copy_ {_gbps(nb, r['index']):7.1f} GB/s, flat copy_ of the same bytes "
              f"{_gbps(nb, r['flat']):7.1f} GB/s (gpx/flat {r['flat'] / r['gpx']:.2f}x)"
              + (f", gpxd {r['gpx_cpu']:.2f} cores busy {_verdict('cpu.busy_cores', r['gpx_cpu'])}"
                 if r.get("gpx_cpu") is not None else ""))
        if r["stages"]:
            print("        gpxd per transfer: " + "; ".join(r["stages"]))
        print(f"        of the client's side: copy_pages_batch until it returns {r['submit'] * 1e6:.1f} us"
              + (f" (the fused kernel's launch until it returns {r['launch'] * 1e6:.1f} us)" if "launch" in r else ""))
        a = r["after"]
        if "fused" in a:
            ra = a["fused"] / a["gpx"]
            print(f"        each after {reps} matmuls (~1 ms): fused {_gbps(nb, a['fused']):7.1f} GB/s, gpx "
                  f"{_gbps(nb, a['gpx']):7.1f} GB/s, {ra:.2f}x   {_verdict('kv.after_work', ra)}")
        else:
            print(f"        each after {reps} matmuls (~1 ms): gpx {_gbps(nb, a['gpx']):7.1f} GB/s")
        if r.get("stages_after"):
            print("        gpxd per transfer after the matmuls: " + "; ".join(r["stages_after"]))
        if "other" in r:
            ob, oa = r["other"], r["other_after"]
            print(f"        a second process's own fused kernel (its own CUDA context and {2 * layers} tensors; a pipe "
                  f"round trip per launch): back to back {_gbps(nb, ob):7.1f} GB/s, after the matmuls "
                  f"{_gbps(nb, oa):7.1f} GB/s ({ob / oa:.2f}x of its back to back"
                  + (f", {a['fused'] / oa:.2f}x of the program's fused kernel after them" if "fused" in a else "")
                  + f"; gpx after them {r['gpx'] / a['gpx']:.2f}x of its back to back)")
        if "step_gpx" in r:
            tid = "kv.concurrent_mps" if mps else "kv.concurrent"
            line = f"        while matmuls run{' (MPS)' if mps else ''}: matmul step alone {r['step_alone'] * 1e6:.1f} us; "
            # No copy that ended while the products ran: nothing moved beside them (0 GB/s).
            gx = (f"gpx {_gbps(nb, r['load_gpx']):7.1f} GB/s" if r["load_gpx"] else
                  "gpx       0 GB/s (none of its copies ended while they ran)")
            if "step_fused" in r:
                rl = (r["load_fused"] / r["load_gpx"] if r["load_fused"] and r["load_gpx"] else
                      0.0 if r["load_fused"] else float("nan"))
                rs = r["step_gpx"] / r["step_fused"]
                line += (f"fused (2nd stream) {_gbps(nb, r['load_fused']):7.1f} GB/s, step {r['step_fused'] * 1e6:.1f} us; "
                         f"{gx}, step {r['step_gpx'] * 1e6:.1f} us; "
                         f"{rl:.2f}x   {_verdict(tid, rl)}; step {rs:.2f}x   {_verdict('kv.concurrent_step', rs)}")
            else:
                line += f"{gx}, step {r['step_gpx'] * 1e6:.1f} us"
            print(line)
            if "step_other" in r:
                lo = r["load_other"]
                print("        meanwhile a second process's own fused kernel (its own context): "
                      + (f"{_gbps(nb, lo):7.1f} GB/s" if lo else "0 GB/s (none of its copies ended while they ran)")
                      + f", step {r['step_other'] * 1e6:.1f} us"
                      + (f"; {r['load_fused'] / lo:.2f}x of the fused kernel on a 2nd stream" if lo and r.get("load_fused")
                         else ""))
    print(f"  {base}: {'ONE launch of the program' + chr(39) + 's gather-scatter kernel over all tensors' if have_fused else 'PyTorch'}"
          "; gpx: one copy_pages_batch; every way verified block by block before it is timed")


# host memory: the same shapes, smaller, numpy views of HostBuffers

def _kv_host_prefill(sock, nblocks, layers, prefix, q, done):
    import numpy as np
    bufs = [gpx.host_alloc(nblocks * BLOCK_BYTES) for _ in range(2 * layers)]
    rng = np.random.default_rng(7)
    with gpx.connect(sock, name="bench-kv-prefill") as c:
        for i, b in enumerate(bufs):
            np.frombuffer(b, dtype=np.uint8)[:] = rng.integers(0, 256, len(b), dtype=np.uint8)
            c.export(c.register(b, read_only=True), f"{prefix}.{i}")
        q.put([(os.getpid(), b.fd) for b in bufs])
        done.get()


def _kv_host(sock, layers, runs):
    import mmap
    import numpy as np
    nblocks, n = 512, 256
    prefix = f"bench.kv.{os.getpid()}"
    ctx = multiprocessing.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    procs = _spawn([(_kv_host_prefill, (sock, nblocks, layers, prefix, q, done))])
    where = _result(q, procs)
    # PyTorch's way has no host twin here: numpy gathers and scatters through the shared memory.
    src = []
    for pid, fd in where:
        with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
            m = mmap.mmap(f.fileno(), nblocks * BLOCK_BYTES, prot=mmap.PROT_READ)
        src.append(np.frombuffer(m, dtype=np.uint8).reshape(nblocks, BLOCK_BYTES))
    bufs = [gpx.host_alloc(nblocks * BLOCK_BYTES) for _ in range(2 * layers)]
    dst = [np.frombuffer(b, dtype=np.uint8).reshape(nblocks, BLOCK_BYTES) for b in bufs]
    rng = np.random.default_rng(3)
    sp = rng.permutation(nblocks)[:n].astype(np.uint32)
    dp = rng.permutation(nblocks)[:n].astype(np.uint32)
    with gpx.connect(sock, name="bench-kv-decode") as c:
        pairs = list(zip([c.import_(f"{prefix}.{i}") for i in range(2 * layers)], [c.register(b) for b in bufs]))

        def numpy_way():
            for a, b in zip(src, dst):
                b[dp] = a[sp]

        batch = c.batch(pairs, pages=True)

        def gpx_way():
            c.copy_pages_batch(batch, BLOCK_BYTES, sp, dp).wait()

        for way in (numpy_way, gpx_way):
            for b in dst:
                b[:] = 0
            way()
            if any(not np.array_equal(b[dp], a[sp]) for a, b in zip(src, dst)):
                raise SystemExit("gpx.bench kv: a block is not what its source holds")
        t_np, t_gpx = _median_time(numpy_way, runs), _median_time(gpx_way, runs)
    done.put(True)
    _join(procs)
    nbytes = 2 * layers * n * BLOCK_BYTES
    print(f"kv (host memory, no GPU: a test of function): {layers} layers x K and V, {nblocks} blocks "
          "of 32 KiB, two processes")
    _row(f"{n} blocks x {2 * layers} tensors ({nbytes >> 20} MiB)", "numpy", nbytes / 1e9 / t_np,
         nbytes / 1e9 / t_gpx, "GB/s")
    print("  numpy: gather / scatter through the shared memory; gpx: one copy_pages_batch; verified")


def kv(sock, args):
    torch, ngpu = _torch_gpus()
    runs = args.runs
    if ngpu == 0 or args.host:
        return _kv_host(sock, 4, runs)
    layers = 32
    args.gpu_ran = True
    gpxd, metrics = getattr(args, "gpxd_pid", None), getattr(args, "metrics", None)
    _kv_gpu(sock, torch, (0, 0), layers, runs, args.alloc, gpxd, metrics)
    if ngpu >= 2:
        try:
            _kv_gpu(sock, torch, (0, 1), layers, runs, args.alloc, gpxd, metrics)
        except SystemExit as e:
            print(f"kv GPU0 -> GPU1: not measured: {e}")


# ---------------------------------------------------------------------------------------------
# weights

def _build_params(torch, dev):
    """A Qwen2-1.5B-shaped model's parameters on dev: built with transformers when it is there."""
    try:
        import transformers
        cfg = transformers.Qwen2Config(**QWEN2_1_5B)
        with torch.device(dev):
            try:
                model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            except TypeError:
                model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        return [p.data for p in model.parameters()], "transformers Qwen2 (1.5 B, random weights)"
    except ImportError:
        pass
    h, f, L, v = 1536, 8960, 28, 151936
    kvh = 2 * 128
    shapes = [(v, h)]
    for _ in range(L):
        shapes += [(h, h), (h,), (kvh, h), (kvh,), (kvh, h), (kvh,), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    shapes.append((h,))
    return [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes], "Qwen2-1.5B shapes"


def _weights_trainer(sock, devs, prefix, nccl, alloc, q, done):
    torch, where = _gpu_child(alloc, devs[0])
    with where:
        params, _ = _build_params(torch, f"cuda:{devs[0]}")
    # Finite values, as weights are: random bits would hold NaNs, whose bits a value copy such
    # as torch._foreach_copy_ may change (it did, for 0.3% of the bytes), failing the check.
    for p in params:
        p.normal_()
    torch.cuda.synchronize()
    with gpx.connect(sock, name="bench-trainer") as c:
        for i, p in enumerate(params):
            c.export(c.register(p, read_only=True), f"{prefix}.{i}")
        q.put(params)
        if nccl:
            import torch.distributed as dist
            dist.init_process_group("nccl", init_method=nccl, rank=0, world_size=2)
            while done.get() == "nccl":
                for p in params:
                    dist.broadcast(p, src=0)
                torch.cuda.synchronize()
            dist.destroy_process_group()
        else:
            done.get()


def _weights_inference(sock, devs, prefix, nccl, runs, alloc, gpxd, metrics, q, done, out_q):
    torch, where = _gpu_child(alloc, devs[1])
    from gpx import bench
    dev = f"cuda:{devs[1]}"
    src = q.get()
    with where:
        dst, model = _build_params(torch, dev)
    nbytes = sum(p.numel() * p.element_size() for p in dst)
    res = {"tensors": len(dst), "bytes": nbytes, "model": model}
    with gpx.connect(sock, name="bench-inference") as c:
        pairs = list(zip([c.import_(f"{prefix}.{i}") for i in range(len(dst))], [c.register(p) for p in dst]))
        small = [(a, b, 256) for a, b in pairs]
        # The pairs parsed once, as a program that pushes the same tensors each time would.
        batch, small_batch = c.batch(pairs), c.batch(small)

        def check(what):
            # (as bytes: random bits hold NaNs, which equal nothing as bf16 values)
            for i, (a, b) in enumerate(zip(src, dst)):
                got, want = b.view(torch.uint8), a.to(dev).view(torch.uint8)
                if not torch.equal(got, want):
                    raise SystemExit(f"gpx.bench weights: {what}: tensor {i} {tuple(a.shape)} is not what the "
                                     f"trainer holds ({int((got != want).sum())} of {got.numel()} bytes differ, "
                                     f"{'all zero' if not bool(got.any()) else 'not zero'})")

        def ipc_way():
            for a, b in zip(src, dst):
                b.copy_(a, non_blocking=True)
            torch.cuda.synchronize(dev)

        def ipc_small():
            for a, b in zip(src, dst):
                b.view(-1)[:128].copy_(a.view(-1)[:128], non_blocking=True)
            torch.cuda.synchronize(dev)

        def foreach_way():
            torch._foreach_copy_(dst, src, non_blocking=True)
            torch.cuda.synchronize(dev)

        src_heads = [a.view(-1)[:128] for a in src]
        dst_heads = [b.view(-1)[:128] for b in dst]

        def foreach_small():
            torch._foreach_copy_(dst_heads, src_heads, non_blocking=True)
            torch.cuda.synchronize(dev)

        def gpx_way():
            c.copy_batch(batch).wait()

        def gpx_small():
            c.copy_batch(small_batch).wait()

        for name, way in (("CUDA IPC + copy_", ipc_way), ("torch._foreach_copy_", foreach_way), ("gpx", gpx_way)):
            for p in dst:
                p.zero_()
            torch.cuda.synchronize(dev)      # (gpxd's copies are not ordered with our streams)
            way()
            check(name)
        res["ipc"] = _median_time(ipc_way, runs)
        res["foreach"] = _median_time(foreach_way, runs)
        before = bench.scrape(metrics)
        cpu = bench.CpuMeter(gpxd) if gpxd else None
        if cpu:
            cpu.start()
        res["gpx"] = _median_time(gpx_way, runs)
        res["gpx_cpu"] = cpu.stop() if cpu else None
        res["stages"] = bench.stage_lines(before, bench.scrape(metrics), res["gpx"])
        res["ipc_small"] = _median_time(ipc_small, runs)
        res["foreach_small"] = _median_time(foreach_small, runs)
        before = bench.scrape(metrics)
        res["gpx_small"] = _median_time(gpx_small, runs * 20)
        res["stages_small"] = bench.stage_lines(before, bench.scrape(metrics), res["gpx_small"])
        res["submit_small"] = _submit_time(lambda: c.copy_batch(small_batch), runs * 20)
        res["submit_tuples"] = _submit_time(lambda: c.copy_batch(small), runs * 20)
        # One flat copy of the same bytes: what a perfect update would take.
        fa = torch.empty(nbytes, dtype=torch.uint8, device=src[0].device)
        fb = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def flat_way():
            fb.copy_(fa, non_blocking=True)
            torch.cuda.synchronize(dev)
        res["flat"] = _median_time(flat_way, runs)
        del fa, fb
        if nccl:
            import torch.distributed as dist
            dist.init_process_group("nccl", init_method=nccl, rank=1, world_size=2)

            def nccl_way():
                done.put("nccl")
                for p in dst:
                    dist.broadcast(p, src=0)
                torch.cuda.synchronize(dev)
            for p in dst:
                p.zero_()
            torch.cuda.synchronize(dev)
            nccl_way()
            check("NCCL broadcast")
            res["nccl"] = _median_time(nccl_way, runs)
            done.put("stop")
            dist.destroy_process_group()
        else:
            done.put("stop")
    out_q.put(res)


def _weights_gpu(sock, devs, runs, alloc, gpxd=None, metrics=None):
    import torch.multiprocessing as tmp
    tctx = tmp.get_context("spawn")
    q, done, out_q = tctx.Queue(), tctx.Queue(), tctx.Queue()
    nccl = f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}" if devs[0] != devs[1] else None
    prefix = f"bench.w.{os.getpid()}"
    procs = [tctx.Process(target=_weights_trainer, args=(sock, devs, prefix, nccl, alloc, q, done)),
             tctx.Process(target=_weights_inference, args=(sock, devs, prefix, nccl, runs, alloc, gpxd, metrics, q,
                                                           done, out_q))]
    for p in procs:
        p.start()
    r = _result(out_q, procs)
    _join(procs)
    _weights_print(r, devs, runs, alloc)
    return r


def _weights_print(r, devs, runs, alloc):
    gb = r["bytes"] / 1e9
    print(f"weights: {r['model']}: {r['tensors']} tensors, {r['bytes'] / 2**30:.2f} GiB, trainer GPU{devs[0]} -> "
          f"inference GPU{devs[1]}, {ALLOC_NAMES[alloc]}, median of {runs}")
    best = min(t for k, t in r.items() if k in ("ipc", "nccl", "foreach"))
    if "nccl" in r:
        _row("full update, NCCL broadcast per tensor", "NCCL", gb / r["nccl"], gb / r["gpx"], "GB/s")
    _row("full update, CUDA IPC + copy_ per tensor", "IPC", gb / r["ipc"], gb / r["gpx"], "GB/s")
    _row("full update, torch._foreach_copy_", "foreach", gb / r["foreach"], gb / r["gpx"], "GB/s")
    ratio = r["flat"] / r["gpx"]
    _row("full update, one flat copy_ of the same bytes", "flat", gb / r["flat"], gb / r["gpx"], "GB/s",
         "   " + _verdict("weights.flat", ratio))
    print(f"  time per update: gpx {r['gpx'] * 1e3:.2f} ms, fastest PyTorch way {best * 1e3:.2f} ms "
          f"({best / r['gpx']:.2f}x), one flat copy {r['flat'] * 1e3:.2f} ms"
          + (f"; gpxd {r['gpx_cpu']:.2f} cores busy {_verdict('cpu.busy_cores', r['gpx_cpu'])}"
             if r.get("gpx_cpu") is not None else ""))
    print(f"  fixed cost per update ({r['tensors']} tensors, 256 bytes each): gpx {r['gpx_small'] * 1e6:.0f} us, "
          f"IPC + copy_ {r['ipc_small'] * 1e6:.0f} us, _foreach_copy_ {r['foreach_small'] * 1e6:.0f} us   "
          f"{_verdict('weights.fixed_us', r['gpx_small'] * 1e6)}")
    if r["stages"]:
        print("  gpxd per transfer (full update): " + "; ".join(r["stages"]))
    if r["stages_small"]:
        print("  gpxd per transfer (fixed cost): " + "; ".join(r["stages_small"]))
    print(f"  of the client's side of the fixed cost: copy_batch until it returns {r['submit_small'] * 1e6:.1f} us "
          f"(of a Batch; of the list of tuples, parsed each time: {r['submit_tuples'] * 1e6:.1f} us)")


def _weights_host(sock, runs, metrics=None):
    import numpy as np
    from gpx import bench
    sizes = [4096 * (1 + i % 7) for i in range(300)]
    srcs = [gpx.host_alloc(s) for s in sizes]
    dsts = [gpx.host_alloc(s) for s in sizes]
    rng = np.random.default_rng(5)
    for b in srcs:
        np.frombuffer(b, dtype=np.uint8)[:] = rng.integers(0, 256, len(b), dtype=np.uint8)
    prefix = f"bench.w.{os.getpid()}"
    with gpx.connect(sock, name="bench-trainer") as a, gpx.connect(sock, name="bench-inference") as b:
        for i, s in enumerate(srcs):
            a.export(a.register(s, read_only=True), f"{prefix}.{i}")
        pairs = [(b.import_(f"{prefix}.{i}"), b.register(d)) for i, d in enumerate(dsts)]
        batch = b.batch(pairs)

        def gpx_way():
            b.copy_batch(batch).wait()

        def numpy_way():
            for s, d in zip(srcs, dsts):
                np.frombuffer(d, dtype=np.uint8)[:] = np.frombuffer(s, dtype=np.uint8)

        for way in (numpy_way, gpx_way):
            for d in dsts:
                np.frombuffer(d, dtype=np.uint8)[:] = 0
            way()
            if any(bytes(s) != bytes(d) for s, d in zip(srcs, dsts)):
                raise SystemExit("gpx.bench weights: a tensor is not what the trainer holds")
        t_np, t_gpx = _median_time(numpy_way, runs), _median_time(gpx_way, runs)
        # The fixed cost of an update, as on a GPU: 256 bytes of each tensor, with gpxd's stages.
        small = [(s, d, 256) for s, d in pairs]
        small_batch = b.batch(small)

        def gpx_small():
            b.copy_batch(small_batch).wait()

        def numpy_small():
            for s, d in zip(srcs, dsts):
                np.frombuffer(d, dtype=np.uint8)[:256] = np.frombuffer(s, dtype=np.uint8)[:256]
        t_np_small = _median_time(numpy_small, runs * 20)
        before = bench.scrape(metrics)
        t_gpx_small = _median_time(gpx_small, runs * 20)
        stages = bench.stage_lines(before, bench.scrape(metrics), t_gpx_small)
        t_submit = _submit_time(lambda: b.copy_batch(small_batch), runs * 20)
        t_tuples = _submit_time(lambda: b.copy_batch(small), runs * 20)
    nbytes = sum(sizes)
    print(f"weights (host memory, no GPU: a test of function): {len(sizes)} tensors, {nbytes >> 10} KiB")
    _row("full update", "numpy", nbytes / 1e9 / t_np, nbytes / 1e9 / t_gpx, "GB/s",
         f"   gpx {t_gpx * 1e6:.0f} us per update")
    print(f"  fixed cost per update ({len(sizes)} tensors, 256 bytes each): gpx {t_gpx_small * 1e6:.1f} us, "
          f"numpy {t_np_small * 1e6:.1f} us (median of {runs * 20})")
    if stages:
        print("  gpxd per transfer (fixed cost): " + "; ".join(stages))
    print(f"  of the client's side of the fixed cost: copy_batch until it returns {t_submit * 1e6:.1f} us "
          f"(of a Batch; of the list of tuples, parsed each time: {t_tuples * 1e6:.1f} us)")


def weights(sock, args):
    torch, ngpu = _torch_gpus()
    if ngpu == 0 or args.host:
        return _weights_host(sock, args.runs, getattr(args, "metrics", None))
    args.gpu_ran = True
    gpxd, metrics = getattr(args, "gpxd_pid", None), getattr(args, "metrics", None)
    _weights_gpu(sock, (0, 0), args.runs, args.alloc, gpxd, metrics)
    if ngpu >= 2:
        try:
            _weights_gpu(sock, (0, 1), args.runs, args.alloc, gpxd, metrics)
        except SystemExit as e:
            print(f"weights GPU0 -> GPU1: not measured: {e}")


# ---------------------------------------------------------------------------------------------
# pages

def _pages_owner(sock, devs, cache_bytes, prefix, alloc, q, done):
    torch, where = _gpu_child(alloc, devs[0])
    with where:
        t = torch.empty(cache_bytes, dtype=torch.uint8, device=f"cuda:{devs[0]}")
    t.view(torch.int16).random_(-32768, 32767)
    with gpx.connect(sock, name="bench-pages-owner") as c:
        c.export(c.register(t, read_only=True), prefix)
        torch.cuda.synchronize()
        q.put(t)
        done.get()


def _pages_user(sock, devs, cache_bytes, prefix, runs, alloc, q, done, out_q):
    torch, where = _gpu_child(alloc, devs[1])
    dev = f"cuda:{devs[1]}"
    src = q.get()
    with where:
        dst = torch.zeros(cache_bytes, dtype=torch.uint8, device=dev)
    work = torch.empty((4096, 4096), dtype=torch.bfloat16, device=dev)
    rows = []
    with gpx.connect(sock, name="bench-pages") as c:
        theirs, mine = c.import_(prefix), c.register(dst)
        # ~1 ms of the program's own GPU work: matrix products, sized here.
        reps = 1
        while True:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(work, work)
            torch.cuda.synchronize(dev)
            if time.perf_counter() - t0 > 1e-3 or reps > 4096:
                break
            reps *= 2

        def own_work():
            for _ in range(reps):
                torch.mm(work, work)
            torch.cuda.synchronize(dev)

        g = torch.Generator().manual_seed(2)
        for page, n in ((4096, 65536), (32768, 8192)):
            slots = cache_bytes // page
            sp = torch.randperm(slots, generator=g)[:n].to(torch.int32)
            dp = torch.randperm(slots, generator=g)[:n].to(torch.int32)
            s_idx, d_idx = sp.long().to(src.device), dp.long().to(dev)
            sv, dv = src.view(slots, page), dst.view(slots, page)

            def torch_way():
                dv.index_copy_(0, d_idx, sv.index_select(0, s_idx).to(dev, non_blocking=True))
                torch.cuda.synchronize(src.device)
                torch.cuda.synchronize(dev)

            def gpx_way():
                c.copy_pages(theirs, mine, page, sp, dp).wait()

            # the same page numbers in this process's GPU memory, as its block table
            table = torch.stack((sp, dp)).to(dev)
            torch.cuda.synchronize(dev)
            rt = c.register(table)

            def gpx_table():
                c.copy_pages_table(theirs, mine, page, rt, n).wait()

            for way in (torch_way, gpx_way, gpx_table):
                dst.zero_()
                torch.cuda.synchronize(dev)  # (gpxd's copies are not ordered with our streams)
                way()
                if not torch.equal(dv.index_select(0, d_idx), sv.index_select(0, s_idx).to(dev)):
                    raise SystemExit("gpx.bench pages: a page is not what its source holds")
            t_torch, t_gpx, t_table = (_median_time(torch_way, runs), _median_time(gpx_way, runs),
                                       _median_time(gpx_table, runs))
            after = []
            for _ in range(runs):
                own_work()
                t0 = time.perf_counter()
                gpx_way()
                after.append(time.perf_counter() - t0)
            rows.append((page, n, t_torch, t_gpx, statistics.median(after), t_table))
            rt.deregister()

        def torch_flat():
            dst.copy_(src)
            torch.cuda.synchronize(dev)

        def gpx_flat():
            c.copy(theirs, mine).wait()
        for way in (torch_flat, gpx_flat):
            dst.zero_()
            torch.cuda.synchronize(dev)
            way()
            if not torch.equal(dst, src.to(dev)):
                raise SystemExit("gpx.bench pages: the flat copy is not what its source holds")
        rows.append(("flat", 1, _median_time(torch_flat, runs), _median_time(gpx_flat, runs), None, None))
    done.put(True)
    out_q.put((rows, reps))


def _pages_gpu(sock, devs, runs, alloc):
    import torch.multiprocessing as tmp
    tctx = tmp.get_context("spawn")
    q, done, out_q = tctx.Queue(), tctx.Queue(), tctx.Queue()
    cache = 256 << 20
    prefix = f"bench.pages.{os.getpid()}"
    procs = [tctx.Process(target=_pages_owner, args=(sock, devs, cache, prefix, alloc, q, done)),
             tctx.Process(target=_pages_user, args=(sock, devs, cache, prefix, runs, alloc, q, done, out_q))]
    for p in procs:
        p.start()
    rows, reps = _result(out_q, procs)
    _join(procs)
    print(f"pages: one 256 MiB cache, GPU{devs[0]} -> GPU{devs[1]}, two processes, {ALLOC_NAMES[alloc]}, "
          f"median of {runs}")
    for page, n, t_torch, t_gpx, t_after, t_table in rows:
        nbytes = cache if page == "flat" else page * n
        gb = nbytes / 1e9
        if page == "flat":
            _row("flat 256 MiB", "copy_", gb / t_torch, gb / t_gpx, "GB/s")
            continue
        _row(f"{n} x {page >> 10} KiB, back to back", "PyTorch", gb / t_torch, gb / t_gpx, "GB/s")
        _row(f"{n} x {page >> 10} KiB, numbers in GPU memory", "PyTorch", gb / t_torch, gb / t_table, "GB/s")
        _row(f"{n} x {page >> 10} KiB, each after 1 ms of GPU work", "back2back", gb / t_gpx, gb / t_after, "GB/s")
    print("  PyTorch: CUDA IPC share, index_select, copy, index_copy_; gpx: one copy_pages (the page numbers "
          "in GPU memory: one copy_pages_table of a (2, n) int32 CUDA tensor); "
          "the second row of each compares gpx after the program's own GPU work with gpx back to back")


def pages(sock, args):
    torch, ngpu = _torch_gpus()
    if ngpu == 0:
        print("pages: no GPU here (the page workload is a GPU figure); see kv for host memory")
        return
    if ngpu >= 2:
        _pages_gpu(sock, (0, 1), args.runs, args.alloc)
    _pages_gpu(sock, (0, 0), args.runs, args.alloc)


# ---------------------------------------------------------------------------------------------
# small

SMALL = 4096


def _gpx_rate(c, rs, rd, n, depth, slots):
    """n copies of 4 KiB through gpx with up to depth in flight, each to its own offset: copies
    a second (every completion checked for its status)."""
    copy, wait = c.copy, c.wait
    t0 = time.perf_counter()
    for i in range(n):
        if c.outstanding >= depth:
            for d in wait(max=depth):
                if d.status != 0:
                    raise SystemExit(f"gpx.bench small: a copy failed: {d}")
        off = (i % slots) * SMALL
        copy(rs, rd, SMALL, src_offset=off, dst_offset=off)
    while c.outstanding:
        for d in wait(max=depth):
            if d.status != 0:
                raise SystemExit(f"gpx.bench small: a copy failed: {d}")
    return n / (time.perf_counter() - t0)


def _p50(fn, n):
    lat = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        lat.append(clock() - t0)
    return statistics.median(lat)


def small(sock, args):
    """20,000 copies of 4 KiB with 64 in flight from Python, and one 4 KiB copy + wait, on GPU 0
    (two tensors of the program): gpx against a torch copy_ loop, torch copy_ + synchronize and
    cuMemcpyAsync + cuStreamSynchronize through ctypes."""
    if args.alloc == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"    # before torch starts
    torch, ngpu = _torch_gpus()
    n, depth = 20000, 64
    slots = 4096                            # 16 MiB of distinct 4 KiB places
    runs = max(args.runs, 3)
    from gpx import bench
    if ngpu == 0 or args.host:
        src, dst = gpx.host_alloc(slots * SMALL), gpx.host_alloc(slots * SMALL)
        memoryview(src)[:] = os.urandom(len(src))
        with gpx.connect(sock, name="bench-small") as c:
            rs, rd = c.register(src, read_only=True), c.register(dst)
            rate = statistics.median(_gpx_rate(c, rs, rd, slots, depth, slots) for _ in range(runs))
            if bytes(dst) != bytes(src):
                raise SystemExit("gpx.bench small: the copies are not what their source holds")
            before = bench.scrape(getattr(args, "metrics", None))
            p50 = _p50(lambda: c.copy(rs, rd, SMALL).wait(), 1000)
            stages = bench.stage_lines(before, bench.scrape(getattr(args, "metrics", None)), p50)
        print("small (host memory, no GPU: a test of function): gpx "
              f"{rate:,.0f} copies of 4 KiB a second ({rate * SMALL / 1e9:.2f} GB/s) with {depth} in flight, "
              f"copy + wait p50 {p50 * 1e6:.1f} us; every byte verified")
        if stages:
            print("        gpxd per transfer: " + "; ".join(stages))
        return
    args.gpu_ran = True
    torch.cuda.set_device(0)
    dev = "cuda:0"
    s = torch.randint(0, 256, (slots * SMALL,), dtype=torch.uint8, device=dev)
    d = torch.zeros_like(s)
    sv, dv = s.view(slots, SMALL), d.view(slots, SMALL)
    sl, dl = [sv[i] for i in range(slots)], [dv[i] for i in range(slots)]
    torch.cuda.synchronize()
    drv = _Driver()
    stream = torch.cuda.Stream(dev)
    raw = stream.cuda_stream

    def torch_loop():
        for i in range(n):
            dl[i % slots].copy_(sl[i % slots], non_blocking=True)
        torch.cuda.synchronize(dev)

    def torch_one():
        dl[0].copy_(sl[0], non_blocking=True)
        torch.cuda.synchronize(dev)

    sp, dp = s.data_ptr(), d.data_ptr()

    def driver_one():
        drv.check(drv.lib.cuMemcpyAsync(dp, sp, SMALL, raw), "cuMemcpyAsync")
        drv.check(drv.lib.cuStreamSynchronize(raw), "cuStreamSynchronize")

    cpu = bench.CpuMeter(args.gpxd_pid) if getattr(args, "gpxd_pid", None) else None
    metrics = getattr(args, "metrics", None)
    with gpx.connect(sock, name="bench-small") as c:
        rs, rd = c.register(s, read_only=True), c.register(d)
        _gpx_rate(c, rs, rd, n, depth, slots)
        if not torch.equal(d, s):
            raise SystemExit("gpx.bench small: the copies are not what their source holds")
        t_loop = [0.0] * runs
        rates = []
        before = bench.scrape(metrics)
        if cpu:
            cpu.start()
        for r in range(runs):
            rates.append(_gpx_rate(c, rs, rd, n, depth, slots))
        busy = cpu.stop() if cpu else None
        stages = bench.stage_lines(before, bench.scrape(metrics))
        torch_loop()
        for r in range(runs):
            t0 = time.perf_counter()
            torch_loop()
            t_loop[r] = time.perf_counter() - t0
        # one at a time, alternating the three ways in rounds (the machine's state drifts)
        one = {"gpx": [], "torch": [], "driver": []}
        gpx_one = lambda: c.copy(rs, rd, SMALL).wait()     # noqa: E731
        for w in (gpx_one, torch_one, driver_one):
            _p50(w, 200)
        before1 = bench.scrape(metrics)
        for _ in range(runs):
            one["gpx"].append(_p50(gpx_one, 1000))
            one["torch"].append(_p50(torch_one, 1000))
            one["driver"].append(_p50(driver_one, 1000))
        p50 = statistics.median(one["gpx"])
        stages1 = bench.stage_lines(before1, bench.scrape(metrics), p50)
    rate = statistics.median(rates)
    torch_rate = n / statistics.median(t_loop)
    p = {k: statistics.median(v) for k, v in one.items()}
    print(f"small: 4 KiB copies within GPU 0, one process, PyTorch tensors ({ALLOC_NAMES[args.alloc]}), "
          f"median of {runs}")
    print(f"  {n:,} copies, {depth} in flight, from Python: gpx {rate:,.0f}/s, torch copy_ loop {torch_rate:,.0f}/s "
          f"({rate / torch_rate:.2f}x)   {_verdict('small.rate_python', rate)}"
          + (f"; gpxd {busy:.2f} cores busy {_verdict('cpu.busy_cores', busy)}" if busy is not None else ""))
    if stages:
        print("        gpxd per transfer: " + "; ".join(stages))
    ratio = p["gpx"] / p["driver"]
    print(f"  4 KiB copy + wait p50: gpx {p['gpx'] * 1e6:.1f} us, torch copy_ + synchronize {p['torch'] * 1e6:.1f} us, "
          f"cuMemcpyAsync + cuStreamSynchronize (ctypes) {p['driver'] * 1e6:.1f} us; gpx/driver {ratio:.2f}   "
          f"{_verdict('small.p50', ratio)}")
    if stages1:
        print("        gpxd per transfer: " + "; ".join(stages1))
