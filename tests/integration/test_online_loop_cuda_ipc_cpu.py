"""The whole online loop on CPU with ``server.transport: cuda_ipc``: the recipe's co-located plan (no Mooncake
master), SpecForge's real producer and torchrun consumer with ``register()``'s store seam, and the CPU reference
capture server writing into a cuda_ipc pool through the same writer SGLang patch spec-capture-cuda-ipc calls (its shared-memory
backend: everything of the transport but the CUDA IPC handle, which ``tests/gpu/test_cuda_ipc.py`` covers).

What this proves without a GPU: the rendered roles find the pool, refs carry descriptors through SpecForge's
channel and ledger, the trainer reads every sample once, releases ride the optimizer-step acknowledgements
(no slot reaches its lease), and a clean stop leaves no pool file nor slot table behind."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from online_cpu import cpu_plan

pytestmark = pytest.mark.slow

STEPS = 10


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def ipc_run(request, tmp_path_factory):
    """With 2 trainer ranks both map the one pool (TP > 1's layout: one writer, every rank reads it) and each
    releases only the ids it acknowledged."""
    from specforge_kimi.run.launch import export_latest, run_plan

    dp = request.param
    plan, recipe, rendered, target = cpu_plan(
        tmp_path_factory.mktemp("ipc"), steps=STEPS, save_interval=5, transport="cuda_ipc", dp=dp
    )
    spawned = []

    def popen(*a, **k):
        p = subprocess.Popen(*a, **k)
        spawned.append(p)
        return p

    rc = run_plan(plan, managed_preflight=lambda _p: None, popen=popen)
    time.sleep(0.5)
    return {
        "rc": rc,
        "dp": dp,
        "plan": plan,
        "recipe": recipe,
        "out": Path(recipe.output_dir),
        "spawned": spawned,
        "export": export_latest(rendered["run_plan"]) if rc == 0 else None,
    }


def _log(run, name: str) -> str:
    return (run["out"] / "logs" / name).read_text(errors="replace")


def test_run_trains_every_step_once(ipc_run):
    from specforge_kimi.evaluate.run_report import report

    assert ipc_run["rc"] == 0, _log(ipc_run, "consumer-node0.log")[-3000:]
    assert [s.command.label for s in ipc_run["plan"].services] == ["capture-server"]
    assert not any("mooncake" in " ".join(map(str, p.args)) for p in ipc_run["spawned"])
    led = report(ipc_run["out"])["ledger"]
    assert led["global_step"] == STEPS and led["acked"] == led["acked_unique"] == STEPS * ipc_run["dp"]
    assert led["duplicates"] == 0 and led["acked_not_committed"] == 0
    assert ipc_run["export"] is not None and (ipc_run["export"] / "config.json").is_file()


def test_refs_carry_descriptors_and_slots_came_back(ipc_run):
    refs = [json.loads(line) for line in (ipc_run["out"] / "control" / "refs.jsonl").read_text().splitlines()]
    assert refs and all(r["feature_store_uri"].startswith("cudaipc://") for r in refs)
    pools = {r["metadata"]["cuda_ipc"]["pool"] for r in refs}
    assert len(pools) == 1
    server = _log(ipc_run, "capture-server-node0.log")
    assert f"cuda_ipc pool {next(iter(pools))}" in server
    # the writer's counters, logged as one JSON object at its clean stop
    closed = re.findall(r"cuda_ipc pool (\w+) closed: (\{.*\})$", server, flags=re.MULTILINE)
    assert len(closed) == 1 and closed[0][0] in pools, server[-2000:]
    stats = json.loads(closed[0][1])
    assert stats["expired"] == 0 and stats["failed"] == 0  # no slot waited for its lease
    assert stats["lent"] >= len(refs) and stats["released"] >= STEPS * ipc_run["dp"]
    # every lend ended one way or is still lent at the stop
    assert stats["lent"] == stats["released"] + stats["expired"] + stats["replaced"] + stats["samples"]
    assert "past the" not in server


def test_nothing_left_behind(ipc_run):
    from specforge_kimi.transport.slots import shm_dir

    ipc = ipc_run["out"] / "ipc"
    assert ipc.is_dir() and not list(ipc.glob("*.json"))
    refs = (ipc_run["out"] / "control" / "refs.jsonl").read_text()
    pool = json.loads(refs.splitlines()[0])["metadata"]["cuda_ipc"]["pool"]
    assert not list(shm_dir().glob(f"sfk-ipc-{pool}.*"))
    assert not any(p.poll() is None for p in ipc_run["spawned"])
