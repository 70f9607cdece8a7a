"""The GPU scripts' stage logic on the CPU: which command runs where, and what each stage leaves.

Scope: ``scripts/gpu_draft_run.sh`` (launch with its listeners listed, then the bench), ``scripts/gpu_online_run.sh STAGE=target`` (target candidates spread over the box's GPUs,
the chosen one kept) and ``scripts/gpu_offline_twin.sh TWIN_STAGE=features|rest`` (the twin split
over two device calls). A device call lost to a script slip costs a budget's GPU time, so the
shell logic is checked here with stand-ins: ``python3 -m specforge_kimi <cmd>`` and ``nvidia-smi``
are replaced on ``PATH`` by shims that record their arguments and write the files the scripts
read; every other ``python3`` (recipe loading) is the real interpreter. The commands themselves
run on the GPU box (archive/gpu-runs/RUNS.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

SHIM = r"""#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args[:2] == ["-m", "specforge_kimi.capture_server"]:  # a stand-in server: its pid, then it waits to be stopped
    import time
    Path(os.environ.get("SHIM_SERVER_PID", os.devnull)).write_text(str(os.getpid()))
    time.sleep(600)
    sys.exit(0)
if args[:1] == ["bench/prefill_depth.py"]:
    sys.exit(0)
if args[:1] == ["bench/online_pipeline.py"]:
    with open(os.environ["SHIM_LOG"], "a") as log:
        log.write(json.dumps({{"cmd": "online_pipeline", "args": args[1:]}}) + "\n")
    sys.exit(0)
if args[:2] != ["-m", "specforge_kimi"]:
    os.execv({python!r}, [{python!r}, *args])
cmd, rest = args[2], args[3:]
def opt(name):
    return rest[rest.index(name) + 1] if name in rest else None
with open(os.environ["SHIM_LOG"], "a") as log:
    log.write(json.dumps({{"cmd": cmd, "args": rest, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\n")
if cmd == "tiny":
    Path(rest[0]).mkdir(parents=True)
    (Path(rest[0]) / "pretrain.json").write_text("{{}}")
elif cmd == "target-text":
    chosen = rest[rest.index("--device") - 1]  # the last candidate
    Path(opt("--out")).write_text(json.dumps({{"chosen": chosen}}))
    print("chosen:", chosen)
elif cmd == "capture-features":
    out = Path(opt("--out"))
    part = out.with_name(out.name + ".partial")
    part.mkdir(parents=True)
    (part / "0.ckpt").write_text("")
    part.rename(out)
    out.with_name(out.name + ".json").write_text("{{}}")
elif cmd == "bench":
    if opt("--baseline-from") and os.environ.get("SHIM_REFUSE_BASELINE"):
        print("error: --baseline-from " + opt("--baseline-from") + ": not like for like", file=sys.stderr)
        sys.exit(int(os.environ["SHIM_REFUSE_BASELINE"]))
    out = Path(opt("--out"))
    out.mkdir(parents=True, exist_ok=True)
    block = "dflash" in opt("--draft")  # a block draft's bench serves DFLASH at its block size
    al = 4.0 if block else 2.5
    run = {{"config": {{"steps": 3, "topk": 1, "draft_tokens": 4}}, "overall": {{"acceptance_length": al}},
           "sets": {{"chat": {{"acceptance_length": al}}}}, "algorithm": "DFLASH" if block else "EAGLE3"}}
    (out / "bench_result.json").write_text(json.dumps({{
        "benchmark": "acceptance", "speculative": [run], "target": {{"path": "runs/tiny-k25", "config_sha256": "ab"}},
        "prompt_sets": {{"chat": {{"prompts": 8}}}}, "settings": {{"max_new_tokens": 256}},
        "baseline": None if "--no-baseline" in rest else {{"reused_from": opt("--baseline-from") and
                                                           {{"path": opt("--baseline-from")}}}},
        "draft": {{"path": opt("--draft")}}}}))
elif cmd == "regenerate":
    import time
    time.sleep(float(os.environ.get("SHIM_SLEEP", "0")))
elif cmd == "launch" and "--plan" in rest:
    print("{{}}")
elif cmd == "launch" and os.environ.get("SHIM_RUN"):
    run = Path(os.environ["SHIM_RUN"])
    if os.environ["SHIM_RUN"] == "recipe":  # the recipe's own output_dir (scripts that launch several recipes)
        import yaml
        run = Path(yaml.safe_load(open(rest[0]))["output_dir"])
    (run / "export-sglang").mkdir(parents=True)
    (run / "export-sglang" / "config.json").write_text("{{}}")
    (run / "logs").mkdir()
    (run / "logs" / "capture-server-node0.log").write_text("up\n")
elif cmd == "export" and opt("--recipe"):
    import yaml
    run = Path(yaml.safe_load(open(opt("--recipe")))["output_dir"])
    (run / "export-sglang").mkdir(parents=True)
    (run / "export-sglang" / "config.json").write_text("{{}}")
elif cmd == "run-report":
    Path(opt("--out")).write_text(json.dumps({{"run_id": rest[0], "last_step": 1500,
                                               "ledger": {{"trained_tokens": 1000, "duplicates": 0}}}}))
elif cmd == "train-offline":
    out = Path(opt("--out"))
    (out / "export-sglang").mkdir(parents=True)
    (out / "twin-step10").mkdir()
"""


def _sandbox(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of scripts/ and recipes/ (they write runs/ beside themselves), src/ linked, shims on PATH."""
    box = tmp_path / "repo"
    box.mkdir()
    for d in ("scripts", "recipes"):
        shutil.copytree(ROOT / d, box / d)
    (box / "src").symlink_to(ROOT / "src")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shims = {
        "python3": SHIM.format(python=sys.executable),
        "nvidia-smi": "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: a)'\necho 'GPU 1: NVIDIA H200 (UUID: b)'\n",
    }
    for name, text in shims.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SHIM_LOG": str(tmp_path / "calls.jsonl"),
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return box, env


def _script(box: Path, env: dict, *argv: str, timeout: int = 180):
    """A runner of ``bash argv`` in the sandbox whose keyword arguments are added to ``env``."""

    def run(**extra):
        return subprocess.run(
            ["bash", *argv], cwd=box, env={**env, **extra}, capture_output=True, text=True, timeout=timeout
        )

    return run


def _calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_target_stage_puts_one_candidate_per_gpu_and_keeps_the_chosen(tmp_path):
    box, env = _sandbox(tmp_path)
    env.update(
        STAGE="target",
        TARGET_SEEDS="0 1",
        PRETRAIN_STEPS="1200",
        PRETRAIN_S="600",
        PRETRAIN_BATCH="128",
        PRETRAIN_PRECISION="bf16",
        PRETRAIN_SCHEDULE="cosine",
        PRETRAIN_PROMPT_RULES="2000",
        OUT=str(tmp_path / "out"),
        RECIPE="recipes/tiny-k25-tp2-h200x2.yaml",
    )
    res = subprocess.run(
        ["bash", "scripts/gpu_online_run.sh"], cwd=box, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    tiny = sorted((c for c in _calls(tmp_path) if c["cmd"] == "tiny"), key=lambda c: c["args"][0])
    assert [(c["args"][0], c["cuda"]) for c in tiny] == [("runs/tiny-k25-seed0", "0"), ("runs/tiny-k25-seed1", "1")]
    for c in tiny:
        a = c["args"]
        assert [
            a[a.index(k) + 1]
            for k in (
                "--pretrain-steps",
                "--pretrain-batch-size",
                "--pretrain-precision",
                "--pretrain-schedule",
                "--pretrain-prompt-rules",
                "--pretrain-prompt-rule",
            )
        ] == ["1200", "128", "bf16", "cosine", "2000", "echo"]
    assert (box / "runs" / "tiny-k25" / "pretrain.json").is_file()
    assert not list((box / "runs").glob("tiny-k25-seed*"))


def test_twin_in_two_calls_equals_one(tmp_path):
    box, env = _sandbox(tmp_path)
    export = box / "runs" / "tiny-k25-tp1" / "export-sglang"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (box / "runs" / "tiny-k25-tp1" / "tiny-k25-tp1-step10").mkdir()
    env["RECIPE"] = "recipes/tiny-k25-tp1-h200.yaml"

    def twin(stage: str, out: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "scripts/gpu_offline_twin.sh"],
            cwd=box,
            env={**env, "TWIN_STAGE": stage, "OUT": str(tmp_path / out)},
            capture_output=True,
            text=True,
            timeout=120,
        )

    res = twin("rest", "early")
    assert res.returncode == 2 and "needs a features stage" in res.stderr
    res = twin("features", "o")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c["cmd"] for c in _calls(tmp_path)] == ["capture-features", "bench"]
    assert (tmp_path / "o" / "bench-online.json").is_file() and not (tmp_path / "o" / "offline_twin.json").exists()
    res = twin("rest", "o")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c["cmd"] for c in _calls(tmp_path)][2:] == ["train-offline", "bench", "eval-draft"]
    from specforge_kimi.plan.run_plan import load_recipe

    ev = _calls(tmp_path)[-1]["args"]  # eval-draft reads the features' layers from the recipe
    aux = load_recipe(ROOT / env["RECIPE"]).target.aux_layer_ids
    assert ev[ev.index("--aux-ids") + 1] == ",".join(map(str, aux)) and aux != [1, 3, 4]  # (1,3,4: once hard-coded)
    summary = json.loads((tmp_path / "o" / "offline_twin.json").read_text())
    assert summary["within_3_percent"] is True and summary["online"]["acceptance_length"] == 2.5
    res = twin("bogus", "x")
    assert res.returncode == 2 and "TWIN_STAGE must be" in res.stderr


def test_twin_against_an_earlier_online_bench(tmp_path):
    """``ONLINE_BENCH_JSON``: the twin needs no online export then, does not bench the online draft again,
    compares the offline twin with that file and evaluates the offline checkpoint alone."""
    box, env = _sandbox(tmp_path)
    env["RECIPE"] = "recipes/tiny-k25-tp1-h200.yaml"
    earlier = tmp_path / "earlier.json"
    run = {
        "config": {"steps": 3, "topk": 1, "draft_tokens": 4},
        "overall": {"acceptance_length": 2.45},
        "sets": {"chat": {"acceptance_length": 2.45}},
    }
    earlier.write_text(json.dumps({"speculative": [run]}))

    def twin(stage: str, online: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "scripts/gpu_offline_twin.sh"],
            cwd=box,
            capture_output=True,
            text=True,
            env={**env, "TWIN_STAGE": stage, "OUT": str(tmp_path / "o"), "ONLINE_BENCH_JSON": online},
            timeout=120,
        )

    res = twin("features", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and "no such file" in res.stderr
    res = twin("features", str(earlier))
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c["cmd"] for c in _calls(tmp_path)] == ["capture-features"]
    res = twin("rest", str(earlier))
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c["cmd"] for c in _calls(tmp_path)][1:] == ["train-offline", "bench", "eval-draft"]
    ev = _calls(tmp_path)[-1]["args"]
    assert ev[ev.index("--draft-config") + 1] == "runs/offline-twin/rendered/draft_config.json"
    assert ev[ev.index("--checkpoints") + 1 : ev.index("--checkpoints") + 3] == [
        "runs/offline-twin/twin-step10",
        "--heldout",
    ]
    summary = json.loads((tmp_path / "o" / "offline_twin.json").read_text())
    assert summary["online_bench_from"] == str(earlier) and summary["online"]["acceptance_length"] == 2.45
    assert summary["offline"]["acceptance_length"] == 2.5 and summary["within_3_percent"] is True


def test_real_width_target_stage_writes_the_slice_and_train_needs_data(tmp_path):
    box, env = _sandbox(tmp_path)
    env.update(STAGE="target", OUT=str(tmp_path / "out"))
    res = subprocess.run(
        ["bash", "scripts/gpu_real_width.sh"], cwd=box, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (tiny,) = (c for c in _calls(tmp_path) if c["cmd"] == "tiny")
    a = tiny["args"]
    assert a[0] == "runs/k25-slice" and "--int4-experts" in a
    got = {k: a[a.index(k) + 1] for k in ("--layers", "--hidden", "--heads", "--experts", "--moe-intermediate")}
    assert got == {
        "--layers": "5",
        "--hidden": "7168",
        "--heads": "64",
        "--experts": "384",
        "--moe-intermediate": "2048",
    }
    assert a[a.index("--init-device") + 1] == "cuda"
    assert [c["args"] for c in _calls(tmp_path) if c["cmd"] == "inspect"] == [["runs/k25-slice"]]
    res = subprocess.run(
        ["bash", "scripts/gpu_real_width.sh"],
        cwd=box,
        env={**env, "STAGE": "train"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "needs a data stage's runs/k25-slice-data" in res.stderr


def test_real_width_bench_stage_takes_the_recipes_target_aux_ids_and_gpu_label(tmp_path):
    """One load of the recipe gives the stages its run folder, target, data folder, GPU label and aux ids."""
    box, env = _sandbox(tmp_path)
    (box / "runs/k25-slice").mkdir(parents=True)
    (box / "runs/k25-slice/config.json").write_text("{}")
    out = tmp_path / "out"
    for recipe, tag in (("recipes/kimi-k25-slice-h200.yaml", "h200"), ("recipes/kimi-k25-slice-h100.yaml", "h100")):
        res = subprocess.run(
            ["bash", "scripts/gpu_real_width.sh"],
            cwd=box,
            env={**env, "STAGE": "bench", "OUT": str(out), "RECIPE": recipe},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        a = [c for c in _calls(tmp_path) if c["cmd"] == "online_pipeline"][-1]["args"]
        aux = yaml.safe_load((box / recipe).read_text())["target"]["aux_layer_ids"]
        assert a[a.index("--target") + 1] == "runs/k25-slice"
        assert a[a.index("--aux-ids") + 1] == ",".join(map(str, aux)) and aux
        assert a[a.index("--out") + 1] == f"{out}/online_pipeline_k25_slice_{tag}.json"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited


def test_real_width_data_stage_killed_mid_stage_stops_its_server(tmp_path):
    """A device call's limit or a ``timeout`` signals the script's process group; the data stage's server runs in
    its own session (setsid), so the script itself must take it down, or it keeps its GPU memory for the next call."""
    box, env = _sandbox(tmp_path)
    curl = tmp_path / "bin" / "curl"  # /health answers at once
    curl.write_text("#!/bin/sh\nexit 0\n")
    curl.chmod(0o755)
    (box / "runs" / "k25-slice").mkdir(parents=True)
    (box / "runs" / "k25-slice" / "config.json").write_text("{}")
    pid_file = tmp_path / "server.pid"
    env.update(STAGE="data", N_PROMPTS="4", OUT=str(tmp_path / "out"), SHIM_SLEEP="120", SHIM_SERVER_PID=str(pid_file))
    proc = subprocess.Popen(
        ["bash", "scripts/gpu_real_width.sh"], cwd=box, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(600):  # the stand-in server is up and regenerate is running
            if pid_file.exists() and (tmp_path / "calls.jsonl").exists():
                if any(c["cmd"] == "regenerate" for c in _calls(tmp_path)):
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("the data stage never reached regenerate")
        server = int(pid_file.read_text())
        assert _alive(server)
        os.killpg(proc.pid, signal.SIGTERM)  # what `timeout` does: the script's group, not the server's session
        assert proc.wait(timeout=60) == 143
        for _ in range(100):
            if not _alive(server):
                break
            time.sleep(0.1)
        assert not _alive(server), "the data stage's server outlived its killed script"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_real_width_train_stage_runs_a_copy_with_the_transport_pool_and_steps(tmp_path):
    """``TRANSPORT=mooncake MAX_STEPS=50 STAGE=train``: launch gets a validated copy of the slice recipe (cuda_ipc
    as shipped) with exactly those changed (the 2026-12-02 runs edited copies by hand)."""
    import yaml

    box, env = _sandbox(tmp_path)
    (box / "runs" / "k25-slice-data").mkdir(parents=True)
    (box / "runs" / "k25-slice-data" / "prompts.jsonl").write_text("{}\n")
    out = tmp_path / "out"
    env.update(STAGE="train", OUT=str(out), TRANSPORT="mooncake", MAX_STEPS="50")
    res = subprocess.run(
        ["bash", "scripts/gpu_real_width.sh", "30"], cwd=box, env=env, capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stdout + res.stderr
    launches = [c["args"] for c in _calls(tmp_path) if c["cmd"] == "launch"]
    assert launches == [[str(out / "recipe-run.yaml"), "--plan"], [str(out / "recipe-run.yaml"), "--no-bench"]]
    copy = yaml.safe_load((out / "recipe-run.yaml").read_text())
    orig = yaml.safe_load((box / "recipes" / "kimi-k25-slice-h200.yaml").read_text())
    assert copy["server"]["transport"] == "mooncake" and orig["server"]["transport"] == "cuda_ipc"
    assert "ipc_pool_gib" not in copy["server"]  # IPC_POOL_GIB is cuda_ipc's only
    assert copy["trainer"]["max_steps"] == 50 and orig["trainer"]["max_steps"] == 300
    copy["server"].pop("transport"), orig["server"].pop("transport")
    copy["trainer"].pop("max_steps"), orig["trainer"].pop("max_steps")
    assert copy == orig
    assert "launch rc=0" in (out / "launch.out").read_text()


def test_real_width_trainer_set_changes_trainer_fields_and_refuses_unknown_ones(tmp_path):
    """``TRAINER_SET=step_empty_cache=true,fused_adamw=false,step_optimizer_fused_clip=false``: SpecForge's
    allocator and optimizer, in a copy; a field the recipe does not have stops before launch with the recipe's own
    error."""
    import yaml

    box, env = _sandbox(tmp_path)
    (box / "runs" / "k25-slice-data").mkdir(parents=True)
    (box / "runs" / "k25-slice-data" / "prompts.jsonl").write_text("{}\n")
    out = tmp_path / "out"
    env.update(
        STAGE="train",
        OUT=str(out),
        TRAINER_SET="step_empty_cache=true,fused_adamw=false,step_optimizer_fused_clip=false",
    )
    res = subprocess.run(
        ["bash", "scripts/gpu_real_width.sh", "30"], cwd=box, env=env, capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stdout + res.stderr
    copy = yaml.safe_load((out / "recipe-run.yaml").read_text())
    orig = yaml.safe_load((box / "recipes" / "kimi-k25-slice-h200.yaml").read_text())
    assert copy["trainer"]["step_empty_cache"] is True and copy["trainer"]["fused_adamw"] is False
    assert copy["trainer"]["step_optimizer_fused_clip"] is False
    for k in ("step_empty_cache", "fused_adamw", "step_optimizer_fused_clip"):
        copy["trainer"].pop(k), orig["trainer"].pop(k, None)
    assert copy == orig
    res = subprocess.run(
        ["bash", "scripts/gpu_real_width.sh", "30"],
        cwd=box,
        env={**env, "TRAINER_SET": "step_emty_cache=true"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 2 and "trainer.step_emty_cache: Extra inputs are not permitted" in res.stderr
    assert len([c for c in _calls(tmp_path) if c["cmd"] == "launch"]) == 2  # the bad copy never launched


def test_draft_run_launches_with_its_listeners_listed_then_benches(tmp_path):
    box, env = _sandbox(tmp_path)
    (box / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "listeners_during.py", box / "tests")
    out = tmp_path / "out"
    env.update(
        RECIPE="recipes/tiny-k25-tp1-h200-dflash.yaml",
        OUT=str(out),
        TAG="tiny_dflash",
        SHIM_RUN=str(box / "runs/tiny-k25-tp1-dflash"),
    )
    (box / "runs" / "tiny-k25-tp1-dflash" / "stale").mkdir(parents=True)  # a leftover of an earlier run
    res = subprocess.run(
        ["bash", "scripts/gpu_draft_run.sh", "60", "60"], cwd=box, env=env, capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stdout + res.stderr
    calls = [(c["cmd"], c["args"]) for c in _calls(tmp_path)]
    assert [c for c, _ in calls] == ["launch", "launch", "run-report", "bench"]
    assert calls[0][1][-1] == "--plan" and calls[1][1][-1] == "--no-bench"
    assert calls[3][1] == [
        "--recipe",
        "recipes/tiny-k25-tp1-h200-dflash.yaml",
        "--draft",
        "runs/tiny-k25-tp1-dflash/export-sglang",
        "--out",
        f"{out}/bench",
    ]
    assert not (box / "runs" / "tiny-k25-tp1-dflash" / "stale").exists()
    listing = json.loads((out / "listeners.json").read_text())
    assert listing["returncode"] == 0 and listing["samples"] >= 1
    assert "launch rc=0" in (out / "launch.out").read_text()
    assert "bench rc=0" in (out / "bench.out").read_text()
    assert (out / "capture-server-node0.log").is_file() and not (out / "online_run.json").exists()
    assert (out / "online_run_tiny_dflash.json").is_file()
    assert (out / "acceptance_tiny_dflash.json").read_bytes() == (out / "bench" / "bench_result.json").read_bytes()


def test_draft_run_in_two_stages_with_its_step_count_and_bench_flags(tmp_path):
    """STAGE=launch launches only (listeners listed), STAGE=bench benches only what it left, with BENCH_ARGS on
    the bench's command line; MAX_STEPS runs a validated copy of the recipe whose only change is the step count; a
    bad STAGE or MAX_STEPS starts nothing."""
    import yaml

    box, env = _sandbox(tmp_path)
    (box / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "listeners_during.py", box / "tests")
    out = tmp_path / "out"
    recipe = "recipes/tiny-k25-tp1-h200.yaml"
    env.update(RECIPE=recipe, OUT=str(out), MAX_STEPS="1500", SHIM_RUN=str(box / "runs/tiny-k25-tp1"))

    run = _script(box, env, "scripts/gpu_draft_run.sh", "60", "60")

    res = run(STAGE="launch")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c["cmd"] for c in _calls(tmp_path)] == ["launch", "launch", "run-report"]
    assert json.loads((out / "listeners.json").read_text())["returncode"] == 0
    copy = yaml.safe_load((out / "recipe-run.yaml").read_text())
    orig = yaml.safe_load((box / recipe).read_text())
    assert copy["trainer"].pop("max_steps") == 1500 and orig["trainer"].pop("max_steps") == 3000
    assert copy == orig
    res = run(STAGE="bench", BENCH_ARGS="--num-prompts 8")
    assert res.returncode == 0, res.stdout + res.stderr
    calls = _calls(tmp_path)
    assert [c["cmd"] for c in calls] == ["launch", "launch", "run-report", "bench"]
    assert calls[-1]["args"] == [
        "--recipe", f"{out}/recipe-run.yaml", "--draft", "runs/tiny-k25-tp1/export-sglang",
        "--out", f"{out}/bench", "--num-prompts", "8",
    ]  # fmt: skip
    assert (box / "runs" / "tiny-k25-tp1" / "export-sglang").is_dir()  # the bench stage removed nothing
    for bad, message in ((dict(STAGE="train"), "STAGE must be all, launch or bench"),
                         (dict(STAGE="launch", MAX_STEPS="0"), "MAX_STEPS must be a positive integer")):  # fmt: skip
        res = run(**bad)
        assert res.returncode == 2 and message in res.stderr, res.stdout + res.stderr
    assert len(_calls(tmp_path)) == 4  # nothing started


def test_draft_run_bench_exports_a_launch_cut_before_its_export(tmp_path):
    """A launch cut by its time limit after its last checkpoint left no export and no run report: STAGE=bench
    exports the newest checkpoint as launch would, writes the run report, then benches; with an export in place it
    exports nothing."""
    box, env = _sandbox(tmp_path)
    out = tmp_path / "out"
    recipe = "recipes/tiny-k25-tp1-h200-dflash.yaml"
    run_dir = box / "runs" / "tiny-k25-tp1-dflash"
    (run_dir / "tiny-k25-tp1-dflash-step1200").mkdir(parents=True)  # what the cut launch left
    env.update(RECIPE=recipe, OUT=str(out), TAG="tiny_dflash")
    run = _script(box, env, "scripts/gpu_draft_run.sh", "60", "60")

    res = run(STAGE="bench")
    assert res.returncode == 0, res.stdout + res.stderr
    calls = _calls(tmp_path)
    assert [c["cmd"] for c in calls] == ["export", "run-report", "bench"]
    assert calls[0]["args"] == ["--recipe", recipe]
    assert calls[1]["args"] == ["runs/tiny-k25-tp1-dflash", "--out", f"{out}/online_run.json"]
    assert "export rc=0" in (out / "export.out").read_text()
    assert (out / "online_run_tiny_dflash.json").is_file() and (out / "acceptance_tiny_dflash.json").is_file()

    res = run(STAGE="bench")  # the export and the report are there now: the bench alone
    assert res.returncode == 0, res.stdout + res.stderr
    assert [c["cmd"] for c in _calls(tmp_path)][3:] == ["bench"]


def test_tiny_compare_launches_both_then_benches_both_and_compares(tmp_path):
    """scripts/gpu_tiny_compare.sh: STAGE=launch launches the EAGLE-3 recipe, then its DFlash twin, each with the same
    step count (FAMILIES one of them); STAGE=bench benches both with BENCH_ARGS (FAMILIES one per call) and writes the
    comparison once both acceptance files are there, every file named after the card nvidia-smi names; a bad STAGE,
    MAX_STEPS or FAMILIES starts nothing."""
    import yaml

    box, env = _sandbox(tmp_path)
    (box / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "listeners_during.py", box / "tests")
    (box / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "draft_comparison.py", box / "bench")
    out = tmp_path / "out"
    env.update(OUT=str(out), MAX_STEPS="1200", SHIM_RUN="recipe")

    run = _script(box, env, "scripts/gpu_tiny_compare.sh", "60", "60", timeout=300)

    res = run(STAGE="launch")
    assert res.returncode == 0, res.stdout + res.stderr
    launches = [c["args"][0] for c in _calls(tmp_path) if c["cmd"] == "launch" and c["args"][-1] == "--no-bench"]
    assert launches == [f"{out}/eagle3/recipe-run.yaml", f"{out}/dflash/recipe-run.yaml"]
    res = run(STAGE="launch", FAMILIES="dflash")  # one family per device call
    assert res.returncode == 0, res.stdout + res.stderr
    launches = [c["args"][0] for c in _calls(tmp_path) if c["cmd"] == "launch" and c["args"][-1] == "--no-bench"]
    assert launches[2:] == [f"{out}/dflash/recipe-run.yaml"]
    for family in ("eagle3", "dflash"):
        assert yaml.safe_load((out / family / "recipe-run.yaml").read_text())["trainer"]["max_steps"] == 1200
        assert (out / family / f"online_run_tiny_{family}_tp1_h200.json").is_file()
        assert json.loads((out / family / "listeners.json").read_text())["returncode"] == 0
    res = run(STAGE="bench", FAMILIES="eagle3", BENCH_ARGS="--num-prompts 8")  # one bench per device call
    assert res.returncode == 0, res.stdout + res.stderr
    assert "comparison skipped: a bench result is missing" in res.stdout
    assert not (out / "draft_comparison_tiny_tp1_h200.json").exists()
    res = run(STAGE="bench", FAMILIES="dflash", BENCH_ARGS="--num-prompts 8")
    assert res.returncode == 0, res.stdout + res.stderr
    benches = [c["args"] for c in _calls(tmp_path) if c["cmd"] == "bench"]
    assert [b[b.index("--draft") + 1] for b in benches] == [
        "runs/tiny-k25-tp1/export-sglang",
        "runs/tiny-k25-tp1-dflash/export-sglang",
    ]
    assert benches[0][-2:] == ["--num-prompts", "8"]
    # the DFlash bench takes the EAGLE-3 bench's baseline (one server start less)
    assert benches[1][-4:] == ["--num-prompts", "8", "--baseline-from", f"{out}/eagle3/bench"]
    comparison = json.loads((out / "draft_comparison_tiny_tp1_h200.json").read_text())
    assert comparison["block_vs_eagle3_acceptance_length"] == 4.0 / 2.5 and comparison["goal"]["met"] is True
    assert comparison["training"]["block_vs_eagle3_trained_tokens"] == 1.0
    assert (comparison["eagle3"]["baseline_from"], comparison["block"]["baseline_from"]) == (
        None,
        f"{out}/eagle3/bench",
    )
    assert "comparison rc=0" in res.stdout
    # a baseline the bench refuses to take (not like for like): the DFlash bench serves its own
    res = run(STAGE="bench", FAMILIES="dflash", BENCH_ARGS="--num-prompts 8", SHIM_REFUSE_BASELINE="2")
    assert res.returncode == 0, res.stdout + res.stderr
    retried = [c["args"] for c in _calls(tmp_path) if c["cmd"] == "bench"][2:]
    assert [b[-2:] for b in retried] == [["--baseline-from", f"{out}/eagle3/bench"], ["--num-prompts", "8"]]
    assert "its own baseline" in res.stdout and (out / "dflash" / "acceptance_tiny_dflash_tp1_h200.json").is_file()
    assert "not like for like" in (out / "dflash" / "bench-shared-baseline.out").read_text()
    # the earlier bench's files were kept aside, not taken for the refused one's
    assert (out / "dflash" / "bench-before-1" / "acceptance_tiny_dflash_tp1_h200.json").is_file()
    reused = json.loads((out / "dflash" / "acceptance_tiny_dflash_tp1_h200.json").read_text())["baseline"]
    assert reused == {"reused_from": None}  # its own baseline
    # a bench that failed or was cut otherwise (here rc 124) is not run again: its call's time is spent
    res = run(STAGE="bench", FAMILIES="dflash", BENCH_ARGS="--num-prompts 8", SHIM_REFUSE_BASELINE="124")
    assert res.returncode == 0 and "not retried" in res.stdout, res.stdout + res.stderr
    assert len([c for c in _calls(tmp_path) if c["cmd"] == "bench"]) == 5  # one more, no retry
    n = len(_calls(tmp_path))
    for bad, message in ((dict(STAGE="train"), "STAGE must be all, launch or bench"),
                         (dict(MAX_STEPS="0"), "MAX_STEPS must be a positive integer"),
                         (dict(STAGE="launch", FAMILIES="eagle3 medusa"), "FAMILIES holds eagle3 and/or dflash"),
                         (dict(STAGE="launch", FAMILIES=" "), "FAMILIES is empty")):  # fmt: skip
        res = run(**bad)
        assert res.returncode == 2 and message in res.stderr, res.stdout + res.stderr
    assert len(_calls(tmp_path)) == n  # nothing started
