"""python3 -m gpx.bench MODE: gpx from Python, measured against the way without it, in one run.

    python3 -m gpx.bench overhead [--spawn | --socket PATH] [--gpu] [--json]
    python3 -m gpx.bench kv|weights|pages|small [--spawn [--stage-clocks] | --socket PATH [--metrics URL]]
                         [--runs N] [--alloc default|expandable|pool]

kv, weights and pages are the workloads of PyTorch programs, in two processes each, against
PyTorch's own way of doing the same (gpx/_workloads.py says which): a paged KV-cache handoff, a
weight push from a trainer, scattered pages and a flat copy.  They use every GPU up to two
(and two processes sharing GPU 0); without a GPU, kv and weights run in host memory.

overhead: the same two loops, once in C (libgpxclient, run by the extension on the same
connection with the GIL released) and once in Python through gpx, alternating for --runs
short runs: a --size copy submitted and waited for (p50 and mean of the round trips), and
submissions alone (copies per second; each batch of 32 is drained untimed); each figure is
the median of its runs.  It prints both
figures, their ratio and what the binding adds per call.  Host memory by default; --gpu uses
CUDA tensors from PyTorch on GPU 0 (same GPU), and GPU 0 -> GPU 1 where there are two.

Modes are functions in MODES: each takes the parsed arguments and a Bench (the connection,
and what to report) and returns rows of (what, C figure, Python figure, unit); more modes add
an entry there.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import time

import gpx

BATCH = 32

# The targets of the GPU benches: id -> (comparison, value, what the figure is).  Ratios are
# gpx's figure over the strongest baseline's, measured in the same run (> 1: gpx faster).
# tests/results/TARGETS.md of the source tree, when it is there, wins over these values:
# a line there reads "kv.back_to_back >= 0.97 ..." (see load_targets).
TARGETS = {
    "kv.back_to_back": (">=", 0.97, "KV handoff, 64 tensors, 256 blocks and up: x the program's fused kernel"),
    "kv.after_work": (">=", 0.95, "the same, each request after 1 ms of the program's matmuls: x fused after the same"),
    "kv.concurrent": (">=", 0.90, "1,024 blocks while the program's matmuls run: x fused on a second stream"),
    "kv.concurrent_mps": (">=", 0.97, "the same under CUDA MPS"),
    "kv.concurrent_step": ("<=", 1.00, "the program's matmul step with gpx copying / with the fused kernel copying"),
    "weights.flat": (">=", 0.95, "weights, 338 tensors: x one flat copy of the same bytes"),
    "weights.fixed_us": ("<=", 50.0, "fixed cost of an update of 338 tensors, us"),
    "small.rate_c": (">=", 500000.0, "4 KiB copies a second, 64 in flight, from C"),
    "small.rate_python": (">=", 250000.0, "4 KiB copies a second, 64 in flight, from Python"),
    "small.p50": ("<=", 1.00, "4 KiB copy + wait p50 / cuMemcpyAsync + cuStreamSynchronize p50"),
    "isolation.p99_us": ("<=", 50.0, "4 KiB probe p99 while others copy 4 MiB .. 1 GiB, us"),
    "cpu.busy_cores": ("<=", 1.00, "gpxd's cores busy per GPU with work in flight"),
    "cpu.idle_cores": ("<=", 0.01, "gpxd's cores busy while idle"),
    "flat.copy": (">=", 0.97, "same-GPU and GPU-to-GPU flat copies from 64 MiB: x cuMemcpyAsync"),
}

_TARGET_LINE = re.compile(r"([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+)[`*|: \t]*(>=|<=|\u2265|\u2264)\s*([0-9][0-9,_]*(?:\.[0-9]+)?)")


def targets_file():
    """tests/results/TARGETS.md of the tree this package was built from ($GPX_TARGETS first)."""
    if os.environ.get("GPX_TARGETS"):
        return os.environ["GPX_TARGETS"]
    # From the package up (build/client-lib/python/gpx: the tree is build/'s parent), then cwd.
    for start in (os.path.dirname(os.path.abspath(__file__)), os.getcwd()):
        while True:
            cand = os.path.join(start, "tests", "results", "TARGETS.md")
            if os.path.isfile(cand):
                return cand
            up = os.path.dirname(start)
            if up == start:
                break
            start = up
    return None


def load_targets():
    """TARGETS with the file's values over them; returns (targets, where they came from)."""
    t = dict(TARGETS)
    path = targets_file()
    if path is None:
        return t, "bench.py (no tests/results/TARGETS.md found)"
    with open(path) as f:
        for line in f:
            for m in _TARGET_LINE.finditer(line):
                op = {"\u2265": ">=", "\u2264": "<="}.get(m.group(2), m.group(2))
                what = t.get(m.group(1), (None, None, m.group(1)))[2]
                t[m.group(1)] = (op, float(m.group(3).replace(",", "").replace("_", "")), what)
    return t, path


def verdict(tid, value, targets=None):
    """'met' or 'NOT MET' for a figure against target tid, with the target; '' when unknown."""
    op, want, _ = (targets or load_targets()[0]).get(tid, (None, None, None))
    if op is None or value is None or value != value:
        return ""
    ok = value >= want if op == ">=" else value <= want
    return "%s (%s %s %g)" % ("met" if ok else "NOT MET", tid, op, want)


def gpxd_pid(sock):
    """The pid of the gpxd serving sock (SO_PEERCRED), or None."""
    import struct
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET)
    try:
        s.connect(sock)
        pid, _, _ = struct.unpack("3i", s.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_PEERCRED, 12))
        return pid
    except OSError:
        return None
    finally:
        s.close()


def cpu_seconds(pid):
    """User and system CPU seconds of process pid so far (/proc/PID/stat), or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """gpxd's cores busy between start() and stop(): CPU seconds over wall seconds."""

    def __init__(self, pid):
        self.pid = pid
        self.t0 = self.c0 = None

    def start(self):
        self.t0, self.c0 = time.perf_counter(), cpu_seconds(self.pid)

    def stop(self):
        c1 = cpu_seconds(self.pid)
        if c1 is None or self.c0 is None:
            return None
        return (c1 - self.c0) / (time.perf_counter() - self.t0)


def scrape(url):
    """gpxd's stage clocks from its metrics endpoint: {stage: (count, seconds)}; {} without one."""
    if not url:
        return {}
    import urllib.request
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = re.match(r'gpx_stage_seconds_(sum|count)\{stage="([a-z_]+)"\} (\S+)', line)
        if m:
            c, s = out.get(m.group(2), (0, 0.0))
            if m.group(1) == "sum":
                s = float(m.group(3))
            else:
                c = int(float(m.group(3)))
            out[m.group(2)] = (c, s)
        m = re.match(r'gpx_event_loop_(naps|nap_wakes|early_wakes)_total (\S+)', line)
        if m:
            out["loop_" + m.group(1)] = int(float(m.group(2)))
    return out


STAGES = (("check", "received -> checked"), ("queue", "checked -> taken by a worker"),
          ("launch", "taken -> first chunk queued on the GPU"), ("gpu_wait", "queued -> GPU started"),
          ("copy", "started -> last byte done"), ("post", "done -> completion written, doorbell rung"))


def stage_lines(before, after, wall=None):
    """Lines of the mean time per transfer in each of gpxd's stages between two scrapes; with
    the client's time per transfer (one at a time), what is left of it: the client's sending,
    its wake-up and Python, which gpxd cannot see."""
    rows, inside = [], 0.0
    for st, what in STAGES:
        c0, s0 = before.get(st, (0, 0.0))
        c1, s1 = after.get(st, (0, 0.0))
        if c1 > c0:
            mean = (s1 - s0) / (c1 - c0)
            inside += mean
            rows.append("%s %.1f us (%s, %d)" % (st, mean * 1e6, what, c1 - c0))
    if rows and wall:
        rows.append("client side %.1f us (its round trip %.1f us less gpxd's stages: sending, waking, Python)"
                    % ((wall - inside) * 1e6, wall * 1e6))
    naps = after.get("loop_naps", 0) - before.get("loop_naps", 0)
    if rows and naps > 0:
        rows.append("the event loop napped %d times (woken by a copy worker before a copy's end %d, by a "
                    "completion %d)" % (naps, after.get("loop_early_wakes", 0) - before.get("loop_early_wakes", 0),
                                        after.get("loop_nap_wakes", 0) - before.get("loop_nap_wakes", 0)))
    return rows


def die_with_parent():
    """In the child before exec: SIGTERM when the process that started it dies."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Daemon:
    """A private gpxd for --spawn, on a temporary socket with a configuration of its own."""

    def __init__(self, settings, stage_clocks=False):
        self.dir = tempfile.mkdtemp(prefix="gpx-pybench.")
        self.sock = os.path.join(self.dir, "gpxd.sock")
        conf = os.path.join(self.dir, "gpxd.conf")
        with open(conf, "w") as f:
            f.write("# gpxd started by python3 -m gpx.bench --spawn\n")
            for s in settings:
                sec, _, rest = s.partition(".")
                key, eq, val = rest.partition("=")
                if not (sec and key and eq):
                    raise SystemExit("gpx.bench: '%s' is not section.key=value" % s)
                f.write("[%s]\n%s = %s\n" % (sec, key, val))
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "JOURNAL_STREAM", "WATCHDOG_USEC")}
        if stage_clocks:
            env["GPXD_STAGE_CLOCKS"] = "1"
        self.log = open(os.path.join(self.dir, "gpxd.log"), "w")
        self.proc = subprocess.Popen([find_gpxd(), "-f", "-c", conf, "-s", self.sock],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env,
                                     preexec_fn=die_with_parent)
        self.metrics = None
        end = time.monotonic() + 10
        while True:
            s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET)
            try:
                s.connect(self.sock)
                self.metrics = self.metrics_url()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    raise SystemExit("gpx.bench: gpxd did not come up")
                time.sleep(0.01)
            finally:
                s.close()

    def metrics_url(self):
        """Where the endpoint of daemon.metrics=ADDR:0 came up, from gpxd's log line."""
        end = time.monotonic() + 2
        while time.monotonic() < end:
            with open(self.log.name) as f:
                m = re.search(r"metrics endpoint on (http://\S+/metrics)", f.read())
            if m:
                return m.group(1)
            time.sleep(0.02)
        return None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def find_gpxd():
    """$GPXD, the gpxd of the build tree this package was staged in, or gpxd on PATH."""
    if os.environ.get("GPXD"):
        return os.environ["GPXD"]
    here = os.path.dirname(os.path.abspath(__file__))
    built = os.path.join(here, "..", "..", "..", "gpxd")
    if os.access(built, os.X_OK):
        return os.path.normpath(built)
    for d in ("/usr/sbin", "/usr/local/sbin"):
        if os.access(os.path.join(d, "gpxd"), os.X_OK):
            return os.path.join(d, "gpxd")
    return shutil.which("gpxd") or "gpxd"


class Bench:
    def __init__(self, conn, args):
        self.conn = conn
        self.args = args
        self.notes = []


def buffers(b, where):
    """Two registered buffers of --size bytes: (src region, dst region, what they are)."""
    n = b.args.size
    if where == "host":
        src, dst = gpx.host_alloc(n), gpx.host_alloc(n)
        memoryview(src)[:] = os.urandom(n)
        return b.conn.register(src, read_only=True), b.conn.register(dst), "host memory"
    import torch
    s_dev, d_dev = where
    pool = gpx.torch_mem_pool(s_dev) if b.args.alloc == "pool" else None

    def alloc(dev):
        if pool is None:
            return torch.empty(n, dtype=torch.uint8, device=dev)
        with torch.cuda.use_mem_pool(pool, device=dev):
            return torch.empty(n, dtype=torch.uint8, device=dev)
    src, dst = alloc(s_dev), alloc(d_dev)
    src.random_(0, 256)
    torch.cuda.synchronize()
    rs, rd = b.conn.register(src, read_only=True), b.conn.register(dst)
    return rs, rd, "CUDA %s -> %s (%s, %s)" % (s_dev, d_dev, rs.kind, "gpx.torch_mem_pool" if pool else
                                               "PyTorch's caching allocator")


def py_copy_wait(conn, src, dst, size, iters):
    copy, clock = conn.copy, time.perf_counter
    lat = [0.0] * iters
    for i in range(iters):
        t0 = clock()
        copy(src, dst, size).wait()
        lat[i] = clock() - t0
    return lat


def py_submit(conn, src, dst, size, iters):
    copy, clock = conn.copy, time.perf_counter
    total = 0.0
    done = 0
    while done < iters:
        k = min(BATCH, iters - done)
        t0 = clock()
        for _ in range(k):
            copy(src, dst, size)
        total += clock() - t0
        done += k
        while conn.outstanding:
            conn.wait(max=64)
    return total


def overhead(b):
    """copy+wait round trips and submission rate: C and Python on one connection."""
    a, conn = b.args, b.conn
    places = ["host"]
    if a.gpu:
        import torch
        places = [("cuda:0", "cuda:0")]
        if torch.cuda.device_count() > 1:
            places.append(("cuda:0", "cuda:1"))
        else:
            b.notes.append("one GPU: GPU 0 -> GPU 1 not measured")
    rows = []
    for where in places:
        src, dst, what = buffers(b, where)
        # warm up both paths
        conn._c_bench(src, dst, a.size, 200, "copy_wait")
        py_copy_wait(conn, src, dst, a.size, 200)
        # Per run: p50 and mean of the round trips, submissions per second.  The machine's
        # state drifts (an idle VM's wake-ups cost more than a busy one's), so C and Python
        # alternate in short runs, and each figure is the median of its runs.
        c_p50, p_p50, c_mean, p_mean, c_rate, p_rate = [], [], [], [], [], []
        for r in range(a.runs):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for side in order:
                if side == 0:
                    lat = conn._c_bench(src, dst, a.size, a.iters, "copy_wait")
                    c_p50.append(statistics.median(lat))
                    c_mean.append(statistics.fmean(lat))
                    c_rate.append(a.submits / conn._c_bench(src, dst, a.size, a.submits, "submit"))
                else:
                    lat = py_copy_wait(conn, src, dst, a.size, a.iters)
                    p_p50.append(statistics.median(lat))
                    p_mean.append(statistics.fmean(lat))
                    p_rate.append(a.submits / py_submit(conn, src, dst, a.size, a.submits))
        med, us = statistics.median, 1e6
        rows += [
            ("%s, %d B copy+wait p50" % (what, a.size), med(c_p50) * us, med(p_p50) * us, "us"),
            ("%s, %d B copy+wait mean" % (what, a.size), med(c_mean) * us, med(p_mean) * us, "us"),
            ("%s, %d B submissions" % (what, a.size), med(c_rate), med(p_rate), "copies/s"),
        ]
        src.deregister()
        dst.deregister()
    return rows


MODES = {
    "overhead": overhead,
}

# The workloads: each starts processes of its own on the daemon's socket and prints its table.
WORKLOADS = {"kv": "kv", "weights": "weights", "pages": "pages", "small": "small"}


def per_call(c, p, unit):
    """What the binding adds per call, in us: round trips are two calls (copy and wait)."""
    if unit == "us":
        return (p - c) / 2
    return (1 / p - 1 / c) * 1e6


def report(rows, b, out):
    a = b.args
    if a.json:
        json.dump({"mode": a.mode, "python": platform.python_version(), "gpx": gpx.__version__,
                   "cpus": os.cpu_count(), "notes": b.notes,
                   "rows": [{"what": w, "c": c, "python": p, "unit": u, "ratio": p / c,
                             "added_us_per_call": per_call(c, p, u)} for w, c, p, u in rows]}, out, indent=1)
        out.write("\n")
        return
    out.write("gpx.bench %s: Python %s, gpx %s, %d CPUs, %d runs of %d round trips and %d submissions\n"
              % (a.mode, platform.python_version(), gpx.__version__, os.cpu_count(), a.runs, a.iters, a.submits))
    width = max(len(r[0]) for r in rows)
    out.write("%-*s  %14s  %14s  %7s  %s\n" % (width, "", "C", "Python", "ratio", "added per call"))
    worst = 0.0
    for w, c, p, u in rows:
        fmt = "%14.2f" if u == "us" else "%14.0f"
        add = per_call(c, p, u)
        worst = max(worst, add)
        out.write(("%-*s  " + fmt + "  " + fmt + "  %6.2fx  %+.2f us   (%s)\n")
                  % (width, w, c, p, p / c, add, u))
    for n in b.notes:
        out.write("note: %s\n" % n)
    out.write("the binding adds at most %.2f us per call here (target: 1 us): %s\n"
              % (worst, "met" if worst <= 1.0 else "NOT met"))


def idle_cpu(a, settle=1.0, span=2.0):
    """gpxd's cores busy while idle, after the workload: a settling second (its workers spin a
    while after the last work), then two seconds measured."""
    if not a.gpxd_pid or not getattr(a, "gpu_ran", False):
        return
    time.sleep(settle)
    m = CpuMeter(a.gpxd_pid)
    m.start()
    time.sleep(span)
    busy = m.stop()
    if busy is not None:
        print("gpxd idle: %.4f cores busy over %.0f s (pid %d)   %s"
              % (busy, span, a.gpxd_pid, verdict("cpu.idle_cores", busy)))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m gpx.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=sorted(list(MODES) + list(WORKLOADS)))
    ap.add_argument("-s", "--socket", help="gpxd's socket (default: $GPX_SOCKET, else %s)" % gpx.DEFAULT_SOCKET)
    ap.add_argument("--spawn", action="store_true", help="start a private gpxd for the run")
    ap.add_argument("--set", action="append", default=[], metavar="SEC.KEY=VAL",
                    help="with --spawn: a gpxd.conf setting (e.g. cuda.trust_legacy_ipc=yes)")
    ap.add_argument("--size", type=int, default=4096, help="bytes per copy (default 4096)")
    ap.add_argument("--runs", type=int, default=None,
                    help="overhead: alternating runs of C and Python (default 30); the workloads: timed "
                         "repetitions of each figure, the median reported (default 10)")
    ap.add_argument("--iters", type=int, default=1000, help="round trips per run (default 1000)")
    ap.add_argument("--submits", type=int, default=10000, help="submissions per run (default 10000)")
    ap.add_argument("--gpu", action="store_true", help="CUDA tensors (PyTorch) instead of host memory")
    ap.add_argument("--alloc", choices=("default", "expandable", "pool"), default="default",
                    help="GPU memory from PyTorch's caching allocator (cuda-ipc: needs trust_legacy_ipc, which "
                         "--spawn sets), with expandable_segments:True (cuda-vmm; the workloads only), or from "
                         "gpx.torch_mem_pool() (cuda-vmm)")
    ap.add_argument("--host", action="store_true", help="kv, weights, small: host memory even where there is a GPU")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--metrics", metavar="URL", help="the workloads with --socket: gpxd's metrics endpoint "
                    "(http://127.0.0.1:9464/metrics), to print where gpxd's time goes (--spawn opens one)")
    ap.add_argument("--stage-clocks", action="store_true", help="with --spawn: gpxd marks when the GPU starts "
                    "each transfer (GPXD_STAGE_CLOCKS=1; one more stream operation per transfer)")
    a = ap.parse_args(argv)
    if a.spawn and a.socket:
        ap.error("--spawn and --socket exclude each other")
    if a.set and not a.spawn:
        ap.error("--set configures the gpxd of --spawn")
    if a.runs is None:
        a.runs = 10 if a.mode in WORKLOADS else 30
    if a.alloc == "expandable" and a.mode not in WORKLOADS:
        ap.error("--alloc expandable is for the workloads (overhead: default or pool)")
    if a.spawn and a.alloc == "default" and not any(s.startswith("cuda.trust_legacy_ipc") for s in a.set):
        a.set.append("cuda.trust_legacy_ipc=yes")   # the private daemon serves this run alone
    if a.spawn and a.mode in WORKLOADS and not any(s.startswith("daemon.metrics=") for s in a.set):
        a.set.append("daemon.metrics=127.0.0.1:0")   # the stage clocks, scraped by the workloads
    d = Daemon(a.set, a.stage_clocks) if a.spawn else None
    if a.mode in WORKLOADS:
        from gpx import _workloads
        try:
            sock = d.sock if d else a.socket or os.environ.get("GPX_SOCKET") or gpx.DEFAULT_SOCKET
            a.gpxd_pid = gpxd_pid(sock)
            if d is not None:
                a.metrics = d.metrics
            getattr(_workloads, WORKLOADS[a.mode])(sock, a)
            idle_cpu(a)
        finally:
            if d is not None:
                d.stop()
        return 0
    try:
        with gpx.connect(d.sock if d else a.socket, name="gpx.bench") as conn:
            b = Bench(conn, a)
            rows = MODES[a.mode](b)
            if d is not None:
                b.notes.append("gpxd spawned with its defaults%s" % ("" if not a.set else " and " + ", ".join(a.set)))
            report(rows, b, sys.stdout)
    finally:
        if d is not None:
            d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
