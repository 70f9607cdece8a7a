"""Co-located launch: Mooncake master, SGLang capture server (TP=N), producer and N trainer ranks
on the same N GPUs, supervised by SpecForge's own ``run_commands``.

Scope: one node of a recipe (:mod:`recipes`). SpecForge 0.2.0's ``managed_local`` mode refuses
trainer GPUs that overlap the capture server's; its supervisor does not care. So we build the
``LaunchPlan`` ourselves -- ``managed_supervisor`` kind: service phase 0 the Mooncake master
(readiness: metadata HTTP + RPC TCP), phase 1 the text-only capture server on all node GPUs
(readiness: ``/health``), then the producer and the torchrun consumer on the same GPUs -- and hand
it to ``specforge.launch_plan.run_commands``, which starts services in phase order, waits for
readiness, stops everything if any child fails, forwards Ctrl-C/TERM/HUP and tears down process
groups (grace, then SIGKILL). Every role writes its own log under ``<output_dir>/logs``. The
memory split is checked when the recipe loads; nothing starts if it does not fit. After a clean
finish the newest checkpoint is exported for SGLang and the recipe's acceptance bench runs
(``bench:`` section); below its ``min_acceptance_length`` the command exits 1. With
``server.transport: cuda_ipc`` no Mooncake master starts (the features go through the server's GPU pool),
the preflight also wants SGLang patch spec-capture-cuda-ipc and, at TP > 1, peer access from every GPU to GPU 0, and what a
killed server's pool left behind is removed when the run ends. The recipe's input files are checked first (:mod:`inputs`),
then the free disk of its output_dir against the checkpoints and export the run keeps (:mod:`disk`: a fresh run is
refused, ``--resume`` warns); an output_dir an earlier launch used is refused unless ``--resume`` continues that
run (:mod:`resume`, which also restarts a failed attempt under ``resilience.run_restarts``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specforge_kimi.environment import SERVER_OUTAGE_S
from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.devices import node_gpus
from specforge_kimi.plan.run_plan import RunPlan

SERVER_START_TIMEOUT_S = 900.0  # K2.5 at TP=8 loads ~550 GB; first starts JIT-compile kernels
MOONCAKE_START_TIMEOUT_S = 60.0
#: the Mooncake master's service label (a role, not a transport)
MASTER_LABEL = "mooncake"


def _logged(argv: list[str], log: Path) -> tuple[str, ...]:
    """Run ``argv`` with stdout+stderr appended to ``log``; ``exec`` keeps the pid and signals."""
    return ("/bin/sh", "-c", 'exec "$@" >>"$0" 2>&1', str(log), *argv)


def _py(argv: list[str], python: str) -> list[str]:
    """The rendered sheet says ``python``; run with this interpreter."""
    return [python if i == 0 and a == "python" else a for i, a in enumerate(argv)]


def _master_service(plan: RunPlan, python: str):
    """Phase 0: the Mooncake master (readiness: metadata HTTP + RPC TCP)."""
    from specforge.launch_plan import CommandSpec, ReadinessSpec, ServiceSpec

    mc = plan.recipe.mooncake
    return ServiceSpec(
        command=CommandSpec(MASTER_LABEL, tuple(_py(list(plan.master_argv), python)), {}),
        readiness=ReadinessSpec(
            "mooncake",
            f"http://{mc.host}:{mc.metadata_port}/metadata?key=specforge-health-check",
            MOONCAKE_START_TIMEOUT_S,
            tcp_host=mc.host,
            tcp_port=mc.rpc_port,
        ),
        log_path=str(plan.output_dir / "logs" / "mooncake.log"),
        phase=0,
    )


def _keeper_service(plan: RunPlan, python: str):
    """Phase 1 with ``segment_owner: keeper``: the process that mounts the Mooncake segment."""
    from specforge.launch_plan import CommandSpec, ReadinessSpec, ServiceSpec

    mc, port = plan.recipe.mooncake, plan.recipe.resilience.keeper_port
    argv = (python, "-m", "specforge_kimi.run.segment_keeper", "--host", mc.host, "--port", str(port))
    return ServiceSpec(
        command=CommandSpec("segment-keeper", argv, {**plan.server_env, "CUDA_VISIBLE_DEVICES": ""}),
        readiness=ReadinessSpec("http", f"http://{mc.host}:{port}/health", MOONCAKE_START_TIMEOUT_S),
        log_path=str(plan.output_dir / "logs" / "segment-keeper.log"),
        phase=1,
    )


def _server_service(plan: RunPlan, env: dict, *, node_rank: int, python: str, local_host: str | None, phase: int):
    """The capture server on the node's GPUs (readiness: ``/health``), under the keeper with server restarts."""
    from specforge.launch_plan import CommandSpec, ReadinessSpec, ServiceSpec

    r = plan.recipe
    argv = [a.replace("${NODE_RANK}", str(node_rank)) for a in _py(list(plan.server_argv), python)]
    if r.gpus.nnodes > 1 and node_rank != 0 and "--host" in argv:  # SGLang's other nodes bind their stand-in here
        argv[argv.index("--host") + 1] = local_host
    if r.resilience.server_restarts:
        argv = [python, "-m", "specforge_kimi.run.keeper", "--restarts", str(r.resilience.server_restarts), "--"] + argv
    return ServiceSpec(
        command=CommandSpec("capture-server", tuple(argv), env),
        readiness=ReadinessSpec("http", f"http://{r.server.host}:{r.server.port}/health", SERVER_START_TIMEOUT_S),
        log_path=str(plan.output_dir / "logs" / f"capture-server-node{node_rank}.log"),
        phase=phase,
    )


def _trainer_commands(plan: RunPlan, env: dict, *, node_rank: int, python: str) -> list:
    """The producer (node 0) and the node's torchrun consumer, each logging to its own file."""
    from specforge.launch_plan import CommandSpec

    r, logs = plan.recipe, plan.output_dir / "logs"
    commands = []
    if node_rank == 0:
        commands.append(
            CommandSpec("producer", _logged(_py(list(plan.producer_argv), python), logs / "producer.log"), env)
        )
    consumer = _py(list(plan.consumer_argv), python)
    if r.gpus.nnodes > 1:
        consumer.insert(3, f"--node_rank={node_rank}")
    if r.resilience.consumer_restarts:
        restarts = str(r.resilience.consumer_restarts)
        keeper = [python, "-m", "specforge_kimi.run.keeper", "--restarts", restarts, "--resume-consumer"]
        consumer = [*keeper, str(plan.output_dir), r.name, "--", *consumer]
    commands.append(CommandSpec("consumer", _logged(consumer, logs / f"consumer-node{node_rank}.log"), env))
    return commands


def build_colocated_plan(plan: RunPlan, *, node_rank: int = 0, python: str = "python", local_host: str | None = None):
    """A SpecForge ``LaunchPlan`` for one node of the run ``plan``.

    Multi-node: ``local_host`` is this node's address the other nodes reach (Mooncake's
    ``MOONCAKE_LOCAL_HOSTNAME`` for its server and trainer ranks, and the bind address of a
    non-zero node's SGLang ranks); node 0 defaults to ``server.host``, other nodes must give it.
    Each node keeps its own supervisor directory under the shared ``output_dir``."""
    from specforge.launch_plan import LaunchPlan

    r = plan.recipe
    res, mc, multinode = r.resilience, r.mooncake, r.gpus.nnodes > 1
    if multinode and local_host is None and node_rank != 0:
        raise KimiInputError(
            f"node {node_rank} of a {r.gpus.nnodes}-node recipe needs --local-host: this "
            "node's address the other nodes reach (Mooncake transfers and SGLang bind to it)"
        )
    local_host = (local_host or r.server.host) if multinode else None
    gpus = node_gpus(r.gpus.per_node)
    master = node_rank == 0 and plan.strategy.runs_mooncake_master
    keeper = node_rank == 0 and res.segment_owner == "keeper"
    services = ([_master_service(plan, python)] if master else []) + ([_keeper_service(plan, python)] if keeper else [])
    server_env = {**plan.server_env, "CUDA_VISIBLE_DEVICES": gpus}
    if keeper:
        server_env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] = "0"  # the server puts into the keeper's segment
    if multinode:
        server_env["MOONCAKE_LOCAL_HOSTNAME"] = local_host
    phase = 2 if keeper else 1
    services.append(
        _server_service(plan, server_env, node_rank=node_rank, python=python, local_host=local_host, phase=phase)
    )
    env = {
        **plan.process_env,
        "CUDA_VISIBLE_DEVICES": gpus,
        SERVER_OUTAGE_S.name: str(res.server_outage_s),
        **({"MOONCAKE_LOCAL_HOSTNAME": local_host} if multinode else {}),
    }
    ports = (
        *((mc.rpc_port, mc.metadata_port) if master else ()),
        r.server.port,
        *([res.keeper_port] if keeper else []),
    )
    return LaunchPlan(
        kind="managed_supervisor",
        role="both",
        commands=tuple(_trainer_commands(plan, env, node_rank=node_rank, python=python)),
        services=tuple(services),
        managed_root=str(plan.output_dir / ("supervisor" if node_rank == 0 else f"supervisor-node{node_rank}")),
        managed_ports=ports if node_rank == 0 else (),
        shutdown_grace_s=30.0,
    )


def preflight(plan) -> None:
    """Refuse to start with one clear error: busy port, stale run directory, missing engines.

    Covers what SpecForge's own managed preflight checks, as :class:`KimiInputError` with a fix.
    """
    import importlib.util

    if plan.managed_root and Path(plan.managed_root).exists():
        raise KimiInputError(
            f"{plan.managed_root} exists: a previous launch used this output_dir; "
            "move it away or choose another output_dir"
        )
    from specforge_kimi.run.services import port_taken

    for port in plan.managed_ports:
        if port_taken(port):
            raise KimiInputError(
                f"port 127.0.0.1:{port} is already in use; stop what holds it or change the recipe's ports"
            )
    masters = [s for s in plan.services if s.command.label == MASTER_LABEL]
    if masters and importlib.util.find_spec("mooncake") is None:
        raise KimiInputError("the mooncake package is missing; pip install mooncake-transfer-engine-cuda13")
    if importlib.util.find_spec("sglang.srt.spec_capture_sink") is None:
        from specforge_kimi.setup.setup_patches import GET_CHECKOUT

        raise KimiInputError(
            "the installed sglang lacks SpecForge's spec-capture patch; run specforge-kimi setup "
            f"--specforge-checkout DIR with a SpecForge checkout: {GET_CHECKOUT}"
        )
    compact_preflight(plan)
    transport_preflight(plan)
    trainer_step_preflight(plan)


def disk_preflight(recipe, *, resume: bool) -> None:
    """Refuse a fresh run whose kept checkpoints and export (:mod:`plan.disk`) exceed the free disk of its
    output_dir; on ``--resume`` only warn, since the checkpoints already written are on that disk."""
    from specforge_kimi.plan import disk

    short = disk.shortfall(recipe)
    if short is None:
        return
    if not resume:
        raise KimiInputError(f"{short}: {disk.FIXES}")
    print(f"warning: {short}; {disk.FIXES}", flush=True)


def transport_preflight(plan) -> None:
    """Refuse to start when the host lacks what the capture server's transport needs (its strategy's
    ``preflight``: the SGLang patch it names, and for cuda_ipc peer access from every GPU to GPU 0)."""
    from specforge_kimi.setup.setup_patches import cuda_ipc_gaps
    from specforge_kimi.transport import registry

    for service in plan.services:
        if service.command.label != "capture-server":
            continue
        strategy = registry.from_env(service.command.env, server=True)
        gaps = cuda_ipc_gaps() if strategy.sglang_patch else []
        problems = strategy.preflight(service.command.env.get("CUDA_VISIBLE_DEVICES", ""), gaps)
        if problems:
            raise KimiInputError("; ".join(problems))


def compact_preflight(plan) -> None:
    """With ``server.compact_passthrough`` on (the plan's SpecForge processes carry the variable), refuse to
    start unless both halves of it are applied (``setup_patches.compact_passthrough_gaps``)."""
    from specforge_kimi.servers.capture_server import COMPACT_PASSTHROUGH_ENV

    if any(c.env.get(COMPACT_PASSTHROUGH_ENV) == "1" for c in plan.commands):
        from specforge_kimi.setup.setup_patches import compact_passthrough_gaps

        gaps = compact_passthrough_gaps()
        if gaps:
            raise KimiInputError(
                "server.compact_passthrough is on, but " + "; ".join(gaps) + ". Run specforge-kimi "
                "setup --specforge-checkout /path/to/SpecForge, or set server.compact_passthrough: "
                "false in the recipe"
            )


def trainer_step_preflight(plan) -> None:
    """Refuse to start when the plan's SpecForge processes ask for a trainer-step setting (``trainer.step_empty_cache:
    false``, ``trainer.fused_adamw: true``, ``trainer.step_fewer_host_syncs: true``, ``trainer.step_chunked_head_loss:
    N``) whose SpecForge patch is not applied: without it the variable is ignored and the run trains as SpecForge
    ships, silently."""
    from specforge_kimi.setup.setup_patches import specforge_patch_gaps
    from specforge_kimi.training.step_knobs import patches_needed

    needed = sorted({name for c in plan.commands for name in patches_needed(c.env)})
    gaps = specforge_patch_gaps(needed) if needed else []
    if gaps:
        raise KimiInputError(
            "the recipe's trainer.step_empty_cache: false / trainer.fused_adamw: true / trainer.step_fewer_host_syncs: "
            "true / trainer.step_chunked_head_loss need our SpecForge patches, but "
            + "; ".join(gaps)
            + ". Run specforge-kimi setup, or set trainer.step_empty_cache: true, trainer.fused_adamw: false, "
            "trainer.step_fewer_host_syncs: false and trainer.step_chunked_head_loss: null"
        )


def run_plan(plan, *, mps_dirs: tuple[str, str] | None = None, gpus: str | None = None, **kwargs) -> int:
    """``specforge.launch_plan.run_commands`` after making the log directory it expects, inside the run's CUDA MPS
    daemon when ``mps_dirs`` is set (recipe ``overlap.mps``, :mod:`specforge_kimi.run.mps`: started before the
    services, stopped after every role, however the run ends)."""
    from specforge.launch_plan import run_commands

    from specforge_kimi.run import mps

    if plan.managed_root is None:
        raise KimiInputError("plan has no managed_root")
    logs = Path(plan.services[0].log_path).parent if plan.services else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    with mps.daemon(mps_dirs, gpus, say=lambda m: print(m, flush=True)):
        return run_commands(plan, **kwargs)


def export_latest(plan: RunPlan) -> Path:
    """Export the run's newest checkpoint (``<output_dir>/<run_id>-latest``) for SGLang into
    ``<output_dir>/export-sglang`` (:func:`specforge_kimi.drafts.export.export_run_draft`, by the draft's
    architecture: Llama-style or MLA EAGLE-3 with captured positions as aux ids, or a DFlash block draft;
    provenance); returns that directory.
    """
    import sys

    from specforge_kimi.drafts.export import export_run_draft
    from specforge_kimi.targets.layer_ids import AuxLayers

    recipe, out = plan.recipe, plan.output_dir
    latest = out / f"{recipe.name}-latest"
    if not (latest / "training_state.pt").is_file():
        raise KimiInputError(f"{latest} has no training_state.pt: the run wrote no checkpoint")
    model = plan.specforge_config["model"]
    ids = recipe.target.aux_layer_ids  # EAGLE-3's; a block draft's ids live in its draft config
    aux = None if ids is None else AuxLayers.from_specforge(ids, recipe.target.num_layers)
    return export_run_draft(
        latest,
        model["draft_model_config"],
        out / "export-sglang",
        vocab_mapping_path=model.get("vocab_mapping_path"),
        target_dir=recipe.target.path,
        aux=aux,
        command=sys.argv,
        extra={"checkpoint": str(latest.resolve()), "recipe": recipe.name},
        mask_token_id=model.get("mask_token_id"),  # block drafts: checked against the checkpoint's
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``launch`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.add_argument("recipe", help="recipe YAML (recipes/*.yaml); its output_dir receives configs, logs, checkpoints")
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's rank in a multi-node recipe (0 runs Mooncake, the producer, the export and the bench)",
    )
    p.add_argument(
        "--local-host",
        default=None,
        help="multi-node: this node's address the others reach "
        "(default on node 0: the recipe's server.host; required on the others)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in the recipe's output_dir from its newest complete checkpoint "
        "(every service restarted; what was acknowledged after the checkpoint is captured again; docs/online.md)",
    )
    p.add_argument(
        "--stop-stale",
        action="store_true",
        help="with --resume: stop processes the previous attempt left (SIGTERM, then SIGKILL) instead of refusing",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print what would run (commands, environments, logs, the SpecForge config, the memory split) as one "
        "JSON document and exit; writes nothing",
    )
    p.add_argument("--no-bench", action="store_true", help="skip the acceptance bench after training")
    p.add_argument(
        "--no-export",
        action="store_true",
        help="skip the export and the bench: a run measured, not served (bench/overlap_rates.py's runs); "
        "`specforge-kimi export --recipe` exports its checkpoint later",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no status line while the run trains (`specforge-kimi watch OUTPUT_DIR` shows it from elsewhere)",
    )


def plan_document(plan: RunPlan, launch_plan) -> dict:
    """What ``launch --plan`` prints: the supervisor's plan, the SpecForge and draft configs and the
    memory split and the disk estimate, with the directory ``launch`` would render them into (nothing is written)."""
    import json

    from specforge_kimi.plan import disk

    return {
        "recipe": plan.name,
        "transport": plan.transport.as_dict(),
        "rendered_dir": str(plan.rendered_dir),
        "written": False,
        "plan": json.loads(launch_plan.render()),
        "specforge_config": plan.rendered()["specforge_config"],
        "draft_config": plan.draft_config,
        "memory_plan": dict(plan.memory),
        "disk": disk.as_dict(plan.recipe),
    }


def run(args) -> int:
    import json
    import sys
    import time

    started = time.monotonic()

    from specforge_kimi.plan.run_plan import compile_plan  # not the module's name: run_plan is this module's runner

    compiled = compile_plan(args.recipe)
    recipe = compiled.recipe
    if args.stop_stale and not args.resume:
        raise KimiInputError("--stop-stale goes with --resume")
    if not args.plan:
        from specforge_kimi.plan.inputs import require_inputs

        require_inputs(recipe)  # target, tokenizer, prompts, vocab mapping, lengths: one line each, nothing started
        disk_preflight(recipe, resume=args.resume)
        compiled.write()
    plan = build_colocated_plan(compiled, node_rank=args.node_rank, python=sys.executable, local_host=args.local_host)
    if args.plan:
        print(json.dumps(plan_document(compiled, plan), indent=2))
        return 0
    out = Path(recipe.output_dir)
    from contextlib import nullcontext

    from specforge_kimi.run.gpu_memory import SAMPLES_CSV, GpuSampler
    from specforge_kimi.run.progress import LiveProgress
    from specforge_kimi.run.resume import run_attempts

    def attempt(p) -> int:  # run_attempts removes stale cuda_ipc pools around it
        logs = Path(p.services[0].log_path).parent if p.services else out / "logs"
        print(
            f"starting {', '.join(s.command.label for s in p.services)}, then "
            f"{', '.join(c.label for c in p.commands)} (TP={recipe.tp}, {recipe.gpus.per_node} trainer ranks per "
            f"node); logs: {logs}",
            flush=True,
        )
        # node 0's per-process GPU memory for run-report (SpecForge records none); the status line reads
        # SpecForge's own files
        sampler = GpuSampler(logs / SAMPLES_CSV) if args.node_rank == 0 else nullcontext()
        with sampler, nullcontext() if args.no_progress else LiveProgress(out):
            gpus = node_gpus(recipe.gpus.per_node)
            return run_plan(p, mps_dirs=compiled.mps_dirs, gpus=gpus, managed_preflight=lambda _plan: None)

    rc = run_attempts(
        recipe,
        plan,
        attempt,
        resume=args.resume,
        stop_stale=args.stop_stale,
        restarts=recipe.resilience.run_restarts,
        check=preflight,
        say=lambda m: print(m, flush=True),
    )
    if rc != 0:
        print(f"the run stopped with exit code {rc}; the first failing role's log is under {out / 'logs'}", flush=True)
        return rc
    if args.node_rank != 0:  # node 0 exports and benches; the output_dir is shared
        print(f"node {args.node_rank}: training done; node 0 exports the draft and runs the bench", flush=True)
        return 0
    trained = time.monotonic()
    print(f"every role stopped {trained - started:.0f} s after launch started", flush=True)
    if args.no_export:
        return 0
    export_dir = export_latest(compiled)
    print(f"exported draft: {export_dir} (in {time.monotonic() - trained:.0f} s)", flush=True)
    if args.no_bench:
        return 0
    # every recipe ends with its acceptance bench, in a process of its own (`specforge-kimi bench --recipe`:
    # its own SGLang servers, the run's GPUs are free now); it exits 1 below bench.min_acceptance_length
    import subprocess

    return subprocess.call(
        [sys.executable, "-m", "specforge_kimi", "bench", "--recipe", str(args.recipe), "--draft", str(export_dir)]
    )
