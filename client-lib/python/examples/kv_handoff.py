#!/usr/bin/env python3
"""KV-cache handoff between a prefill process and a decode process, through gpxd.

The prefill process holds a paged KV cache, per layer one K and one V tensor of shape
[num_blocks, 16, 8, 128] (bf16: blocks of 16 tokens, 8 KV heads of 128), registers each with
gpxd and exports it under a name.  The decode process imports them and pulls a batch of blocks
by number into its own cache with copy_pages: one request per tensor, each checked whole by
gpxd before any byte moves, then waited for.  Neither process opens the other's memory.

    python3 kv_handoff.py prefill [--name kv] &      # exports kv.L0.K, kv.L0.V, ...
    python3 kv_handoff.py decode  [--name kv]        # pulls blocks, checks every byte
    python3 kv_handoff.py demo                       # both, the prefill as a child process

On a machine with PyTorch and a GPU the caches are CUDA tensors; --host (or no GPU) uses host
memory instead (gpx.host_alloc viewed through numpy), which runs anywhere gpxd does.  With
PyTorch's default caching allocator gpxd must trust legacy CUDA IPC handles (gpxd.conf:
[cuda] trust_legacy_ipc = yes); --alloc pool allocates the caches from gpx.torch_mem_pool()
instead, exportable VMM memory that multi-tenant nodes accept.

Every block's bytes are a function of (layer, K or V, block number), so the decode side checks
what it received without asking the prefill side.
"""
import argparse
import os
import subprocess
import sys
import time

import gpx

TOKENS, HEADS, DIM, ELEM = 16, 8, 128, 2          # a block: 16 tokens x 8 heads x 128, bf16
BLOCK_BYTES = TOKENS * HEADS * DIM * ELEM          # 32 KiB


def use_gpu(args):
    if args.host:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class Cache:
    """num_blocks blocks per layer for K and for V, on the GPU (torch) or in host memory."""

    def __init__(self, args, num_blocks):
        self.gpu = use_gpu(args)
        self.num_blocks = num_blocks
        self.tensors = {}          # (layer, "K"/"V") -> tensor or numpy array
        self.keep = []             # HostBuffers behind the numpy arrays
        pool = None
        if self.gpu and args.alloc == "pool":
            pool = gpx.torch_mem_pool()
        for layer in range(args.layers):
            for kv in "KV":
                self.tensors[layer, kv] = self._alloc(pool)

    def _alloc(self, pool):
        shape = (self.num_blocks, TOKENS, HEADS, DIM)
        if self.gpu:
            import torch
            if pool is not None:
                with torch.cuda.use_mem_pool(pool):
                    return torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
            return torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        import numpy as np
        hb = gpx.host_alloc(self.num_blocks * BLOCK_BYTES)
        self.keep.append(hb)
        return np.frombuffer(hb, dtype=np.uint16).reshape(shape)   # bf16 bits as uint16

    def block_bytes(self, layer, kv, blocks):
        """The bytes of some blocks, as a flat uint8 array or tensor."""
        t = self.tensors[layer, kv][blocks]
        if self.gpu:
            import torch
            return t.contiguous().view(torch.uint8).flatten()
        return t.view("uint8").reshape(-1)


def pattern(gpu, layer, kv, blocks):
    """What blocks of (layer, kv) hold, as uint8: each byte a function of where it is."""
    k = 1 if kv == "V" else 0
    if gpu:
        import torch
        b = torch.as_tensor(blocks, dtype=torch.int64, device="cuda").view(-1, 1)
        i = torch.arange(BLOCK_BYTES, dtype=torch.int64, device="cuda").view(1, -1)
    else:
        import numpy as np
        b = np.asarray(blocks, dtype=np.int64).reshape(-1, 1)
        i = np.arange(BLOCK_BYTES, dtype=np.int64).reshape(1, -1)
    v = (i * 31 + b * 7 + layer * 13 + k * 101 + (i >> 8) * 3) % 251
    return (v.to(torch.uint8) if gpu else v.astype("uint8")).reshape(-1)


def names(args, layer, kv):
    return "%s.L%d.%s" % (args.name, layer, kv)


def prefill(args):
    """Fills the cache, exports each tensor, and serves until stdin closes (or a signal)."""
    cache = Cache(args, args.blocks)
    for (layer, kv), t in cache.tensors.items():
        blocks = list(range(args.blocks))
        if cache.gpu:
            import torch
            t.view(torch.uint8).view(-1)[:] = pattern(True, layer, kv, blocks)
        else:
            t.view("uint8").reshape(-1)[:] = pattern(False, layer, kv, blocks)
    if cache.gpu:
        import torch
        torch.cuda.synchronize()       # the bytes must be there before anyone copies them
    with gpx.connect(args.socket, name="kv-prefill") as conn:
        for (layer, kv), t in cache.tensors.items():
            region = conn.register(t, read_only=True)     # keeps t alive while registered
            conn.export(region, names(args, layer, kv), rule=args.rule, read_only=True)
        print("prefill: %d layers x K,V of %d blocks (%s, %s regions) exported as %s.L*.K/V" % (
            args.layers, args.blocks, "GPU" if cache.gpu else "host memory", region.kind, args.name),
            flush=True)
        print("ready", flush=True)
        sys.stdin.read()               # until the decode side (or the operator) is done
    return 0


def decode(args):
    """Imports the prefill side's exports and pulls a batch of blocks into its own cache."""
    import random
    rng = random.Random(args.seed)
    cache = Cache(args, args.batch * 2)
    src_blocks = sorted(rng.sample(range(args.blocks), args.batch))
    dst_blocks = rng.sample(range(cache.num_blocks), args.batch)
    with gpx.connect(args.socket, name="kv-decode") as conn:
        pairs = []
        for (layer, kv), t in cache.tensors.items():
            theirs = conn.import_(names(args, layer, kv))
            pairs.append((theirs, conn.register(t), layer, kv))
        t0 = time.perf_counter()
        # One request per tensor: the same block numbers out of every layer's K and V.
        transfers = [conn.copy_pages(theirs, mine, BLOCK_BYTES, src_blocks, dst_blocks)
                     for theirs, mine, _, _ in pairs]
        moved = sum(t.wait() for t in transfers)     # or, in a coroutine: await each
        took = time.perf_counter() - t0
        for layer_kv in cache.tensors:
            got = cache.block_bytes(*layer_kv, dst_blocks)
            want = pattern(cache.gpu, *layer_kv, src_blocks)
            ok = bool((got == want).all())
            if not ok:
                print("decode: layer %d %s: blocks differ from the prefill side's" % layer_kv, file=sys.stderr)
                return 1
    print("decode: pulled %d blocks x %d tensors (%d bytes) in %.2f ms; every byte verified" % (
        args.batch, len(pairs), moved, took * 1e3))
    return 0


def demo(args):
    """The prefill side as a child process, then the decode side here."""
    child = [sys.executable, os.path.abspath(__file__), "prefill"] + common_argv(args)
    p = subprocess.Popen(child, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            print(line, end="")
            if line.strip() == "ready":
                break
        else:
            print("demo: the prefill side did not come up", file=sys.stderr)
            return 1
        return decode(args)
    finally:
        p.stdin.close()
        p.wait(30)


def common_argv(args):
    argv = ["--name", args.name, "--layers", str(args.layers), "--blocks", str(args.blocks),
            "--alloc", args.alloc, "--rule", args.rule]
    if args.socket:
        argv += ["--socket", args.socket]
    if args.host:
        argv.append("--host")
    return argv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=("prefill", "decode", "demo"))
    ap.add_argument("--socket", help="gpxd's socket (default: $GPX_SOCKET, else %s)" % gpx.DEFAULT_SOCKET)
    ap.add_argument("--name", default="kv", help="prefix of the export names (default kv)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per tensor on the prefill side")
    ap.add_argument("--batch", type=int, default=64, help="blocks the decode side pulls")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--host", action="store_true", help="host memory even where there is a GPU")
    ap.add_argument("--alloc", choices=("default", "pool"), default="default",
                    help="GPU caches from PyTorch's caching allocator or from gpx.torch_mem_pool()")
    ap.add_argument("--rule", choices=("uid", "gid", "any"), default="uid", help="who may import")
    args = ap.parse_args()
    return {"prefill": prefill, "decode": decode, "demo": demo}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
