"""`await transfer`: the event loop watches Conn.fileno() while transfers are awaited."""
import asyncio

import numpy as np
import pytest

import gpx
from conftest import host


def test_await_one(conn, rng):
    hb, v = host(1 << 20, rng)
    dhb, d = host(1 << 20)
    rs, rd = conn.register(hb), conn.register(dhb)

    async def main():
        n = await conn.copy(rs, rd, 300000, src_offset=7, dst_offset=11)
        loop = asyncio.get_running_loop()
        # Nothing awaited any more: the loop no longer watches the fd.
        assert not loop.remove_reader(conn.fileno())
        return n

    assert asyncio.run(main()) == 300000
    assert np.array_equal(d[11:300011], v[7:300007])


def test_await_many_at_once_on_two_connections(gpxd, conn, rng):
    hb, v = host(4 << 20, rng)
    dhb, d = host(4 << 20)
    with gpx.connect(gpxd.sock, name="second") as c2:
        regs = [(conn, conn.register(hb), conn.register(dhb)), (c2, c2.register(hb), c2.register(dhb))]

        async def one(i):
            c, rs, rd = regs[i % 2]
            await asyncio.sleep(0.001 * (i % 5))
            return await c.copy(rs, rd, 32 << 10, src_offset=(32 << 10) * i, dst_offset=(32 << 10) * i)

        async def main():
            res = await asyncio.gather(*(one(i) for i in range(100)))
            loop = asyncio.get_running_loop()
            assert not loop.remove_reader(conn.fileno()) and not loop.remove_reader(c2.fileno())
            return res

        assert asyncio.run(main()) == [32 << 10] * 100
    assert np.array_equal(d[:100 * (32 << 10)], v[:100 * (32 << 10)])


def test_await_raises_the_transfers_error(conn):
    hb, v = host(4096)
    r = conn.register(hb)

    async def main():
        with pytest.raises(gpx.RangeError, match="leaves its region"):
            await conn.copy(r, r, 100, dst_offset=4000)
        with pytest.raises(gpx.AccessError):
            await conn.copy(r, conn.register(gpx.host_alloc(100), read_only=True), 10)
        return await conn.copy(r, r, 10)

    assert asyncio.run(main()) == 10


def test_await_a_completed_transfer(conn):
    hb, v = host(4096)
    r = conn.register(hb)
    t = conn.copy(r, r, 100, dst_offset=1000)
    assert t.wait() == 100

    async def main():
        return await t

    assert asyncio.run(main()) == 100


def test_awaited_completions_do_not_reach_poll(conn):
    hb, v = host(1 << 16)
    r = conn.register(hb)

    async def main():
        dropped = {conn.copy(r, r, 10, tag=500 + i).tag for i in range(5)}
        awaited = [conn.copy(r, r, 10, tag=600 + i) for i in range(5)]
        assert await asyncio.gather(*awaited) == [10] * 5
        got = []
        while len(got) < 5:
            got += conn.wait(timeout=10)
        assert {c.tag for c in got} == dropped

    asyncio.run(main())
    assert conn.poll() == []


def test_cancelled_await(daemon_factory):
    # gpxd stopped (SIGSTOP), so the transfer cannot complete before the await is cancelled.
    import signal
    d = daemon_factory()
    c = gpx.connect(d.sock, name="cancel-await")
    hb, v = host(1 << 20)
    r = c.register(hb)

    async def _await(t):
        return await t

    async def main():
        loop = asyncio.get_running_loop()
        d.proc.send_signal(signal.SIGSTOP)
        try:
            t = c.copy(r, r, 4096, dst_offset=8192)
            task = asyncio.ensure_future(_await(t))
            await asyncio.sleep(0.05)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not loop.remove_reader(c.fileno())
        finally:
            d.proc.send_signal(signal.SIGCONT)
        # The transfer itself goes on; the connection still works.
        return await c.copy(r, r, 4096)

    assert asyncio.run(main()) == 4096
    c.close()


def test_close_while_awaiting(gpxd, rng):
    c = gpx.connect(gpxd.sock, name="closing")
    hb, v = host(64 << 20)
    r = c.register(hb)

    async def main():
        ts = [c.copy(r, r, 16 << 20, dst_offset=32 << 20) for _ in range(8)]
        waits = asyncio.gather(*(_await(t) for t in ts), return_exceptions=True)
        await asyncio.sleep(0)
        c.close()
        res = await asyncio.wait_for(waits, 20)
        for x in res:
            assert x == 16 << 20 or isinstance(x, (gpx.CanceledError, gpx.ConnectionLostError)), x

    async def _await(t):
        return await t

    asyncio.run(main())
    assert c.closed


def test_await_outside_a_loop_fails_cleanly(conn):
    hb, v = host(4096)
    r = conn.register(hb)
    t = conn.copy(r, r, 10)
    with pytest.raises(RuntimeError):
        t.__await__()
    assert t.wait() == 10
