"""Connections, host memory, regions and the three kinds of copy, against a real gpxd: random
sizes, offsets and data, every byte checked."""
import array
import os

import numpy as np
import pytest

import gpx
from conftest import host


def test_connect_is_a_context_manager(gpxd):
    with gpx.connect(gpxd.sock, name="ctx") as c:
        assert isinstance(c, gpx.Conn)
        assert c.client_id > 0 and c.name == "ctx" and not c.closed
        assert c.fileno() >= 0 and c.outstanding == 0 and c.dropped == 0
    assert c.closed
    with pytest.raises(gpx.ConnectionLostError, match="closed"):
        c.fileno()


def test_connect_takes_the_socket_from_the_environment(gpxd, monkeypatch):
    monkeypatch.setenv("GPX_SOCKET", gpxd.sock)
    with gpx.connect() as c:
        assert c.client_id > 0
        assert c.name  # the program's name by default


def test_connect_refused_names_the_socket(tmp_path):
    path = str(tmp_path / "no.sock")
    with pytest.raises(gpx.ConnectionLostError) as e:
        gpx.connect(path)
    assert path in str(e.value) and e.value.code == -gpx.ECONN
    assert "No such file or directory" in str(e.value)   # the system's reason, not only the code
    assert isinstance(e.value, ConnectionError)


def test_host_alloc_buffer_protocol():
    hb = gpx.host_alloc(12345)
    assert len(hb) == hb.nbytes == 12345 and hb.fd >= 0 and not hb.closed
    m = memoryview(hb)
    assert m.nbytes == 12345 and not m.readonly and m.format == "B"
    assert bytes(m[:64]) == bytes(64)          # zero-filled
    v = np.frombuffer(hb, dtype=np.uint8)
    v[100:104] = [1, 2, 3, 4]
    assert bytes(m[100:104]) == b"\x01\x02\x03\x04"
    with pytest.raises(BufferError, match="view"):
        hb.close()
    m.release()
    del v
    hb.close()
    hb.close()
    assert hb.closed and hb.fd == -1
    with pytest.raises(ValueError, match="closed"):
        memoryview(hb)
    with pytest.raises(ValueError):
        gpx.host_alloc(0)
    with pytest.raises(ValueError):
        gpx.host_alloc(-1)


def test_regions_describe_themselves(conn):
    hb, v = host(1 << 16)
    r = conn.register(hb, read_only=True)
    assert r.kind == "host" and r.length == 1 << 16 and r.read_only and not r.imported
    assert r.live and r.conn is conn and r.name is None and r.id != 0
    assert "host" in repr(r) and "read-only" in repr(r)
    s = conn.register(v[4096:8192])
    assert s.length == 4096 and not s.read_only
    s.deregister()
    assert not s.live
    with pytest.raises(ValueError, match="already"):
        s.deregister()
    with conn.register(v[:100]) as w:
        assert w.live
    assert not w.live


def test_copy_random_sizes_offsets_and_data(conn, rng):
    n = 4 << 20
    shb, src = host(n, rng)
    dhb, dst = host(n)
    rs = conn.register(shb, read_only=True)
    rd = conn.register(dhb)
    for _ in range(60):
        length = int(rng.integers(1, 256 << 10))
        so = int(rng.integers(0, n - length))
        do = int(rng.integers(0, n - length))
        dst[do:do + length] = 0
        t = conn.copy(rs, rd, length, src_offset=so, dst_offset=do)
        assert isinstance(t, gpx.Transfer)
        assert t.wait() == length
        assert t.done() and t.status == 0 and t.bytes == length
        assert np.array_equal(dst[do:do + length], src[so:so + length])


def test_copy_between_views_of_host_buffers(conn, rng):
    shb, src = host(1 << 20, rng)
    dhb, dst = host(1 << 20)
    # A slice of a numpy view registers as that slice of its HostBuffer.
    rs = conn.register(src[1000:300000], read_only=True)
    rd = conn.register(dst[5000:])
    assert conn.copy(rs, rd).wait() == 299000        # length None: the rest of src
    assert np.array_equal(dst[5000:304000], src[1000:300000])
    assert not dst[:5000].any() and not dst[304000:].any()
    # memoryview and array views of the same memory register as well
    r2 = conn.register(memoryview(dhb)[10:20])
    assert r2.length == 10


def test_copyv_random_segments(conn, rng):
    n = 8 << 20
    shb, src = host(n, rng)
    dhb, dst = host(n)
    rs = conn.register(shb, read_only=True)
    rd = conn.register(dhb)
    for count, dtype in ((3, np.uint64), (40, np.int64), (300, np.uint64), (300, np.int64), (5000, np.int64)):
        dst[:] = 0
        # Non-overlapping destination pieces: a shuffled partition of dst into count slots.
        slot = n // count
        lengths = rng.integers(1, slot, count)
        dslots = rng.permutation(count)
        segs = np.empty((count, 3), dtype=dtype)
        segs[:, 0] = rng.integers(0, n - slot, count)
        segs[:, 1] = dslots * slot
        segs[:, 2] = lengths
        t = conn.copyv(rs, rd, segs)
        assert t.wait() == int(lengths.sum())
        expect = np.zeros(n, dtype=np.uint8)
        for so, do, ln in segs.tolist():
            expect[do:do + ln] = src[so:so + ln]
        assert np.array_equal(dst, expect), (count, dtype)
    # a list of triples, and a flat array of 3n
    dst[:] = 0
    assert conn.copyv(rs, rd, [(0, 10, 5), (100, 200, 7)]).wait() == 12
    assert np.array_equal(dst[10:15], src[0:5]) and np.array_equal(dst[200:207], src[100:107])
    assert conn.copyv(rs, rd, np.array([1, 2, 3], dtype=np.uint64)).wait() == 3


def test_copyv_refuses_bad_lists(conn):
    hb, v = host(1 << 16)
    r = conn.register(hb)
    with pytest.raises(TypeError, match="8-byte"):
        conn.copyv(r, r, np.zeros((2, 3), dtype=np.float64))
    with pytest.raises(TypeError, match="8-byte"):
        conn.copyv(r, r, np.zeros((2, 3), dtype=np.uint32))
    with pytest.raises(ValueError, match=r"\(n, 3\)"):
        conn.copyv(r, r, np.zeros((3, 2), dtype=np.uint64))
    with pytest.raises(ValueError, match="contiguous"):
        conn.copyv(r, r, np.zeros((3, 6), dtype=np.uint64)[:, ::2])
    with pytest.raises(ValueError, match="no segments"):
        conn.copyv(r, r, np.zeros((0, 3), dtype=np.uint64))
    for n in (2, 100, 5000):        # short lists, the segment area, the GIL released
        segs = np.zeros((n, 3), dtype=np.int64)
        segs[:, 2] = 1
        segs[n - 1, 0] = -5
        with pytest.raises(ValueError, match="negative"):
            conn.copyv(r, r, segs)
    with pytest.raises(ValueError):
        conn.copyv(r, r, [(0, 0, -1)])
    with pytest.raises(TypeError):
        conn.copyv(r, r, [(0, 0)])
    with pytest.raises(TypeError):
        conn.copyv(r, r, 17)
    assert conn.outstanding == 0
    assert conn.copyv(r, r, np.array([[0, 100, 10]], dtype=np.int64)).wait() == 10


def test_copy_pages_random_blocks(conn, rng):
    page, pages = 4096, 512
    shb, src = host(page * pages + 512, rng)
    dhb, dst = host(page * pages + 256)
    rs = conn.register(shb, read_only=True)
    rd = conn.register(dhb)
    makers = [
        lambda a: np.asarray(a, dtype=np.int32),
        lambda a: np.asarray(a, dtype=np.uint32),
        lambda a: array.array("i", a),
        lambda a: array.array("I", a),
        lambda a: list(a),
    ]
    for make in makers:
        dst[:] = 0
        n = int(rng.integers(1, pages))
        sp = rng.choice(pages, n, replace=False)
        dp = rng.choice(pages, n, replace=False)
        so, do = int(rng.integers(0, 512)), int(rng.integers(0, 256))
        t = conn.copy_pages(rs, rd, page, make(sp.tolist()), make(dp.tolist()), src_offset=so, dst_offset=do)
        assert t.wait() == n * page
        expect = np.zeros_like(dst)
        for s, d in zip(sp.tolist(), dp.tolist()):
            expect[do + d * page:do + (d + 1) * page] = src[so + s * page:so + (s + 1) * page]
        assert np.array_equal(dst, expect)


def test_copy_pages_refuses_bad_lists(conn):
    hb, v = host(1 << 16)
    r = conn.register(hb)
    with pytest.raises(ValueError, match="negative"):
        conn.copy_pages(r, r, 4096, np.array([0, -1], dtype=np.int32), [0, 1])
    with pytest.raises(ValueError, match="differ"):
        conn.copy_pages(r, r, 4096, [0, 1], [0])
    with pytest.raises(TypeError, match="4-byte"):
        conn.copy_pages(r, r, 4096, np.array([0], dtype=np.int64), [0])
    with pytest.raises(ValueError, match="page_size"):
        conn.copy_pages(r, r, 0, [0], [1])
    with pytest.raises(ValueError, match="32 bits"):
        conn.copy_pages(r, r, 4096, [1 << 32], [0])
    with pytest.raises(ValueError, match="no pages"):
        conn.copy_pages(r, r, 4096, [], [])
    assert conn.outstanding == 0


def test_copy_pages_table_refusals(conn):
    # A table in host memory is refused by gpxd (its page kernel reads tables in GPU memory only);
    # what the module can see is refused before anything is sent.
    hb, v = host(1 << 16)
    r = conn.register(hb)
    tb, tv = host(4096)
    tv[:] = 0
    rt = conn.register(tb)
    with pytest.raises(gpx.InvalidError, match="not GPU memory"):
        conn.copy_pages_table(r, r, 4096, rt, 8).wait()
    with pytest.raises(gpx.RangeError, match="inside its region"):
        conn.copy_pages_table(r, r, 4096, rt, 600).wait()     # 4,800 bytes of a 4,096-byte table
    with pytest.raises(ValueError, match="page_size"):
        conn.copy_pages_table(r, r, 0, rt, 8)
    with pytest.raises(ValueError, match="no pages"):
        conn.copy_pages_table(r, r, 4096, rt, 0)
    with pytest.raises(TypeError, match="table must be a gpx.Region"):
        conn.copy_pages_table(r, r, 4096, tb, 8)
    # a batch's table: the same refusals
    with pytest.raises(gpx.InvalidError, match="not GPU memory"):
        conn.copy_pages_batch_table([(r, r)], 4096, rt, 8).wait()
    with pytest.raises(ValueError, match="no pages"):
        conn.copy_pages_batch_table([(r, r)], 4096, rt, 0)
    with pytest.raises(TypeError, match="table must be a gpx.Region"):
        conn.copy_pages_batch_table([(r, r)], 4096, tb, 8)
    assert conn.outstanding == 0


def test_register_refuses_what_gpxd_cannot_map(conn):
    with pytest.raises(ValueError, match="host_alloc"):
        conn.register(np.zeros(4096, dtype=np.uint8))
    with pytest.raises(ValueError, match="host_alloc"):
        conn.register(bytearray(100))
    with pytest.raises(TypeError, match="cannot register int"):
        conn.register(17)
    hb, v = host(1 << 16)
    with pytest.raises(ValueError, match="contiguous"):
        conn.register(v.reshape(256, 256)[:, :128])
    with pytest.raises(ValueError, match="no bytes"):
        conn.register(v[10:10])
    with pytest.raises(ValueError, match="read_only=True"):
        conn.register(memoryview(hb).toreadonly())
    assert conn.register(memoryview(hb).toreadonly(), read_only=True).read_only
    hb2 = gpx.host_alloc(100)
    hb2.close()
    with pytest.raises(ValueError, match="closed"):
        conn.register(hb2)


def test_regions_of_another_connection_are_refused(gpxd, conn):
    hb, v = host(4096)
    r = conn.register(hb)
    with gpx.connect(gpxd.sock) as other:
        o = other.register(hb)
        with pytest.raises(ValueError, match="another connection"):
            conn.copy(r, o, 10)
        with pytest.raises(TypeError, match="gpx.Region"):
            conn.copy(r, 5, 10)


def test_tags(conn):
    hb, v = host(1 << 16)
    r = conn.register(hb)
    t = conn.copy(r, r, 100, dst_offset=1000, tag=12345)
    assert t.tag == 12345
    with pytest.raises(ValueError, match="in use"):
        conn.copy(r, r, 100, tag=12345)
    t.wait()
    conn.copy(r, r, 100, tag=12345).wait()      # free again once complete
    with pytest.raises(ValueError, match="2\\*\\*62"):
        conn.copy(r, r, 100, tag=1 << 62)
    with pytest.raises(ValueError):
        conn.copy(r, r, 100, tag=-1)
    auto = [conn.copy(r, r, 10) for _ in range(5)]
    assert len({a.tag for a in auto}) == 5 and all(a.tag >= 1 << 62 for a in auto)
    for a in auto:
        a.wait()


def test_each_completion_is_consumed_once(conn):
    hb, v = host(1 << 20)
    r = conn.register(hb)
    # Waiting for the last keeps the others' completions for their own Transfers.
    ts = [conn.copy(r, r, 4096, dst_offset=4096 * (i + 1)) for i in range(20)]
    assert ts[-1].wait() == 4096
    for t in ts[:-1]:
        assert t.wait() == 4096
    assert conn.poll() == [] and conn.outstanding == 0
    # Transfers dropped unwaited: their completions go to poll()/wait(), each once.
    tags = {conn.copy(r, r, 100, tag=1000 + i).tag for i in range(10)}
    got = []
    while len(got) < 10:
        got += conn.wait(timeout=10)
    assert {c.tag for c in got} == tags and all(c.status == 0 and c.bytes == 100 for c in got)
    assert not any(c.notify for c in got) and all(c.reason is None for c in got)
    assert conn.poll() == []
    # poll() resolves a live Transfer: done() without blocking, wait() at once, no second delivery.
    t = conn.copy(r, r, 64, tag=77)
    got = []
    while not got:
        got = conn.wait(timeout=10)
    assert [c.tag for c in got] == [77]
    assert t.done() and t.wait() == 64 and conn.poll() == []


def test_poll_max_and_wait_timeout(conn):
    hb, v = host(1 << 16)
    r = conn.register(hb)
    for i in range(6):
        conn.copy(r, r, 8, tag=3000 + i)
    got = []
    while len(got) < 6:
        part = conn.wait(timeout=10, max=2)
        assert 1 <= len(part) <= 2
        got += part
    assert sorted(c.tag for c in got) == list(range(3000, 3006))
    import time
    t0 = time.monotonic()
    assert conn.wait(timeout=0.1) == []
    assert time.monotonic() - t0 >= 0.09
    with pytest.raises(ValueError):
        conn.poll(max=0)
    with pytest.raises(ValueError):
        conn.wait(timeout=-1)


def test_transfer_wait_timeout(conn):
    hb, v = host(64 << 20)
    r = conn.register(hb)
    timed_out = 0
    for _ in range(3):
        t = conn.copy(r, r, 32 << 20, dst_offset=32 << 20)
        try:
            t.wait(0)
        except gpx.TimeoutError as e:
            assert isinstance(e, TimeoutError) and e.code == -gpx.ETIMEDOUT
            timed_out += 1
        assert t.wait(30) == 32 << 20
    assert timed_out >= 1


def test_cancel(conn):
    # Four transfers of 1 GiB each (1,024 segments of 1 MiB), served round-robin: none has all
    # its chunks handed out before most of the 4 GiB has moved, long after the cancels, so the
    # cancelled ones end cancelled.  A cancel that does nothing lets them all complete; of up
    # to three rounds, one must not.
    hb, v = host(64 << 20)
    r = conn.register(hb)
    segs = np.array([((i % 32) << 20, (32 + i % 32) << 20, 1 << 20) for i in range(1024)], dtype=np.uint64)
    for _ in range(3):
        ts = [conn.copyv(r, r, segs) for _ in range(4)]
        answers = [t.cancel() for t in reversed(ts)]
        assert all(isinstance(a, bool) for a in answers)
        outcomes = []
        for t, accepted in zip(ts, reversed(answers)):
            try:
                assert t.wait(30) == 1 << 30
                outcomes.append("done")
            except gpx.CanceledError as e:
                assert e.code == -gpx.ECANCELED
                assert accepted                 # only a cancel the daemon took ends so
                outcomes.append("cancelled")
        assert ts[0].cancel() is False          # complete: nothing to cancel
        if "cancelled" in outcomes:
            break
    assert "cancelled" in outcomes, outcomes


def test_error_classes():
    pairs = {
        gpx.ProtocolError: gpx.EPROTO, gpx.VersionError: gpx.EVERSION, gpx.InvalidError: gpx.EINVAL,
        gpx.NotFoundError: gpx.ENOENT, gpx.AccessError: gpx.EACCES, gpx.RangeError: gpx.ERANGE,
        gpx.BusyError: gpx.EBUSY, gpx.QuotaError: gpx.EQUOTA, gpx.BadFdError: gpx.EBADFD,
        gpx.NoMemoryError: gpx.ENOMEM, gpx.CanceledError: gpx.ECANCELED, gpx.RevokedError: gpx.EREVOKED,
        gpx.ExistsError: gpx.EEXIST, gpx.NotSupportedError: gpx.ENOTSUP, gpx.CopyError: gpx.EIO,
        gpx.ShutdownError: gpx.ESHUTDOWN, gpx.DrainingError: gpx.EDRAINING, gpx.NotAdminError: gpx.EPERM,
        gpx.ConnectionLostError: gpx.ECONN, gpx.TimeoutError: gpx.ETIMEDOUT, gpx.SysError: gpx.ESYS,
    }
    for cls, code in pairs.items():
        assert issubclass(cls, gpx.Error) and cls.code == -code, cls
        assert gpx.strerror(code) == gpx.strerror(-code) != "unknown error"
    assert issubclass(gpx.InvalidError, ValueError)
    assert issubclass(gpx.AccessError, PermissionError)
    assert issubclass(gpx.NoMemoryError, MemoryError)
    assert issubclass(gpx.ConnectionLostError, ConnectionError)
    assert issubclass(gpx.TimeoutError, TimeoutError)
    assert issubclass(gpx.SysError, OSError)
    assert gpx.Error.code is None and gpx.strerror(-6) == "segment out of the region's bounds"


def test_many_transfers_in_flight(conn, rng):
    # More than the credit (64 here) in total, never more than it at once.
    hb, v = host(1 << 20, rng)
    dhb, d = host(1 << 20)
    rs, rd = conn.register(hb), conn.register(dhb)
    for rnd in range(4):
        ts = [conn.copy(rs, rd, 1024, src_offset=1024 * i, dst_offset=1024 * i) for i in range(60)]
        with pytest.raises(gpx.BusyError, match="credit"):
            for _ in range(10):
                ts.append(conn.copy(rs, rd, 1))
        for t in ts:
            t.wait()
    assert np.array_equal(d[:60 * 1024], v[:60 * 1024])


def test_module_never_imports_torch_numpy_or_cupy():
    code = ("import sys, gpx\n"
            "bad = [m for m in ('torch', 'numpy', 'cupy', 'asyncio') if m in sys.modules]\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    from conftest import run_child
    p = run_child(code)
    assert p.returncode == 0, p.stdout + p.stderr
