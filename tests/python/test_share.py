"""Exports and imports between processes, notifications, and every refusal raising its own
exception with gpxd's reason."""
import hashlib
import os

import numpy as np
import pytest

import gpx
from conftest import host, run_child


# The importing process: reads the export into its own memory and reports a digest of it,
# then writes random pieces of its own into the export and reports what it wrote.
IMPORTER = r"""
import hashlib, sys, numpy as np, gpx
sock, name, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(seed)
with gpx.connect(sock, name="importer") as c:
    r = c.import_(name)
    assert r.imported and r.name == name and r.kind == "host", r
    hb = gpx.host_alloc(r.length)
    mine = np.frombuffer(hb, dtype=np.uint8)
    reg = c.register(hb)
    assert c.copy(r, reg).wait() == r.length
    print("digest", hashlib.sha256(mine).hexdigest())
    mine[:] = rng.integers(0, 256, r.length, dtype=np.uint8)
    for i in range(8):
        ln = int(rng.integers(1, r.length // 8))
        so = int(rng.integers(0, r.length - ln))
        do = i * (r.length // 8)
        c.copy(reg, r, ln, src_offset=so, dst_offset=do).wait()
        print("wrote", so, do, ln, hashlib.sha256(mine[so:so + ln]).hexdigest())
"""


def test_two_processes_export_and_import(gpxd, conn, rng):
    n = 1 << 20
    hb, v = host(n, rng)
    r = conn.register(hb)
    conn.export(r, "py.two.kv", rule="any", notify=True)
    original = hashlib.sha256(v).hexdigest()
    p = run_child(IMPORTER, gpxd.sock, "py.two.kv", int(rng.integers(1 << 30)))
    assert p.returncode == 0, p.stderr
    lines = [l.split() for l in p.stdout.splitlines()]
    # The importer read exactly our bytes (before it wrote into them).
    assert lines[0] == ["digest", original]
    wrote = [l for l in lines if l[0] == "wrote"]
    assert len(wrote) == 8
    for _, so, do, ln, digest in wrote:
        do, ln = int(do), int(ln)
        assert hashlib.sha256(v[do:do + ln]).hexdigest() == digest
    # One notification per copy into our export, with the region's id as its tag.
    notes = []
    while len(notes) < 8:
        got = conn.wait(timeout=10)
        assert got, "notifications missing"
        notes += got
    assert all(c.notify and c.tag == r.id and c.status == 0 for c in notes)
    assert sorted(c.bytes for c in notes) == sorted(int(w[3]) for w in wrote)
    conn.unexport("py.two.kv")


def test_unknown_export(conn):
    with pytest.raises(gpx.NotFoundError) as e:
        conn.import_("py.no.such.export")
    assert e.value.code == -gpx.ENOENT and e.value.reason and e.value.reason in str(e.value)


def test_export_name_taken(conn):
    hb, v = host(4096)
    r = conn.register(hb)
    conn.export(r, "py.taken")
    with pytest.raises(gpx.ExistsError) as e:
        conn.export(r, "py.taken")
    assert "exists" in e.value.reason
    conn.unexport("py.taken")
    conn.export(r, "py.taken")
    conn.unexport("py.taken")
    with pytest.raises(gpx.NotFoundError):
        conn.import_("py.taken")


def test_export_arguments(conn):
    hb, v = host(4096)
    r = conn.register(hb)
    with pytest.raises(ValueError, match="rule"):
        conn.export(r, "py.args", rule="world")
    with pytest.raises(gpx.InvalidError) as e:
        conn.export(r, "bad name with spaces")
    assert isinstance(e.value, ValueError) and "names" in e.value.reason
    with pytest.raises(TypeError):
        conn.export(5, "py.args")
    conn.export(r, "py.args.gid", rule="gid", gid=os.getegid())
    conn.unexport("py.args.gid")


def test_read_only_export_refuses_writes(gpxd, conn, rng):
    hb, v = host(8192, rng)
    conn.export(conn.register(hb), "py.ro", rule="any", read_only=True)
    with gpx.connect(gpxd.sock, name="reader") as other:
        imp = other.import_("py.ro")
        assert imp.read_only and imp.imported
        mine_hb, mine = host(8192)
        mine_r = other.register(mine_hb)
        assert other.copy(imp, mine_r).wait() == 8192
        assert np.array_equal(mine, v)
        with pytest.raises(gpx.AccessError) as e:
            other.copy(mine_r, imp, 16).wait()
        assert isinstance(e.value, PermissionError) and "read-only" in e.value.reason
        assert e.value.code == -gpx.EACCES
    conn.unexport("py.ro")


def test_bounds_refused_whole(conn, rng):
    hb, v = host(64 << 10, rng)
    dhb, d = host(64 << 10)
    rs, rd = conn.register(hb), conn.register(dhb)
    with pytest.raises(gpx.RangeError) as e:
        conn.copy(rs, rd, 4096, dst_offset=(64 << 10) - 100).wait()
    assert "leaves its region" in e.value.reason and e.value.code == -gpx.ERANGE
    # One bad segment: nothing of the request moves.
    segs = np.array([[0, 0, 4096], [0, 8192, 4096], [0, (64 << 10) - 1, 2]], dtype=np.uint64)
    with pytest.raises(gpx.RangeError, match="segment 2"):
        conn.copyv(rs, rd, segs).wait()
    with pytest.raises(gpx.RangeError):
        conn.copy_pages(rs, rd, 4096, [0, 1, 16], [0, 1, 2]).wait()
    assert not d.any()
    # An offset past 2**64 is an argument error here, before gpxd sees it.
    with pytest.raises(ValueError):
        conn.copy(rs, rd, 1, src_offset=1 << 64)


def test_refused_transfer_reasons_belong_to_their_transfer(conn):
    # Several refusals in flight at once: each Transfer raises its own reason.
    hb, v = host(4096)
    r = conn.register(hb)
    ro = conn.register(gpx.host_alloc(4096), read_only=True)
    bad_range = [conn.copy(r, r, 100, dst_offset=4090) for _ in range(3)]
    bad_rights = [conn.copy(r, ro, 10) for _ in range(3)]
    for t in bad_range:
        with pytest.raises(gpx.RangeError, match="leaves its region"):
            t.wait()
    for t in bad_rights:
        with pytest.raises(gpx.AccessError, match="read-only"):
            t.wait()
    # a refusal that nobody waits for: poll() returns it with its reason
    conn.copy(r, ro, 10, tag=99)
    got = []
    while not got:
        got = conn.wait(timeout=10)
    assert got[0].tag == 99 and got[0].status == -gpx.EACCES and "read-only" in got[0].reason


@pytest.mark.skipif(os.geteuid() != 0, reason="export rules across uids need root to start a client as another user")
def test_export_rules_across_users(gpxd, conn):
    hb, v = host(4096)
    r = conn.register(hb)
    conn.export(r, "py.rule.uid")
    conn.export(r, "py.rule.gid", rule="gid", gid=2000)
    conn.export(r, "py.rule.any", rule="any")
    code = r"""
import sys, gpx
c = gpx.connect(sys.argv[1], name="stranger")
for name in sys.argv[2:]:
    try:
        c.import_(name)
        print(name, "ok")
    except gpx.Error as e:
        print(name, type(e).__name__, e.code, "|", e.reason)
"""
    p = run_child(code, gpxd.sock, "py.rule.uid", "py.rule.gid", "py.rule.any", user=1002, group=1002,
                  extra_groups=[], cwd="/")
    assert p.returncode == 0, p.stderr
    res = {l.split()[0]: l for l in p.stdout.splitlines()}
    assert "AccessError -5" in res["py.rule.uid"] and res["py.rule.uid"].split("|")[1].strip()
    assert "AccessError -5" in res["py.rule.gid"]
    assert res["py.rule.any"].endswith("ok")
    p = run_child(code, gpxd.sock, "py.rule.gid", user=1003, group=2000, extra_groups=[], cwd="/")
    assert p.stdout.split() == ["py.rule.gid", "ok"], p.stderr
    for n in ("py.rule.uid", "py.rule.gid", "py.rule.any"):
        conn.unexport(n)
