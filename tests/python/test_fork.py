"""fork(): a child is no client on its parent's connection, but shares its host buffers."""
import os

import numpy as np

import gpx


def test_fork(gpxd, conn):
    hb = gpx.host_alloc(1 << 20)
    v = np.frombuffer(hb, dtype=np.uint8)
    r = conn.register(hb)
    t = conn.copy(r, r, 4096, dst_offset=8192)     # outstanding across the fork, perhaps
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        # The child: every call fails with a clear error; its HostBuffer is the parent's memory.
        code = 0
        try:
            os.close(rfd)
            msgs = []
            for call in (lambda: conn.copy(r, r, 10), lambda: conn.poll(), lambda: conn.fileno(),
                         lambda: conn.register(hb), lambda: t.wait(), lambda: r.deregister()):
                try:
                    call()
                    msgs.append("no error")
                except gpx.ConnectionLostError as e:
                    msgs.append(str(e))
            if not all("parent process" in m for m in msgs):
                code = 2
            v[100000:100004] = [7, 7, 7, 7]
            conn.close()                      # closes the child's copies only
            with gpx.connect(gpxd.sock, name="child") as own:
                own.copy(own.register(hb), own.register(hb), 4, src_offset=100000, dst_offset=200000).wait()
            os.write(wfd, "\n".join(msgs).encode())
        except BaseException as e:
            os.write(wfd, repr(e).encode())
            code = 3
        finally:
            os._exit(code)
    os.close(wfd)
    msgs = b""
    while True:
        b = os.read(rfd, 4096)
        if not b:
            break
        msgs += b
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, msgs.decode()
    # What the child wrote, and what gpxd copied for the child, is in the shared mapping.
    assert list(v[100000:100004]) == [7] * 4 and list(v[200000:200004]) == [7] * 4
    # The parent's connection went on untouched by the child's close.
    assert t.wait() == 4096
    assert conn.copy(r, r, 4, src_offset=100000, dst_offset=300000).wait() == 4
    assert list(v[300000:300004]) == [7] * 4
