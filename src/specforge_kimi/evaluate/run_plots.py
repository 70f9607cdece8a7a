"""PNG plots of an online run, drawn from what ``run-report`` reads back (SpecForge's own outputs).

Scope: one run directory's consumer-log metrics (``step N: {...}``, every ``training.log_interval``
steps), its ledger's tokens per step, and optionally the per-process GPU-memory samples
(``time,pid,used_mib,cmdline``: what ``launch`` records in ``logs/gpu_mem_samples.csv`` when
``nvidia-smi`` is there, or ``scripts/gpu_online_run.sh``'s file). Four figures:

- ``run_loss.png``: SpecForge's training loss per logged step (single-batch values, so noisy) and
  their running mean;
- ``run_acceptance.png``: per TTT position, SpecForge's ``acceptance_rate_i`` (expected acceptance of
  the draft's distribution against the target's) and ``acc_i`` (top-1 agreement);
- ``run_throughput.png``: trained tokens per second per logged step, end to end (the ledger's tokens
  per step over SpecForge's ``perf/optimizer_step_time_s``) and trainer only (over
  ``perf/train_compute_time_s``, the step without waiting for features);
- ``run_gpu_memory.png``: GPU memory over time per role (the largest of the role's processes, i.e.
  per GPU), only with samples.
"""

from __future__ import annotations

from pathlib import Path

from specforge_kimi.run.progress import per_position


def _roles_over_time(samples_csv: Path) -> dict[str, list[tuple[float, int]]]:
    """Per role, ``(time, MiB)`` of its largest process at each sample time."""
    from specforge_kimi.run.gpu_memory import read_samples, role_of

    per_time: dict[str, dict[float, int]] = {}
    for t, _pid, mib, cmd in read_samples(samples_csv):
        series = per_time.setdefault(role_of(cmd), {})
        series[t] = max(series.get(t, 0), mib)
    return {role: sorted(s.items()) for role, s in per_time.items()}


def _running_mean(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_run(steps: list[dict], tokens_per_step: float | None, out_dir: Path, *, title: str, gpu_samples=None) -> dict:
    """Write the figures under ``out_dir``; returns ``{name: path}`` of those written (a figure whose
    data is missing is left out: ``{name: "why"}`` under ``"skipped"``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict = {}
    skipped: dict = {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / f"run_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written[name] = str(path)

    logged = [s for s in steps if "loss" in s]
    if logged:
        x = [s["step"] for s in logged]
        loss = [s["loss"] for s in logged]
        fig, ax = plt.subplots(figsize=(7, 3.6))
        ax.plot(x, loss, lw=0.8, label="loss (one batch)")
        ax.plot(x, _running_mean(loss, max(1, len(loss) // 10)), lw=2, label="running mean")
        ax.set(xlabel="optimizer step", ylabel="SpecForge loss", title=f"{title}: draft loss")
        ax.legend(fontsize=8)
        save(fig, "loss")
    else:
        skipped["loss"] = "no `step N: {...}` line in logs/consumer-node*.log yet"

    acc_rows = [s for s in steps if per_position(s, "acc") or per_position(s, "acceptance_rate")]
    if acc_rows:
        x = [s["step"] for s in acc_rows]
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
        for ax, stem, what in (
            (axes[0], "acceptance_rate", "acceptance_rate_i (expected acceptance)"),
            (axes[1], "acc", "acc_i (top-1 agreement)"),
        ):
            n = max(len(per_position(s, stem)) for s in acc_rows)
            for j in range(n):
                ax.plot(x, [(per_position(s, stem) + [float("nan")] * n)[j] for s in acc_rows], lw=1, label=f"pos {j}")
            ax.set(xlabel="optimizer step", title=what, ylim=(0, 1))
            if n:
                ax.legend(fontsize=7, ncol=2)
        axes[0].set_ylabel("per TTT position")
        fig.suptitle(f"{title}: per-position acceptance", fontsize=10)
        save(fig, "acceptance")
    else:
        skipped["acceptance"] = "no per-position metrics logged yet"

    timed = [s for s in steps if s.get("perf/optimizer_step_time_s")]
    if timed and tokens_per_step:
        x = [s["step"] for s in timed]
        fig, ax = plt.subplots(figsize=(7, 3.6))
        ax.plot(x, [tokens_per_step / s["perf/optimizer_step_time_s"] for s in timed], lw=1.2, label="end to end")
        compute = [s for s in timed if s.get("perf/train_compute_time_s")]
        if compute:
            ax.plot(
                [s["step"] for s in compute],
                [tokens_per_step / s["perf/train_compute_time_s"] for s in compute],
                lw=1.2,
                label="trainer only (no data wait)",
            )
        ax.set(
            xlabel="optimizer step",
            ylabel="trained tokens / s",
            title=f"{title}: throughput ({tokens_per_step:.0f} tokens per step, from the ledger)",
        )
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        save(fig, "throughput")
    else:
        skipped["throughput"] = "needs perf/optimizer_step_time_s in the log and trained tokens in the ledger"

    if gpu_samples and Path(gpu_samples).is_file():
        roles = _roles_over_time(Path(gpu_samples))
        if roles:
            t0 = min(t for series in roles.values() for t, _ in series)
            fig, ax = plt.subplots(figsize=(7, 3.6))
            for role, series in sorted(roles.items()):
                ax.plot([t - t0 for t, _ in series], [m / 1024 for _, m in series], lw=1.2, label=role)
            ax.set(xlabel="seconds since the first sample", ylabel="GiB (largest process of the role)")
            ax.set(title=f"{title}: GPU memory per role")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
            save(fig, "gpu_memory")
        else:
            skipped["gpu_memory"] = f"{gpu_samples} has no samples"
    else:
        skipped["gpu_memory"] = "no GPU-memory samples (logs/gpu_mem_samples.csv or --gpu-samples)"
    return {**written, **({"skipped": skipped} if skipped else {})}
