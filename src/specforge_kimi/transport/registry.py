"""The feature transports by name (:class:`.strategy.Transport` each), and the order ``auto`` asks them in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specforge_kimi.transport import SERVER_TRANSPORT_ENV, TRANSPORT_ENV
from specforge_kimi.transport.cuda_ipc import CUDA_IPC
from specforge_kimi.transport.mooncake import MOONCAKE
from specforge_kimi.transport.strategy import Transport

#: the order ``auto`` asks the strategies in (the first that accepts a recipe serves it); the last one is what a
#: process runs when its environment names none (SpecForge's own)
AUTO_ORDER: tuple[Transport, ...] = (CUDA_IPC, MOONCAKE)
REGISTRY: dict[str, Transport] = {t.name: t for t in AUTO_ORDER}
assert len(REGISTRY) == len(AUTO_ORDER) and all(n.islower() for n in REGISTRY), "names are lowercase and unique"


def names() -> tuple[str, ...]:
    return tuple(t.name for t in AUTO_ORDER)


def get(name: str) -> Transport:
    """The strategy named ``name``; ValueError naming the choices otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"transport {name!r}: expected one of {', '.join(names())}") from None


def default() -> Transport:
    """What a process runs when its environment names no transport."""
    return AUTO_ORDER[-1]


def from_env(env: Mapping[str, Any], *, server: bool = False) -> Transport:
    """The strategy a role's environment names (the capture server's variable with ``server``, else the SpecForge
    processes'); :func:`default` when unset. ValueError for a name no strategy has."""
    value = env.get(SERVER_TRANSPORT_ENV if server else TRANSPORT_ENV)
    return get(value) if value else default()
