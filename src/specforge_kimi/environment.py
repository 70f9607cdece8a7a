"""The environment variables that carry configuration between processes: one declared table.

Each row names the variable, the modules of this package that set it (``writers``: for another process, or for
library code in their own), the modules that read it (``readers``), what it means, and whose it is: ``ours``
(``SPECFORGE_KIMI_*``), ``our patch`` (a variable one of our SpecForge / SGLang patches introduces, named in
``patches`` as ``<library>/<patch name>``), or ``library`` (SpecForge, SGLang, Mooncake, torch, NCCL, CUDA, ...;
``outside`` says who). Module names are relative to ``specforge_kimi`` (``transport`` is its ``__init__``).

Code that names one of these variables takes the name from here (``TRANSPORT.name``, or a module constant
defined from it such as ``transport.TRANSPORT_ENV``); tests/unit/test_environment_table.py checks the table
against every environment read and write in ``src/``. Scope: names and meanings only; no values, no reads.
"""

from __future__ import annotations

from dataclasses import dataclass

OURS = "ours"
OUR_PATCH = "our patch"
LIBRARY = "library"


@dataclass(frozen=True)
class EnvVar:
    name: str
    meaning: str
    owner: str
    writers: tuple[str, ...] = ()
    readers: tuple[str, ...] = ()
    outside: str = ""
    patches: tuple[str, ...] = ()


# -- ours: SpecForge's processes (producer, trainer ranks) and the run's lifecycle ------------------------------
TRANSPORT = EnvVar(
    "SPECFORGE_KIMI_TRANSPORT",
    "the feature transport of SpecForge's processes; cuda_ipc makes the cuda-ipc-store seam answer with our store",
    OURS,
    writers=("transport.cuda_ipc",),
    readers=("transport.registry", "transport.cuda_ipc", "registration", "transport.store"),
)
IPC_DIR = EnvVar(
    "SPECFORGE_KIMI_IPC_DIR",
    "where SpecForge's processes find the capture server's cuda_ipc pool files (<output_dir>/ipc)",
    OURS,
    writers=("transport.cuda_ipc",),
    readers=("transport.store",),
)
SERVER_OUTAGE_S = EnvVar(
    "SPECFORGE_KIMI_SERVER_OUTAGE_S",
    "seconds the outage-wait seam waits for a lost capture server (recipe resilience.server_outage_s)",
    OURS,
    writers=("run.launch",),
    readers=("registration",),
)
CONSUMER_RESTARTABLE = EnvVar(
    "SPECFORGE_KIMI_CONSUMER_RESTARTABLE",
    "1 while the keeper will restart the consumer: the restartable-consumer seam stops a rank that lost a sibling",
    OURS,
    writers=("run.keeper",),
    readers=("registration",),
)
EAGLE3_BLOCK_MASK = EnvVar(
    "SPECFORGE_KIMI_EAGLE3_BLOCK_MASK",
    "1: the eagle3-block-mask seam builds the EAGLE-3 flex attention's block mask per block instead of per entry "
    "(recipe trainer step knob)",
    OURS,
    writers=("training.step_knobs",),
    readers=("drafts.eagle3_block_mask",),
)
FLEX_AUTOTUNE = EnvVar(
    "SPECFORGE_KIMI_FLEX_AUTOTUNE",
    "1: the flex-autotune seam compiles SpecForge's flex attention with inductor's max-autotune (recipe trainer "
    "step knob)",
    OURS,
    writers=("training.step_knobs",),
    readers=("drafts.flex_autotune",),
)
OPTIMIZER_FUSED_CLIP = EnvVar(
    "SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP",
    "1: the optimizer-fused-clip seam folds the BF16 optimizer's gradient clip into fused AdamW's grad_scale and "
    "drops its extra passes (recipe trainer step knob)",
    OURS,
    writers=("training.step_knobs",),
    readers=("drafts.optimizer_fused_clip",),
)
EAGLE3_FUSED_WGRAD = EnvVar(
    "SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD",
    "1: the eagle3-fused-wgrad seam sums each EAGLE-3 draft weight's gradient over the TTT positions inside its "
    "weight-gradient GEMM (recipe trainer step knob)",
    OURS,
    writers=("training.step_knobs",),
    readers=("drafts.eagle3_fused_wgrad",),
)
EAGLE3_FUSED_PROJ = EnvVar(
    "SPECFORGE_KIMI_EAGLE3_FUSED_PROJ",
    "1: the eagle3-fused-proj seam runs the EAGLE-3 draft layer's sibling projections (q/k/v and gate/up; the MLA "
    "draft's q/kv down-projections) as one GEMM per group (recipe trainer step knob)",
    OURS,
    writers=("training.step_knobs",),
    readers=("drafts.eagle3_fused_proj",),
)
EAGLE3_COMPILE_ELEMENTWISE = EnvVar(
    "SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE",
    "1: the compile-elementwise seam compiles the EAGLE-3 Llama draft layer's norms, MLP and residual adds and the "
    "step's acceptance metric (recipe trainer step knob)",
    OURS,
    writers=("training.step_knobs",),
    readers=("drafts.compile_elementwise",),
)
EAGLE3_FA_KERNEL = EnvVar(
    "SPECFORGE_KIMI_EAGLE3_FA_KERNEL",
    "1: the fa-kernel seam runs SpecForge's fa EAGLE-3 attention on PyTorch's own attention kernels (set when the "
    "recipe's trainer.attention_backend is fa)",
    OURS,
    writers=("training.step_knobs",),
    readers=("drafts.eagle3_fa_kernel",),
)
RESUME_SKIP = EnvVar(
    "SPECFORGE_KIMI_RESUME_SKIP",
    "a file of the task ids a resumed attempt skips (trained before its checkpoint)",
    OURS,
    writers=("run.resume",),
    readers=("registration",),
)
RESUME_FRESH_CHANNEL = EnvVar(
    "SPECFORGE_KIMI_RESUME_FRESH_CHANNEL",
    "1 for a resumed attempt, whose control channel is new: no consumed-counter repair in the distributor",
    OURS,
    writers=("run.resume",),
    readers=("registration",),
)
RUN_DIR = EnvVar(
    "SPECFORGE_KIMI_RUN_DIR",
    "the run's output directory, marked on every process a launch starts so that stop and the guard find them",
    OURS,
    writers=("run.resume",),
    readers=("run.run_guard",),
)

# -- our patches' switches ---------------------------------------------------------------------------------------
SPECFORGE_PLUGINS = EnvVar(
    "SPECFORGE_PLUGINS",
    "modules SpecForge imports at start (ours registers the K2.5 seams)",
    OUR_PATCH,
    writers=("plan.roles", "cli"),
    readers=("cli",),
    patches=("specforge/load-plugins",),
)
SPEC_CAPTURE_COMPACT = EnvVar(
    "SPECFORGE_SPEC_CAPTURE_COMPACT",
    "1: the producer sends capture passthrough compactly (recipe server.compact_passthrough)",
    OUR_PATCH,
    writers=("plan.roles", "run.offline_twin"),
    readers=("run.launch",),
    patches=("specforge/compact-capture-passthrough",),
)
EAGLE3_EMPTY_CACHE = EnvVar(
    "SPECFORGE_EAGLE3_EMPTY_CACHE",
    "0: the EAGLE-3 step keeps the allocator's cache (recipe trainer step knob)",
    OUR_PATCH,
    writers=("training.step_knobs",),
    readers=("training.step_knobs",),
    patches=("specforge/eagle3-keep-allocator-cache",),
)
ADAMW_FUSED = EnvVar(
    "SPECFORGE_ADAMW_FUSED",
    "1: the bf16 optimizer uses torch's fused AdamW (recipe trainer step knob)",
    OUR_PATCH,
    writers=("training.step_knobs",),
    readers=("training.step_knobs",),
    patches=("specforge/bf16-optimizer-fused-adamw",),
)
EAGLE3_FEWER_SYNCS = EnvVar(
    "SPECFORGE_EAGLE3_FEWER_SYNCS",
    "1: the EAGLE-3 step makes fewer host syncs (recipe trainer step knob)",
    OUR_PATCH,
    writers=("training.step_knobs",),
    readers=("training.step_knobs",),
    patches=("specforge/eagle3-fewer-host-syncs",),
)
EAGLE3_CHUNKED_LOSS = EnvVar(
    "SPECFORGE_EAGLE3_CHUNKED_LOSS",
    "N > 0: the EAGLE-3 draft head and its loss run N positions at a time (recipe trainer step knob)",
    OUR_PATCH,
    writers=("training.step_knobs",),
    readers=("training.step_knobs",),
    patches=("specforge/eagle3-chunked-head-loss",),
)
SERVER_TRANSPORT = EnvVar(
    "SGLANG_SPEC_CAPTURE_TRANSPORT",
    "the capture server's feature sink: mooncake (SpecForge's, the default) or cuda_ipc (our pool)",
    OUR_PATCH,
    writers=("transport.cuda_ipc",),
    readers=("transport.writer", "transport.registry"),
    patches=("sglang/spec-capture-cuda-ipc",),
)
IPC_POOL_BYTES = EnvVar(
    "SGLANG_SPEC_CAPTURE_IPC_POOL_BYTES",
    "the cuda_ipc pool's size in bytes (recipe server.ipc_pool_gib, or sized)",
    OUR_PATCH,
    writers=("transport.cuda_ipc",),
    readers=("transport.writer",),
    outside="our capture writer, called by SGLang patch spec-capture-cuda-ipc",
)
IPC_POOL_DIR = EnvVar(
    "SGLANG_SPEC_CAPTURE_IPC_DIR",
    "the directory the capture server writes its pool file to (the readers' SPECFORGE_KIMI_IPC_DIR)",
    OUR_PATCH,
    writers=("transport.cuda_ipc",),
    readers=("transport.writer",),
    outside="our capture writer, called by SGLang patch spec-capture-cuda-ipc",
)
IPC_LEASE_S = EnvVar(
    "SGLANG_SPEC_CAPTURE_IPC_LEASE_S",
    "seconds a lent pool slot may stay unreleased before the server reclaims it (recipe server.ipc_lease_s)",
    OUR_PATCH,
    writers=("transport.cuda_ipc",),
    readers=("transport.writer",),
    outside="our capture writer, called by SGLang patch spec-capture-cuda-ipc",
)
IPC_MAX_SLOTS = EnvVar(
    "SGLANG_SPEC_CAPTURE_IPC_MAX_SLOTS",
    "rows of the cuda_ipc slot table (samples lent at once); an operator's override",
    OUR_PATCH,
    readers=("transport.writer",),
    outside="our capture writer, called by SGLang patch spec-capture-cuda-ipc",
)
IPC_WAIT_S = EnvVar(
    "SGLANG_SPEC_CAPTURE_IPC_WAIT_S",
    "seconds a batch waits for pool space before its captures fail; an operator's override",
    OUR_PATCH,
    readers=("transport.writer",),
    outside="our capture writer, called by SGLang patch spec-capture-cuda-ipc",
)
PUT_CLIENTS = EnvVar(
    "SGLANG_SPEC_CAPTURE_PUT_CLIENTS",
    "Mooncake store clients the capture sink splits each batch's put over (recipe server.capture_put_clients)",
    OUR_PATCH,
    writers=("servers.capture_server",),
    patches=("sglang/spec-capture-parallel-put", "sglang/spec-capture-cuda-ipc"),
)

# -- libraries' variables we set or read -------------------------------------------------------------------------
CAPTURE_TIMING = EnvVar(
    "SGLANG_SPEC_CAPTURE_TIMING",
    "1: the capture sink logs per-batch timings (our cuda_ipc writer too); an operator's switch",
    LIBRARY,
    readers=("transport.writer",),
    outside="SpecForge's spec-capture patch of SGLang",
)
DIST_INIT_OVERRIDE = EnvVar(
    "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE",
    "SGLang's distributed init method: a file:// store, so a single-node server opens no TCPStore listener",
    LIBRARY,
    writers=("servers.capture_server",),
    outside="SGLang (ModelRunner.init_torch_distributed)",
)
GLOO_SOCKET_IFNAME = EnvVar(
    "GLOO_SOCKET_IFNAME",
    "the interface gloo's listeners bind (lo on one node)",
    LIBRARY,
    writers=("servers.capture_server", "plan.roles"),
    outside="gloo",
)
NCCL_SOCKET_IFNAME = EnvVar(
    "NCCL_SOCKET_IFNAME",
    "the interface NCCL's bootstrap and proxy listeners bind (lo on one node)",
    LIBRARY,
    writers=("servers.capture_server", "plan.roles"),
    outside="NCCL",
)
NCCL_NVLS_ENABLE = EnvVar(
    "NCCL_NVLS_ENABLE",
    "0: NCCL's NVLink multicast off (shared hosts)",
    LIBRARY,
    writers=("servers.capture_server", "evaluate.bench"),
    outside="NCCL",
)
TORCH_SYMM_MEM_DISABLE_MULTICAST = EnvVar(
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "1: torch symmetric memory without NVLink multicast (shared hosts)",
    LIBRARY,
    writers=("servers.capture_server", "evaluate.bench"),
    outside="torch",
)
NVSHMEM_DISABLE_NVLS = EnvVar(
    "NVSHMEM_DISABLE_NVLS",
    "1: NVSHMEM without NVLink multicast (shared hosts)",
    LIBRARY,
    writers=("servers.capture_server", "evaluate.bench"),
    outside="NVSHMEM",
)
FLASHINFER_DISABLE_VERSION_CHECK = EnvVar(
    "FLASHINFER_DISABLE_VERSION_CHECK",
    "1: FlashInfer skips its version check in the capture server (as SpecForge's launcher sets it)",
    LIBRARY,
    writers=("servers.capture_server",),
    outside="FlashInfer",
)
MOONCAKE_METADATA_SERVER = EnvVar(
    "MOONCAKE_METADATA_SERVER",
    "the Mooncake master's HTTP metadata endpoint",
    LIBRARY,
    writers=("servers.capture_server", "plan.roles"),
    readers=("servers.reference_server", "run.segment_keeper"),
    outside="SpecForge's Mooncake store and spec-capture sink",
    patches=("sglang/spec-capture-parallel-put",),
)
MOONCAKE_MASTER_SERVER_ADDR = EnvVar(
    "MOONCAKE_MASTER_SERVER_ADDR",
    "the Mooncake master's RPC address",
    LIBRARY,
    writers=("servers.capture_server", "plan.roles"),
    readers=("servers.reference_server", "run.segment_keeper"),
    outside="SpecForge's Mooncake store and spec-capture sink",
    patches=("sglang/spec-capture-parallel-put",),
)
MOONCAKE_LOCAL_HOSTNAME = EnvVar(
    "MOONCAKE_LOCAL_HOSTNAME",
    "the address this process's Mooncake client is reached at (launch --local-host on several nodes)",
    LIBRARY,
    writers=("servers.capture_server", "run.launch"),
    readers=("servers.reference_server", "run.segment_keeper"),
    outside="SpecForge's Mooncake store and spec-capture sink",
    patches=("sglang/spec-capture-parallel-put",),
)
MOONCAKE_PROTOCOL = EnvVar(
    "MOONCAKE_PROTOCOL",
    "Mooncake's transfer protocol (tcp or rdma)",
    LIBRARY,
    writers=("servers.capture_server",),
    readers=("servers.reference_server", "run.segment_keeper"),
    outside="SpecForge's Mooncake store and spec-capture sink",
    patches=("sglang/spec-capture-parallel-put",),
)
MOONCAKE_RDMA_DEVICES = EnvVar(
    "MOONCAKE_RDMA_DEVICES",
    "the RDMA devices Mooncake uses with protocol rdma",
    LIBRARY,
    writers=("servers.capture_server",),
    readers=("servers.reference_server", "run.segment_keeper"),
    outside="SpecForge's Mooncake store and spec-capture sink",
    patches=("sglang/spec-capture-parallel-put",),
)
MOONCAKE_GLOBAL_SEGMENT_SIZE = EnvVar(
    "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "bytes of the Mooncake segment this process mounts (0: the server puts into the segment keeper's)",
    LIBRARY,
    writers=("servers.capture_server", "run.launch"),
    readers=("servers.reference_server", "run.segment_keeper"),
    outside="SpecForge's Mooncake store and spec-capture sink",
    patches=("sglang/spec-capture-parallel-put",),
)
MOONCAKE_LOCAL_BUFFER_SIZE = EnvVar(
    "MOONCAKE_LOCAL_BUFFER_SIZE",
    "bytes of the Mooncake client's local transfer buffer",
    LIBRARY,
    writers=("servers.capture_server",),
    readers=("servers.reference_server",),
    outside="SpecForge's Mooncake store and spec-capture sink",
    patches=("sglang/spec-capture-parallel-put",),
)
CUDA_VISIBLE_DEVICES = EnvVar(
    "CUDA_VISIBLE_DEVICES",
    "the GPUs a process sees (the node's for server and trainer, none for the segment keeper and master)",
    LIBRARY,
    writers=("servers.capture_server", "run.launch", "run.services", "run.offline_twin", "transport.cuda_ipc"),
    readers=("plan.devices", "run.launch"),
    outside="CUDA",
)
CUDA_MPS_PIPE_DIRECTORY = EnvVar(
    "CUDA_MPS_PIPE_DIRECTORY",
    "the run's private CUDA MPS pipe directory (recipe overlap.mps): the daemon listens there, every role connects",
    LIBRARY,
    writers=("plan.roles", "run.mps"),
    outside="CUDA MPS",
)
CUDA_MPS_LOG_DIRECTORY = EnvVar(
    "CUDA_MPS_LOG_DIRECTORY",
    "where the run's CUDA MPS daemon writes control.log and server.log (recipe overlap.mps)",
    LIBRARY,
    writers=("run.mps",),
    outside="CUDA MPS",
)
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = EnvVar(
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "the share of each GPU's SMs an MPS client's kernels may use (recipe overlap.server_sm_percent / "
    "trainer_sm_percent)",
    LIBRARY,
    writers=("plan.roles",),
    outside="CUDA MPS",
)
CUDA_MPS_CLIENT_PRIORITY = EnvVar(
    "CUDA_MPS_CLIENT_PRIORITY",
    "an MPS client's scheduling priority, read at CUDA init: 0 NORMAL, 1 BELOW_NORMAL (recipe "
    "overlap.below_normal_priority names the side that gets 1)",
    LIBRARY,
    writers=("plan.roles",),
    outside="CUDA MPS",
)
PYTORCH_CUDA_ALLOC_CONF = EnvVar(
    "PYTORCH_CUDA_ALLOC_CONF",
    "torch's caching-allocator settings of the trainer ranks (recipe trainer step knob)",
    LIBRARY,
    writers=("training.step_knobs",),
    readers=("transport.writer", "evaluate.run_report"),
    outside="torch",
)
PYTORCH_ALLOC_CONF = EnvVar(
    "PYTORCH_ALLOC_CONF",
    "torch's newer name for PYTORCH_CUDA_ALLOC_CONF; an operator's setting",
    LIBRARY,
    readers=("transport.writer",),
    outside="torch",
)
DISAGG_STORE_ID = EnvVar(
    "DISAGG_STORE_ID",
    "the feature store's id SpecForge's launcher gives its processes (our cuda_ipc store takes it too)",
    LIBRARY,
    readers=("transport.cuda_ipc",),
    outside="SpecForge's launcher",
)
CLONE_ON_FETCH = EnvVar(
    "CLONE_ON_FETCH",
    "0: SpecForge's feature loader does not clone fetched tensors (our cuda_ipc store returns fresh ones)",
    LIBRARY,
    writers=("transport.cuda_ipc",),
    outside="SpecForge's feature loader",
)
LOCAL_RANK = EnvVar(
    "LOCAL_RANK",
    "a trainer rank's index on its node (its GPU)",
    LIBRARY,
    writers=("training.offline",),
    readers=("transport.store",),
    outside="torchrun",
)
RANK = EnvVar(
    "RANK", "a trainer rank's global index", LIBRARY, writers=("training.offline",), outside="torchrun, SpecForge"
)
WORLD_SIZE = EnvVar(
    "WORLD_SIZE", "the trainer's rank count", LIBRARY, writers=("training.offline",), outside="torchrun, SpecForge"
)
MASTER_ADDR = EnvVar(
    "MASTER_ADDR", "the trainer's rendezvous host", LIBRARY, writers=("training.offline",), outside="torch.distributed"
)
MASTER_PORT = EnvVar(
    "MASTER_PORT", "the trainer's rendezvous port", LIBRARY, writers=("training.offline",), outside="torch.distributed"
)
FSDP_SHARDING = EnvVar(
    "FSDP_SHARDING",
    "SpecForge's FSDP sharding strategy (kept around the offline twin's in-process training)",
    LIBRARY,
    writers=("training.offline",),
    outside="SpecForge's training backend",
)
CUBLAS_WORKSPACE_CONFIG = EnvVar(
    "CUBLAS_WORKSPACE_CONFIG",
    "cuBLAS's workspace for deterministic kernels (the demo's deterministic pretraining)",
    LIBRARY,
    writers=("demo.pretrain",),
    outside="torch / cuBLAS",
)
PYTHONUNBUFFERED = EnvVar(
    "PYTHONUNBUFFERED",
    "1: the keeper's children write their logs unbuffered",
    LIBRARY,
    writers=("run.keeper",),
    outside="Python",
)

#: every row, in the order declared above
TABLE: tuple[EnvVar, ...] = tuple(v for v in list(globals().values()) if isinstance(v, EnvVar))
BY_NAME: dict[str, EnvVar] = {v.name: v for v in TABLE}
