#!/usr/bin/env python3
# etcd-hold.py: a TCP proxy between one gpxd and etcd's JSON gateway (plain HTTP/1.1) that
# holds back the transactions on keys under .../names/, the calls on leases, and range reads,
# of the kinds MODE_FILE names for a set time before it passes them on, and relays everything
# else at once, both ways.  Used by tests/cluster-race.test to make a name's claim or delete
# arrive late, in a known order, and by tests/cluster-own-key.test to keep a read of every
# key in flight.
#
#   etcd-hold.py LISTEN_PORT ETCD_PORT HOLD_SECONDS LOG MODE_FILE
#
# MODE_FILE, read at each request, holds the kinds to hold back: "delete" (a transaction
# deleting a name's key: a withdrawal), "claim" (one putting it), "revoke" (the revoke of a
# lease, KEY "lease": gpxd's stop), "ttl" (a lease's time to live asked, KEY "lease": gpxctl
# cluster), "range" (a range read, KEY its first key: "P/" for every key under prefix P, as a
# join and a read of every key again ask), any of them, or none (no file).  KIND:SECONDS holds
# that kind for SECONDS rather than HOLD_SECONDS: longer than gpxd waits for its answer, a
# request is carried out by etcd after gpxd has given it up.
# It listens on 127.0.0.1:LISTEN_PORT and appends a line to LOG for each name key, lease call
# or range it sees in a request, with the time (time.monotonic(), seconds):
#   T listening
#   T pass OP KEY        a request of kind OP (claim, delete, revoke, ttl, range) on KEY went on to etcd
#   T hold OP KEY        ... came, and is held for HOLD_SECONDS (or its KIND:SECONDS)
#   T release OP KEY     ... and went on to etcd now
# Requests are read whole (headers, then Content-Length bytes) before they go on; a request
# of another shape (chunked) ends the parsing of its connection, whose bytes are then relayed
# as they come.  curl sends one request at a time on a connection, so a held request holds
# nothing but its own connection: curl opens another for the calls made meanwhile.  A client
# that closes its connection leaves what it sent to go on: the connection to etcd is shut
# once etcd has answered (or after 5 s), as etcd may drop a request whose client is gone.
import base64
import json
import socket
import sys
import threading
import time

listen_port, etcd_port, hold_s, log_path, mode_path = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                                       sys.argv[4], sys.argv[5])
log_lock = threading.Lock()


def log(what):
    with log_lock, open(log_path, "a") as f:
        f.write("%.3f %s\n" % (time.monotonic(), what))


def name_keys(body, op):
    """The keys under .../names/ that a transaction's success list gives to op."""
    try:
        t = json.loads(body)
        keys = [base64.b64decode(o[op]["key"]).decode() for o in t.get("success", []) if op in o]
    except (ValueError, KeyError, TypeError, AttributeError):
        return []
    return [k for k in keys if "/names/" in k]


def range_key(body):
    """The first key of a range read, or "?" where the body does not say."""
    try:
        return base64.b64decode(json.loads(body)["key"]).decode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


def holding():
    """The kinds of request to hold back now: {kind: seconds}."""
    try:
        with open(mode_path) as f:
            words = f.read().split()
    except OSError:
        return {}
    kinds = {}
    for w in words:
        k, _, t = w.partition(":")
        kinds[k] = float(t) if t else hold_s
    return kinds


def relay(src, dst):
    """The bytes of src to dst as they come (etcd's answers; a client's bytes once they are not
    parsed); then both ends shut."""
    try:
        while True:
            b = src.recv(65536)
            if not b:
                break
            dst.sendall(b)
    except OSError:
        pass
    for s in (dst, src):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def read_request(cli, buf):
    """One whole request from cli (bytes already read in buf): (request, rest), or (None, buf)
    at the end of the stream or for a request this does not parse."""
    while b"\r\n\r\n" not in buf:
        b = cli.recv(65536)
        if not b:
            return None, buf
        buf += b
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = None
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v.strip())
        elif k.strip().lower() == b"transfer-encoding":
            return None, buf
    if length is None:
        length = 0
    while len(rest) < length:
        b = cli.recv(65536)
        if not b:
            return None, buf
        rest += b
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


def serve(cli):
    try:
        up = socket.create_connection(("127.0.0.1", etcd_port))
    except OSError:
        cli.close()
        return
    answers = threading.Thread(target=relay, args=(up, cli), daemon=True)
    answers.start()
    buf = b""
    try:
        while True:
            rq, buf = read_request(cli, buf)
            if rq is None:
                break
            body = rq.partition(b"\r\n\r\n")[2]
            ops = [("claim", k) for k in name_keys(body, "request_put")] + \
                [("delete", k) for k in name_keys(body, "request_delete_range")]
            path = rq.split(b" ", 2)[1]
            if path == b"/v3/lease/revoke":
                ops.append(("revoke", "lease"))
            elif path == b"/v3/lease/timetolive":
                ops.append(("ttl", "lease"))
            elif path == b"/v3/kv/range":
                ops.append(("range", range_key(body)))
            kinds = holding()
            hold = max([kinds[op] for op, _ in ops if op in kinds], default=None)
            for op, k in ops:
                log("%s %s %s" % ("pass" if hold is None else "hold", op, k))
            if hold is not None:
                time.sleep(hold)
                for op, k in ops:
                    log("release %s %s" % (op, k))
            up.sendall(rq)
        if buf:
            up.sendall(buf)
    except OSError:
        pass
    if not buf:
        answers.join(5)   # the client gone: etcd's answer to what it sent, which ends the relay
    relay(cli, up)        # the rest, unparsed (at once over, where the connection failed)


def main():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", listen_port))
    srv.listen(64)
    log("listening")
    while True:
        cli, _ = srv.accept()
        threading.Thread(target=serve, args=(cli,), daemon=True).start()


main()
