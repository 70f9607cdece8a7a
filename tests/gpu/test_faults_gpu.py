"""Issue 7's fault scenarios on a 2-GPU box with the real stack: the tiny K2.5 recipe's co-located
plan (Mooncake, text-only SGLang capture server at TP=2, producer, 2 torchrun trainer ranks on the
same GPUs), under SpecForge's supervisor. Same drills and checks as the CPU ones
(``tests/integration/test_faults_cpu.py``, machinery in ``tests/drills.py``):
  - capture server SIGKILLed (with its scheduler processes) -> segment keeper + server keeper:
    the run finishes, every prompt trained exactly once (SpecForge's ledger);
  - a trainer rank crashes right after a checkpoint -> consumer keeper resumes consumer-only;
  - Mooncake master SIGKILLed -> the run stops within ``STOP_BOUND_S``, nothing left.
With ``server.transport: cuda_ipc`` (issue 25; no Mooncake master, features in the server's GPU pool):
  - a trainer rank SIGKILLed right after a checkpoint while it holds mapped, unacknowledged slots -> consumer
    keeper: the resumed consumer reads them again from the pool, every prompt trained exactly once;
  - the capture server SIGKILLed while slots are lent -> the run stops within ``STOP_BOUND_S``;
  each then with no compute process left on the GPU (nvidia-smi), no slot reclaimed by its lease, and nothing of
  the pool left once the launch's cleanup (``transport.pool.remove_stale``) ran. ~2-3 min each on one H200
  (``SPECFORGE_KIMI_DRILL_TP=1``), mostly the server's start.
Outcomes go to ``$SPECFORGE_KIMI_GPU_OUT/fault_drills.jsonl`` and ``fault_drills_tp<TP>_h200.json``. A small random-weight target and
200 corpus conversations keep each drill to a server start plus seconds of training.
``SPECFORGE_KIMI_DRILL_TP=1`` runs each drill on one GPU (TP=1 server, 1 trainer rank), the first
one ``CUDA_VISIBLE_DEVICES`` lists, so two drills can run side by side on a 2-GPU box; the
2-rank crash case also runs on CPU (``test_faults_cpu.py``, ``dp=2``).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from conftest import prepare_corpus
from drills import (
    check_recovered,
    check_stopped,
    drill,
    inject_consumer_crash,
    kill_server_child,
    kill_service,
    producer_just_ahead,
)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
TP = int(os.environ.get("SPECFORGE_KIMI_DRILL_TP", "2"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    root = tmp_path_factory.mktemp("faults")
    target = write_tiny(root / "k25", TinySpec(layers=8, hidden=512))
    prepare_corpus(root, 200, "--tokenizer", str(target))
    return root, target


def _build(run_dir: Path, inputs, *, save_interval: int, resilience: dict | None, transport: str = "mooncake"):
    def build():
        from specforge_kimi.plan.run_plan import compile_plan
        from specforge_kimi.run.launch import build_colocated_plan
        from specforge_kimi.run.resume import marked
        from specforge_kimi.run.services import free_ports

        root, target = inputs
        raw = copy.deepcopy(yaml.safe_load((ROOT / "recipes" / "tiny-k25-tp2-h200x2.yaml").read_text()))
        rpc, meta, metrics, port, keeper = free_ports(5)
        raw["output_dir"] = str(run_dir)
        raw["target"]["path"] = str(target)
        raw["mooncake"] = {"rpc_port": rpc, "metadata_port": meta, "metrics_port": metrics, "global_segment_gib": 8}
        raw["server"]["port"] = port
        raw["trainer"].update(max_steps=1000, save_interval=save_interval)
        raw["gpus"]["per_node"] = TP
        raw["server"]["transport"] = transport
        raw["data"] = {
            "prompts_path": str(root / "data" / "prompts.jsonl"),
            "vocab_mapping_path": str(root / "data" / "vocab_mapping.pt"),
        }
        if resilience:
            raw["resilience"] = {"keeper_port": keeper, **resilience}
        compiled = compile_plan(raw, rendered_dir=run_dir / "rendered")
        recipe = compiled.recipe
        compiled.write()
        cfg_path = run_dir / "rendered" / "specforge_run.yaml"
        cfg = yaml.safe_load(cfg_path.read_text())
        cfg["training"]["log_interval"] = 1  # the drills key on "step N:" lines
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        # every process of the run carries its mark, as under launch: _check_after finds what outlived the drill by it
        plan = marked(build_colocated_plan(compiled, python=sys.executable), run_dir)
        return plan, recipe, root / "data" / "prompts.jsonl"

    return build


def _append(entry: dict) -> None:
    """One outcome into ``$SPECFORGE_KIMI_GPU_OUT``: a line of ``fault_drills.jsonl`` and the drill's entry of
    ``fault_drills_tp<TP>_h200.json`` (merged by drill name: the cuda_ipc drills write a second part after the
    run), the name ``scripts/keep_gpu_results.sh`` files under bench/results."""
    out = Path(os.environ.get("SPECFORGE_KIMI_GPU_OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fault_drills.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    path = out / f"fault_drills_tp{TP}_h200.json"
    doc = (
        json.loads(path.read_text())
        if path.is_file()
        else {"benchmark": "fault drills", "test": "tests/gpu/test_faults_gpu.py", "drills": {}}
    )
    doc["drills"].setdefault(entry["drill"], {}).update(entry)
    path.write_text(json.dumps(doc, indent=1))


def _record(name: str, res: dict) -> None:
    led = res["report"]["ledger"]
    _append(
        {
            "drill": name,
            "tp": TP,
            "trainer_ranks": TP,
            "rc": res["rc"],
            "stop_s": res["stop_s"],
            "victims": len(res["victims"] or []),
            "processes_left": len(res["left"]) + len(res["spawned_alive"]),
            "prompts": res["prompts"],
            "acked": led.get("acked"),
            "duplicates": led.get("duplicates"),
            "committed": led.get("committed"),
            "global_step": led.get("global_step"),
        }
    )


def test_server_lost_and_restarted(tmp_path, inputs, shm_before):
    res = drill(
        tmp_path,
        kill_server_child("specforge_kimi.capture_server"),
        _build(
            tmp_path / "run", inputs, save_interval=50, resilience={"segment_owner": "keeper", "server_restarts": 2}
        ),
        edit_plan=producer_just_ahead,
        wait_s=600,
    )
    name = "capture server SIGKILL, segment keeper + server keeper"
    _record(name, res)
    check_recovered(res, dp=TP)
    _check_after(name, res, shm_before, "mooncake")


def test_trainer_crash_resumed(tmp_path, inputs, shm_before):
    res = drill(
        tmp_path,
        lambda _spawned: ["fault_consumer"],
        _build(tmp_path / "run", inputs, save_interval=1, resilience={"consumer_restarts": 1}),
        edit_plan=inject_consumer_crash,
        wait_s=600,
    )
    name = "trainer rank crash at a checkpoint, consumer keeper"
    _record(name, res)
    assert (tmp_path / "crashed").is_file()
    check_recovered(res, dp=TP)
    _check_after(name, res, shm_before, "mooncake")


def test_mooncake_master_killed(tmp_path, inputs, shm_before):
    res = drill(
        tmp_path,
        kill_service("mooncake.cli"),
        _build(tmp_path / "run", inputs, save_interval=50, resilience=None),
        wait_s=600,
    )
    name = "mooncake master SIGKILL"
    _record(name, res)
    check_stopped(res, dp=TP)
    _check_after(name, res, shm_before, "mooncake")


def _smi(query: str) -> list[list[str]]:
    import subprocess

    res = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, check=True)
    return [[f.strip() for f in ln.split(",")] for ln in res.stdout.splitlines() if ln.strip()]


def _drill_gpus() -> set[str]:
    """UUIDs of the GPUs a drill runs on: the first ``TP`` that ``CUDA_VISIBLE_DEVICES`` lists (indices or UUIDs),
    else GPUs 0..TP-1."""
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpus = _smi("--query-gpu=index,uuid")
    picked = listed[:TP] if listed else [str(i) for i in range(TP)]
    return {uuid for index, uuid in gpus if index in picked or uuid in picked}


def _compute_apps() -> list[str]:
    """Compute processes on the drill's GPUs (a drill beside it on another GPU is not counted), this one excepted."""
    mine = _drill_gpus()
    return [
        ", ".join((pid, mib))
        for pid, uuid, mib in _smi("--query-compute-apps=pid,gpu_uuid,used_memory")
        if uuid in mine and pid != str(os.getpid())
    ]


def _own_shm() -> dict[str, tuple[int, int]]:
    """``{name: (st_dev, st_ino)}`` of this user's regular files in ``/dev/shm`` now."""
    from specforge_kimi.run.shm_leftovers import own_files

    return {name: (st.st_dev, st.st_ino) for name, st in own_files().items()}


@pytest.fixture
def shm_before():
    """This user's files in ``/dev/shm`` before the drill (name -> inode): what a drill adds is compared against them."""
    return _own_shm()


def _check_after(name: str, res: dict, shm_before: dict[str, tuple[int, int]], transport: str) -> None:
    """Nothing the drill started holds GPU memory, and once the launcher's cleanup ran (what ``resume.run_attempts``
    does around each attempt: stale cuda_ipc pools, the run's libraries' files in ``/dev/shm``) no file of this user
    is in ``/dev/shm`` that was not there before the drill (by name and inode), whatever its name, unless a live process
    holds it: no process with the run's mark is left (SGLang renames its children, so they are found by the mark, not
    by their command lines), so a holder is another run's, e.g. a drill beside it on another GPU. On cuda_ipc also:
    no lease expiry, no pool file nor slot table left."""
    import time

    from specforge_kimi.run.resume import clean_leftovers
    from specforge_kimi.run.run_guard import run_processes
    from specforge_kimi.run.shm_leftovers import held
    from specforge_kimi.transport.slots import shm_dir

    time.sleep(5)
    apps = _compute_apps()
    server = (res["out"] / "logs" / "capture-server-node0.log").read_text(errors="replace")
    since = min(p.stat().st_mtime for p in (res["out"] / "rendered").iterdir()) - 1.0
    removed, shm_removed = clean_leftovers(res["recipe"], since)  # what the launcher runs after each attempt
    ours = run_processes(res["out"])
    added = {n: key for n, key in _own_shm().items() if shm_before.get(n) != key}
    busy = held()
    new = sorted(n for n, key in added.items() if key not in busy)
    _append(
        {
            "drill": name,
            "compute_apps_after": apps,
            "stale_pools_removed": removed,
            "shm_leftovers_removed": shm_removed,
            "shm_new_after_cleanup": new,
            "shm_new_held_by_live_processes": sorted(set(added) - set(new)),
            "run_processes_left": [cmd[:200] for _pid, cmd in ours],
        }
    )
    assert not ours, ours
    assert not apps, apps
    assert not new, new
    if transport != "cuda_ipc":
        return
    assert "cuda_ipc pool" in server and "past the" not in server
    assert not list((res["out"] / "ipc").glob("*.json"))
    refs = (res["out"] / "control" / "refs.jsonl").read_text().splitlines()
    pools = {json.loads(r)["metadata"]["cuda_ipc"]["pool"] for r in refs}
    assert pools and not [p for pool in pools for p in shm_dir().glob(f"sfk-ipc-{pool}.*")]


def test_cuda_ipc_trainer_crash_with_mapped_slots(tmp_path, inputs, shm_before):
    res = drill(
        tmp_path,
        lambda _spawned: ["fault_consumer"],
        _build(tmp_path / "run", inputs, save_interval=1, resilience={"consumer_restarts": 1}, transport="cuda_ipc"),
        edit_plan=inject_consumer_crash,
        wait_s=600,
    )
    name = "cuda_ipc: trainer rank crash at a checkpoint with mapped slots, consumer keeper"
    _record(name, res)
    assert (tmp_path / "crashed").is_file()
    check_recovered(res, dp=TP)
    _check_after(name, res, shm_before, "cuda_ipc")


def test_cuda_ipc_capture_server_killed_with_slots_lent(tmp_path, inputs, shm_before):
    res = drill(
        tmp_path,
        kill_server_child("specforge_kimi.capture_server"),
        _build(tmp_path / "run", inputs, save_interval=50, resilience=None, transport="cuda_ipc"),
        wait_s=600,
    )
    name = "cuda_ipc: capture server SIGKILL with slots lent"
    _record(name, res)
    check_stopped(res, dp=TP)
    _check_after(name, res, shm_before, "cuda_ipc")
