"""The CPU reference capture server's HTTP edge: request bodies are capped before they are read."""

from __future__ import annotations

import json
import socket
import threading
from http.server import ThreadingHTTPServer

import pytest

from specforge_kimi.servers.reference_server import make_handler


class _Backend:
    """Stands in for ReferenceCapture at the HTTP boundary: what the handler hands over."""

    def __init__(self):
        self.bodies = []

    def generate(self, body):
        self.bodies.append(body)
        return [{"text": "", "meta_info": {}}]


@pytest.fixture
def server():
    backend = _Backend()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(backend, max_request_bytes=1024))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1], backend
    httpd.shutdown()
    httpd.server_close()


def _post(port: int, length: str, body: bytes) -> tuple[int, dict]:
    """A raw POST /generate with the given Content-Length header (the client is not trusted to tell the truth)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        head = (
            f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        )
        conn.sendall(head.encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_body_over_the_limit_is_refused_unread(server):
    port, backend = server
    status, payload = _post(port, "2000", json.dumps({"input_ids": [[1] * 600]}).encode()[:2000].ljust(2000))
    assert status == 413 and "over this server's limit of 1024" in payload["error"]
    status, payload = _post(port, str(10**12), b"{}")  # a lie: not read, not allocated
    assert status == 413 and f"{10**12} bytes" in payload["error"]
    assert backend.bodies == []


def test_bad_content_length_is_400_and_a_small_body_passes(server):
    port, backend = server
    assert _post(port, "-5", b"")[0] == 400
    assert _post(port, "many", b"")[0] == 400
    status, _ = _post(port, "2", b"{}")
    assert status == 200 and backend.bodies == [{}]


def test_deeply_nested_body_is_400():
    backend = _Backend()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(backend, max_request_bytes=1 << 20))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        status, payload = _post(httpd.server_address[1], str(200_000), b"[" * 100_000 + b"]" * 100_000)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert status == 400 and "nested too deeply" in payload["error"] and backend.bodies == []
