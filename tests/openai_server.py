"""A small OpenAI-compatible chat server for ``regenerate``'s tests, on 127.0.0.1 (a free port).

It answers deterministically from the last message, like a K2.5 SGLang server with the kimi_k2
reasoning and tool-call parsers: ``reasoning_content`` + ``content``, or ``tool_calls`` for
"weather:CITY" when tools are given. It can fail requests (HTTP 503) to exercise retries, records
every request, and ``chat_reply`` replaces its chat answer with raw bytes (any status, a body that
is not JSON or not OpenAI's shape, a Content-Length larger than the body, a delay, a stall after
the headers, the whole reply trickled a byte at a time) for the tests of bad and slow replies. A
pause ends early when the client hangs up, so an abandoned request does not hold a server thread.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class RawReply:
    """One chat answer as sent: ``status``, ``body`` bytes; ``declared_length`` (default ``len(body)``)
    larger than the body truncates it (the connection closes early); ``delay_s`` before answering;
    ``stall_s`` between the headers and the body; ``trickle_s``: the whole reply (status line,
    headers, body) sent one byte at a time, spread over that many seconds."""

    status: int
    body: bytes
    declared_length: int | None = None
    delay_s: float = 0.0
    stall_s: float = 0.0
    trickle_s: float = 0.0

    def head(self) -> bytes:
        length = self.declared_length or len(self.body)
        return (
            f"HTTP/1.0 {self.status} X\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()


class FakeServer:
    """Deterministic OpenAI-compatible chat server with failure injection."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail_first_attempts = 0  # per distinct request body
        self.fail_after = None  # serve this many chat requests, then 503 forever
        self.latency_s = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.attempts: dict[bytes, int] = {}
        self.lock = threading.Lock()
        self.chat_reply: Callable[[dict], RawReply] | None = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms delayed-ACK waits

            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this request (its deadline, an abort): expected

            def _pause(self, seconds: float) -> bool:
                """Wait ``seconds``; False at once if the client hangs up (its side of the socket reads EOF)."""
                if seconds <= 0:
                    return True
                readable, _, _ = select.select([self.connection], [], [], seconds)
                return not readable

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._reply(200, {"object": "list", "data": [{"id": "kimi-k2.5-test"}]})
                else:
                    self._reply(404, {"error": "not found"})

            def _raw(self, reply: RawReply) -> None:
                self.close_connection = True
                if not self._pause(reply.delay_s):
                    return
                data = reply.head() + reply.body
                if reply.trickle_s:
                    step = reply.trickle_s / len(data)
                    for i in range(len(data)):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        if not self._pause(step):
                            return
                    return
                self.wfile.write(reply.head())
                self.wfile.flush()
                if self._pause(reply.stall_s):
                    self.wfile.write(reply.body)

            def do_POST(self):
                length = int(self.headers["Content-Length"])
                body = self.rfile.read(length)
                if len(body) < length:
                    return  # the client hung up before its whole body came (its deadline, an abort): no reply
                try:
                    payload = json.loads(body)
                except ValueError:
                    self.send_error(400, "body is not JSON")
                    return
                if server.chat_reply is not None:
                    with server.lock:
                        server.requests.append(payload)
                    self._raw(server.chat_reply(payload))
                    return
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    attempt = server.attempts.get(body, 0)
                    server.attempts[body] = attempt + 1
                    served = len(server.requests)
                    dead = server.fail_after is not None and served >= server.fail_after
                    failing = attempt < server.fail_first_attempts or dead
                    if not failing:
                        server.requests.append(payload)
                try:
                    time.sleep(server.latency_s)
                    if failing:
                        self._reply(503, {"error": "overloaded"})
                    else:
                        self._reply(200, respond(payload))
                finally:
                    with server.lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def respond(payload: dict) -> dict:
    messages = payload["messages"]
    thinking = payload["chat_template_kwargs"]["thinking"]
    assert thinking in (True, False)
    last = messages[-1]
    message: dict
    if last["role"] == "tool":
        message = {
            "role": "assistant",
            "content": f"It is {last['content']}.",
            "reasoning_content": "Report the tool result.",
        }
    elif payload.get("tools") and last["content"].startswith("weather:"):
        city = last["content"].split(":", 1)[1]
        calls = sum(len(m.get("tool_calls") or []) for m in messages)
        message = {
            "role": "assistant", "content": "", "reasoning_content": f"Look up {city}.",
            "tool_calls": [{"id": f"functions.get_weather:{calls}", "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}],
        }  # fmt: skip
    elif last["content"] == "inline":
        message = {"role": "assistant", "content": "thought inline</think>visible answer"}
    elif last["content"] == "long":
        return {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": "..."},
                }
            ]
        }
    elif not thinking:  # generation prompt `<think></think>`: the parser finds no reasoning
        message = {"role": "assistant", "content": f"echo {last['content']}", "reasoning_content": None}
    else:
        message = {
            "role": "assistant",
            "content": f"echo {last['content']}",
            "reasoning_content": f"think {last['content']}",
        }
    return {"id": "x", "object": "chat.completion", "model": payload["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}  # fmt: skip
