"""The OpenAI-compatible chat client ``regenerate`` sends its requests through: stdlib HTTP, a deadline
per request, retries, and an abort for Ctrl-C.

Scope: JSON requests to ``/v1/models`` and ``/v1/chat/completions`` over http or https, one
connection per attempt. ``timeout_s`` bounds an attempt whole -- connecting, sending, the status
line, the headers and the body -- not each socket read: every read waits at most for what is left
of the attempt's budget, so a reply that trickles a byte at a time ends at the deadline like one
that never comes. Connection errors, the deadline, HTTP 408, 429 and 5xx, and bodies that are cut
short or not JSON are retried with exponential backoff; other HTTP statuses are not (the same
request would fail again). :meth:`ChatClient.abort` ends every attempt in flight at once (their
sockets are shut down, backoffs cut short) and fails every later request.
"""

from __future__ import annotations

import http.client
import io
import json
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

__all__ = ["ChatClient", "RequestFailed"]

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 60.0


class RequestFailed(Exception):
    """A request that failed for good (retries spent, or a status that retrying cannot help); one line."""


class _Aborted(RequestFailed):
    pass


def _left(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    return remaining


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting at most for what is left until ``deadline``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(_left(self._deadline))
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """What ``http.client`` needs of a socket (send, makefile, close), every step bounded by ``deadline``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(_left(self._deadline))
        self._sock.sendall(data)

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        """Nothing: ``http.client`` closes the connection before the body of a ``Connection: close`` reply
        is read; the socket is closed by :meth:`_Connection.release` once the attempt is over."""


class _Connection(http.client.HTTPConnection):
    """One attempt's connection: the socket is made here so that :meth:`ChatClient.abort` can shut it down."""

    def __init__(self, client: ChatClient, deadline: float) -> None:
        super().__init__(client.host, client.port)
        self.default_port = client.default_port  # the Host header names the port only when it is not the default
        self._client = client
        self._deadline = deadline
        self._socket: socket.socket | None = None

    def connect(self) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        raw = socket.socket(family, kind, proto)
        self._socket = raw
        self._client._track(raw)
        raw.settimeout(_left(self._deadline))
        raw.connect(address)
        if family in (socket.AF_INET, socket.AF_INET6):
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client's own connect does
        sock = raw
        if self._client.scheme == "https":
            import ssl

            sock = ssl.create_default_context().wrap_socket(raw, server_hostname=self.host)  # takes raw's fd
            self._client._untrack(raw)
            self._socket = sock
            self._client._track(sock)
        self.sock = _DeadlineSocket(sock, self._deadline)

    def release(self) -> None:
        self.close()
        if self._socket is not None:
            self._client._untrack(self._socket)
            self._socket.close()
            self._socket = None


class ChatClient:
    """Requests to an OpenAI-compatible server: ``timeout_s`` per attempt, whole; ``max_retries`` retries
    with backoff (``retry_delay_s`` x 2^attempt, capped, plus jitter)."""

    def __init__(self, server: str, *, timeout_s: float, max_retries: int, retry_delay_s: float) -> None:
        base = server.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.base = base
        parts = urllib.parse.urlsplit(base)
        self.scheme = parts.scheme
        self.default_port = 443 if parts.scheme == "https" else 80
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or self.default_port
        self._prefix = parts.path
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_delay_s = retry_delay_s
        self._jitter = random.Random(0)
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._stop = threading.Event()

    def get(self, path: str) -> Any:
        return self.request("GET", path, None)

    def post(self, path: str, payload: Mapping[str, Any]) -> Any:
        return self.request("POST", path, payload)

    def abort(self) -> None:
        """End every request in flight now and fail every later one (Ctrl-C: nothing waits for the server)."""
        with self._lock:  # the lock _track takes: a socket is either in this list or refused there
            self._stop.set()
            live = list(self._live)
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a connect or read blocked on it
            except OSError:  # not connected yet: Linux still marks it shut, so its connect's send fails
                pass

    def request(self, method: str, path: str, payload: Mapping[str, Any] | None) -> Any:
        """The reply's JSON; raises :class:`RequestFailed` (one line) once retries are spent."""
        url = self.base + path
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt and self._stop.wait(self._backoff(attempt)):
                break
            if self._stop.is_set():
                break
            try:
                status, body = self._attempt(method, path, data)
            except _Aborted:  # abort() came before its socket was registered: refused there
                break
            except TimeoutError:
                last_error = f"no whole reply from {url} within --timeout {self.timeout_s:g} s"
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, IncompleteRead: a body cut short
                last_error = _one_line(f"cannot reach {url} or it broke off its reply: {type(exc).__name__}: {exc}")
            else:
                if 200 <= status < 300:
                    try:
                        return json.loads(body)
                    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
                        last_error = _one_line(f"{url} returned invalid JSON: {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                last_error = _one_line(f"HTTP {status} from {url}: {body[:300].decode('utf-8', 'replace')}")
                if status not in _RETRY_STATUS:
                    raise RequestFailed(last_error)
            if self._stop.is_set():
                break
        if self._stop.is_set():
            raise _Aborted(f"request to {url} abandoned (interrupted)")
        raise RequestFailed(f"{last_error} (after {self.max_retries} retries)")

    def _attempt(self, method: str, path: str, data: bytes | None) -> tuple[int, bytes]:
        connection = _Connection(self, time.monotonic() + self.timeout_s)
        try:
            headers = {"Content-Type": "application/json", "Connection": "close"}
            connection.request(method, self._prefix + path, body=data, headers=headers)
            response = connection.getresponse()
            if 200 <= response.status < 300:
                return response.status, response.read()
            try:  # the status decides; a body cut short does not make it retryable (the deadline does)
                return response.status, response.read()
            except (ConnectionError, http.client.HTTPException):
                return response.status, b"(body unreadable)"
        finally:
            connection.release()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            if self._stop.is_set():
                sock.close()
                raise _Aborted("interrupted")
            self._live.add(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._live.discard(sock)

    def _backoff(self, attempt: int) -> float:
        base = self.retry_delay_s
        with self._lock:
            jitter = self._jitter.uniform(0, base)
        return min(_MAX_BACKOFF_S, base * 2 ** (attempt - 1)) + jitter


def _one_line(message: str) -> str:
    return " ".join(message.split())
