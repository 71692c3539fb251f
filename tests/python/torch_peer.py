"""A process of the GPU tests (test_torch.py): PyTorch with the allocator its environment asks
for (PYTORCH_CUDA_ALLOC_CONF is set before torch is imported), driven by JSON lines on stdin,
answering one JSON line each on stdout.

    {"op": "init", "socket": S, "device": 0, "alloc": "default" | "expandable" | "pool"}
    {"op": "make", "key": K, "shape": "whole" | "view" | "second" | "span", "nbytes": N, "seed": S}
        -> {"sha": ..., "offset": where the tensor starts in its allocator segment}
    {"op": "register", "key": K, "export": NAME or null}     -> {"kind": ..., "length": ...}
    {"op": "import", "key": K, "name": NAME}                  -> {"kind": ..., "length": ...}
    {"op": "copy", "src": K, "dst": K}                        -> {"bytes": ...}
    {"op": "sha", "key": K}                                   -> {"sha": ...}
    {"op": "quit"}
An error answers {"error": class name, "reason": ..., "code": ...}.
"""
import hashlib
import json
import sys
import traceback


def main():
    import gpx
    import torch

    conn = pool = dev = None
    tensors, regions, keep = {}, {}, []

    def sha(t):
        # SHA-256 of the bytes where numpy is there to read them out; else position-weighted
        # sums computed on the GPU (both processes of a test run the same way).
        torch.cuda.synchronize(dev)
        try:
            import numpy  # noqa: F401
            return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
        except ImportError:
            x = t.detach().reshape(-1).view(torch.uint8).to(torch.int64)
            i = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
            sums = (x.sum(), (x * (i % 65521 + 1)).sum(), (x * ((i * 2654435761) % 1000003 + 1)).sum())
            return "%d:%s" % (x.numel(), ":".join(str(int(v)) for v in sums))

    def empty(n):
        if pool is not None:
            with torch.cuda.use_mem_pool(pool, device=dev):
                return torch.empty(n, dtype=torch.uint8, device=dev)
        return torch.empty(n, dtype=torch.uint8, device=dev)

    def segment_offset(t):
        p = t.data_ptr()
        for s in torch.cuda.memory_snapshot():
            if s["address"] <= p < s["address"] + s["total_size"]:
                return p - s["address"]
        return -1

    def make(shape, n):
        if shape == "whole":
            return empty(n)
        if shape == "view":               # a view into a larger tensor
            big = empty(4 * n)
            keep.append(big)
            return big[n:2 * n]
        if shape == "second":             # not the first tensor of its allocator block
            first = empty(n)
            keep.append(first)
            return empty(n)
        if shape == "span":               # after a small tensor: crosses allocator pieces
            keep.append(empty(1 << 20))
            return empty(n)
        raise ValueError(shape)

    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "init":
                dev = torch.device("cuda", req["device"])
                torch.cuda.set_device(dev)
                if req["alloc"] == "pool":
                    pool = gpx.torch_mem_pool(dev)
                conn = gpx.connect(req["socket"], name="torch-peer")
                ans = {"devices": torch.cuda.device_count(), "torch": torch.__version__}
            elif op == "make":
                t = make(req["shape"], req["nbytes"])
                g = torch.Generator(device=dev).manual_seed(req["seed"])
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=dev, generator=g))
                tensors[req["key"]] = t
                ans = {"sha": sha(t), "offset": segment_offset(t), "ptr": t.data_ptr()}
            elif op == "register":
                r = conn.register(tensors[req["key"]])
                regions[req["key"]] = r
                if req.get("export"):
                    conn.export(r, req["export"], rule="any")
                ans = {"kind": r.kind, "length": r.length}
            elif op == "import":
                r = conn.import_(req["name"])
                regions[req["key"]] = r
                ans = {"kind": r.kind, "length": r.length}
            elif op == "copy":
                ans = {"bytes": conn.copy(regions[req["src"]], regions[req["dst"]]).wait(timeout=60)}
            elif op == "copy_table":
                # pages by number, the numbers in a (2, n) int32 tensor of this process's GPU
                sp, dp = req["src_pages"], req["dst_pages"]
                if pool is not None:
                    with torch.cuda.use_mem_pool(pool, device=dev):
                        tab = torch.tensor([sp, dp], dtype=torch.int32, device=dev)
                else:
                    tab = torch.tensor([sp, dp], dtype=torch.int32, device=dev)
                torch.cuda.synchronize(dev)
                rt = conn.register(tab)
                n = conn.copy_pages_table(regions[req["src"]], regions[req["dst"]], req["page"], rt,
                                          len(sp)).wait(timeout=60)
                rt.deregister()
                ans = {"bytes": n, "kind": rt.kind}
            elif op == "sha":
                t = tensors[req["key"]]
                if "pages" in req:         # those pages of it, in that order
                    t = t.view(-1, req["page"]).index_select(0, torch.tensor(req["pages"], device=t.device))
                ans = {"sha": sha(t)}
            elif op == "quit":
                if conn is not None:       # (a peer told to quit before init has none)
                    conn.close()
                print(json.dumps({}), flush=True)
                return 0
            else:
                raise ValueError(op)
        except gpx.Error as e:
            ans = {"error": type(e).__name__, "reason": e.reason, "code": e.code}
        except Exception as e:
            ans = {"error": type(e).__name__, "reason": "".join(traceback.format_exception_only(e)).strip()}
        print(json.dumps(ans), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
