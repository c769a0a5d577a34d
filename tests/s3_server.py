"""A real S3-compatible server for the object-storage tests: moto's server (``ThreadedMotoServer``)
on a free loopback port, behind a small proxy that can answer every Nth request with an HTTP
500, as a flaky object store does. Clients (s3fs/botocore) find it through the standard
``AWS_ENDPOINT_URL_S3`` setting, so the code under test runs unchanged."""

from __future__ import annotations

import http.client
import os
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ray_cluster import free_port

ERROR_500 = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>planted failure</Message></Error>"
)


class FlakyProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.upstream_port = upstream_port
        self.fail_every = 0  # 0: pass everything through
        self.requests = 0
        self.failed = 0
        self.lock = threading.Lock()

    def should_fail(self) -> bool:
        with self.lock:
            self.requests += 1
            fail = self.fail_every > 0 and self.requests % self.fail_every == 0
            self.failed += fail
            return fail


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        body = self._body()
        server: FlakyProxy = self.server  # type: ignore[assignment]
        if server.should_fail():
            self.send_response(500)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(ERROR_500)))
            self.end_headers()
            self.wfile.write(ERROR_500)
            return
        conn = http.client.HTTPConnection("127.0.0.1", server.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body or None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        # A HEAD answer has no body but the object's length (clients read sizes from it).
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class S3Server:
    """moto + the proxy, with the environment every client in the test (and its worker
    processes) uses: ``with S3Server() as s3: ...``."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never ask a metadata server for credentials
        }
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> S3Server:
        import logging

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request
        self.moto.start()
        # moto keeps its buckets per process, not per server: start each server empty
        reset = http.client.HTTPConnection("127.0.0.1", self.moto._server.server_port, timeout=60)
        reset.request("POST", "/moto-api/reset")
        assert reset.getresponse().status == 200, "moto did not reset its state"
        reset.close()
        self.proxy = FlakyProxy(self.moto._server.server_port)
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        self.env["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{self.proxy.server_port}"
        self.env["AWS_ENDPOINT_URL"] = self.env["AWS_ENDPOINT_URL_S3"]
        for k, v in self.env.items():
            self._saved[k] = os.environ.get(k)
            os.environ[k] = v
        _forget_clients()
        return self

    def __exit__(self, *exc) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()
        _forget_clients()


def _forget_clients() -> None:
    """fsspec keeps one S3 file system per set of arguments, with its client bound to the
    endpoint of its day: a second server (another test module's, on another port) must not be
    reached through the first one's cached client."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def s3_with_bucket(name: str = "bucket"):
    """A server with one empty bucket, for a module's tests (``with s3_with_bucket() as s3``)."""
    with S3Server() as server:
        import fsspec

        fsspec.filesystem("s3").mkdir(name)
        yield server
