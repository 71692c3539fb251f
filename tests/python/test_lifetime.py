"""What a region keeps alive, closing with transfers outstanding, and no leaks of references,
memory or descriptors."""
import gc
import os
import sys
import time
import weakref

import numpy as np
import pytest

import gpx
from conftest import host


def test_a_region_keeps_its_object_alive(conn):
    hb, v = host(1 << 16)
    view = v[4096:8192]
    ref = weakref.ref(view)
    r = conn.register(view)
    del view
    gc.collect()
    assert ref() is not None, "registered object freed while gpxd may write into it"
    r.deregister()
    gc.collect()
    assert ref() is None
    # A registered HostBuffer cannot be closed (unmapped) under gpxd.
    del v
    r = conn.register(hb)
    with pytest.raises(BufferError, match="registered"):
        hb.close()
    r.deregister()
    hb.close()


def test_a_dropped_region_object_stays_registered(conn):
    hb, v = host(1 << 16)
    view = v[:4096]
    ref = weakref.ref(view)
    conn.register(view)         # the Region object is dropped at once
    del view
    gc.collect()
    assert ref() is not None
    conn.close()
    gc.collect()
    assert ref() is None


def test_close_with_transfers_outstanding(gpxd):
    base = gpxd.settle()
    c = gpx.connect(gpxd.sock, name="close-outstanding")
    hb, v = host(64 << 20)
    view = v[:]
    ref = weakref.ref(view)
    r = c.register(view)
    del view
    ts = [c.copy(r, r, 16 << 20, dst_offset=32 << 20) for _ in range(16)]
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 10
    gc.collect()
    assert ref() is None, "objects let go of after close"
    outcomes = set()
    for t in ts:
        assert t.done()
        try:
            assert t.wait() == 16 << 20
            outcomes.add("done")
        except gpx.CanceledError:
            outcomes.add("cancelled")
        except gpx.ConnectionLostError:
            outcomes.add("lost")
    assert outcomes
    # Every call now fails the same way; closing again is fine.
    c.close()
    for call in (lambda: c.copy(r, r, 1), lambda: c.register(hb), lambda: c.import_("x"),
                 lambda: c.export(r, "x"), lambda: c.poll(), lambda: c.wait(0), lambda: c.fileno(),
                 lambda: r.deregister(), lambda: c.copyv(r, r, [(0, 0, 1)]),
                 lambda: c.copy_pages(r, r, 1, [0], [0]), lambda: c.unexport("x")):
        with pytest.raises(gpx.ConnectionLostError, match="closed"):
            call()
    assert not r.live
    assert gpxd.wait_fds(base) == base, "gpxd kept descriptors of the closed client"


def test_dropping_a_connection_closes_it(gpxd):
    base = gpxd.settle()

    def session():
        c = gpx.connect(gpxd.sock, name="dropped")
        hb, v = host(1 << 20)
        r = c.register(hb)
        c.copy(r, r, 4096, dst_offset=4096)
        return weakref.ref(hb)

    ref = session()
    gc.collect()
    assert ref() is None
    assert gpxd.wait_fds(base) == base


def test_the_daemon_dying_ends_every_wait(daemon_factory):
    d = daemon_factory()
    c = gpx.connect(d.sock, name="orphan")
    hb, v = host(64 << 20)
    r = c.register(hb)
    ts = [c.copy(r, r, 16 << 20, dst_offset=32 << 20) for _ in range(16)]
    d.kill()
    t0 = time.monotonic()
    lost = 0
    for t in ts:
        try:
            t.wait(timeout=5)
        except gpx.ConnectionLostError:
            lost += 1
    assert time.monotonic() - t0 < 2
    with pytest.raises(gpx.ConnectionLostError):
        c.copy(r, r, 1).wait(timeout=5)
    c.close()
    assert lost > 0 or all(t.status == 0 for t in ts)


def test_no_leaks_in_a_loop(gpxd, conn):
    # The same work many times: references, Python memory and descriptors stay put.
    hb, v = host(1 << 20)
    conn.export(conn.register(hb), "py.leak.src", rule="any")
    segs = np.array([[0, 0, 100], [1000, 2000, 300]], dtype=np.uint64)
    pages = np.array([1, 2, 3], dtype=np.int32)

    def round_():
        with gpx.connect(gpxd.sock, name="leak") as c:
            view = v[8192:16384]
            d = c.register(view)
            s = c.import_("py.leak.src")
            c.copy(s, d, 4096).wait()
            c.copyv(s, d, segs).wait()
            c.copy_pages(s, d, 1024, pages, [0, 1, 2]).wait()
            try:
                c.copy(s, d, 1 << 30).wait()
            except gpx.RangeError:
                pass
            c.copy(s, d, 8)
            c.poll()
            d.deregister()

    fds = lambda: len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        round_()
    gc.collect()
    refs = (sys.getrefcount(hb), sys.getrefcount(v), sys.getrefcount(segs), sys.getrefcount(pages))
    blocks, nfd = sys.getallocatedblocks(), fds()
    for _ in range(300):
        round_()
    gc.collect()
    assert (sys.getrefcount(hb), sys.getrefcount(v), sys.getrefcount(segs), sys.getrefcount(pages)) == refs
    assert fds() == nfd
    assert sys.getallocatedblocks() - blocks < 200, sys.getallocatedblocks() - blocks
    conn.unexport("py.leak.src")
