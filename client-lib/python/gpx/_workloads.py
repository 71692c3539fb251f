"""The workloads of ``python3 -m gpx.bench``: kv, weights and pages.

Each runs what a PyTorch program does, two processes as in production, once through
PyTorch's own means and once through gpxd, from one run, and checks every result against the
source bytes before it is counted.

kv       a prefill process and a decode process, a vLLM-shaped paged cache: per layer a K and a
         V tensor ``[num_blocks, 16, 8, 128]`` bf16 (32 KiB a block).  A batch of requests'
         blocks moves from prefill block numbers to other decode block numbers.  PyTorch's way:
         the prefill tensors shared with torch.multiprocessing, then per tensor a gather on the
         source GPU, a copy to the destination and a scatter there.  gpx's way: one
         copy_pages_batch of every tensor pair.  Also a flat copy of the same bytes, the
         bandwidth a perfect handoff would reach.
weights  a trainer process pushes a whole model's weights into an inference process.  The
         model is built with transformers from a Qwen2-1.5B-shaped config (random weights,
         nothing downloaded), or, without transformers, the same list of shapes.  PyTorch's
         ways: NCCL broadcast tensor by tensor (two GPUs), and CUDA IPC plus copy_ per tensor.
         gpx: one copy_batch of every tensor.  Also the fixed cost of an update: the same
         tensors, 256 bytes of each.
pages    the scattered pages of one 256 MiB cache: 65,536 x 4 KiB and 8,192 x 32 KiB, back to
         back and each after 1 ms of the decode process's own GPU work, against PyTorch's
         gather / copy / scatter; and a flat 256 MiB copy against torch's copy_.

Without a GPU (or without torch) kv and weights run the same shapes, smaller, in host memory
(HostBuffers viewed through numpy, the baseline a numpy gather / scatter through the shared
memory), so that CI runs them as a test of function, not of speed.
"""

import multiprocessing
import os
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
    for top in (16384, 8192, 4096, 2048, 1024):
        need = per_block * (top + 256) * (2 if shared else 1) + 2 * per_block * top
        if need < budget:
            return top + 256, [n for n in (1024, 4096, 16384) if n <= top]
    return 1024 + 256, [1024]


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


def _kv_decode(sock, devs, nblocks, layers, prefix, sizes, runs, alloc, conn_q, done_q, out_q):
    torch, where = _gpu_child(alloc, devs[1])
    dev = f"cuda:{devs[1]}"
    src = conn_q.get()
    with where:
        dst = [torch.zeros((nblocks,) + BLOCK_SHAPE, dtype=torch.bfloat16, device=dev) for _ in range(2 * layers)]
    results = []
    with gpx.connect(sock, name="bench-kv-decode") as c:
        theirs = [c.import_(f"{prefix}.{i}") for i in range(2 * layers)]
        mine = [c.register(t) for t in dst]
        pairs = list(zip(theirs, mine))
        g = torch.Generator().manual_seed(1)
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

            def gpx_way():
                c.copy_pages_batch(pairs, BLOCK_BYTES, sp, dp).wait()

            for way in (torch_way, gpx_way):
                for t in dst:
                    t.zero_()
                # gpxd's copies are not ordered with this process's streams: what it does on
                # the GPU must be done before a copy is asked for.
                torch.cuda.synchronize(dev)
                way()
                check(way.__name__)
            t_torch = _median_time(torch_way, runs)
            t_gpx = _median_time(gpx_way, runs)
            # A flat copy of the same bytes (beyond 2 GiB the bandwidth is that of 2 GiB).
            nbytes = 2 * layers * n * BLOCK_BYTES
            flat = min(nbytes, 2 << 30)
            fa = torch.empty(flat, dtype=torch.uint8, device=src[0].device)
            fb = torch.empty(flat, dtype=torch.uint8, device=dev)

            def flat_way():
                fb.copy_(fa)
                torch.cuda.synchronize(dev)
            flat_way()
            t_flat = _median_time(flat_way, runs) * nbytes / flat
            del fa, fb
            results.append((n, nbytes, t_torch, t_gpx, t_flat))
    done_q.put(True)
    out_q.put(results)


def _kv_gpu(sock, torch, devs, layers, runs, alloc):
    free = min(torch.cuda.mem_get_info(d)[0] for d in set(devs))
    nblocks, sizes = _kv_sizes(torch, devs, free, layers)
    ctx = multiprocessing.get_context("spawn")
    import torch.multiprocessing as tmp
    tctx = tmp.get_context("spawn")
    conn_q, done_q, out_q = tctx.Queue(), ctx.Queue(), ctx.Queue()
    prefix = f"bench.kv.{os.getpid()}"
    procs = [tctx.Process(target=_kv_prefill, args=(sock, devs, nblocks, layers, prefix, alloc, conn_q, done_q)),
             tctx.Process(target=_kv_decode, args=(sock, devs, nblocks, layers, prefix, sizes, runs, alloc, conn_q,
                                                   done_q, out_q))]
    for p in procs:
        p.start()
    results = _result(out_q, procs)
    _join(procs)
    print(f"kv: {layers} layers x K and V [{nblocks}, 16, 8, 128] bf16, 32 KiB blocks, "
          f"GPU{devs[0]} (prefill) -> GPU{devs[1]} (decode), {ALLOC_NAMES[alloc]}, median of {runs}")
    for n, nbytes, t_torch, t_gpx, t_flat in results:
        gb = nbytes / 1e9
        _row(f"{n} blocks x {2 * layers} tensors ({nbytes >> 20} MiB)", "PyTorch", gb / t_torch, gb / t_gpx,
             "GB/s", f"   flat copy {gb / t_flat:7.1f} GB/s, gpx/flat {t_flat / t_gpx:.2f}x")
    print("  PyTorch: CUDA IPC share, index_select on the source GPU, copy, index_copy_ per tensor;"
          " gpx: one copy_pages_batch; verified block by block")
    return results


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

        def gpx_way():
            c.copy_pages_batch(pairs, BLOCK_BYTES, sp, dp).wait()

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
    if ngpu >= 2:
        _kv_gpu(sock, torch, (0, 1), layers, runs, args.alloc)
    _kv_gpu(sock, torch, (0, 0), layers, runs, args.alloc)


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
    for p in params:
        p.view(torch.int16).random_(-32768, 32767)
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


def _weights_inference(sock, devs, prefix, nccl, runs, alloc, q, done, out_q):
    torch, where = _gpu_child(alloc, devs[1])
    dev = f"cuda:{devs[1]}"
    src = q.get()
    with where:
        dst, model = _build_params(torch, dev)
    nbytes = sum(p.numel() * p.element_size() for p in dst)
    res = {"tensors": len(dst), "bytes": nbytes, "model": model}
    with gpx.connect(sock, name="bench-inference") as c:
        pairs = list(zip([c.import_(f"{prefix}.{i}") for i in range(len(dst))], [c.register(p) for p in dst]))
        small = [(a, b, 256) for a, b in pairs]

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

        def gpx_way():
            c.copy_batch(pairs).wait()

        def gpx_small():
            c.copy_batch(small).wait()

        for name, way in (("CUDA IPC + copy_", ipc_way), ("gpx", gpx_way)):
            for p in dst:
                p.zero_()
            torch.cuda.synchronize(dev)      # (gpxd's copies are not ordered with our streams)
            way()
            check(name)
        res["ipc"] = _median_time(ipc_way, runs)
        res["gpx"] = _median_time(gpx_way, runs)
        res["ipc_small"] = _median_time(ipc_small, runs)
        res["gpx_small"] = _median_time(gpx_small, runs)
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


def _weights_gpu(sock, devs, runs, alloc):
    import torch.multiprocessing as tmp
    tctx = tmp.get_context("spawn")
    q, done, out_q = tctx.Queue(), tctx.Queue(), tctx.Queue()
    nccl = f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}" if devs[0] != devs[1] else None
    prefix = f"bench.w.{os.getpid()}"
    procs = [tctx.Process(target=_weights_trainer, args=(sock, devs, prefix, nccl, alloc, q, done)),
             tctx.Process(target=_weights_inference, args=(sock, devs, prefix, nccl, runs, alloc, q, done, out_q))]
    for p in procs:
        p.start()
    r = _result(out_q, procs)
    _join(procs)
    gb = r["bytes"] / 1e9
    print(f"weights: {r['model']}: {r['tensors']} tensors, {r['bytes'] / 2**30:.2f} GiB, trainer GPU{devs[0]} -> "
          f"inference GPU{devs[1]}, {ALLOC_NAMES[alloc]}, median of {runs}")
    best = min(t for k, t in r.items() if k in ("ipc", "nccl"))
    if "nccl" in r:
        _row("full update, NCCL broadcast per tensor", "NCCL", gb / r["nccl"], gb / r["gpx"], "GB/s")
    _row("full update, CUDA IPC + copy_ per tensor", "IPC", gb / r["ipc"], gb / r["gpx"], "GB/s")
    print(f"  time per update: gpx {r['gpx'] * 1e3:.2f} ms, fastest PyTorch way {best * 1e3:.2f} ms "
          f"({best / r['gpx']:.2f}x)")
    print(f"  fixed cost per update ({r['tensors']} tensors, 256 bytes each): gpx {r['gpx_small'] * 1e6:.0f} us, "
          f"IPC + copy_ {r['ipc_small'] * 1e6:.0f} us")
    return r


def _weights_host(sock, runs):
    import numpy as np
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

        def gpx_way():
            b.copy_batch(pairs).wait()

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
    nbytes = sum(sizes)
    print(f"weights (host memory, no GPU: a test of function): {len(sizes)} tensors, {nbytes >> 10} KiB")
    _row("full update", "numpy", nbytes / 1e9 / t_np, nbytes / 1e9 / t_gpx, "GB/s",
         f"   gpx {t_gpx * 1e6:.0f} us per update")


def weights(sock, args):
    torch, ngpu = _torch_gpus()
    if ngpu == 0 or args.host:
        return _weights_host(sock, args.runs)
    if ngpu >= 2:
        _weights_gpu(sock, (0, 1), args.runs, args.alloc)
    _weights_gpu(sock, (0, 0), args.runs, args.alloc)


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

            for way in (torch_way, gpx_way):
                dst.zero_()
                torch.cuda.synchronize(dev)  # (gpxd's copies are not ordered with our streams)
                way()
                if not torch.equal(dv.index_select(0, d_idx), sv.index_select(0, s_idx).to(dev)):
                    raise SystemExit("gpx.bench pages: a page is not what its source holds")
            t_torch, t_gpx = _median_time(torch_way, runs), _median_time(gpx_way, runs)
            after = []
            for _ in range(runs):
                own_work()
                t0 = time.perf_counter()
                gpx_way()
                after.append(time.perf_counter() - t0)
            rows.append((page, n, t_torch, t_gpx, statistics.median(after)))

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
        rows.append(("flat", 1, _median_time(torch_flat, runs), _median_time(gpx_flat, runs), None))
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
    for page, n, t_torch, t_gpx, t_after in rows:
        nbytes = cache if page == "flat" else page * n
        gb = nbytes / 1e9
        if page == "flat":
            _row("flat 256 MiB", "copy_", gb / t_torch, gb / t_gpx, "GB/s")
            continue
        _row(f"{n} x {page >> 10} KiB, back to back", "PyTorch", gb / t_torch, gb / t_gpx, "GB/s")
        _row(f"{n} x {page >> 10} KiB, each after 1 ms of GPU work", "back2back", gb / t_gpx, gb / t_after, "GB/s")
    print("  PyTorch: CUDA IPC share, index_select, copy, index_copy_; gpx: one copy_pages; "
          "the second row of each compares gpx after the program's own GPU work with gpx back to back")


def pages(sock, args):
    torch, ngpu = _torch_gpus()
    if ngpu == 0:
        print("pages: no GPU here (the page workload is a GPU figure); see kv for host memory")
        return
    if ngpu >= 2:
        _pages_gpu(sock, (0, 1), args.runs, args.alloc)
    _pages_gpu(sock, (0, 0), args.runs, args.alloc)
