"""The capture server's side of the cuda_ipc transport: copy each captured sample into the pool, lend its slot.

Scope: called on the capture sink's single writer thread (SGLang's ``spec-capture-batch-put`` executor, through
SGLang patch spec-capture-cuda-ipc; or the CPU reference server's request thread), one instance per server process,
created on the attention-TP rank 0 that writes captures. What it does per scheduler batch:

1. reclaim: free every slot a reader released (``release == alloc`` in the slot table) and every slot older
   than the lease (logged with its sample id: a trainer that never acknowledged it, or a lost one);
2. per sample: free a previous lend of the same sample id (SpecForge retries a capture under the same id with
   ``replace``), take one region for all its features (waiting while the pool is full: backpressure, not an
   error, until the wait limit), and copy aux hidden states, last hidden state and the passthrough tensors
   into it -- device to device on a private CUDA stream for the captured rows the scheduler left on the GPU,
   host to device for the small passthrough tensors;
3. wait for the copies once, then return SpecForge's result per sample plus its descriptor
   (:mod:`specforge_kimi.transport.descriptor`); the scheduler drops its GPU rows only after that.

A sample too large for the whole pool fails its batch at once with the size it needed.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specforge_kimi.transport import (
    ALIGN,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_SLOTS,
    LEASE_ENV,
    MAX_SLOTS_ENV,
    POOL_BYTES_ENV,
    POOL_DIR_ENV,
    SERVER_TRANSPORT_ENV,
    TRANSPORTS,
    WAIT_ENV,
)
from specforge_kimi.transport.descriptor import Descriptor
from specforge_kimi.transport.pool import (
    PoolInfo,
    create_memory,
    process_start,
    remove_pool_files,
    slots_path,
    write_pool_file,
)
from specforge_kimi.transport.regions import RegionAllocator, aligned
from specforge_kimi.transport.slots import SlotTable, sample_key

logger = logging.getLogger(__name__)

_AUX, _LAST = "aux", "last_hidden"  # the sink's artifact names (SpecForge's spec-capture patch)


@dataclasses.dataclass
class _Lent:
    sample_id: str
    offset: int
    nbytes: int
    alloc_id: int
    since: float  # the writer's clock


def server_transport(environ=None) -> str:
    """The capture server's transport from its environment (``mooncake`` unless set); unknown values refused."""
    value = (os.environ if environ is None else environ).get(SERVER_TRANSPORT_ENV, "mooncake") or "mooncake"
    if value not in TRANSPORTS:
        raise ValueError(f"{SERVER_TRANSPORT_ENV}={value!r}: expected one of {', '.join(TRANSPORTS)}")
    return value


class IpcCaptureWriter:
    """One capture server's pool, slot table and pool file; :meth:`from_env` in the server."""

    WAIT_POLL_S = 0.005
    WAIT_LOG_S = 30.0

    def __init__(
        self,
        *,
        pool_bytes: int,
        pool_dir: str | os.PathLike,
        device,
        lease_s: float = DEFAULT_LEASE_S,
        max_slots: int = DEFAULT_MAX_SLOTS,
        wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import torch

        pool_bytes = aligned(int(pool_bytes), ALIGN)
        if pool_bytes <= 0:
            raise ValueError("the cuda_ipc pool needs a positive size")
        if lease_s <= 0:
            raise ValueError(f"lease must be positive, not {lease_s}")
        self.pool_id = uuid.uuid4().hex[:16]
        self.pool_dir = os.fspath(pool_dir)
        self.device = torch.device(device)
        self.lease_s = float(lease_s)
        self.wait_s = float(wait_s) if wait_s is not None else self.lease_s + 60.0
        self._clock = clock
        self.memory, backend, handle, dev = create_memory(self.pool_id, pool_bytes, self.device)
        if backend == "cuda":
            self.device = self.memory.device
        slots = slots_path(self.pool_id)
        try:
            self.table = SlotTable.create(slots, max_slots=max_slots, capacity=pool_bytes)
        except BaseException:
            if backend == "shm":  # ours: created above; nothing else is removed
                Path(handle["path"]).unlink(missing_ok=True)
            raise
        self.regions = RegionAllocator(pool_bytes, align=ALIGN)
        self.info = PoolInfo(
            pool_id=self.pool_id,
            backend=backend,
            nbytes=pool_bytes,
            slots_path=str(slots),
            pid=os.getpid(),
            pid_start=process_start(os.getpid()),
            lease_s=self.lease_s,
            created=time.time(),
            device=dev,
            handle=handle,
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
        )
        self._lent: dict[int, _Lent] = {}
        self._by_sample: dict[str, int] = {}
        self._batch: set[int] = set()  # slots lent to the batch being written: never expired under it
        self._next_alloc = 1
        self._stream = None
        self._closed = False
        self.stats = {"lent": 0, "released": 0, "expired": 0, "replaced": 0, "failed": 0, "wait_s": 0.0}
        try:
            self.pool_file = write_pool_file(self.pool_dir, self.info)
        except BaseException:
            self.table.close()
            remove_pool_files(self.info)  # the table and shared-memory file made above, not the refused path
            raise
        atexit.register(self.close)
        logger.info(
            "cuda_ipc pool %s: %.2f GiB on %s (%s), %d slots, lease %.0f s, pool file %s",
            self.pool_id,
            pool_bytes / 2**30,
            self.device,
            backend,
            max_slots,
            self.lease_s,
            self.pool_file,
        )

    @classmethod
    def from_env(cls, *, device, environ=None) -> IpcCaptureWriter | None:
        """The writer the capture server's environment asks for, or None when its transport is ``mooncake``."""
        env = os.environ if environ is None else environ
        if server_transport(env) != "cuda_ipc":
            return None
        missing = [k for k in (POOL_BYTES_ENV, POOL_DIR_ENV) if not env.get(k)]
        if missing:
            raise ValueError(f"{SERVER_TRANSPORT_ENV}=cuda_ipc needs {', '.join(missing)}")
        return cls(
            pool_bytes=int(env[POOL_BYTES_ENV]),
            pool_dir=env[POOL_DIR_ENV],
            device=device,
            lease_s=float(env.get(LEASE_ENV) or DEFAULT_LEASE_S),
            max_slots=int(env.get(MAX_SLOTS_ENV) or DEFAULT_MAX_SLOTS),
            wait_s=float(env[WAIT_ENV]) if env.get(WAIT_ENV) else None,
        )

    @staticmethod
    def wants(spec: dict) -> bool:
        """Whether a request's ``spec_capture`` goes to the pool: all do, unless one names ``transport:
        mooncake`` (tests and benches compare both transports on one server)."""
        return spec.get("transport", "cuda_ipc") == "cuda_ipc"

    # -- reclaim -------------------------------------------------------------------------------------------------
    def reclaim(self) -> int:
        """Free released slots and slots past their lease; returns how many were freed."""
        freed = 0
        for slot in self.table.released():
            if slot in self._lent:
                self._free(slot)
                self.stats["released"] += 1
                freed += 1
        now = self._clock()
        for slot, lent in list(self._lent.items()):
            if now - lent.since > self.lease_s and slot not in self._batch:
                logger.warning(
                    "cuda_ipc pool %s: sample %s held slot %d for %.0f s, past the %.0f s lease, without a release; "
                    "reclaimed (a trainer that stopped before acknowledging it, or a capture nobody adopted)",
                    self.pool_id,
                    lent.sample_id,
                    slot,
                    now - lent.since,
                    self.lease_s,
                )
                self._free(slot)
                self.stats["expired"] += 1
                freed += 1
        return freed

    def _free(self, slot: int) -> None:
        lent = self._lent.pop(slot)
        if self._by_sample.get(lent.sample_id) == slot:
            del self._by_sample[lent.sample_id]
        self.table.free(slot)
        self.regions.free(lent.offset)

    # -- lend ----------------------------------------------------------------------------------------------------
    def _lend(self, sample_id: str, nbytes: int) -> tuple[int, int, int]:
        """``(slot, offset, alloc_id)`` for ``nbytes``; waits (reclaiming) while the pool or the table is full."""
        if aligned(nbytes, ALIGN) > self.regions.capacity:
            raise RuntimeError(
                f"cuda_ipc: sample {sample_id} needs {nbytes} bytes, the whole pool is {self.regions.capacity} "
                "(raise server.ipc_pool_gib)"
            )
        started = time.monotonic()  # the wait is real time; leases use the (injectable) clock
        logged = started
        while True:
            offset = self.regions.alloc(nbytes)
            if offset is not None:
                alloc_id = self._next_alloc
                slot = self.table.claim(
                    alloc_id=alloc_id, key=sample_key(sample_id), offset=offset, nbytes=nbytes, t_ns=time.time_ns()
                )
                if slot is not None:
                    self._next_alloc += 1
                    self._lent[slot] = _Lent(sample_id, offset, aligned(nbytes, ALIGN), alloc_id, self._clock())
                    self._by_sample[sample_id] = slot
                    self.stats["lent"] += 1
                    self.stats["wait_s"] += time.monotonic() - started
                    return slot, offset, alloc_id
                self.regions.free(offset)  # every row lent: wait like a full pool
            if self.reclaim():
                continue
            now = time.monotonic()
            if now - started > self.wait_s:
                raise RuntimeError(
                    f"cuda_ipc pool {self.pool_id} full for {now - started:.0f} s: {len(self._lent)} samples lent, "
                    f"{self.regions.free_bytes} of {self.regions.capacity} bytes free (largest "
                    f"{self.regions.largest_free}), none released; the trainer is not acknowledging"
                )
            if now - logged >= self.WAIT_LOG_S:
                logger.warning(
                    "cuda_ipc pool %s full: waiting %.0f s for releases (%d samples lent, %d bytes free)",
                    self.pool_id,
                    now - started,
                    len(self._lent),
                    self.regions.free_bytes,
                )
                logged = now
            time.sleep(self.WAIT_POLL_S)

    def _named(self, spec: dict, aux, last_hidden, passthrough_tensor) -> list[tuple[str, Any]]:
        """A sample's (feature name, tensor) list in SpecForge's layout: aux [1, L, 3H], last hidden [1, L, H],
        then the passthrough tensors, as the Mooncake sink stores them."""
        features = dict(spec.get("features") or {})
        named = []
        if features.get(_AUX) is not None:
            if aux is None:
                raise RuntimeError(
                    "spec_capture requested 'aux' but no aux hidden states were captured -- launch the server "
                    "with --enable-spec-capture"
                )
            named.append((str(features[_AUX]), aux.unsqueeze(0)))
        if features.get(_LAST) is not None:
            if last_hidden is None:
                raise RuntimeError("spec_capture requested 'last_hidden' but the logits processor did not return it")
            named.append((str(features[_LAST]), last_hidden.unsqueeze(0)))
        for item in spec.get("passthrough") or []:
            named.append((str(item["name"]), passthrough_tensor(item)))
        return named

    def _context(self):
        import contextlib

        import torch

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            torch.cuda.set_device(self.device)  # the sink's thread starts on device 0
            self._stream = torch.cuda.Stream(device=self.device)
        return torch.cuda.stream(self._stream)

    def put_samples(
        self,
        samples: Sequence[tuple[dict, Any, Any]],
        *,
        passthrough_tensor: Callable[[dict], Any],
        aux_layer_ids: Sequence[int] | None,
    ) -> list[dict]:
        """One scheduler batch of ``(spec_capture, aux rows, last hidden rows)`` into the pool; SpecForge's result
        dict per sample with ``"cuda_ipc"`` (the descriptor) added. On any error the batch's slots are freed and
        the error raised (the sink fails the batch's captures)."""
        if self._closed:
            raise RuntimeError(f"cuda_ipc pool {self.pool_id} is closed")
        timing = os.environ.get("SGLANG_SPEC_CAPTURE_TIMING", "0") == "1"
        t0 = time.perf_counter()
        staged = [(spec, self._named(spec, aux, last, passthrough_tensor)) for spec, aux, last in samples]
        self.reclaim()
        t_reclaim = time.perf_counter()
        made: list[int] = []
        results: list[dict] = []
        waited = 0.0
        try:
            with self._context():
                for spec, named in staged:
                    sample_id = str(spec["sample_id"])
                    prior = self._by_sample.get(sample_id)
                    if prior is not None:  # a retry of a capture whose answer was lost, or a re-capture
                        self._free(prior)
                        self.stats["replaced"] += 1
                    sizes = [t.numel() * t.element_size() for _, t in named]
                    total = sum(aligned(n, ALIGN) for n in sizes) or ALIGN
                    w = time.perf_counter()
                    slot, offset, alloc_id = self._lend(sample_id, total)
                    waited += time.perf_counter() - w
                    made.append(slot)
                    self._batch.add(slot)
                    places, feats = {}, {}
                    at = offset
                    for (name, tensor), nbytes in zip(named, sizes, strict=True):
                        dst = self.memory[at : at + nbytes].view(tensor.dtype).view(tensor.shape)
                        dst.copy_(tensor, non_blocking=self._stream is not None)
                        places[name] = (at, nbytes)
                        feats[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}
                        at += aligned(nbytes, ALIGN)
                    results.append(
                        {
                            "sample_id": sample_id,
                            "store_id": str(spec["store_id"]),
                            "gen": int(spec.get("gen", 1)),
                            "aux_layer_ids": list(aux_layer_ids) if aux_layer_ids is not None else None,
                            "features": feats,
                            "cuda_ipc": Descriptor(self.pool_id, slot, alloc_id, places).to_json(),
                        }
                    )
                t_issued = time.perf_counter()
                if self._stream is not None:
                    self._stream.synchronize()  # the copies are done before SGLang may drop its rows
        except BaseException:
            for slot in made:
                if slot in self._lent:
                    self._free(slot)
            self.stats["failed"] += len(samples)
            raise
        finally:
            self._batch.clear()
        if timing:
            done = time.perf_counter()
            logger.info(
                "[spec-capture-timing] ipc_sink samples=%d bytes=%d reclaim_ms=%.3f wait_ms=%.3f issue_ms=%.3f "
                "copy_wait_ms=%.3f total_ms=%.3f",
                len(samples),
                sum(d["cuda_ipc"]["features"][n][1] for d in results for n in d["cuda_ipc"]["features"]),
                (t_reclaim - t0) * 1000,
                waited * 1000,
                (t_issued - t_reclaim - waited) * 1000,
                (done - t_issued) * 1000,
                (done - t0) * 1000,
            )
        return results

    def lent(self) -> dict:
        """What is lent now (for logs and tests)."""
        return {
            "samples": len(self._lent),
            "bytes": sum(x.nbytes for x in self._lent.values()),
            "free_bytes": self.regions.free_bytes,
            **self.stats,
        }

    def close(self) -> None:
        """Remove the pool file and the slot table (readers then refuse the pool); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.reclaim()  # count what readers released since the last batch
            logger.info("cuda_ipc pool %s closed: %s", self.pool_id, json.dumps(self.lent(), sort_keys=True))
            self.table.close()
        finally:
            remove_pool_files(self.info, self.pool_dir)
