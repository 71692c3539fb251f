"""Fixtures of the Python module's tests: a real gpxd (the binary named by $GPXD) on a private
socket in a fresh temporary directory, with a configuration file written here, as the C tests'
harness (tests/harness.c) starts it; connections to it; host buffers.

Run by tests/python.test under `make check`; by hand:
    GPXD=build/gpxd PYTHONPATH=build/client-lib/python python3 -m pytest tests/python
"""
import os
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import gpx

HERE = os.path.dirname(os.path.abspath(__file__))

# The configuration of tests/harness.c.
BASE_CONF = """# written by the gpx Python tests
[daemon]
socket_mode = 0666
workers = 2
blocking_threads = 2
ring_entries = 64
chunk_size = 64K
max_segments = 131072
log_level = info
"""


def gpxd_path():
    p = os.environ.get("GPXD")
    if not p or not os.access(p, os.X_OK):
        pytest.exit("set GPXD to the gpxd binary (make check does)", returncode=99)
    return p


def die_with_parent():
    """In the child before exec: SIGTERM when the process that started it dies."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Daemon:
    """A gpxd on a socket of its own, stopped with SIGTERM like an operator would."""

    def __init__(self, extra=""):
        self.dir = tempfile.mkdtemp(prefix="gpx-pytest.", dir=os.environ.get("TMPDIR") or "/tmp")
        os.chmod(self.dir, 0o755)   # other uids (the export-rule test) reach the socket
        self.sock = os.path.join(self.dir, "gpxd.sock")
        self.conf = os.path.join(self.dir, "gpxd.conf")
        self.log = os.path.join(self.dir, "gpxd.log")
        with open(self.conf, "w") as f:
            f.write(BASE_CONF + extra)
        self.proc = None
        self.start()

    def start(self):
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM", "LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC")}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([gpxd_path(), "-f", "-s", self.sock, "-c", self.conf],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=log, env=env, close_fds=True,
                                     preexec_fn=die_with_parent)
        end = time.monotonic() + 30
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect(self.sock)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError("gpxd did not come up on %s:\n%s" % (self.sock, self.log_text()))
                time.sleep(0.01)
            finally:
                s.close()
        self.settle()

    def log_text(self):
        try:
            with open(self.log) as f:
                return f.read()
        except OSError:
            return ""

    def fds(self):
        return len(os.listdir("/proc/%d/fd" % self.proc.pid))

    def settle(self, quiet_ms=150, timeout=20):
        """Waits until gpxd's descriptor count holds still (closed clients are reaped
        asynchronously); returns it."""
        end = time.monotonic() + timeout
        last, since = self.fds(), time.monotonic()
        while time.monotonic() < end:
            time.sleep(0.01)
            n = self.fds()
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet_ms / 1000:
                break
        return last

    def wait_fds(self, want, timeout=10):
        """Waits until gpxd holds exactly `want` descriptors; returns the last count."""
        end = time.monotonic() + timeout
        n = self.fds()
        while n != want and time.monotonic() < end:
            time.sleep(0.01)
            n = self.fds()
        return n

    def kill(self, sig=signal.SIGKILL):
        self.proc.send_signal(sig)
        self.proc.wait()

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def gpxd():
    d = Daemon()
    yield d
    d.cleanup()


@pytest.fixture
def daemon_factory():
    """Private daemons for tests that change the configuration or kill gpxd."""
    made = []

    def make(extra=""):
        d = Daemon(extra)
        made.append(d)
        return d
    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def conn(gpxd, request):
    c = gpx.connect(gpxd.sock, name=request.node.name[:60])
    yield c
    c.close()


@pytest.fixture
def rng():
    import numpy as np
    seed = int.from_bytes(os.urandom(4), "little")
    print("random seed", seed)
    return np.random.default_rng(seed)


def host(nbytes, rng=None):
    """A HostBuffer and a uint8 numpy view of it (random bytes when rng is given)."""
    import numpy as np
    hb = gpx.host_alloc(nbytes)
    view = np.frombuffer(hb, dtype=np.uint8)
    if rng is not None:
        view[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return hb, view


def child_env():
    """The environment for child Python processes: this package and these helpers importable."""
    env = dict(os.environ)
    paths = [os.path.dirname(os.path.dirname(gpx.__file__)), HERE]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_child(code, *args, timeout=60, **kw):
    """Runs `code` in a fresh Python (this interpreter) with args; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-c", code] + [str(a) for a in args], env=child_env(),
                          capture_output=True, text=True, timeout=timeout, **kw)
