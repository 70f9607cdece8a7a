"""A text-only SGLang capture server for Kimi-K2.5 checkpoints (SpecForge's online mode).

Scope: SGLang 0.5.14 patched with SpecForge's ``spec-capture.patch`` (its server flags
``--enable-spec-capture`` etc. exist only then), a local K2.5 checkpoint directory.

Why this exists: SGLang builds a multimodal processor for ``KimiK25ForConditionalGeneration``
even with ``--skip-tokenizer-init``; a checkpoint without processor files then fails at start.
``enable_multimodal`` is ``Optional[bool]`` on ``ServerArgs`` but its CLI flag is store_true, so
``False`` cannot be passed on the command line. ``python -m specforge_kimi.capture_server ARGS``
parses ARGS with SGLang's own parser (``ServerArgs.add_cli_args``), sets
``enable_multimodal=False`` on the parsed namespace *before* ``ServerArgs`` runs its
``__post_init__`` (which caches a ``ModelConfig`` built from that value), and then runs exactly
what ``python -m sglang.launch_server`` runs (``load_plugins``, ``run_server``,
``kill_process_tree``).

:func:`capture_server_argv` builds the command SpecForge's ``managed_local`` mode would launch
(``specforge.launch_plan._managed_local_services``) with this module as the entry point, and
:func:`capture_server_env` the environment the spec-capture sink reads its Mooncake endpoints
from. Importing this module imports neither sglang nor specforge.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import specforge_kimi.environment as _env
from specforge_kimi.targets.checkpoint import is_kimi_k25_checkpoint

#: What the spec-capture patch's sink and SpecForge's managed_local launcher use.
SPEC_CAPTURE_METHOD = "eagle3"
#: ``--spec-capture-method`` values the spec-capture patch takes (dflash and dspark share the DFlash aux plumbing;
#: their ids are DFlash ids, captured after layer ``id``)
SPEC_CAPTURE_METHODS = ("eagle3", "dflash", "dspark")
#: NVLink multicast stays off on shared hosts (see the device notes); servers inherit these.
NVLS_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FUSION_BACKEND_SM90 = "trtllm"
#: SGLang's switch for its distributed init method (``sglang.srt.environ``; read in ``init_torch_distributed``)
DIST_INIT_OVERRIDE_ENV = _env.DIST_INIT_OVERRIDE.name
#: gloo's and NCCL's socket listeners on the loopback interface (a single node's ranks need no other)
LOOPBACK_IFNAME_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
#: our SpecForge patch compact-capture-passthrough sends capture passthrough compactly when this is "1" (recipe
#: ``server.compact_passthrough``; SGLang patch spec-capture-compact-passthrough rebuilds the values)
COMPACT_PASSTHROUGH_ENV = _env.SPEC_CAPTURE_COMPACT.name


def mooncake_config(
    *,
    rpc_port: int = 35551,
    metadata_port: int = 35880,
    metrics_port: int = 35903,
    global_segment_size_bytes: int = 32 << 30,
    local_buffer_size_bytes: int = 1 << 30,
    **kwargs: Any,
):
    """SpecForge's own ``ManagedLocalMooncakeConfig`` (loopback master; its defaults otherwise)."""
    from specforge.config.schema import ManagedLocalMooncakeConfig

    return ManagedLocalMooncakeConfig(
        rpc_port=rpc_port,
        metadata_port=metadata_port,
        metrics_port=metrics_port,
        global_segment_size_bytes=global_segment_size_bytes,
        local_buffer_size_bytes=local_buffer_size_bytes,
        **kwargs,
    )


def mooncake_master_argv(mooncake, *, python: str = sys.executable, host: str = "127.0.0.1") -> list[str]:
    """The master SpecForge's managed_local starts, through ``mooncake.cli`` (no PATH lookup), with its three
    listeners (RPC, HTTP metadata, metrics) bound to ``host``: loopback unless a multi-node recipe names an
    address. Mooncake binds each to 0.0.0.0 unless told (``mooncake_master --help``: ``rpc_address``,
    ``http_metadata_server_host``, ``metrics_host``)."""
    return [
        python,
        "-c",
        "from mooncake.cli import main; main()",
        "--enable_http_metadata_server=true",
        f"--rpc_address={host}",
        f"--http_metadata_server_host={host}",
        f"--metrics_host={host}",
        f"--rpc_port={mooncake.rpc_port}",
        f"--http_metadata_server_port={mooncake.metadata_port}",
        f"--metrics_port={mooncake.metrics_port}",
    ]


def mooncake_client_env(mooncake) -> dict[str, str]:
    """``MOONCAKE_*`` endpoints, as SpecForge's managed_local exports them to every role."""
    env = {
        "MOONCAKE_METADATA_SERVER": f"http://127.0.0.1:{mooncake.metadata_port}/metadata",
        "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{mooncake.rpc_port}",
        "MOONCAKE_LOCAL_HOSTNAME": mooncake.local_hostname,
        "MOONCAKE_PROTOCOL": mooncake.protocol,
    }
    if mooncake.rdma_devices:
        env["MOONCAKE_RDMA_DEVICES"] = mooncake.rdma_devices
    return env


def capture_server_env(
    mooncake, *, cuda_visible_devices: Sequence[int | str] | None = None, put_clients: int = 1
) -> dict[str, str]:
    """Environment additions for a capture server (SpecForge's managed_local ``service_env``).

    The patch's sink reads its Mooncake endpoints and segment sizes from these; the server owns
    the Mooncake segment the features live in, so its segment must hold every capture in flight.
    ``put_clients`` > 1 sets ``SGLANG_SPEC_CAPTURE_PUT_CLIENTS`` (our SGLang patch spec-capture-parallel-put: the sink
    splits each batch's put over that many store clients, each mounting 1/N of the segment).
    """
    if put_clients < 1:
        raise ValueError(f"put_clients must be >= 1, not {put_clients}")
    env = {
        **mooncake_client_env(mooncake),
        "FLASHINFER_DISABLE_VERSION_CHECK": "1",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(mooncake.global_segment_size_bytes),
        "MOONCAKE_LOCAL_BUFFER_SIZE": str(mooncake.local_buffer_size_bytes),
        **NVLS_OFF_ENV,
    }
    if put_clients > 1:
        env["SGLANG_SPEC_CAPTURE_PUT_CLIENTS"] = str(put_clients)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in cuda_visible_devices)
    return env


def mooncake_reader_setup_kwargs(mooncake, *, client_buffer_size: int = 256 << 20) -> dict[str, Any]:
    """``MooncakeFeatureStore(setup_kwargs=...)`` for a reader: no segment of its own, as
    SpecForge's launcher forces for online producers and consumers (the server owns the data)."""
    return {
        "local_hostname": mooncake.local_hostname,
        "metadata_server": f"http://127.0.0.1:{mooncake.metadata_port}/metadata",
        "master_server_addr": f"127.0.0.1:{mooncake.rpc_port}",
        "protocol": mooncake.protocol,
        "rdma_devices": mooncake.rdma_devices or "",
        "global_segment_size": 0,
        "local_buffer_size": client_buffer_size,
    }


def capture_server_argv(
    model_dir: str | os.PathLike,
    *,
    tp: int,
    port: int,
    aux_specforge_ids: Sequence[int],
    fusion: bool | None,
    attention_backend: str = "triton",
    mem_fraction_static: float = 0.4,
    context_length: int | None = None,
    host: str = "127.0.0.1",
    dtype: str = "bfloat16",
    disable_cuda_graph: bool = True,
    ep_size: int = 1,
    dp_attention_size: int | None = None,
    python: str = sys.executable,
    extra: Sequence[str] = (),
    method: str = SPEC_CAPTURE_METHOD,
) -> list[str]:
    """The whole command line of a text-only K2.5 capture server.

    Identical to what SpecForge 0.2.0's ``managed_local`` launcher builds for one capture server
    (same fixed flags in the same order, then ``specforge.launch_plan._sglang_argv`` over a
    SpecForge ``ModelConfig`` for the ``sglang_*`` knobs), except that the module is this one and
    these are appended: ``--disable-cuda-graph`` (default; tiny/debug servers), and the all-reduce
    fusion switch: ``fusion=None`` -> nothing (SGLang's own auto choice, e.g. on SM100);
    ``fusion=False`` -> ``--enforce-disable-flashinfer-allreduce-fusion``;
    ``fusion=True`` -> ``--flashinfer-allreduce-fusion-backend trtllm`` (what ``auto`` picks on a
    single SM90 node; named so that the multicast-based ``mnnvl`` backend is never chosen).

    ``aux_specforge_ids`` are the ids of the capture ``method`` (:data:`SPEC_CAPTURE_METHODS`): for eagle3,
    SpecForge/SGLang ids (SGLang shifts all by +1 when the first is 1); for dflash/dspark, DFlash ids (always +1;
    see :mod:`specforge_kimi.targets.layer_ids`). ``context_length=None`` keeps the checkpoint's own.

    ``ep_size`` (expert parallelism) and ``dp_attention_size`` (``--enable-dp-attention --dp-size N``:
    N attention data-parallel groups inside the TP group, the layout DeepSeek-V3-style models are served
    with) go through SpecForge's own ``ModelConfig`` fields (``sglang_ep_size``, ``sglang_enable_dp_attention``,
    ``sglang_dp_size``), so the flags are spelled as SpecForge spells them; each must divide ``tp``. SpecForge's
    managed launcher refuses DP attention for capture servers, and the capture patch writes from every
    attention-TP rank 0 (one per DP group): whether those captures are right is what the TP=8 parity test
    checks (``tests/gpu/test_capture_parity.py``), not something this function assumes.
    """
    from specforge.config import ModelConfig
    from specforge.launch_plan import _sglang_argv

    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    ids = [int(i) for i in aux_specforge_ids]
    if not ids:
        raise ValueError("aux_specforge_ids is empty")
    if method not in SPEC_CAPTURE_METHODS:
        raise ValueError(f"capture method {method!r}: expected one of {', '.join(SPEC_CAPTURE_METHODS)}")
    for name, size in (("ep_size", ep_size), ("dp_attention_size", dp_attention_size)):
        if size is not None and (size < 1 or tp % size):
            raise ValueError(f"{name} must be a positive divisor of tp={tp}, got {size}")
    dp = dp_attention_size if (dp_attention_size or 1) > 1 else None  # one DP group is no DP attention
    argv = [
        python,
        "-m",
        "specforge_kimi.capture_server",
        "--model-path",
        str(model_dir),
        "--dtype",
        dtype,
        "--skip-tokenizer-init",
        "--tp-size",
        str(tp),
        "--chunked-prefill-size",
        "-1",
        "--enable-spec-capture",
        "--spec-capture-method",
        method,
        "--spec-capture-aux-layer-ids",
        *[str(i) for i in ids],
        "--host",
        host,
        "--port",
        str(port),
    ]
    model = ModelConfig(
        target_model_path=str(model_dir),
        torch_dtype=dtype,
        sglang_attention_backend=attention_backend,
        sglang_mem_fraction_static=mem_fraction_static,
        sglang_context_length=context_length,
        sglang_ep_size=ep_size,
        sglang_enable_dp_attention=dp is not None,
        sglang_dp_size=dp,
    )
    argv += _sglang_argv(model)
    if disable_cuda_graph:
        argv.append("--disable-cuda-graph")
    if fusion:
        argv += ["--flashinfer-allreduce-fusion-backend", FUSION_BACKEND_SM90]
    elif fusion is not None:
        argv.append("--enforce-disable-flashinfer-allreduce-fusion")
    argv += list(extra)
    return argv


# --------------------------------------------------------------------------------------------
# the entry point (imports sglang)
# --------------------------------------------------------------------------------------------
def parse_text_only_args(argv: Sequence[str]):
    """SGLang's own CLI parsing (``sglang.srt.server_args.prepare_server_args``), with
    ``enable_multimodal=False`` forced on the namespace for K2.5 checkpoints.

    Returns the argparse namespace; :func:`prepare_text_only_server_args` turns it into
    ``ServerArgs``. Forcing happens before ``ServerArgs.__post_init__`` because that caches a
    ``ModelConfig`` (``server_args.model_config``) built from ``enable_multimodal``.
    """
    import argparse
    import logging

    from sglang.srt.server_args import ServerArgs

    argv = list(argv)
    parser = argparse.ArgumentParser(prog="python -m specforge_kimi.capture_server")
    ServerArgs.add_cli_args(parser)
    if "--config" in argv:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    raw = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, raw.log_level.upper()),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
    if is_kimi_k25_checkpoint(raw.model_path):
        if raw.enable_multimodal:
            raise SystemExit("specforge_kimi.capture_server serves K2.5 text-only; drop --enable-multimodal")
        raw.enable_multimodal = False
        print(
            f"specforge_kimi.capture_server: {raw.model_path} is a kimi_k25 checkpoint; "
            "set enable_multimodal=False (text-only: no vision tower, no multimodal processor)",
            flush=True,
        )
    return raw


def prepare_text_only_server_args(argv: Sequence[str]):
    """``ServerArgs`` for ``argv`` (see :func:`parse_text_only_args`)."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs.from_cli_args(parse_text_only_args(argv))


def loopback_env(server_args, store_dir: str | os.PathLike) -> dict[str, str]:
    """What a single-node server's distributed init needs to listen on loopback only; nothing for a multi-node one
    (``--nnodes`` > 1 or ``--dist-init-addr``), whose ranks must reach each other.

    SGLang's model runner rendezvous at ``tcp://127.0.0.1:<port>``, and torch's TCPStore server then listens on
    every address whatever host it is given (``TCPStoreLibUvBackend.cpp``, ``UvTcpServer::makeWithPort``; see
    :mod:`specforge_kimi.servers.loopback`). SGLang's own switch for that rendezvous,
    ``SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE`` (``ModelRunner.init_torch_distributed``), names a ``file://``
    store in ``store_dir`` instead: no TCP listener at all. Gloo's (SGLang's CPU groups) and NCCL's bootstrap
    listeners bind the address the host name resolves to unless told an interface: ``lo``."""
    if getattr(server_args, "nnodes", 1) > 1 or getattr(server_args, "dist_init_addr", None):
        return {}
    return {DIST_INIT_OVERRIDE_ENV: f"file://{Path(store_dir).resolve()}/dist-store", **LOOPBACK_IFNAME_ENV}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m sglang.launch_server`` with :func:`prepare_text_only_server_args`, its distributed init on
    loopback for a single node (:func:`loopback_env`; a value already in the environment is kept)."""
    import shutil
    import tempfile

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_text_only_server_args(sys.argv[1:] if argv is None else argv)
    store_dir = tempfile.mkdtemp(prefix="sfk-dist-")  # 0700: the store's file is this server's alone
    for name, value in loopback_env(server_args, store_dir).items():
        os.environ.setdefault(name, value)  # the scheduler processes SGLang starts inherit it
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
        shutil.rmtree(store_dir, ignore_errors=True)


def spec_capture_supported() -> bool:
    """Whether the importable sglang carries SpecForge's spec-capture patch."""
    import importlib.util

    return importlib.util.find_spec("sglang.srt.spec_capture_sink") is not None


__all__ = [
    "capture_server_argv",
    "capture_server_env",
    "loopback_env",
    "mooncake_config",
    "mooncake_master_argv",
    "mooncake_client_env",
    "mooncake_reader_setup_kwargs",
    "parse_text_only_args",
    "prepare_text_only_server_args",
    "main",
    "spec_capture_supported",
]

if __name__ == "__main__":
    main()
