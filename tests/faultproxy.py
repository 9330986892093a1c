"""A fault-injecting HTTP/1.1 reverse proxy for tests: tierfs -> proxy -> Ceph RGW, with faults switched at run time.

It runs in its own process (never sharing the GIL with pytest or the daemon), listens on a free 127.0.0.1 port and
forwards every request to one upstream S3 endpoint, streaming bodies in 64 KiB pieces in both directions (a 16 MiB
PUT or GET is never held in memory). The Host header is forwarded unchanged, so SigV4 signatures made for the
proxy's address verify at the upstream (path-style addressing).

Faults (one mode at a time, applied to requests that match `methods`, each with `probability`, for at most `count`
faults after which the mode falls back to pass):

    pass       forward untouched
    latency    sleep `latency_ms` before forwarding each request
    error      answer `status` (500 or 503) with an S3 XML error body (`code`: InternalError, SlowDown, ...)
    reset      TCP RST (SO_LINGER 0): `phase` "request" = before forwarding (the upstream never sees it), or
               "response" = after the upstream answered: before the answer's headers when it has no body (a PUT
               happened, its answer is lost), else after half of the body
    truncate   forward, keep the upstream's Content-Length, send `fraction` of the body, then close the connection
    corrupt    forward, flip one byte in the middle of the body (same length: only a checksum can tell)
    stall      accept and read the request, answer nothing until the mode changes (then close the connection)
    pause      forward; a body longer than `pause_after` bytes stops after that many until the mode changes
               (at most 60 s), then goes on: a GET that is slow in its middle

Control, on the proxy's own port (bucket names cannot start with '_', so it never shadows S3):

    POST /_fault/mode   JSON {"mode": ..., "latency_ms": .., "status": .., "code": .., "phase": .., "fraction": ..,
                              "probability": .., "count": .., "methods": [..]} -> the new settings
    GET  /_fault/mode   the current settings
    GET  /_fault/stats  {"requests": n, "faults": {mode: n}, "active": requests in flight, "bytes_up": .., ...}

Command line: `python faultproxy.py --upstream http://127.0.0.1:7480 [--port 0]` prints "LISTENING <port>" once it
accepts connections. In tests, the `fault_proxy` fixture (below) starts it, gives a `FaultProxy` client, and kills
it by PID at teardown.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import random
import select
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

CONTROL_PREFIX = "/_fault/"
MODES = ("pass", "latency", "error", "reset", "truncate", "corrupt", "stall", "pause")
PIECE = 64 * 1024
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
               "trailer", "trailers", "transfer-encoding", "upgrade", "expect"}
_DEFAULTS: dict[str, Any] = {"mode": "pass", "latency_ms": 0, "status": 503, "code": "SlowDown", "phase": "request",
                             "fraction": 0.5, "probability": 1.0, "count": None, "methods": None,
                           "pause_after": 0}


class Faults:
    """The current fault settings and counters, shared by all connection threads."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.settings = dict(_DEFAULTS)
        self.epoch = 0  # bumped on every change: a stalled request ends when it moves
        self.requests = 0
        self.active = 0
        self.faults: dict[str, int] = {m: 0 for m in MODES if m != "pass"}
        self.bytes_up = 0
        self.bytes_down = 0
        self.rng = random.Random(int(os.environ.get("FAULTPROXY_SEED", "0")) or None)

    def update(self, new: dict[str, Any]) -> dict[str, Any]:
        unknown = set(new) - set(_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(sorted(unknown))}; known: {', '.join(_DEFAULTS)}")
        s = dict(_DEFAULTS)
        s.update(new)
        if s["mode"] not in MODES:
            raise ValueError(f"mode {s['mode']!r}: allowed {', '.join(MODES)}")
        if s["phase"] not in ("request", "response"):
            raise ValueError(f"phase {s['phase']!r}: allowed request, response")
        if not 0.0 <= float(s["probability"]) <= 1.0 or not 0.0 <= float(s["fraction"]) < 1.0:
            raise ValueError("probability must be in [0, 1] and fraction in [0, 1)")
        if s["methods"] is not None:
            s["methods"] = [m.upper() for m in s["methods"]]
        with self.cond:
            self.settings = s
            self.epoch += 1
            self.cond.notify_all()
        return s

    def pick(self, method: str) -> dict[str, Any] | None:
        """The settings to apply to this request if it gets a fault (latency counts as one), else None."""
        with self.cond:
            self.requests += 1
            s = self.settings
            if s["mode"] == "pass":
                return None
            if s["methods"] is not None and method not in s["methods"]:
                return None
            if self.rng.random() >= float(s["probability"]):
                return None
            if s["count"] is not None:
                if s["count"] <= 0:
                    return None
                s["count"] -= 1
            self.faults[s["mode"]] += 1
            return dict(s, epoch=self.epoch)

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"requests": self.requests, "faults": dict(self.faults), "active": self.active,
                    "bytes_up": self.bytes_up, "bytes_down": self.bytes_down, "settings": dict(self.settings)}


class _Abort(Exception):
    """End this client connection now (the fault already did what it had to)."""


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ProxyServer

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: tests read stats, not access logs
        return

    def handle_expect_100(self) -> bool:
        return True  # answered in _send_upstream, only once the body is really wanted

    # ---------------------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        faults = self.server.faults
        with faults.cond:
            faults.active += 1
        try:
            if self.path.startswith(CONTROL_PREFIX):
                self._control()
                return
            fault = faults.pick(self.command)
            try:
                self._proxy(fault)
            except _Abort:
                self.close_connection = True
        finally:
            with faults.cond:
                faults.active -= 1

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = do_OPTIONS = _dispatch

    def _control(self) -> None:
        faults = self.server.faults
        what = self.path[len(CONTROL_PREFIX):].split("?", 1)[0]
        try:
            if what == "mode" and self.command == "POST":
                n = int(self.headers.get("Content-Length") or 0)
                body = faults.update(json.loads(self.rfile.read(n) or b"{}"))
            elif what == "mode":
                body = faults.stats()["settings"]
            elif what == "stats":
                body = faults.stats()
            else:
                raise KeyError(what)
            self._reply(200, json.dumps(body).encode(), "application/json")
        except (ValueError, KeyError) as e:
            self._reply(400, json.dumps({"error": str(e)}).encode(), "application/json")

    def _reply(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    # ---------------------------------------------------------------------------- faults

    def _reset(self) -> None:
        """Abort the client connection with a TCP RST."""
        try:
            self.wfile.flush()
        except OSError:
            pass
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.server.no_fin.add(id(self.connection))  # close without the FIN a shutdown would send first
        raise _Abort

    def _stall(self, epoch: int) -> None:
        """Answer nothing until the settings change or the client gives up."""
        faults = self.server.faults
        while True:
            with faults.cond:
                if faults.epoch != epoch:
                    break
                faults.cond.wait(0.2)
            r, _, _ = select.select([self.connection], [], [], 0)
            if r:
                try:
                    if not self.connection.recv(1, socket.MSG_PEEK):
                        break  # the client closed (its read timeout)
                except OSError:
                    break
        raise _Abort

    def _wait_for_change(self, epoch: int, limit: float) -> None:
        """Block until the settings change (or `limit` seconds pass)."""
        faults = self.server.faults
        deadline = time.monotonic() + limit
        with faults.cond:
            while faults.epoch == epoch and time.monotonic() < deadline:
                faults.cond.wait(0.2)

    def _error(self, status: int, code: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected by faultproxy'
                f'</Message><Resource>{self.path.split("?", 1)[0]}</Resource><RequestId>faultproxy-'
                f'{self.server.faults.requests}</RequestId></Error>').encode()
        expects = self.headers.get("Expect", "").lower() == "100-continue"
        if not expects:
            self._drain_body()
        else:
            self.close_connection = True  # the body was never sent: the connection cannot be reused
        extra = {"Retry-After": "0"} if status == 503 else {}
        if expects:
            extra["Connection"] = "close"
        self._reply(status, body, "application/xml", extra)

    # ---------------------------------------------------------------------------- forwarding

    def _body_kind(self) -> tuple[str, int]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return "chunked", -1
        return "length", int(self.headers.get("Content-Length") or 0)

    def _drain_body(self) -> None:
        kind, n = self._body_kind()
        if kind == "chunked":
            for _ in self._chunks():
                pass
            return
        while n > 0:
            got = self.rfile.read(min(PIECE, n))
            if not got:
                raise _Abort
            n -= len(got)

    def _chunks(self):
        """Raw chunked-encoding pieces of the request body, framing included (forwarded as is)."""
        while True:
            line = self.rfile.readline(1024)
            if not line:
                raise _Abort
            yield line
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:
                    trailer = self.rfile.readline(1024)
                    yield trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        return
            left = size + 2
            while left > 0:
                got = self.rfile.read(min(PIECE, left))
                if not got:
                    raise _Abort
                left -= len(got)
                yield got

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self, "_up", None)
        if conn is None:
            host, port = self.server.upstream
            conn = self._up = http.client.HTTPConnection(host, port, timeout=300)
        return conn

    def _send_upstream(self) -> http.client.HTTPResponse:
        kind, n = self._body_kind()
        for attempt in (1, 2):
            conn = self._upstream()
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP_BY_HOP or (k.lower() == "transfer-encoding" and kind == "chunked"):
                        conn.putheader(k, v)
                conn.endheaders()
                break
            except OSError:
                conn.close()
                if attempt == 2:
                    raise
        if self.headers.get("Expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        if kind == "chunked":
            for piece in self._chunks():
                conn.send(piece)
                self.server.faults.bytes_up += len(piece)
        else:
            while n > 0:
                got = self.rfile.read(min(PIECE, n))
                if not got:
                    conn.close()
                    raise _Abort
                conn.send(got)
                n -= len(got)
                self.server.faults.bytes_up += len(got)
        return conn.getresponse()

    def _proxy(self, fault: dict[str, Any] | None) -> None:
        mode = fault["mode"] if fault else "pass"
        if mode == "latency":
            time.sleep(fault["latency_ms"] / 1000.0)
        elif mode == "error":
            self._error(int(fault["status"]), str(fault["code"]))
            return
        elif mode == "reset" and fault["phase"] == "request":
            self._reset()
        elif mode == "stall":
            self._stall(fault["epoch"])
        try:
            resp = self._send_upstream()
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, (ConnectionError, http.client.HTTPException)):
                self._up.close()
            print(f"faultproxy: upstream failed for {self.command} {self.path}: {e!r}", file=sys.stderr, flush=True)
            self._reply(502, f"upstream failed: {e}".encode(), "text/plain", {"Connection": "close"})
            self.close_connection = True
            return
        self._relay(resp, mode, fault)

    def _relay(self, resp: http.client.HTTPResponse, mode: str, fault: dict[str, Any] | None) -> None:
        length = resp.getheader("Content-Length")
        chunked = length is None and self.command != "HEAD" and resp.status not in (204, 304) and \
            resp.chunked
        if mode == "reset" and not chunked and (self.command == "HEAD" or not int(length or 0)):
            self._up.close()
            self._reset()  # no body to cut: the upstream acted, its answer is lost
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP_BY_HOP:
                self.send_header(k, v)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if resp.will_close and length is None and not chunked:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        total = int(length) if length is not None and self.command != "HEAD" else None
        cut = None  # bytes of body to send before the fault ends the connection
        if total and mode in ("truncate", "reset") and fault:
            cut = int(total * (fault["fraction"] if mode == "truncate" else 0.5))
        flip = total // 2 if total and mode == "corrupt" else None
        pause = int(fault["pause_after"]) if mode == "pause" and total and total > int(fault["pause_after"]) else None
        sent = 0
        while True:
            piece = resp.read1(PIECE) if self.command != "HEAD" else b""
            if not piece:
                break
            if pause is not None and sent + len(piece) > pause:
                head, piece = piece[:pause - sent], piece[pause - sent:]
                self.wfile.write(head)
                self.wfile.flush()
                sent += len(head)
                self.server.faults.bytes_down += len(head)
                self._wait_for_change(fault["epoch"], 60.0)
                pause = None
            if flip is not None and sent <= flip < sent + len(piece):
                b = bytearray(piece)
                b[flip - sent] ^= 0xFF
                piece = bytes(b)
            if cut is not None and sent + len(piece) >= cut:
                self.wfile.write(piece[:cut - sent])
                self.server.faults.bytes_down += cut - sent
                self._up.close()  # the rest of the upstream answer is abandoned
                if mode == "reset":
                    self._reset()
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                raise _Abort
            if chunked:
                self.wfile.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
            else:
                self.wfile.write(piece)
            sent += len(piece)
            self.server.faults.bytes_down += len(piece)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        resp.close()  # read1 never closes a fully read response itself; the connection stays reusable
        if resp.will_close:
            self._up.close()

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        up = getattr(self, "_up", None)
        if up is not None:
            up.close()


class ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]):
        super().__init__(listen, ProxyHandler)
        self.upstream = upstream
        self.faults = Faults()
        self.no_fin: set[int] = set()  # ids of client sockets to be closed with a bare RST

    def shutdown_request(self, request: Any) -> None:
        if id(request) in self.no_fin:
            self.no_fin.discard(id(request))
            self.close_request(request)
            return
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (OSError, _Abort, http.client.HTTPException)):
            return  # a client or upstream went away mid-request: expected under faults
        super().handle_error(request, client_address)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="http://HOST:PORT of the S3 server")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    args = ap.parse_args(argv)
    up = urllib.parse.urlsplit(args.upstream)
    if up.scheme != "http" or not up.hostname:
        sys.exit(f"--upstream {args.upstream!r}: only http://HOST:PORT is supported")
    server = ProxyServer(("127.0.0.1", args.port), (up.hostname, up.port or 80))
    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    print(f"LISTENING {server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass


# ------------------------------------------------------------------------------------------------ test side


class FaultProxy:
    """Client of a running proxy process: `endpoint_url` for tierfs, `set(mode, **settings)`, `stats()`."""

    def __init__(self, proc: subprocess.Popen, port: int, stderr: Any = None):
        self.proc = proc
        self.port = port
        self.endpoint_url = f"http://127.0.0.1:{port}"
        self._stderr = stderr

    def _call(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.endpoint_url + CONTROL_PREFIX + path, data=data,
                                     method="POST" if data is not None else "GET",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def set(self, mode: str = "pass", **settings: Any) -> dict:
        return self._call("mode", {"mode": mode, **settings})

    def passthrough(self) -> dict:
        return self.set("pass")

    def stats(self) -> dict:
        return self._call("stats")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, by PID."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()

    def stderr_tail(self, n: int = 4000) -> str:
        """What the proxy process printed (upstream failures, unexpected errors)."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-n:].decode(errors="replace")


def start_proxy(upstream: str, timeout: float = 15) -> FaultProxy:
    """Start the proxy process (own session; its stderr goes to a temporary file, never to a pipe nobody
    reads) and return once it listens."""
    err = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the proxy; closed by FaultProxy.stop
    proc = subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve()), "--upstream", upstream],
                            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if r else ""
    if not line.startswith("LISTENING "):
        proc.kill()
        proc.wait(10)
        err.seek(0)
        raise RuntimeError(f"fault proxy did not start: {line!r} {err.read()[-2000:].decode(errors='replace')}")
    return FaultProxy(proc, int(line.split()[1]), err)


try:
    import pytest

    @pytest.fixture
    def fault_proxy(rgw):
        """A FaultProxy in front of the session's Ceph RGW, in pass mode; killed by PID at teardown."""
        p = start_proxy(rgw.endpoint_url)
        try:
            yield p
        finally:
            p.stop()
except ImportError:  # run as a program without pytest installed
    pass


if __name__ == "__main__":
    main()
