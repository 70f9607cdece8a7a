"""``specforge-kimi prepare``: outputs SpecForge reads, counts, malformed lines, determinism,
atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specforge_kimi.data import prepare as prepare_module
from specforge_kimi.data.prepare import PrepareOptions, prepare
from specforge_kimi.errors import KimiInputError


def main(argv):
    """``specforge-kimi prepare ARGV``."""
    from specforge_kimi.cli import main as cli_main

    return cli_main(["prepare", *argv])


PROMPTS = "prompts.jsonl"
IM_END, IM_ASSISTANT, THINK, END_THINK = 163586, 163588, 163606, 163607

GOOD = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Add."}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y" * 50}]},
]  # fmt: skip


def write_jsonl(path: Path, lines: list) -> Path:
    with open(path, "w", encoding="utf-8") as out:
        for line in lines:
            out.write(line if isinstance(line, str) else json.dumps(line))
            out.write("\n")
    return path


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tok():
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    return build_standin_tokenizer()


def run(tmp_path: Path, tok, lines: list, **options) -> tuple[dict, Path]:
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / options.pop("out_name", "out")
    summary = prepare(PrepareOptions(input_path=source, out_dir=out, **options), tok)
    return summary, out


def test_outputs_in_specforge_formats(tmp_path, tok):
    summary, out = run(tmp_path, tok, GOOD, shuffle=False, draft_vocab_size=64)
    assert sorted(p.name for p in out.iterdir()) == [
        "prompts.jsonl", "summary.json", "vocab_mapping.json", "vocab_mapping.pt",
    ]  # fmt: skip
    rows = read_rows(out)
    assert [set(r) for r in rows] == [{"input_ids", "loss_mask"}] * 3
    first = rows[0]
    # the row for the thinking turn: ... <think> | Add.</think>4<|im_end|>
    assert first["input_ids"][-8:] == [THINK, *b"Add.", END_THINK, *b"4", IM_END]
    assert first["loss_mask"][-8:] == [0, 1, 1, 1, 1, 1, 1, 1]
    assert sum(first["loss_mask"]) == 7

    # SpecForge's own reader for data.prompts_path accepts it unchanged
    from specforge.data.prompt_builder import prepare_prompt_tasks

    tasks = prepare_prompt_tasks(
        out / "prompts.jsonl", None, chat_template="kimi-k2.5", max_length=8192,
        is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None,
        num_proc=None,
    )  # fmt: skip
    assert [t["payload"] for t in tasks] == rows

    mapping = torch.load(out / "vocab_mapping.pt")
    assert set(mapping) == {"d2t", "t2d"}
    from specforge_kimi.data.vocab_mapping import load_vocab_mapping

    loaded = load_vocab_mapping(out / "vocab_mapping.pt")
    trained_ids = {i for r in rows for i, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m}
    assert trained_ids <= set(loaded.draft_ids)

    assert summary["rows"] == 3
    assert summary["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert summary["trained_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert summary["trained_fraction"] == round(summary["trained_tokens"] / summary["tokens"], 6)
    assert json.loads((out / "summary.json").read_text())["rows"] == 3


def test_malformed_lines_are_skipped_with_line_numbers(tmp_path, tok):
    lines = [
        GOOD[0],
        "{not json",
        {"messages": [{"role": "robot", "content": "x"}]},
        "",
        {"text": "no messages"},
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": "[oops"},
            ]
        },
        [1, 2],
        GOOD[1],
    ]
    summary, out = run(tmp_path, tok, lines)
    assert summary["rows"] == 2
    assert summary["blank_lines"] == 1
    errors = {e["line"]: e["error"] for e in summary["errors"]["first"]}
    assert summary["errors"]["count"] == 5
    assert sorted(errors) == [2, 3, 5, 6, 7]
    assert errors[2].startswith("invalid JSON")
    assert "unsupported role 'robot'" in errors[3]
    assert "neither 'messages' nor 'conversations'" in errors[5]
    assert "tool_calls is a string that is not JSON" in errors[6]
    assert "expected a JSON object" in errors[7]


def test_on_error_fail_stops_with_the_line_and_leaves_nothing(tmp_path, tok, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [GOOD[0], GOOD[1], "{broken"])
    out = tmp_path / "out"
    code = main([str(source), "--out", str(out), "--standin-tokenizer", "--on-error", "fail"])
    assert code == 2
    assert f"{source}:3: invalid JSON" in capsys.readouterr().err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [source]  # no staging directory left behind


def test_drop_reasons_are_counted(tmp_path, tok):
    media = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            {"role": "assistant", "content": "a cat"},
        ]
    }
    no_answer = {"messages": [{"role": "user", "content": "hello?"}]}
    summary, _ = run(tmp_path, tok, [GOOD[0], media, no_answer, media])
    assert summary["dropped"] == {"media": 2, "no_assistant_turn": 1}
    assert summary["rows"] == 1


def test_max_length_truncate_and_drop(tmp_path, tok):
    long_row = GOOD[2]  # 131 stand-in tokens; its answer starts at token 80
    summary, out = run(tmp_path, tok, [GOOD[0], long_row], max_length=100, shuffle=False, out_name="t")
    assert summary["truncated_rows"] == 1 and summary["rows"] == 2
    rows = read_rows(out)
    assert [len(r["input_ids"]) for r in rows] == [38, 100]
    assert sum(rows[1]["loss_mask"]) == 20

    summary, out = run(tmp_path, tok, [GOOD[0], long_row], max_length=100, overflow="drop", out_name="d")
    assert summary["dropped"] == {"too_long": 1} and summary["rows"] == 1
    assert summary["truncated_rows"] == 0

    # cut before the answer starts: nothing to train, dropped and counted
    summary, _ = run(tmp_path, tok, [GOOD[0], long_row], max_length=60, out_name="n")
    assert summary["dropped"] == {"truncated_before_answer": 1}
    assert summary["truncated_rows"] == 0 and summary["rows"] == 1


def test_deterministic_for_same_input_and_seed(tmp_path, tok):
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}", "reasoning_content": f"r{i}"},
            ]
        }
        for i in range(200)
    ]
    _, a = run(tmp_path, tok, lines, seed=7, out_name="a")
    _, b = run(tmp_path, tok, lines, seed=7, out_name="b")
    _, c = run(tmp_path, tok, lines, seed=8, out_name="c")
    for name in ("prompts.jsonl", "vocab_mapping.pt"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    summary_a = json.loads((a / "summary.json").read_text())
    summary_b = json.loads((b / "summary.json").read_text())
    for summary in (summary_a, summary_b):
        summary.pop("run")
        summary["options"].pop("out_dir")
    assert summary_a == summary_b
    # another seed: same rows, another order
    assert (a / "prompts.jsonl").read_bytes() != (c / "prompts.jsonl").read_bytes()
    assert sorted((a / "prompts.jsonl").read_text().splitlines()) == sorted(
        (c / "prompts.jsonl").read_text().splitlines()
    )


def test_shuffle_over_several_buckets_keeps_every_row(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(prepare_module, "_SHUFFLE_BUCKET_BYTES", 2000)
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(300)
    ]
    _, shuffled = run(tmp_path, tok, lines, out_name="s")
    _, ordered = run(tmp_path, tok, lines, shuffle=False, out_name="o")
    rows = (shuffled / "prompts.jsonl").read_text().splitlines()
    assert rows != (ordered / "prompts.jsonl").read_text().splitlines()
    assert sorted(rows) == sorted((ordered / "prompts.jsonl").read_text().splitlines())


def test_failed_run_leaves_no_output(tmp_path, tok, monkeypatch):
    import specforge_kimi.data.vocab_mapping as vocab_mapping

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(vocab_mapping, "save_vocab_mapping", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        run(tmp_path, tok, GOOD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_existing_output_needs_overwrite(tmp_path, tok):
    _, out = run(tmp_path, tok, GOOD[:1])
    with pytest.raises(KimiInputError, match="already exists; pass --overwrite"):
        run(tmp_path, tok, GOOD)
    summary, out = run(tmp_path, tok, GOOD, overwrite=True)
    assert summary["rows"] == 3 and len(read_rows(out)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]

    stranger = tmp_path / "mine"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep me")
    with pytest.raises(KimiInputError, match="not a previous prepare output"):
        run(tmp_path, tok, GOOD, out_name="mine", overwrite=True)
    assert (stranger / "notes.txt").read_text() == "keep me"


def test_deeply_nested_line_is_a_counted_error_or_one_line(tmp_path, tok, capsys):
    """Issue 32: one line nested deeper than Python's recursion limit is a row error, not a traceback."""
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    summary, _ = run(tmp_path, tok, [GOOD[0], deep, GOOD[1]], shuffle=False)
    assert summary["rows"] == 2 and summary["errors"]["count"] == 1
    assert summary["errors"]["first"] == [{"line": 2, "error": "JSON nested too deeply"}]
    capsys.readouterr()
    source = write_jsonl(tmp_path / "deep.jsonl", [GOOD[0], deep])
    code = main([str(source), "--out", str(tmp_path / "o2"), "--standin-tokenizer", "--on-error", "fail"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"error: {source}:2: JSON nested too deeply"
    assert not (tmp_path / "o2").exists()


def test_lone_surrogate_escape_is_a_counted_error(tmp_path, tok):
    """Found by tests/unit/test_fuzz_data_path.py: a lone ``\\ud800`` reached the tokenizer (TypeError)."""
    lone = json.dumps(GOOD[0]).replace('"4"', '"\\ud800"')
    paired = json.dumps(GOOD[0]).replace('"4"', '"\\ud83d\\ude00"')  # an escaped pair is one character
    source = tmp_path / "in.jsonl"  # and as raw bytes (json.loads decodes bytes with surrogatepass)
    source.write_bytes(
        b"\n".join([lone.encode(), paired.encode(), lone.replace("\\ud800", "\udc00").encode("utf-8", "surrogatepass")])
    )
    summary = prepare(PrepareOptions(input_path=source, out_dir=tmp_path / "out", shuffle=False), tok)
    assert summary["rows"] == 1 and summary["errors"]["count"] == 2
    assert all("unpaired UTF-16 surrogate" in e["error"] for e in summary["errors"]["first"])


class _Killed(BaseException):
    """A kill -9: no cleanup of ours runs after it."""


def test_overwrite_killed_between_renames_keeps_the_old_output(tmp_path, tok, monkeypatch):
    """Issue 32: a kill between the swap's two renames leaves the old output whole at ``.out.previous``,
    and the next run puts it back before it looks at ``out``; each rename is followed by a directory fsync."""
    import os
    import subprocess

    import specforge_kimi.durable as durable

    first, out = run(tmp_path, tok, GOOD[:1])
    old_rows = read_rows(out)
    calls: list[tuple[str, str]] = []
    real_rename, real_fsync = os.rename, durable.fsync_path

    def rename(src, dst):
        calls.append(("rename", Path(dst).name))
        if len([c for c in calls if c[0] == "rename"]) == 2:
            raise _Killed
        real_rename(src, dst)

    def fsync_path(path):
        calls.append(("fsync", Path(path).name))
        real_fsync(path)

    monkeypatch.setattr(durable.os, "rename", rename)
    monkeypatch.setattr(durable, "fsync_path", fsync_path)
    monkeypatch.setattr(durable.shutil, "rmtree", lambda *a, **k: None)  # a killed run cleans nothing
    with pytest.raises(_Killed):
        run(tmp_path, tok, GOOD, overwrite=True)
    monkeypatch.undo()
    # the killed run was another process, now gone: its staging carries a dead pid
    (staging,) = tmp_path.glob(".out.partial-*")
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.rename(staging, tmp_path / f".out.partial-{dead.pid}-dead")
    renames = [i for i, c in enumerate(calls) if c[0] == "rename"]
    assert ("fsync", PROMPTS) in calls[: renames[0]]  # the new files are durable before they are published
    assert calls[renames[0] + 1] == ("fsync", tmp_path.name)  # the rename itself is durable
    assert not out.exists()
    previous = tmp_path / ".out.previous"
    assert json.loads((previous / "summary.json").read_text())["rows"] == first["rows"]
    # the next run (here one that fails on its input) first puts the old output back
    with pytest.raises(KimiInputError, match="no training rows survived"):
        run(tmp_path, tok, ["{x"], overwrite=True)
    assert read_rows(out) == old_rows and not previous.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]  # the killed run's staging is gone


def test_input_inside_out_is_refused_before_overwrite(tmp_path, tok):
    _, out = run(tmp_path, tok, GOOD[:1])
    inside = write_jsonl(out / "corpus.jsonl", GOOD)
    with pytest.raises(KimiInputError, match="is inside --out"):
        prepare(PrepareOptions(input_path=inside, out_dir=out, overwrite=True), tok)
    assert inside.is_file()


def test_bad_options_fail_before_any_work(tmp_path, tok):
    with pytest.raises(KimiInputError, match="--draft-vocab-size must be in 9..163840"):
        run(tmp_path, tok, GOOD, draft_vocab_size=4)
    with pytest.raises(KimiInputError, match="--max-length must be at least 2"):
        run(tmp_path, tok, GOOD, max_length=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_nothing_survives_is_an_error(tmp_path, tok):
    with pytest.raises(KimiInputError, match="no training rows survived"):
        run(tmp_path, tok, ["{x", {"messages": [{"role": "user", "content": "q"}]}])
    assert not (tmp_path / "out").exists()


def test_cli_with_tokenizer_dir_and_one_row_per_answer(tmp_path, capsys):
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    build_standin_tokenizer(tmp_path / "tok")
    multi = {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "r1"},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!", "reasoning_content": "r2"},
    ]}  # fmt: skip
    source = write_jsonl(tmp_path / "in.jsonl", [multi])
    code = main(
        [
            str(source),
            "--out",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tmp_path / "tok"),
            "--one-row-per-answer",
            "--no-shuffle",
        ]
    )
    assert code == 0
    assert "prepared 2 rows from 1 conversations" in capsys.readouterr().out
    rows = read_rows(tmp_path / "o")
    # "r1" </think> "Hello!" <|im_end|>, then "r2" </think> "Bye!" <|im_end|>
    assert [sum(r["loss_mask"]) for r in rows] == [2 + 1 + 6 + 1, 2 + 1 + 4 + 1]


def test_argparse_wiring():
    from specforge_kimi import cli

    args = cli.build_parser(only="prepare").parse_args(
        [
            "prepare",
            "in.jsonl",
            "--out",
            "d",
            "--standin-tokenizer",
            "--max-length",
            "128",
            "--overflow",
            "drop",
        ]
    )
    assert args.func is prepare_module.run
    assert (args.max_length, args.overflow, args.on_error, args.draft_vocab_size, args.seed) == (
        128,
        "drop",
        "skip",
        32000,
        42,
    )


def test_data_path_modules_import_light():
    import subprocess
    import sys

    code = (
        "import sys; import specforge_kimi.data.chat_template, specforge_kimi.data.conversation, "
        "specforge_kimi.data.tokenizer, specforge_kimi.data.tool_declaration, specforge_kimi.data.vocab_mapping, "
        "specforge_kimi.data.prepare, specforge_kimi.data.regenerate; "
        "print(','.join(m for m in ('torch', 'specforge', 'sglang', 'transformers', 'tokenizers', "
        "'tqdm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_out_that_is_a_link_is_refused_with_one_line_and_the_link_kept(tmp_path, tok, capsys):
    """Issue 43: ``--out LINK --overwrite`` died with a traceback and a later run replaced the link with a
    local directory. A link as ``--out`` is refused; the link and what it points at are left alone."""
    _, real = run(tmp_path, tok, GOOD[:1], out_name="real")
    before = (real / "prompts.jsonl").read_bytes()
    link = tmp_path / "link"
    link.symlink_to(real)
    source = tmp_path / "in.jsonl"
    for extra in (["--overwrite"], []):
        code = main([str(source), "--out", str(link), "--standin-tokenizer", *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
        assert (
            err
            == f"error: --out {link} is a symbolic link to {real}; refusing to write through or replace a link (pass {real} itself)\n"
        )
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    assert main([str(source), "--out", str(dangling), "--standin-tokenizer"]) == 2
    assert "symbolic link" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
    assert link.is_symlink() and (real / "prompts.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "in.jsonl", "link", "real"]


def test_a_huge_line_is_skipped_unread_in_bounded_memory_and_counted(tmp_path, tok, monkeypatch):
    """Issue 43: one 50 MiB line was tokenized whole before truncation. It is skipped unparsed, in bounded
    memory, as a counted line error; the other rows are kept and the input hash still covers it."""
    import hashlib
    import tracemalloc

    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (50 << 20) + b'"}]}'
    source = tmp_path / "in.jsonl"
    source.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + huge + b"\n" + json.dumps(GOOD[1]).encode() + b"\n")
    real_loads, parsed = json.loads, []
    monkeypatch.setattr(prepare_module.json, "loads", lambda raw, **k: parsed.append(len(raw)) or real_loads(raw, **k))
    tracemalloc.start()
    try:
        summary = prepare(PrepareOptions(input_path=source, out_dir=tmp_path / "out", shuffle=False), tok)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # the 50 MiB line was never held whole
    monkeypatch.undo()
    assert max(parsed) < 1 << 20  # never parsed
    assert summary["rows"] == 2 and summary["dropped"] == {"line_too_large": 1}
    assert summary["input"]["lines"] == 3
    cap = max(prepare_module.MIN_LINE_BYTES, prepare_module.LINE_BYTES_PER_TOKEN * 8192)
    assert summary["errors"]["first"] == [
        {"line": 2, "error": f"line of {len(huge) + 1} bytes is over the {cap}-byte line cap "
         "(--max-line-bytes; default from --max-length); skipped unread"}
    ]  # fmt: skip
    assert summary["input"]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    with pytest.raises(KimiInputError, match=f"^{source}:2: line of .* bytes is over"):
        prepare(PrepareOptions(input_path=source, out_dir=tmp_path / "o2", on_error="fail"), tok)
    assert not (tmp_path / "o2").exists()


def test_line_cap_boundary_and_flag(tmp_path, tok, capsys):
    line = json.dumps(GOOD[2]).encode()
    source = tmp_path / "in.jsonl"
    cap = len(line) + 1  # a line's bytes without its newline
    source.write_bytes(line + b" \n" + line + b"  \n" + line + b"  " + b"\n" + line + b" ")  # cap, cap+1, cap+1, cap
    options = PrepareOptions(input_path=source, out_dir=tmp_path / "out", shuffle=False, max_line_bytes=cap)
    summary = prepare(options, tok)
    assert summary["rows"] == 2 and summary["dropped"] == {"line_too_large": 2}
    assert [e["line"] for e in summary["errors"]["first"]] == [2, 3]
    assert PrepareOptions(input_path=source, out_dir=tmp_path, max_length=100).line_byte_cap == 1 << 20
    assert PrepareOptions(input_path=source, out_dir=tmp_path, max_length=1 << 16).line_byte_cap == 64 << 16
    capsys.readouterr()
    code = main([str(source), "--out", str(tmp_path / "o2"), "--standin-tokenizer", "--max-line-bytes", "1"])
    assert code == 2 and capsys.readouterr().err == "error: --max-line-bytes must be at least 2, got 1\n"


def test_a_record_without_messages_names_its_keys_on_one_line():
    """The record's key names are the input's own strings: quoted, so a key holding a newline keeps the error on one
    line (found by the generated-input suite), and capped, so ten thousand keys do not make a ten-thousand-key
    message."""
    from specforge_kimi.data.conversation import conversation_from_record

    with pytest.raises(KimiInputError) as err:
        conversation_from_record({"a\nb": 1, "text": 2})
    assert str(err.value) == "record has neither 'messages' nor 'conversations' (keys: 'a\\nb', 'text')"
    with pytest.raises(KimiInputError) as err:
        conversation_from_record({f"k{i:05d}": i for i in range(10_000)})
    assert str(err.value).endswith("'k00007', ... (10000 keys))") and len(str(err.value)) < 200
    with pytest.raises(KimiInputError, match=r"\(keys: none\)"):
        conversation_from_record({})
