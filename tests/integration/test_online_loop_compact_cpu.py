"""The online loop on CPU with ``server.compact_passthrough`` on: SpecForge's producer, patched by
``specforge-kimi setup`` (our SpecForge patch compact-capture-passthrough, on a copy of the wheel), sends input_ids,
loss_mask and attention_mask compactly; the reference capture server rebuilds them as SGLang
patch spec-capture-compact-passthrough does; the torchrun consumer trains on what comes back out of Mooncake.

Scope: the recipe field -> launch plan -> producer environment -> patched payload -> server ->
Mooncake -> trainer path end to end. That the compact forms give the same bytes as SpecForge's
lists is tested apart (``tests/unit/test_compact_passthrough.py``, ``test_sglang_patches.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from online_cpu import cpu_plan

from specforge_kimi.run.progress import consumer_steps

pytestmark = pytest.mark.slow

STEPS = 6


@pytest.fixture(scope="module")
def compact_run(tmp_path_factory):
    from specforge_kimi.run.launch import run_plan
    from specforge_kimi.setup import setup_patches

    root = tmp_path_factory.mktemp("compact")
    patched = root / "specforge-patched"
    shutil.copytree(
        Path(importlib.util.find_spec("specforge").origin).parent,
        patched / "specforge",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    assert setup_patches.run(argparse.Namespace(specforge_checkout=str(patched), check=False, no_sglang=True)) == 0
    plan, recipe, rendered, _ = cpu_plan(root, steps=STEPS, save_interval=STEPS, compact_specforge=patched)
    rc = run_plan(plan, managed_preflight=lambda _p: None, popen=subprocess.Popen)
    return {"rc": rc, "out": Path(recipe.output_dir), "plan": plan}


def test_compact_run_trains_from_compact_captures(compact_run):
    out = compact_run["out"]
    logs = out / "logs"
    assert compact_run["rc"] == 0, (logs / "producer.log").read_text(errors="replace")[-3000:]
    assert all(c.env.get("SPECFORGE_SPEC_CAPTURE_COMPACT") == "1" for c in compact_run["plan"].commands)
    server = next(logs.glob("capture-server*.log")).read_text(errors="replace")
    forms = [json.loads(m.replace("'", '"')) for m in re.findall(r"passthrough forms so far: (\{.*\})", server)]
    assert forms, server[-2000:]
    last = forms[-1]
    # every passthrough value came compactly: the ids as the request's own, the all-ones attention
    # mask as a fill, the loss mask (0/1 mixed) as bytes; none as a JSON list
    assert last.get("source", 0) > 0 and last.get("fill", 0) > 0 and last.get("data_b64", 0) > 0, last
    assert "data" not in last and "?" not in last, last
    producer = (logs / "producer.log").read_text(errors="replace")
    assert re.search(r"drive_producer returning produced=\d+ prompts_failed=0", producer), producer[-2000:]
    consumer = (logs / "consumer-node0.log").read_text(errors="replace")
    losses = [row["loss"] for row in consumer_steps(consumer)]
    assert len(losses) == STEPS and all(x == x and x > 0 for x in losses), consumer[-2000:]
