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

Requests (``data.chat_client``): at most ``--concurrency`` in flight (rows in parallel, turns of
one row in order); ``--timeout`` bounds each request whole (connecting, sending, the entire reply),
so a reply that trickles ends at the deadline. Connection errors, the deadline, HTTP 408, 429 and
5xx, and bodies that are cut short or not JSON are retried ``--max-retries`` times with exponential
backoff (``--retry-delay`` x 2^attempt, capped at 60 s, plus jitter). Other HTTP errors (400, 401,
404, ...) and replies that are JSON but not a chat completion (no ``choices[0].message`` object,
fields of the wrong type) fail the row at once. Every failed row is one line in the errors file and
counts as failed: after ``--max-consecutive-failures`` rows fail in a row the run stops (exit 2), so
a dead or misconfigured server does not turn the whole dataset into error lines, and a run in which
no row was written but some failed exits 2 naming the first error.

Output (``data.output_file``): ``--out``, its errors file and ``OUT.lock`` are checked before
anything is opened for writing: the input file (through a symlink or a hard link too), a symbolic
link, a directory, anything but a regular file, or a directory that is missing or not writable is
refused in one line. ``OUT.lock`` is held for the whole run: a second run on the same ``--out``
(with ``--resume`` or not) refuses at once, naming the holder's pid. Ctrl-C abandons the requests
in flight at once, keeps only whole lines in ``OUT`` and the errors file, and exits 130 with one
line; ``--resume`` then finishes the file, each row once. ``kill -INT`` does the same, also for a run
started with SIGINT ignored or blocked (a shell script's background command is started with it
ignored): the run takes SIGINT for itself while it holds ``OUT.lock``. SIGTERM (``kill``,
``timeout``, systemd, Slurm, container runtimes) stops the run the same way, with one line naming
it and exit 143 (128 + the signal's number); a run started with SIGTERM ignored leaves it ignored
(the parent's choice). Killed outright (SIGKILL), a run can leave a torn last line: ``--resume``
cuts it off and asks for that row again.

Reproducibility is the server's: with SGLang's default kernels, greedy generations depend on what
else is in the batch, so two runs of the same rows differ in a few; a server started with
``--enable-deterministic-inference`` gives the same output bit for bit, regenerating somewhat
slower (the measurements: docs/decisions/002-data-path.md). SGLang 0.5.14 confines DeepSeek's MLA architectures to ``fa3`` or ``triton`` in that
mode, but its list names ``DeepseekV3ForCausalLM``, not K2.5's wrapper, so it would also accept
``flashinfer`` for K2.5: use ``triton`` (measured) or ``fa3``. At TP > 1 it turns custom
all-reduce off for NCCL's tree algorithm: weigh that cost at TP=8 before choosing it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import reprlib
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specforge_kimi.data.chat_client import ChatClient, RequestFailed
from specforge_kimi.data.conversation import (
    Conversation,
    Message,
    ToolCall,
    conversation_from_record,
    conversation_to_openai,
)
from specforge_kimi.data.output_file import LineWriter, OutputLock, check_output, open_no_follow
from specforge_kimi.errors import KimiInputError

__all__ = ["Interrupted", "RegenerateOptions", "add_arguments", "regenerate", "run"]

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


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM: requests in flight abandoned, OUT cut back to its last
    whole line; one line. ``signum``: the signal; the CLI exits ``128 + signum``, the shell's convention."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


class _Stopped(KeyboardInterrupt):
    """Raised in the main thread by a stop signal the run took for itself (:func:`_signals_interrupt`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# The signals that stop a run, each with whether a run started with it ignored takes it anyway: a shell
# ignores SIGINT in a script's background command without anyone asking; SIGTERM ignored is the parent's
# own choice (it wants the run to outlive it) and stays ignored.
_STOP_SIGNALS: dict[int, bool] = {signal.SIGINT: True, signal.SIGTERM: False}


def regenerate(options: RegenerateOptions) -> dict[str, Any]:
    """Run the regeneration; returns counts (rows written, skipped, failed, truncated).

    Raises :class:`Interrupted` on Ctrl-C or SIGTERM (``--resume`` finishes the file) and ``KimiInputError``
    (one line) for bad input, a server that cannot be used, or an output another run holds."""
    _check_options(options)
    out = options.out_path
    job: _Run | None = None
    try:
        # before anything is read or written: one run per output, and the signals its message names work
        with _signals_interrupt(_STOP_SIGNALS), OutputLock(_lock_path(out), out):
            if out.exists() and not (options.resume or options.overwrite):
                raise KimiInputError(f"{out} exists; pass --resume to continue it or --overwrite")
            client = ChatClient(
                options.server,
                timeout_s=options.timeout_s,
                max_retries=options.max_retries,
                retry_delay_s=options.retry_delay_s,
            )
            try:  # before OUT is created: an unreachable server leaves nothing a retry would have to --resume
                model = options.model or _model_name(client)
            except RequestFailed as exc:
                raise KimiInputError(f"cannot list the server's models ({exc}); check --server") from None
            done, keep = _resume_state(options)
            job = _Run(options, client, model, done)
            return job.rows(keep)
    except KeyboardInterrupt as exc:  # rows(), once begun, has cut OUT and the errors file to whole lines
        signum = getattr(exc, "signum", signal.SIGINT)
        how = "interrupted" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})"
        written = job.counts["written"] if job else 0
        raise Interrupted(
            f"{how}: {written} rows written this run, {out} holds whole lines only; rerun with --resume to finish it",
            signum,
        ) from None


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


@contextlib.contextmanager
def _signals_interrupt(signals: Mapping[int, bool]) -> Iterator[None]:
    """Each of ``signals`` raises ``KeyboardInterrupt`` in the main thread while entered, however the
    process was started: one it was started with at the default action would kill the run mid-write
    (SIGTERM), and one ignored (``signals[signum]`` true: SIGINT, which a shell ignores in a script's
    background command) or blocked would let a Ctrl-C or ``kill`` pass unnoticed while its requests stall.
    Restores the dispositions and the mask on exit. A handler of the caller's own, a signal the caller
    ignored that ``signals`` leaves ignored (disposition and mask alike), and a call from another thread
    (only the main thread takes signals) are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced: dict[int, Any] = {}
    blocked: set[int] = set()
    try:
        taken = {s for s, take_ignored in signals.items() if take_ignored or signal.getsignal(s) != signal.SIG_IGN}
        for signum in taken:
            previous = signal.getsignal(signum)
            if previous in (signal.SIG_IGN, signal.SIG_DFL):
                replaced[signum] = previous
                signal.signal(signum, _raise_stopped)
        blocked = taken & signal.pthread_sigmask(signal.SIG_UNBLOCK, taken)
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        for signum, previous in replaced.items():
            signal.signal(signum, previous)


class _Run:
    """One run's rows: requested by ``concurrency`` workers, written in input order by the caller's thread."""

    def __init__(self, options: RegenerateOptions, client: ChatClient, model: str, done: set[int]) -> None:
        self.options = options
        self.client = client
        self.model = model
        self.done = done
        self.counts = {"written": 0, "already_done": len(done), "failed": 0, "skipped": 0, "truncated": 0}
        self.consecutive_server_failures = 0
        self.first_failure = ""

    def rows(self, keep: int) -> dict[str, Any]:
        from tqdm import tqdm

        options = self.options
        errors_path = _errors_path(options.out_path)
        out = LineWriter(options.out_path, "--out", keep=keep)
        errors = LineWriter(errors_path, "the errors file")
        workers = _Workers(options.concurrency)
        window: deque[Future[_Result]] = deque()
        total = _count_lines(options.input_path) - len(self.done)
        whole = False
        try:
            with tqdm(desc="regenerate", unit="row", total=total, disable=not options.progress) as bar:
                for line, record in _pending_rows(options.input_path, self.done):
                    window.append(workers.submit(_regenerate_row, self.client, self.model, options, line, record))
                    self._drain(window, options.concurrency * 4, out, errors, bar.update)
                self._drain(window, 0, out, errors, bar.update)
            whole = True
        finally:  # on a stop signal too (regenerate() words it): nothing waits, OUT keeps whole lines only
            self.client.abort()  # a run that stops early waits for no request in flight
            for future in window:
                future.cancel()
            workers.close()
            out.close(whole=whole)
            errors.close(whole=whole)
        if self.counts["failed"] and not self.counts["written"]:
            raise KimiInputError(
                f"no row was regenerated: {self.counts['failed']} failed (first, {self.first_failure}); "
                f"see {errors_path}"
            )
        return self.counts

    def _drain(
        self,
        window: deque[Future[_Result]],
        block_until: int,
        out: LineWriter,
        errors: LineWriter,
        advance: Callable[[int], Any],
    ) -> None:
        options = self.options
        while window and (len(window) > block_until or window[0].done()):
            result = window[0].result()
            if result.text is not None:
                out.write_line(result.text)
                self.counts["written"] += 1
                self.counts["truncated"] += int(result.truncated)
                self.consecutive_server_failures = 0
            else:
                errors.write_line(json.dumps({"line": result.line, "error": result.error}))
                if result.server_fault:
                    self.counts["failed"] += 1
                    self.consecutive_server_failures += 1
                    self.first_failure = self.first_failure or f"line {result.line}: {result.error}"
                else:
                    self.counts["skipped"] += 1
            window.popleft()
            advance(1)
            if result.text is not None:
                continue
            if options.on_error == "fail" and result.server_fault:
                raise KimiInputError(f"{options.input_path}:{result.line}: {result.error}")
            if self.consecutive_server_failures >= options.max_consecutive_failures:
                raise KimiInputError(
                    f"{self.consecutive_server_failures} rows in a row failed against "
                    f"{options.server} (last: {result.error}); stopping. Fix the server and "
                    "rerun with --resume"
                )


class _Workers:
    """``n`` daemon threads that run submitted calls: an interrupted run leaves without waiting for them
    (the client's abort ends their requests; a thread still inside one is not joined at exit)."""

    def __init__(self, n: int) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(n)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., _Result], *args: Any) -> Future[_Result]:
        future: Future[_Result] = Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller through the future
                future.set_exception(exc)


def _model_name(client: ChatClient) -> str:
    reply = client.get("/models")
    models = (reply.get("data") if isinstance(reply, dict) else None) or []
    if not isinstance(models, list):
        models = []
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise KimiInputError(f"{client.base}/models lists no model; pass --model")
    return str(models[0]["id"])


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
    try:
        counts = regenerate(options)
    except Interrupted as exc:
        print(exc, file=sys.stderr)
        return 128 + exc.signum
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
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds per request, whole: connecting, sending and the entire reply; a reply still arriving "
        "then is a failed attempt, retried (default 1800)",
    )
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
    for path, what in (
        (options.out_path, "--out"),
        (_errors_path(options.out_path), "the errors file"),
        (_lock_path(options.out_path), "the lock file"),
    ):
        check_output(path, what, options.input_path)
    if options.concurrency < 1:
        raise KimiInputError(f"--concurrency must be at least 1, got {options.concurrency}")
    if options.max_retries < 0 or options.max_tokens < 1:
        raise KimiInputError("--max-retries must be >= 0 and --max-tokens >= 1")
    if not options.timeout_s > 0:
        raise KimiInputError(f"--timeout must be a positive number of seconds, got {options.timeout_s}")
    if not options.server.startswith(("http://", "https://")):
        raise KimiInputError(f"--server must be an http(s) URL, got {options.server!r}")


def _errors_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".errors.jsonl")


def _lock_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".lock")


def _resume_state(options: RegenerateOptions) -> tuple[set[int], int]:
    """Source lines already in OUT and where its last whole line ends (a torn last line is cut off
    there); nothing for --overwrite or a new OUT."""
    out = options.out_path
    if options.overwrite or not out.exists():
        return set(), 0
    done: set[int] = set()
    good_end = 0
    with os.fdopen(open_no_follow(out, os.O_RDONLY, "--out"), "rb") as stream:
        lines = stream.readlines()
    for number, raw in enumerate(lines, start=1):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("torn line")
            done.add(int(json.loads(raw)["regenerate"]["source_line"]))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            if number == len(lines):
                break  # an interrupted write: LineWriter cuts it off
            raise KimiInputError(f"{out}:{number} is not a regenerate output line ({exc}); cannot resume") from None
        good_end += len(raw)
    return done, good_end


def _count_lines(path: Path) -> int:
    with open(path, "rb") as stream:
        return sum(1 for raw in stream if raw.strip())


def _pending_rows(path: Path, done: set[int]) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as stream:
        for line, raw in enumerate(stream, start=1):
            if line in done or not raw.strip():
                continue
            yield line, raw


def _regenerate_row(client: ChatClient, model: str, options: RegenerateOptions, line: int, raw: bytes) -> _Result:
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
    except RequestFailed as exc:
        return _Result(line, error=_one_line(str(exc)), server_fault=True)
    return _Result(line, text=text, truncated=truncated)


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _regenerate_turns(
    client: ChatClient, model: str, options: RegenerateOptions, conversation: Conversation
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
    client: ChatClient, model: str, options: RegenerateOptions, prefix: Conversation, *, thinking: bool = True
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
    choice, message = _reply_message(client.post("/chat/completions", payload))
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
