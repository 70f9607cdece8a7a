"""Own the Mooncake segment that holds captured features, in a process of its own.

Scope: the co-located online loop with ``resilience.segment_owner: keeper``. SpecForge's SGLang
capture sink mounts the feature segment inside the capture server (``MOONCAKE_GLOBAL_SEGMENT_SIZE``),
so a server that dies takes every committed-but-untrained sample with it. This process mounts the
segment instead (the server then runs with a zero-sized segment and puts into this one), so the
committed samples outlive a server restart. Cost: the server's puts cross a process boundary
(Mooncake's TCP transport on loopback) instead of landing in its own memory -- not yet measured
on GPUs; the default stays ``server``.

Serves ``GET /health`` once the segment is mounted (the supervisor's readiness probe); exits on
SIGTERM/SIGINT. Mooncake settings come from the ``MOONCAKE_*`` environment, like the sink.

    python -m specforge_kimi.run.segment_keeper --port 35904
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def mount():
    from mooncake.store import MooncakeDistributedStore

    env = os.environ.get
    size = int(env("MOONCAKE_GLOBAL_SEGMENT_SIZE", 1 << 30))
    if size <= 0:
        raise SystemExit("MOONCAKE_GLOBAL_SEGMENT_SIZE must be positive for the segment keeper")
    store = MooncakeDistributedStore()
    rc = store.setup(
        env("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
        env("MOONCAKE_METADATA_SERVER"),
        size,
        16 << 20,
        env("MOONCAKE_PROTOCOL", "tcp"),
        env("MOONCAKE_RDMA_DEVICES", ""),
        env("MOONCAKE_MASTER_SERVER_ADDR"),
    )
    if rc is not None and int(rc) != 0:
        raise SystemExit(f"mooncake setup failed (status {rc})")
    return store


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specforge_kimi.run.segment_keeper")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    store = mount()  # noqa: F841  (held for the process lifetime: the segment lives as long as it does)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path.startswith("/health") else 404)
            self.end_headers()

        def log_message(self, *_a) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Health)
    stop = threading.Event()

    def on_signal(_signum, _frame) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(
        f"segment keeper: {os.environ.get('MOONCAKE_GLOBAL_SEGMENT_SIZE')} bytes mounted; "
        f"health on http://{args.host}:{args.port}/health",
        flush=True,
    )
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
