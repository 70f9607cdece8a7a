"""The ``cuda_ipc`` feature transport of a co-located online run: captured hidden states go from the SGLang
capture server to the trainer ranks through one GPU pool the server owns, mapped once per process by CUDA IPC,
instead of GPU -> host -> Mooncake over loopback TCP -> host -> GPU.

Scope: one node (IPC handles do not cross hosts), one capture writer (attention-TP rank 0 of one SGLang server;
DP attention would make one writer per DP group), GPUs that reach the writer's GPU by peer access when TP > 1.
Where those do not hold the recipe refuses ``server.transport: cuda_ipc`` and Mooncake stays the transport.

The pieces, each a module:

- :mod:`.regions` the pool's byte ranges (first fit, coalescing, 256-byte aligned);
- :mod:`.slots` the release channel: a node-local slot table both sides map (the server writes what it lent,
  readers write what they release);
- :mod:`.descriptor` what a capture result and a ``SampleRef`` carry instead of Mooncake keys;
- :mod:`.pool` the pool's memory, exported once (CUDA IPC handle, or a shared-memory file for the CPU
  stand-in server), the pool file that names it, and the reader's mapping;
- :mod:`.writer` the capture server's side (what SGLang patch spec-capture-cuda-ipc and the CPU reference server
  call);
- :mod:`.store` SpecForge's side: a ``FeatureStore`` for the producer and the trainer ranks
  (``register()`` installs it when ``SPECFORGE_KIMI_TRANSPORT=cuda_ipc``).

Importing this package imports nothing heavy; torch and SpecForge are imported by the modules that need them.
"""

from __future__ import annotations

import specforge_kimi.environment as _env

#: the transports a recipe may name (``server.transport``)
TRANSPORTS = ("mooncake", "cuda_ipc")

# -- the capture server's environment (SGLang patch spec-capture-cuda-ipc and the CPU reference server read these) -
#: ``mooncake`` (SpecForge's sink, the default) or ``cuda_ipc`` (this package's pool)
SERVER_TRANSPORT_ENV = _env.SERVER_TRANSPORT.name
#: the pool's size in bytes (recipe ``server.ipc_pool_gib``)
POOL_BYTES_ENV = _env.IPC_POOL_BYTES.name
#: the directory the pool file goes to (the readers' :data:`READER_DIR_ENV` names the same one)
POOL_DIR_ENV = _env.IPC_POOL_DIR.name
#: seconds a lent slot may stay unreleased before the server logs and reclaims it (recipe ``server.ipc_lease_s``)
LEASE_ENV = _env.IPC_LEASE_S.name
#: rows of the slot table (samples lent at once), default :data:`DEFAULT_MAX_SLOTS`
MAX_SLOTS_ENV = _env.IPC_MAX_SLOTS.name
#: seconds a batch waits for pool space before its captures fail (default: the lease + 60 s)
WAIT_ENV = _env.IPC_WAIT_S.name

# -- SpecForge's processes (producer, trainer ranks) ---------------------------------------------------------
#: ``cuda_ipc`` makes ``register()``'s store seam answer SpecForge's online feature store with ours
TRANSPORT_ENV = _env.TRANSPORT.name
#: where readers find pool files (the server's :data:`POOL_DIR_ENV`)
READER_DIR_ENV = _env.IPC_DIR.name

DEFAULT_LEASE_S = 1800.0
DEFAULT_MAX_SLOTS = 16384
#: bytes each feature of a sample is aligned to inside its region
ALIGN = 256
