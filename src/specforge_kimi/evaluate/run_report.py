"""What an online run did, read back from its output directory: steps, loss, ledger, disk, memory.

Scope: a run directory written by ``specforge-kimi launch`` (SpecForge 0.2.0 disaggregated online
mode). Sources, all SpecForge's own: the consumer log's ``step N: {...}`` lines (rank 0's console
metrics), the consumer ledger ``consumer-state/consumer.sqlite`` (``committed`` = refs the
consumer accepted with their ``num_tokens``; ``acked`` = samples whose optimizer step became
durable; ``marker.global_step``), the checkpoint directories ``<run_id>-step<N>`` and the export.
What was trained (strategy, the draft's width and layers, the target layers it reads): the rendered SpecForge
config, the draft config rendered beside it and the target's config. Disk: every byte under the run directory
except checkpoints, the export, the rendered configs and this command's own ``run-report/``, per trained token -- features travel through
Mooncake, so this is metadata (refs, ledger, logs). GPU memory per role from the per-process samples
``launch`` records (``logs/gpu_mem_samples.csv``, :mod:`run.gpu_memory`) or ``--gpu-samples``. The
JSON goes to ``--out`` (default ``<run_dir>/run-report/run_report.json``), the plots
(:mod:`run_plots`) beside it.

    specforge-kimi run-report runs/tiny-k25-tp2 [--gpu-samples gpu_mem_samples.csv] [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from specforge_kimi.durable import write_atomic
from specforge_kimi.errors import KimiInputError
from specforge_kimi.run.ledger import ledger
from specforge_kimi.run.progress import consumer_steps

#: where ``run-report`` writes its JSON and plots by default: ``<run_dir>/run-report/``
REPORT_DIR = "run-report"


def run_steps(run: Path) -> list[dict]:
    """SpecForge's logged steps of the consumer over every attempt of the run (``logs/``, then ``logs-attempt2/``, ... of
    ``launch --resume``); a step trained again by a later attempt counts as that attempt logged it (it is the
    one the final weights hold)."""
    dirs = [run / "logs"] + sorted(run.glob("logs-attempt*"), key=lambda p: int(p.name.rsplit("attempt", 1)[1]))
    by_step: dict[int, dict] = {}
    for d in dirs:
        logs = sorted(d.glob("consumer-node*.log"))
        for s in consumer_steps("\n".join(p.read_text(errors="replace") for p in logs)):
            by_step[s["step"]] = s
    return [by_step[k] for k in sorted(by_step)]


def disk_bytes(run_dir: Path, run_id: str) -> dict:
    """Bytes under ``run_dir`` by top-level entry, split into checkpoints/export and the rest."""
    by_entry: dict[str, int] = {}
    for p in run_dir.rglob("*"):
        if p.is_file() and not p.is_symlink():
            top = p.relative_to(run_dir).parts[0]
            if top == REPORT_DIR:  # this command's own output, not the run's
                continue
            by_entry[top] = by_entry.get(top, 0) + p.stat().st_size
    excluded = {k for k in by_entry if k.startswith(f"{run_id}-step") or k in ("export-sglang", "rendered")}
    return {
        "by_entry": by_entry,
        "checkpoints_and_export": sum(by_entry[k] for k in excluded),
        "metadata": sum(v for k, v in by_entry.items() if k not in excluded),
    }


def gpu_memory(samples_csv: Path) -> dict:
    """Peak MiB per role from ``time,pid,used_mib,cmdline`` samples (:mod:`run.gpu_memory`)."""
    from specforge_kimi.run.gpu_memory import read_samples, role_of

    peaks: dict[str, int] = {}
    for _t, pid, mib, cmd in read_samples(samples_csv):
        key = f"{role_of(cmd)}:{pid}"
        peaks[key] = max(peaks.get(key, 0), mib)
    by_role: dict[str, int] = {}
    for key, mib in peaks.items():
        role = key.split(":")[0]
        by_role[role] = max(by_role.get(role, 0), mib)
    return {"peak_mib_per_process": peaks, "peak_mib_per_role": by_role}


def perf(steps: list[dict], led: dict, *, skip: int = 10) -> dict:
    """Medians of SpecForge's per-step perf metrics (after ``skip`` warm-up steps) and the token
    rates they imply: end-to-end = tokens per step / step time; trainer-only = tokens per step /
    compute time (the step without waiting for features). With the ``allocator-retries`` seam's metrics in the
    steps, also the trainer allocator's retries per step (``allocator_retries_per_step``: above 0, the trainer's
    GPU room is smaller than what its caching allocator reserves, and each retry costs a device sync)."""
    import statistics

    body = steps[skip:] if len(steps) > skip + 5 else steps
    keys = (
        "perf/optimizer_step_time_s",
        "perf/data_wait_time_s",
        "perf/train_compute_time_s",
        "perf/durable_ack_time_s",
        "perf/global_samples_per_second",
        "perf/cuda_alloc_retries",
        "perf/cuda_reserved_gib",
    )
    med = {
        k.split("/", 1)[1]: statistics.median(s[k] for s in body) for k in keys if body and all(k in s for s in body)
    }
    tokens_per_step = led["trained_tokens"] / led["global_step"] if led.get("global_step") else None
    out = {
        "steps_used": len(body),
        "warmup_steps_skipped": len(steps) - len(body),
        "median": med,
        "tokens_per_step": tokens_per_step,
    }
    if tokens_per_step and med.get("optimizer_step_time_s"):
        out["end_to_end_tokens_per_s"] = tokens_per_step / med["optimizer_step_time_s"]
    if tokens_per_step and med.get("train_compute_time_s"):
        out["trainer_only_tokens_per_s"] = tokens_per_step / med["train_compute_time_s"]
    if "cuda_alloc_retries" in med:
        out["allocator_retries_per_step"] = med["cuda_alloc_retries"]
    if med.get("optimizer_step_time_s"):
        out["data_wait_fraction"] = med.get("data_wait_time_s", 0.0) / med["optimizer_step_time_s"]
    return out


def transport(run: Path) -> str | None:
    """The run's feature transport, from the launch sheet ``launch`` rendered (``rendered/launch.json``): its
    ``transport`` entry, or for a sheet written before it had one, the trainer ranks' transport variable
    (mooncake when unset); None without a sheet."""
    import json

    from specforge_kimi.transport import registry

    sheet_path = run / "rendered" / "launch.json"
    if not sheet_path.is_file():
        return None
    sheet = json.loads(sheet_path.read_text())
    if isinstance(sheet.get("transport"), dict):
        return sheet["transport"].get("transport")
    return registry.from_env(sheet.get("env") or {}).name


def trainer_step(run: Path) -> dict[str, str] | None:
    """The trainer step the run's ranks ran: the step variables of the launch sheet's environment
    (``training.step_knobs``), SpecForge's own values for a sheet written before it set them (SpecForge's step
    was the only one then); None without a sheet. An allocator setting the launching shell passed down
    (``trainer.cuda_alloc_conf`` unset) is not in the sheet and not here."""
    from specforge_kimi.training.step_knobs import ALLOC_CONF_ENV, step_env

    sheet_path = run / "rendered" / "launch.json"
    if not sheet_path.is_file():
        return None
    env = json.loads(sheet_path.read_text()).get("env") or {}
    specforge = step_env(empty_cache=True, fused_adamw=False, alloc_conf=None)  # SpecForge's own step
    out = {key: env.get(key, value) for key, value in specforge.items()}
    if env.get(ALLOC_CONF_ENV):
        out[ALLOC_CONF_ENV] = env[ALLOC_CONF_ENV]
    return out


def _acc_keys(step: dict) -> list[str]:
    """The accuracies a logged step carries: EAGLE-3's per TTT position (``acc_0``, ``acc_1``, ...), or a strategy's
    single ``acc`` (a block draft's) when it logs no positions."""
    positions = sorted(k for k in step if k.startswith("acc_"))
    return positions or (["acc"] if "acc" in step else [])


def _config_json(path: Path | None) -> dict:
    """A JSON object read from ``path``; {} when there is none or it is not a readable object."""
    if path is None:
        return {}
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _launched_path(value, run: Path, output_dir) -> Path | None:
    """A path the rendered config names (the target's) (``launch`` writes them relative to the directory it ran in): absolute as
    is; relative, against that directory (``run`` less the config's ``output_dir``) when it is there, else as given;
    None for an empty value."""
    if not value or not isinstance(value, str):
        return None
    p = Path(value)
    if p.is_absolute():
        return p
    out = Path(output_dir) if isinstance(output_dir, str) and output_dir else None
    parts = run.resolve().parts
    if out is not None and not out.is_absolute() and parts[len(parts) - len(out.parts) :] == out.parts:
        rooted = Path(*parts[: len(parts) - len(out.parts)]) / p
        if rooted.exists():
            return rooted
    return p


def draft(cfg: dict, run: Path) -> dict:
    """What the run trained: the strategy (the rendered SpecForge config's ``training.strategy``: ``eagle3``,
    ``dflash``, ...), the draft config's architecture, width, layers and block size (``rendered/draft_config.json``,
    the file that config names), the captured target layers, and the target's hidden size (its ``config.json``). A
    file that cannot be read leaves its entries None."""
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    training = cfg.get("training") if isinstance(cfg.get("training"), dict) else {}
    out = {"strategy": training.get("strategy", "eagle3")}
    d = _config_json(run / "rendered" / "draft_config.json")
    arch = d.get("architectures")
    out["architecture"] = arch[0] if isinstance(arch, list) and arch else None
    for key in ("hidden_size", "num_hidden_layers", "block_size"):
        out[f"draft_{key}"] = d.get(key)
    block = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    out["target_layer_ids"] = block.get("target_layer_ids") or model.get("aux_hidden_state_layer_ids")
    target = _launched_path(model.get("target_model_path"), run, cfg.get("output_dir"))
    t = _config_json(target / "config.json" if target is not None else None)
    text = t.get("text_config") if isinstance(t.get("text_config"), dict) else t
    out["target_hidden_size"] = text.get("hidden_size")
    return out


def report(run_dir: str | Path, *, gpu_samples: str | None = None) -> dict:
    run = Path(run_dir)
    rendered = run / "rendered" / "specforge_run.yaml"
    if not rendered.is_file():
        raise KimiInputError(f"{run} is not a launched run directory (no rendered/specforge_run.yaml)")
    import yaml

    cfg = yaml.safe_load(rendered.read_text())
    run_id = cfg["run_id"]
    steps = run_steps(run)
    losses = [s["loss"] for s in steps if "loss" in s]
    k = max(1, min(20, len(losses) // 5)) if losses else 0
    led = ledger(run)
    disk = disk_bytes(run, run_id)
    step_dir = re.compile(rf"^{re.escape(run_id)}-step(\d+)$")  # not the *.abandoned-attemptK a --resume set aside
    ckpts = sorted(
        (p.name for p in run.glob(f"{run_id}-step*") if step_dir.match(p.name) and (p / "training_state.pt").is_file()),
        key=lambda n: int(n.rsplit("step", 1)[1]),
    )
    out = {
        "run_dir": str(run),
        "run_id": run_id,
        "transport": transport(run),
        "draft": draft(cfg, run),
        "trainer_step_env": trainer_step(run),
        "max_steps": cfg["training"].get("max_steps"),
        "steps_logged": len(steps),
        "last_step": steps[-1]["step"] if steps else 0,
        "loss_first_mean": sum(losses[:k]) / k if k else None,
        "loss_last_mean": sum(losses[-k:]) / k if k else None,
        "loss_window": k,
        "losses": losses,
        "acc_last_mean": (
            {key: sum(s.get(key, 0.0) for s in steps[-k:]) / k for key in _acc_keys(steps[-1])} if k else {}
        ),
        "ledger": led,
        "checkpoints": ckpts,
        "export_dir": str(run / "export-sglang"),
        "export_present": (run / "export-sglang" / "config.json").is_file(),
        "disk": disk,
        "metadata_bytes_per_trained_token": (
            disk["metadata"] / led["trained_tokens"] if led.get("trained_tokens") else None
        ),
        "feature_bytes_per_trained_token": (
            led["feature_bytes_trained"] / led["trained_tokens"] if led.get("trained_tokens") else None
        ),
    }
    out["perf"] = perf(steps, led)
    samples = default_gpu_samples(run, gpu_samples)
    if samples is not None:
        out["gpu_memory"] = gpu_memory(samples)
        out["gpu_samples"] = str(samples)
    return out


def default_gpu_samples(run: Path, given: str | None) -> Path | None:
    """``given``, else the samples ``launch`` records (``logs/gpu_mem_samples.csv``), if the file exists."""
    from specforge_kimi.run.gpu_memory import SAMPLES_CSV

    path = Path(given) if given else run / "logs" / SAMPLES_CSV
    return path if path.is_file() else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``run-report`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.description = (
        "Reads the run back from what SpecForge wrote (consumer log, ledger, checkpoints) and writes "
        "run_report.json with PNG plots beside it: loss, per-position acceptance, trained tokens/s, GPU memory per role."
    )
    p.add_argument("run_dir", help="the recipe's output_dir")
    p.add_argument(
        "--gpu-samples",
        default=None,
        help="per-process GPU-memory samples CSV (time,pid,used_mib,cmdline) "
        "(default: RUN_DIR/logs/gpu_mem_samples.csv, which launch records when nvidia-smi is there)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="the JSON file to write; the plots go beside it (default: RUN_DIR/run-report/run_report.json)",
    )
    p.add_argument("--no-plots", action="store_true", help="write the JSON only")


def run(args) -> int:
    run_dir = Path(args.run_dir)
    res = report(run_dir, gpu_samples=args.gpu_samples)
    out = Path(args.out) if args.out else run_dir / REPORT_DIR / "run_report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        from specforge_kimi.evaluate.run_plots import plot_run

        res["plots"] = plot_run(
            run_steps(run_dir),
            res["perf"].get("tokens_per_step"),
            out.parent,
            title=res["run_id"],
            gpu_samples=res.get("gpu_samples"),
        )
    write_atomic(out, json.dumps(res, indent=2))
    brief = {k: v for k, v in res.items() if k not in ("losses", "disk")}
    brief["disk_metadata_bytes"] = res["disk"]["metadata"]
    brief["report_json"] = str(out)
    print(json.dumps(brief, indent=2))
    retries = res["perf"].get("allocator_retries_per_step")
    if retries:
        print(
            f"note: the trainer's caching allocator retried {retries:g} times a step (median): its GPU room is smaller "
            "than what it reserves, and each retry syncs the device (docs/online.md, 'Memory: how one GPU is shared')",
            file=sys.stderr,
        )
    return 0
