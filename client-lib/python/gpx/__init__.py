"""gpx: move GPU and host memory between the processes of a node, through gpxd.

A client connects to gpxd, hands it memory once (CUDA tensors and arrays, or host memory from
gpx.host_alloc), shares it under a name or imports another process's, and then asks gpxd to
copy between regions; each copy ends in one completion::

    import gpx, torch

    with gpx.connect(name="decode-7") as conn:
        kv = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        mine = conn.register(kv)                     # a Region; kv is kept alive by it
        theirs = conn.import_("prefill-3.kv")        # another process's export
        conn.copy(theirs, mine, 4096, src_offset=8192).wait()
        t = conn.copy_pages(theirs, mine, 65536, src_blocks, dst_blocks)
        await t                                      # in a coroutine: asyncio watches conn.fileno()

Errors raise gpx.Error subclasses named after gpx's codes (gpx.AccessError, gpx.RangeError,
...), with .code and gpxd's own .reason.  Calls that can block release the GIL.  This package
imports neither torch nor numpy nor cupy: their objects are read through their attributes
(data_ptr(), __cuda_array_interface__, __dlpack__, the buffer protocol).

The C half is the extension gpx._gpx (CPython's stable ABI, 3.11 and later) over
libgpxclient; gpx-python(3) is the manual page.
"""
import functools
import os
import sys
import threading

from . import _gpx
from ._gpx import (  # noqa: F401  (the module's API, re-exported)
    API_VERSION, DEFAULT_SOCKET, Batch, Completion, Conn, HostBuffer, Region, Transfer, __version__,
    host_alloc, strerror,
    Error, ProtocolError, VersionError, InvalidError, NotFoundError, AccessError, RangeError,
    BusyError, QuotaError, BadFdError, NoMemoryError, CanceledError, RevokedError, ExistsError,
    NotSupportedError, CopyError, ShutdownError, DrainingError, NotAdminError,
    ConnectionLostError, TimeoutError, SysError,
    EPROTO, EVERSION, EINVAL, ENOENT, EACCES, ERANGE, EBUSY, EQUOTA, EBADFD, ENOMEM, ECANCELED,
    EREVOKED, EEXIST, ENOTSUP, EIO, ESHUTDOWN, EDRAINING, EPERM, ECONN, ETIMEDOUT, ESYS,
)

__all__ = [
    "connect", "host_alloc", "strerror", "torch_mem_pool",
    "Conn", "Region", "Batch", "Transfer", "Completion", "HostBuffer",
    "Error", "ProtocolError", "VersionError", "InvalidError", "NotFoundError", "AccessError",
    "RangeError", "BusyError", "QuotaError", "BadFdError", "NoMemoryError", "CanceledError",
    "RevokedError", "ExistsError", "NotSupportedError", "CopyError", "ShutdownError",
    "DrainingError", "NotAdminError", "ConnectionLostError", "TimeoutError", "SysError",
    "EPROTO", "EVERSION", "EINVAL", "ENOENT", "EACCES", "ERANGE", "EBUSY", "EQUOTA", "EBADFD",
    "ENOMEM", "ECANCELED", "EREVOKED", "EEXIST", "ENOTSUP", "EIO", "ESHUTDOWN", "EDRAINING",
    "EPERM", "ECONN", "ETIMEDOUT", "ESYS",
    "API_VERSION", "DEFAULT_SOCKET",
]


def connect(socket=None, name=None):
    """connect(socket=None, name=None) -> Conn

    Connects to gpxd at socket (default: $GPX_SOCKET, else gpx.DEFAULT_SOCKET), the GIL
    released while it does.  name is what gpxctl shows for this client (default: the
    program's name).  The Conn is a context manager that closes on exit.
    """
    if name is None:
        name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return _gpx.connect(socket, name)


def torch_mem_pool(device=None):
    """torch_mem_pool(device=None) -> torch.cuda.MemPool

    A PyTorch memory pool whose blocks are VMM memory exportable as POSIX fds, allocated by this
    module (gpx_torch_alloc / gpx_torch_free through torch.cuda.memory.CUDAPluggableAllocator).
    Tensors allocated under ``with torch.cuda.use_mem_pool(pool):`` register as 'cuda-vmm'
    regions: capabilities by possession, which gpxd accepts on multi-tenant nodes, where
    PyTorch's default allocator gives 'cuda-ipc' regions (legacy handles, accepted only with
    trust_legacy_ipc).  device (default: the current one) is checked for VMM support with
    POSIX-fd handles; gpx.NotSupportedError says why not.  Needs PyTorch 2.5 or later.
    """
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError("torch_mem_pool: %s is not a CUDA device" % dev)
    _gpx._vmm_check(dev.index if dev.index is not None else torch.cuda.current_device())
    alloc = torch.cuda.memory.CUDAPluggableAllocator(_gpx.__file__, "gpx_torch_alloc", "gpx_torch_free")
    return torch.cuda.MemPool(alloc.allocator())


# ---- asyncio: `await transfer` ----

class _Watcher:
    """The transfers awaited on one Conn in one event loop: the loop watches the Conn's fd
    while at least one is awaited, and its reader routes what arrives (Conn._drain), which
    calls back _resolved for each awaited transfer."""

    def __init__(self, loop, conn):
        self.loop = loop
        self.fd = conn.fileno()
        self.thread = threading.get_ident()
        self.futures = {}
        self.reading = False
        self.closed = False

    def watch(self, conn, t, fut):
        # The transfer is kept here until it resolves: `await conn.copy(...)` holds only the
        # future, and a Transfer that dies leaves its completion to poll().
        self.futures[t.tag] = (fut, t)
        fut.add_done_callback(functools.partial(self._forget, t.tag))
        if not self.reading:
            self.loop.add_reader(self.fd, conn._drain)
            self.reading = True

    def _resolved(self, t):
        # Called by the extension, in whichever thread routed the completion.
        if threading.get_ident() != self.thread:
            self.loop.call_soon_threadsafe(self._resolved, t)
            return
        fut, _ = self.futures.pop(t.tag, (None, None))
        if fut is not None and not fut.done():
            _settle(fut, t)
        self._idle()

    def _forget(self, tag, fut):
        # A future cancelled (or settled): its transfer no longer keeps the fd watched.
        if self.futures.get(tag, (None,))[0] is fut:
            del self.futures[tag]
        self._idle()

    def _idle(self):
        if not self.futures and self.reading and not self.closed:
            self.reading = False
            if not self.loop.is_closed():
                self.loop.remove_reader(self.fd)

    def close(self):
        # Conn.close() calls this before the fd closes.
        if self.reading and not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
        self.reading = False
        self.closed = True


def _settle(fut, t):
    try:
        fut.set_result(t.wait(0))
    except Exception as e:  # gpx.Error of the transfer, as wait() raises it
        fut.set_exception(e)


def _await_transfer(t):
    # `await transfer`: the extension's am_await slot calls this.
    import asyncio

    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    if t.done():
        _settle(fut, t)
        return fut.__await__()
    conn = t.conn
    w = conn._aio
    if w is None or w.loop is not loop or w.closed:
        if w is not None and w.futures and not w.closed:
            raise RuntimeError("a gpx.Conn's transfers are awaited in one event loop at a time")
        w = conn._aio = _Watcher(loop, conn)
    # Claimed first, then looked at: a completion read meanwhile (by done() or by another
    # thread) goes to the waker, never to the backlog.
    t._waker = w._resolved
    if t.done():
        t._waker = None
        _settle(fut, t)
    else:
        w.watch(conn, t, fut)
    return fut.__await__()


_gpx._set_await_hook(_await_transfer)
