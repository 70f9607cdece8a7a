"""What a cuda_ipc capture hands back instead of Mooncake keys: the pool, the slot, and where each feature lies.

Scope: the JSON form the capture server puts beside SpecForge's result in ``meta_info["spec_capture"]``
(``"cuda_ipc": {"v": 1, "pool": ID, "slot": N, "alloc": ID, "features": {name: [offset, nbytes]}}``; shapes
and dtypes stay in SpecForge's own ``features`` entry), and the ``SampleRef`` that carries it on to the trainer
(``metadata["cuda_ipc"]``, ``feature_store_uri`` ``cudaipc://POOL/SAMPLE``). JSON-native values only: refs are
written to SpecForge's ``refs.jsonl`` and its ledger as they are.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

VERSION = 1
URI_SCHEME = "cudaipc"
_POOL_ID = re.compile(r"[0-9a-f]{8,32}")
#: bound of every integer a descriptor carries (the slot table's int64 columns; pools are far smaller)
_MAX_INT = 2**62

#: the key of a capture result and of a ref's metadata that holds the descriptor
RESULT_KEY = "cuda_ipc"


def _count(x: Any, least: int) -> bool:
    """``x`` is a plain int (not a bool) in ``[least, 2**62)``."""
    return type(x) is int and least <= x < _MAX_INT


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """One sample's place in a pool: ``slot`` holds ``alloc_id`` while the sample is lent."""

    pool_id: str
    slot: int
    alloc_id: int
    features: dict[str, tuple[int, int]]  # name -> (byte offset in the pool, nbytes)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.features.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "pool": self.pool_id,
            "slot": self.slot,
            "alloc": self.alloc_id,
            "features": {name: [int(o), int(n)] for name, (o, n) in self.features.items()},
        }

    @classmethod
    def from_json(cls, raw: Any) -> Descriptor:
        """Parse and check a descriptor; ``ValueError`` naming what is wrong."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"cuda_ipc descriptor is not an object: {type(raw).__name__}")
        if raw.get("v") != VERSION:
            raise ValueError(f"cuda_ipc descriptor version {raw.get('v')!r}, expected {VERSION}")
        pool = raw.get("pool")
        if not isinstance(pool, str) or not _POOL_ID.fullmatch(pool):
            raise ValueError(f"cuda_ipc descriptor pool id {pool!r} is not a hex id")
        slot, alloc = raw.get("slot"), raw.get("alloc")
        if not _count(slot, 1) or not _count(alloc, 1):
            raise ValueError(f"cuda_ipc descriptor slot {slot!r} / alloc {alloc!r} must be positive integers")
        feats = raw.get("features")
        if not isinstance(feats, Mapping) or not feats:
            raise ValueError("cuda_ipc descriptor names no feature")
        out: dict[str, tuple[int, int]] = {}
        for name, place in feats.items():
            if (
                not isinstance(name, str)
                or not isinstance(place, (list, tuple))
                or len(place) != 2
                or not all(_count(x, 0) for x in place)
                or place[0] + place[1] >= _MAX_INT
            ):
                raise ValueError(
                    f"cuda_ipc descriptor feature {name!r}: {place!r} is not [offset, nbytes] (integers >= 0)"
                )
            out[name] = (place[0], place[1])
        return cls(pool, slot, alloc, out)


def uri(pool_id: str, sample_id: str) -> str:
    return f"{URI_SCHEME}://{pool_id}/{sample_id}"


def spec_nbytes(shape, dtype: str) -> int:
    """Bytes of a feature of ``shape`` and SpecForge dtype string ``dtype``."""
    import torch

    torch_dtype = getattr(torch, str(dtype), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown feature dtype {dtype!r}")
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=torch_dtype).element_size()


def with_descriptor(ref, raw: Any):
    """``ref`` (SpecForge's ``SampleRef`` built from a capture result) pointing at the pool: the descriptor in
    ``metadata["cuda_ipc"]`` and a ``cudaipc://`` URI. The descriptor must place exactly the ref's features,
    each with the bytes its spec says."""
    desc = Descriptor.from_json(raw)
    if set(desc.features) != set(ref.feature_specs):
        raise ValueError(
            f"sample {ref.sample_id}: cuda_ipc descriptor places {sorted(desc.features)}, "
            f"the capture names {sorted(ref.feature_specs)}"
        )
    for name, spec in ref.feature_specs.items():
        want = spec_nbytes(spec.shape, spec.dtype)
        if desc.features[name][1] != want:
            raise ValueError(
                f"sample {ref.sample_id}: cuda_ipc feature {name!r} holds {desc.features[name][1]} bytes, "
                f"its spec {tuple(spec.shape)} {spec.dtype} needs {want}"
            )
    return dataclasses.replace(
        ref,
        feature_store_uri=uri(desc.pool_id, ref.sample_id),
        metadata={**ref.metadata, "cuda_ipc": desc.to_json()},
    )
