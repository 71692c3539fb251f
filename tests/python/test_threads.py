"""Threads: blocking calls release the GIL, and several threads may wait on one connection."""
import subprocess
import sys
import threading
import time

import numpy as np

import gpx
from conftest import host


class Counter(threading.Thread):
    """Counts as fast as Python lets it: it only advances while this thread holds the GIL."""

    def __init__(self):
        super().__init__(daemon=True)
        self.n = 0
        self.stop = False
        self.marks = []         # when it reached each multiple of 1,024

    def run(self):
        while not self.stop:
            self.n += 1
            if self.n % 1024 == 0:
                self.marks.append(time.monotonic())


def test_waiting_releases_the_gil(conn):
    c = Counter()
    c.start()
    time.sleep(0.05)
    before = c.n
    assert conn.wait(timeout=0.5) == []          # nothing pending: the full half second
    during = c.n - before
    # While a copy runs, the counter's pace when this thread sleeps in time.sleep (which
    # releases the GIL) and when it waits for the copy must be alike; a wait that holds the GIL
    # leaves the counter only the moments the wait lets go of it in between (about a tenth).
    # Counted from the marks inside each interval, past a switch interval, so that what it did
    # before does not count.  The copy is long enough on any machine: 2 GiB, as 2,048 segments
    # of 1 MiB over a 128 MiB buffer (one copy of it would take a fast machine 10 ms).
    hb, v = host(128 << 20)
    r = conn.register(hb)
    segs = np.array([((i % 64) << 20, (64 + i % 64) << 20, 1 << 20) for i in range(2048)], dtype=np.uint64)
    margin = sys.getswitchinterval() + 0.001
    t = conn.copyv(r, r, segs)
    s0 = time.monotonic()
    time.sleep(0.03)
    t0 = time.monotonic()
    assert t.wait() == 2 << 30
    t1 = time.monotonic()
    c.stop = True
    c.join()

    def pace(a, b):
        return sum(1 for m in c.marks if a + margin < m < b) / (b - a - margin)

    # Python runs a few million increments a second: a held GIL would leave at most one
    # switch interval's worth (5 ms).
    assert during > 100000, during
    assert t1 - t0 > 2 * margin, t1 - t0
    slept, waited = pace(s0, t0), pace(t0, t1)
    assert slept > 0 and waited > 0.4 * slept, (slept, waited, t1 - t0)


def test_threads_wait_on_one_connection(conn):
    hb, v = host(8 << 20)
    v[:4 << 20] = np.arange(4 << 20, dtype=np.uint64).view(np.uint8)[:4 << 20]
    r = conn.register(hb)
    errors = []

    def worker(k):
        try:
            for i in range(100):
                off = (k * 100 + i) * 1024 % (4 << 20)
                t = conn.copy(r, r, 1024, src_offset=off, dst_offset=(4 << 20) + off)
                assert t.wait(timeout=30) == 1024
        except Exception as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a waiting thread hangs"
    assert errors == []
    assert conn.outstanding == 0 and conn.poll() == []


def test_another_threads_poll_wakes_a_waiter(conn):
    # Thread B reads the completion thread A waits for: A must still wake up.
    hb, v = host(64 << 20)
    r = conn.register(hb)
    for _ in range(5):
        t = conn.copy(r, r, 16 << 20, dst_offset=32 << 20)
        res = []
        a = threading.Thread(target=lambda: res.append(t.wait(timeout=30)))
        a.start()
        stop = time.monotonic() + 10
        while a.is_alive() and time.monotonic() < stop:
            conn.poll()
        a.join(30)
        assert not a.is_alive() and res == [16 << 20]


def test_requests_to_a_stopped_gpxd_release_the_gil(daemon_factory):
    # gpxd stopped (SIGSTOP): import_() and register() block until it goes on, and meanwhile
    # this thread runs Python.
    import signal
    d = daemon_factory()
    c = gpx.connect(d.sock, name="stopped")
    hb, v = host(1 << 20)
    c.export(c.register(hb), "py.threads.stop", rule="any")
    for call in (lambda: c.import_("py.threads.stop"), lambda: c.register(hb)):
        d.proc.send_signal(signal.SIGSTOP)
        # Resumed from outside: were the GIL held, this thread could not do it.
        resume = subprocess.Popen(["sh", "-c", "sleep 1; kill -CONT %d" % d.proc.pid])
        out = []
        w = threading.Thread(target=lambda: out.append(call()))
        w.start()
        time.sleep(0.05)
        n, end = 0, time.monotonic() + 0.3
        while time.monotonic() < end:
            n += 1
        assert w.is_alive(), "the request did not wait for the stopped gpxd, or held the GIL"
        resume.wait()
        w.join(10)
        assert isinstance(out[0], gpx.Region)
        assert n > 10000, n
    c.close()


def _metric(log_text, name):
    """One counter of gpxd's metrics endpoint, found from the address its log announced."""
    import re
    import urllib.request
    port = re.search(r"metrics endpoint on http://127\.0\.0\.1:(\d+)/metrics", log_text).group(1)
    page = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10).read().decode()
    return float(re.search(r"^%s (\S+)$" % name, page, re.M).group(1))


def test_a_sleeping_wait_is_woken_before_its_record(daemon_factory):
    # A wait that spins 50 us only sleeps through a 32 MiB copy; gpxd wakes it, with no record,
    # as the copy's last chunk starts (cq_sleepers), and the woken wait spins again and takes
    # the record.  Every copy arrives whole, and the early doorbells are counted.
    d = daemon_factory("metrics = 127.0.0.1:0\n")
    code = """if 1:
        import sys
        import numpy as np
        import gpx
        from conftest import host
        n = 32 << 20
        with gpx.connect(sys.argv[1], name="sleeper") as c:
            shb, src = host(n, np.random.default_rng(7))
            dhb, dst = host(n)
            rs, rd = c.register(shb, read_only=True), c.register(dhb)
            for i in range(40):
                dst[:] = 0
                assert c.copy(rs, rd, n).wait() == n
                assert np.array_equal(dst, src), i
        print("ok")
    """
    end = time.monotonic() + 10
    while "metrics endpoint on" not in d.log_text() and time.monotonic() < end:
        time.sleep(0.01)
    before = _metric(d.log_text(), "gpx_doorbells_early_total")
    env = dict(__import__("conftest").child_env(), GPX_WAIT_SPIN_US="50")
    p = subprocess.run([sys.executable, "-c", code, d.sock], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    after = _metric(d.log_text(), "gpx_doorbells_early_total")
    assert after > before, "no wait of the Python module was woken before its record (%g -> %g)" % (before, after)


def test_a_completion_taken_by_another_wait_leaves_the_fd_readable(gpxd):
    # A wait that spins (200 ms here) takes every record that comes meanwhile, and gpxd writes no
    # doorbell while it spins; a record that no Transfer waits for goes to the backlog, and
    # whoever watches the connection's fd (an event loop calling poll()) must still be told.
    code = """if 1:
        import select, sys
        import gpx
        from conftest import host
        n = 16 << 20
        with gpx.connect(sys.argv[1], name="spinner") as c:
            r = [c.register(host(n)[0]) for _ in range(4)]
            for i in range(20):
                other = c.copy(r[2], r[3], n)     # nobody waits for this one
                mine = c.copy(r[0], r[1], n)
                assert mine.wait() == n
                ready, _, _ = select.select([c.fileno()], [], [], 2.0)
                assert ready, "round %d: the fd never became readable for the other's completion" % i
                assert other.wait() == n
                assert c.wait(timeout=0) == []    # the doorbell read, for the next round
        print("ok")
    """
    env = dict(__import__("conftest").child_env(), GPX_WAIT_SPIN_US="200000")
    p = subprocess.run([sys.executable, "-c", code, gpxd.sock], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
