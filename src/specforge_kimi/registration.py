"""What :func:`specforge_kimi.register` installs, seam by seam.

Scope: in-process registration only; it changes no file on disk. Every step is idempotent and
imports transformers/specforge lazily. The seams, each by its name (code, tests and docs use the name):

- ``k25-config``: transformers ``AutoConfig``: ``kimi_k25`` -> ``targets.checkpoint.KimiK25Config`` (no remote code;
  top-level ``hidden_size``/``vocab_size``/``num_hidden_layers`` read through ``text_config``,
  which is what SpecForge's ``TargetHead`` and draft-config derivation read).
- ``weight-keys``: SpecForge weight loaders (``TargetHead.load_weights``,
  ``TargetEmbeddingsAndHead._load_weights``, ``Eagle3DraftModel.load_embedding``): a key that
  a local checkpoint does not contain is resolved to the checkpoint's own embedding / LM-head
  name (K2.5 ``language_model.*``, NVFP4 ``language_model.layers.*``) instead of a KeyError.
  Keys that exist are passed through untouched. These are wrappers, not rewrites: SpecForge's
  own loading code still runs. They act only on a checkpoint :func:`_is_k25_dir` recognises (a
  local directory whose ``config.json`` is K2.5's wrapper); for any other target SpecForge's code
  runs with the arguments it was given, so its own checks and errors (``.bin`` checkpoints, a
  missing tensor, a missing shard) are what the user sees.
- ``chat-template``: SpecForge ``TEMPLATE_REGISTRY``: the ``kimi-k2.5`` chat template.
- ``remote-tokenizer``: SpecForge's producer tokenizer (``training.assembly._load_text_tokenizer``, which calls
  ``AutoTokenizer`` with the run's ``trust_remote_code``, False by default): a K2.5 checkpoint
  whose tokenizer is remote code (``tokenization_kimi.py``, tiktoken) is loaded with
  ``trust_remote_code=True`` from local files and its special ids are checked
  (:func:`tokenizer.load_tokenizer`); the run's config (and with it the AutoConfig path) keeps
  ``trust_remote_code: false``. Other targets pass through untouched.
- ``mla-draft``: SpecForge's draft registry and ``eagle3`` algorithm: the MLA EAGLE-3 draft
  (``Eagle3DeepseekV2ForCausalLM``, :func:`specforge_kimi.drafts.mla_eagle3.register_mla_draft`).
- ``compile-elementwise``: SpecForge's ``LlamaDecoderLayer.forward`` and ``specforge.core.lk_loss``'s per-position
  acceptance metric, only in a process with ``SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE=1`` (recipe
  ``trainer.step_compile_elementwise``): the regions around the draft layer's attention (norms, MLP, residual adds)
  and the metric under ``torch.compile`` (:mod:`specforge_kimi.drafts.compile_elementwise`). Without the variable
  SpecForge's forward and metric are untouched.
- ``eagle3-block-mask``: SpecForge's ``generate_eagle3_mask`` and the two ``create_block_mask`` names of
  ``specforge.modeling.draft.llama3_eagle``, only in a process with ``SPECFORGE_KIMI_EAGLE3_BLOCK_MASK=1`` (recipe
  ``trainer.step_eagle3_block_mask``): the flex attention's block mask from per-block counts in closed form, the
  same ``BlockMask`` (:mod:`specforge_kimi.drafts.eagle3_block_mask`). Without the variable nothing is replaced.
- ``flex-autotune``: SpecForge's ``WrappedFlexAttention`` singleton, only in a process with
  ``SPECFORGE_KIMI_FLEX_AUTOTUNE=1`` (recipe ``trainer.step_flex_autotune``): flex attention compiled with
  ``max-autotune-no-cudagraphs`` (:mod:`specforge_kimi.drafts.flex_autotune`). Without the variable it is SpecForge's.
- ``optimizer-fused-clip``: SpecForge's ``BF16Optimizer.step``, only in a process with
  ``SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP=1`` (recipe ``trainer.step_optimizer_fused_clip``): the gradient clip as
  fused AdamW's ``grad_scale``, the norm from one multi-tensor pass, the masters cast back in one copy
  (:mod:`specforge_kimi.drafts.optimizer_fused_clip`). Without the variable SpecForge's step is untouched.
- ``eagle3-fused-wgrad``: SpecForge's ``OnlineEagle3Model.forward``, only in a process with
  ``SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD=1`` (recipe ``trainer.step_eagle3_fused_wgrad``): the draft layer's and head's
  linears sum their weight gradients over the TTT positions inside the weight-gradient GEMM
  (:mod:`specforge_kimi.drafts.eagle3_fused_wgrad`). Without the variable SpecForge's forward is untouched.
- ``eagle3-fused-proj``: SpecForge's ``OnlineEagle3Model.forward``, only in a process with
  ``SPECFORGE_KIMI_EAGLE3_FUSED_PROJ=1`` (recipe ``trainer.step_eagle3_fused_proj``): the Llama draft layer's q/k/v
  and gate/up projections run as one GEMM per group (:mod:`specforge_kimi.drafts.eagle3_fused_proj`). Without the
  variable SpecForge's forward is untouched.
- ``fa-kernel``: ``_FlashCachedMergeFunc`` and ``LlamaFlashAttention.__init__`` of
  ``specforge.modeling.draft.llama3_eagle``, only in a process with ``SPECFORGE_KIMI_EAGLE3_FA_KERNEL=1`` (recipe
  ``trainer.attention_backend: fa``): SpecForge's ``fa`` TTT attention on PyTorch's own kernels (cuDNN's attention
  with its log-sum-exp on CUDA, its flash attention where cuDNN refuses) instead of the ``flash_attn`` package, the
  diagonal terms merged in batched products (:mod:`specforge_kimi.drafts.eagle3_fa_kernel`). Without the variable
  nothing is replaced.
- ``allocator-retries``: SpecForge's ``TrainerCore.train_step``, in every process: after each optimizer step on CUDA,
  the caching allocator's retries since the previous one (``perf/cuda_alloc_retries``: each a device sync and a
  release of cached memory, the sign of a trainer whose GPU room is smaller than what its allocator reserves) and
  what it holds (``perf/cuda_reserved_gib``) join the step's metrics (:mod:`specforge_kimi.drafts.allocator_retries`);
  ``run-report`` reads them back. The step itself is untouched.
- ``outage-wait``: SpecForge's producer transport (``SGLangServerCaptureAdapter.produce_refs``): when a capture
  request fails at the HTTP level and the server does not answer ``/health``, wait for it (up to
  ``SPECFORGE_KIMI_SERVER_OUTAGE_S`` seconds, default 900) before the failure goes back to
  SpecForge. Its rollout worker requeues the prompts (retryable) either way, but it drops a
  worker after 3 consecutive failed calls and fails a prompt after 5 attempts, so without the
  wait a server restart (a minute or more) ends the run. Successful calls are untouched.
- ``restartable-consumer``: SpecForge's consumer-failure sidecar (``StreamingRefChannel.mark_consumer_failed``):
  when one trainer rank dies, torchrun SIGTERMs the others, and each of them publishes
  ``consumer_failed: _WorkerTermination: 15``, which stops the producer for good -- so a consumer
  the keeper is about to resume (``SPECFORGE_KIMI_CONSUMER_RESTARTABLE=1``, set by
  :mod:`specforge_kimi.run.keeper` while it has restarts left) would find no producer. In that case
  only, a signal-driven stop (``_WorkerTermination``) is not published, nor is a collective that
  failed because a peer rank's connection closed (gloo's ``Connection closed by peer``, which can
  reach a surviving rank before torchrun's SIGTERM does: :data:`PEER_LOST`); the producer waits
  for the resumed consumer instead, and if the keeper cannot resume it exits and the supervisor
  stops the run. Real training errors are always published.
- ``cuda-ipc-store``: the cuda_ipc feature transport (:mod:`specforge_kimi.transport`): with
  ``SPECFORGE_KIMI_TRANSPORT=cuda_ipc`` (set by a recipe with ``server.transport: cuda_ipc`` for every role)
  SpecForge's online feature store (``training.disaggregated._mooncake_store``, looked up at call time) is our
  :class:`~specforge_kimi.transport.store.CudaIpcFeatureStore`; and the producer's
  ``SGLangServerCaptureAdapter._ref_from_result`` carries a capture's ``cuda_ipc`` descriptor into the ref
  (``metadata["cuda_ipc"]``, ``cudaipc://`` URI). Without the variable, and for results without a
  descriptor, both are SpecForge's own.

Whole-run resume (``specforge-kimi launch RECIPE --resume``, :mod:`specforge_kimi.run.resume`) needs
three more, installed in every run from its first attempt:

- ``prompt-ids``: SpecForge's online prompt plan (``specforge.launch._iter_epoch_online_prompt_batches``): every prompt
  gets a deterministic task id, ``epoch{e:04d}-prompt{i:012d}`` (SpecForge's own multi-epoch form, now
  also for one epoch, where SpecForge mints a random ``task-<uuid>`` per producer run), so the ledger's
  sample ids name prompts across attempts. With ``SPECFORGE_KIMI_RESUME_SKIP`` naming a file of task
  ids (one a line: the samples trained into the checkpoint a resumed attempt starts from), those
  prompts are left out of the plan; the rest keep their order.
- ``fresh-channel``: SpecForge's ``RefDistributor.__init__`` on a fresh channel
  (``SPECFORGE_KIMI_RESUME_FRESH_CHANNEL=1``, set for a resumed attempt, whose control directory is new): it
  still skips the released sample ids, but does not "repair" the channel's consumed counter from them -- that
  repair is for a consumer restarted on the same channel; on a new one it marks consumed what was never
  published there, which turns the producer's backpressure off.
- ``checkpoint-save``: SpecForge's ``CheckpointManager.save``: after SpecForge wrote a checkpoint (``torch.save`` +
  rename, no fsync, ``-latest`` re-pointed by remove + symlink), every rank fsyncs its own file, then rank 0
  fsyncs the shared one and writes ``specforge_kimi_complete.json`` (step, run id, world size, every
  file's size) atomically and fsynced. ``--resume`` loads only checkpoints with that marker whose files
  still have those sizes, so a checkpoint the node died writing is never loaded.
"""

from __future__ import annotations

import functools
import os

import specforge_kimi.environment as _env

_DONE = False
_WRAPPED_FLAG = "__specforge_kimi_wrapped__"


def _is_k25_dir(model_path) -> bool:
    """A local K2.5 checkpoint directory (the only targets the weight-key wrappers touch). A
    ``config.json`` that does not parse is not recognised: SpecForge reports it its own way."""
    if not isinstance(model_path, (str, os.PathLike)) or not os.path.isdir(model_path):
        return False
    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.targets.checkpoint import is_kimi_k25_checkpoint

    try:
        return is_kimi_k25_checkpoint(model_path)
    except KimiInputError:
        return False


def _resolving(role: str, key_arg: str, key_pos: int, default: str):
    """Decorator factory: resolve ``key_arg`` (positional index ``key_pos`` after self/path)."""

    def deco(fn):
        if getattr(fn, _WRAPPED_FLAG, False):
            return fn

        @functools.wraps(fn)
        def wrapper(self, model_path, *args, **kwargs):
            from specforge_kimi.targets.checkpoint import resolve_weight_key

            if _is_k25_dir(model_path):
                if key_arg in kwargs:
                    kwargs[key_arg] = resolve_weight_key(model_path, kwargs[key_arg] or default, role)
                elif len(args) > key_pos:
                    args = list(args)
                    args[key_pos] = resolve_weight_key(model_path, args[key_pos] or default, role)
                else:
                    kwargs[key_arg] = resolve_weight_key(model_path, default, role)
            return fn(self, model_path, *args, **kwargs)

        setattr(wrapper, _WRAPPED_FLAG, True)
        return wrapper

    return deco


def _install_weight_key_resolution() -> None:
    """The ``weight-keys`` seam (module docstring)."""
    from specforge.modeling.draft.base import Eagle3DraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead

    TargetHead.load_weights = _resolving("lm_head", "lm_head_key", 0, "lm_head.weight")(TargetHead.load_weights)
    Eagle3DraftModel.load_embedding = _resolving("embedding", "embedding_key", 0, "model.embed_tokens.weight")(
        Eagle3DraftModel.load_embedding
    )
    original = TargetEmbeddingsAndHead._load_weights
    if not getattr(original, _WRAPPED_FLAG, False):

        @functools.wraps(original)
        def _load_weights(self, model_path, embed_key, lm_head_key, tie_weights):
            from specforge_kimi.targets.checkpoint import resolve_weight_key

            if _is_k25_dir(model_path):
                embed_key = resolve_weight_key(model_path, embed_key, "embedding")
                if not tie_weights:
                    lm_head_key = resolve_weight_key(model_path, lm_head_key, "lm_head")
            return original(self, model_path, embed_key, lm_head_key, tie_weights)

        setattr(_load_weights, _WRAPPED_FLAG, True)
        TargetEmbeddingsAndHead._load_weights = _load_weights


def _install_tokenizer_loader() -> None:
    """The ``remote-tokenizer`` seam (module docstring)."""
    import json

    from specforge.training import assembly

    original = assembly._load_text_tokenizer
    if getattr(original, _WRAPPED_FLAG, False):
        return

    @functools.wraps(original)
    def _load_text_tokenizer(cfg):
        path = cfg.model.target_model_path
        tok_cfg = os.path.join(path, "tokenizer_config.json") if os.path.isdir(path) else ""
        if not cfg.model.trust_remote_code and tok_cfg and os.path.isfile(tok_cfg):
            with open(tok_cfg, encoding="utf-8") as f:
                remote = "auto_map" in json.load(f)
            from specforge_kimi.targets.checkpoint import is_kimi_k25_checkpoint

            if remote and is_kimi_k25_checkpoint(path):
                from specforge_kimi.data.tokenizer import load_tokenizer

                load_tokenizer(path)  # special-id check, with a clear error
                model = cfg.model.model_copy(update={"trust_remote_code": True})
                return original(cfg.model_copy(update={"model": model}))
        return original(cfg)

    setattr(_load_text_tokenizer, _WRAPPED_FLAG, True)
    assembly._load_text_tokenizer = _load_text_tokenizer


def _server_healthy(base_url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as r:
            return r.status == 200
    except Exception:
        return False


#: seconds the outage-wait seam waits for a lost capture server (set by ``launch``)
OUTAGE_ENV = _env.SERVER_OUTAGE_S.name


def _install_outage_wait() -> None:
    """The ``outage-wait`` seam (module docstring)."""
    from specforge.inference.adapters.server_capture import SGLangServerCaptureAdapter

    original = SGLangServerCaptureAdapter.produce_refs
    if getattr(original, _WRAPPED_FLAG, False):
        return

    @functools.wraps(original)
    def produce_refs(self, tasks, *, capture):
        import logging
        import time

        try:
            return original(self, tasks, capture=capture)
        except Exception as exc:
            import requests

            if not isinstance(exc, requests.RequestException) or _server_healthy(self.base_url):
                raise
            limit = float(os.environ.get(OUTAGE_ENV, "900"))
            log = logging.getLogger("specforge_kimi")
            log.warning(
                "capture server %s unreachable (%s); waiting up to %.0f s for it",
                self.base_url,
                type(exc).__name__,
                limit,
            )
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline and not _server_healthy(self.base_url):
                time.sleep(2.0)
            log.warning(
                "capture server %s is %s",
                self.base_url,
                "back" if _server_healthy(self.base_url) else f"still down after {limit:.0f} s",
            )
            raise  # SpecForge requeues the prompts (retryable) and its next call finds the server up

    setattr(produce_refs, _WRAPPED_FLAG, True)
    SGLangServerCaptureAdapter.produce_refs = produce_refs


RESTARTABLE_ENV = _env.CONSUMER_RESTARTABLE.name
# a surviving rank's collective failing because a sibling died (the sibling's own failure, if it could
# publish one, is not suppressed); torch's gloo and NCCL wordings
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
)


def _peer_stop(reason: str) -> bool:
    """A failure a keeper's resume can absorb: torchrun's signal, or a peer rank gone mid-collective."""
    return reason.startswith("_WorkerTermination") or any(m in reason for m in PEER_LOST)


def _install_restartable_consumer_failure() -> None:
    """The ``restartable-consumer`` seam (module docstring)."""
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    original = StreamingRefChannel.mark_consumer_failed
    if getattr(original, _WRAPPED_FLAG, False):
        return

    @functools.wraps(original)
    def mark_consumer_failed(self, reason: str) -> None:
        if os.environ.get(RESTARTABLE_ENV) == "1" and _peer_stop(str(reason)):
            import logging

            logging.getLogger("specforge_kimi").warning(
                "consumer stopped by a signal or a lost peer rank (%s) with a keeper restart left: not publishing "
                "consumer_failed, the producer waits for the resumed consumer",
                reason,
            )
            return
        return original(self, reason)

    setattr(mark_consumer_failed, _WRAPPED_FLAG, True)
    StreamingRefChannel.mark_consumer_failed = mark_consumer_failed


def _install_cuda_ipc_transport() -> None:
    """The ``cuda-ipc-store`` seam (module docstring)."""
    from specforge.inference.adapters.server_capture import SGLangServerCaptureAdapter
    from specforge.training import disaggregated

    original_store = disaggregated._mooncake_store
    if not getattr(original_store, _WRAPPED_FLAG, False):

        @functools.wraps(original_store)
        def _mooncake_store(cfg, *, retain_on_release: bool = False):
            from specforge_kimi.transport import TRANSPORT_ENV, registry
            from specforge_kimi.transport.cuda_ipc import feature_store_for

            try:
                registry.from_env(os.environ)
            except ValueError as exc:
                raise ValueError(f"{TRANSPORT_ENV}: {exc}") from None
            if getattr(cfg, "mode", None) == "online":
                store = feature_store_for(os.environ, cfg.run_id, retain_on_release=retain_on_release)
                if store is not None:
                    return store
            return original_store(cfg, retain_on_release=retain_on_release)

        setattr(_mooncake_store, _WRAPPED_FLAG, True)
        disaggregated._mooncake_store = _mooncake_store

    original_ref = SGLangServerCaptureAdapter._ref_from_result
    if not getattr(original_ref, _WRAPPED_FLAG, False):

        @functools.wraps(original_ref)
        def _ref_from_result(self, task, result, capture):
            ref = original_ref(self, task, result, capture)
            from specforge_kimi.transport.descriptor import RESULT_KEY, with_descriptor

            if isinstance(result, dict) and RESULT_KEY in result:
                ref = with_descriptor(ref, result[RESULT_KEY])
            return ref

        setattr(_ref_from_result, _WRAPPED_FLAG, True)
        SGLangServerCaptureAdapter._ref_from_result = _ref_from_result


RESUME_SKIP_ENV = _env.RESUME_SKIP.name
FRESH_CHANNEL_ENV = _env.RESUME_FRESH_CHANNEL.name
CHECKPOINT_COMPLETE = "specforge_kimi_complete.json"
CHECKPOINT_COMPLETE_FORMAT = "specforge-kimi/checkpoint-complete/v1"


def prompt_task_id(epoch: int, index: int) -> str:
    """The task id the ``prompt-ids`` seam gives prompt ``index`` of ``epoch`` (SpecForge's multi-epoch form)."""
    return f"epoch{epoch:04d}-prompt{index:012d}"


_SKIP_CACHE: dict[str, frozenset[str]] = {}


def _resume_skip_ids() -> frozenset[str]:
    path = os.environ.get(RESUME_SKIP_ENV)
    if not path:
        return frozenset()
    if path not in _SKIP_CACHE:
        with open(path, encoding="utf-8") as f:
            _SKIP_CACHE[path] = frozenset(line.strip() for line in f if line.strip())
    return _SKIP_CACHE[path]


def _install_deterministic_prompt_ids() -> None:
    """The ``prompt-ids`` seam (module docstring)."""
    import specforge.launch as sf_launch

    original = sf_launch._iter_epoch_online_prompt_batches
    if getattr(original, _WRAPPED_FLAG, False):
        return

    @functools.wraps(original)
    def _iter_epoch_online_prompt_batches(prompts, epoch, prompt_epochs, *, seed=0, batch_size=4096):
        skip = _resume_skip_ids()
        batch, skipped = [], 0
        for index in sf_launch._epoch_prompt_indices(prompts, epoch, seed=seed):
            item = sf_launch._epoch_online_prompt(prompts[index], index, epoch, prompt_epochs)
            if "task_id" not in item:
                item = {**item, "task_id": prompt_task_id(epoch, index)}
            if item["task_id"] in skip:
                skipped += 1
                continue
            batch.append(item)
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch
        if skip:
            import logging

            logging.getLogger("specforge_kimi").warning(
                "resume: epoch %d: left out %d prompts already trained into the checkpoint this attempt resumes",
                epoch,
                skipped,
            )

    setattr(_iter_epoch_online_prompt_batches, _WRAPPED_FLAG, True)
    sf_launch._iter_epoch_online_prompt_batches = _iter_epoch_online_prompt_batches


def _install_fresh_channel_distributor() -> None:
    """The ``fresh-channel`` seam (module docstring)."""
    from specforge.runtime.data_plane.ref_distributor import RefDistributor

    original = RefDistributor.__init__
    if getattr(original, _WRAPPED_FLAG, False):
        return

    @functools.wraps(original)
    def __init__(self, *args, skip_ids=None, **kwargs):  # noqa: N807
        if os.environ.get(FRESH_CHANNEL_ENV) != "1":
            return original(self, *args, skip_ids=skip_ids, **kwargs)
        original(self, *args, skip_ids=None, **kwargs)  # no consumed-counter repair on a new channel
        self._skip = set(skip_ids or ())

    setattr(__init__, _WRAPPED_FLAG, True)
    RefDistributor.__init__ = __init__


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mark_checkpoint_complete(ckpt_dir: str, *, run_id: str, step: int, world_size: int) -> None:
    """Rank 0, once every rank's file is on disk: fsync the files, then write the completion marker
    (temp file, fsync, rename, fsync of the directories)."""
    import json
    import time

    files = {}
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name.endswith(".pt") and os.path.isfile(path):
            _fsync(path)
            files[name] = os.path.getsize(path)
    record = {
        "format": CHECKPOINT_COMPLETE_FORMAT,
        "run_id": run_id,
        "step": int(step),
        "world_size": int(world_size),
        "files": files,
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = os.path.join(ckpt_dir, f".{CHECKPOINT_COMPLETE}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, CHECKPOINT_COMPLETE))
    _fsync(ckpt_dir)
    _fsync(os.path.dirname(os.path.abspath(ckpt_dir)))  # the step directory's entry and -latest


def _install_checkpoint_completion() -> None:
    """The ``checkpoint-save`` seam (module docstring)."""
    from specforge.training.checkpoint import CheckpointManager

    original = CheckpointManager.save
    if getattr(original, _WRAPPED_FLAG, False):
        return

    def _gather_errors(err: str) -> list[str]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            errs = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
            return [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
        return [f"rank 0: {err}"] if err else []

    @functools.wraps(original)
    def save(self, state, step, *, rank_state=None):
        import torch.distributed as dist

        ckpt_dir = original(self, state, step, rank_state=rank_state)
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        err = ""
        try:
            if rank_state is not None:
                _fsync(os.path.join(ckpt_dir, self._rank_file(rank)))
        except OSError as exc:
            err = f"fsync failed: {exc}"
        failures = _gather_errors(err)  # every rank's file is durable before rank 0 writes the marker
        if not failures:
            err = ""
            if rank == 0:
                try:
                    _mark_checkpoint_complete(ckpt_dir, run_id=self.run_id, step=step, world_size=world)
                except OSError as exc:
                    err = f"completion marker: {exc}"
            failures = _gather_errors(err)
        if failures:
            raise RuntimeError(f"checkpoint {ckpt_dir} not made durable: " + "; ".join(failures))
        return ckpt_dir

    setattr(save, _WRAPPED_FLAG, True)
    CheckpointManager.save = save


#: the step seams (module, install function): each installs only when its variable asks for it
#: (SPECFORGE_KIMI_EAGLE3_COMPILE_ELEMENTWISE, SPECFORGE_KIMI_EAGLE3_BLOCK_MASK, SPECFORGE_KIMI_FLEX_AUTOTUNE,
#: SPECFORGE_KIMI_OPTIMIZER_FUSED_CLIP, SPECFORGE_KIMI_EAGLE3_FUSED_WGRAD, SPECFORGE_KIMI_EAGLE3_FUSED_PROJ,
#: SPECFORGE_KIMI_EAGLE3_FA_KERNEL)
_STEP_SEAMS = (
    ("specforge_kimi.drafts.compile_elementwise", "install_compile_elementwise"),
    ("specforge_kimi.drafts.eagle3_block_mask", "install_eagle3_block_mask"),
    ("specforge_kimi.drafts.flex_autotune", "install_flex_autotune"),
    ("specforge_kimi.drafts.optimizer_fused_clip", "install_optimizer_fused_clip"),
    ("specforge_kimi.drafts.eagle3_fused_wgrad", "install_eagle3_fused_wgrad"),
    # after fused-wgrad: its forward runs outside that seam's, so it takes the siblings before that seam's wrap
    ("specforge_kimi.drafts.eagle3_fused_proj", "install_eagle3_fused_proj"),
    ("specforge_kimi.drafts.eagle3_fa_kernel", "install_fa_kernel"),
)


def _install_step_seams() -> None:
    """Install each of :data:`_STEP_SEAMS` (imported here: each pulls in torch)."""
    import importlib

    for module, install in _STEP_SEAMS:
        getattr(importlib.import_module(module), install)()


def register_all() -> None:
    """Run every registration step once per process."""
    global _DONE
    if _DONE:
        return
    from specforge_kimi.targets.checkpoint import register_config

    register_config()
    _install_weight_key_resolution()
    from specforge_kimi.data.chat_template import register_template

    register_template()
    _install_tokenizer_loader()
    from specforge_kimi.drafts.mla_eagle3 import register_mla_draft

    register_mla_draft()
    _install_step_seams()
    from specforge_kimi.drafts.allocator_retries import install_allocator_retries

    install_allocator_retries()
    _install_outage_wait()
    _install_restartable_consumer_failure()
    _install_cuda_ipc_transport()
    _install_deterministic_prompt_ids()
    _install_fresh_channel_distributor()
    _install_checkpoint_completion()
    _DONE = True
