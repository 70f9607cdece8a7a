"""``specforge-kimi prepare``: conversations -> SpecForge pre-tokenized prompts + vocab mapping.

Reads a JSONL of conversations (OpenAI messages or ShareGPT, see
:mod:`specforge_kimi.data.conversation`), renders each one with the ``kimi-k2.5`` template into
training rows (:mod:`specforge_kimi.data.chat_template`), tokenizes them with K2.5's tokenizer and
writes, into ``--out DIR``:

- ``prompts.jsonl``: one ``{"input_ids": [...], "loss_mask": [...]}`` per line, SpecForge's
  pre-tokenized format for ``data.prompts_path`` (its fast path reads exactly these two keys);
- ``vocab_mapping.pt`` (+ ``vocab_mapping.json`` provenance): ``d2t``/``t2d`` for
  ``model.vocab_mapping_path``, from the frequency of loss-masked tokens, always covering the
  special tokens K2.5 emits (:mod:`specforge_kimi.data.vocab_mapping`);
- ``summary.json``: rows, tokens, trained-token fraction, drops by reason, per-line errors,
  options, input hash, versions, and (under ``"run"``) time and peak RSS.

Streaming: one input line at a time; memory is the token counter (bounded by the vocab size)
plus, with shuffling, one shuffle bucket (the output split into <= 256 buckets of ~32 MiB), so
it does not grow with the input until the output passes 256 x 32 MiB.

Deterministic: the same input, options and ``--seed`` give byte-identical ``prompts.jsonl`` and
``vocab_mapping.pt`` (``--seed`` orders the shuffle; ``--no-shuffle`` keeps input order).

Atomic and crash-safe: everything is written into a hidden sibling staging directory
(``.DIR.partial-PID-RANDOM``), fsynced, and renamed to ``DIR`` only after the last file is complete,
so a failed run leaves no ``DIR``. ``--overwrite`` moves the old ``DIR`` to ``.DIR.previous`` for
the instant between the two renames (:mod:`specforge_kimi.durable`); the next run moves it back
if a kill came in between, and deletes staging directories of processes that are gone. An ``--out``
that is a symbolic link is refused with one line naming where it points (pass that path itself): the
link is never replaced by a directory of ours, nor is its target emptied.

Line size cap: a line longer than ``--max-line-bytes`` (default: the larger of 1 MiB and 64 bytes per
token of ``--max-length``) is neither parsed nor tokenized: it is read in bounded chunks, hashed, and
skipped as a line error naming its size (fatal with ``--on-error fail``), counted under
``dropped.line_too_large``. 64 bytes is more than JSON text takes for one token, ``\\u`` escapes and
markup included, so a line under the cap still fills a ``--max-length`` row, and one over it holds more
than a row keeps after truncation; memory stays bounded by the cap.

Dropped rows are counted by reason: ``media`` (image/video parts: text-only training drops the
conversation, see docs/data.md), ``no_assistant_turn``, ``too_long`` (``--overflow drop``),
``truncated_before_answer`` (``--overflow truncate`` cut every trained token),
``no_trained_tokens`` (e.g. instant-mode turns that all carry reasoning), ``line_too_large`` (over
the line size cap). Malformed lines are errors
with their line number: skipped and counted (``--on-error skip``) or fatal (``fail``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from specforge_kimi.data.tokenizer import TextTokenizer
from specforge_kimi.durable import recover_dir, refuse_link, staged_dir
from specforge_kimi.errors import KimiInputError

__all__ = [
    "PROMPTS_FILE",
    "SUMMARY_FILE",
    "VOCAB_MAPPING_FILE",
    "PrepareOptions",
    "add_arguments",
    "prepare",
    "run",
]

PROMPTS_FILE = "prompts.jsonl"
VOCAB_MAPPING_FILE = "vocab_mapping.pt"
SUMMARY_FILE = "summary.json"
_UNSHUFFLED_FILE = "prompts.unshuffled.jsonl"
_SHUFFLE_BUCKET_BYTES = 32 * 1024 * 1024
_MAX_SHUFFLE_BUCKETS = 256
_MAX_REPORTED_ERRORS = 100
#: the default line size cap: bytes per token of --max-length, and a floor for short --max-length
LINE_BYTES_PER_TOKEN = 64
MIN_LINE_BYTES = 1 << 20
_SKIP_CHUNK_BYTES = 1 << 20  # the rest of an over-long line is read (and hashed) this much at a time
#: maybe a lone surrogate, checked on the record: a ``\uD8xx`` escape, or its UTF-8-like bytes (json.loads
#: decodes bytes with ``surrogatepass``)
_LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_DESCRIPTION = (
    "Conversations JSONL -> SpecForge pre-tokenized prompts (input_ids, loss_mask) "
    "+ draft vocab mapping, for Kimi-K2.5."
)


@dataclass(frozen=True)
class PrepareOptions:
    """Everything ``prepare`` needs besides the tokenizer (the CLI flags, typed)."""

    input_path: Path
    out_dir: Path
    max_length: int = 8192
    overflow: Literal["truncate", "drop"] = "truncate"
    on_error: Literal["skip", "fail"] = "skip"
    thinking: Literal["auto", "on", "off"] = "auto"
    one_row_per_answer: bool = False
    draft_vocab_size: int = 32000
    shuffle: bool = True
    seed: int = 42
    overwrite: bool = False
    progress: bool = False
    max_line_bytes: int | None = None  # None: max(MIN_LINE_BYTES, LINE_BYTES_PER_TOKEN * max_length)

    @property
    def line_byte_cap(self) -> int:
        """Lines longer than this many bytes are skipped unread (see the module docstring)."""
        if self.max_line_bytes is not None:
            return self.max_line_bytes
        return max(MIN_LINE_BYTES, LINE_BYTES_PER_TOKEN * self.max_length)


@dataclass
class _Stats:
    input_lines: int = 0
    blank_lines: int = 0
    conversations: int = 0
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    truncated_rows: int = 0
    dropped: Counter = field(default_factory=Counter)
    error_count: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)

    def error(self, line: int, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < _MAX_REPORTED_ERRORS:
            self.errors.append({"line": line, "error": message})


def prepare(options: PrepareOptions, tokenizer: TextTokenizer, *, tokenizer_source: str = "") -> dict[str, Any]:
    """Run the whole preparation; returns the summary (also written to ``summary.json``)."""
    started = time.monotonic()
    _check_options(options)
    out_dir = options.out_dir
    refuse_link(out_dir, "--out")
    _recover_out_dir(out_dir)
    _check_out_dir(out_dir, overwrite=options.overwrite)
    _check_input_outside(options.input_path, out_dir)
    with staged_dir(out_dir) as staging:
        summary = _prepare_into(staging, options, tokenizer, tokenizer_source, started)
    return summary


def _prepare_into(
    staging: Path, options: PrepareOptions, tokenizer: TextTokenizer, tokenizer_source: str, started: float
) -> dict[str, Any]:
    """Write every output file into ``staging``; returns the summary."""
    stats = _Stats()
    counts: Counter = Counter()
    unshuffled = staging / _UNSHUFFLED_FILE
    input_sha256 = _tokenize_file(options, tokenizer, unshuffled, stats, counts)
    if stats.input_lines - stats.blank_lines <= 0:
        raise KimiInputError(f"{options.input_path} is empty (no JSONL lines)")
    if stats.rows == 0:
        raise KimiInputError(
            f"{options.input_path}: no training rows survived "
            f"(errors: {stats.error_count}, dropped: {dict(stats.dropped) or 'none'})"
        )
    prompts = staging / PROMPTS_FILE
    if options.shuffle:
        _shuffle_lines(unshuffled, prompts, seed=options.seed, work_dir=staging)
        unshuffled.unlink()
    else:
        os.replace(unshuffled, prompts)
    # Peak of the streaming part alone; importing torch for the mapping file adds a constant.
    streaming_peak_rss = _peak_rss_mib()

    from specforge_kimi.data.vocab_mapping import build_vocab_mapping, save_vocab_mapping

    mapping = build_vocab_mapping(
        counts,
        draft_vocab_size=options.draft_vocab_size,
        source={"prompts": PROMPTS_FILE, "input_sha256": input_sha256},
    )
    save_vocab_mapping(mapping, staging / VOCAB_MAPPING_FILE)

    summary = _summary(options, stats, mapping.meta, input_sha256, tokenizer_source)
    summary["run"] = {
        "elapsed_s": round(time.monotonic() - started, 3),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "peak_rss_mib_before_vocab_mapping": round(streaming_peak_rss, 1),
        "command": " ".join(sys.argv),
    }
    (staging / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def run(args: argparse.Namespace) -> int:
    """Run ``prepare`` from parsed arguments; KimiInputError is reported by the CLI (exit 2)."""
    from specforge_kimi.data.tokenizer import build_standin_tokenizer, load_tokenizer

    if args.standin_tokenizer:
        tokenizer: TextTokenizer = build_standin_tokenizer()
        source = "stand-in (byte-level, K2.5 special ids)"
    else:
        tokenizer = load_tokenizer(args.tokenizer)
        source = str(args.tokenizer)
    options = PrepareOptions(
        input_path=Path(args.input),
        out_dir=Path(args.out),
        max_length=args.max_length,
        overflow=args.overflow,
        on_error=args.on_error,
        thinking=args.thinking,
        one_row_per_answer=args.one_row_per_answer,
        draft_vocab_size=args.draft_vocab_size,
        shuffle=not args.no_shuffle,
        seed=args.seed,
        overwrite=args.overwrite,
        max_line_bytes=args.max_line_bytes,
        progress=args.progress if args.progress is not None else sys.stderr.isatty(),
    )
    summary = prepare(options, tokenizer, tokenizer_source=source)
    _print_summary(summary, options)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``prepare`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    parser.description = _DESCRIPTION
    parser.add_argument("input", metavar="IN.jsonl", help="conversations, one JSON object per line")
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output directory (must not exist, or --overwrite)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="local K2.5 checkpoint (or stand-in) tokenizer directory",
    )
    source.add_argument(
        "--standin-tokenizer",
        action="store_true",
        help="byte-level stand-in with K2.5's special ids (tests, demo; not for real training)",
    )
    parser.add_argument("--max-length", type=int, default=8192, help="max tokens per row (default 8192)")
    parser.add_argument(
        "--max-line-bytes",
        type=int,
        default=None,
        help=f"input lines longer than this are skipped unread, as line errors (default: the larger of "
        f"{MIN_LINE_BYTES} and {LINE_BYTES_PER_TOKEN} x --max-length)",
    )
    parser.add_argument(
        "--overflow",
        choices=["truncate", "drop"],
        default="truncate",
        help="rows longer than --max-length: cut to it, or drop them (both counted)",
    )
    parser.add_argument(
        "--on-error",
        choices=["skip", "fail"],
        default="skip",
        help="malformed lines: skip and count, or stop",
    )
    parser.add_argument(
        "--thinking",
        choices=["auto", "on", "off"],
        default="auto",
        help="thinking-mode rows (auto: when the trained turns have reasoning)",
    )
    parser.add_argument(
        "--one-row-per-answer",
        action="store_true",
        help="one row per final answer instead of one per conversation (repeats prefixes)",
    )
    parser.add_argument("--draft-vocab-size", type=int, default=32000, help="draft vocabulary size (default 32000)")
    parser.add_argument("--seed", type=int, default=42, help="shuffle seed (default 42)")
    parser.add_argument("--no-shuffle", action="store_true", help="keep input order")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing prepare output directory")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def _check_options(options: PrepareOptions) -> None:
    if options.max_length < 2:
        raise KimiInputError(f"--max-length must be at least 2, got {options.max_length}")
    if options.max_line_bytes is not None and options.max_line_bytes < 2:
        raise KimiInputError(f"--max-line-bytes must be at least 2, got {options.max_line_bytes}")
    if not options.input_path.is_file():
        raise KimiInputError(f"input file {options.input_path} does not exist")
    from specforge_kimi.data.tokenizer import K25_EMITTED_SPECIAL_TOKENS, K25_VOCAB_SIZE

    if not len(K25_EMITTED_SPECIAL_TOKENS) <= options.draft_vocab_size <= K25_VOCAB_SIZE:
        raise KimiInputError(
            f"--draft-vocab-size must be in {len(K25_EMITTED_SPECIAL_TOKENS)}..{K25_VOCAB_SIZE} "
            f"(it always holds K2.5's emitted special tokens), got {options.draft_vocab_size}"
        )


def _check_out_dir(out_dir: Path, *, overwrite: bool) -> None:
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    if not out_dir.is_dir():
        raise KimiInputError(f"--out {out_dir} exists and is not a directory")
    if not overwrite:
        raise KimiInputError(f"--out {out_dir} already exists; pass --overwrite to replace it")
    if not (out_dir / SUMMARY_FILE).is_file():
        raise KimiInputError(
            f"--out {out_dir} is not a previous prepare output (no {SUMMARY_FILE}); refusing to replace it"
        )


def _recover_out_dir(out_dir: Path) -> None:
    """Undo an interrupted swap a killed run left beside ``out_dir`` (:func:`durable.staged_dir` then
    deletes the staging directories of processes that no longer run)."""
    done = recover_dir(out_dir)
    if done:
        print(f"note: {done}", file=sys.stderr)


def _check_input_outside(input_path: Path, out_dir: Path) -> None:
    """``--overwrite`` deletes the old ``--out``: refuse an input that lives inside it."""
    if not out_dir.exists():
        return
    if os.path.realpath(input_path).startswith(os.path.realpath(out_dir) + os.sep):
        raise KimiInputError(
            f"input {input_path} is inside --out {out_dir}, which --overwrite replaces; move it out first"
        )


def _iter_lines(options: PrepareOptions, hasher: Any) -> Iterator[tuple[int, bytes | None, int]]:
    """``(number, line, size)`` per input line; ``line`` is None for a line over the size cap, which is
    read (and hashed) in bounded chunks and never held whole."""
    size = options.input_path.stat().st_size
    cap = options.line_byte_cap
    from tqdm import tqdm

    with (
        open(options.input_path, "rb") as stream,
        tqdm(total=size, unit="B", unit_scale=True, desc="prepare", disable=not options.progress) as bar,
    ):
        for number in itertools.count(1):
            raw = stream.readline(cap + 1)
            if not raw:
                return
            hasher.update(raw)
            bar.update(len(raw))
            if len(raw) <= cap or raw.endswith(b"\n"):
                yield number, raw, len(raw)
                continue
            length = len(raw)
            while not raw.endswith(b"\n"):
                raw = stream.readline(_SKIP_CHUNK_BYTES)
                if not raw:
                    break
                hasher.update(raw)
                bar.update(len(raw))
                length += len(raw)
            yield number, None, length


def _tokenize_file(
    options: PrepareOptions,
    tokenizer: TextTokenizer,
    out_path: Path,
    stats: _Stats,
    counts: Counter,
) -> str:
    from specforge_kimi.data.chat_template import encode_spans, training_rows
    from specforge_kimi.data.conversation import conversation_from_record

    thinking = {"auto": None, "on": True, "off": False}[options.thinking]
    answers = options.one_row_per_answer
    hasher = hashlib.sha256()
    with open(out_path, "w", encoding="utf-8") as out:
        for number, raw, size in _iter_lines(options, hasher):
            stats.input_lines += 1
            if raw is None:
                message = (
                    f"line of {size} bytes is over the {options.line_byte_cap}-byte line cap "
                    "(--max-line-bytes; default from --max-length); skipped unread"
                )
                _line_error(options, stats, number, message)
                stats.dropped["line_too_large"] += 1
                continue
            if not raw.strip():
                stats.blank_lines += 1
                continue
            try:
                record = json.loads(raw)
                if _LONE_SURROGATE.search(raw) and _has_lone_surrogate(record):
                    raise KimiInputError("text holds an unpaired UTF-16 surrogate (U+D800-U+DFFF)")
                conversation = conversation_from_record(record)
                media = conversation.has_media
                rows = [] if media else training_rows(conversation, thinking=thinking, one_row_per_answer=answers)
                encoded = [encode_spans(spans, tokenizer) for spans in rows]
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                _line_error(options, stats, number, f"invalid JSON: {exc}")
                continue
            except RecursionError:
                _line_error(options, stats, number, "JSON nested too deeply")
                continue
            except KimiInputError as exc:
                _line_error(options, stats, number, str(exc))
                continue
            stats.conversations += 1
            if media:
                stats.dropped["media"] += 1
                continue
            if not encoded:
                stats.dropped["no_assistant_turn"] += 1
                continue
            for input_ids, loss_mask in encoded:
                truncated = len(input_ids) > options.max_length
                if truncated:
                    if options.overflow == "drop":
                        stats.dropped["too_long"] += 1
                        continue
                    input_ids = input_ids[: options.max_length]
                    loss_mask = loss_mask[: options.max_length]
                trained = sum(loss_mask)
                if trained == 0:
                    reason = "truncated_before_answer" if truncated else "no_trained_tokens"
                    stats.dropped[reason] += 1
                    continue
                stats.truncated_rows += int(truncated)
                out.write(json.dumps({"input_ids": input_ids, "loss_mask": loss_mask}, separators=(",", ":")))
                out.write("\n")
                counts.update(itertools.compress(input_ids, loss_mask))
                stats.rows += 1
                stats.tokens += len(input_ids)
                stats.trained_tokens += trained
    return hasher.hexdigest()


def _has_lone_surrogate(record: Any) -> bool:
    """A JSON ``\\udXXX`` escape without its pair decodes to a str no tokenizer (nor UTF-8) takes."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _line_error(options: PrepareOptions, stats: _Stats, line: int, message: str) -> None:
    if options.on_error == "fail":
        raise KimiInputError(f"{options.input_path}:{line}: {message}")
    stats.error(line, message)
    if stats.error_count <= 20:
        print(f"warning: {options.input_path}:{line}: {message} (skipped)", file=sys.stderr)
    elif stats.error_count == 21:
        print("warning: more malformed lines; see summary.json", file=sys.stderr)


def _shuffle_lines(source: Path, target: Path, *, seed: int, work_dir: Path) -> None:
    """Seeded shuffle in bounded memory: scatter lines to random buckets, shuffle each bucket."""
    size = source.stat().st_size
    bucket_count = min(_MAX_SHUFFLE_BUCKETS, max(1, math.ceil(size / _SHUFFLE_BUCKET_BYTES)))
    rng = random.Random(seed)
    bucket_paths = [work_dir / f".bucket-{i:03d}" for i in range(bucket_count)]
    buckets = [open(path, "w", encoding="utf-8") for path in bucket_paths]
    try:
        with open(source, encoding="utf-8") as stream:
            for line in stream:
                buckets[rng.randrange(bucket_count)].write(line)
    finally:
        for bucket in buckets:
            bucket.close()
    with open(target, "w", encoding="utf-8") as out:
        for path in bucket_paths:
            with open(path, encoding="utf-8") as stream:
                lines = stream.readlines()
            rng.shuffle(lines)
            out.writelines(lines)
            del lines
            path.unlink()


def _summary(
    options: PrepareOptions,
    stats: _Stats,
    vocab_meta: dict[str, Any],
    input_sha256: str,
    tokenizer_source: str,
) -> dict[str, Any]:
    from specforge_kimi.provenance import VERSION as __version__

    option_values = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}
    option_values.pop("progress", None)
    return {
        "input": {
            "path": str(options.input_path),
            "sha256": input_sha256,
            "lines": stats.input_lines,
        },
        "tokenizer": tokenizer_source,
        "options": option_values,
        "outputs": {
            "prompts": PROMPTS_FILE,
            "vocab_mapping": VOCAB_MAPPING_FILE,
            "vocab_mapping_meta": "vocab_mapping.json",
        },
        "rows": stats.rows,
        "conversations": stats.conversations,
        "blank_lines": stats.blank_lines,
        "tokens": stats.tokens,
        "trained_tokens": stats.trained_tokens,
        "trained_fraction": round(stats.trained_tokens / stats.tokens, 6) if stats.tokens else 0.0,
        "truncated_rows": stats.truncated_rows,
        "dropped": dict(sorted(stats.dropped.items())),
        "errors": {"count": stats.error_count, "first": stats.errors},
        "vocab_mapping": {k: vocab_meta[k] for k in ("draft_vocab_size", "coverage", "distinct_counted_tokens")},
        "versions": {"specforge_kimi": __version__, **_versions()},
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("specforge", "torch", "transformers", "tokenizers", "tiktoken"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _print_summary(summary: dict[str, Any], options: PrepareOptions) -> None:
    dropped = ", ".join(f"{k} {v}" for k, v in summary["dropped"].items()) or "none"
    print(
        f"prepared {summary['rows']} rows from {summary['conversations']} conversations "
        f"({summary['input']['lines']} lines) -> {options.out_dir}\n"
        f"  tokens {summary['tokens']}, trained {summary['trained_tokens']} "
        f"({summary['trained_fraction']:.1%}), truncated rows {summary['truncated_rows']}\n"
        f"  dropped: {dropped}; malformed lines: {summary['errors']['count']}\n"
        f"  draft vocab {summary['vocab_mapping']['draft_vocab_size']} covers "
        f"{summary['vocab_mapping']['coverage']:.2%} of trained tokens; "
        f"peak RSS {summary['run']['peak_rss_mib']} MiB"
    )
