"""A node's GPUs: which devices a recipe's roles see on one node."""

from __future__ import annotations

import os
from typing import Any

from specforge_kimi.errors import KimiInputError


def node_gpus(count: int, environ: Any = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for a node's ``count`` GPUs: the first ``count`` devices
    the launching environment already lists in ``CUDA_VISIBLE_DEVICES``, else ``0..count-1``."""
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return ",".join(str(i) for i in range(count))
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if len(devices) < count:
        raise KimiInputError(
            f"CUDA_VISIBLE_DEVICES={visible} lists {len(devices)} device(s) but the recipe needs "
            f"{count} per node (gpus.per_node); list {count} or unset it"
        )
    return ",".join(devices[:count])
