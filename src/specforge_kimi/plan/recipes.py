"""Recipe schema: one YAML per (model, topology), typed and checked field by field and section against section.

Scope: the online co-located topology (SGLang TP=N capture server, Mooncake master, SpecForge
producer and N consumer ranks on the same N GPUs per node; ``nnodes > 1`` spreads server TP and
trainer ranks over nodes). Unknown fields are rejected everywhere (``extra="forbid"``). What depends on the
transport -- its refusals, the memory split, the rendered SpecForge config -- is the plan's
(:func:`specforge_kimi.plan.run_plan.compile_plan`), checked once per command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from specforge_kimi.data.tokenizer import K25_SPECIAL_TOKENS
from specforge_kimi.errors import KimiInputError, validation_summary
from specforge_kimi.plan import draft_config
from specforge_kimi.plan.draft_config import DFlashDraft, DSparkDraft, Eagle3Draft
from specforge_kimi.targets.layer_ids import AuxLayers
from specforge_kimi.training.step_knobs import check_alloc_conf
from specforge_kimi.transport import registry

#: ``server.transport``'s default: the first transport (``transport.registry.AUTO_ORDER``) that accepts the recipe
AUTO = "auto"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


#: the draft families a recipe trains: EAGLE-3 (SpecForge strategy eagle3) and the block drafts (dflash, dspark)
FAMILIES = ("eagle3", "dflash", "dspark")
BLOCK_FAMILIES = ("dflash", "dspark")
#: trainer fields only the eagle3 step reads (patches eagle3-keep-allocator-cache, eagle3-fewer-host-syncs,
#: eagle3-chunked-head-loss; TTT)
EAGLE3_ONLY_TRAINER_FIELDS = (
    "ttt_length",
    "step_empty_cache",
    "step_fewer_host_syncs",
    "step_chunked_head_loss",
    "step_compile_elementwise",
    "step_eagle3_block_mask",
    "step_flex_autotune",
    "step_eagle3_fused_wgrad",
    "step_eagle3_fused_proj",
)
#: the mask token of a K2.5 block draft: <|reserved_token_163824|>, unused by K2.5 (SpecForge's K3 config's choice)
K25_MASK_TOKEN_ID = 163824


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
    aux_layer_ids: list[int] | None = Field(
        default=None,
        description="EAGLE-3 aux layers, SpecForge ids (SGLang shifts all by +1 when the first is 1); required for "
        "trainer.family eagle3, refused for block drafts (they name theirs in trainer.draft.dflash_config."
        "target_layer_ids, DFlash ids: position = id + 1)",
    )
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
    host: str = Field(
        default="127.0.0.1", pattern=r"^\S+$", description="Bind address (no whitespace); loopback unless multi-node"
    )
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
    transport: str = Field(
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

    @field_validator("transport")
    @classmethod
    def _known_transport(cls, value: str) -> str:
        if value != AUTO and value not in registry.names():
            raise ValueError(f"server.transport {value!r}: expected {AUTO} or one of {', '.join(registry.names())}")
        return value


class MooncakeSection(_Strict):
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Transfer protocol")
    host: str = Field(
        default="127.0.0.1", pattern=r"^\S+$", description="Master/metadata host (no whitespace; loopback by default)"
    )
    rpc_port: int = Field(default=35551, gt=0, lt=65536, description="Master RPC port")
    metadata_port: int = Field(default=35880, gt=0, lt=65536, description="HTTP metadata server port")
    metrics_port: int = Field(default=35903, gt=0, lt=65536, description="Master metrics port")
    rdma_devices: str | None = Field(default=None, description="RDMA NICs for protocol rdma")
    global_segment_gib: float = Field(
        default=32,
        gt=0,
        description="Segment holding features in flight (the server's, or the keeper's); the producer pauses at "
        "0.8 of it less 8 samples (plan.transport_plan), and one optimizer window plus those 8 must fit",
    )

    @model_validator(mode="after")
    def _distinct_ports(self):
        if len({self.rpc_port, self.metadata_port, self.metrics_port}) != 3:
            raise ValueError("mooncake: rpc_port, metadata_port and metrics_port must differ")
        return self


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


class BlockSection(_Strict):
    """A block draft's knobs (``trainer.family`` dflash or dspark): SpecForge's ``training`` DFlash-family fields."""

    block_size: int = Field(
        default=8, ge=2, description="Tokens per draft block (the draft config's block_size must be the same)"
    )
    num_anchors: int = Field(default=512, gt=0, description="SpecForge's training.num_anchors: blocks per sample")
    loss_decay_gamma: float | None = Field(
        default=None, gt=0, description="SpecForge's training.loss_decay_gamma (None: no decay over block positions)"
    )
    objective_chunk_blocks: int = Field(
        default=128, ge=0, description="SpecForge's training.objective_chunk_blocks (0: all objective logits at once)"
    )
    loss_type: Literal["dflash", "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"] = Field(
        default="dflash", description="SpecForge's training.loss_type"
    )
    mask_token_id: int = Field(
        default=K25_MASK_TOKEN_ID,
        ge=0,
        description="The block's mask token (SpecForge's model.mask_token_id and the draft's dflash_config."
        "mask_token_id); 163824 is <|reserved_token_163824|>, unused by K2.5",
    )


class DSparkSection(_Strict):
    """DSpark's loss weights (SpecForge's training.dspark_*_alpha)."""

    ce: float = Field(default=0.1, ge=0, description="training.dspark_ce_loss_alpha")
    l1: float = Field(default=0.9, ge=0, description="training.dspark_l1_loss_alpha")
    confidence: float = Field(default=1.0, ge=0, description="training.dspark_confidence_head_alpha")


class TrainerSection(_Strict):
    family: Literal["eagle3", "dflash", "dspark"] = Field(
        default="eagle3",
        description="The draft family: eagle3 (SpecForge strategy eagle3), or a block draft, dflash (served by SGLang's "
        "DFLASH) or dspark (trains; SGLang 0.5.14 cannot serve its heads). Compiled into SpecForge's "
        "training.strategy, the capture server's --spec-capture-method, the feature sizing and the trainer terms",
    )
    block: BlockSection | None = Field(
        default=None, description="Block size, anchors, losses and mask token; block families only"
    )
    dspark: DSparkSection | None = Field(default=None, description="DSpark loss weights; family dspark only")
    draft: Eagle3Draft | DFlashDraft | DSparkDraft = Field(
        description="Draft config JSON (LlamaForCausalLMEagle3, the MLA Eagle3DeepseekV2ForCausalLM, or a block "
        "draft's DFlashDraftModel/DSparkDraftModel), typed by trainer.family (plan.draft_config), written beside "
        "the run as given"
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
    max_checkpoints: int = Field(
        default=0,
        ge=0,
        description="SpecForge's training.max_checkpoints: keep the newest N step checkpoints, older ones are "
        "removed as new ones land; 0 keeps all. SpecForge removes the older ones before our seam checkpoint-save "
        "marks the new one complete, so keep 2 or more for --resume. The launch refuses a run whose kept "
        "checkpoints and export do not fit the output_dir's free disk (plan.disk)",
    )
    seed: int = Field(default=0, description="Seed")
    reserve_gib: float = Field(default=6.0, ge=0, description="Per-GPU headroom (CUDA context, NCCL, fragmentation)")
    consumer_state_dir: str | None = Field(
        default=None,
        description="SpecForge's consumer ledger (SQLite/WAL) directory; default "
        "<output_dir>/consumer-state. A multi-node recipe must name a directory on trainer "
        "node 0's local disk (SpecForge: node-local; SQLite on a shared filesystem is unsafe)",
    )
    attention_backend: Literal["flex_attention", "fa", "sdpa"] = Field(
        default="flex_attention",
        description="SpecForge's training.attention_backend. flex_attention (SpecForge's default) keeps TTT "
        "attention memory linear in max_length; fa is SpecForge's flash path (per TTT position one causal kernel "
        "over the first key block, the earlier positions' own keys merged by log-sum-exp), also linear, run on "
        "PyTorch's own attention kernels by our seam fa-kernel (cuDNN's attention on CUDA, its flash kernel where "
        "cuDNN refuses; no flash_attn package; SPECFORGE_KIMI_EAGLE3_FA_KERNEL=1, set from this field; "
        "tests/unit/test_fa_kernel.py); sdpa is SpecForge's "
        "eager TTT path, which keeps heads x max_length^2 softmax weights (fp32 + bf16) per TTT step for the "
        "backward: fine for short samples, needed on the CPU (flex has no CPU backward) and by the MLA draft (sdpa "
        "only)",
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
    step_chunked_head_loss: int | None = Field(
        default=None,
        gt=0,
        description="Tokens per chunk: the eagle3 draft head's logits and its loss and metrics are computed that many "
        "positions at a time, each chunk recomputed in the backward, so the step never keeps its whole "
        "[sequence, draft vocab] logits for the backward (SPECFORGE_EAGLE3_CHUNKED_LOSS=N; needs our SpecForge patch "
        "eagle3-chunked-head-loss; the launch refuses to start without it). Same loss, gradients and metrics to fp32 "
        "rounding (tests/unit/test_step_patches.py); costs a second draft-head forward per chunk. Measured by "
        "bench/trainer_memory.py --variants recipe,chunked_loss. None (the default): as SpecForge ships",
    )
    step_compile_elementwise: bool = Field(
        default=False,
        description="true runs the eagle3 Llama draft layer's norms, MLP and residual adds (the regions around its "
        "attention) and the step's expected-acceptance metric (softmax, minimum and sum over the draft vocabulary) "
        "under torch.compile, so their elementwise work is fused, forward and backward "
        "(SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE=1; our registration seam compile-elementwise, no patch; the MLA "
        "draft is left as it is). Same loss, gradients and metrics to fp32 rounding "
        "(tests/unit/test_compile_elementwise.py); "
        "the first step compiles. Measured by bench/trainer_memory.py --variants recipe,compiled. Off by default",
    )
    step_eagle3_block_mask: bool = Field(
        default=False,
        description="true builds the eagle3 flex attention's block mask at each TTT position from the count of kept "
        "entries per block in closed form, instead of PyTorch evaluating the mask at every (query, key) pair "
        "(SPECFORGE_KIMI_EAGLE3_BLOCK_MASK=1; our registration seam eagle3-block-mask, no patch; "
        "trainer.attention_backend flex_attention only). The same BlockMask tensors, so the same attention "
        "(tests/unit/test_eagle3_block_mask.py). Measured by bench/trainer_memory.py --variants recipe,block_mask. "
        "Off by default",
    )
    step_flex_autotune: bool = Field(
        default=False,
        description="true compiles SpecForge's flex attention with inductor's max-autotune-no-cudagraphs, which "
        "benchmarks flex attention's tile configurations for the shapes met and keeps the fastest, forward and "
        "backward (SPECFORGE_KIMI_FLEX_AUTOTUNE=1; our registration seam flex-autotune, no patch; "
        "trainer.attention_backend flex_attention only). Same mathematics, fp32 accumulation order aside; the first "
        "step of each new shape pays the autotuning. Measured by bench/trainer_memory.py --variants "
        "recipe,flex_autotune. Off by default",
    )
    step_eagle3_fused_wgrad: bool = Field(
        default=False,
        description="true sums each eagle3 draft weight's gradient over the TTT positions inside its weight-gradient "
        "GEMM (C += g^T x) and hands autograd one gradient per weight, instead of one per position added up by "
        "weight-sized adds (SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD=1; our registration seam eagle3-fused-wgrad, no patch; "
        "the draft layer's and head's bias-free linears; not with trainer.step_chunked_head_loss). The same "
        "gradients to fp32 rounding (tests/unit/test_eagle3_fused_wgrad.py). Measured by bench/trainer_memory.py "
        "--variants recipe,fused_wgrad. Off by default",
    )
    step_eagle3_fused_proj: bool = Field(
        default=False,
        description="true runs the eagle3 Llama draft layer's q/k/v projections as one GEMM and its MLP's gate/up "
        "projections as one GEMM (the MLA draft: its q/kv down-projections and gate/up), over their weights "
        "concatenated once per forward, so the backward runs one input-gradient GEMM per group instead of one per "
        "projection and the adds of their input gradients (SPECFORGE_KIMI_EAGLE3_FUSED_PROJ=1; our registration seam "
        "eagle3-fused-proj, no patch; the checkpoint keeps SpecForge's parameters; holds the concatenated weights "
        "through the backward). The same loss and gradients to fp32 rounding (tests/unit/test_eagle3_fused_proj.py). "
        "Its bench: bench/trainer_memory.py --variants recipe,fused_proj. Off by default",
    )
    step_optimizer_fused_clip: bool = Field(
        default=False,
        description="true runs SpecForge's BF16 optimizer step with the gradient clip handed to fused AdamW as its "
        "grad_scale (no pass multiplies the gradients), the norm from one multi-tensor pass over the bf16 "
        "gradients, and the masters cast back in one copy each (SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP=1; our "
        "registration seam optimizer-fused-clip, no patch; needs trainer.fused_adamw; every draft family). The same "
        "update to fp32 rounding (tests/unit/test_optimizer_fused_clip.py). Measured by bench/trainer_memory.py "
        "--variants recipe,fused_clip. Off by default",
    )
    cuda_alloc_conf: str | None = Field(
        default=None,
        description="PYTORCH_CUDA_ALLOC_CONF for SpecForge's producer and trainer ranks, verbatim (key:value[,...], "
        "e.g. expandable_segments:True); unset: inherited from the launching shell",
    )

    @field_validator("cuda_alloc_conf")
    @classmethod
    def _alloc_conf_form(cls, value: str | None) -> str | None:
        return value if value is None else check_alloc_conf(value)

    @field_validator("draft", mode="wrap")
    @classmethod
    def _draft_of_family(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        """The draft checked as its family's (``plan.draft_config``); not at all when ``trainer.family`` is bad
        (its own error says so)."""
        family = info.data.get("family")
        return value if family is None else draft_config.validate_draft(family, value)

    @model_validator(mode="after")
    def _fused_wgrad_not_chunked(self) -> TrainerSection:
        if self.step_eagle3_fused_wgrad and self.step_chunked_head_loss:
            raise ValueError(
                "trainer.step_eagle3_fused_wgrad and trainer.step_chunked_head_loss exclude each other (the chunked "
                "loss recomputes the head in the backward); set one"
            )
        return self

    @model_validator(mode="after")
    def _fused_clip_needs_fused_adamw(self) -> TrainerSection:
        if self.step_optimizer_fused_clip and not self.fused_adamw:
            raise ValueError(
                "trainer.step_optimizer_fused_clip needs trainer.fused_adamw: true (the clip is fused AdamW's "
                "grad_scale)"
            )
        return self


class DataSection(_Strict):
    prompts_path: str = Field(description="specforge-kimi prepare output prompts.jsonl")
    vocab_mapping_path: str | None = Field(
        default=None,
        description="specforge-kimi prepare output vocab_mapping.pt; EAGLE-3 only (a block draft uses the target's "
        "vocabulary)",
    )


class BenchSection(_Strict):
    min_acceptance_length: float = Field(gt=1, description="Fail the recipe below this mean acceptance length")
    algorithm: Literal["EAGLE3", "DFLASH"] = Field(
        default="EAGLE3",
        description="--speculative-algorithm: EAGLE3 for trainer.family eagle3, DFLASH for a block draft",
    )
    steps: int = Field(default=3, description="--speculative-num-steps (EAGLE3)")
    topk: int = Field(default=1, description="--speculative-eagle-topk (EAGLE3)")
    draft_tokens: int = Field(default=4, description="--speculative-num-draft-tokens (EAGLE3)")
    block_size: int | None = Field(
        default=None,
        ge=2,
        description="--speculative-dflash-block-size (DFLASH); unset: trainer.block.block_size",
    )
    cuda_graph: bool = Field(
        default=True,
        description="Serve both bench servers with SGLang's CUDA graphs, as a deployment decodes (the capture "
        "server's server.disable_cuda_graph does not apply: it never decodes); false adds --disable-cuda-graph",
    )


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


class OverlapSection(_Strict):
    """How the co-located capture server and trainer share a GPU (docs/online.md, "Overlap options"). Every option
    is off by default: the two take turns on the GPU as CUDA time-slices separate processes."""

    mps: bool = Field(
        default=False,
        description="Run the node's processes as clients of one CUDA MPS daemon, so the server's prefill and the "
        "trainer's step can run kernels at the same time: launch starts nvidia-cuda-mps-control -d with a pipe and "
        "log directory private to the run (mode 0700), hands every role the pipe directory, and stops the daemon "
        "when the run ends; a daemon that cannot start stops the launch with its reason",
    )
    server_sm_percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="With mps: the capture server's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (share of each GPU's SMs its "
        "kernels may use); unset: all of them",
    )
    trainer_sm_percent: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="With mps: the producer's and trainer ranks' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; unset: all",
    )
    below_normal_priority: Literal["server", "trainer"] | None = Field(
        default=None,
        description="With mps: the side whose MPS clients get CUDA_MPS_CLIENT_PRIORITY=1, BELOW_NORMAL (server: the "
        "capture server; trainer: the producer and trainer ranks), the other side 0, NORMAL: a hint to the MPS "
        "server to favour the other side's work when both have some, per process, not per stream; unset: both at "
        "the daemon's default",
    )
    producer_concurrency: int = Field(
        default=1,
        ge=1,
        le=16,
        description="SpecForge's runtime.producer_concurrency: capture calls the producer keeps in flight (each of "
        "up to runtime.producer_lease 8 prompts), so the server has the next prefill queued while the sink writes "
        "the last; the byte watermarks leave room for concurrency x 8 samples of overshoot",
    )

    @model_validator(mode="after")
    def _client_options_need_mps(self) -> OverlapSection:
        if not self.mps and (self.server_sm_percent is not None or self.trainer_sm_percent is not None):
            raise ValueError("overlap.server_sm_percent / overlap.trainer_sm_percent need overlap.mps: true")
        if not self.mps and self.below_normal_priority is not None:
            raise ValueError("overlap.below_normal_priority needs overlap.mps: true (an MPS client priority)")
        return self


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
    overlap: OverlapSection = OverlapSection()

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        tp = self.tp
        if self.target.num_attention_heads % tp:
            raise ValueError(f"TP={tp} does not divide num_attention_heads={self.target.num_attention_heads}")
        d = self.trainer.draft
        for name in ("block", "dspark"):
            if not self.is_block and getattr(self.trainer, name) is not None:
                raise ValueError(f"trainer.{name} is for block drafts (trainer.family dflash/dspark), not eagle3")
        if d.hidden_size != self.target.hidden_size:
            raise ValueError(f"draft hidden_size {d.hidden_size} != target hidden_size {self.target.hidden_size}")
        if self.is_block:
            _check_block(self)
        else:
            _check_eagle3(self)
        if self.server.capture_put_clients > 1 and self.resilience.segment_owner != "server":
            raise ValueError(
                "server.capture_put_clients > 1 splits the server's own segment; with segment_owner: "
                "keeper the server mounts none (set capture_put_clients: 1)"
            )
        if self.gpus.nnodes > 1 and self.server.host.startswith("127."):
            raise ValueError("a multi-node recipe needs server.host reachable from the other nodes")
        if self.gpus.nnodes > 1 and self.overlap.mps:
            raise ValueError("overlap.mps is single-node only (each node's daemon needs a pipe directory of its own)")
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
        if isinstance(d, Eagle3Draft) and d.is_mla and self.trainer.attention_backend != "sdpa":
            raise ValueError(
                "the MLA draft (Eagle3DeepseekV2ForCausalLM) trains with trainer.attention_backend: sdpa only"
            )
        return self

    @property
    def tp(self) -> int:
        return self.gpus.per_node * self.gpus.nnodes

    @property
    def is_block(self) -> bool:
        """Whether the recipe trains a block draft (``trainer.family`` dflash or dspark)."""
        return self.trainer.family in BLOCK_FAMILIES

    @property
    def capture_ids(self) -> list[int]:
        """The ids the capture server and SpecForge get, in the family's convention: EAGLE-3's
        ``target.aux_layer_ids`` (SpecForge ids), or a block draft's ``dflash_config.target_layer_ids`` (DFlash ids)."""
        if self.is_block:
            return list(self.trainer.draft.dflash_config.target_layer_ids)
        return list(self.target.aux_layer_ids or ())

    @property
    def capture_layers(self) -> AuxLayers:
        """The captured positions of :attr:`capture_ids` (``targets.layer_ids``)."""
        engine = "dflash" if self.is_block else "specforge"
        return AuxLayers.from_engine(engine, self.capture_ids, self.target.num_layers)

    @property
    def bench_block_size(self) -> int | None:
        """DFLASH's block size for ``bench``: ``bench.block_size``, else the training block; None for EAGLE-3."""
        if not self.is_block:
            return None
        return self.bench.block_size or self.trainer.block.block_size


def _check_eagle3(r: Recipe) -> None:
    """An EAGLE-3 recipe: aux ids, vocabulary mapping, no block sections."""
    t, d = r.target, r.trainer.draft
    if t.aux_layer_ids is None:
        raise ValueError("target.aux_layer_ids is required for trainer.family eagle3 (SpecForge ids, e.g. [1, 29, 57])")
    if r.data.vocab_mapping_path is None:
        raise ValueError("data.vocab_mapping_path is required for trainer.family eagle3 (specforge-kimi prepare)")
    if r.bench.algorithm != "EAGLE3" or r.bench.block_size is not None:
        raise ValueError("bench.algorithm DFLASH and bench.block_size are for block drafts; eagle3 benches EAGLE3")
    AuxLayers.from_specforge(t.aux_layer_ids, t.num_layers)
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"draft vocab_size {d.vocab_size} != target vocab_size {t.vocab_size}")
    named = d.eagle_config.eagle_aux_hidden_state_layer_ids if d.eagle_config else None
    if named is not None and list(named) != list(t.aux_layer_ids):
        raise ValueError(
            f"draft eagle_config.eagle_aux_hidden_state_layer_ids {list(named)} != "
            f"target.aux_layer_ids {list(t.aux_layer_ids)}: the draft would be "
            "trained on other layers than it names"
        )


def _check_block_fields(r: Recipe) -> None:
    """What a block recipe must not carry: EAGLE-3's ids, vocabulary mapping, step knobs, bench flags."""
    tr, fam = r.trainer, r.trainer.family
    if tr.block is None:
        raise ValueError(f"trainer.family {fam} needs trainer.block (block_size, num_anchors, ..., mask_token_id)")
    if tr.dspark is not None and fam != "dspark":
        raise ValueError(f"trainer.dspark is for trainer.family dspark, not {fam}")
    if r.target.aux_layer_ids is not None:
        raise ValueError(
            f"target.aux_layer_ids is EAGLE-3's; a {fam} draft names its layers in "
            "trainer.draft.dflash_config.target_layer_ids (DFlash ids)"
        )
    if r.data.vocab_mapping_path is not None:
        raise ValueError(f"data.vocab_mapping_path is EAGLE-3's; a {fam} draft uses the target's vocabulary")
    eagle3_only = [f"trainer.{k}" for k in EAGLE3_ONLY_TRAINER_FIELDS if k in tr.model_fields_set]
    eagle3_only += [f"bench.{k}" for k in ("steps", "topk", "draft_tokens") if k in r.bench.model_fields_set]
    if eagle3_only:
        raise ValueError(f"{', '.join(eagle3_only)}: EAGLE-3 only, not for trainer.family {fam}")
    if r.bench.algorithm != "DFLASH":
        raise ValueError(f"bench.algorithm must be DFLASH for trainer.family {fam}")


def _check_block(r: Recipe) -> None:
    """A block recipe: its draft's target layers, block size and mask token agree with the recipe (the draft's own
    fields and heads are ``plan.draft_config``'s)."""
    _check_block_fields(r)
    t, d, b = r.target, r.trainer.draft, r.trainer.block
    dc = d.dflash_config
    AuxLayers.from_dflash(dc.target_layer_ids, t.num_layers)
    if d.num_target_layers != t.num_layers:
        raise ValueError(f"draft num_target_layers {d.num_target_layers} != target.num_layers {t.num_layers}")
    if d.block_size != b.block_size:
        raise ValueError(f"draft block_size {d.block_size} != trainer.block.block_size {b.block_size}")
    if dc.mask_token_id != b.mask_token_id:
        raise ValueError(
            f"draft dflash_config.mask_token_id {dc.mask_token_id} != trainer.block.mask_token_id "
            f"{b.mask_token_id} (SGLang needs the id in the draft; it cannot look up a mask token without a tokenizer)"
        )
    if b.mask_token_id >= t.vocab_size:
        raise ValueError(f"trainer.block.mask_token_id {b.mask_token_id} is outside the vocabulary (< {t.vocab_size})")
    special = {v: k for k, v in K25_SPECIAL_TOKENS.items()}.get(b.mask_token_id)
    if special is not None:
        raise ValueError(f"trainer.block.mask_token_id {b.mask_token_id} is K2.5's {special}, a token in use")


def read_recipe(path: str | Path) -> Recipe:
    """The recipe at ``path``, its schema checked (one-line :class:`KimiInputError` otherwise); its transport and
    memory split are the plan's to check (``plan.run_plan.compile_plan``)."""
    import yaml

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
