"""PyTorch: CPU tensors in host buffers (wherever torch is installed), and CUDA tensors between
two processes with real PyTorch allocators (skipped without a GPU): the default caching
allocator (legacy IPC, so gpxd trusts it here), expandable segments, gpx.torch_mem_pool();
tensors inside larger blocks; the same GPU and GPU 0 -> GPU 1; every byte checked (SHA-256
of each side's tensor, or checksums computed on the GPU where numpy is missing)."""
import json
import os
import random
import select
import subprocess
import sys

import pytest

import gpx
from conftest import HERE, Daemon, child_env

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (or no driver) here")
ALLOC_CONF = {"default": None, "expandable": "expandable_segments:True", "pool": None}


# ---- CPU tensors: host memory, read through data_ptr() ----

def test_cpu_tensor_in_a_host_buffer(conn):
    hb = gpx.host_alloc(1 << 16)
    t = torch.frombuffer(hb, dtype=torch.uint8)
    t[:4096] = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    src = conn.register(t[:4096], read_only=True)
    dst = conn.register(t[8192:16384].view(torch.int32))          # any dtype: its bytes
    assert src.kind == dst.kind == "host" and dst.length == 8192
    assert conn.copy(src, dst, dst_offset=100).wait() == 4096
    assert torch.equal(t[8292:8292 + 4096], t[:4096])
    pages = torch.tensor([0, 3], dtype=torch.int32)
    assert conn.copy_pages(src, dst, 1024, pages, torch.tensor([7, 6], dtype=torch.int32)).wait() == 2048
    assert torch.equal(t[8192 + 7 * 1024:8192 + 8 * 1024], t[:1024])
    with pytest.raises(ValueError, match="negative"):
        conn.copy_pages(src, dst, 1024, torch.tensor([-1], dtype=torch.int32), [0])
    with pytest.raises(TypeError, match="4-byte"):
        conn.copy_pages(src, dst, 1024, torch.tensor([1], dtype=torch.int64), [0])
    with pytest.raises(TypeError, match="4-byte"):
        conn.copy_pages(src, dst, 1024, torch.tensor([1.0], dtype=torch.float32), [0])
    assert conn.copyv(src, dst, torch.tensor([[0, 0, 8]], dtype=torch.int64)).wait() == 8
    # The dtypes of the lists met so far are kept: each still answers for its own size, its sign
    # (a uint32 list after the int32 ones: 4294967295, not -1) and the tensor for its layout.
    for _ in range(2):
        with pytest.raises(TypeError, match="4-byte"):
            conn.copy_pages(src, dst, 1024, torch.tensor([1], dtype=torch.int16), [0])
        with pytest.raises(ValueError, match="negative"):
            conn.copy_pages(src, dst, 1024, torch.tensor([-1], dtype=torch.int32), [0])
        with pytest.raises(Exception) as e:
            conn.copy_pages(src, dst, 1024, torch.tensor([-1], dtype=torch.int32).view(torch.uint32), [0]).wait()
        assert "negative" not in str(e.value)
        with pytest.raises(ValueError, match="contiguous"):
            conn.copy_pages(src, dst, 1024, torch.tensor([3, 9, 0, 9], dtype=torch.int32)[::2], [6, 7])
        assert conn.copy_pages(src, dst, 1024, torch.tensor([3, 0], dtype=torch.int32), [6, 7]).wait() == 2048


def test_cpu_tensors_gpxd_cannot_map(conn):
    with pytest.raises(ValueError, match="host_alloc"):
        conn.register(torch.zeros(4096, dtype=torch.uint8))
    hb = gpx.host_alloc(1 << 16)
    t = torch.frombuffer(hb, dtype=torch.uint8).view(256, 256)
    with pytest.raises(ValueError, match="contiguous"):
        conn.register(t[:, :128])
    with pytest.raises(ValueError, match="no bytes"):
        conn.register(t[:0])


def test_dlpack_cpu_tensor_in_a_host_buffer(conn):
    class OnlyDLPack:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    hb = gpx.host_alloc(1 << 16)
    t = torch.frombuffer(hb, dtype=torch.uint8)
    t[:100] = 9
    r = conn.register(OnlyDLPack(t[:1000]), read_only=True)
    d = conn.register(OnlyDLPack(t[5000:6000]))
    assert r.length == d.length == 1000
    conn.copy(r, d).wait()
    assert torch.equal(t[5000:5100], t[:100])
    with pytest.raises(ValueError, match="host_alloc"):
        conn.register(OnlyDLPack(torch.zeros(10)))


# ---- CUDA tensors in this process ----

@pytest.fixture(scope="module")
def trusting_gpxd():
    """gpxd that accepts legacy CUDA IPC handles (PyTorch's default allocator)."""
    d = Daemon("[cuda]\ntrust_legacy_ipc = yes\n")
    yield d
    d.cleanup()


@cuda
def test_cuda_tensors_in_this_process(trusting_gpxd):
    with gpx.connect(trusting_gpxd.sock, name="torch-local") as c:
        g = torch.Generator(device="cuda").manual_seed(7)
        a = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda", generator=g)
        b = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        ra, rb = c.register(a, read_only=True), c.register(b[1 << 20:])
        # This process's allocator mode decides the kind: expandable segments are VMM memory.
        expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        assert ra.kind == ("cuda-vmm" if expandable else "cuda-ipc") and rb.length == 2 << 20
        assert c.copy(ra, rb, 1 << 20, src_offset=12345).wait() == 1 << 20
        assert torch.equal(b[1 << 20:2 << 20], a[12345:12345 + (1 << 20)])

        class OnlyCAI:
            def __init__(self, t):
                self.__cuda_array_interface__ = t.__cuda_array_interface__

        class OnlyDLPack:
            def __init__(self, t):
                self.t = t

            def __dlpack__(self, stream=None):
                return self.t.__dlpack__()

        rc = c.register(OnlyCAI(a[4096:8192]), read_only=True)
        rd = c.register(OnlyDLPack(b[:4096]))
        assert rc.length == rd.length == 4096
        c.copy(rc, rd).wait()
        assert torch.equal(b[:4096], a[4096:8192])
        with pytest.raises(ValueError, match="contiguous"):
            c.register(a.view(1024, 3072)[:, :100])
        with pytest.raises(ValueError, match="contiguous"):
            c.register(OnlyCAI(a.view(1024, 3072)[:, :100]))


@cuda
def test_torch_mem_pool_tensors_are_cuda_vmm(gpxd):
    # No trust in legacy handles needed: the pool's memory is exportable VMM memory.
    pool = gpx.torch_mem_pool()
    try:
        with torch.cuda.use_mem_pool(pool):
            a = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, device="cuda")
            b = torch.zeros(5 << 20, dtype=torch.uint8, device="cuda")
    except RuntimeError as e:
        pytest.fail("allocating from gpx.torch_mem_pool() failed: %s (gpx_torch_alloc: %s)"
                    % (e, gpx._gpx._torch_alloc_error()))
    torch.cuda.synchronize()
    with gpx.connect(gpxd.sock, name="torch-pool") as c:
        ra, rb = c.register(a[100:]), c.register(b)
        assert ra.kind == rb.kind == "cuda-vmm", (ra.kind, gpx._gpx._torch_alloc_error())
        assert c.copy(ra, rb, (5 << 20) - 100).wait() == (5 << 20) - 100
        assert torch.equal(b[:(5 << 20) - 100], a[100:])


# ---- two processes ----

class Peer:
    """A torch_peer.py process with its own allocator configuration."""

    def __init__(self, alloc):
        env = child_env()
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if ALLOC_CONF[alloc]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[alloc]
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "torch_peer.py")], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, timeout=120, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        line = self.p.stdout.readline() if r else ""
        if not line:
            self.p.kill()
            raise AssertionError("torch peer gave no answer to %s (exit %s)" % (req, self.p.poll()))
        return json.loads(line)

    def ok(self, **req):
        a = self.ask(**req)
        assert "error" not in a, (req, a)
        return a

    def close(self):
        if self.p.poll() is None:
            try:
                self.ask(op="quit", timeout=30)
            except AssertionError:
                pass
            self.p.wait(30)


SHAPES = [("whole", 6 << 20), ("view", 3 << 20), ("second", 256 << 10), ("span", 48 << 20)]


def pair(sock, alloc, devs):
    owner, peer = Peer(alloc), Peer(alloc)
    try:
        info = owner.ok(op="init", socket=sock, device=devs[0], alloc=alloc)
        if info["devices"] <= max(devs):
            pytest.skip("one GPU here: GPU 0 -> GPU 1 needs two")
        peer.ok(op="init", socket=sock, device=devs[1], alloc=alloc)
        made, failed = {}, []
        for i, (shape, n) in enumerate(SHAPES):
            key, name = shape, "py.torch.%s.%s.%d%d" % (alloc, shape, devs[0], devs[1])
            made[key] = owner.ok(op="make", key=key, shape=shape, nbytes=n, seed=100 + i)
            reg = owner.ask(op="register", key=key, export=name)
            if "error" in reg:
                failed.append("%s tensor of %d bytes: %s: %s" % (shape, n, reg["error"], reg["reason"]))
                continue
            want_kind = "cuda-ipc" if alloc == "default" else "cuda-vmm"
            assert reg["kind"] == want_kind and reg["length"] == n, (shape, reg)
            # pull: the peer reads the owner's tensor into a tensor of its own
            peer.ok(op="import", key="their-" + key, name=name)
            peer.ok(op="make", key="mine-" + key, shape="whole", nbytes=n, seed=1)
            peer.ok(op="register", key="mine-" + key)
            assert peer.ok(op="copy", src="their-" + key, dst="mine-" + key)["bytes"] == n
            assert peer.ok(op="sha", key="mine-" + key)["sha"] == made[key]["sha"], (alloc, shape, "pull")
            if shape == "whole":
                # pages by number from a table in the peer's GPU memory: every page, shuffled
                page, npg = 4096, n // 4096
                perm = random.Random(5).sample(range(npg), npg)
                got = peer.ok(op="copy_table", src="their-" + key, dst="mine-" + key, page=page,
                              src_pages=perm, dst_pages=list(range(npg)))
                assert got["bytes"] == n, got
                want = owner.ok(op="sha", key=key, page=page, pages=perm)["sha"]
                assert peer.ok(op="sha", key="mine-" + key)["sha"] == want, (alloc, "pages from a table")
            # push: the peer writes fresh bytes into the owner's tensor
            pushed = peer.ok(op="make", key="new-" + key, shape="whole", nbytes=n, seed=200 + i)
            peer.ok(op="register", key="new-" + key)
            assert peer.ok(op="copy", src="new-" + key, dst="their-" + key)["bytes"] == n
            assert owner.ok(op="sha", key=key)["sha"] == pushed["sha"], (alloc, shape, "push")
        if alloc == "default":
            # Inside larger cudaMalloc blocks: the registration named base + offset.
            assert made["view"]["offset"] > 0 and made["second"]["offset"] > 0, made
        return failed
    finally:
        owner.close()
        peer.close()


@cuda
@pytest.mark.parametrize("devs", [(0, 0), (0, 1)], ids=["same-gpu", "gpu0-to-gpu1"])
@pytest.mark.parametrize("alloc", ["default", "pool"])
def test_two_processes(trusting_gpxd, alloc, devs):
    failed = pair(trusting_gpxd.sock, alloc, devs)
    assert not failed, failed


@cuda
@pytest.mark.parametrize("devs", [(0, 0), (0, 1)], ids=["same-gpu", "gpu0-to-gpu1"])
def test_two_processes_expandable_segments(trusting_gpxd, devs):
    failed = pair(trusting_gpxd.sock, "expandable", devs)
    if failed:
        pytest.fail("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: registering tensors failed "
                    "(a tensor there may span several cuMemCreate pieces of one reservation, and "
                    "gpx_register_cuda must register all of them): " + "; ".join(failed))
