"""Peak memory of ``specforge-kimi prepare`` against input size: does it stream?

Generates synthetic conversation files (thinking, instant, multi-turn with reasoning history,
tool calls with results, ShareGPT; seeded, so the files are the same on every run), runs
``python -m specforge_kimi prepare FILE --out DIR --standin-tokenizer`` on each in a fresh
subprocess (shuffled, the default, and ``--no-shuffle``) and records that subprocess's own peak
RSS (``os.wait4`` rusage ``ru_maxrss``), wall time and the summary counts into
``bench/results/prepare_memory.json``, with the command and the environment.

Usage::

    python bench/studies/prepare_memory.py                      # 2,000 and 20,000 rows
    python bench/studies/prepare_memory.py --rows 2000 20000 60000

Scope: the stand-in tokenizer (byte-level ids, so more tokens per row than K2.5's tiktoken);
the question is growth with the file, not K2.5's absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "prepare_memory.json"

_WORDS = (
    "the draft model predicts several tokens ahead and the target verifies them in one pass "
    "speculative decoding keeps the output distribution exact while cutting latency "
    "Kimi K2.5 reasons before it answers and calls tools when a question needs fresh data "
    "数据 模型 推理 工具 调用 结果 训练 草稿 目标 验证"
).split()


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def _conversation(rng: random.Random, index: int) -> dict:
    kind = index % 5
    if kind == 0:  # single turn, thinking
        return {"messages": [
            {"role": "user", "content": _text(rng, 10, 60)},
            {"role": "assistant", "content": _text(rng, 20, 120), "reasoning_content": _text(rng, 40, 300)},
        ]}  # fmt: skip
    if kind == 1:  # single turn, instant, with a system prompt
        return {"messages": [
            {"role": "system", "content": _text(rng, 5, 20)},
            {"role": "user", "content": _text(rng, 10, 60)},
            {"role": "assistant", "content": _text(rng, 20, 200)},
        ]}  # fmt: skip
    if kind == 2:  # multi-turn with reasoning history
        messages = []
        for _ in range(rng.randint(2, 4)):
            messages.append({"role": "user", "content": _text(rng, 5, 40)})
            messages.append(
                {
                    "role": "assistant",
                    "content": _text(rng, 10, 80),
                    "reasoning_content": _text(rng, 20, 150),
                }
            )
        return {"messages": messages}
    if kind == 3:  # tool declaration + call + result
        city = rng.choice(["Paris", "Tokyo", "Lima", "Oslo"])
        return {
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "Current weather for a city.",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["c", "f"], "default": "c"}},
                    "required": ["city"]}}}],
            "messages": [
                {"role": "user", "content": f"Weather in {city}? " + _text(rng, 5, 30)},
                {"role": "assistant", "content": "", "reasoning_content": _text(rng, 10, 80),
                 "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": f"{rng.randint(-10, 35)}C, clear"},
                {"role": "assistant", "content": _text(rng, 10, 60), "reasoning_content": _text(rng, 10, 60)},
            ],
        }  # fmt: skip
    return {"conversations": [  # ShareGPT
        {"from": "human", "value": _text(rng, 10, 60)},
        {"from": "gpt", "value": _text(rng, 20, 200)},
    ]}  # fmt: skip


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """Write ``rows`` synthetic conversations (deterministic for ``seed``)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as out:
        for index in range(rows):
            out.write(json.dumps(_conversation(rng, index), ensure_ascii=False) + "\n")


def measure(rows: int, work: Path, *, shuffle: bool) -> dict:
    source = work / f"conversations-{rows}.jsonl"
    if not source.exists():
        generate(source, rows)
    out = work / f"prepared-{rows}-{'shuffled' if shuffle else 'ordered'}"
    command = [sys.executable, "-m", "specforge_kimi", "prepare", str(source), "--out", str(out),
               "--standin-tokenizer", "--no-progress"]  # fmt: skip
    if not shuffle:
        command.append("--no-shuffle")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.monotonic() - started
    stdout, stderr = process.stdout.read().decode(), process.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"prepare failed for {rows} rows:\n{stderr}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "rows_in": rows,
        "shuffle": shuffle,
        "input_bytes": source.stat().st_size,
        "output_bytes": (out / "prompts.jsonl").stat().st_size,
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "peak_rss_mib_before_vocab_mapping": summary["run"]["peak_rss_mib_before_vocab_mapping"],
        "wall_s": round(elapsed, 2),
        "rows_out": summary["rows"],
        "tokens": summary["tokens"],
        "trained_fraction": summary["trained_fraction"],
        "command": " ".join(command[1:]),
        "stdout": stdout.strip(),
    }


def _environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("specforge-kimi", "specforge", "torch", "tokenizers", "transformers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    try:
        git = ["git", "-C", str(REPO)]
        sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    except OSError:
        sha, dirty = "", None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_head": sha,
        "git_uncommitted_changes": dirty,
        "versions": versions,
        "tokenizer": "stand-in (byte-level ids, K2.5 special ids)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="prepare-memory-") as tmp:
        runs = [measure(rows, Path(tmp), shuffle=shuffle) for rows in args.rows for shuffle in (True, False)]
    for run in runs:
        print(f"{run['rows_in']:>7} rows  {run['input_bytes'] / 2**20:7.1f} MiB in  "
              f"{run['output_bytes'] / 2**20:7.1f} MiB out  shuffle={run['shuffle']!s:5}  "
              f"peak RSS {run['peak_rss_mib']:7.1f} MiB "
              f"(before vocab mapping {run['peak_rss_mib_before_vocab_mapping']:6.1f})  "
              f"{run['wall_s']:6.1f} s")  # fmt: skip
    growth = {}
    for shuffle in (True, False):
        same = [run for run in runs if run["shuffle"] == shuffle]
        growth["shuffled" if shuffle else "ordered"] = {
            f"{a['rows_in']}->{b['rows_in']}": round(b["peak_rss_mib"] - a["peak_rss_mib"], 1)
            for a, b in zip(same, same[1:], strict=False)
        }
    result = {
        "benchmark": "prepare peak RSS vs input size",
        "script": "python bench/studies/prepare_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": _environment(),
        "runs": runs,
        "peak_rss_growth_mib": growth,
        "input_growth_factor": round(runs[-1]["input_bytes"] / runs[0]["input_bytes"], 1),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
