"""SpecForge's side of the cuda_ipc transport: the ``FeatureStore`` its online producer and trainer ranks use.

Scope: SpecForge 0.2.0's ``FeatureStore`` contract as its disaggregated online path uses it (read in
``specforge/runtime/data_plane``): the consumer's ``FeatureDataLoader`` calls ``get`` then ``release``, the
optimizer-step acknowledgement (``DPAckController``) calls ``abort`` for each rank's acknowledged ids; the
producer's ``SGLangServerCaptureAdapter`` needs ``store_id``, ``track_external_attempt``, ``adopt`` and
``discard_external_attempts``; shutdown drains. ``register()`` returns this store from SpecForge's
``training.disaggregated._mooncake_store`` when ``SPECFORGE_KIMI_TRANSPORT=cuda_ipc`` (the recipe sets it for
every role), so SpecForge's producer and consumer run unchanged.

``get`` maps the sample's pool once per process (on the rank's own GPU, ``cuda:LOCAL_RANK``: SpecForge binds each
rank to it) and copies the sample into fresh tensors there; it answers on that GPU whatever device the loader
names (SpecForge's loader says ``cpu``, its strategy moves batches to the rank's GPU, a no-op then).
``release`` only drops the read lease: with ``retain_on_release`` (the consumer) the slot stays lent until
``abort`` at the optimizer-step acknowledgement, so a consumer resumed after a crash replays the unacknowledged
samples from the pool. ``abort`` writes the release into the slot table (no CUDA, so it works in the producer);
a sample this process never saw is found by its sample-id key. ``put`` is refused: features come from the
capture server only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from specforge.runtime.contracts import FeatureHandle, SampleRef
from specforge.runtime.data_plane.feature_store import FeatureStore

from specforge_kimi.transport import READER_DIR_ENV, TRANSPORT_ENV
from specforge_kimi.transport.descriptor import Descriptor
from specforge_kimi.transport.pool import PoolReader, read_pool_file
from specforge_kimi.transport.slots import SlotTable, sample_key

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def rank_device() -> torch.device:
    """The trainer rank's own GPU (``cuda:LOCAL_RANK``), read from torchrun's environment without touching CUDA."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


class CudaIpcFeatureStore(FeatureStore):
    """A ``FeatureStore`` over capture-server pools under ``pool_dir``."""

    backend = "cuda_ipc"
    #: how many released ``(sample id, alloc id)`` pairs are remembered to refuse a late ``get`` of them (the
    #: most recent ones; older ones are refused by the slot table's alloc check once the server frees the slot)
    FREED_KEPT = 65536

    def __init__(
        self,
        *,
        store_id: str,
        pool_dir: str | os.PathLike,
        retain_on_release: bool = False,
        device: torch.device | str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store_id = str(store_id)
        self.pool_dir = Path(pool_dir)
        self.retain_on_release = retain_on_release
        self._device = torch.device(device) if device is not None else None
        self._clock = clock
        self._lock = threading.RLock()
        self._readers: dict[str, PoolReader] = {}
        self._tables: dict[str, SlotTable] = {}  # pools this process releases into without reading them
        self._known: dict[str, Descriptor] = {}
        self._bytes: dict[str, int] = {}
        self._since: dict[str, float] = {}
        self._provisional: dict[tuple[str, int], list[str]] = {}
        self._leases: dict[str, FeatureHandle] = {}
        self._freed: OrderedDict[tuple[str, int], None] = OrderedDict()  # bounded by FREED_KEPT, oldest first
        self._counter = 0
        self._stats = {"reads": 0, "read_bytes": 0, "read_s": 0.0, "released": 0, "released_by_key": 0}

    @classmethod
    def from_env(cls, *, store_id: str, retain_on_release: bool = False) -> CudaIpcFeatureStore:
        pool_dir = os.environ.get(READER_DIR_ENV)
        if not pool_dir:
            raise ValueError(f"{TRANSPORT_ENV}=cuda_ipc needs {READER_DIR_ENV} (the capture server's pool dir)")
        return cls(store_id=store_id, pool_dir=pool_dir, retain_on_release=retain_on_release)

    # -- pools -------------------------------------------------------------------------------------------------
    def _reader(self, pool_id: str) -> PoolReader:
        with self._lock:
            reader = self._readers.get(pool_id)
            if reader is None:
                info = read_pool_file(self.pool_dir, pool_id)
                device = self._device or (rank_device() if info.backend == "cuda" else torch.device("cpu"))
                reader = self._readers[pool_id] = PoolReader(info, device)
                logger.info(
                    "cuda_ipc: mapped pool %s (%.2f GiB, %s, writer pid %d) on %s",
                    pool_id,
                    info.nbytes / 2**30,
                    info.backend,
                    info.pid,
                    device,
                )
            return reader

    def _table(self, pool_id: str) -> SlotTable | None:
        """The pool's slot table for releases (no memory mapping, no CUDA); None once the pool is gone."""
        with self._lock:
            if pool_id in self._readers:
                return self._readers[pool_id].table
            table = self._tables.get(pool_id)
            if table is None:
                try:
                    table = self._tables[pool_id] = SlotTable.attach(read_pool_file(self.pool_dir, pool_id).slots_path)
                except (FileNotFoundError, ValueError):
                    return None
            return table

    def _all_tables(self) -> list[SlotTable]:
        ids = sorted(p.stem for p in self.pool_dir.glob("*.json")) if self.pool_dir.is_dir() else []
        return [t for t in (self._table(i) for i in ids) if t is not None]

    # -- SpecForge's FeatureStore ------------------------------------------------------------------------------
    def put(self, tensors, *, sample_id: str, metadata: dict[str, Any]) -> SampleRef:
        raise NotImplementedError("cuda_ipc features are written by the capture server, not put by a client")

    @staticmethod
    def descriptor(ref: SampleRef) -> Descriptor:
        raw = (ref.metadata or {}).get("cuda_ipc")
        if raw is None:
            raise KeyError(
                f"sample {ref.sample_id} carries no cuda_ipc descriptor ({ref.feature_store_uri}): its capture server "
                "is not on the cuda_ipc transport"
            )
        return Descriptor.from_json(raw)

    def adopt(self, sample_ref: SampleRef) -> None:
        """Record a server-written sample so ``abort`` can release its slot without a ``get``."""
        desc = self.descriptor(sample_ref)
        with self._lock:
            self._known[sample_ref.sample_id] = desc
            self._bytes[sample_ref.sample_id] = desc.nbytes
            self._since[sample_ref.sample_id] = self._clock()
            for key in [k for k in self._provisional if k[0] == sample_ref.sample_id]:
                del self._provisional[key]

    def track_external_attempt(self, sample_id: str, *, generation: int, feature_names: list[str]) -> None:
        names = list(dict.fromkeys(str(n) for n in feature_names))
        if not names:
            raise ValueError("external capture attempt must name at least one feature")
        with self._lock:
            self._provisional[(str(sample_id), int(generation))] = names

    def discard_external_attempts(self, *, reason: str = "unadopted-external-capture") -> int:
        """Release whatever the server lent for captures whose answer never came (found by sample-id key)."""
        with self._lock:
            attempts = [sid for sid, _ in self._provisional if sid not in self._known]
            self._provisional.clear()
        released = sum(self._release_by_key(sid) for sid in attempts)
        if released:
            logger.info("cuda_ipc: released %d slots of unanswered captures (%s)", released, reason)
        return len(attempts)

    def get(
        self,
        sample_ref: SampleRef,
        *,
        device: torch.device | str = "cpu",
        names: list[str] | None = None,
    ) -> tuple[dict[str, torch.Tensor], FeatureHandle]:
        sid = sample_ref.sample_id
        desc = self.descriptor(sample_ref)
        with self._lock:
            if (sid, desc.alloc_id) in self._freed:
                raise KeyError(f"sample {sid} (cuda_ipc alloc {desc.alloc_id}) was released; refusing use-after-free")
        wanted = list(names or sample_ref.feature_keys)
        specs = {}
        for name in wanted:
            spec = sample_ref.feature_specs.get(name)
            if spec is None or name not in desc.features:
                raise KeyError(f"sample {sid} has no feature {name!r}")
            dtype = _DTYPES.get(spec.dtype)
            if dtype is None:
                raise KeyError(f"unsupported feature dtype {spec.dtype!r} for sample {sid}")
            specs[name] = (tuple(int(d) for d in spec.shape), dtype)
        reader = self._reader(desc.pool_id)
        out_device = self._device if self._device is not None else reader.memory.device
        if str(device) != "cpu":
            out_device = torch.device(device)
        t = time.perf_counter()
        out = reader.read(desc, specs, wanted, out_device)
        with self._lock:
            self._stats["reads"] += 1
            self._stats["read_bytes"] += sum(desc.features[n][1] for n in wanted)
            self._stats["read_s"] += time.perf_counter() - t
            self._known.setdefault(sid, desc)
            self._bytes.setdefault(sid, desc.nbytes)
            self._since.setdefault(sid, self._clock())
            self._counter += 1
            handle = FeatureHandle(sample_id=sid, generation=desc.alloc_id, lease_token=f"{sid}:{self._counter}")
            self._leases[handle.lease_token] = handle
        return out, handle

    def release(self, handle: FeatureHandle, *, reason: str = "consumed") -> None:
        with self._lock:
            self._leases.pop(handle.lease_token, None)
            if self.retain_on_release:
                return  # the optimizer-step acknowledgement aborts it
            if any(h.sample_id == handle.sample_id for h in self._leases.values()):
                return
        self.abort(handle.sample_id, reason=reason)

    def abort(self, sample_id: str, *, reason: str = "aborted") -> None:
        """Give the sample's slot back to the server (idempotent); by key when this process never saw it."""
        with self._lock:
            desc = self._known.pop(sample_id, None)
            self._bytes.pop(sample_id, None)
            self._since.pop(sample_id, None)
        if desc is None:
            self._release_by_key(sample_id)
            return
        with self._lock:
            self._freed[(sample_id, desc.alloc_id)] = None
            self._freed.move_to_end((sample_id, desc.alloc_id))
            while len(self._freed) > self.FREED_KEPT:
                self._freed.popitem(last=False)
        table = self._table(desc.pool_id)
        if table is not None and table.release(desc.slot, desc.alloc_id):
            self._stats["released"] += 1

    def _release_by_key(self, sample_id: str) -> int:
        key = sample_key(sample_id)
        n = 0
        for table in self._all_tables():
            for slot, alloc_id in table.find(key):
                n += table.release(slot, alloc_id)
        self._stats["released_by_key"] += n
        return n

    def drain_sample_removals(self, sample_ids, **_kw) -> dict[str, int]:
        return {"removed": 0, "removed_bytes": 0, "release_pending": 0}  # releases are synchronous writes

    def drain_pending_removals(self, **_kw) -> dict[str, int]:
        return {"removed": 0, "removed_bytes": 0, "release_pending": 0}

    def gc(self, *, now: float | None = None) -> dict[str, int]:
        return {"force_freed": 0, "force_freed_bytes": 0, "release_pending": 0}  # the server owns leases

    def close(self) -> None:
        """Drop this process's mappings (the pools' memory is closed when the last tensor read from it is freed)."""
        with self._lock:
            readers, self._readers = self._readers, {}
            self._tables.clear()
        for reader in readers.values():
            reader.table.close()

    def health(self) -> dict[str, Any]:
        with self._lock:
            now = self._clock()
            ages = [now - t for t in self._since.values()]
            read_s = self._stats["read_s"]
            return {
                "store_id": self.store_id,
                "backend": self.backend,
                "resident_samples": len(self._known),
                "resident_bytes": sum(self._bytes.values()),
                "active_leases": len(self._leases),
                "provisional_external": len(self._provisional),
                "release_pending": 0,
                "oldest_age_s": max(ages) if ages else 0.0,
                "pools": sorted(self._readers),
                "read_gb_per_s": self._stats["read_bytes"] / read_s / 1e9 if read_s else None,
                **{k: v for k, v in self._stats.items() if k != "read_s"},
            }


__all__ = ["CudaIpcFeatureStore", "rank_device"]
