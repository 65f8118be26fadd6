"""A real S3 API on loopback for tests: moto's server, and a proxy that injects faults.

``S3Server`` starts moto on 127.0.0.1 (a free port) and points botocore at it through
the environment (``AWS_ENDPOINT_URL``, fake credentials), exactly as a user would point
unbroken at MinIO or another S3-compatible store; nothing in unbroken is told.
``FaultProxy`` sits between the client and moto and answers chosen requests with a 5xx
error, throttling, or a dropped connection, forwarding everything else unchanged.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries off: unbroken's are under test
    "AWS_RETRY_MODE": "standard",
    "UNBROKEN_STORE_BACKOFF_S": "0.01",
}


def forget_clients() -> None:
    """Drop cached S3 clients (they keep the endpoint they were made with)."""
    from unbroken.storage import store as remote

    remote._stores.clear()
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{self.port}"
        self.env = {**ENV, "AWS_ENDPOINT_URL": self.endpoint}

    @contextlib.contextmanager
    def environment(self, endpoint: str | None = None) -> Iterator[dict[str, str]]:
        """os.environ pointing at this server (or at ``endpoint``), for this process and
        the processes it starts."""
        env = {**self.env, **({"AWS_ENDPOINT_URL": endpoint} if endpoint else {})}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        forget_clients()
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            forget_clients()

    def bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, **_creds()).create_bucket(Bucket=name)
        return name

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **_creds())

    def stop(self) -> None:
        self._server.stop()


def _creds() -> dict[str, str]:
    return {
        "aws_access_key_id": ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": ENV["AWS_DEFAULT_REGION"],
    }


Rule = Callable[[str, str], "str | None"]  # (method, path) -> fault to inject, or None


class FaultProxy:
    """HTTP proxy to ``upstream`` that injects the faults ``rule`` names: "500", "503",
    "slowdown" (throttling), "drop" (the connection closes without an answer) or "lose"
    (the request reaches the store, then the connection closes: its answer is lost).
    ``injected`` counts them."""

    def __init__(self, upstream_port: int, rule: Rule) -> None:
        self.rule = rule
        self.injected = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size + 2)[:size]
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += chunk
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self) -> None:
                body = self._body()
                fault = proxy.rule(self.command, self.path)
                if fault is not None:
                    proxy.injected += 1
                    if fault == "lose":
                        self._forward(body)
                        fault = "drop"
                    if fault == "drop":
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    status, code = {
                        "500": (500, "InternalError"),
                        "503": (503, "ServiceUnavailable"),
                        "slowdown": (503, "SlowDown"),
                    }[fault]
                    text = f"<Error><Code>{code}</Code><Message>injected</Message></Error>"
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text.encode())
                    return
                status, answer_headers, data = self._forward(body)
                self.send_response(status)
                for k, v in answer_headers:
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length")
                }
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    return answer.status, answer.getheaders(), answer.read()
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
