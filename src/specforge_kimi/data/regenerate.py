"""``specforge-kimi regenerate``: replace assistant turns with K2.5's own generations.

Sends each conversation's prefix to an OpenAI-compatible chat endpoint (SGLang serving K2.5,
``--reasoning-parser kimi_k2 --tool-call-parser kimi_k2``) with thinking on
(``chat_template_kwargs: {"thinking": true}``) and writes the target's reply in place of the
dataset's: ``reasoning_content`` (the thinking), ``content`` and ``tool_calls``. If the server
returns the thinking inline (no reasoning parser), it is split at the first ``</think>``.

Turns, in order; every assistant turn in the output is the target's own:

- an assistant turn is regenerated from the regenerated prefix (history turns are sent with
  their reasoning; K2.5's template decides what the model sees);
- if the source turn called tools, the source's tool results are reused only when the target
  makes the same calls (same function names and JSON-equal arguments, in order), with the ids
  rewritten to the target's; otherwise, and whenever the target calls a tool where the source
  answered, or answers where the source called, the conversation ends at the target's turn
  (counted as ``truncated``): tool results for calls the dataset never made do not exist.
- a generation cut by ``max_tokens`` (``finish_reason: length``) fails the row: it has no end
  (``--keep-unfinished`` keeps it: for small targets that never stop; the row then ends with the
  template's ``<|im_end|>``, one token the target did not generate).

Output: OpenAI-messages JSONL (``{"messages", "tools", ...source keys, "regenerate":
{"source_line", "regenerated_turns", "truncated"}}``), in input order. Rows that fail (after
retries) or cannot be regenerated (media, no assistant turn, malformed) go to
``OUT.errors.jsonl`` with their line number. ``--resume`` continues a partial output: rows whose
``source_line`` is already in ``OUT`` are not requested again, a torn last line is cut off, and
failed rows are retried.

Requests: at most ``--concurrency`` in flight (rows in parallel, turns of one row in order);
connection errors, timeouts, HTTP 408, 429 and 5xx, and bodies that are cut short or not JSON
are retried ``--max-retries`` times with exponential backoff (``--retry-delay`` x 2^attempt,
capped at 60 s, plus jitter). Other HTTP errors (400, 401, 404, ...) and replies that are JSON
but not a chat completion (no ``choices[0].message`` object, fields of the wrong type) fail the
row at once. Every failed row is one line in the errors file and counts as failed: after
``--max-consecutive-failures`` rows fail in a row the run stops (exit 2), so a dead or
misconfigured server does not turn the whole dataset into error lines, and a run in which no row
was written but some failed exits 2 naming the first error.

``--out`` (and its errors file) must not be the input file, through a symlink or a hard link
either: that is refused before anything is opened for writing.

Reproducibility is the server's: with SGLang's default kernels, greedy generations depend on what
else is in the batch, so two runs of the same rows differ in a few; a server started with
``--enable-deterministic-inference`` gives the same output bit for bit, regenerating somewhat slower
(archive/gpu-runs/RUNS.md, "is the data stage repeatable?"). SGLang 0.5.14 confines DeepSeek's MLA
architectures to ``fa3`` or ``triton`` in that mode, but its list names ``DeepseekV3ForCausalLM``, not K2.5's
wrapper, so it would also accept ``flashinfer`` for K2.5: use ``triton`` (the one that has run) or ``fa3``. At
TP > 1 it turns custom all-reduce off for NCCL's tree algorithm: weigh that cost at TP=8 before choosing it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import reprlib
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specforge_kimi.data.conversation import (
    Conversation,
    Message,
    ToolCall,
    conversation_from_record,
    conversation_to_openai,
)
from specforge_kimi.errors import KimiInputError

__all__ = ["RegenerateOptions", "add_arguments", "regenerate", "run"]

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 60.0
_DESCRIPTION = (
    "Replace a dataset's assistant turns with Kimi-K2.5's own generations (thinking on) "
    "through an OpenAI-compatible server."
)


@dataclass(frozen=True)
class RegenerateOptions:
    """The CLI flags, typed."""

    input_path: Path
    out_path: Path
    server: str
    model: str | None = None
    concurrency: int = 16
    max_tokens: int = 16384
    keep_unfinished: bool = False
    temperature: float = 1.0
    top_p: float = 0.95
    timeout_s: float = 1800.0
    max_retries: int = 5
    retry_delay_s: float = 1.0
    max_consecutive_failures: int = 32
    on_error: str = "skip"
    resume: bool = False
    overwrite: bool = False
    progress: bool = False
    thinking: str = "on"  # "on", "off", or "auto": each turn in the mode of the turn it replaces


class _RowFailed(Exception):
    """A row that cannot be regenerated; ``server_fault``: the server failed (after retries)."""

    def __init__(self, message: str, *, server_fault: bool = False) -> None:
        super().__init__(message)
        self.server_fault = server_fault


@dataclass
class _Result:
    line: int
    text: str | None = None  # the output line (JSON), serialised in the worker
    truncated: bool = False
    error: str | None = None
    server_fault: bool = False


class _Client:
    """Minimal OpenAI-compatible chat client (stdlib HTTP) with retries and backoff."""

    def __init__(self, options: RegenerateOptions) -> None:
        self.base = options.server.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.options = options
        self._jitter = random.Random(0)
        self._lock = threading.Lock()

    def model_name(self) -> str:
        reply = self._request("GET", "/models", None)
        models = (reply.get("data") if isinstance(reply, dict) else None) or []
        if not isinstance(models, list):
            models = []
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise KimiInputError(f"{self.base}/models lists no model; pass --model")
        return str(models[0]["id"])

    def chat(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/chat/completions", payload)

    def _request(self, method: str, path: str, payload: Mapping[str, Any] | None) -> Any:
        url = self.base + path
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        last_error = ""
        for attempt in range(self.options.max_retries + 1):
            if attempt:
                time.sleep(self._backoff(attempt))
            request = urllib.request.Request(
                url, data=data, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.options.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                try:
                    body = exc.read()[:300].decode("utf-8", "replace")
                except (OSError, http.client.HTTPException):
                    body = "(body unreadable)"
                last_error = _one_line(f"HTTP {exc.code} from {url}: {body}")
                if exc.code not in _RETRY_STATUS:  # the same request would fail again: a failed row
                    raise _RowFailed(last_error, server_fault=True) from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last_error = _one_line(f"cannot reach {url}: {exc}")
            except http.client.HTTPException as exc:  # IncompleteRead: a body cut short
                last_error = _one_line(f"{url} broke off its reply: {type(exc).__name__}: {exc}")
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
                last_error = _one_line(f"{url} returned invalid JSON: {type(exc).__name__}: {str(exc)[:200]}")
        raise _RowFailed(f"{last_error} (after {self.options.max_retries} retries)", server_fault=True)

    def _backoff(self, attempt: int) -> float:
        base = self.options.retry_delay_s
        with self._lock:
            jitter = self._jitter.uniform(0, base)
        return min(_MAX_BACKOFF_S, base * 2 ** (attempt - 1)) + jitter


def regenerate(options: RegenerateOptions) -> dict[str, Any]:
    """Run the regeneration; returns counts (rows written, skipped, failed, truncated)."""
    _check_options(options)
    client = _Client(options)
    try:  # before OUT is created: an unreachable server leaves nothing a retry would have to --resume
        model = options.model or client.model_name()
    except _RowFailed as exc:
        raise KimiInputError(f"cannot list the server's models ({exc}); check --server") from exc
    done = _resume_state(options)
    errors_path = _errors_path(options.out_path)
    counts = {"written": 0, "already_done": len(done), "failed": 0, "skipped": 0, "truncated": 0}
    consecutive_server_failures = 0
    first_failure = ""

    from tqdm import tqdm

    with (
        open(options.out_path, "a", encoding="utf-8") as out,
        open(errors_path, "w", encoding="utf-8") as errors,
        ThreadPoolExecutor(max_workers=options.concurrency) as pool,
        tqdm(
            desc="regenerate",
            unit="row",
            total=_count_lines(options.input_path) - len(done),
            disable=not options.progress,
        ) as bar,
    ):
        window: deque[Future[_Result]] = deque()

        def drain(block_until: int) -> None:
            nonlocal consecutive_server_failures, first_failure
            while window and (len(window) > block_until or window[0].done()):
                result = window.popleft().result()
                bar.update(1)
                if result.text is not None:
                    out.write(result.text + "\n")
                    out.flush()
                    counts["written"] += 1
                    counts["truncated"] += int(result.truncated)
                    consecutive_server_failures = 0
                    continue
                errors.write(json.dumps({"line": result.line, "error": result.error}) + "\n")
                errors.flush()
                if result.server_fault:
                    counts["failed"] += 1
                    consecutive_server_failures += 1
                    first_failure = first_failure or f"line {result.line}: {result.error}"
                else:
                    counts["skipped"] += 1
                if options.on_error == "fail" and result.server_fault:
                    raise KimiInputError(f"{options.input_path}:{result.line}: {result.error}")
                if consecutive_server_failures >= options.max_consecutive_failures:
                    raise KimiInputError(
                        f"{consecutive_server_failures} rows in a row failed against "
                        f"{options.server} (last: {result.error}); stopping. Fix the server and "
                        "rerun with --resume"
                    )

        try:
            for line, record in _pending_rows(options.input_path, done):
                window.append(pool.submit(_regenerate_row, client, model, options, line, record))
                drain(block_until=options.concurrency * 4)
            drain(block_until=0)
        except BaseException:
            for future in window:
                future.cancel()
            raise
    if counts["failed"] and not counts["written"]:
        raise KimiInputError(
            f"no row was regenerated: {counts['failed']} failed (first, {first_failure}); see {errors_path}"
        )
    return counts


def run(args: argparse.Namespace) -> int:
    """Run from parsed arguments; exit 0 when every row was written or skipped, 1 if some failed."""
    options = RegenerateOptions(
        input_path=Path(args.input),
        out_path=Path(args.out),
        server=args.server,
        model=args.model,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        keep_unfinished=args.keep_unfinished,
        temperature=args.temperature,
        top_p=args.top_p,
        timeout_s=args.timeout,
        max_retries=args.max_retries,
        retry_delay_s=args.retry_delay,
        max_consecutive_failures=args.max_consecutive_failures,
        on_error=args.on_error,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=args.progress if args.progress is not None else sys.stderr.isatty(),
        thinking=args.thinking,
    )
    counts = regenerate(options)
    print(
        f"regenerated {counts['written']} rows -> {options.out_path} "
        f"({counts['already_done']} already done, {counts['truncated']} truncated at a tool call, "
        f"{counts['skipped']} skipped, {counts['failed']} failed; "
        f"see {_errors_path(options.out_path)})"
    )
    return 1 if counts["failed"] else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``regenerate`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    parser.description = _DESCRIPTION
    parser.add_argument("input", metavar="IN.jsonl", help="conversations (OpenAI messages or ShareGPT)")
    parser.add_argument(
        "--server",
        required=True,
        metavar="URL",
        help="OpenAI-compatible base URL, e.g. http://127.0.0.1:30000",
    )
    parser.add_argument("--out", required=True, metavar="OUT.jsonl", help="output JSONL (OpenAI messages)")
    parser.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=16384,
        help="max generated tokens per turn (default 16384)",
    )
    parser.add_argument(
        "--thinking",
        choices=("on", "off", "auto"),
        default="on",
        help="thinking mode of the generations: on (default), off, or auto = per turn, as the turn it "
        "replaces (reasoning present -> on)",
    )
    parser.add_argument(
        "--keep-unfinished",
        action="store_true",
        help="keep generations cut by --max-tokens instead of skipping the row (small targets that never stop)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature (K2.5 thinking default 1.0)",
    )
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (K2.5 thinking default 0.95)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (default 1800)")
    parser.add_argument("--max-retries", type=int, default=5, help="retries per request (default 5)")
    parser.add_argument("--retry-delay", type=float, default=1.0, help="first backoff in seconds, doubled per retry")
    parser.add_argument(
        "--max-consecutive-failures",
        type=int,
        default=32,
        help="stop after this many rows in a row fail against the server (default 32)",
    )
    parser.add_argument(
        "--on-error",
        choices=["skip", "fail"],
        default="skip",
        help="a row that fails after retries: record it and go on, or stop",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue a partial OUT")
    mode.add_argument("--overwrite", action="store_true", help="start OUT afresh")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr",
    )


def _check_options(options: RegenerateOptions) -> None:
    if not options.input_path.is_file():
        raise KimiInputError(f"input file {options.input_path} does not exist")
    for path, what in ((options.out_path, "--out"), (_errors_path(options.out_path), "the errors file")):
        if path.exists() and os.path.samefile(path, options.input_path):
            raise KimiInputError(
                f"{what} {path} is the input file {options.input_path}; writing it would destroy the input: "
                "choose another --out"
            )
    if options.concurrency < 1:
        raise KimiInputError(f"--concurrency must be at least 1, got {options.concurrency}")
    if options.max_retries < 0 or options.max_tokens < 1:
        raise KimiInputError("--max-retries must be >= 0 and --max-tokens >= 1")
    if not options.server.startswith(("http://", "https://")):
        raise KimiInputError(f"--server must be an http(s) URL, got {options.server!r}")
    if options.out_path.exists() and not (options.resume or options.overwrite):
        raise KimiInputError(f"{options.out_path} exists; pass --resume to continue it or --overwrite")


def _errors_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".errors.jsonl")


def _resume_state(options: RegenerateOptions) -> set[int]:
    """Source lines already in OUT; cuts a torn last line; empties OUT for --overwrite."""
    out = options.out_path
    out.parent.mkdir(parents=True, exist_ok=True)
    if options.overwrite or not out.exists():
        out.write_bytes(b"")
        return set()
    done: set[int] = set()
    good_end = 0
    with open(out, "rb") as stream:
        lines = stream.readlines()
    for number, raw in enumerate(lines, start=1):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("torn line")
            done.add(int(json.loads(raw)["regenerate"]["source_line"]))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            if number == len(lines):
                break  # an interrupted write: cut it off below
            raise KimiInputError(f"{out}:{number} is not a regenerate output line ({exc}); cannot resume") from exc
        good_end += len(raw)
    if good_end != out.stat().st_size:
        with open(out, "r+b") as stream:
            stream.truncate(good_end)
    return done


def _count_lines(path: Path) -> int:
    with open(path, "rb") as stream:
        return sum(1 for raw in stream if raw.strip())


def _pending_rows(path: Path, done: set[int]) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as stream:
        for line, raw in enumerate(stream, start=1):
            if line in done or not raw.strip():
                continue
            yield line, raw


def _regenerate_row(client: _Client, model: str, options: RegenerateOptions, line: int, raw: bytes) -> _Result:
    try:
        conversation = conversation_from_record(json.loads(raw))
        if conversation.has_media:
            raise _RowFailed("skipped: image/video content (text-only training)")
        if not conversation.assistant_indices:
            raise _RowFailed("skipped: no assistant turn to regenerate")
        regenerated, turns, truncated = _regenerate_turns(client, model, options, conversation)
        record = conversation_to_openai(regenerated)
        record["regenerate"] = {"source_line": line, "regenerated_turns": turns, "truncated": truncated}
        text = json.dumps(record, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (valid as a JSON escape): keep it escaped
            text = json.dumps(record)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _Result(line, error=_one_line(f"invalid JSON: {exc}"))
    except RecursionError:
        return _Result(line, error="JSON nested too deeply")
    except KimiInputError as exc:
        return _Result(line, error=_one_line(str(exc)))
    except _RowFailed as exc:
        return _Result(line, error=_one_line(str(exc)), server_fault=exc.server_fault)
    return _Result(line, text=text, truncated=truncated)


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _regenerate_turns(
    client: _Client, model: str, options: RegenerateOptions, conversation: Conversation
) -> tuple[Conversation, int, bool]:
    output: list[Message] = []
    id_map: dict[str, str] = {}
    turns = 0
    source = conversation.messages
    for index, message in enumerate(source):
        if message.role == "tool":
            if message.tool_call_id not in id_map:
                # The matching call was not reproduced; _regenerate_turns stopped before this.
                raise _RowFailed(f"skipped: tool result for unknown call {message.tool_call_id}")
            output.append(replace(message, tool_call_id=id_map[message.tool_call_id]))
            continue
        if message.role != "assistant":
            output.append(message)
            continue
        reply = _generate(
            client,
            model,
            options,
            Conversation(tuple(output), conversation.tools),
            thinking=turn_thinking(options.thinking, message),
        )
        output.append(reply)
        turns += 1
        later = source[index + 1 :]
        if not any(m.role == "assistant" for m in later):
            return Conversation(tuple(output), conversation.tools, conversation.extra), turns, False
        if not _same_calls(message.tool_calls, reply.tool_calls):
            return Conversation(tuple(output), conversation.tools, conversation.extra), turns, True
        id_map.update({old.id: new.id for old, new in zip(message.tool_calls, reply.tool_calls, strict=True)})
    return Conversation(tuple(output), conversation.tools, conversation.extra), turns, False


def _same_calls(source: tuple[ToolCall, ...], target: tuple[ToolCall, ...]) -> bool:
    if len(source) != len(target):
        return False
    return all(
        a.name == b.name and _parsed(a.arguments) == _parsed(b.arguments) for a, b in zip(source, target, strict=True)
    )


def _parsed(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def turn_thinking(mode: str, source: Message) -> bool:
    """Thinking for the turn that replaces ``source``: ``on`` / ``off``, or ``auto`` = thinking when
    ``source`` carries reasoning (a dataset that mixes both modes keeps its mix; a draft serves both)."""
    if mode == "auto":
        return bool(source.reasoning)
    if mode not in ("on", "off"):
        raise KimiInputError(f"thinking must be on, off or auto, not {mode!r}")
    return mode == "on"


def _generate(
    client: _Client, model: str, options: RegenerateOptions, prefix: Conversation, *, thinking: bool = True
) -> Message:
    request = conversation_to_openai(prefix)
    payload: dict[str, Any] = {
        "model": model,
        "messages": request["messages"],
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "stream": False,
        "chat_template_kwargs": {"thinking": thinking},
    }
    if prefix.tools:
        payload["tools"] = request["tools"]
    choice, message = _reply_message(client.chat(payload))
    if choice.get("finish_reason") == "length" and not options.keep_unfinished:
        raise _RowFailed(f"generation hit max_tokens={options.max_tokens} (finish_reason=length)")
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if reasoning is None and "</think>" in content:
        reasoning, content = content.split("</think>", 1)
        reasoning = reasoning.removeprefix("<think>")
    record = {"role": "assistant", "content": content, "reasoning_content": reasoning or ""}
    if message.get("tool_calls"):
        record["tool_calls"] = message["tool_calls"]
    try:
        parsed = conversation_from_record({"messages": [{"role": "user", "content": ""}, record]})
    except KimiInputError as exc:
        raise _RowFailed(f"server reply is not a valid assistant message: {exc}", server_fault=True) from exc
    return parsed.messages[1]


def _reply_message(reply: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``choices[0]`` and its ``message`` from a chat completion, each field of the type OpenAI's API
    gives it; anything else fails the row (the server's fault, counted)."""

    def bad(why: str) -> _RowFailed:
        return _RowFailed(f"server reply {why}: {_one_line(reprlib.repr(reply))}", server_fault=True)

    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad("has no choices[0] object")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise bad("has no choices[0].message object")
    if not isinstance(choice.get("finish_reason"), str | None):
        raise bad("has a finish_reason that is not a string")
    for key in ("content", "reasoning_content"):
        if not isinstance(message.get(key), str | None):
            raise bad(f"has a message.{key} that is not a string")
    if not isinstance(message.get("tool_calls"), list | None):
        raise bad("has message.tool_calls that is not a list")
    return choice, message
