"""``specforge-kimi regenerate`` against a small OpenAI-compatible server started by the test
(``tests/openai_server.py``: deterministic K2.5-like replies, failure injection, every request recorded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from openai_server import FakeServer, RawReply, respond

from specforge_kimi.data.regenerate import Interrupted, RegenerateOptions, regenerate
from specforge_kimi.errors import KimiInputError


def main(argv):
    """``specforge-kimi regenerate ARGV``."""
    from specforge_kimi.cli import main as cli_main

    return cli_main(["regenerate", *argv])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def rows_input(tmp_path: Path) -> Path:
    rows = [
        {"id": "a", "messages": [user("one"), assistant("old one"), user("two"), assistant("old two")]},
        {"conversations": [{"from": "human", "value": "sharegpt"}, {"from": "gpt", "value": "old"}]},
        {"id": "tool", "tools": TOOLS, "messages": [
            user("weather:Paris"),
            assistant("", tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]),
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            assistant("old answer"),
        ]},
        {"id": "diverge", "tools": TOOLS, "messages": [
            user("weather:Rome"),
            assistant("", tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Milan"}'}}]),
            {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
            assistant("old"),
        ]},
        {"messages": [user([{"type": "image_url", "image_url": {"url": "u"}}]), assistant("a cat")]},
        "{broken json",
        {"messages": [user("inline"), assistant("x")]},
        {"messages": [user("long"), assistant("x")]},
    ]  # fmt: skip
    for i in range(8, 20):
        rows.append({"messages": [user(f"q{i}"), assistant("old")]})
    path = tmp_path / "in.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def options(source: Path, out: Path, server: FakeServer, **kw) -> RegenerateOptions:
    base = dict(
        input_path=source,
        out_path=out,
        server=server.url,
        concurrency=4,
        retry_delay_s=0.01,
        max_retries=3,
    )
    base.update(kw)
    return RegenerateOptions(**base)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerates_assistant_turns_with_reasoning(tmp_path, server):
    source = rows_input(tmp_path)
    out = tmp_path / "out.jsonl"
    counts = regenerate(options(source, out, server))
    rows = read(out)
    by_line = {r["regenerate"]["source_line"]: r for r in rows}
    assert [r["regenerate"]["source_line"] for r in rows] == sorted(by_line)  # input order
    assert counts["written"] == len(rows) == 17 and counts["skipped"] == 3 and counts["failed"] == 0

    first = by_line[1]
    assert first["id"] == "a"
    assert first["messages"] == [
        user("one"), assistant("echo one", reasoning_content="think one"),
        user("two"), assistant("echo two", reasoning_content="think two"),
    ]  # fmt: skip
    # history is sent with its regenerated reasoning; the template decides what the model sees
    second_request = next(r for r in server.requests if r["messages"][-1]["content"] == "two")
    assert second_request["messages"][1] == assistant("echo one", reasoning_content="think one")
    assert second_request["model"] == "kimi-k2.5-test"
    assert all(r["chat_template_kwargs"] == {"thinking": True} for r in server.requests)  # the default

    assert by_line[2]["messages"][1] == assistant("echo sharegpt", reasoning_content="think sharegpt")

    tool = by_line[3]
    assert tool["regenerate"] == {"source_line": 3, "regenerated_turns": 2, "truncated": False}
    assert tool["tools"] == TOOLS
    call = tool["messages"][1]["tool_calls"][0]
    assert call["id"] == "functions.get_weather:0" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert tool["messages"][2] == {
        "role": "tool",
        "content": "18C",
        "tool_call_id": "functions.get_weather:0",
    }
    assert tool["messages"][3] == assistant("It is 18C.", reasoning_content="Report the tool result.")

    diverged = by_line[4]  # target calls Rome, source called Milan: its result cannot be reused
    assert diverged["regenerate"]["truncated"] is True
    assert (
        len(diverged["messages"]) == 2
        and diverged["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    )

    assert by_line[7]["messages"][1] == assistant("visible answer", reasoning_content="thought inline")
    errors = {e["line"]: e["error"] for e in read(tmp_path / "out.jsonl.errors.jsonl")}
    assert sorted(errors) == [5, 6, 8]
    assert "image/video" in errors[5] and "invalid JSON" in errors[6] and "finish_reason=length" in errors[8]


def test_output_feeds_prepare(tmp_path, server):
    from specforge_kimi.data.prepare import PrepareOptions, prepare
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    source = rows_input(tmp_path)
    regenerate(options(source, tmp_path / "out.jsonl", server))
    summary = prepare(PrepareOptions(tmp_path / "out.jsonl", tmp_path / "prepared"), build_standin_tokenizer())
    assert summary["rows"] == 17 and summary["errors"]["count"] == 0


def test_retries_with_backoff(tmp_path, server):
    server.fail_first_attempts = 2
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"messages": [user(f"q{i}"), assistant("old")]}) + "\n" for i in range(5)))
    counts = regenerate(options(source, tmp_path / "out.jsonl", server, max_retries=2))
    assert counts["written"] == 5 and counts["failed"] == 0
    assert sorted(server.attempts.values()) == [3] * 5  # two 503s, then success, per request


def test_concurrency_limit(tmp_path, server):
    server.latency_s = 0.3  # long enough that 3 requests overlap even on a loaded 2-core machine
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"messages": [user(f"q{i}"), assistant("old")]}) + "\n" for i in range(24)))
    regenerate(options(source, tmp_path / "out.jsonl", server, concurrency=3))
    assert server.max_in_flight == 3


def test_resume_after_interruption(tmp_path, server):
    source = rows_input(tmp_path)
    full = tmp_path / "full.jsonl"
    regenerate(options(source, full, server))
    full_requests = len(server.requests)

    # A run that dies part-way: the server stops answering after 9 requests, --on-error fail.
    partial_server = FakeServer()
    try:
        partial_server.fail_after = 9
        out = tmp_path / "out.jsonl"
        with pytest.raises(KimiInputError):
            regenerate(options(source, out, partial_server, on_error="fail", max_retries=1))
        done_first = read(out)
        assert 0 < len(done_first) < 17
        # and a torn last line, as a kill in the middle of a write leaves it
        with open(out, "a") as stream:
            stream.write('{"messages": [{"role": "us')
        with pytest.raises(KimiInputError, match="--resume"):
            regenerate(options(source, out, partial_server))
    finally:
        partial_server.close()

    resumed = FakeServer()
    try:
        code = main(
            [
                str(source),
                "--server",
                resumed.url,
                "--out",
                str(out),
                "--resume",
                "--retry-delay",
                "0.01",
            ]
        )
        assert code == 0
        assert out.read_text() == full.read_text()
        done_lines = {r["regenerate"]["source_line"] for r in done_first}
        asked = {json.dumps(r["messages"][0]) for r in resumed.requests}
        for row in done_first:  # nothing already written was requested again
            assert json.dumps(row["messages"][0]) not in asked
        assert len(resumed.requests) == full_requests - sum(r["regenerate"]["regenerated_turns"] for r in done_first)
        assert done_lines
    finally:
        resumed.close()


def test_dead_server_stops_the_run(tmp_path, server):
    server.fail_after = 0
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"messages": [user(f"q{i}"), assistant("old")]}) + "\n" for i in range(50)))
    with pytest.raises(KimiInputError, match="rows in a row failed"):
        regenerate(options(source, tmp_path / "out.jsonl", server, max_retries=0, max_consecutive_failures=5))
    assert read(tmp_path / "out.jsonl") == []


def test_existing_output_needs_resume_or_overwrite(tmp_path, server):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": [user("q"), assistant("a")]}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("")
    with pytest.raises(KimiInputError, match="pass --resume"):
        regenerate(options(source, out, server))
    assert regenerate(options(source, out, server, overwrite=True))["written"] == 1


def _one_row_input(path: Path, rows: int = 1) -> Path:
    path.write_text("".join(json.dumps({"messages": [user(f"q{i}"), assistant("old")]}) + "\n" for i in range(rows)))
    return path


@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "errors file"])
def test_out_that_is_the_input_is_refused_before_writing(tmp_path, server, capsys, how):
    """Issue 32: ``--out IN --overwrite`` emptied IN and exited 0."""
    source = _one_row_input(tmp_path / ("in.jsonl.errors.jsonl" if how == "errors file" else "in.jsonl"), rows=3)
    before = source.read_bytes()
    out = {
        "same path": source,
        "symlink": tmp_path / "link.jsonl",
        "hard link": tmp_path / "hard.jsonl",
        "errors file": tmp_path / "in.jsonl",
    }[how]
    if how == "symlink":
        out.symlink_to(source)
    elif how == "hard link":
        out.hardlink_to(source)
    code = main([str(source), "--server", server.url, "--out", str(out), "--overwrite"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is the input file" in err and err.startswith("error: ")
    assert source.read_bytes() == before
    assert server.requests == []


def test_http_400_to_every_request_fails_the_run(tmp_path, server, capsys):
    """Issue 32: 4xx answers were counted as skipped rows, so the run wrote nothing and exited 0."""
    server.chat_reply = lambda payload: RawReply(400, b'{"error": "bad request"}')
    source = _one_row_input(tmp_path / "in.jsonl", rows=4)
    out = tmp_path / "out.jsonl"
    code = main([str(source), "--server", server.url, "--out", str(out), "--retry-delay", "0.01"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "no row was regenerated: 4 failed (first, line 1: HTTP 400 from" in err
    assert len(server.requests) == 4  # not retried: the same request would be refused again
    assert [e["line"] for e in read(tmp_path / "out.jsonl.errors.jsonl")] == [1, 2, 3, 4]
    _one_row_input(source, rows=30)
    with pytest.raises(KimiInputError, match="5 rows in a row failed .* HTTP 400"):
        regenerate(options(source, out, server, overwrite=True, max_consecutive_failures=5, concurrency=1))


@pytest.mark.parametrize(
    "reply",
    [
        RawReply(200, b'{"choices":[{"message":"oops"}]}'),
        RawReply(200, b'{"choices":[]}'),
        RawReply(200, b'{"choices":"x"}'),
        RawReply(200, b"[1, 2]"),
        RawReply(200, b"null"),
        RawReply(200, b'{"choices":[{"message":{"content":5}}]}'),
        RawReply(200, b'{"choices":[{"message":{"content":"a","reasoning_content":["x"]}}]}'),
        RawReply(200, b'{"choices":[{"message":{"content":"a","tool_calls":{"a":1}}}]}'),
        RawReply(200, b'{"choices":[{"message":{"content":"a","tool_calls":[{"function":5}]}}]}'),
        RawReply(200, b'{"choices":[{"finish_reason":7,"message":{"content":"a"}}]}'),
        RawReply(200, b"<html>gateway</html>"),
        RawReply(200, b"\xff\xfe{}"),
        RawReply(200, b'{"choices":[{"message":{"content":"cut'),
        RawReply(200, b'{"choices":[{"message":{"content":"a"}}]}', declared_length=4096),
        RawReply(200, b"[" * 100_000 + b"]" * 100_000),
    ],
    ids=lambda r: r.body[:24].decode("latin-1") + (f" of {r.declared_length}" if r.declared_length else ""),
)
def test_malformed_reply_is_a_counted_row_error(tmp_path, server, capsys, reply):
    """Issue 32: a reply of the wrong shape ended the run with an AttributeError traceback."""
    server.chat_reply = lambda payload: reply
    source = _one_row_input(tmp_path / "in.jsonl", rows=2)
    out = tmp_path / "out.jsonl"
    code = main([str(source), "--server", server.url, "--out", str(out), "--max-retries", "1", "--retry-delay", "0.01"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no row was regenerated: 2 failed" in err
    errors = read(tmp_path / "out.jsonl.errors.jsonl")
    assert [e["line"] for e in errors] == [1, 2] and all("\n" not in e["error"] for e in errors)
    assert out.read_text() == ""


def test_unreachable_server_is_a_clear_error(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": [user("q"), assistant("a")]}) + "\n")
    fake = FakeServer()
    url = fake.url
    fake.close()  # nothing listens on this port any more
    code = main([str(source), "--server", url, "--out", str(tmp_path / "o.jsonl"), "--max-retries", "0"])
    assert code == 2
    assert not (tmp_path / "o.jsonl").exists()  # so the retry with the right --server needs no --resume


def test_keep_unfinished_keeps_cut_generations(tmp_path, server):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": [user("long"), assistant("old")]}) + "\n")
    counts = regenerate(options(source, tmp_path / "skip.jsonl", server))
    assert counts["written"] == 0  # default: a generation cut by max_tokens has no end -> row skipped
    counts = regenerate(options(source, tmp_path / "keep.jsonl", server, keep_unfinished=True))
    assert counts["written"] == 1
    assert read(tmp_path / "keep.jsonl")[0]["messages"][1]["content"] == "..."


@pytest.mark.parametrize("mode, expected", [("off", [False, False]), ("auto", [True, False])])
def test_thinking_mode(tmp_path, server, mode, expected):
    """``--thinking auto`` keeps each turn's mode (a draft serves both); ``off`` asks for none."""
    source = tmp_path / "in.jsonl"
    source.write_text(
        json.dumps({"messages": [user("r"), assistant("old", reasoning_content="why")]})
        + "\n"
        + json.dumps({"messages": [user("p"), assistant("old")]})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                str(source),
                "--server",
                server.url,
                "--out",
                str(out),
                "--thinking",
                mode,
                "--no-progress",
                "--concurrency",
                "1",
            ]
        )
        == 0
    )
    asked = {r["messages"][-1]["content"]: r["chat_template_kwargs"]["thinking"] for r in server.requests}
    assert [asked["r"], asked["p"]] == expected
    rows = read(out)
    assert [bool(r["messages"][1].get("reasoning_content")) for r in rows] == expected


def test_thinking_mode_is_checked():
    from specforge_kimi.data.conversation import Message
    from specforge_kimi.data.regenerate import turn_thinking

    with pytest.raises(KimiInputError, match="on, off or auto"):
        turn_thinking("maybe", Message(role="assistant", content="x"))


def test_prompt_mix_records_regenerate_with_thinking_on(tmp_path, server):
    """``prompt_mix.records`` (a user prompt and an empty assistant turn) is what ``regenerate``
    fills: every row answered once, with thinking on as the bench asks those sets."""
    from specforge_kimi.data import prompt_mix

    source = tmp_path / "mix.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in prompt_mix.records(6, seed=0)))
    out = tmp_path / "mix-regen.jsonl"
    counts = regenerate(options(source, out, server, thinking="on"))
    rows = read(out)
    assert counts["written"] == 6 and counts["skipped"] == 0 and counts["failed"] == 0
    for row, (_, text) in zip(rows, prompt_mix.prompts(6, seed=0), strict=False):
        assert row["messages"] == [user(text), assistant(f"echo {text}", reasoning_content=f"think {text}")]
    assert all(r["chat_template_kwargs"] == {"thinking": True} for r in server.requests)


# -- slow and silent servers, Ctrl-C, two runs on one output, odd --out (issue 43) ------------------------------


def _reply_ok() -> bytes:
    return json.dumps(
        {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}
    ).encode()


@pytest.mark.parametrize(
    "slow",
    [
        RawReply(200, _reply_ok(), trickle_s=4.0),  # every byte comes well within the timeout; the whole does not
        RawReply(200, _reply_ok(), stall_s=4.0),  # headers, then nothing
        RawReply(200, _reply_ok(), delay_s=4.0),  # nothing at all
    ],
    ids=["trickle", "stall after headers", "silent"],
)
def test_timeout_bounds_the_whole_request(tmp_path, server, capsys, slow):
    """Issue 43: ``--timeout`` bounded each socket read, so a reply that trickled a byte at a time never
    timed out. Now each attempt ends at the deadline, whole, and the row fails after its retries."""
    import time

    server.chat_reply = lambda payload: slow
    source = _one_row_input(tmp_path / "in.jsonl", rows=2)
    out = tmp_path / "out.jsonl"
    started = time.monotonic()
    code = main([str(source), "--server", server.url, "--out", str(out), "--timeout", "0.3", "--max-retries", "1",
                 "--retry-delay", "0.01", "--concurrency", "2", "--no-progress"])  # fmt: skip
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no row was regenerated: 2 failed" in err
    assert elapsed < 2.5  # two attempts of 0.3 s per row, rows in parallel; the reply itself takes 4 s
    errors = read(tmp_path / "out.jsonl.errors.jsonl")
    assert [e["line"] for e in errors] == [1, 2]
    assert all("no whole reply from" in e["error"] and "within --timeout 0.3 s (after 1 retries)" in e["error"]
               for e in errors)  # fmt: skip
    assert len(server.requests) == 4  # each row tried twice


def test_a_slow_reply_within_the_timeout_is_kept(tmp_path, server):
    """The deadline is the request's, not shorter: a reply that trickles in under it is a written row."""
    server.chat_reply = lambda payload: RawReply(200, _reply_ok(), trickle_s=0.4)
    source = _one_row_input(tmp_path / "in.jsonl", rows=1)
    counts = regenerate(options(source, tmp_path / "out.jsonl", server, timeout_s=5.0, max_retries=0))
    assert counts["written"] == 1 and read(tmp_path / "out.jsonl")[0]["messages"][1]["content"] == "ok"


def _holding_run(tmp_path: Path, server: FakeServer, rows: int, answered: int, preexec_fn=None):
    """A ``regenerate`` subprocess whose first ``answered`` rows are answered and the rest stall; returns
    (process, source, out) once ``answered`` lines are in OUT. ``preexec_fn`` runs in the child before
    the exec (a signal disposition or mask set there is what the run inherits)."""
    import subprocess
    import sys
    import time

    def reply(payload):
        text = payload["messages"][-1]["content"]
        if int(text[1:]) < answered:
            return RawReply(200, json.dumps({"choices": [{"finish_reason": "stop", "message": {
                "role": "assistant", "content": f"echo {text}"}}]}).encode())  # fmt: skip
        return RawReply(200, b"{}", delay_s=60)

    server.chat_reply = reply
    source = _one_row_input(tmp_path / "in.jsonl", rows=rows)
    source.write_text("{broken\n" + source.read_text())  # line 1: one line for the errors file
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "specforge_kimi", "regenerate", str(source), "--server", server.url,
            "--out", str(out), "--concurrency", "4", "--no-progress", "--max-retries", "3"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + 60
    errors = tmp_path / "out.jsonl.errors.jsonl"
    while not (out.exists() and out.read_text().count("\n") >= answered and errors.exists() and errors.read_text()):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run wrote nothing"
        time.sleep(0.05)
    time.sleep(0.3)  # the stalled requests are in flight
    return process, source, out


def test_ctrl_c_abandons_requests_in_flight_and_resume_completes(tmp_path, server):
    """Issue 43: Ctrl-C waited for the requests in flight (up to the timeout times the retries). Now they are
    abandoned at once, OUT keeps whole lines only, the exit is one line and 130, and ``--resume`` finishes
    the file with every row once. A second run on the same OUT meanwhile refuses, naming the holder, and
    leaves the errors file alone."""
    import signal
    import subprocess
    import sys

    process, source, out = _holding_run(tmp_path, server, rows=12, answered=3)
    second = subprocess.run(
        [sys.executable, "-m", "specforge_kimi", "regenerate", str(source), "--server", server.url,
         "--out", str(out), "--resume"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 2 and second.stderr.count("\n") == 1
    assert f"being written by another regenerate (pid {process.pid}," in second.stderr
    _stop_then_resume(server, process, source, out, signal.SIGINT, 130, "interrupted: 3 rows written this run")


def _stop_then_resume(server, process, source: Path, out: Path, signum: int, code: int, line_start: str) -> None:
    """Send ``signum`` to a ``_holding_run(rows=12, answered=3)``: it ends at once with exit ``code`` and
    one line starting ``line_start`` (no traceback), OUT holds whole lines only, the errors file is untouched,
    the lock is gone; ``--resume`` then finishes the file with every row once, asking only for the rest."""
    import time

    errors_path = out.with_name(out.name + ".errors.jsonl")
    errors_before = errors_path.read_text()
    started = time.monotonic()
    process.send_signal(signum)
    try:
        _, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
    assert time.monotonic() - started < 2.0
    assert process.returncode == code, stderr
    assert stderr.count("\n") == 1 and stderr.startswith(line_start) and "Traceback" not in stderr
    assert out.read_text().endswith("\n") and [r["regenerate"]["source_line"] for r in read(out)] == [2, 3, 4]
    assert errors_path.read_text() == errors_before and [e["line"] for e in read(errors_path)] == [1]
    assert not out.with_name(out.name + ".lock").exists()

    server.chat_reply = None  # the server answers everything now
    asked_before = len(server.requests)
    assert main([str(source), "--server", server.url, "--out", str(out), "--resume", "--no-progress"]) == 0
    assert [r["regenerate"]["source_line"] for r in read(out)] == list(range(2, 14))  # each row once, in order
    assert len(server.requests) - asked_before == 9  # only the rows not yet written were asked
    assert [e["line"] for e in read(errors_path)] == [1]


def _start_with_sigint_ignored():
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_with_sigint_blocked():
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.mark.parametrize("start", [_start_with_sigint_ignored, _start_with_sigint_blocked], ids=["ignored", "blocked"])
def test_kill_int_stops_a_run_started_with_sigint_ignored_or_blocked(tmp_path, server, start):
    """A run inherits SIGINT ignored when a shell script starts it in the background (and a parent can
    leave it blocked): the test above, run from a pytest started that way, hung for the stalled requests.
    The run takes SIGINT for itself: ``kill -INT``, which the lock's refusal names, stops it at once."""
    import signal
    import time

    process, _, out = _holding_run(tmp_path, server, rows=8, answered=2, preexec_fn=start)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
    assert time.monotonic() - started < 2.0
    assert process.returncode == 130 and stderr.startswith("interrupted: 2 rows written this run")
    assert [r["regenerate"]["source_line"] for r in read(out)] == [2, 3]


def _start_with_sigterm_blocked():
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


@pytest.mark.parametrize("start", [None, _start_with_sigterm_blocked], ids=["default", "blocked"])
def test_sigterm_stops_a_run_like_ctrl_c_and_resume_completes(tmp_path, server, start):
    """SIGTERM (``kill``, ``timeout``, systemd, Slurm, container runtimes) killed the run mid-write with no
    word. Now it stops like Ctrl-C: requests in flight abandoned at once, OUT and the errors file keep
    whole lines only, one line naming the signal, exit 143 (128 + 15), the lock released, and ``--resume``
    finishes the file with every row once. A run started with SIGTERM blocked takes it too."""
    import signal

    process, source, out = _holding_run(tmp_path, server, rows=12, answered=3, preexec_fn=start)
    line = f"terminated (SIGTERM): 3 rows written this run, {out} holds whole lines only"
    _stop_then_resume(server, process, source, out, signal.SIGTERM, 143, line)


def _main_thread_blocks(signum: int) -> bool:
    """Whether the main thread blocks ``signum`` (its mask, read from any thread through /proc)."""
    import threading

    status = Path(f"/proc/self/task/{threading.main_thread().native_id}/status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return bool(mask >> (signum - 1) & 1)


def _own_sigterm_handler(signum, frame):
    raise AssertionError("the caller's own handler, never called here")


@pytest.mark.parametrize("start", ["default", "ignored", "own handler", "blocked"])
def test_sigterm_disposition_during_a_run_and_restored_after(tmp_path, server, start):
    """While the run holds OUT.lock, SIGTERM at the default action is the run's (it would kill a write
    half done) and a blocked one is unblocked; an ignored one stays ignored, the parent's choice (a
    SIGTERM sent then changes nothing: every row is written), and a handler of the caller's own is left
    alone. After the run the disposition and the mask are what they were."""
    import signal
    import threading

    previous = {"ignored": signal.SIG_IGN, "own handler": _own_sigterm_handler}.get(start, signal.SIG_DFL)
    seen = []
    one_kill = threading.Lock()  # one SIGTERM, sent while the run holds OUT.lock: a later one, from a request
    # the run abandoned, could land after SIG_DFL is back and end pytest instead of failing this test

    def reply(payload):  # in the server's thread: the disposition is the process's, the mask the main thread's
        seen.append((signal.getsignal(signal.SIGTERM), _main_thread_blocks(signal.SIGTERM)))
        if start == "ignored" and one_kill.acquire(blocking=False):
            os.kill(os.getpid(), signal.SIGTERM)
        return RawReply(200, json.dumps(respond(payload)).encode())

    server.chat_reply = reply
    source = _one_row_input(tmp_path / "in.jsonl", rows=3)
    saved = signal.signal(signal.SIGTERM, previous)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK if start == "blocked" else signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        try:
            counts = regenerate(options(source, tmp_path / "out.jsonl", server))
        except Interrupted as exc:  # a KeyboardInterrupt: uncaught, it would end the whole pytest session
            pytest.fail(f"a SIGTERM the run was started with ignored stopped it: {exc}")
        after = signal.getsignal(signal.SIGTERM), _main_thread_blocks(signal.SIGTERM)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, saved)
    assert counts["written"] == 3 and len(seen) == 3
    during = {handler for handler, _ in seen}
    if start in ("default", "blocked"):
        assert len(during) == 1 and callable(*during) and during != {_own_sigterm_handler}
    else:
        assert during == {previous}
    assert not any(blocked for _, blocked in seen)
    assert after == (previous, start == "blocked")


def test_second_run_on_a_held_output_refuses_at_once(tmp_path, server, capsys):
    from specforge_kimi.data.output_file import OutputLock

    source = _one_row_input(tmp_path / "in.jsonl", rows=2)
    out = tmp_path / "out.jsonl"
    out.write_text("")
    errors = tmp_path / "out.jsonl.errors.jsonl"
    errors.write_text('{"line": 7, "error": "from the first run"}\n')
    with OutputLock(tmp_path / "out.jsonl.lock", out):
        for flags in ([], ["--resume"], ["--overwrite"]):
            code = main([str(source), "--server", server.url, "--out", str(out), *flags])
            err = capsys.readouterr().err.strip()
            assert code == 2 and len(err.splitlines()) == 1
            assert f"being written by another regenerate (pid {os.getpid()}," in err
    assert errors.read_text() == '{"line": 7, "error": "from the first run"}\n' and out.read_text() == ""
    assert server.requests == []
    assert not (tmp_path / "out.jsonl.lock").exists()  # released and removed
    assert main([str(source), "--server", server.url, "--out", str(out), "--resume"]) == 0


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_a_planted_lock_file_is_never_written_through(tmp_path, server, capsys, kind):
    source = _one_row_input(tmp_path / "in.jsonl", rows=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = tmp_path / "out.jsonl.lock"
    lock.symlink_to(victim) if kind == "symlink" else lock.hardlink_to(victim)
    code = main([str(source), "--server", server.url, "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "lock file" in err
    assert victim.read_text() == "precious\n" and not (tmp_path / "out.jsonl").exists()


def _odd_out(tmp_path: Path, kind: str) -> Path:
    if kind == "directory":
        (tmp_path / "d").mkdir()
        return tmp_path / "d"
    if kind == "dangling symlink":
        (tmp_path / "link").symlink_to(tmp_path / "nowhere.jsonl")
        return tmp_path / "link"
    if kind == "symlink to a directory":
        (tmp_path / "d").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "d")
        return tmp_path / "link"
    if kind == "symlink to a file":
        (tmp_path / "real.jsonl").write_text("")
        (tmp_path / "link").symlink_to(tmp_path / "real.jsonl")
        return tmp_path / "link"
    if kind == "missing parent":
        return tmp_path / "no" / "such" / "out.jsonl"
    if kind == "parent is a file":
        (tmp_path / "f").write_text("x")
        return tmp_path / "f" / "out.jsonl"
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return tmp_path / "fifo"
    if kind == "errors file is a directory":
        (tmp_path / "out.jsonl.errors.jsonl").mkdir()
        return tmp_path / "out.jsonl"
    if kind == "errors file is a symlink":
        (tmp_path / "victim.txt").write_text("precious\n")
        (tmp_path / "out.jsonl.errors.jsonl").symlink_to(tmp_path / "victim.txt")
        return tmp_path / "out.jsonl"
    assert kind == "unwritable parent"
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    return tmp_path / "ro" / "out.jsonl"


ODD_OUTS = {
    "directory": "is a directory",
    "dangling symlink": "is a symbolic link (to ",
    "symlink to a directory": "is a symbolic link (to ",
    "symlink to a file": "is a symbolic link (to ",
    "missing parent": "does not exist; create it first",
    "parent is a file": "Not a directory",
    "fifo": "is not a regular file",
    "errors file is a directory": "the errors file",
    "errors file is a symlink": "the errors file",
    "unwritable parent": "permission denied",
}


@pytest.mark.parametrize("kind", sorted(ODD_OUTS))
def test_odd_out_is_one_line_and_writes_nothing(tmp_path, server, capsys, kind):
    """Issue 43: ``--out`` naming a directory or a dangling symlink ended in a traceback or an unclear
    message. Every odd --out is one line (exit 2), before anything is written or asked."""
    if kind == "unwritable parent" and os.geteuid() == 0:
        pytest.skip("root writes in any directory")
    source = _one_row_input(tmp_path / "in.jsonl", rows=1)
    out = _odd_out(tmp_path, kind)
    before = sorted((p.name, p.is_symlink()) for p in tmp_path.rglob("*"))
    code = main([str(source), "--server", server.url, "--out", str(out), "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert ODD_OUTS[kind] in err
    assert sorted((p.name, p.is_symlink()) for p in tmp_path.rglob("*")) == before
    assert server.requests == []
    if kind == "errors file is a symlink":
        assert (tmp_path / "victim.txt").read_text() == "precious\n"


def test_an_interrupted_write_is_cut_back_to_whole_lines(tmp_path, monkeypatch):
    """A Ctrl-C that lands inside a line's write: the line is cut off when the writer closes."""
    from specforge_kimi.data import output_file

    path = tmp_path / "out.jsonl"
    writer = output_file.LineWriter(path, "--out")
    writer.write_line('{"a": 1}')
    real_write = os.write

    def half_then_interrupt(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise KeyboardInterrupt

    monkeypatch.setattr(output_file.os, "write", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        writer.write_line('{"b": 2, "long": "' + "x" * 100 + '"}')
    monkeypatch.setattr(output_file.os, "write", real_write)
    assert path.read_text().startswith('{"a": 1}\n{"b"')  # half a line, as a Ctrl-C leaves it
    writer.close(whole=False)
    assert path.read_text() == '{"a": 1}\n'


def test_abort_ends_requests_in_flight_at_once(server):
    """``ChatClient.abort`` (Ctrl-C) shuts down the sockets of the requests in flight: a request the server
    stalls on ends now, not at its deadline, and is not retried."""
    import threading
    import time

    from specforge_kimi.data.chat_client import ChatClient, RequestFailed

    server.chat_reply = lambda payload: RawReply(200, _reply_ok(), delay_s=30)
    client = ChatClient(server.url, timeout_s=60, max_retries=5, retry_delay_s=0.01)
    outcome = []

    def ask():
        try:
            client.post("/chat/completions", {"messages": []})
        except RequestFailed as exc:
            outcome.append(str(exc))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    while len(server.requests) < 3:
        time.sleep(0.01)
    started = time.monotonic()
    client.abort()
    for thread in threads:
        thread.join(timeout=5)
    assert time.monotonic() - started < 1.0
    assert len(outcome) == 3 and all("abandoned (interrupted)" in o for o in outcome)
    assert len(server.requests) == 3  # none retried
    with pytest.raises(RequestFailed, match="abandoned"):  # and nothing later is sent
        client.get("/models")


def test_abort_before_a_request_registers_its_socket_ends_that_request(server, monkeypatch):
    """An abort() that lands after a request started but before its socket is registered (so the abort
    cannot shut it down) ends that request at once, abandoned like the others, not after the server's
    reply."""
    import time

    from specforge_kimi.data.chat_client import ChatClient, RequestFailed

    server.chat_reply = lambda payload: RawReply(200, _reply_ok(), delay_s=5)
    client = ChatClient(server.url, timeout_s=60, max_retries=5, retry_delay_s=0.01)
    track = client._track

    def abort_then_track(sock):
        client.abort()  # as a Ctrl-C between the request's start and its socket's registration
        track(sock)

    monkeypatch.setattr(client, "_track", abort_then_track)
    started = time.monotonic()
    with pytest.raises(RequestFailed, match=r"abandoned \(interrupted\)"):
        client.post("/chat/completions", {"messages": []})
    assert time.monotonic() - started < 1.0
    assert server.requests == []  # nothing was sent


@pytest.mark.parametrize("kind", ["symlink", "hard link", "fifo"])
def test_output_lock_never_writes_through_what_is_planted(tmp_path, kind):
    """``OutputLock`` by itself (a link planted after ``regenerate``'s checks): ``O_NOFOLLOW``, one link only,
    a regular file only; the planted file is left as it was."""
    from specforge_kimi.data.output_file import OutputLock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = tmp_path / "out.jsonl.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(victim) if kind == "symlink" else lock.hardlink_to(victim)
    with pytest.raises(KimiInputError, match="lock file") as caught:
        OutputLock(lock, tmp_path / "out.jsonl").__enter__()
    assert "\n" not in str(caught.value)
    assert victim.read_text() == "precious\n" and os.path.lexists(lock)
