"""An earlier bench's baseline (the target served without speculation) taken by a later bench of another draft
on the same target: ``specforge-kimi bench --baseline-from DIR|bench_result.json``.

Scope: what must match for the reuse to be like for like, the one-line refusal when it does not, and the greedy
outputs a served baseline leaves beside its ``bench_result.json`` (``baseline_outputs.json``) so the later bench
still checks its outputs against it. The bench decides when to call these; this module serves nothing.

Compared: the result's schema, the card(s) and the stack's versions, the target (path, config hash and its
pretraining record; its weights are not hashed), the prompt sets (source, count, mean prompt tokens), the context
length, every bench setting the baseline server or its requests depend on, and the baseline server's command line
with its port left out. A baseline measured on another card, stack or set of flags is refused: its tok/s is not
this bench's denominator.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specforge_kimi.errors import KimiInputError

RESULT_FILE = "bench_result.json"
OUTPUTS_FILE = "baseline_outputs.json"

#: The bench settings the baseline's servers and requests depend on (the draft, its configs, the threshold, the
#: port, the timeouts, the draft check and the output folder do not).
BASELINE_SETTINGS = (
    "sets",
    "prompt_files",
    "num_prompts",
    "max_new_tokens",
    "concurrency",
    "warmup",
    "thinking",
    "tp",
    "attention_backend",
    "mem_fraction_static",
    "context_length",
    "disable_cuda_graph",
    "disable_allreduce_fusion",
    "extra_server_args",
    "tokenizer",
    "standin_tokenizer",
)


def result_path(given: str | Path) -> Path:
    """``given`` itself, or its ``bench_result.json`` when it is a folder."""
    p = Path(given)
    return p / RESULT_FILE if p.is_dir() else p


def outputs_doc(rows: Mapping[str, Sequence[dict]]) -> dict:
    """What ``baseline_outputs.json`` holds: each set's prompt ids and greedy output ids, in request order."""
    return {
        "what": "greedy output ids of the baseline server, per prompt set, for a later bench's output check",
        "sets": {name: [{"id": r["id"], "output_ids": r["output_ids"]} for r in rs] for name, rs in rows.items()},
    }


def _without_port(argv: Sequence[str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--port":
            out[i + 1] = "<port>"
    return out


def _first_difference(earlier: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    for key, value in now.items():
        if earlier.get(key) != value:
            return (
                f"its {key} {json.dumps(earlier.get(key), default=str)[:120]} is not this bench's "
                + json.dumps(value, default=str)[:120]
            )
    return None


def load(given: str | Path, *, expected: Mapping[str, Any]) -> tuple[dict, dict[str, list[dict]], dict]:
    """The earlier baseline, its greedy outputs per set (empty when it left none) and where it came from.

    ``expected`` holds this bench's ``schema_version``, ``devices``, ``versions``, ``target``, ``prompt_sets``,
    ``context_length``, ``settings`` (the :data:`BASELINE_SETTINGS`) and ``server_argv`` (the baseline server's).
    Raises :class:`KimiInputError` in one line when the file is unreadable, holds no baseline or differs.
    """
    path = result_path(given)
    where = f"--baseline-from {given}"
    try:
        raw = path.read_bytes()
        earlier = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise KimiInputError(f"{where}: cannot read {path}: {exc}") from None
    if not isinstance(earlier, dict) or earlier.get("benchmark") != "acceptance":
        raise KimiInputError(f"{where}: {path} is not a bench result (benchmark 'acceptance')")
    baseline = earlier.get("baseline")
    if not isinstance(baseline, dict) or not isinstance(baseline.get("sets"), dict):
        raise KimiInputError(f"{where}: {path} holds no baseline (that bench ran with --no-baseline)")
    env = earlier.get("environment") or {}
    settings = earlier.get("settings") or {}
    then = {
        "schema_version": earlier.get("schema_version"),
        "devices": env.get("devices"),
        "versions": env.get("versions"),
        "target": earlier.get("target"),
        "prompt_sets": earlier.get("prompt_sets"),
        "context_length": earlier.get("context_length"),
        "settings": {k: settings.get(k) for k in BASELINE_SETTINGS},
        "server_argv": _without_port(baseline.get("server_argv") or []),
    }
    now = json.loads(json.dumps({**expected, "server_argv": _without_port(expected["server_argv"])}))
    for key in ("settings", "target"):  # name the first differing setting, not the whole dict
        diff = _first_difference(then[key] or {}, now[key] or {})
        if diff:
            raise KimiInputError(f"{where}: not like for like: {key}: {diff}")
    diff = _first_difference(then, now)
    if diff:
        raise KimiInputError(f"{where}: not like for like: {diff}")
    rows = _outputs(path.parent / OUTPUTS_FILE, where, earlier.get("prompt_sets") or {})
    source = {
        "path": str(path.resolve()),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "date_utc": earlier.get("date_utc"),
        "outputs": str((path.parent / OUTPUTS_FILE).resolve()) if rows else None,
        "reused_from": baseline.get("reused_from"),  # where that bench took it, when it did: the chain stays whole
    }
    baseline = {k: v for k, v in baseline.items() if k != "reused_from"}
    return baseline, rows, source


def _outputs(path: Path, where: str, prompt_sets: Mapping[str, Any]) -> dict[str, list[dict]]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
        sets = doc["sets"]
        rows = {
            name: [{"id": str(r["id"]), "output_ids": list(r["output_ids"])} for r in rs] for name, rs in sets.items()
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KimiInputError(f"{where}: cannot read {path}: {exc!r}") from None
    counts = {name: len(rs) for name, rs in rows.items()}
    if counts != {name: (info or {}).get("prompts") for name, info in prompt_sets.items()}:
        raise KimiInputError(f"{where}: {path} holds {counts} outputs, not one per prompt of its bench")
    return rows


__all__ = ["BASELINE_SETTINGS", "OUTPUTS_FILE", "RESULT_FILE", "load", "outputs_doc", "result_path"]
