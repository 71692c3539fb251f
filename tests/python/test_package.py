"""The package around the extension: the example a PyTorch user copies (run here with host
memory), the benchmark, and the type stub against what the module really has."""
import ast
import os
import re
import subprocess
import sys

import pytest

import gpx
from conftest import child_env

SRC = os.environ.get("GPX_SRCDIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
EXAMPLE = os.path.join(SRC, "client-lib", "python", "examples", "kv_handoff.py")
STUB = os.path.join(os.path.dirname(gpx.__file__), "__init__.pyi")


def test_kv_handoff_example(gpxd):
    p = subprocess.run([sys.executable, EXAMPLE, "demo", "--socket", gpxd.sock, "--host", "--name", "py.example",
                        "--layers", "3", "--blocks", "128", "--batch", "40"],
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "every byte verified" in p.stdout and "pulled 40 blocks x 6 tensors" in p.stdout, p.stdout


def test_bench_overhead_runs(gpxd):
    p = subprocess.run([sys.executable, "-m", "gpx.bench", "overhead", "--socket", gpxd.sock, "--runs", "2",
                        "--iters", "50", "--submits", "200"],
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    for what in ("B copy+wait p50", "B copy+wait mean", "B submissions"):
        row = [l for l in lines if what in l]
        assert len(row) == 1 and row[0].split()[-2] == "us", p.stdout
    assert "per call" in lines[-1], p.stdout


@pytest.mark.parametrize("mode", ["kv", "weights", "small"])
def test_bench_workload_runs(gpxd, mode):
    """The workloads of the benchmark, as CI runs them: host memory without a GPU, every
    result checked against its source (a mismatch ends the run with an error)."""
    p = subprocess.run([sys.executable, "-m", "gpx.bench", mode, "--socket", gpxd.sock, "--runs", "2", "--host"],
                       env=child_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gpx" in p.stdout and "GB/s" in p.stdout, p.stdout
    if mode == "weights":
        # the fixed cost's parts: what the client's submission takes, apart from its wake-up
        assert re.search(r"copy_batch until it returns \d+\.\d us", p.stdout), p.stdout


def test_bench_stage_lines_say_the_loops_naps():
    """The benches' lines of gpxd's stages, from two real scrapes of its metrics: with busy
    polling on, a client that only waits for its 64 MiB copies sends nothing while one runs, the
    event loop naps, and the end of each copy wakes it; the lines count those naps."""
    from gpx import bench
    d = bench.Daemon(["daemon.metrics=127.0.0.1:0", "daemon.busy_poll_us=1000000", "daemon.workers=1"])
    try:
        assert d.metrics, "gpxd did not say where its metrics are"
        size = 64 << 20
        a, b = gpx.host_alloc(size), gpx.host_alloc(size)
        with gpx.connect(d.sock) as c:
            ra, rb = c.register(a), c.register(b)
            before = bench.scrape(d.metrics)
            for _ in range(4):
                c.copy(ra, rb).wait()
            after = bench.scrape(d.metrics)
        lines = bench.stage_lines(before, after, 0.01)
        m = [re.match(r"the event loop napped (\d+) times \(woken by a copy worker before a copy's end (\d+), "
                      r"by a completion (\d+)\)$", x) for x in lines]
        m = [x for x in m if x]
        assert len(m) == 1, lines
        naps, early, ends = map(int, m[0].groups())
        assert naps >= 1 and ends >= 1 and early == 0, lines     # (early: GPU workers only)
    finally:
        d.stop()


def test_bench_targets_file_wins(tmp_path, monkeypatch):
    """The targets the benches print against: bench.py's own, and a targets file's values over
    them, whatever the line around the id looks like (a table row, a list item, a >= sign)."""
    from gpx import bench
    f = tmp_path / "TARGETS.md"
    f.write_text("| `kv.back_to_back` | >= 0.99 | ratio |\n- small.rate_python \u2265 300,000 copies/s\n"
                 "weights.fixed_us <= 40 us\n")
    monkeypatch.setenv("GPX_TARGETS", str(f))
    t, where = bench.load_targets()
    assert where == str(f)
    assert t["kv.back_to_back"][:2] == (">=", 0.99) and t["small.rate_python"][:2] == (">=", 300000.0)
    assert t["weights.fixed_us"][:2] == ("<=", 40.0) and t["kv.after_work"] == bench.TARGETS["kv.after_work"]
    assert bench.verdict("kv.back_to_back", 0.98, t).startswith("NOT MET")
    assert bench.verdict("kv.back_to_back", 0.99, t).startswith("met")
    assert bench.verdict("weights.fixed_us", 41, t).startswith("NOT MET")
    assert bench.verdict("small.rate_python", 300001, t).startswith("met")
    assert bench.verdict("no.such_target", 1.0, t) == "" and bench.verdict("kv.after_work", float("nan"), t) == ""


def test_stub_matches_the_module():
    tree = ast.parse(open(STUB).read())
    stubbed, methods = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stubbed.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            stubbed.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            methods[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | \
                {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    public = set(gpx.__all__) | {"__version__"}
    assert public - stubbed == set(), "not in the stub"
    assert {n for n in stubbed if n not in ("Memory", "Segments", "Pages")} - public == set(), "not in gpx"
    for cls in ("Conn", "Region", "Transfer", "HostBuffer"):
        real = {n for n in dir(getattr(gpx, cls)) if not n.startswith("_")}
        assert real == {n for n in methods[cls] if not n.startswith("_")}, cls
    assert set(gpx.Completion.__match_args__) == methods["Completion"]


def test_under_mps_looks_at_the_control_endpoint(tmp_path, monkeypatch):
    """The benches say MPS where the control daemon's endpoint is, as a named pipe (older
    drivers) or a socket (newer ones), and not for a plain file or an empty folder."""
    import socket
    from gpx import _workloads
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not _workloads._under_mps()
    (tmp_path / "control").write_text("")
    assert not _workloads._under_mps()
    os.unlink(tmp_path / "control")
    os.mkfifo(tmp_path / "control")
    assert _workloads._under_mps()
    os.unlink(tmp_path / "control")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "control"))
        assert _workloads._under_mps()
    finally:
        s.close()
