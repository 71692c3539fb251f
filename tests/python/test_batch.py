"""Batches from Python: copy_batch (a weight push: whole tensors, lengths, offsets) and
copy_pages_batch (a KV handoff: the same blocks of every layer's tensors), into another
process's exports, every byte checked; and the whole batch refused, nothing moved, when one
pair is bad."""
import hashlib
import subprocess
import sys

import numpy as np
import pytest

import gpx
from conftest import child_env, host


# Another process owns the destination caches: it exports 8 of them and, once the parent's
# batch is done (the parent says so on stdin), prints a digest of each.
OWNER = r"""
import hashlib, sys, numpy as np, gpx
sock, prefix, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with gpx.connect(sock, name="batch-owner") as c:
    bufs = [gpx.host_alloc(size) for _ in range(n)]
    for i, b in enumerate(bufs):
        np.frombuffer(b, dtype=np.uint8)[:] = 0
        c.export(c.register(b), f"{prefix}.{i}", notify=(i == 0))
    print("ready", flush=True)
    sys.stdin.readline()
    for b in bufs:
        print(hashlib.sha256(np.frombuffer(b, dtype=np.uint8)).hexdigest(), flush=True)
"""


def test_kv_handoff_into_another_process(gpxd, conn, rng):
    layers, blocks, bs, n = 8, 64, 512, 40
    p = subprocess.Popen([sys.executable, "-c", OWNER, gpxd.sock, "py.batch.kv", str(layers), str(blocks * bs)],
                         env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().split() == ["ready"], p.stderr.read()
    mine = [host(blocks * bs, rng) for _ in range(layers)]
    pairs = [(conn.register(hb), conn.import_(f"py.batch.kv.{i}")) for i, (hb, _) in enumerate(mine)]
    sp = rng.permutation(blocks)[:n].astype(np.uint32)
    dp = rng.permutation(blocks)[:n].astype(np.int32)
    assert conn.copy_pages_batch(pairs, bs, sp, dp).wait() == layers * n * bs
    p.stdin.write("done\n")
    p.stdin.flush()
    digests = [p.stdout.readline().strip() for _ in range(layers)]
    assert p.wait(30) == 0, p.stderr.read()
    for (hb, v), digest in zip(mine, digests):
        want = np.zeros(blocks * bs, dtype=np.uint8).reshape(blocks, bs)
        want[dp] = v.reshape(blocks, bs)[sp]
        assert hashlib.sha256(want).hexdigest() == digest


def test_weight_push_shapes(conn, rng):
    sizes = [int(s) for s in rng.integers(1, 300_000, 40)]
    src = [host(s, rng) for s in sizes]
    dst = [host(s + 64) for s in sizes]
    rs = [conn.register(hb) for hb, _ in src]
    rd = [conn.register(hb) for hb, _ in dst]
    # Whole regions, explicit lengths, and offsets, in one request.
    pairs = []
    for i, (a, b) in enumerate(zip(rs, rd)):
        if i % 3 == 0:
            pairs.append((a, b))
        elif i % 3 == 1:
            pairs.append((a, b, sizes[i] // 2))
        else:
            pairs.append((a, b, sizes[i] - 7, 7, 64))
    want_bytes = sum(sizes[i] if i % 3 == 0 else sizes[i] // 2 if i % 3 == 1 else sizes[i] - 7
                     for i in range(len(sizes)))
    t = conn.copy_batch(pairs)
    assert t.wait() == want_bytes and t.bytes == want_bytes
    for i, ((_, s), (_, d)) in enumerate(zip(src, dst)):
        if i % 3 == 0:
            assert np.array_equal(d[:sizes[i]], s)
        elif i % 3 == 1:
            assert np.array_equal(d[:sizes[i] // 2], s[:sizes[i] // 2])
        else:
            assert np.array_equal(d[64:64 + sizes[i] - 7], s[7:])
    assert conn.poll() == []


def test_one_bad_pair_refuses_all(conn, rng):
    src = [host(4096, rng) for _ in range(6)]
    dst = [host(4096) for _ in range(6)]
    pairs = [(conn.register(a), conn.register(b)) for (a, _), (b, _) in zip(src, dst)]
    bad = pairs[:5] + [(pairs[5][0], pairs[5][1], 4096, 0, 1)]     # one byte past the end
    with pytest.raises(gpx.RangeError) as e:
        conn.copy_batch(bad).wait()
    assert e.value.reason
    assert all(not v.any() for _, v in dst), "a refused batch moved bytes"
    sp = np.array([0, 1], dtype=np.uint32)
    with pytest.raises(gpx.RangeError):
        conn.copy_pages_batch(pairs[:5] + [(pairs[5][0], pairs[5][1], 0, 2048)], 2048, sp, sp).wait()
    assert all(not v.any() for _, v in dst)


def test_read_only_destination_refuses_all(gpxd, conn, rng):
    a, _ = host(4096, rng)
    ro_src, _ = host(4096)
    ra = conn.register(a)
    conn.export(conn.register(ro_src), "py.batch.ro", read_only=True)
    with gpx.connect(gpxd.sock, name="batch-importer") as c2:
        ro = c2.import_("py.batch.ro")
        mine = c2.register(gpx.host_alloc(4096))
        with pytest.raises(gpx.AccessError):
            c2.copy_batch([(mine, mine), (mine, ro)]).wait()
    del ra


def test_argument_errors(conn):
    a = conn.register(gpx.host_alloc(4096))
    with pytest.raises(ValueError):
        conn.copy_batch([])
    with pytest.raises(TypeError):
        conn.copy_batch([(a,)])
    with pytest.raises(TypeError):
        conn.copy_batch([(a, a, 10, 1)])               # one offset without the other
    with pytest.raises(TypeError):
        conn.copy_batch([[a, a]])                      # a list, not a tuple
    with pytest.raises(TypeError):
        conn.copy_batch([(a, 5)])
    with pytest.raises(TypeError):
        conn.copy_pages_batch([(a, a, 1)], 64, [0], [0])
    with pytest.raises(ValueError):
        conn.copy_pages_batch([(a, a)], 64, [0, 1], [0])
    with pytest.raises(ValueError):
        conn.copy_pages_batch([(a, a)], 0, [0], [0])
    with pytest.raises(ValueError):
        conn.copy_batch([(a, a)] * 16385)              # GPX_PAIRS_MAX + 1


def test_prepared_batch_moves_what_is_there_each_time(gpxd, conn, rng):
    """A Batch (Conn.batch) is parsed once and submitted again and again: each submission moves
    the bytes its sources hold then, whole tensors, lengths and offsets as with tuples, and a
    pages Batch serves copy_pages_batch with each call's own page lists."""
    sizes = [int(s) for s in rng.integers(64, 20_000, 24)]
    src = [host(s, rng) for s in sizes]
    dst = [host(s + 64) for s in sizes]
    rs = [conn.register(hb) for hb, _ in src]
    rd = [conn.register(hb) for hb, _ in dst]
    tuples = [(a, b) if i % 3 == 0 else (a, b, sizes[i] // 2) if i % 3 == 1 else (a, b, sizes[i] - 7, 7, 64)
              for i, (a, b) in enumerate(zip(rs, rd))]
    b = conn.batch(tuples)
    assert len(b) == len(tuples) and not b.pages and "24 pairs" in repr(b)
    del tuples, rs, rd                     # the Batch keeps its regions
    for round_ in range(3):
        for _, s in src:
            s[:] = rng.integers(0, 256, len(s), dtype=np.uint8)
        t = conn.copy_batch(b, tag=900 + round_)
        assert t.wait() == sum(sizes[i] if i % 3 == 0 else sizes[i] // 2 if i % 3 == 1 else sizes[i] - 7
                               for i in range(len(sizes)))
        for i, ((_, s), (_, d)) in enumerate(zip(src, dst)):
            if i % 3 == 0:
                assert np.array_equal(d[:sizes[i]], s), (round_, i)
            elif i % 3 == 1:
                assert np.array_equal(d[:sizes[i] // 2], s[:sizes[i] // 2]), (round_, i)
            else:
                assert np.array_equal(d[64:64 + sizes[i] - 7], s[7:]), (round_, i)
    # Pages: 4 tensors of 16 blocks of 512 bytes, with bases.
    ps = [host(16 * 512, rng) for _ in range(4)]
    pd = [host(16 * 512 + 1024) for _ in range(4)]
    pb = conn.batch([(conn.register(a), conn.register(c), 0, 1024) for (a, _), (c, _) in zip(ps, pd)], pages=True)
    assert pb.pages
    for sp, dp in (([0, 5, 9], [3, 1, 15]), ([15, 2], [0, 7])):
        assert conn.copy_pages_batch(pb, 512, np.array(sp, dtype=np.uint32), dp).wait() == 4 * len(sp) * 512
        for (_, s), (_, d) in zip(ps, pd):
            for x, y in zip(sp, dp):
                assert np.array_equal(d[1024 + y * 512:1024 + (y + 1) * 512], s[x * 512:(x + 1) * 512])
    assert conn.poll() == []


def test_prepared_batch_refusals(gpxd, conn, rng):
    """A Batch is refused, with nothing moved, for the other kind of batch, on another
    connection, and once one of its regions was deregistered; bad pairs are refused when it
    is made."""
    (a, _), (c, dv) = host(4096, rng), host(4096)
    ra, rc = conn.register(a), conn.register(c)
    b = conn.batch([(ra, rc, 100), (rc, ra, 10, 0, 200)])
    pb = conn.batch([(ra, rc)], pages=True)
    with pytest.raises(TypeError, match="copy_pages_batch"):
        conn.copy_batch(pb)
    with pytest.raises(TypeError, match="copy_batch"):
        conn.copy_pages_batch(b, 64, [0], [0])
    with gpx.connect(gpxd.sock, name="batch-other") as c2:
        with pytest.raises(ValueError, match="another connection"):
            c2.copy_batch(b)
    with pytest.raises(TypeError):
        conn.batch([(ra, rc, 1, 2)])                  # one offset without the other
    with pytest.raises(TypeError):
        conn.batch([(ra, rc, 1)], pages=True)
    with pytest.raises(ValueError):
        conn.batch([])
    with pytest.raises(TypeError):
        gpx.Batch()
    rc.deregister()
    with pytest.raises(ValueError, match="pair 0: dst was deregistered"):
        conn.copy_batch(b)
    with pytest.raises(ValueError, match="pair 0: dst was deregistered"):
        conn.copy_pages_batch(pb, 64, [0], [0])
    assert not dv.any(), "a refused Batch moved bytes"
    assert conn.poll() == []
