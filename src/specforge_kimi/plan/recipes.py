"""Recipe schema: one YAML per (model, topology) -> SpecForge run config + server/Mooncake argv.

Scope: the online co-located topology (SGLang TP=N capture server, Mooncake master, SpecForge
producer and N consumer ranks on the same N GPUs per node; ``nnodes > 1`` spreads server TP and
trainer ranks over nodes). Unknown fields are rejected everywhere (``extra="forbid"``); the
rendered SpecForge config is validated by SpecForge's own ``Config``. The memory split is
computed and checked here, before anything is launched: server ``mem_fraction_static`` must
hold its weights and KV cache, and the trainer's estimated peak must fit in the rest.
Estimates are stated formulas (``memory_plan``), meant to be replaced by measured peaks.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from specforge_kimi.errors import KimiInputError, validation_summary
from specforge_kimi.plan.trainer_terms import draft_params as _draft_params
from specforge_kimi.plan.trainer_terms import trainer_peak_bytes, trainer_room_bytes, trainer_terms

GIB = 1 << 30


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


#: the draft config keys the memory plan reads (Llama; the MLA draft also needs :data:`_MLA_DRAFT_KEYS`)
_DRAFT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "draft_vocab_size", "vocab_size")
_MLA_DRAFT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _check_draft_keys(d: dict) -> None:
    """Each size the memory plan reads from ``trainer.draft`` is there and a positive integer."""
    keys = _DRAFT_KEYS + (_MLA_DRAFT_KEYS if "kv_lora_rank" in d else ())
    for key in keys + tuple(k for k in ("num_key_value_heads", "head_dim") if k in d):
        v = d.get(key)
        if type(v) is not int or v <= 0:
            raise ValueError(f"trainer.draft.{key} must be a positive integer, not {v!r}")


class TargetSection(_Strict):
    path: str = Field(description="Local K2.5 checkpoint directory (or tiny one)")
    num_layers: int = Field(gt=0, description="text_config.num_hidden_layers (checked against the checkpoint)")
    hidden_size: int = Field(gt=0, description="text_config.hidden_size")
    vocab_size: int = Field(gt=0, description="text_config.vocab_size")
    num_attention_heads: int = Field(gt=0, description="text_config.num_attention_heads (TP must divide it)")
    weights_gib: float = Field(gt=0, description="Total checkpoint weight size on GPU, GiB (K2.5 INT4 experts: ~554)")
    kv_bytes_per_token: int = Field(
        gt=0, description="MLA KV per token per GPU: (kv_lora 512 + rope 64) x layers x 2 B"
    )
    aux_layer_ids: list[int] = Field(description="SpecForge ids; SGLang shifts all by +1 when the first is 1")
    embedding_key: str = Field(default="language_model.model.embed_tokens.weight", description="Embedding tensor")
    lm_head_key: str = Field(default="language_model.lm_head.weight", description="LM head tensor")


class GpuSection(_Strict):
    kind: str = Field(description="GPU model, for humans and doctor (e.g. B200, B300, H200)")
    per_node: int = Field(gt=0, description="GPUs per node; server TP per node and trainer ranks per node")
    memory_gib: float = Field(gt=0, description="Usable memory per GPU, GiB")
    nnodes: int = Field(default=1, gt=0, description="Nodes; SGLang TP = per_node x nnodes")


class ServerSection(_Strict):
    mem_fraction_static: float = Field(gt=0, lt=1, description="SGLang static pool fraction (weights + KV)")
    kv_tokens: int = Field(gt=0, description="KV-cache tokens the capture server must hold (max batch x length)")
    attention_backend: str = Field(default="flashinfer", description="SGLang --attention-backend")
    allreduce_fusion: bool = Field(default=True, description="False adds --enforce-disable-flashinfer-allreduce-fusion")
    host: str = Field(default="127.0.0.1", description="Bind address; loopback unless multi-node")
    port: int = Field(
        default=30000, gt=0, le=55535, description="HTTP port; at most 55535 (SGLang serves gRPC on port + 10000)"
    )
    disable_cuda_graph: bool = Field(
        default=True,
        description="--disable-cuda-graph. On by default: a capture server only prefills (SpecForge's "
        "producer asks max_new_tokens 0), so decode CUDA graphs would only cost startup "
        "time and memory outside the static pool, i.e. beside the trainer",
    )
    extra_args: list[str] = Field(default_factory=list, description="More SGLang launch_server args, verbatim")
    capture_put_clients: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Mooncake store clients the capture sink splits each batch's put over, "
        "each into its own 1/N of the server's segment (our SGLang patch spec-capture-parallel-put; Mooncake copies "
        "one client's same-process puts on one thread); each client holds its own local transfer buffer. "
        "segment_owner: server only",
    )
    compact_passthrough: bool = Field(
        default=True,
        description="SpecForge's producer sends each capture's input_ids / loss_mask / attention_mask "
        "compactly (the request's own ids, a fill value or base64 bytes) instead of JSON int lists "
        "(SPECFORGE_SPEC_CAPTURE_COMPACT=1; needs our SpecForge patch compact-capture-passthrough and SGLang patch "
        "spec-capture-compact-passthrough, both applied by `specforge-kimi setup`; the launch refuses to start when "
        "either is missing). What it saves per capture call: bench/REPORT.md, 'Where a capture call's time goes'",
    )
    transport: Literal["auto", "mooncake", "cuda_ipc"] = Field(
        default="auto",
        description="How captured features reach the trainer ranks: cuda_ipc (one GPU pool the capture server owns, "
        "mapped by CUDA IPC by every rank of the node, device-to-device copies; one node, needs SGLang patch "
        "spec-capture-cuda-ipc) or mooncake (GPU -> host -> Mooncake over TCP/RDMA -> host -> GPU; any topology). "
        "auto: cuda_ipc wherever the recipe passes every check with it, else mooncake (plan.transport_plan.choice "
        "says why; `recipe validate` prints it). docs/online.md 'Feature transports' says when to use which",
    )
    ipc_pool_gib: float | None = Field(
        default=None,
        gt=0,
        description="cuda_ipc: the pool on the capture writer's GPU (GPU 0), GiB; must hold one optimizer window of "
        "max_length samples plus the producer's 8 in flight at a 0.8 watermark; unset: sized from the memory plan "
        "(two windows plus every rank's prefetch, capped at what GPU 0 has left beside the trainer's planned peak)",
    )
    ipc_lease_s: float = Field(
        default=1800,
        gt=0,
        description="cuda_ipc: seconds a lent sample may stay unacknowledged before the server logs and reclaims "
        "its slot (a resumed consumer replays unacknowledged samples from the pool, so keep it above a resume)",
    )


class MooncakeSection(_Strict):
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Transfer protocol")
    host: str = Field(default="127.0.0.1", description="Master/metadata host")
    rpc_port: int = Field(default=35551, description="Master RPC port")
    metadata_port: int = Field(default=35880, description="HTTP metadata server port")
    metrics_port: int = Field(default=35903, description="Master metrics port")
    rdma_devices: str | None = Field(default=None, description="RDMA NICs for protocol rdma")
    global_segment_gib: float = Field(
        default=32,
        gt=0,
        description="Segment holding features in flight (the server's, or the keeper's); the producer pauses at "
        "0.8 of it less 8 samples (plan.transport_plan), and one optimizer window plus those 8 must fit",
    )


class ResilienceSection(_Strict):
    segment_owner: Literal["server", "keeper"] = Field(
        default="server",
        description="Who mounts the Mooncake segment holding features in flight: the capture "
        "server (SpecForge's default; a lost server loses them) or a separate segment keeper process",
    )
    keeper_port: int = Field(default=35904, gt=0, lt=65536, description="Segment keeper's /health port")
    server_restarts: int = Field(default=0, ge=0, description="Restarts of a lost capture server (keeper)")
    server_outage_s: float = Field(default=900, gt=0, description="How long the producer waits for a lost server")
    consumer_restarts: int = Field(
        default=0,
        ge=0,
        description="Consumer-only resumes after a trainer crash "
        "(SpecForge resumes only when the ledger's durable step = a checkpoint's)",
    )
    run_restarts: int = Field(
        default=0,
        ge=0,
        description="Whole-run resumes after a failed attempt (run.resume: every service restarted, the newest "
        "complete checkpoint loaded, what was acknowledged after it captured again): a lost Mooncake master, a crash "
        "between checkpoints. Not after Ctrl-C/SIGTERM/SIGHUP, nor after an attempt that made no durable step",
    )


class TrainerSection(_Strict):
    draft: dict[str, Any] = Field(
        description="Draft config JSON (LlamaForCausalLMEagle3, or the MLA "
        "Eagle3DeepseekV2ForCausalLM), written beside the run"
    )
    max_steps: int = Field(gt=0, description="Optimizer steps")
    num_epochs: int = Field(
        default=1,
        gt=0,
        description="Passes over the prompts (SpecForge's online prompt "
        "epochs: each pass captures again, with its own sample ids)",
    )
    learning_rate: float = Field(gt=0, description="Peak learning rate")
    ttt_length: int = Field(default=7, gt=0, description="EAGLE-3 TTT unroll")
    max_length: int = Field(gt=0, description="Max tokens per sample")
    batch_size: Literal[1] = Field(default=1, description="Online disaggregated runs use batch 1")
    save_interval: int = Field(default=1000, ge=0, description="Checkpoint every N steps")
    seed: int = Field(default=0, description="Seed")
    reserve_gib: float = Field(default=6.0, ge=0, description="Per-GPU headroom (CUDA context, NCCL, fragmentation)")
    consumer_state_dir: str | None = Field(
        default=None,
        description="SpecForge's consumer ledger (SQLite/WAL) directory; default "
        "<output_dir>/consumer-state. A multi-node recipe must name a directory on trainer "
        "node 0's local disk (SpecForge: node-local; SQLite on a shared filesystem is unsafe)",
    )
    attention_backend: Literal["flex_attention", "sdpa"] = Field(
        default="flex_attention",
        description="SpecForge's training.attention_backend. flex_attention (SpecForge's default) keeps TTT "
        "attention memory linear in max_length; sdpa is SpecForge's eager TTT path, which keeps "
        "heads x max_length^2 softmax weights (fp32 + bf16) per TTT step for the backward: fine for "
        "short samples, needed on the CPU (flex has no CPU backward) and by the MLA draft (sdpa only)",
    )
    step_empty_cache: bool = Field(
        default=False,
        description="SpecForge's eagle3 forward calls torch.cuda.empty_cache() every step, so every step "
        "cudaMallocs its activations again and the rank's reserved memory swings between the weights and the step's "
        "peak. false keeps the allocator's cache (SPECFORGE_EAGLE3_EMPTY_CACHE=0; needs our SpecForge patch "
        "eagle3-keep-allocator-cache, applied by `specforge-kimi setup`; the launch refuses to start without it); "
        "true is SpecForge as shipped. Measured by bench/trainer_memory.py --variants: bench/REPORT.md, 'One "
        "trainer rank at a recipe's sizes'",
    )
    fused_adamw: bool = Field(
        default=True,
        description="SpecForge's BF16Optimizer with torch's fused AdamW over its fp32 masters "
        "(SPECFORGE_ADAMW_FUSED=1; needs our SpecForge patch bf16-optimizer-fused-adamw; the launch refuses to start "
        "without it) instead of the foreach one; same update to fp32 rounding, same state_dict. Measured by "
        "bench/trainer_memory.py --variants: bench/REPORT.md, 'One trainer rank at a recipe's sizes'",
    )
    step_fewer_host_syncs: bool = Field(
        default=False,
        description="true builds the eagle3 step's loss denominators and draft-vocabulary columns on the device "
        "and reads its metrics back in one copy (SPECFORGE_EAGLE3_FEWER_SYNCS=1; needs our SpecForge patch "
        "eagle3-fewer-host-syncs; the launch refuses to start without it): SpecForge makes the host wait for the GPU "
        "7 + 1 + 7 times per step at TTT length 7. Same values (tests/unit/test_step_patches.py); measured by "
        "bench/trainer_memory.py --variants: bench/REPORT.md, 'One trainer rank at a recipe's sizes'. Off by default",
    )
    cuda_alloc_conf: str | None = Field(
        default=None,
        description="PYTORCH_CUDA_ALLOC_CONF for SpecForge's producer and trainer ranks, verbatim (key:value[,...], "
        "e.g. expandable_segments:True); unset: inherited from the launching shell",
    )

    @field_validator("cuda_alloc_conf")
    @classmethod
    def _alloc_conf_form(cls, value: str | None) -> str | None:
        from specforge_kimi.training.step_knobs import check_alloc_conf

        return value if value is None else check_alloc_conf(value)


class DataSection(_Strict):
    prompts_path: str = Field(description="specforge-kimi prepare output prompts.jsonl")
    vocab_mapping_path: str = Field(description="specforge-kimi prepare output vocab_mapping.pt")


class BenchSection(_Strict):
    min_acceptance_length: float = Field(gt=1, description="Fail the recipe below this mean acceptance length")
    steps: int = Field(default=3, description="--speculative-num-steps")
    topk: int = Field(default=1, description="--speculative-eagle-topk")
    draft_tokens: int = Field(default=4, description="--speculative-num-draft-tokens")


class TrackingSection(_Strict):
    """SpecForge's own ``tracking`` section (``specforge.config.TrackingConfig``), passed through as is."""

    report_to: Literal["none", "wandb", "tensorboard", "swanlab", "mlflow"] = Field(
        default="tensorboard",
        description="SpecForge's tracking.report_to: the tracker its trainer (consumer rank 0) logs every "
        "training.log_interval step to, besides the consumer log. tensorboard (the default here; SpecForge's is "
        "none) writes <output_dir>/runs/events.out.tfevents.*; none turns tracking off",
    )
    wandb_project: str | None = Field(default=None, description="W&B project (SpecForge's default: specforge)")
    wandb_name: str | None = Field(default=None, description="W&B run name (SpecForge's default: the run id)")
    wandb_key: str | None = Field(default=None, description="W&B API key (better: WANDB_API_KEY in the environment)")
    wandb_offline: bool = Field(default=False, description="W&B offline mode (sync later with `wandb sync`)")
    wandb_dir: str | None = Field(default=None, description="W&B's local directory")
    swanlab_project: str | None = Field(default=None, description="SwanLab project")
    swanlab_name: str | None = Field(default=None, description="SwanLab run name")
    swanlab_key: str | None = Field(default=None, description="SwanLab API key")
    mlflow_tracking_uri: str | None = Field(default=None, description="MLflow tracking URI")
    mlflow_experiment_name: str | None = Field(default=None, description="MLflow experiment")
    mlflow_run_name: str | None = Field(default=None, description="MLflow run name")


class Recipe(_Strict):
    name: str = Field(description="Run id")
    output_dir: str = Field(description="Run directory (refs, ledger, logs, checkpoints)")
    target: TargetSection
    gpus: GpuSection
    server: ServerSection
    mooncake: MooncakeSection = MooncakeSection()
    trainer: TrainerSection
    data: DataSection
    bench: BenchSection
    resilience: ResilienceSection = ResilienceSection()
    tracking: TrackingSection = TrackingSection()

    _transport_chosen_by: str = PrivateAttr(default="recipe")
    _transport_why: str = PrivateAttr(default="")

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        from specforge_kimi.targets.layer_ids import AuxLayers

        tp = self.tp
        if self.target.num_attention_heads % tp:
            raise ValueError(f"TP={tp} does not divide num_attention_heads={self.target.num_attention_heads}")
        AuxLayers.from_specforge(self.target.aux_layer_ids, self.target.num_layers)
        d = self.trainer.draft
        _check_draft_keys(d)
        if d.get("hidden_size") != self.target.hidden_size:
            raise ValueError(
                f"draft hidden_size {d.get('hidden_size')} != target hidden_size {self.target.hidden_size}"
            )
        if d.get("vocab_size") != self.target.vocab_size:
            raise ValueError(f"draft vocab_size {d.get('vocab_size')} != target vocab_size {self.target.vocab_size}")
        named = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if named is not None and list(named) != list(self.target.aux_layer_ids):
            raise ValueError(
                f"draft eagle_config.eagle_aux_hidden_state_layer_ids {list(named)} != "
                f"target.aux_layer_ids {list(self.target.aux_layer_ids)}: the draft would be "
                "trained on other layers than it names"
            )
        if self.server.capture_put_clients > 1 and self.resilience.segment_owner != "server":
            raise ValueError(
                "server.capture_put_clients > 1 splits the server's own segment; with segment_owner: "
                "keeper the server mounts none (set capture_put_clients: 1)"
            )
        if self.gpus.nnodes > 1 and self.server.host.startswith("127."):
            raise ValueError("a multi-node recipe needs server.host reachable from the other nodes")
        if self.gpus.nnodes > 1 and self.resilience.run_restarts:
            raise ValueError("resilience.run_restarts is single-node only (whole-run resume reads node 0's ledger)")
        if self.gpus.nnodes > 1 and self.resilience.consumer_restarts:
            raise ValueError(
                "resilience.consumer_restarts is single-node only: the keeper reads the ledger, which "
                "a multi-node run keeps on trainer node 0's disk"
            )
        if self.gpus.nnodes > 1 and not self.trainer.consumer_state_dir:
            raise ValueError(
                "a multi-node recipe needs trainer.consumer_state_dir on trainer node 0's local disk "
                "(output_dir is shared; SpecForge's ledger is SQLite/WAL)"
            )
        if "kv_lora_rank" in self.trainer.draft and self.trainer.attention_backend != "sdpa":
            raise ValueError(
                "the MLA draft (Eagle3DeepseekV2ForCausalLM) trains with trainer.attention_backend: sdpa only"
            )
        from specforge_kimi.plan.transport_plan import refusal, store_refusal

        try:
            why = refusal(self) if self.server.transport == "cuda_ipc" else store_refusal(self)
            plan = memory_plan(self)
        except (OverflowError, ValueError) as exc:  # sizes too large for byte arithmetic (1e308 GiB)
            raise ValueError(f"a size in the recipe is out of range: {exc}") from None
        if why:
            raise ValueError(why)
        if not plan["fits"]:
            raise ValueError(f"memory split does not fit: {plan['why']}")
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_transport(cls, data, handler):
        """(Defined after ``_check`` so that it wraps it.) ``server.transport: auto`` (or unset): the recipe validated with cuda_ipc if it passes every check with
        it, else with mooncake, remembering why (``transport_plan.choice``)."""
        server = data.get("server") if isinstance(data, dict) else None
        if not isinstance(server, dict) or server.get("transport", "auto") != "auto":
            return handler(data)
        try:
            recipe = handler({**data, "server": {**server, "transport": "cuda_ipc"}})
            why = ""
        except ValidationError as exc:
            recipe = handler({**data, "server": {**server, "transport": "mooncake"}})
            why = "cuda_ipc would be refused: " + validation_summary(exc).removeprefix("Value error, ")
        recipe._transport_chosen_by, recipe._transport_why = "auto", why
        return recipe

    @property
    def tp(self) -> int:
        return self.gpus.per_node * self.gpus.nnodes


def memory_plan(r: Recipe) -> dict:
    """Per-GPU memory estimate (GiB) for server and trainer, and whether they fit.

    server = mem_fraction_static x GPU memory, must hold weights/TP + kv_tokens x KV bytes;
    trainer = the sum of :func:`trainer_terms` + ``trainer.reserve_gib``; with ``server.transport: cuda_ipc``
    also each rank's prefetched samples, and on the capture writer's GPU the pool and the captured rows
    waiting for the sink come out of the trainer's room (:func:`transport_plan.memory_terms`).
    """
    from specforge_kimi.plan.transport_plan import memory_terms

    g, t, s, tr = r.gpus, r.target, r.server, r.trainer
    weights = t.weights_gib / r.tp
    kv = s.kv_tokens * t.kv_bytes_per_token / GIB
    server_pool = s.mem_fraction_static * g.memory_gib
    terms = trainer_terms(r)
    ipc = memory_terms(r)
    trainer = trainer_peak_bytes(r, prefetch=ipc["prefetch"]) / GIB
    trainer_room = trainer_room_bytes(r) / GIB
    writer_room = trainer_room - (ipc["pool"] + ipc["server_rows"]) / GIB
    why = []
    if weights + kv > server_pool:
        why.append(
            f"server needs {weights:.1f} GiB weights + {kv:.1f} GiB KV > {server_pool:.1f} GiB "
            f"(mem_fraction_static {s.mem_fraction_static} x {g.memory_gib} GiB)"
        )
    if trainer > trainer_room:
        why.append(f"trainer peak ~{trainer:.1f} GiB > {trainer_room:.1f} GiB left beside the server")
    elif trainer > writer_room:
        why.append(
            f"trainer peak ~{trainer:.1f} GiB > {writer_room:.1f} GiB left on GPU 0 beside the server, its cuda_ipc "
            f"pool ({ipc['pool'] / GIB:.1f} GiB) and captured rows ({ipc['server_rows'] / GIB:.1f} GiB)"
        )
    cuda_ipc = {
        "ipc_pool_gib": round(ipc["pool"] / GIB, 2),
        "server_capture_rows_gib": round(ipc["server_rows"] / GIB, 2),
        "trainer_ipc_prefetch_gib": round(ipc["prefetch"] / GIB, 2),
        "writer_gpu_trainer_room_gib": round(writer_room, 2),
    }
    return {
        "transport": s.transport,
        **(cuda_ipc if s.transport == "cuda_ipc" else {}),
        "server_weights_gib": round(weights, 2),
        "server_kv_gib": round(kv, 2),
        "server_pool_gib": round(server_pool, 2),
        "draft_params": _draft_params(tr.draft),
        "trainer_peak_gib": round(trainer, 2),
        "trainer_sdpa_attention_gib": round(terms["sdpa_attention"] / GIB, 2),
        "trainer_room_gib": round(trainer_room, 2),
        "fits": not why,
        "why": "; ".join(why),
    }


def load_recipe(path: str | Path) -> Recipe:
    import yaml
    from pydantic import ValidationError

    p = Path(path)
    if not p.is_file():
        raise KimiInputError(f"recipe {p} not found")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KimiInputError(f"recipe {p} is not UTF-8 text (byte {exc.start})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KimiInputError(f"recipe {p} is not valid YAML: {' '.join(str(exc).split())}") from None
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise KimiInputError(f"recipe {p}: {validation_summary(exc)}") from None


def server_argv(r: Recipe) -> list[str]:
    """The capture server's command line (:func:`capture_server.capture_server_argv`, i.e. what
    SpecForge's managed launcher builds, with our text-only module); ``python`` is a placeholder."""
    from specforge_kimi.servers.capture_server import capture_server_argv
    from specforge_kimi.targets.layer_ids import AuxLayers

    AuxLayers.from_specforge(r.target.aux_layer_ids, r.target.num_layers)  # validates
    extra: list[str] = []
    if r.gpus.nnodes > 1:
        extra += [
            "--nnodes",
            str(r.gpus.nnodes),
            "--dist-init-addr",
            f"{r.server.host}:50000",
            "--node-rank",
            "${NODE_RANK}",
        ]
    # The server gets the very ids of the SpecForge config: the sink echoes them and SpecForge's
    # producer refuses a capture whose echoed ids differ from its contract (same layers or not).
    # fusion: off when the recipe says so, else SGLang's own choice for the GPU (auto-enabled on
    # SM90/SM100 for K2.5 at TP>1).
    return capture_server_argv(
        r.target.path,
        tp=r.tp,
        port=r.server.port,
        aux_specforge_ids=list(r.target.aux_layer_ids),
        fusion=None if r.server.allreduce_fusion else False,
        attention_backend=r.server.attention_backend,
        mem_fraction_static=r.server.mem_fraction_static,
        context_length=r.trainer.max_length + 256,
        host=r.server.host,
        disable_cuda_graph=r.server.disable_cuda_graph,
        python="python",
        extra=[*extra, *r.server.extra_args],
    )


def _mooncake(r: Recipe):
    """SpecForge's own ``ManagedLocalMooncakeConfig`` for the recipe's Mooncake section."""
    from specforge_kimi.servers.capture_server import mooncake_config

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


def server_env(r: Recipe) -> dict[str, str]:
    """The capture server's environment: SpecForge's managed-local Mooncake settings + our plugin."""
    from specforge_kimi.plan import transport_plan
    from specforge_kimi.servers.capture_server import capture_server_env

    env = capture_server_env(_mooncake(r), put_clients=r.server.capture_put_clients)
    if r.mooncake.host != "127.0.0.1":
        env["MOONCAKE_METADATA_SERVER"] = f"http://{r.mooncake.host}:{r.mooncake.metadata_port}/metadata"
        env["MOONCAKE_MASTER_SERVER_ADDR"] = f"{r.mooncake.host}:{r.mooncake.rpc_port}"
    return {**env, **transport_plan.server_env(r), "SPECFORGE_PLUGINS": "specforge_kimi"}


def process_env(r: Recipe) -> dict[str, str]:
    """The environment of every SpecForge process the launch starts (producer, trainer ranks)."""
    from specforge_kimi.plan import transport_plan
    from specforge_kimi.servers.capture_server import COMPACT_PASSTHROUGH_ENV
    from specforge_kimi.training.step_knobs import trainer_env

    env = {"SPECFORGE_PLUGINS": "specforge_kimi", **transport_plan.process_env(r)}
    if r.gpus.nnodes == 1:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo binds the address the host name resolves to, not always loopback
    if r.server.compact_passthrough:
        env[COMPACT_PASSTHROUGH_ENV] = "1"
    env.update(trainer_env(r.trainer))
    return env


def consumer_state_dir(r: Recipe) -> str:
    """Where SpecForge's consumer ledger lives: the recipe's ``trainer.consumer_state_dir`` or
    ``<output_dir>/consumer-state``."""
    return r.trainer.consumer_state_dir or str(Path(r.output_dir) / "consumer-state")


def specforge_config(r: Recipe, draft_config_path: str) -> dict:
    """The SpecForge run config (external disaggregated mode); validated by SpecForge's ``Config``."""
    mc = r.mooncake
    out = Path(r.output_dir)
    cfg = {
        "run_id": r.name,
        "output_dir": str(out),
        "model": {
            "target_model_path": r.target.path,
            "draft_model_config": draft_config_path,
            "vocab_mapping_path": r.data.vocab_mapping_path,
            "embedding_key": r.target.embedding_key,
            "lm_head_key": r.target.lm_head_key,
            "aux_hidden_state_layer_ids": list(r.target.aux_layer_ids),
            "torch_dtype": "bfloat16",
        },
        "data": {"prompts_path": r.data.prompts_path, "max_length": r.trainer.max_length},
        "training": {
            "strategy": "eagle3",
            "max_steps": r.trainer.max_steps,
            "num_epochs": r.trainer.num_epochs,
            "batch_size": r.trainer.batch_size,
            "learning_rate": r.trainer.learning_rate,
            "ttt_length": r.trainer.ttt_length,
            "save_interval": r.trainer.save_interval,
            "seed": r.trainer.seed,
            "attention_backend": r.trainer.attention_backend,
            # console metrics (loss, acc, perf/*) every 10 steps; SpecForge's default is 50
            "log_interval": 10,
        },
        "tracking": r.tracking.model_dump(exclude_none=True),
        "deployment": {
            "mode": "disaggregated",
            "trainer": {
                "nnodes": r.gpus.nnodes,
                "nproc_per_node": r.gpus.per_node,
                **({"master_addr": r.server.host, "master_port": 29500} if r.gpus.nnodes > 1 else {}),
            },
            "disaggregated": {
                "control_dir": str(out / "control"),
                "consumer_state_dir": consumer_state_dir(r),
                "backend": "mooncake",
                "server_urls": [f"http://{r.server.host}:{r.server.port}"],
                "mooncake_metadata_server": f"http://{mc.host}:{mc.metadata_port}/metadata",
                "mooncake_master_server_addr": f"{mc.host}:{mc.rpc_port}",
                "mooncake_protocol": mc.protocol,
                **({"mooncake_rdma_devices": mc.rdma_devices} if mc.rdma_devices else {}),
            },
        },
    }
    from specforge_kimi.plan.transport_plan import runtime_config

    cfg["runtime"] = runtime_config(r)  # the producer pauses on bytes before the pool or the segment fills
    from specforge.config import Config

    Config.model_validate(cfg)  # SpecForge's own schema: unknown/invalid fields fail here
    return cfg


def _master_argv(r: Recipe) -> list[str]:
    from specforge_kimi.servers.capture_server import mooncake_master_argv

    return mooncake_master_argv(_mooncake(r), python="python", host=r.mooncake.host)


def render(r: Recipe, out_dir: str | Path, *, write: bool = True) -> dict:
    """Write draft config, SpecForge config and a launch sheet under ``out_dir``; return them.
    ``write=False`` returns the same (paths under ``out_dir``) and writes nothing."""
    import json

    import yaml

    from specforge_kimi.plan.transport_plan import choice as transport_choice

    o = Path(out_dir)
    if write:
        o.mkdir(parents=True, exist_ok=True)
    draft_path = o / "draft_config.json"
    if write:
        draft_path.write_text(json.dumps(r.trainer.draft, indent=2))
    cfg = specforge_config(r, str(draft_path))
    if write:
        (o / "specforge_run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    sheet = {
        "env": process_env(r),
        "server_env": server_env(r),
        "mooncake_master": _master_argv(r),
        "capture_server": server_argv(r),
        "producer": [
            "python",
            "-m",
            "specforge_kimi",
            "train",
            "-c",
            str(o / "specforge_run.yaml"),
            "--role",
            "producer",
        ],
        # one node: --standalone picks a free rendezvous port (as SpecForge's own plan does), and
        # servers.loopback keeps torchrun's stores on 127.0.0.1 (torch binds them to every address otherwise)
        "consumer": [
            "python",
            "-m",
            *(
                ["specforge_kimi.servers.loopback", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1"]
                if r.gpus.nnodes == 1
                else [
                    "torch.distributed.run",
                    f"--nnodes={r.gpus.nnodes}",
                    f"--master_addr={r.server.host}",
                    "--master_port=29500",
                ]
            ),
            f"--nproc_per_node={r.gpus.per_node}",
            "-m",
            "specforge_kimi",
            "train",
            "-c",
            str(o / "specforge_run.yaml"),
            "--role",
            "consumer",
        ],
        "memory_plan": memory_plan(r),
        "transport": transport_choice(r),
    }
    if write:
        (o / "launch.json").write_text(json.dumps(sheet, indent=2))
    return {
        "specforge_config": cfg,
        "launch": sheet,
        "commands": {k: shlex.join(v) for k, v in sheet.items() if isinstance(v, list)},
    }
