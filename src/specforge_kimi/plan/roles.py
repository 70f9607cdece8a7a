"""Each role's command line and environment for a recipe whose transport is chosen, and the SpecForge run config.

Scope: the pieces a :class:`~specforge_kimi.plan.run_plan.RunPlan` is made of -- the capture server's argv (what
SpecForge's managed launcher builds, with our text-only module), the Mooncake master's, the producer's and the
torchrun consumer's, the environment of the server and of the SpecForge processes (SpecForge's managed-local
Mooncake settings, the transport's variables, the trainer step's), and the external-disaggregated SpecForge config.
``python`` in an argv is a placeholder the launch replaces with its interpreter.
"""

from __future__ import annotations

from pathlib import Path

from specforge_kimi.environment import (
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
    CUDA_MPS_CLIENT_PRIORITY,
    CUDA_MPS_PIPE_DIRECTORY,
    SPECFORGE_PLUGINS,
)
from specforge_kimi.plan.inputs import SERVER_CONTEXT_MARGIN
from specforge_kimi.plan.recipes import DSparkSection
from specforge_kimi.servers.capture_server import (
    COMPACT_PASSTHROUGH_ENV,
    capture_server_argv,
    capture_server_env,
    mooncake_config,
    mooncake_master_argv,
)
from specforge_kimi.training.step_knobs import trainer_env
from specforge_kimi.transport.strategy import GIB, FeatureSizing, Transport

#: the module SpecForge's processes load our plugin from
PLUGINS = {SPECFORGE_PLUGINS.name: "specforge_kimi"}
#: the trainer's rendezvous port across nodes (node 0's ``server.host``)
TRAINER_MASTER_PORT = 29500
#: SGLang's ``--dist-init-addr`` port across nodes
SERVER_DIST_INIT_PORT = 50000
#: the longest MPS control-socket path kept under the run directory (sun_path holds 108 bytes)
MPS_SOCKET_PATH_MAX = 100


def server_argv(r) -> list[str]:
    """The capture server's command line (:func:`capture_server.capture_server_argv`): the family's capture method
    (``--spec-capture-method eagle3|dflash|dspark``) and its ids (EAGLE-3 aux ids, or a block draft's DFlash ids)."""
    extra: list[str] = []
    if r.gpus.nnodes > 1:
        extra += ["--nnodes", str(r.gpus.nnodes), "--dist-init-addr", f"{r.server.host}:{SERVER_DIST_INIT_PORT}"]
        extra += ["--node-rank", "${NODE_RANK}"]
    # The server gets the very ids of the SpecForge config: the sink echoes them and SpecForge's
    # producer refuses a capture whose echoed ids differ from its contract (same layers or not).
    # fusion: off when the recipe says so, else SGLang's own choice for the GPU (auto-enabled on
    # SM90/SM100 for K2.5 at TP>1).
    return capture_server_argv(
        r.target.path,
        tp=r.tp,
        port=r.server.port,
        aux_specforge_ids=r.capture_ids,
        method=r.trainer.family,
        fusion=None if r.server.allreduce_fusion else False,
        attention_backend=r.server.attention_backend,
        mem_fraction_static=r.server.mem_fraction_static,
        context_length=r.trainer.max_length + SERVER_CONTEXT_MARGIN,
        host=r.server.host,
        disable_cuda_graph=r.server.disable_cuda_graph,
        python="python",
        extra=[*extra, *r.server.extra_args],
    )


def mooncake(r):
    """SpecForge's own ``ManagedLocalMooncakeConfig`` for the recipe's Mooncake section."""
    mc = r.mooncake
    extra = {"rdma_devices": mc.rdma_devices} if mc.rdma_devices else {}
    return mooncake_config(
        rpc_port=mc.rpc_port,
        metadata_port=mc.metadata_port,
        metrics_port=mc.metrics_port,
        global_segment_size_bytes=int(mc.global_segment_gib * GIB),
        protocol=mc.protocol,
        local_hostname=mc.host,
        **extra,
    )


def master_argv(r) -> list[str]:
    return mooncake_master_argv(mooncake(r), python="python", host=r.mooncake.host)


def server_env(r, strategy: Transport, sizing: FeatureSizing) -> dict[str, str]:
    """The capture server's environment: SpecForge's managed-local Mooncake settings, the transport's, our plugin."""
    env = capture_server_env(mooncake(r), put_clients=r.server.capture_put_clients)
    if r.mooncake.host != "127.0.0.1":
        env["MOONCAKE_METADATA_SERVER"] = f"http://{r.mooncake.host}:{r.mooncake.metadata_port}/metadata"
        env["MOONCAKE_MASTER_SERVER_ADDR"] = f"{r.mooncake.host}:{r.mooncake.rpc_port}"
    return {**env, **strategy.server_env(r, sizing), **PLUGINS, **mps_env(r, "server")}


def process_env(r, strategy: Transport) -> dict[str, str]:
    """The environment of every SpecForge process the launch starts (producer, trainer ranks)."""
    env = {**PLUGINS, **strategy.process_env(r)}
    if r.gpus.nnodes == 1:
        # gloo binds the address the host name resolves to, not always loopback; NCCL's bootstrap and proxy
        # listeners bind the first interface NCCL finds, loopback last (one node's ranks need no other)
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["NCCL_SOCKET_IFNAME"] = "lo"
    if r.server.compact_passthrough:
        env[COMPACT_PASSTHROUGH_ENV] = "1"
    env.update(trainer_env(r.trainer))
    env.update(mps_env(r, "trainer"))
    return env


def mps_dirs(r) -> tuple[str, str] | None:
    """The run's CUDA MPS pipe and log directories with ``overlap.mps`` (else None): ``<output_dir>/mps/{pipe,log}``,
    or, when that pipe path is too long for the daemon's Unix socket, a directory under /tmp named by a hash of
    the output directory (the launch creates both mode 0700 and refuses one it does not own)."""
    if not r.overlap.mps:
        return None
    base = Path(r.output_dir).absolute() / "mps"
    if len(str(base / "pipe" / "control")) > MPS_SOCKET_PATH_MAX:
        import hashlib

        base = Path("/tmp") / f"specforge-kimi-mps-{hashlib.sha256(str(base).encode()).hexdigest()[:16]}"
    return str(base / "pipe"), str(base / "log")


def mps_env(r, side: str) -> dict[str, str]:
    """A side's CUDA MPS variables with ``overlap.mps`` (``side``: ``server`` for the capture server, ``trainer``
    for the producer and trainer ranks): the pipe directory, its SM share when the recipe sets one, and with
    ``overlap.below_normal_priority`` its client priority (1, BELOW_NORMAL, on the side named; 0, NORMAL, set
    explicitly on the other, so a priority inherited from the launching shell cannot lower both)."""
    dirs = mps_dirs(r)
    if dirs is None:
        return {}
    env = {CUDA_MPS_PIPE_DIRECTORY.name: dirs[0]}
    sm_percent = r.overlap.server_sm_percent if side == "server" else r.overlap.trainer_sm_percent
    if sm_percent is not None:
        env[CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.name] = str(sm_percent)
    if r.overlap.below_normal_priority is not None:
        env[CUDA_MPS_CLIENT_PRIORITY.name] = "1" if r.overlap.below_normal_priority == side else "0"
    return env


def consumer_state_dir(r) -> str:
    """Where SpecForge's consumer ledger lives: the recipe's ``trainer.consumer_state_dir`` or
    ``<output_dir>/consumer-state``."""
    return r.trainer.consumer_state_dir or str(Path(r.output_dir) / "consumer-state")


def family_model(r) -> dict:
    """SpecForge's ``model`` fields of the draft family: EAGLE-3's vocabulary mapping and aux ids; a block draft's
    mask token (its capture layers come from the draft config: SpecForge refuses ``aux_hidden_state_layer_ids`` for
    dflash/dspark)."""
    if r.is_block:
        return {"mask_token_id": r.trainer.block.mask_token_id}
    return {"vocab_mapping_path": r.data.vocab_mapping_path, "aux_hidden_state_layer_ids": list(r.capture_ids)}


def family_training(r) -> dict:
    """SpecForge's ``training`` fields of the draft family: EAGLE-3's TTT length; a block draft's anchors, loss and
    objective chunking (the block size is the draft config's), and DSpark's loss weights."""
    tr = r.trainer
    if not r.is_block:
        return {"ttt_length": tr.ttt_length}
    out = tr.block.model_dump(exclude={"block_size", "mask_token_id"})
    if tr.family == "dspark":
        ds = tr.dspark or DSparkSection()
        out.update(dspark_ce_loss_alpha=ds.ce, dspark_l1_loss_alpha=ds.l1, dspark_confidence_head_alpha=ds.confidence)
    return out


def specforge_config(r, draft_config_path: str, runtime: dict) -> dict:
    """The SpecForge run config (external disaggregated mode) with the transport's ``runtime:`` section; the caller
    validates it with SpecForge's ``Config``."""
    mc, tr = r.mooncake, r.trainer
    out = Path(r.output_dir)
    training = ("max_steps", "num_epochs", "batch_size", "learning_rate", "save_interval", "seed")
    return {
        "run_id": r.name,
        "output_dir": str(out),
        "model": {
            "target_model_path": r.target.path,
            "draft_model_config": draft_config_path,
            "embedding_key": r.target.embedding_key,
            "lm_head_key": r.target.lm_head_key,
            "torch_dtype": "bfloat16",
            **family_model(r),
        },
        "data": {"prompts_path": r.data.prompts_path, "max_length": tr.max_length},
        "training": {
            "strategy": tr.family,
            **{k: getattr(tr, k) for k in training},
            **family_training(r),
            # omitted at 0 (SpecForge's default, keep all): configs of recipes without it render as before
            **({"max_checkpoints": tr.max_checkpoints} if tr.max_checkpoints else {}),
            "attention_backend": tr.attention_backend,
            # console metrics (loss, acc, perf/*) every 10 steps; SpecForge's default is 50
            "log_interval": 10,
        },
        "tracking": r.tracking.model_dump(exclude_none=True),
        "deployment": {
            "mode": "disaggregated",
            "trainer": {
                "nnodes": r.gpus.nnodes,
                "nproc_per_node": r.gpus.per_node,
                **({"master_addr": r.server.host, "master_port": TRAINER_MASTER_PORT} if r.gpus.nnodes > 1 else {}),
            },
            "disaggregated": {
                "control_dir": str(out / "control"),
                "consumer_state_dir": consumer_state_dir(r),
                "backend": "mooncake",  # SpecForge's control plane; our store seam swaps the features' transport
                "server_urls": [f"http://{r.server.host}:{r.server.port}"],
                "mooncake_metadata_server": f"http://{mc.host}:{mc.metadata_port}/metadata",
                "mooncake_master_server_addr": f"{mc.host}:{mc.rpc_port}",
                "mooncake_protocol": mc.protocol,
                **({"mooncake_rdma_devices": mc.rdma_devices} if mc.rdma_devices else {}),
            },
        },
        "runtime": runtime,  # the producer pauses on bytes before the pool or the segment fills
    }


def producer_argv(config_path: str) -> list[str]:
    return ["python", "-m", "specforge_kimi", "train", "-c", config_path, "--role", "producer"]


def consumer_argv(r, config_path: str) -> list[str]:
    """torchrun over the node's trainer ranks. One node: --standalone picks a free rendezvous port (as SpecForge's
    own plan does), and servers.loopback keeps torchrun's stores on 127.0.0.1 (torch binds them to every address
    otherwise)."""
    if r.gpus.nnodes == 1:
        runner = ["specforge_kimi.servers.loopback", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1"]
    else:
        runner = [
            "torch.distributed.run",
            f"--nnodes={r.gpus.nnodes}",
            f"--master_addr={r.server.host}",
            f"--master_port={TRAINER_MASTER_PORT}",
        ]
    return ["python", "-m", *runner, f"--nproc_per_node={r.gpus.per_node}", "-m", "specforge_kimi", "train"] + [
        "-c",
        config_path,
        "--role",
        "consumer",
    ]
