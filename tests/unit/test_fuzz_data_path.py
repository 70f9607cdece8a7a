"""Generated bad input for the data path (issue 32): ``prepare``'s input lines and ``regenerate``'s server
replies. Valid rows and replies are mutated (values of the wrong type, keys removed, huge and deeply nested
values, invalid UTF-8, truncation; for replies also HTTP statuses, bodies cut short, and replies slower than
the deadline: trickled a byte at a time, stalled after the headers, or silent). Every case must end in a
result or one clear error line -- never a traceback -- and leave no partial output behind; each reply's
row must be asked and end as the client's contract says (retried or not, written or which error). Example counts are bounded so the file runs in well under two minutes on two cores; the number
of cases each surface tried is printed in the run's summary (``tests/fuzz_counts.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from fuzz_counts import record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_server import FakeServer, RawReply

from specforge_kimi.data.prepare import PROMPTS_FILE, SUMMARY_FILE, VOCAB_MAPPING_FILE, PrepareOptions, prepare
from specforge_kimi.errors import KimiInputError

_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
_DEEP = "__deep__"

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
ROWS = [
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Add."}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "system": "S"},
    {"tools": [TOOL], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": "It is 18C.", "reasoning_content": None},
    ]},
]  # fmt: skip
COMPLETION = {
    "id": "x",
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "answer", "reasoning_content": "thought", "tool_calls": None},
        }
    ],
}

# -- mutations ------------------------------------------------------------------------------------------------

json_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _paths(value, prefix=()):
    """Every path (tuple of keys / indexes) inside ``value``, itself included."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _set(value, path, new):
    if not path:
        return new
    value = json.loads(json.dumps(value))
    target = value
    for key in path[:-1]:
        target = target[key]
    if new is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = new
    return value


_DELETE = object()


@st.composite
def mutated_json(draw, base) -> bytes:
    """``base`` (a JSON value) with up to three mutations, serialised; then maybe damaged as bytes."""
    value = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(0, 3))):
        paths = list(_paths(value))
        path = paths[draw(st.integers(0, len(paths) - 1))]
        kind = draw(st.sampled_from(["type", "delete", "huge", "deep", "empty"]))
        if kind == "type":
            new = draw(json_values)
        elif kind == "delete":
            new = _DELETE if path else {}
        elif kind == "huge":
            new = "x" * draw(st.sampled_from([10_000, 300_000])) if draw(st.booleans()) else list(range(20_000))
        elif kind == "deep":
            new = _DEEP
        else:
            new = draw(st.sampled_from([[], {}, "", None]))
        value = _set(value, path, new)
    text = json.dumps(value)
    if _DEEP in text:  # nesting past any recursion limit is written as text (json.dumps would hit the limit)
        depth = draw(st.sampled_from([50, 900, 5_000, 100_000]))
        text = text.replace(f'"{_DEEP}"', "[" * depth + "]" * depth, 1).replace(f'"{_DEEP}"', "0")
    raw = text.encode()
    damage = draw(st.sampled_from(["none", "none", "truncate", "bad utf-8", "surrogate"]))
    at = draw(st.integers(0, max(0, len(raw) - 1)))
    if damage == "truncate":
        raw = raw[:at]
    elif damage == "bad utf-8":
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf0\x9f"])) + raw[at:]
    elif damage == "surrogate":
        raw = raw.replace(b'"4"', b'"\\ud800"').replace(b'"hello"', b'"\\udfff x"')
    return raw


# -- prepare ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    return build_standin_tokenizer()


def _check_prepare_outcome(tmp: Path, out: Path, ran) -> None:
    """``ran()`` returns a summary or raises KimiInputError (one line); the output is whole or absent."""
    try:
        summary = ran()
    except KimiInputError as exc:
        assert "\n" not in str(exc)
        assert not out.exists()
    else:
        assert summary["rows"] > 0
        assert sorted(p.name for p in out.iterdir()) == sorted(
            [PROMPTS_FILE, SUMMARY_FILE, VOCAB_MAPPING_FILE, "vocab_mapping.json"]
        )
        for line in (out / PROMPTS_FILE).read_text().splitlines():
            row = json.loads(line)
            assert len(row["input_ids"]) == len(row["loss_mask"]) > 0
    assert not [p for p in tmp.iterdir() if p.name.startswith(".")]  # no staging, no parked output


@given(data=st.data())
@settings(max_examples=1000, **_SETTINGS)
def test_prepare_survives_generated_input_lines(tok, data):
    lines = [data.draw(mutated_json(data.draw(st.sampled_from(ROWS)))) for _ in range(data.draw(st.integers(1, 3)))]
    if data.draw(st.booleans()):
        lines.append(json.dumps(ROWS[0]).encode())  # a good line beside the bad ones
    on_error = data.draw(st.sampled_from(["skip", "fail"]))
    max_line_bytes = data.draw(st.sampled_from([None, None, 64, 200]))  # small caps cut through the lines
    record("prepare input lines")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        source = tmp / "in.jsonl"
        source.write_bytes(b"\n".join(lines) + b"\n")
        out = tmp / "out"
        options = PrepareOptions(
            input_path=source,
            out_dir=out,
            on_error=on_error,
            draft_vocab_size=64,
            max_length=4096,
            max_line_bytes=max_line_bytes,
        )
        with contextlib.redirect_stderr(io.StringIO()):  # the per-line warnings
            _check_prepare_outcome(tmp, out, lambda: prepare(options, tok))


# -- regenerate ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    yield fake
    fake.close()


_SLOW_S = 3.0  # how long a slow reply takes whole; the client's deadline in a case with one is _DEADLINE_S
_DEADLINE_S = 0.2
_FAST_DEADLINE_S = 10.0  # a case without slow replies: a deadline no healthy loopback reply meets late
_RETRY = {408, 429, 500, 502, 503, 504}


@st.composite
def raw_replies(draw) -> RawReply:
    status = draw(st.sampled_from([200, 200, 200, 200, 400, 401, 404, 408, 413, 422, 429, 500, 502, 503]))
    body = draw(
        st.one_of(
            mutated_json(COMPLETION),
            st.just(json.dumps(COMPLETION).encode()),
            st.binary(max_size=40),
            st.sampled_from([b"", b"null", b"<html>bad gateway</html>", b'{"error": "overloaded"}']),
        )
    )
    short = draw(st.sampled_from([None, None, None, len(body) + 100]))
    # one reply in 60 is slow (about 50 of the 1,000 cases have one): each costs the deadline per attempt
    pace = draw(st.sampled_from(["trickle", "stall", "silent"])) if draw(st.integers(0, 59)) == 37 else "now"
    return RawReply(
        status,
        body,
        declared_length=short,
        delay_s=_SLOW_S if pace == "silent" else 0.0,  # nothing at all
        stall_s=_SLOW_S if pace == "stall" else 0.0,  # the headers, then nothing
        trickle_s=_SLOW_S if pace == "trickle" else 0.0,  # every byte soon, the whole reply late
    )


def _slow(reply: RawReply) -> bool:
    """Past the deadline: silent, trickled, or stalled before a body (a stall before no body is no wait)."""
    return bool(reply.delay_s or reply.trickle_s or (reply.stall_s and (reply.body or reply.declared_length)))


def _expected(replies: list[RawReply], retries: int) -> tuple[int, str]:
    """A row's attempts and outcome as the client's contract gives them: ``written``; ``failed at once:``
    or ``failed after retries:`` and the error's words; or ``answered`` (a JSON reply the row's checks
    judge: written, or failed at once)."""
    words = ""
    for attempt, reply in enumerate(replies[: retries + 1], start=1):
        if _slow(reply):
            words = f"within --timeout {_DEADLINE_S:g} s"
        elif reply.status in _RETRY:
            words = f"HTTP {reply.status} from"
        elif not 200 <= reply.status < 300:
            return attempt, f"failed at once: HTTP {reply.status} from"
        elif reply.declared_length:
            words = "broke off its reply"
        else:
            try:
                json.loads(reply.body)
            except (ValueError, RecursionError):
                words = "returned invalid JSON"
            else:
                return attempt, "written" if reply.body == json.dumps(COMPLETION).encode() else "answered"
    return retries + 1, f"failed after retries: {words}"


def _regenerate_cli(argv: list[str]) -> int:
    """``specforge-kimi regenerate ARGV`` as ``cli.main`` runs it (a bad input: one ``error:`` line, exit 2),
    without building every other subcommand's parser for each of a thousand cases."""
    import argparse

    from specforge_kimi.data import regenerate

    parser = argparse.ArgumentParser(prog="specforge-kimi regenerate")
    regenerate.add_arguments(parser)
    try:
        return regenerate.run(parser.parse_args(argv))
    except KimiInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


@given(data=st.data())
@settings(max_examples=1000, **_SETTINGS)
def test_regenerate_survives_generated_replies(server, data):
    """Every row's attempts and outcome are the ones the client's contract gives its replies: a slow reply
    (trickled, stalled after the headers, or silent) ends at the deadline and is retried; the run's exit
    code and its one error line follow from the rows."""
    rows = data.draw(st.integers(1, 3))
    retries = data.draw(st.integers(0, 1))
    plans = [data.draw(st.lists(raw_replies(), min_size=retries + 1, max_size=retries + 1)) for _ in range(rows)]
    lock = threading.Lock()
    asked: dict[int, int] = {}

    def reply(payload):
        row = int(payload["messages"][-1]["content"].removeprefix("q"))
        with lock:
            attempt = asked[row] = asked.get(row, 0) + 1
        return plans[row][min(attempt, retries + 1) - 1]

    server.chat_reply = reply
    expected = [_expected(plan, retries) for plan in plans]
    slow = any(_slow(r) for plan in plans for r in plan)
    record("regenerate server replies")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        source = tmp / "in.jsonl"
        source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]
                                              + ROWS[0]["messages"][1:]}) + "\n" for i in range(rows)))  # fmt: skip
        out = tmp / "out.jsonl"
        argv = [str(source), "--server", server.url, "--out", str(out), "--concurrency", str(rows)]
        argv += ["--timeout", str(_DEADLINE_S if slow else _FAST_DEADLINE_S), "--max-retries", str(retries)]
        argv += ["--retry-delay", "0.001", "--no-progress"]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = _regenerate_cli(argv)
        written = out.read_bytes()
        assert written == b"" or written.endswith(b"\n")  # no torn line
        done = {json.loads(line)["regenerate"]["source_line"] - 1 for line in written.splitlines()}
        errors = {
            e["line"] - 1: e["error"]
            for e in map(json.loads, (tmp / "out.jsonl.errors.jsonl").read_text().splitlines())
        }
        assert sorted([*done, *errors]) == list(range(rows))  # every row once: an output line or an error line
        assert sorted(p.name for p in tmp.iterdir()) == ["in.jsonl", "out.jsonl", "out.jsonl.errors.jsonl"]
    server.chat_reply = None
    for row, (attempts, outcome) in enumerate(expected):
        assert asked.get(row, 0) == attempts, (row, outcome, errors.get(row))
        if outcome == "written":
            assert row in done
        elif outcome.startswith("failed"):
            error = errors[row]
            assert outcome.split(": ", 1)[1] in error and "\n" not in error, (outcome, error)
            assert (f"(after {retries} retries)" in error) == outcome.startswith("failed after retries")
        else:
            assert row in done or "retries)" not in errors[row]  # judged at once, never retried
    failed = [row for row, (_, outcome) in enumerate(expected) if outcome.startswith("failed")]
    lines = err.getvalue().strip().splitlines()
    if not errors:
        assert code == 0
    elif failed and not done:
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: no row was regenerated"), lines
    elif failed:
        assert code == 1
    else:  # errors only from rows the checks judged: skipped (0), failed (1; 2 when none was written)
        assert code in (0, 1) or (code == 2 and not done and len(lines) == 1)
