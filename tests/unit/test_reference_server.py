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


class _Store:
    """Stands in for Mooncake: keeps each put's bytes by key."""

    def __init__(self):
        self.objects = {}

    def batch_put_from(self, keys, ptrs, sizes, cfg):
        import ctypes

        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self.objects[key] = ctypes.string_at(ptr, size)
        return [0] * len(keys)


@pytest.mark.parametrize(
    "method,ids,positions",
    [("dflash", [0, 1, 2, 3], [1, 2, 3, 4]), ("dspark", [1, 3], [2, 4]), ("eagle3", [1, 2, 3], [2, 3, 4])],
)
def test_capture_method_reads_ids_as_sglang_and_writes_n_layers(tiny_dir, method, ids, positions):
    import torch

    from specforge_kimi.servers.reference_server import ReferenceCapture
    from specforge_kimi.targets.capture import text_decoder

    backend = ReferenceCapture(str(tiny_dir), ids, method=method)
    assert list(backend.aux.positions) == positions
    backend._store, backend._cfg = _Store(), None
    tokens = [5, 17, 99, 3, 250, 7, 11]
    spec = {"store_id": "s", "sample_id": "x", "features": {"aux": "hidden_states"}, "passthrough": []}
    result, _ = backend.capture_one(tokens, spec)
    width = len(ids) * backend.model.config.hidden_size
    assert result["features"]["hidden_states"]["shape"] == [1, len(tokens), width]
    assert result["aux_layer_ids"] == ids  # echoed as given, as SGLang's sink does
    got = torch.frombuffer(bytearray(backend._store.objects["s/x/g1/hidden_states"]), dtype=torch.float32)
    with torch.no_grad():
        hs = text_decoder(backend.model)(
            input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False
        ).hidden_states
    torch.testing.assert_close(got.reshape(1, len(tokens), width), torch.cat([hs[p] for p in positions], -1))


def test_capture_method_refuses_dflash_last_layer_and_unknown_method(tiny_dir):
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.servers.reference_server import ReferenceCapture

    with pytest.raises(KimiInputError, match="never captured"):
        ReferenceCapture(str(tiny_dir), [1, 5], method="dflash")  # 6 layers: DFlash ids 0..4
    with pytest.raises(ValueError, match="expected one of"):
        ReferenceCapture(str(tiny_dir), [1, 2, 3], method="medusa")
