"""``specforge-kimi bench``: acceptance length and speedup of a draft through SGLang's own EAGLE-3 or DFLASH.

Scope: a local target checkpoint (K2.5 or a tiny one) and an exported SGLang draft, served by
SGLang 0.5.14 on this node through our text-only launcher (``python -m
specforge_kimi.capture_server``, no spec-capture flags; ``--skip-tokenizer-init``, prompts go
to ``POST /generate`` as ``input_ids`` rendered with K2.5's chat template and tokenized here).
For each speculative config (``--speculative-algorithm EAGLE3`` with steps / topk / draft
tokens; default 3/1/4 and 7/1/8; or ``--speculative-algorithm DFLASH --speculative-dflash-block-size B`` for a
block draft, which SGLang serves with steps and topk forced to 1 and B draft tokens, recorded as
``1/1/B`` in the same ``config`` shape) one server is started, the prompt sets are run greedily
(temperature 0), and the server is stopped; the same is done once without speculation for the
speedup, or an earlier bench's baseline on the same card, stack, target, prompts and server flags is taken
(``--baseline-from``, :mod:`specforge_kimi.evaluate.baseline_reuse`). Readiness, timeouts and teardown are
SpecForge's own supervisor pieces (``specforge.launch_plan``: ``/health`` readiness, process-group SIGTERM then
SIGKILL).

Metrics come only from the engine's counters in ``meta_info`` of each finished request
(``sglang/srt/managers/tokenizer_manager.py`` ``_calculate_spec_decoding_metrics``;
counters incremented per verify step in ``scheduler_components/batch_result_processor.py``):

- ``acceptance_length`` = sum(``completion_tokens``) / sum(``spec_verify_ct``): SGLang's
  per-request ``spec_accept_length`` formula over the whole set (token-weighted). It counts the
  first token, which comes from prefill, not from a verify step.
- ``acceptance_length_decode`` = (sum ``spec_num_correct_drafts`` + sum ``spec_verify_ct``) /
  sum ``spec_verify_ct``: tokens per verify step, what the server-wide
  ``avg_spec_accept_length`` of ``/server_info`` (``scheduler.py``, ``metrics_reporter.py``)
  and ``bench_serving`` report.
- ``acceptance_length_mean_per_request``: mean of ``spec_accept_length`` (SpecForge 0.2.0's
  ``benchmarks/sglang.py`` statistic).
- per draft position, from ``spec_correct_drafts_histogram`` (bin k = verify steps that
  accepted exactly k drafted tokens, bonus excluded): ``at_least[j]`` = share of verify steps
  that accepted the j-th drafted token, ``conditional[j]`` = at_least[j] / at_least[j-1]; over
  the ``steps`` chain positions for EAGLE-3, the B-1 drafted block positions for DFLASH (the
  same counters: ``batch_result_processor.py`` counts both).

With ``--recipe`` the recipe fixes what is measured: the target (and its tokenizer), the server
flags (TP, attention backend, memory fraction, allreduce fusion, ``server.extra_args``), the
speculative config and the threshold (``bench.min_acceptance_length`` over every measured set).
The flags about how to run the measurement still apply (:data:`RECIPE_RUN_FLAGS`: prompt sets and
files, prompt count, tokens, concurrency, warmup, thinking, baseline, context length, CUDA graphs,
``--server-arg`` after the recipe's extra args, port, timeouts, draft check, output); a flag the
recipe fixes is refused in one line (:data:`RECIPE_FIXED_FLAGS`).

Limits: one node (``--tp``), no multi-node servers; throughput is output tokens over the wall
time of a set at ``--concurrency`` (default 1, where speculation helps most); both servers use
the same flags apart from speculation, CUDA graphs on unless ``--disable-cuda-graph`` (sized to the bench:
:func:`cuda_graph_argv`).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from specforge_kimi.durable import write_atomic
from specforge_kimi.errors import KimiInputError
from specforge_kimi.evaluate import baseline_reuse
from specforge_kimi.provenance import devices as _devices

SCHEMA_VERSION = 1
BUILTIN_SETS = ("chat", "math", "code", "structured")
DEFAULT_CONFIGS = ("3,1,4", "7,1,8")
#: K2.5 ends an assistant turn with <|im_end|>; [EOS] as a fallback.
STOP_TOKEN_IDS = (163586, 163585)
SERVER_MODULE = "specforge_kimi.capture_server"
STRUCTURED_PROMPTS = 48


# --------------------------------------------------------------------------------------------
# speculative configs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecConfig:
    """EAGLE-3: ``--speculative-num-steps`` / ``--speculative-eagle-topk`` / ``--speculative-num-draft-tokens``."""

    algorithm: ClassVar[str] = "EAGLE3"
    block_size: ClassVar[int | None] = None
    steps: int
    topk: int
    draft_tokens: int

    @property
    def drafted_positions(self) -> int:
        """Positions a verify step can accept (the chain's depth)."""
        return self.steps

    @property
    def run_label(self) -> str:
        return f"eagle3-{self.steps}-{self.topk}-{self.draft_tokens}"

    def config_dict(self) -> dict:
        """The result's ``config``: steps / topk / draft tokens as SGLang runs them."""
        return {"steps": self.steps, "topk": self.topk, "draft_tokens": self.draft_tokens}

    def validate(self) -> SpecConfig:
        if self.steps < 1 or self.topk < 1 or self.draft_tokens < 2:
            raise KimiInputError(f"speculative config {self.label}: need steps >= 1, topk >= 1, draft tokens >= 2")
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            # SGLang silently rewrites draft_tokens to steps + 1 for topk 1 (speculative_hook.py).
            raise KimiInputError(
                f"speculative config {self.label}: with topk 1 SGLang needs draft tokens = steps + 1 = {self.steps + 1}"
            )
        if self.draft_tokens > 1 + self.steps * self.topk**2:
            raise KimiInputError(f"speculative config {self.label}: more draft tokens than the draft tree holds")
        return self

    @property
    def label(self) -> str:
        return f"{self.steps}/{self.topk}/{self.draft_tokens}"

    def argv(self) -> list[str]:
        return [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-num-steps",
            str(self.steps),
            "--speculative-eagle-topk",
            str(self.topk),
            "--speculative-num-draft-tokens",
            str(self.draft_tokens),
        ]


@dataclass(frozen=True)
class DFlashConfig:
    """DFLASH: ``--speculative-dflash-block-size B``; SGLang 0.5.14 forces steps and topk to 1 and draft tokens
    to B (``arg_groups/speculative_hook.py`` ``_handle_dflash``). ``block_size`` None: the draft's own."""

    algorithm: ClassVar[str] = "DFLASH"
    block_size: int | None = None

    def validate(self) -> DFlashConfig:
        if self.block_size is not None and self.block_size < 2:
            raise KimiInputError(f"speculative config {self.label}: a DFLASH block needs at least 2 tokens")
        return self

    @property
    def label(self) -> str:
        return f"DFLASH/{self.block_size or 'draft'}"

    @property
    def steps(self) -> int:
        return 1

    @property
    def topk(self) -> int:
        return 1

    @property
    def draft_tokens(self) -> int:
        return self._block()

    @property
    def drafted_positions(self) -> int:
        """Block position 0 is the verified token; positions 1..B-1 are drafted."""
        return self._block() - 1

    @property
    def run_label(self) -> str:
        return f"dflash-{self._block()}"

    def _block(self) -> int:
        if self.block_size is None:
            raise KimiInputError("DFLASH block size not resolved from the draft's config.json")
        return self.block_size

    def config_dict(self) -> dict:
        return {"steps": 1, "topk": 1, "draft_tokens": self._block()}

    def argv(self) -> list[str]:
        return ["--speculative-algorithm", "DFLASH", "--speculative-dflash-block-size", str(self._block())]


def parse_spec_config(text: str) -> SpecConfig | DFlashConfig:
    """``"3,1,4"`` or ``"3/1/4"`` (EAGLE-3 steps, topk, draft tokens); ``"DFLASH,8"`` (block size 8) or
    ``"DFLASH"`` (the draft's block size)."""
    parts = text.replace("/", ",").split(",")
    if parts[0].strip().upper() == "DFLASH":
        try:
            block = [int(p) for p in parts[1:]]
        except ValueError:
            block = [0, 0]
        if len(block) > 1:
            raise KimiInputError(f"--config {text!r}: expected DFLASH or DFLASH,BLOCK_SIZE, e.g. DFLASH,8")
        return DFlashConfig(block[0] if block else None).validate()
    try:
        steps, topk, tokens = (int(p) for p in parts)
    except ValueError:
        raise KimiInputError(f"--config {text!r}: expected STEPS,TOPK,DRAFT_TOKENS, e.g. 3,1,4") from None
    return SpecConfig(steps, topk, tokens).validate()


# --------------------------------------------------------------------------------------------
# prompt sets
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple  # tuple[conversation.Message, ...], ending with a user or tool turn
    tools: tuple = ()
    thinking: bool | None = None  # None: the bench's --thinking setting


@dataclass
class PromptSet:
    name: str
    source: str
    prompts: list[Prompt] = field(default_factory=list)


def _prompt_from_record(record: Any, where: str, default_id: str) -> Prompt:
    from specforge_kimi.data.conversation import conversation_from_record

    if isinstance(record, dict) and "prompt" in record and "messages" not in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise KimiInputError(f"{where}: 'prompt' must be a non-empty string")
        record = {**record, "messages": [{"role": "user", "content": record.pop("prompt")}]}
    try:
        conv = conversation_from_record(record)
    except KimiInputError as exc:
        raise KimiInputError(f"{where}: {exc}") from None
    messages = list(conv.messages)
    if messages and messages[-1].role == "assistant":
        messages.pop()  # a reference answer: the target generates its own
    if not messages or messages[-1].role not in ("user", "tool"):
        raise KimiInputError(
            f"{where}: the prompt must end with a user or tool message (after dropping a final assistant answer)"
        )
    thinking = record.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise KimiInputError(f"{where}: 'thinking' must be true or false")
    pid = record.get("id", default_id)
    return Prompt(str(pid), tuple(messages), tuple(conv.tools), thinking)


def load_prompt_file(path: str | os.PathLike, name: str | None = None) -> PromptSet:
    """A JSONL prompt set: one ``{"messages": [...], "id"?, "tools"?, "thinking"?}`` or
    ``{"prompt": "text"}`` per line; blank lines are skipped, a bad line names file and line."""
    p = Path(path)
    if not p.is_file():
        raise KimiInputError(f"prompt file {p} not found")
    ps = PromptSet(name or p.stem, str(p))
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KimiInputError(f"{p}:{n}: not valid JSON ({exc.msg})") from None
        ps.prompts.append(_prompt_from_record(record, f"{p}:{n}", f"{ps.name}-{n}"))
    if not ps.prompts:
        raise KimiInputError(f"prompt file {p} holds no prompts")
    return ps


def structured_prompt_set(n: int = STRUCTURED_PROMPTS) -> PromptSet:
    """Held-out conversations of the synthetic corpus (:mod:`corpus`, ``HELDOUT_SEED``), answer dropped.

    A tiny target pretrained by ``tiny --pretrain`` has only learned this corpus, so acceptance
    on a tiny target means something mostly here. Each prompt keeps its conversation's mode
    (thinking when the reference answer had reasoning), as the target was trained.
    """
    from specforge_kimi.data import corpus
    from specforge_kimi.data.corpus import HELDOUT_SEED

    ps = PromptSet("structured", f"specforge_kimi.data.corpus seed {HELDOUT_SEED}")
    for rec in corpus.conversations(n, seed=HELDOUT_SEED):
        prompt = _prompt_from_record(rec, f"structured {rec['id']}", rec["id"])
        thinking = bool(rec["messages"][-1].get("reasoning_content"))
        ps.prompts.append(Prompt(prompt.id, prompt.messages, prompt.tools, thinking))
    return ps


def builtin_prompt_set(name: str) -> PromptSet:
    """``chat``, ``math``, ``code`` (package data, written for this project) or ``structured``."""
    from importlib.resources import as_file, files

    if name == "structured":
        return structured_prompt_set()
    if name not in BUILTIN_SETS:
        raise KimiInputError(
            f"unknown prompt set {name!r}; built in: {', '.join(BUILTIN_SETS)} (pass your own with --prompts-file)"
        )
    with as_file(files("specforge_kimi.data") / "prompts" / f"{name}.jsonl") as path:
        ps = load_prompt_file(path, name)
    ps.source = f"specforge_kimi/data/prompts/{name}.jsonl"
    return ps


def load_prompt_sets(names: Sequence[str], files_: Sequence[str] = (), limit: int | None = None) -> list[PromptSet]:
    """Built-in sets by name, then user JSONL files; ``limit`` keeps the first N of each."""
    sets = [builtin_prompt_set(n) for n in names] + [load_prompt_file(f) for f in files_]
    seen: set[str] = set()
    for ps in sets:
        if ps.name in seen:
            raise KimiInputError(f"two prompt sets are named {ps.name!r}; rename the file")
        seen.add(ps.name)
        if limit is not None:
            ps.prompts = ps.prompts[:limit]
    if not sets:
        raise KimiInputError("no prompt sets selected")
    return sets


def encode_prompt(prompt: Prompt, tokenizer, *, thinking: bool) -> list[int]:
    """K2.5 chat render with the generation prompt (:func:`chat_template.render_messages`), tokenized."""
    from specforge_kimi.data.chat_template import render_messages

    th = thinking if prompt.thinking is None else prompt.thinking
    return list(
        tokenizer.encode(render_messages(prompt.messages, prompt.tools, thinking=th, add_generation_prompt=True))
    )


# --------------------------------------------------------------------------------------------
# metrics from SGLang responses
# --------------------------------------------------------------------------------------------
def per_position_acceptance(histogram: Sequence[int], steps: int) -> dict:
    """``at_least[j-1]``: share of verify steps whose j-th drafted token was accepted (j = 1..steps);
    ``conditional[j-1]``: the same given the (j-1)-th was accepted. From SGLang's
    ``spec_correct_drafts_histogram`` (bin k = steps that accepted exactly k drafted tokens)."""
    h = list(histogram) + [0] * max(0, steps + 1 - len(histogram))
    total = sum(h)
    if total == 0:
        return {"at_least": [], "conditional": []}
    at_least = [sum(h[j:]) / total for j in range(1, steps + 1)]
    prev = [1.0] + at_least[:-1]
    conditional = [a / p if p > 0 else 0.0 for a, p in zip(at_least, prev, strict=True)]
    return {"at_least": at_least, "conditional": conditional}


def summarize(responses: Sequence[dict], *, wall_s: float, spec: SpecConfig | DFlashConfig | None) -> dict:
    """Set-level metrics from finished ``/generate`` responses (``{"output_ids", "meta_info"}``)."""
    metas = [r.get("meta_info") or {} for r in responses]
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    out: dict[str, Any] = {
        "requests": len(metas),
        "prompt_tokens": sum(int(m.get("prompt_tokens", 0)) for m in metas),
        "completion_tokens": completion,
        "wall_s": round(wall_s, 4),
        "output_tok_per_s": completion / wall_s if wall_s > 0 else None,
        "finish_reasons": {},
    }
    lat = [int(m.get("completion_tokens", 0)) / m["e2e_latency"] for m in metas if m.get("e2e_latency")]
    out["request_tok_per_s_mean"] = sum(lat) / len(lat) if lat else None
    for m in metas:
        reason = m.get("finish_reason")
        key = reason.get("type", "?") if isinstance(reason, dict) else str(reason)
        out["finish_reasons"][key] = out["finish_reasons"].get(key, 0) + 1
    if spec is None:
        return out
    verify = sum(int(m.get("spec_verify_ct", 0)) for m in metas)
    correct = sum(int(m.get("spec_num_correct_drafts", 0)) for m in metas)
    proposed = sum(int(m.get("spec_num_proposed_drafts", 0)) for m in metas)
    hist: list[int] = []
    for m in metas:
        for k, c in enumerate(m.get("spec_correct_drafts_histogram") or []):
            hist.extend([0] * (k + 1 - len(hist)))
            hist[k] += int(c)
    per_req = [float(m["spec_accept_length"]) for m in metas if m.get("spec_accept_length") is not None]
    out.update(
        {
            "spec_verify_ct": verify,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "acceptance_length": completion / verify if verify else None,
            "acceptance_length_decode": (correct + verify) / verify if verify else None,
            "acceptance_length_mean_per_request": sum(per_req) / len(per_req) if per_req else None,
            "accept_rate": correct / proposed if proposed else None,
            "requests_without_verify": sum(1 for m in metas if not m.get("spec_verify_ct")),
            "correct_drafts_histogram": hist,
            # the histogram must account for every verify step and every accepted draft token
            "histogram_consistent": sum(hist) == verify and sum(k * c for k, c in enumerate(hist)) == correct,
            "per_position": per_position_acceptance(hist, spec.drafted_positions),
            # per prompt, so a comparison can resample prompts (bench/draft_comparison.py's interval)
            "per_request": [
                {
                    "id": r.get("id"),
                    "completion_tokens": int(m.get("completion_tokens", 0)),
                    "spec_verify_ct": int(m.get("spec_verify_ct", 0)),
                }
                for r, m in zip(responses, metas, strict=True)
            ],
        }
    )
    return out


# --------------------------------------------------------------------------------------------
# settings, server command, lifecycle
# --------------------------------------------------------------------------------------------
@dataclass
class BenchSettings:
    target: str
    draft: str
    configs: list[SpecConfig | DFlashConfig] = field(
        default_factory=lambda: [parse_spec_config(c) for c in DEFAULT_CONFIGS]
    )
    sets: list[str] = field(default_factory=lambda: list(BUILTIN_SETS))
    prompt_files: list[str] = field(default_factory=list)
    num_prompts: int | None = None
    max_new_tokens: int = 256
    concurrency: int = 1
    warmup: int = 2
    thinking: bool = True
    baseline: bool = True
    baseline_from: str | None = None
    tp: int = 1
    attention_backend: str = "triton"
    mem_fraction_static: float | None = None
    context_length: int | None = None
    disable_cuda_graph: bool = False
    disable_allreduce_fusion: bool = False
    extra_server_args: list[str] = field(default_factory=list)
    port: int | None = None
    start_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    tokenizer: str | None = None
    standin_tokenizer: bool = False
    check_draft: bool = True
    min_acceptance_length: float | None = None
    threshold_sets: list[str] | None = None
    out_dir: str = "runs/bench"

    def validate(self) -> None:
        for what, p in (("--target", self.target), ("--draft", self.draft)):
            if not (Path(p) / "config.json").is_file():
                raise KimiInputError(f"{what} {p}: no config.json there")
        if not self.configs:
            raise KimiInputError("no speculative config given")
        for c in self.configs:
            c.validate()
        self._check_algorithm()
        for name, v in (
            ("--max-new-tokens", self.max_new_tokens),
            ("--concurrency", self.concurrency),
            ("--tp", self.tp),
        ):
            if v < 1:
                raise KimiInputError(f"{name} must be >= 1, got {v}")
        if self.warmup < 0 or (self.num_prompts is not None and self.num_prompts < 1):
            raise KimiInputError("--warmup must be >= 0 and --num-prompts >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise KimiInputError("--mem-fraction-static must be in (0, 1)")
        if self.min_acceptance_length is not None and self.min_acceptance_length < 1:
            raise KimiInputError("--min-acceptance-length below 1 can never fail; drop it or raise it")
        if self.start_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise KimiInputError("timeouts must be positive")
        if self.baseline_from is not None and not self.baseline:
            raise KimiInputError("--baseline-from takes an earlier baseline, --no-baseline runs none: pick one")
        if self.baseline_from is not None and (
            baseline_reuse.result_path(self.baseline_from).parent.resolve() == Path(self.out_dir).resolve()
        ):
            raise KimiInputError(
                f"--baseline-from {self.baseline_from} is this bench's own --out, which it would overwrite: "
                "bench into another folder"
            )

    def _check_algorithm(self) -> None:
        """Each config's algorithm serves this draft; a DFLASH block size left open becomes the draft's."""
        from specforge_kimi.drafts.block_export import block_arch

        cfg = _read_json(Path(self.draft) / "config.json")
        block = block_arch(cfg) is not None
        for i, c in enumerate(self.configs):
            if (c.algorithm == "DFLASH") != block:
                raise KimiInputError(
                    f"speculative config {c.label}: the draft {self.draft} is {cfg.get('architectures')}, which "
                    f"SGLang serves with {'DFLASH' if block else 'EAGLE3'}"
                )
            if isinstance(c, DFlashConfig) and c.block_size is None:
                size = cfg.get("block_size") or (cfg.get("dflash_config") or {}).get("block_size")
                if not isinstance(size, int) or size < 2:
                    raise KimiInputError(f"{self.draft}/config.json names no block_size; pass --config DFLASH,B")
                self.configs[i] = DFlashConfig(size)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KimiInputError(f"cannot read {path}: {exc}") from None


def context_length(settings: BenchSettings, longest_prompt: int) -> int:
    """The server's ``--context-length``: SGLang hands the target's context to the draft and refuses
    to start if it exceeds the draft's ``max_position_embeddings`` (``configs/model_config.py``
    ``_derive_context_length``), so default to the smaller of the two; it must hold the longest
    prompt plus ``max_new_tokens``."""
    need = longest_prompt + settings.max_new_tokens + 8
    if settings.context_length is not None:
        ctx = settings.context_length
    else:
        tcfg = _read_json(Path(settings.target) / "config.json")
        text = tcfg.get("text_config") or tcfg
        dcfg = _read_json(Path(settings.draft) / "config.json")
        limits = [v for v in (text.get("max_position_embeddings"), dcfg.get("max_position_embeddings")) if v]
        ctx = min(limits) if limits else need
    if ctx < need:
        raise KimiInputError(
            f"context length {ctx} cannot hold the longest prompt ({longest_prompt} tokens) + "
            f"--max-new-tokens {settings.max_new_tokens}; lower --max-new-tokens or --num-prompts, or "
            "pass --context-length"
        )
    return ctx


def server_argv(
    settings: BenchSettings,
    spec: SpecConfig | DFlashConfig | None,
    *,
    port: int,
    context: int,
    python: str = sys.executable,
) -> list[str]:
    """The text-only SGLang server (``python -m specforge_kimi.capture_server``) without spec capture.

    The ``sglang_*`` knobs go through SpecForge's own ``ModelConfig`` -> ``_sglang_argv`` (as our
    capture server's argv does), which also adds ``--disable-radix-cache``: repeated prompts and the
    warm-up never hit a prefix cache. ``--mem-fraction-static`` is left to SGLang unless given.
    """
    from specforge.config import ModelConfig
    from specforge.launch_plan import _sglang_argv

    argv = [
        python,
        "-m",
        SERVER_MODULE,
        "--model-path",
        str(settings.target),
        "--skip-tokenizer-init",
        "--tp-size",
        str(settings.tp),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    model = ModelConfig(
        target_model_path=str(settings.target),
        sglang_attention_backend=settings.attention_backend,
        sglang_context_length=context,
    )
    argv += _sglang_argv(model, overrides={"sglang_mem_fraction_static": settings.mem_fraction_static})
    argv += ["--disable-cuda-graph"] if settings.disable_cuda_graph else cuda_graph_argv(settings.concurrency)
    if settings.disable_allreduce_fusion:
        argv.append("--enforce-disable-flashinfer-allreduce-fusion")
    if spec is not None:
        argv += ["--speculative-draft-model-path", str(settings.draft), *spec.argv()]
    return argv + list(settings.extra_server_args)


def cuda_graph_argv(concurrency: int) -> list[str]:
    """SGLang's CUDA graphs sized to the bench: decode graphs up to ``concurrency`` requests, no prefill graph.

    SGLang otherwise captures decode graphs for every batch size up to a maximum it picks from the GPU's memory
    (``server_args.py`` ``_handle_gpu_memory_settings``), each one a capture of the target and, with EAGLE-3, of
    the draft's decode and draft-extend steps: start-up time for batches the bench never forms (at most
    ``concurrency`` requests are in flight; a larger batch would run eagerly). The prefill graph (``tc_piecewise``,
    a torch.compile trace and a capture per token count) is off on both servers because SGLang runs an EAGLE
    target's prefill eagerly under that backend anyway (``ModelRunner.init_prefill_cuda_graph``): on only the
    baseline it would make the two servers' prefill differ. ``--server-arg`` comes after these and overrides them.
    """
    return ["--cuda-graph-max-bs-decode", str(concurrency), "--disable-prefill-cuda-graph"]


@contextmanager
def serving(
    label: str, argv: Sequence[str], *, port: int, log_path: Path, timeout_s: float, env: dict | None = None
) -> Iterator[float]:
    """Start a server, wait for ``/health``, yield the start-up seconds, always tear it down.

    SpecForge's supervisor pieces: ``_spawn_service`` (own session, log file), ``_wait_for_service``
    (HTTP readiness, fails early if the process exits) and ``_stop_services`` (SIGTERM to the
    process group, SIGKILL after the grace period).
    """
    from specforge.launch_plan import (
        CommandSpec,
        ReadinessSpec,
        ServiceSpec,
        _spawn_service,
        _stop_services,
        _wait_for_service,
    )

    from specforge_kimi.servers.capture_server import NVLS_OFF_ENV

    service = ServiceSpec(
        command=CommandSpec(label, tuple(argv), {**NVLS_OFF_ENV, **(env or {})}),
        readiness=ReadinessSpec("http", f"http://127.0.0.1:{port}/health", timeout_s),
        log_path=str(log_path),
        phase=1,
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if log_path.exists():
        log_path.unlink()
    t0 = time.monotonic()
    proc = _spawn_service(service, popen=subprocess.Popen)
    started = [(service, proc)]
    try:
        try:
            _wait_for_service(service, proc, started)
        except (RuntimeError, TimeoutError) as exc:
            tail = log_path.read_text(errors="replace").splitlines()[-15:] if log_path.exists() else []
            raise RuntimeError(f"{exc}\n--- last lines of {log_path} ---\n" + "\n".join(tail)) from None
        yield time.monotonic() - t0
    finally:
        _stop_services(started, grace_s=30.0)


def _http(url: str, payload: dict | None, timeout: float) -> Any:
    import urllib.error
    import urllib.request

    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST" if data is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        try:
            return json.loads(body)
        except json.JSONDecodeError:  # /flush_cache answers plain text
            return body.decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


def generate_payload(input_ids: Sequence[int], max_new_tokens: int) -> dict:
    """A greedy ``/generate`` request (``--skip-tokenizer-init``: ids in, ids out)."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": list(STOP_TOKEN_IDS),
        },
    }


def run_set(
    base_url: str, encoded: Sequence[tuple[str, list[int]]], settings: BenchSettings
) -> tuple[list[dict], float]:
    """All prompts of one set at ``settings.concurrency``; (responses in prompt order, wall seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item: tuple[str, list[int]]) -> dict:
        pid, ids = item
        r = _http(base_url + "/generate", generate_payload(ids, settings.max_new_tokens), settings.request_timeout_s)
        r = r[0] if isinstance(r, list) else r
        return {"id": pid, "output_ids": r.get("output_ids") or [], "meta_info": r.get("meta_info") or {}}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
        out = list(pool.map(one, encoded))
    return out, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------
def _tokenizer(settings: BenchSettings):
    from specforge_kimi.data.tokenizer import build_standin_tokenizer, load_tokenizer

    if settings.standin_tokenizer:
        return build_standin_tokenizer(), "stand-in (byte-level ids, K2.5 special ids)"
    path = Path(settings.tokenizer or settings.target)
    if not (path / "tokenizer_config.json").is_file():
        raise KimiInputError(
            f"{path} has no tokenizer files; pass --tokenizer DIR, or --standin-tokenizer for a "
            "tiny target trained on stand-in ids"
        )
    return load_tokenizer(path), str(path)


def _draft_info(settings: BenchSettings) -> dict:
    from specforge_kimi.drafts.block_export import block_arch, check_dflash_export

    cfg = _read_json(Path(settings.draft) / "config.json")
    info = {
        "path": str(Path(settings.draft).resolve()),
        "architectures": cfg.get("architectures"),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "eagle_aux_hidden_state_layer_ids": (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
    }
    if block_arch(cfg) is not None:
        info["block_size"] = cfg.get("block_size")
        info["dflash_config"] = cfg.get("dflash_config")
        if settings.check_draft:
            info["export_check"] = check_dflash_export(settings.draft, settings.target)
    if settings.check_draft and cfg.get("architectures") == ["LlamaForCausalLMEagle3"]:
        from specforge_kimi.drafts.export import check_sglang_export

        info["export_check"] = check_sglang_export(settings.draft, target_dir=settings.target)
    prov = Path(settings.draft) / "provenance.json"
    if prov.is_file():
        info["provenance"] = {
            k: v for k, v in _read_json(prov).items() if k in ("command", "config_sha256", "specforge_kimi_git_commit")
        }
    return info


def _target_info(settings: BenchSettings) -> dict:
    from specforge_kimi.provenance import canonical_hash

    cfg = _read_json(Path(settings.target) / "config.json")
    info: dict[str, Any] = {
        "path": str(Path(settings.target).resolve()),
        "config_sha256": canonical_hash(cfg),
        "tiny_spec": cfg.get("specforge_kimi_tiny"),
    }
    pre = Path(settings.target) / "pretrain.json"
    if pre.is_file():
        p = _read_json(pre)
        info["pretrain"] = {
            "corpus": p.get("corpus"),
            "heldout": p.get("heldout"),
            "train": {k: v for k, v in (p.get("train") or {}).items() if k != "losses"},
        }
    return info


def _output_match(base: dict[str, list[dict]], spec: dict[str, list[dict]]) -> dict:
    """Greedy outputs with and without speculation, prompt by prompt (same ids = same text)."""
    res = {}
    for name, rows in spec.items():
        ref = {r["id"]: r["output_ids"] for r in base.get(name, [])}
        same = [r["id"] for r in rows if ref.get(r["id"]) == r["output_ids"]]
        differ = [r["id"] for r in rows if r["id"] in ref and ref[r["id"]] != r["output_ids"]]
        res[name] = {"identical": len(same), "different": len(differ), "first_different": differ[:3]}
    return res


def _launched_argv(
    settings: BenchSettings,
    spec: SpecConfig | DFlashConfig | None,
    *,
    port: int,
    context: int,
    launcher: Sequence[str] | None,
) -> list[str]:
    """The command a server of ``spec`` (None: the baseline) is started with, as its run records it."""
    argv = server_argv(settings, spec, port=port, context=context)
    if launcher is not None:  # tests: a stand-in process at the same boundary (same SGLang args)
        argv = [*launcher, *argv[3:]]
    return argv


def _serve_and_measure(
    label: str,
    settings: BenchSettings,
    spec: SpecConfig | DFlashConfig | None,
    encoded: dict,
    warm: list,
    *,
    context: int,
    out: Path,
    launcher: Sequence[str] | None,
) -> tuple[dict, dict]:
    from specforge_kimi.run.services import free_ports

    port = settings.port or free_ports(1)[0]
    argv = _launched_argv(settings, spec, port=port, context=context, launcher=launcher)
    base = f"http://127.0.0.1:{port}"
    print(f"[bench] starting {label} server (port {port}); log {out / 'logs' / (label + '.log')}", flush=True)
    with serving(
        label, argv, port=port, log_path=out / "logs" / f"{label}.log", timeout_s=settings.start_timeout_s
    ) as startup:
        if warm:
            run_set(base, warm, settings)
        try:
            _http(base + "/flush_cache", None, 60)
        except (OSError, RuntimeError):
            pass
        sets, rows = {}, {}
        for name, items in encoded.items():
            responses, wall = run_set(base, items, settings)
            rows[name] = responses
            sets[name] = summarize(responses, wall_s=wall, spec=spec)
            al = sets[name].get("acceptance_length")
            print(
                f"[bench] {label} {name}: {sets[name]['output_tok_per_s']:.1f} tok/s"
                + (f", acceptance length {al:.3f}" if al is not None else ""),
                flush=True,
            )
        server_al = None
        if spec is not None:
            try:
                info = _http(base + "/server_info", None, 60)
                states = info.get("internal_states") or [{}]
                server_al = states[0].get("avg_spec_accept_length")
            except (OSError, RuntimeError):
                pass
    all_rows = [r for rs in rows.values() for r in rs]
    overall = summarize(all_rows, wall_s=sum(s["wall_s"] for s in sets.values()), spec=spec)
    overall.pop("per_request", None)  # per set only: a prompt id may repeat across sets
    run = {"label": label, "server_argv": argv, "startup_s": round(startup, 2), "sets": sets, "overall": overall}
    if spec is not None:
        run["config"] = spec.config_dict()
        run["algorithm"] = spec.algorithm
        run["block_size"] = spec.block_size
        run["server_info_avg_spec_accept_length"] = server_al
    return run, rows


def _prompt_sets_info(sets: Sequence[PromptSet], encoded: dict) -> dict:
    return {
        ps.name: {
            "source": ps.source,
            "prompts": len(ps.prompts),
            "prompt_tokens_mean": sum(len(i) for _, i in encoded[ps.name]) / len(ps.prompts),
        }
        for ps in sets
    }


def _recorded(settings: BenchSettings, sets: Sequence[PromptSet], encoded: dict) -> dict:
    """What the result records of the machine, stack, target and prompts, read once: a taken baseline is checked
    against exactly this."""
    from specforge_kimi.provenance import versions

    return {
        "devices": _devices(),
        "versions": versions(),
        "target": _target_info(settings),
        "prompt_sets": _prompt_sets_info(sets, encoded),
    }


def _reused_baseline(settings: BenchSettings, recorded: dict, context: int, launcher: Sequence[str] | None) -> tuple:
    """``--baseline-from``'s baseline, checked like for like against this bench (:mod:`.baseline_reuse`):
    ``recorded`` holds the devices, versions, target and prompt sets this bench's result will record."""
    s = asdict(settings)
    argv = _launched_argv(settings, None, port=0, context=context, launcher=launcher)
    expected = {
        "schema_version": SCHEMA_VERSION,
        **{k: recorded[k] for k in ("devices", "versions", "target", "prompt_sets")},
        "context_length": context,
        "settings": {k: s[k] for k in baseline_reuse.BASELINE_SETTINGS},
        "server_argv": argv,
    }
    return baseline_reuse.load(settings.baseline_from, expected=expected)


def _baseline(
    settings: BenchSettings,
    reused: tuple | None,
    encoded: dict,
    warm: list,
    *,
    context: int,
    out: Path,
    launcher: Sequence[str] | None,
) -> tuple[dict | None, dict]:
    """The baseline run and its rows: taken (``reused``), served, or none; its greedy outputs written beside the
    result so a later bench can take it with them."""
    baseline, base_rows = (None, {})
    if reused is not None:
        baseline, base_rows, source = reused
        baseline = {**baseline, "reused_from": source}  # source names the one it took in turn, if any
    elif settings.baseline:
        baseline, base_rows = _serve_and_measure(
            "baseline", settings, None, encoded, warm, context=context, out=out, launcher=launcher
        )
    if base_rows:
        write_atomic(out / baseline_reuse.OUTPUTS_FILE, json.dumps(baseline_reuse.outputs_doc(base_rows)))
    else:  # an earlier bench's outputs in this folder must not pass for this baseline's
        (out / baseline_reuse.OUTPUTS_FILE).unlink(missing_ok=True)
    return baseline, base_rows


def check_threshold(result: dict, minimum: float | None) -> dict | None:
    """The first config's acceptance length over ``threshold_sets`` against ``minimum``."""
    if minimum is None:
        return None
    run = result["speculative"][0]
    names = result["settings"]["threshold_sets"] or list(run["sets"])
    rows = [run["sets"][n] for n in names if n in run["sets"]]
    verify = sum(r.get("spec_verify_ct") or 0 for r in rows)
    al = sum(r["completion_tokens"] for r in rows) / verify if verify else None
    passed = al is not None and al >= minimum
    return {
        "min_acceptance_length": minimum,
        "config": run["config"],
        "sets": names,
        "acceptance_length": al,
        "passed": passed,
    }


def run_bench(settings: BenchSettings, *, launcher: Sequence[str] | None = None) -> dict:
    """Run the whole bench; writes ``bench_result.json`` and ``acceptance.png`` under ``out_dir``."""
    import platform
    import signal
    import threading

    from specforge_kimi.provenance import git_commit

    settings.validate()
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, tok_source = _tokenizer(settings)
    sets = load_prompt_sets(settings.sets, settings.prompt_files, settings.num_prompts)
    unknown = set(settings.threshold_sets or ()) - {s.name for s in sets}
    if unknown:
        raise KimiInputError(f"--threshold-sets {sorted(unknown)} are not among the measured sets")
    draft = _draft_info(settings)
    encoded = {
        ps.name: [(p.id, encode_prompt(p, tokenizer, thinking=settings.thinking)) for p in ps.prompts] for ps in sets
    }
    longest = max(len(ids) for items in encoded.values() for _, ids in items)
    context = context_length(settings, longest)
    first = next(iter(encoded.values()))
    warm = [(f"warmup-{i}", first[i % len(first)][1]) for i in range(settings.warmup)]

    recorded = _recorded(settings, sets, encoded)
    reused = None
    if settings.baseline_from is not None:  # checked before any server starts
        reused = _reused_baseline(settings, recorded, context, launcher)

    previous = None
    if threading.current_thread() is threading.main_thread():

        def _term(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, _term)  # SIGTERM tears the servers down like Ctrl-C
    t0 = time.monotonic()
    try:
        baseline, base_rows = _baseline(settings, reused, encoded, warm, context=context, out=out, launcher=launcher)
        runs = []
        for spec in settings.configs:
            label = spec.run_label
            run, rows = _serve_and_measure(
                label, settings, spec, encoded, warm, context=context, out=out, launcher=launcher
            )
            if baseline is not None:
                run["speedup"] = {
                    n: (
                        s["output_tok_per_s"] / baseline["sets"][n]["output_tok_per_s"]
                        if baseline["sets"][n]["output_tok_per_s"]
                        else None
                    )
                    for n, s in run["sets"].items()
                }
                b_all = baseline["overall"]["output_tok_per_s"]
                run["speedup"]["overall"] = run["overall"]["output_tok_per_s"] / b_all if b_all else None
                run["output_match"] = _output_match(base_rows, rows) if base_rows else None
            runs.append(run)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    s = asdict(settings)
    s["configs"] = [{**c.config_dict(), "algorithm": c.algorithm, "block_size": c.block_size} for c in settings.configs]
    result = {
        "benchmark": "acceptance",
        "schema_version": SCHEMA_VERSION,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": sys.argv,
        "environment": {
            "platform": platform.platform(),
            "devices": recorded["devices"],
            "versions": recorded["versions"],
            "specforge_kimi_git_commit": git_commit(),
        },
        "target": recorded["target"],
        "draft": draft,
        "tokenizer": tok_source,
        "settings": s,
        "context_length": context,
        "prompt_sets": recorded["prompt_sets"],
        "baseline": baseline,
        "speculative": runs,
        "wall_s": round(time.monotonic() - t0, 2),
        "metric_definitions": METRIC_DEFINITIONS,
    }
    result["threshold"] = check_threshold(result, settings.min_acceptance_length)
    result["png"] = str(out / "acceptance.png")
    write_atomic(out / "bench_result.json", json.dumps(result, indent=2))
    plot_result(result, out / "acceptance.png")
    return result


METRIC_DEFINITIONS = {
    "acceptance_length": "sum(meta_info.completion_tokens) / sum(meta_info.spec_verify_ct) (SGLang's "
    "spec_accept_length formula, token-weighted over the set; counts the prefill token)",
    "acceptance_length_decode": "(sum spec_num_correct_drafts + sum spec_verify_ct) / sum spec_verify_ct: tokens per "
    "verify step (= /server_info avg_spec_accept_length's definition)",
    "acceptance_length_mean_per_request": "mean of meta_info.spec_accept_length (SpecForge benchmarks/sglang.py)",
    "accept_rate": "sum spec_num_correct_drafts / sum spec_num_proposed_drafts (draft tokens - 1 per verify)",
    "per_position.at_least[j-1]": "share of verify steps that accepted the j-th drafted token, from "
    "meta_info.spec_correct_drafts_histogram",
    "per_position.conditional[j-1]": "at_least[j-1] / at_least[j-2]: acceptance of position j given j-1",
    "per_request": "each prompt's completion_tokens and spec_verify_ct (meta_info), by prompt id",
    "output_tok_per_s": "completion tokens / wall seconds of the set at the given concurrency",
    "speedup": "output_tok_per_s with speculation / without, same prompts, same server flags otherwise",
}


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------
def plot_result(result: dict, path: Path) -> None:
    """Acceptance length per set and config, per-position acceptance, throughput vs baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["speculative"]
    names = list(runs[0]["sets"]) if runs else []
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        vals = [run["sets"][n].get("acceptance_length") or 0 for n in names]
        ax[0].bar([x + i * width for x in range(len(names))], vals, width, label=_label(run))
        pos = run["overall"].get("per_position", {}).get("at_least") or []
        ax[1].plot(range(1, len(pos) + 1), pos, marker="o", color=f"C{i}", label=f"{_label(run)}: j accepted")
        cond = run["overall"].get("per_position", {}).get("conditional") or []
        ax[1].plot(
            range(1, len(cond) + 1),
            cond,
            ls="--",
            marker=".",
            color=f"C{i}",
            label=f"{_label(run)}: j accepted given j-1",
        )
    ax[0].axhline(1.0, color="grey", lw=0.8)
    ax[0].set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(names))], names)
    ax[0].set(ylabel="acceptance length", title="acceptance length (completion / verify)")
    ax[0].legend(fontsize=7)
    ax[1].set(xlabel="draft position j", ylabel="acceptance", ylim=(0, 1.05), title="per draft position (all sets)")
    ax[1].legend(fontsize=6)
    bars = ([("no spec", result["baseline"])] if result.get("baseline") else []) + [(_label(r), r) for r in runs]
    w = 0.8 / max(1, len(bars))
    for i, (lab, run) in enumerate(bars):
        ax[2].bar(
            [x + i * w for x in range(len(names))],
            [run["sets"].get(n, {}).get("output_tok_per_s") or 0 for n in names],
            w,
            label=lab,
        )
    ax[2].set_xticks([x + w * (len(bars) - 1) / 2 for x in range(len(names))], names)
    ax[2].set(ylabel="output tok/s", title=f"throughput, concurrency {result['settings']['concurrency']}")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(run: dict) -> str:
    c = run["config"]
    if run.get("algorithm") == "DFLASH":
        return f"DFLASH block {c['draft_tokens']}"
    return f"EAGLE3 {c['steps']}/{c['topk']}/{c['draft_tokens']}"


# --------------------------------------------------------------------------------------------
# recipes
# --------------------------------------------------------------------------------------------
def recipe_settings(recipe, draft_dir: str | os.PathLike, *, out_dir: str | None = None) -> BenchSettings:
    """Bench settings for a recipe's draft: its target, server flags and ``bench:`` section (CUDA graphs per
    ``bench.cuda_graph``, not the capture server's ``server.disable_cuda_graph``).

    One node, TP = GPUs per node (serving alone needs no co-located trainer room). Prompt sets:
    ``structured`` for a tiny target (it only learned the synthetic corpus), else chat, math, code.
    """
    cfg = _read_json(Path(recipe.target.path) / "config.json")
    tiny = "specforge_kimi_tiny" in cfg
    b, srv = recipe.bench, recipe.server
    if getattr(b, "algorithm", "EAGLE3") == "DFLASH":
        spec: SpecConfig | DFlashConfig = DFlashConfig(getattr(b, "block_size", None)).validate()
    else:
        spec = SpecConfig(b.steps, b.topk, b.draft_tokens).validate()
    return BenchSettings(
        target=recipe.target.path,
        draft=str(draft_dir),
        configs=[spec],
        sets=["structured"] if tiny else ["chat", "math", "code"],
        tp=recipe.gpus.per_node,
        attention_backend=srv.attention_backend,
        mem_fraction_static=srv.mem_fraction_static,
        disable_cuda_graph=not b.cuda_graph,
        disable_allreduce_fusion=not srv.allreduce_fusion,
        extra_server_args=list(srv.extra_args),
        port=srv.port,
        standin_tokenizer=tiny and not (Path(recipe.target.path) / "tokenizer_config.json").is_file(),
        min_acceptance_length=b.min_acceptance_length,
        out_dir=out_dir or str(Path(recipe.output_dir) / "bench"),
    )


def run_recipe_bench(recipe, draft_dir: str | os.PathLike, *, out_dir: str | None = None) -> dict:
    """Bench ``draft_dir`` as ``recipe`` states; the result's ``threshold.passed`` says pass/fail.

    Call it after training and export (e.g. at the end of ``launch.run`` once the plan returned 0)
    and exit non-zero when ``result["threshold"]["passed"]`` is false.
    """
    return run_bench(recipe_settings(recipe, draft_dir, out_dir=out_dir))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--target", help="target checkpoint directory")
    p.add_argument("--draft", required=True, help="exported SGLang draft directory")
    p.add_argument(
        "--recipe",
        help="take target, tokenizer, server flags, config and threshold from a recipe; the flags about how to "
        "run the measurement still apply (sets, prompts, tokens, concurrency, warmup, thinking, baseline, context "
        "length, CUDA graphs, --server-arg after the recipe's extra args, port, timeouts, draft check, --out), "
        "a flag the recipe sets is refused; exits 1 below its bench.min_acceptance_length",
    )
    p.add_argument(
        "--config",
        action="append",
        metavar="STEPS,TOPK,DRAFT_TOKENS|DFLASH[,B]",
        help="speculative config, repeatable: EAGLE-3 steps,topk,draft tokens, or DFLASH,B for a block draft "
        f"(block size B; DFLASH alone: the draft's) (default: {' and '.join(DEFAULT_CONFIGS)}; a DFlash draft: DFLASH)",
    )
    p.add_argument(
        "--sets",
        default=None,
        help=f"built-in prompt sets, comma-separated ({', '.join(BUILTIN_SETS)}); '' for none "
        "(default: all; with --recipe: structured for a tiny target, else chat, math, code)",
    )
    p.add_argument("--prompts-file", action="append", default=[], help="extra JSONL prompt set (name = file stem)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each set")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight per server")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per server before measuring")
    p.add_argument("--no-thinking", action="store_true", help="generation prompt <think></think> (instant mode)")
    p.add_argument("--no-baseline", action="store_true", help="skip the server without speculation (no speedup)")
    p.add_argument(
        "--baseline-from",
        default=None,
        metavar="DIR|JSON",
        help="take the baseline of an earlier bench (its --out folder or bench_result.json) instead of serving "
        "the target without speculation again: refused in one line unless the card, stack, target, prompts, "
        "context and baseline server flags are the same",
    )
    p.add_argument("--tp", type=int, default=1, help="SGLang --tp-size of both servers")
    p.add_argument("--attention-backend", default="triton", help="SGLang --attention-backend")
    p.add_argument(
        "--mem-fraction-static", type=float, default=None, help="SGLang --mem-fraction-static (default: SGLang's own)"
    )
    p.add_argument(
        "--context-length", type=int, default=None, help="default: min(target, draft max_position_embeddings)"
    )
    p.add_argument(
        "--disable-cuda-graph", action="store_true", help="SGLang --disable-cuda-graph (faster start, slower decode)"
    )
    p.add_argument(
        "--disable-allreduce-fusion",
        action="store_true",
        help="SGLang --enforce-disable-flashinfer-allreduce-fusion (TP > 1)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra SGLang server argument (repeatable; use --server-arg=--flag)",
    )
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to become healthy")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's)")
    p.add_argument("--standin-tokenizer", action="store_true", help="stand-in tokenizer (tiny targets)")
    p.add_argument(
        "--skip-draft-check", action="store_true", help="do not run export-check on a Llama-style or DFlash draft"
    )
    p.add_argument(
        "--min-acceptance-length",
        type=float,
        default=None,
        help="exit 1 when the first config's acceptance length over --threshold-sets is below this",
    )
    p.add_argument("--threshold-sets", default=None, help="sets the threshold applies to (default: all measured)")
    p.add_argument(
        "--out",
        default=None,
        help="output directory: bench_result.json, acceptance.png, logs/ "
        "(default runs/bench; with --recipe OUTPUT_DIR/bench)",
    )


def _default_configs(draft: str) -> tuple[str, ...]:
    """EAGLE-3's 3/1/4 and 7/1/8, or DFLASH at the draft's own block size for a block draft."""
    from specforge_kimi.drafts.block_export import block_arch

    cfg_path = Path(draft) / "config.json"
    block = cfg_path.is_file() and block_arch(_read_json(cfg_path)) is not None
    return ("DFLASH",) if block else DEFAULT_CONFIGS


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _same(value: Any) -> Any:
    return value


#: How each flag (argparse dest) lands in :class:`BenchSettings`: (field, value from the flag's value).
#: ``--target``, ``--draft``, ``--config`` and ``--recipe`` are resolved on their own.
FLAG_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "sets": ("sets", lambda v: list(BUILTIN_SETS) if v is None else _names(v)),
    "prompts_file": ("prompt_files", list),
    "num_prompts": ("num_prompts", _same),
    "max_new_tokens": ("max_new_tokens", _same),
    "concurrency": ("concurrency", _same),
    "warmup": ("warmup", _same),
    "no_thinking": ("thinking", operator.not_),
    "no_baseline": ("baseline", operator.not_),
    "baseline_from": ("baseline_from", _same),
    "tp": ("tp", _same),
    "attention_backend": ("attention_backend", _same),
    "mem_fraction_static": ("mem_fraction_static", _same),
    "context_length": ("context_length", _same),
    "disable_cuda_graph": ("disable_cuda_graph", _same),
    "disable_allreduce_fusion": ("disable_allreduce_fusion", _same),
    "server_arg": ("extra_server_args", list),
    "port": ("port", _same),
    "start_timeout": ("start_timeout_s", _same),
    "request_timeout": ("request_timeout_s", _same),
    "tokenizer": ("tokenizer", _same),
    "standin_tokenizer": ("standin_tokenizer", _same),
    "skip_draft_check": ("check_draft", operator.not_),
    "min_acceptance_length": ("min_acceptance_length", _same),
    "threshold_sets": ("threshold_sets", lambda v: _names(v) if v else None),
    "out": ("out_dir", lambda v: v or "runs/bench"),
}

#: Beside ``--recipe``: the flags about how to run the measurement, which override the recipe's
#: settings (``--server-arg`` goes after the recipe's ``server.extra_args``; ``--sets`` replaces
#: the recipe target's sets).
RECIPE_RUN_FLAGS = (
    "sets",
    "prompts_file",
    "num_prompts",
    "max_new_tokens",
    "concurrency",
    "warmup",
    "no_thinking",
    "no_baseline",
    "baseline_from",
    "context_length",
    "disable_cuda_graph",
    "server_arg",
    "port",
    "start_timeout",
    "request_timeout",
    "skip_draft_check",
    "out",
)

_TOKENIZER = "target section sets the tokenizer (the target's own; a stand-in for a tiny target without one)"
_THRESHOLD = "bench section sets the threshold (bench.min_acceptance_length, over every measured set)"
#: Beside ``--recipe``: the flags the recipe fixes, refused; each with the recipe section that sets it.
RECIPE_FIXED_FLAGS = {
    "target": "target section sets the target checkpoint (target.path)",
    "config": "bench section sets the speculative config (bench.algorithm, steps, topk, draft_tokens, block_size)",
    "tp": "gpus section sets the TP size (gpus.per_node)",
    "attention_backend": "server section sets the attention backend (server.attention_backend)",
    "mem_fraction_static": "server section sets the static memory fraction (server.mem_fraction_static)",
    "disable_allreduce_fusion": "server section sets allreduce fusion (server.allreduce_fusion)",
    "tokenizer": _TOKENIZER,
    "standin_tokenizer": _TOKENIZER,
    "min_acceptance_length": _THRESHOLD,
    "threshold_sets": _THRESHOLD,
}


def _given_beside_recipe(args: argparse.Namespace) -> list[str]:
    """The run and fixed flags whose value differs from the parser's default. argparse keeps no record of
    what was typed, so a flag typed with its default value counts as not given: for a run flag that is the
    value the recipe's bench gets anyway (``--sets``, ``--port``, ``--server-arg`` and ``--out``, which the
    recipe sets otherwise, default to what no typed value equals); a fixed flag typed with its default value
    (e.g. ``--tp 1``) is not refused, and the recipe's value holds."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return [d for d in (*RECIPE_RUN_FLAGS, *RECIPE_FIXED_FLAGS) if getattr(args, d) != parser.get_default(d)]


def _refuse_fixed_flags(given: Sequence[str]) -> None:
    fixed = [d for d in given if d in RECIPE_FIXED_FLAGS]
    if not fixed:
        return
    flags = ", ".join("--" + d.replace("_", "-") for d in fixed)
    why = "; ".join(dict.fromkeys(f"the recipe's {RECIPE_FIXED_FLAGS[d]}" for d in fixed))
    raise KimiInputError(f"{flags} {'does' if len(fixed) == 1 else 'do'} not apply with --recipe: {why}")


def recipe_settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """``--recipe``'s settings with the run flags given beside it; a flag the recipe fixes is refused."""
    from specforge_kimi.plan.run_plan import load_recipe

    given = _given_beside_recipe(args)
    _refuse_fixed_flags(given)
    s = recipe_settings(load_recipe(args.recipe), args.draft)
    recipe_extra_args = list(s.extra_server_args)
    for dest in given:
        name, value = FLAG_FIELDS[dest]
        setattr(s, name, value(getattr(args, dest)))
    s.extra_server_args = recipe_extra_args + list(args.server_arg)  # after the recipe's, not instead
    return s


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    if args.recipe:
        return recipe_settings_from_args(args)
    if not args.target:
        raise KimiInputError("pass --target DIR (or --recipe)")
    fields = {name: value(getattr(args, dest)) for dest, (name, value) in FLAG_FIELDS.items()}
    configs = [parse_spec_config(c) for c in (args.config or _default_configs(args.draft))]
    return BenchSettings(target=args.target, draft=args.draft, configs=configs, **fields)


def run(args: argparse.Namespace) -> int:
    result = run_bench(settings_from_args(args))
    for r in result["speculative"]:
        o = r["overall"]
        speed = (r.get("speedup") or {}).get("overall")
        print(
            f"{_label(r)}: acceptance length {o['acceptance_length'] or 0:.3f} "
            f"(decode {o['acceptance_length_decode'] or 0:.3f}), {o['output_tok_per_s']:.1f} tok/s"
            + (f", speedup {speed:.2f}x" if speed else "")
        )
    print(f"results: {Path(result['png']).parent / 'bench_result.json'}; plot {result['png']}")
    th = result["threshold"]
    if th is not None and not th["passed"]:
        print(
            f"FAIL: acceptance length {th['acceptance_length']} < {th['min_acceptance_length']} "
            f"(config {th['config']}, sets {th['sets']})",
            file=sys.stderr,
        )
        return 1
    return 0


__all__ = [
    "BenchSettings",
    "SpecConfig",
    "DFlashConfig",
    "PromptSet",
    "Prompt",
    "parse_spec_config",
    "load_prompt_file",
    "load_prompt_sets",
    "builtin_prompt_set",
    "structured_prompt_set",
    "encode_prompt",
    "summarize",
    "per_position_acceptance",
    "server_argv",
    "cuda_graph_argv",
    "serving",
    "run_bench",
    "recipe_settings",
    "recipe_settings_from_args",
    "run_recipe_bench",
    "check_threshold",
    "plot_result",
    "add_arguments",
    "run",
]
