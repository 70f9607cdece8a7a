"""A CPU stand-in for the spec-capture SGLang server: same HTTP contract, same Mooncake layout.

Scope: testing and debugging the online loop (SpecForge producer -> Mooncake -> SpecForge
consumer) on a machine without a GPU. It serves ``GET /health`` and ``POST /generate`` for the
subset of SGLang 0.5.14's request that SpecForge's ``SGLangServerCaptureAdapter`` sends
(``input_ids`` batch, ``spec_capture`` payloads, ``sampling_params``, ``extra_key``), runs the
tiny K2.5 text decoder in transformers with the reference hooks of :mod:`capture`, and writes
each sample the way SpecForge's ``spec-capture.patch`` sink does: one hard-pinned Mooncake
object per tensor at ``{store_id}/{sample_id}/g{gen}/{name}``, raw contiguous bytes, shape and
dtype returned in ``meta_info["spec_capture"]``; ``replace`` removes the keys first. The
features are the reference capture (fp32 forward, cast to ``--dtype``), not SGLang's kernels:
the GPU parity test (``tests/gpu/test_capture_parity.py``) is what ties the two together.

Not a server for real models: one request at a time, no batching, no generation beyond the one
greedy token SGLang's capture requests ask for (``max_new_tokens: 1``). Request bodies over
``--max-request-bytes`` (64 MiB) are answered 413 without being read.

    python -m specforge_kimi.servers.reference_server --model-path DIR --spec-capture-aux-layer-ids 1 3 4 \
        --host 127.0.0.1 --port 30000 [--dtype float32] [--spec-capture-method eagle3|dflash|dspark]

``--spec-capture-method`` says how the ids are read, as SGLang does: eagle3 ids shift by +1 when the first is 1,
dflash/dspark ids always (capture after layer ``id``); the aux rows are the N captured layers side by side.

Mooncake settings come from the same ``MOONCAKE_*`` environment variables as the real sink. With
``SGLANG_SPEC_CAPTURE_TRANSPORT=cuda_ipc`` (and the pool variables of :mod:`specforge_kimi.transport`) the
samples go into a cuda_ipc pool instead, through the very writer SGLang patch spec-capture-cuda-ipc calls, on its
shared-memory backend (this server runs on the CPU): everything of that transport but the CUDA handle, on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from specforge_kimi.transport.cuda_ipc import wants_pool

logger = logging.getLogger("specforge_kimi.servers.reference_server")

_DTYPES = ("float32", "bfloat16", "float16")
#: ``--spec-capture-method`` values (SGLang's spec-capture patch: eagle3, and dflash/dspark through the DFlash ids)
METHODS = ("eagle3", "dflash", "dspark")
#: request bodies above this are answered 413 unread (a tiny model's capture batches are a few MiB of JSON)
MAX_REQUEST_BYTES = 64 << 20


#: the keys that carry a passthrough item's values (SpecForge's ``data``, the compact forms of SGLang patch
#: spec-capture-compact-passthrough)
PASSTHROUGH_FORMS = ("data", "source", "fill", "data_b64")


def passthrough_tensor(item: dict, input_ids: list[int]):
    """A ``spec_capture`` passthrough item's tensor, as our patched SGLang sink builds it: ``data``
    (SpecForge's JSON list), or the compact forms of SGLang patch spec-capture-compact-passthrough
    (``source: input_ids``, ``fill``, ``data_b64`` + ``data_dtype``) that SpecForge sends with
    ``SPECFORGE_SPEC_CAPTURE_COMPACT=1`` (SpecForge patch compact-capture-passthrough)."""
    import base64

    import torch

    dtype = getattr(torch, str(item.get("dtype", "int64")))
    shape = [int(d) for d in item["shape"]]
    if item.get("source") == "input_ids":
        return torch.tensor(input_ids, dtype=dtype).reshape(shape)
    if "source" in item:
        raise ValueError(f"passthrough {item.get('name')!r}: unknown source {item['source']!r} (only 'input_ids')")
    if "data" in item:
        return torch.tensor(item["data"], dtype=dtype).reshape(shape)
    if "fill" in item:
        return torch.full(shape, item["fill"], dtype=dtype)
    if "data_b64" in item:
        raw = getattr(torch, str(item.get("data_dtype")), None)
        if not isinstance(raw, torch.dtype) or raw is torch.bool:
            raise ValueError(f"passthrough {item.get('name')!r}: unsupported data_dtype {item.get('data_dtype')!r}")
        data = bytearray(base64.b64decode(item["data_b64"], validate=True))
        return torch.frombuffer(data, dtype=raw).to(dtype).reshape(shape)
    raise ValueError(f"passthrough {item.get('name')!r} has none of data, source, fill, data_b64")


class ReferenceCapture:
    """The model, the aux positions and the Mooncake connection behind the HTTP handler."""

    def __init__(
        self, model_path: str, aux_layer_ids: Sequence[int], dtype: str = "float32", method: str = "eagle3"
    ) -> None:
        import torch

        from specforge_kimi.targets.checkpoint import inspect_target, load_text_model
        from specforge_kimi.targets.layer_ids import AuxLayers

        info = inspect_target(model_path)
        # SGLang's rule for the method (eagle3: +1 for all when the first id is 1; dflash/dspark: +1 always); the ids
        # themselves are echoed back
        if method not in METHODS:
            raise ValueError(f"capture method {method!r}: expected one of {', '.join(METHODS)}")
        self.method = method
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        engine = "sglang" if method == "eagle3" else "dflash"
        self.aux = AuxLayers.from_engine(engine, self.aux_layer_ids, info.num_layers)
        self.model = load_text_model(model_path, dtype=torch.float32).eval()
        self.dtype = getattr(torch, dtype)
        self.dtype_name = dtype
        self.lock = threading.Lock()
        self._store = None
        self._cfg = None
        self.requests = 0
        self.samples = 0
        self.passthrough_forms: Counter = Counter()  # how the passthrough values came (logged per request)
        from specforge_kimi.transport.writer import IpcCaptureWriter

        self.ipc = IpcCaptureWriter.from_env(device="cpu")  # None unless the transport is cuda_ipc

    def store(self):
        if self._store is None:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig

            env = os.environ.get
            store = MooncakeDistributedStore()
            rc = store.setup(
                env("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
                env("MOONCAKE_METADATA_SERVER", "http://127.0.0.1:8080/metadata"),
                int(env("MOONCAKE_GLOBAL_SEGMENT_SIZE", 1 << 30)),
                int(env("MOONCAKE_LOCAL_BUFFER_SIZE", 1 << 28)),
                env("MOONCAKE_PROTOCOL", "tcp"),
                env("MOONCAKE_RDMA_DEVICES", ""),
                env("MOONCAKE_MASTER_SERVER_ADDR", "127.0.0.1:50051"),
            )
            if rc is not None and int(rc) != 0:
                raise RuntimeError(f"mooncake setup failed (status {rc})")
            cfg = ReplicateConfig()
            cfg.replica_num = 1
            cfg.with_hard_pin = True  # SpecForge, not Mooncake's LRU, owns the lifetime
            self._store, self._cfg = store, cfg
        return self._store

    def capture_one(self, input_ids: list[int], spec: dict) -> tuple[dict, int]:
        """Forward one prompt, write its features; returns (meta_info result, greedy next token)."""
        import torch

        from specforge_kimi.targets.capture import capture_aux, text_decoder

        ids = torch.tensor([input_ids], dtype=torch.long)
        with torch.no_grad(), capture_aux(self.model, self.aux) as out:
            hidden = text_decoder(self.model)(input_ids=ids, use_cache=False).last_hidden_state
            next_token = int(self.model.lm_head(hidden[:, -1]).argmax(-1))
        artifacts = {"aux": out["aux"], "last_hidden": out["last"]}
        if self.ipc is not None and self.ipc.wants(spec):
            for item in spec.get("passthrough") or []:
                self.passthrough_forms[next((k for k in PASSTHROUGH_FORMS if k in item), "?")] += 1
            unknown = set(spec.get("features") or {}) - set(artifacts)
            if unknown:
                raise ValueError(f"unknown capture artifact {sorted(unknown)[0]!r}")
            (result,) = self.ipc.put_samples(
                [(spec, out["aux"][0].to(self.dtype), out["last"][0].to(self.dtype))],
                passthrough_tensor=lambda item: passthrough_tensor(item, input_ids),
                aux_layer_ids=self.aux_layer_ids,
            )
            self.samples += 1
            return result, next_token
        if wants_pool(spec):
            raise ValueError("spec_capture asked for transport cuda_ipc, but this server has no cuda_ipc pool")
        store_id, sample_id = str(spec["store_id"]), str(spec["sample_id"])
        gen = int(spec.get("gen", 1))
        keys, tensors, feats = [], [], {}

        def stage(name: str, tensor) -> None:
            tensor = tensor.contiguous()
            keys.append(f"{store_id}/{sample_id}/g{gen}/{name}")
            tensors.append(tensor)
            feats[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}

        for artifact, name in (spec.get("features") or {}).items():
            if artifact not in artifacts:
                raise ValueError(f"unknown capture artifact {artifact!r}")
            stage(str(name), artifacts[artifact].to(self.dtype))  # already [1, L, W]
        for item in spec.get("passthrough") or []:
            stage(str(item["name"]), passthrough_tensor(item, input_ids))
            self.passthrough_forms[next((k for k in PASSTHROUGH_FORMS if k in item), "?")] += 1
        store = self.store()
        if spec.get("replace"):
            for key in keys:
                try:
                    store.remove(key)
                except Exception:
                    pass
        sizes = [t.element_size() * t.numel() for t in tensors]
        statuses = store.batch_put_from(keys, [t.data_ptr() for t in tensors], sizes, self._cfg)
        failed = [(k, s) for k, s in zip(keys, statuses or [], strict=False) if s is not None and int(s) < 0]
        if failed:
            for key in keys:
                try:
                    store.remove(key)
                except Exception:
                    pass
            raise RuntimeError(f"mooncake put failed for {len(failed)}/{len(keys)} keys; first={failed[0]}")
        self.samples += 1
        return (
            {
                "sample_id": sample_id,
                "store_id": store_id,
                "gen": gen,
                "aux_layer_ids": list(self.aux_layer_ids),
                "features": feats,
            },
            next_token,
        )

    def generate(self, body: dict) -> list[dict]:
        batch = body.get("input_ids")
        if not isinstance(batch, list) or not batch:
            raise ValueError("input_ids must be a non-empty list")
        if batch and isinstance(batch[0], int):
            batch = [batch]
        specs = body.get("spec_capture")
        if specs is None:
            specs = [None] * len(batch)
        elif isinstance(specs, dict):
            specs = [specs]
        if len(specs) != len(batch):
            raise ValueError(f"{len(specs)} spec_capture payloads for {len(batch)} prompts")
        rows = []
        with self.lock:
            self.requests += 1
            for ids, spec in zip(batch, specs, strict=False):
                meta: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": 1}
                try:
                    if spec is None:
                        result, token = None, None
                    else:
                        result, token = self.capture_one(ids, spec)
                    meta["spec_capture"] = result
                except Exception as exc:  # a per-request error, as the real sink reports it
                    logger.exception("capture failed")
                    meta["spec_capture"] = {"error": f"{type(exc).__name__}: {exc}"}
                    token = None
                rows.append({"output_ids": [] if token is None else [token], "meta_info": meta})
            if any(specs):
                logger.info("passthrough forms so far: %s", dict(sorted(self.passthrough_forms.items())))
        return rows


def make_handler(backend: ReferenceCapture, max_request_bytes: int = MAX_REQUEST_BYTES):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            if code >= 400:
                self.close_connection = True  # an unread or partly read body must not be parsed as a request
                self.send_header("Connection", "close")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] in ("/health", "/health_generate"):
                self._send(200, {"status": "ok"})
            elif self.path.split("?")[0] == "/server_info":
                self._send(
                    200,
                    {
                        "requests": backend.requests,
                        "samples": backend.samples,
                        "aux_layer_ids": list(backend.aux.positions),
                        "dtype": backend.dtype_name,
                        "passthrough_forms": dict(backend.passthrough_forms),
                    },
                )
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.split("?")[0] != "/generate":
                self._send(404, {"error": "not found"})
                return
            length = self._body_length()
            if length is None:
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                rows = backend.generate(body)
            except RecursionError:
                self._send(400, {"error": "request JSON nested too deeply"})
                return
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, {"error": str(exc)})
                return
            self._send(200, rows if len(rows) > 1 else rows[0])

        def _body_length(self) -> int | None:
            """The request's Content-Length, or None after answering 400/413 (nothing read)."""
            raw = self.headers.get("Content-Length", "0")
            try:
                length = int(raw)
            except ValueError:
                length = -1
            if length < 0:
                self._send(400, {"error": f"bad Content-Length {raw[:40]!r}"})
                return None
            if length > max_request_bytes:
                self._send(
                    413,
                    {"error": f"request body of {length} bytes is over this server's limit of {max_request_bytes}"},
                )
                return None
            return length

        def log_message(self, fmt: str, *args) -> None:
            logger.debug(fmt, *args)

    return Handler


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m specforge_kimi.servers.reference_server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model-path", required=True)
    p.add_argument(
        "--spec-capture-aux-layer-ids",
        type=int,
        nargs="+",
        required=True,
        help="SGLang/SpecForge ids (shifted by +1 when the first is 1, as SGLang does)",
    )
    p.add_argument(
        "--spec-capture-method",
        choices=METHODS,
        default="eagle3",
        help="how the ids are read: eagle3 (+1 when the first is 1) or dflash/dspark (+1 always)",
    )
    p.add_argument("--dtype", choices=_DTYPES, default="float32")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help=f"larger request bodies are refused with HTTP 413 (default {MAX_REQUEST_BYTES})",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    backend = ReferenceCapture(
        args.model_path, args.spec_capture_aux_layer_ids, args.dtype, method=args.spec_capture_method
    )
    import signal
    import sys

    # SIGTERM (the launch's teardown) exits through the finally below and atexit: a cuda_ipc pool's files go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = ThreadingHTTPServer((args.host, args.port), make_handler(backend, args.max_request_bytes))
    logger.info(
        "reference capture server on http://%s:%d (%s ids %s -> positions %s, %s)",
        args.host,
        args.port,
        backend.method,
        backend.aux_layer_ids,
        list(backend.aux.positions),
        args.dtype,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
