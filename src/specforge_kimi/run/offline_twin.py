"""A recipe's offline twin: its prompts captured once to disk through the same capture server the
online run uses (``capture-features``), and its draft trained on them by SpecForge's offline trainer
(``train-offline``).

Scope: the offline side of an online-vs-offline comparison (the same draft trained offline on the
same captured data), and offline training in general. ``capture-features`` starts the recipe's
Mooncake master and capture server (:mod:`specforge_kimi.run.services`, the recipe's own server
argv), sends ``prompts.jsonl`` rows through SpecForge's producer transport
(``SGLangServerCaptureAdapter.produce_refs``) exactly as the online producer does, reads every
sample back with SpecForge's ``MooncakeFeatureStore.get`` and writes it in SpecForge's offline
format (``input_ids``, ``loss_mask``, ``hidden_state`` [1,L,H], ``aux_hidden_state`` [1,L,3H];
:mod:`specforge_kimi.training.offline` documents it), one ``sample-NNNNNN.ckpt`` per row, into
``OUT.partial`` renamed to ``OUT`` when complete. Features are what the server computed (bf16 on
GPUs). ``train-offline`` uses the recipe's draft config, vocab mapping, lr, TTT, max length and seed.

    specforge-kimi capture-features RECIPE --out runs/features [--limit N]
    specforge-kimi train-offline RECIPE --features runs/features --out runs/offline
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from specforge_kimi.durable import make_staging, refuse_link, remove_stale_staging, replace_dir, write_atomic
from specforge_kimi.errors import KimiInputError
from specforge_kimi.servers.capture_server import COMPACT_PASSTHROUGH_ENV

BATCH_TOKENS = 16384


def _rows(prompts_path: Path, limit: int | None) -> list[dict]:
    rows = []
    with open(prompts_path) as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                row = json.loads(line)
                rows.append(
                    {"input_ids": [int(x) for x in row["input_ids"]], "loss_mask": [int(x) for x in row["loss_mask"]]}
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise KimiInputError(f"{prompts_path}:{n}: not a prepare row ({exc})") from None
    if not rows:
        raise KimiInputError(f"{prompts_path} has no rows")
    return rows


def _batches(rows: list[dict], max_length: int) -> Iterator[list[int]]:
    batch, tokens = [], 0
    for i, row in enumerate(rows):
        n = min(len(row["input_ids"]), max_length)
        if batch and tokens + n > BATCH_TOKENS:
            yield batch
            batch, tokens = [], 0
        batch.append(i)
        tokens += n
    if batch:
        yield batch


def producer_body(adapter, tasks, *, compact: bool) -> dict:
    """The ``/generate`` body SpecForge's ``SGLangServerCaptureAdapter.produce_refs`` posts for
    ``tasks``, built with its own request and payload builders, with :data:`COMPACT_PASSTHROUGH_ENV`
    set for the call (``compact``) or unset; for benches that post it themselves."""
    import uuid

    old = os.environ.pop(COMPACT_PASSTHROUGH_ENV, None)
    if compact:
        os.environ[COMPACT_PASSTHROUGH_ENV] = "1"
    try:
        body = adapter._request_inputs(tasks)
        body["extra_key"] = [uuid.uuid4().hex for _ in tasks]
        body["sampling_params"] = {"temperature": 0.0, "max_new_tokens": 1}
        body["spec_capture"] = [adapter._spec_capture_payload(t) for t in tasks]
    finally:
        os.environ.pop(COMPACT_PASSTHROUGH_ENV, None)
        if old is not None:
            os.environ[COMPACT_PASSTHROUGH_ENV] = old
    return body


def capture_tools(
    url: str,
    mooncake,
    *,
    aux_ids: Sequence[int],
    hidden: int,
    vocab: int,
    run_id: str,
    store=None,
    method: str = "eagle3",
    timeout_s: float = 1800.0,
):
    """SpecForge's producer transport for one capture server, as its online producer builds it:
    ``(SGLangServerCaptureAdapter, CaptureConfig, MooncakeFeatureStore, server layout)`` for the ``method``
    strategy (``eagle3`` or ``dflash``, SpecForge's ``specforge.algorithms.<method>``); ``store`` another feature
    store in the Mooncake one's place (the cuda_ipc one: ``transport.store``); ``timeout_s`` the adapter's wait for
    one ``/generate``."""
    import importlib

    from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
    from specforge.inference.capture import CaptureConfig
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    from specforge_kimi.servers.capture_server import mooncake_reader_setup_kwargs

    algorithm = importlib.import_module(f"specforge.algorithms.{method}.providers").create_registration()
    streaming = algorithm.providers.server_streaming_for("text")
    layout = streaming.layout
    schema = ServerCaptureSchema(
        aux_feature=layout.aux_feature,
        last_hidden_feature=layout.last_hidden_feature,
        passthrough=layout.passthrough,
        attention_mask_feature=layout.attention_mask_feature,
    )
    contract = algorithm.spec.feature_contract("streaming", "text")
    cfg = CaptureConfig.from_strategy(
        required_features=contract.required_tensors,
        aux_hidden_state_layer_ids=tuple(aux_ids),
        target_repr=streaming.target_representation,
        target_hidden_size=hidden,
        target_vocab_size=vocab,
    )
    if store is None:
        store = MooncakeFeatureStore(store_id=run_id, setup_kwargs=mooncake_reader_setup_kwargs(mooncake))
    adapter = SGLangServerCaptureAdapter(
        url,
        store,
        run_id=run_id,
        algorithm=algorithm.name,
        schema=schema,
        timeout_s=timeout_s,
        target_model_version=run_id,
    )
    return adapter, cfg, store, layout


def capture_to_disk(
    url: str,
    mooncake,
    rows: list[dict],
    out: Path,
    *,
    aux_ids: Sequence[int],
    hidden: int,
    vocab: int,
    max_length: int,
    run_id: str = "capture-features",
) -> dict:
    """Capture ``rows`` through the server at ``url``; write one ``.ckpt`` per row under ``out``."""
    import torch
    from specforge.inference.adapters.server_capture import ServerCaptureFailure
    from specforge.runtime.contracts import PromptTask

    adapter, cfg, store, layout = capture_tools(
        url, mooncake, aux_ids=aux_ids, hidden=hidden, vocab=vocab, run_id=run_id
    )
    out.mkdir(parents=True, exist_ok=True)
    written, tokens = 0, 0
    for batch in _batches(rows, max_length):
        tasks = [
            PromptTask(
                task_id=f"row{i:06d}",
                run_id=run_id,
                source_id="capture-features",
                payload={k: v[:max_length] for k, v in rows[i].items()},
                max_length=max_length,
                metadata={"num_tokens": min(len(rows[i]["input_ids"]), max_length)},
            )
            for i in batch
        ]
        results = adapter.produce_refs(tasks, capture=cfg)
        for i, res in zip(batch, results, strict=False):
            if isinstance(res, ServerCaptureFailure):
                raise RuntimeError(f"row {i}: capture failed: {res.reason}")
            store.adopt(res)
            tensors, handle = store.get(res)
            sample = {
                "input_ids": tensors["input_ids"][0].clone(),
                "loss_mask": tensors["loss_mask"][0].clone(),
                "hidden_state": tensors[layout.last_hidden_feature].clone(),
                "aux_hidden_state": tensors[layout.aux_feature].clone(),
            }
            store.release(handle)
            store.abort(res.sample_id, reason="captured-to-disk")
            torch.save(sample, out / f"sample-{i:06d}.ckpt")
            written += 1
            tokens += int(sample["input_ids"].numel())
    return {"written": written, "tokens": tokens}


def run_recipe(
    plan,
    out_dir: str | Path,
    *,
    limit: int | None = None,
    server_argv: list[str] | None = None,
    start_timeout_s: float = 900.0,
) -> dict:
    """Start the plan's Mooncake + capture server on this node, capture its recipe's prompts, stop both."""
    recipe = plan.recipe
    from specforge_kimi.plan.devices import node_gpus
    from specforge_kimi.run import services
    from specforge_kimi.servers.capture_server import capture_server_env

    out = Path(out_dir)
    refuse_link(out, "--out")
    if out.exists():
        raise KimiInputError(f"{out} exists; choose a new --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    partial = make_staging(out)  # .OUT.partial-PID-RANDOM; swapped in whole once every sample is written
    rows = _rows(Path(recipe.data.prompts_path), limit)
    work = out.with_name(out.name + ".logs")
    work.mkdir(parents=True, exist_ok=True)
    port, *mc_ports = services.free_ports(4)  # drawn together: a port drawn alone can come back for the master
    t0 = time.monotonic()
    with services.mooncake_master(
        work / "mooncake.log", segment_bytes=int(recipe.mooncake.global_segment_gib * 2**30), ports=mc_ports
    ) as mc:
        argv = server_argv or [sys.executable if a == "python" else a for a in plan.server_argv]
        argv[argv.index("--port") + 1] = str(port)
        # the plan's server environment, with this master's Mooncake endpoints and segment
        env = {**plan.server_env, **capture_server_env(mc)}
        env["CUDA_VISIBLE_DEVICES"] = node_gpus(recipe.gpus.per_node)
        with services.server(argv, env, work / "capture-server.log", port, timeout_s=start_timeout_s):
            stats = capture_to_disk(
                f"http://127.0.0.1:{port}",
                mc,
                rows,
                partial,
                aux_ids=recipe.target.aux_layer_ids,
                hidden=recipe.target.hidden_size,
                vocab=recipe.target.vocab_size,
                max_length=recipe.trainer.max_length,
            )
    replace_dir(partial, out)
    summary = {
        "command": sys.argv,
        "recipe": recipe.name,
        "prompts_path": recipe.data.prompts_path,
        "out": str(out),
        "seconds": round(time.monotonic() - t0, 1),
        **stats,
    }
    write_atomic(out.with_name(out.name + ".json"), json.dumps(summary, indent=2))
    return summary


def add_capture_arguments(p: argparse.ArgumentParser) -> None:
    """The ``capture-features`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.add_argument("recipe", help="recipe YAML (recipes/*.yaml): target, server flags, data and draft")
    p.add_argument("--out", required=True, help="new directory for sample-NNNNNN.ckpt files")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")


def run_capture(args) -> int:
    from specforge_kimi.plan import run_plan

    summary = run_recipe(run_plan.compile_plan(args.recipe), args.out, limit=args.limit)
    print(json.dumps(summary, indent=2))
    return 0


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The ``train-offline`` command's arguments (``specforge_kimi.cli.COMMANDS`` declares the command)."""
    p.add_argument("recipe", help="recipe YAML (recipes/*.yaml): target, server flags, data and draft")
    p.add_argument("--features", required=True, help="directory of SpecForge offline .ckpt feature files")
    p.add_argument("--out", required=True, help="output directory (checkpoints, export-sglang/)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the recipe's max_steps)")


def _check_inputs(recipe, features: str) -> None:
    """What train-offline reads, before anything is written: a clear error instead of SpecForge's traceback."""
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    from specforge_kimi.errors import KimiInputError

    if not os.path.isdir(features):
        raise KimiInputError(f"--features {features} is not a directory (specforge-kimi capture-features output)")
    if not list_feature_files(features):
        raise KimiInputError(f"--features {features} holds no .ckpt / .ckpt.gz feature files")
    if not os.path.isdir(recipe.target.path):
        raise KimiInputError(f"target.path {recipe.target.path} is not a directory")
    if not os.path.isfile(recipe.data.vocab_mapping_path):
        raise KimiInputError(
            f"data.vocab_mapping_path {recipe.data.vocab_mapping_path} not found (specforge-kimi prepare writes it)"
        )


def run_train(args) -> int:
    """Same draft config, vocab mapping, lr, TTT, max length, seed, global batch (one rank,
    gradient accumulation = the recipe's trainer ranks) and, on a GPU, attention backend as the
    recipe's online run."""
    import json

    from specforge_kimi import console
    from specforge_kimi.plan import run_plan
    from specforge_kimi.run.progress import StepLines

    plan = run_plan.compile_plan(args.recipe, rendered_dir=os.path.join(args.out, "rendered"))
    recipe = plan.recipe
    _check_inputs(recipe, args.features)
    model = plan.write()["specforge_config"]["model"]
    max_steps = args.steps or recipe.trainer.max_steps
    log = os.path.join(args.out, "specforge.log")
    print(f"training offline, {max_steps} steps; SpecForge's own output: {log}", flush=True)
    steps = StepLines()
    with console.output_to_log(log, on_line=steps):
        steps.bar = console.Progress("train-offline", max_steps, unit="step")
        result = _train_and_export(recipe, args.features, args.out, model["draft_model_config"], max_steps)
        steps.bar.close()
    k = max(1, min(50, len(result["losses"]) // 5))
    summary = {
        "steps": len(result["losses"]),
        "loss_first_mean": sum(result["losses"][:k]) / k,
        "loss_last_mean": sum(result["losses"][-k:]) / k,
        "checkpoint_dir": result["checkpoint_dir"],
        "export_dir": result["export_dir"],
        "specforge_log": log,
    }
    print(json.dumps(summary, indent=2))
    return 0


def _train_and_export(recipe, features: str, out: str, draft_config: str, max_steps: int) -> dict:
    """SpecForge's offline trainer on ``features``, then the SGLang export of its last checkpoint."""
    import sys

    from specforge_kimi.drafts.export import export_run_draft
    from specforge_kimi.targets.layer_ids import AuxLayers
    from specforge_kimi.training.offline import _cuda_available, train_offline

    result = train_offline(
        target_dir=recipe.target.path,
        draft_config_path=draft_config,
        hidden_states_path=features,
        vocab_mapping_path=recipe.data.vocab_mapping_path,
        output_dir=out,
        max_steps=max_steps,
        ttt_length=recipe.trainer.ttt_length,
        learning_rate=recipe.trainer.learning_rate,
        max_length=recipe.trainer.max_length,
        seed=recipe.trainer.seed,
        embedding_key=recipe.target.embedding_key,
        lm_head_key=recipe.target.lm_head_key,
        save_interval=recipe.trainer.save_interval or None,
        accumulation_steps=recipe.gpus.per_node * recipe.gpus.nnodes,
        extra_overrides={
            "training.max_checkpoints": recipe.trainer.max_checkpoints,
            # the recipe's attention backend on a GPU; sdpa on the CPU (flex has no CPU backward)
            **(
                {"training.attention_backend": recipe.trainer.attention_backend}
                if _cuda_available()
                else {"model.torch_dtype": "float32"}
            ),
        },
    )
    export_dir = os.path.join(out, "export-sglang")
    export_run_draft(
        result["checkpoint_dir"],
        draft_config,
        export_dir,
        vocab_mapping_path=recipe.data.vocab_mapping_path,
        target_dir=recipe.target.path,
        aux=AuxLayers.from_specforge(recipe.target.aux_layer_ids, recipe.target.num_layers),
        command=sys.argv,
        extra={"offline_features": os.path.abspath(features)},
    )
    return {**result, "export_dir": export_dir}
