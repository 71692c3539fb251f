"""PyTorch's expandable segments as a program lives with them (skipped without a GPU): one
segment that grows 20 MiB at a time under registered tensors, torch.cuda.empty_cache()
unmapping pieces a region still uses, a new tensor where the freed one was, and a cache of
several GiB registered in one call (its cost, first and again, is printed).  Every copy is
checked byte for byte against the tensor it came from."""
import json
import subprocess
import sys

import pytest

from conftest import child_env

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (or no driver) here")

PROGRAM = r"""
import hashlib, json, sys, time
import torch, gpx

def sha(t):
    torch.cuda.synchronize()
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()

def host_sha(hb, n):
    return hashlib.sha256(memoryview(hb)[:n]).hexdigest()

out = {}
dev = torch.device("cuda:0")
MiB = 1 << 20
with gpx.connect(sys.argv[1], name="expandable") as c:
    hb = gpx.host_alloc(300 * MiB)
    rh = c.register(hb)
    # One tensor of 100 MiB: five or six pieces of the segment.
    a = torch.empty(100 * MiB, dtype=torch.uint8, device=dev)
    a.random_(0, 256)
    ra = c.register(a)
    out["kind"] = ra.kind
    segs = [s for s in torch.cuda.memory_snapshot() if s["segment_type"] == "large"]
    out["segments_before"] = len(segs)
    assert c.copy(ra, rh).wait() == 100 * MiB
    sha_a = sha(a)
    out["a_out"] = host_sha(hb, 100 * MiB) == sha_a
    # Growth: a second tensor maps more pieces onto the same segment.
    b = torch.empty(150 * MiB, dtype=torch.uint8, device=dev)
    b.random_(0, 256)
    segs = [s for s in torch.cuda.memory_snapshot() if s["segment_type"] == "large"]
    out["segments_after_growth"] = len(segs)
    rb = c.register(b)
    assert c.copy(rb, rh).wait() == 150 * MiB
    out["b_out"] = host_sha(hb, 150 * MiB) == sha(b)
    assert c.copy(ra, rh).wait() == 100 * MiB
    out["a_after_growth"] = host_sha(hb, 100 * MiB) == sha_a
    # Write into b through gpxd: the tensor sees it.
    memoryview(hb)[:150 * MiB] = bytes(range(256)) * (150 * MiB // 256)
    assert c.copy(rh, rb, 150 * MiB).wait() == 150 * MiB
    out["b_in"] = sha(b) == host_sha(hb, 150 * MiB)
    # The owner frees a and empties the cache: its pieces are unmapped while ra still uses them.
    a_ptr = a.data_ptr()
    del a
    torch.cuda.empty_cache()
    assert c.copy(ra, rh).wait() == 100 * MiB
    out["a_after_empty_cache"] = host_sha(hb, 100 * MiB) == sha_a
    # A new tensor of the same size, likely where a was: new pieces, a new region.
    a2 = torch.empty(100 * MiB, dtype=torch.uint8, device=dev)
    a2.fill_(7)
    out["a2_same_place"] = a2.data_ptr() == a_ptr
    ra2 = c.register(a2)
    assert c.copy(ra2, rh).wait() == 100 * MiB
    out["a2_out"] = host_sha(hb, 100 * MiB) == sha(a2)
    assert c.copy(ra, rh).wait() == 100 * MiB
    out["a_still_old"] = host_sha(hb, 100 * MiB) == sha_a
    for r in (ra, rb, ra2):
        r.deregister()
    del b, a2
    torch.cuda.empty_cache()
    # A cache of several GiB in one registration: the first time, and again.
    n = int(sys.argv[2]) * (1 << 30)
    kv = torch.empty(n, dtype=torch.uint8, device=dev)
    kv[::4096].fill_(1)
    t0 = time.perf_counter(); r1 = c.register(kv); t1 = time.perf_counter()
    r2 = c.register(kv); t2 = time.perf_counter()
    r3 = c.register(kv[20 * MiB:40 * MiB]); t3 = time.perf_counter()
    out["big_gib"] = n >> 30
    out["big_first_ms"] = (t1 - t0) * 1e3
    out["big_again_ms"] = (t2 - t1) * 1e3
    out["one_piece_again_us"] = (t3 - t2) * 1e6
    assert c.copy(r2, rh, 100 * MiB, src_offset=n - 100 * MiB).wait() == 100 * MiB
    out["big_tail"] = host_sha(hb, 100 * MiB) == sha(kv[n - 100 * MiB:])
print(json.dumps(out))
"""


@cuda
def test_expandable_segments_growth_and_empty_cache(gpxd):
    env = child_env()
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    gib = 4 if torch.cuda.mem_get_info(0)[0] > (16 << 30) else 1
    p = subprocess.run([sys.executable, "-c", PROGRAM, gpxd.sock, str(gib)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.splitlines()[-1])
    print("expandable segments:", r)
    assert r["kind"] == "cuda-vmm"
    assert r["segments_after_growth"] == r["segments_before"], "the segment was expected to grow, not to be new"
    for k in ("a_out", "b_out", "a_after_growth", "b_in", "a_after_empty_cache", "a2_out", "a_still_old",
              "big_tail"):
        assert r[k], (k, r)
