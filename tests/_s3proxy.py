"""A tiny fault-injecting HTTP reverse proxy for S3 tests (standard library).

``S3FaultProxy(upstream)`` listens on 127.0.0.1:<random port> and forwards
every request unchanged (method, path and query, headers including ``Host``,
body) to ``upstream`` (e.g. ``SeaweedServer.endpoint``).  SigV4 signatures
stay valid because the ``Host`` header the client signed is passed through.
``Expect: 100-continue`` (botocore sends it with file-like bodies; it is not
signed) is answered by the proxy itself and not forwarded.  Chunked request
bodies are relayed chunk by chunk.

Faults, all cleared by ``reset()``:

* ``fail_next(n, status=503, code=None)``: answer the next ``n`` requests
  with ``status`` and an S3 XML error body (``SlowDown`` for 503), without
  forwarding them.
* ``fail_matching(predicate, status=503, code=None, count=None)``: the same
  for requests where ``predicate(method, path, headers)`` is true (``path``
  includes the query string; ``headers`` is an ``email.message.Message``),
  at most ``count`` times (``None``: until reset).
* ``delay(seconds, drop=False)``: every request waits ``seconds`` before it
  is forwarded (or, with ``drop``, its connection is closed without an
  answer), e.g. to trigger client read timeouts.

``requests`` records ``(method, path, status)`` of every request handled.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time
import urllib.parse
from typing import Callable

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"}

_CODES = {500: "InternalError", 503: "SlowDown", 502: "BadGateway", 504: "GatewayTimeout",
          400: "BadRequest", 403: "AccessDenied", 404: "NoSuchKey", 429: "SlowDown"}


def error_body(status: int, code: str | None, resource: str) -> bytes:
    code = code or _CODES.get(status, "InternalError")
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by lazyckpt test proxy ({status})</Message>"
            f"<Resource>{resource}</Resource><RequestId>lazyckpt-proxy</RequestId></Error>").encode()


class _Rule:
    def __init__(self, predicate, status, code, count):
        self.predicate, self.status, self.code, self.count = predicate, status, code, count


class Hold:
    """Requests matching ``predicate`` wait until ``release()`` (see the module doc)."""

    def __init__(self, predicate):
        self.predicate = predicate
        self.arrived = threading.Event()
        self._go = threading.Event()

    def release(self) -> None:
        self._go.set()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *args):  # quiet
        pass

    def setup(self):
        super().setup()
        # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's
        # algorithm holds the second one for the client's delayed ACK (~40 ms a request).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self):
        if self._upstream is not None:
            self._upstream.close()
        super().finish()

    # every method goes through _proxy
    def do_GET(self):
        self._proxy()
    do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = do_GET

    def _body_chunks(self):
        """The request body as an iterator of byte strings (raw chunked
        framing is re-emitted by the caller when the body is chunked)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    # trailers up to the blank line
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield self.rfile.read(size)
                self.rfile.readline()  # CRLF after the chunk
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left > 0:
                block = self.rfile.read(min(left, 1 << 20))
                if not block:
                    raise ConnectionError("client closed mid-body")
                left -= len(block)
                yield block

    def _proxy(self):
        proxy = self.server.owner
        for hold in proxy._matching_holds(self.command, self.path, self.headers):
            hold.arrived.set()
            hold._go.wait(300)
        fault = proxy._pick_fault(self.command, self.path, self.headers)
        if proxy._delay:
            time.sleep(proxy._delay)
            if proxy._drop:
                for _ in self._body_chunks():
                    pass
                proxy._record(self.command, self.path, None)
                self.close_connection = True
                return
        if fault is not None:
            for _ in self._body_chunks():
                pass
            status, code = fault
            body = error_body(status, code, urllib.parse.urlsplit(self.path).path)
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("x-amz-request-id", "lazyckpt-proxy")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            proxy._record(self.command, self.path, status)
            return
        status = self._forward()
        proxy._record(self.command, self.path, status)

    def _forward(self):
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        for attempt in (0, 1):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.server.owner.upstream_addr, timeout=300)
            conn = self._upstream
            try:
                if conn.sock is None:
                    conn.connect()
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        conn.putheader(name, value)
                conn.endheaders()
                break
            except (ConnectionError, OSError, http.client.HTTPException):
                # a stale kept-alive upstream connection: reconnect once
                conn.close()
                self._upstream = None
                if attempt:
                    raise
        try:
            for block in self._body_chunks():
                if chunked:
                    conn.send(b"%x\r\n" % len(block) + block + b"\r\n")
                else:
                    conn.send(block)
            if chunked:
                conn.send(b"0\r\n\r\n")
            resp = conn.getresponse()
        except (ConnectionError, OSError, http.client.HTTPException):
            conn.close()
            self._upstream = None
            self.close_connection = True
            return None
        if self.command == "HEAD" or resp.status in (204, 304):
            body = None
            resp.read()
        elif resp.getheader("Content-Length") is None:
            body = resp.read()  # chunked or until-close response: buffer it
        else:
            body = resp
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.getheaders():
            low = name.lower()
            if low in _HOP_BY_HOP or low == "transfer-encoding":
                continue
            if low == "content-length" and isinstance(body, bytes):
                continue
            self.send_header(name, value)
        if isinstance(body, bytes):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if isinstance(body, bytes):
            self.wfile.write(body)
        elif body is not None:
            while True:
                block = resp.read(1 << 20)
                if not block:
                    break
                self.wfile.write(block)
        if resp.will_close:
            conn.close()
            self._upstream = None
        return resp.status


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: "S3FaultProxy"

    def handle_error(self, request, client_address):
        import sys
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class S3FaultProxy:
    """Reverse proxy in front of ``upstream`` ("http://host:port")."""

    def __init__(self, upstream: str):
        u = urllib.parse.urlsplit(upstream)
        self.upstream_addr = (u.hostname, u.port or 80)
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.requests: list[tuple[str, str, int | None]] = []
        self.reset()
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="s3-fault-proxy",
                                        daemon=True)
        self._thread.start()

    # -- faults -------------------------------------------------------------

    def reset(self) -> None:
        """Forward everything again: no faults, no delay."""
        with self._lock:
            self._fail_next: list[tuple[int, str | None]] = []
            self._rules: list[_Rule] = []
            for hold in getattr(self, "_holds", []):
                hold.release()
            self._holds: list[Hold] = []
            self._delay = 0.0
            self._drop = False

    def fail_next(self, n: int, status: int = 503, code: str | None = None) -> None:
        with self._lock:
            self._fail_next += [(status, code)] * n

    def fail_matching(self, predicate: Callable[[str, str, object], bool], status: int = 503,
                      code: str | None = None, count: int | None = None) -> None:
        with self._lock:
            self._rules.append(_Rule(predicate, status, code, count))

    def delay(self, seconds: float, drop: bool = False) -> None:
        with self._lock:
            self._delay = float(seconds)
            self._drop = drop

    def armed(self) -> bool:
        """Whether any fault or delay is in force (requests may fail or wait)."""
        with self._lock:
            return bool(self._fail_next or self._delay or self._drop
                        or any(r.count is None or r.count > 0 for r in self._rules))

    def hold_matching(self, predicate: Callable[[str, str, object], bool]) -> Hold:
        hold = Hold(predicate)
        with self._lock:
            self._holds.append(hold)
        return hold

    def _matching_holds(self, method, path, headers):
        with self._lock:
            holds = [h for h in self._holds if not h._go.is_set()]
        return [h for h in holds if h.predicate(method, path, headers)]

    def _pick_fault(self, method, path, headers):
        with self._lock:
            if self._fail_next:
                return self._fail_next.pop(0)
            for rule in self._rules:
                if rule.count is not None and rule.count <= 0:
                    continue
                if rule.predicate(method, path, headers):
                    if rule.count is not None:
                        rule.count -= 1
                    return rule.status, rule.code
        return None

    def _record(self, method, path, status):
        with self._lock:
            self.requests.append((method, path, status))

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        self.reset()                    # held requests go on (the server must not wait on them)
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> "S3FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
