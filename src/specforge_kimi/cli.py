"""``specforge-kimi``: thin subcommands over the modules; heavy imports happen per command.

Bad input (:class:`errors.KimiInputError`) prints one ``error: ...`` line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specforge_kimi.errors import KimiInputError, validation_summary


def _cmd_tiny(args: argparse.Namespace) -> int:
    from specforge_kimi.targets.tiny import TinySpec, write_tiny

    spec = TinySpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        experts=args.experts,
        experts_per_token=args.experts_per_token,
        moe_intermediate=args.moe_intermediate,
        dense_intermediate=args.dense_intermediate,
        q_lora_rank=args.q_lora_rank,
        vocab=args.vocab,
        seed=args.seed,
        int4_experts=args.int4_experts,
    )
    if args.pretrain:
        from specforge_kimi.demo.pretrain import pretrain_structured_target
        from specforge_kimi.targets.checkpoint import resolve_device

        res = pretrain_structured_target(
            args.out_dir,
            spec,
            seconds=args.pretrain,
            device=resolve_device(args.device),
            lr=args.pretrain_lr,
            schedule=args.pretrain_schedule,
            loss=args.pretrain_loss,
            max_steps=args.pretrain_steps,
            deterministic=args.pretrain_deterministic,
            batch_size=args.pretrain_batch_size,
            precision=args.pretrain_precision,
            prompt_rules=args.pretrain_prompt_rules,
            prompt_rule=args.pretrain_prompt_rule,
        )
        tr, held = res["train"], res["heldout"]
        print(
            f"wrote tiny Kimi-K2.5 checkpoint pretrained on the structured corpus to {args.out_dir}: "
            f"{tr['steps']} steps, {tr['loss']} loss {tr['loss_first']:.3f} -> {tr['loss_last']:.3f}, held-out "
            f"answer loss {held['loss']:.3f} full vocab / {held['loss_corpus_tokens']:.3f} corpus tokens "
            f"(greedy acc {held['greedy_accuracy']:.2f}); see pretrain.json"
        )
        if "prompt_rules" in res:
            rh = res["prompt_rules"]["heldout"]
            print(
                f"prompt rules ({res['prompt_rules']['rule']}): {res['prompt_rules']['conversations']} conversations trained on; on the bench's own "
                f"chat/math/code prompts answer loss {rh['loss']:.3f}, greedy acc {rh['greedy_accuracy']:.2f}"
            )
        if tr["lr_schedule"] == "cosine" and tr["schedule_fraction"] < 1:
            print(
                f"note: the time budget ended the cosine schedule at {tr['schedule_fraction']:.0%} of its steps "
                "(deterministic runs decay over --pretrain-steps)"
            )
        return 0
    out = write_tiny(args.out_dir, spec, device=args.init_device)
    print(
        f"wrote tiny Kimi-K2.5 checkpoint to {out}"
        + (" (routed experts INT4, K2.5's format)" if spec.int4_experts else "")
    )
    return 0


def _tiny_arguments(p: argparse.ArgumentParser) -> None:
    """``tiny``: the checkpoint's shape, and the optional pretraining on the structured corpus."""
    from specforge_kimi.demo import prompt_rules  # light: the rule names for --pretrain-prompt-rule

    p.add_argument("out_dir", help="new directory for the checkpoint (config, safetensors, tokenizer)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (K2.5: 61; the first is dense)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (K2.5: 7168)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (divisible by the TP size you test)")
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (K2.5: 384)")
    p.add_argument("--experts-per-token", type=int, default=2, help="top-k routing (K2.5: 8)")
    p.add_argument("--moe-intermediate", type=int, default=256, help="routed expert intermediate size (K2.5: 2048)")
    p.add_argument("--dense-intermediate", type=int, default=1024, help="layer 0's dense MLP size (K2.5: 18432)")
    p.add_argument("--q-lora-rank", type=int, default=1536, help="MLA query low-rank size (K2.5: 1536)")
    p.add_argument("--vocab", type=int, default=163840, help="vocabulary (K2.5: 163840; must hold K2.5's special ids)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument(
        "--int4-experts",
        action="store_true",
        help="routed experts as K2.5 ships them: compressed-tensors pack-quantized int4, symmetric, "
        "group 32 (weight_packed/weight_scale/weight_shape), K2.5's quantization_config; with "
        "--pretrain they are quantized after training and the held-out numbers are the quantized model's",
    )
    p.add_argument(
        "--init-device",
        default="cpu",
        help="device that generates (and quantizes) the random weights: cpu (default; the same bytes "
        "for a seed everywhere) or cuda (a K2.5-width checkpoint in seconds; other bytes than cpu's)",
    )
    p.add_argument(
        "--pretrain",
        type=float,
        default=0,
        metavar="SECONDS",
        help="pretrain on the synthetic structured corpus for SECONDS (writes pretrain.json)",
    )
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=10_000,
        metavar="N",
        help="also stop pretraining after N optimizer steps (whichever of SECONDS / N ends first)",
    )
    p.add_argument(
        "--no-pretrain-deterministic",
        dest="pretrain_deterministic",
        action="store_false",
        help="allow non-deterministic kernels (faster on CUDA; two runs of N steps then differ)",
    )
    p.add_argument("--device", default="auto", help="pretraining device: auto, cpu, cuda, cuda:N")
    p.add_argument("--pretrain-lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--pretrain-batch-size", type=int, default=32, metavar="B", help="sequences per optimizer step")
    p.add_argument(
        "--pretrain-precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32, or bf16 autocast for the decoder's forward (weights, optimizer and loss in fp32)",
    )
    p.add_argument(
        "--pretrain-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="constant, or warm-up + cosine decay over --pretrain-steps (with "
        "--no-pretrain-deterministic: over the time budget if that ends first)",
    )
    p.add_argument(
        "--pretrain-loss",
        choices=("full", "corpus"),
        default="full",
        help="full: softmax over the whole vocab as the written checkpoint scores it (untrained "
        "tokens at logit 0); corpus: restricted to the corpus's tokens (earlier behaviour)",
    )
    p.add_argument(
        "--pretrain-prompt-rules",
        type=int,
        default=0,
        metavar="N",
        help="also pretrain on N chat/math/code prompts answered by a rule (specforge_kimi.demo.prompt_rules), "
        "so the target answers the bench's natural-language prompts by that rule, not at random",
    )
    p.add_argument(
        "--pretrain-prompt-rule",
        choices=sorted(prompt_rules.RULES),
        default=prompt_rules.DEFAULT_RULE,
        help="the rule of --pretrain-prompt-rules: echo (restate the prompt) or words (its first words, "
        "one per numbered line); specforge_kimi.demo.prompt_rules describes both",
    )


def _cmd_inspect(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specforge_kimi.targets.checkpoint import inspect_target

    info = asdict(inspect_target(args.target))
    info.pop("text")
    print(json.dumps(info, indent=2))
    return 0


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    """``inspect``: the checkpoint."""
    p.add_argument("target", help="checkpoint directory (config.json + safetensors)")


def _cmd_layer_ids(args: argparse.Namespace) -> int:
    from specforge_kimi.targets.layer_ids import ENGINES, AuxLayers, parse_id_list

    given = parse_id_list(args.ids, "layer-ids")
    aux = AuxLayers.from_engine(args.engine, given, args.num_layers)
    views: dict[str, list[int] | str] = {}
    for engine in ENGINES:
        try:
            views[engine] = aux.to_engine(engine)
        except KimiInputError as exc:
            views[engine] = f"unreachable: {exc}"
    # an EAGLE-3 recipe (and SpecForge's config) takes SpecForge ids: the ids as given when they are SpecForge's or
    # SGLang's own, else the SpecForge view of the captured positions; a block draft takes the DFlash view
    recipe_ids = list(given) if args.engine in ("specforge", "sglang") else views["specforge"]
    if args.json:
        doc = {"recipe_aux_layer_ids": recipe_ids, "captured_positions": list(aux.positions), **views}
        print(json.dumps(doc, indent=2))
        return 0

    def ids(v) -> str:
        return ",".join(map(str, v)) if isinstance(v, list) else v

    rows = [
        ("recipe target.aux_layer_ids (SpecForge ids)", ids(recipe_ids)),
        ("captured positions = HF hidden_states indices", ids(list(aux.positions))),
        ("SGLang --spec-capture-aux-layer-ids (eagle3)", ids(recipe_ids)),
        ("vLLM ids", ids(views["vllm"])),
        ("exported drafts' eagle_aux_hidden_state_layer_ids", ids(views["sglang"])),
        ("block drafts' dflash_config.target_layer_ids", ids(views["dflash"])),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"aux layers of a {args.num_layers}-layer target, given as {args.engine} ids {ids(list(given))}:")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    block = (
        f"[{', '.join(map(str, views['dflash']))}] into a block draft's trainer.draft.dflash_config.target_layer_ids"
    )
    if args.engine == "dflash" or not isinstance(recipe_ids, list):
        eagle3 = "" if isinstance(recipe_ids, list) else " (EAGLE-3 cannot capture these positions)"
        print(f"put {block}{eagle3}")
        return 0
    same = (
        f" ({ids(list(aux.positions))} captures the same layers: SGLang shifts a list that starts at 1 by +1)"
        if recipe_ids[0] == 1
        else ""
    )
    print(f"put [{', '.join(map(str, recipe_ids))}] into the recipe's target.aux_layer_ids{same}")
    return 0


def _layer_ids_arguments(p: argparse.ArgumentParser) -> None:
    """``layer-ids``: the ids and whose convention they are in."""
    p.add_argument("ids", help="comma-separated, e.g. 1,29,57")
    p.add_argument(
        "--engine",
        default="specforge",
        choices=("specforge", "sglang", "vllm", "hf", "dflash"),
        help="whose convention the ids are in (dflash: a block draft's target_layer_ids, position = id + 1)",
    )
    p.add_argument("--num-layers", type=int, default=61, help="target decoder layers (K2.5: 61)")
    p.add_argument("--json", action="store_true", help="every convention as JSON instead of the table")


def _cmd_export(args: argparse.Namespace) -> int:
    if not args.recipe:
        from specforge_kimi.drafts.export import run

        return run(args)
    from specforge_kimi.plan.run_plan import compile_plan
    from specforge_kimi.run.launch import export_latest

    print(f"exported draft: {export_latest(compile_plan(args.recipe))}")
    return 0


def _cmd_export_check(args: argparse.Namespace) -> int:
    from specforge_kimi.drafts.export import check_any_export

    print(json.dumps(check_any_export(args.draft, args.target), indent=2))
    return 0


def _export_check_arguments(p: argparse.ArgumentParser) -> None:
    """``export-check``: the exported draft and, optionally, its target."""
    p.add_argument("draft", help="exported draft directory (config.json + model.safetensors)")
    p.add_argument("--target", default=None, help="target checkpoint to check sizes and aux ids against")


def _cmd_recipe(args: argparse.Namespace) -> int:
    from specforge_kimi.plan import run_plan

    plan = run_plan.compile_plan(args.recipe, rendered_dir=args.out if args.action == "render" else None)
    if args.action == "validate":
        if args.check_files:  # the data files against the target and each other (plan.inputs), one line each
            from specforge_kimi.plan.inputs import require_inputs

            require_inputs(plan.recipe)
        print(json.dumps(plan.report(), indent=2))
        return 0
    print(json.dumps(plan.write()["commands"], indent=2))
    return 0


def _recipe_arguments(p: argparse.ArgumentParser) -> None:
    """``recipe``: the action and the recipe."""
    p.add_argument(
        "action",
        choices=("validate", "render"),
        help="validate: schema + per-GPU memory split (writes nothing); render: write the SpecForge config, "
        "draft config and launch.json",
    )
    p.add_argument("recipe", help="recipe YAML (recipes/*.yaml)")
    p.add_argument("--out", default=None, help="render directory (default: OUTPUT_DIR/rendered)")
    p.add_argument(
        "--check-files",
        action="store_true",
        help="validate: also check that the target, its tokenizer, the prompts and the vocab mapping exist and "
        "agree (vocab, special ids, draft vocab, max_length within the server's context)",
    )


def _cmd_train(args: argparse.Namespace) -> int:
    """``specforge train`` with specforge_kimi registered here and in every child SpecForge starts."""
    import os

    import specforge_kimi

    sf = list(args.specforge_args)
    for flag in ("-c", "--config"):
        if flag in sf[:-1] and not os.path.exists(sf[sf.index(flag) + 1]):
            raise KimiInputError(f"run config {sf[sf.index(flag) + 1]} does not exist")
    plugins = [p for p in os.environ.get("SPECFORGE_PLUGINS", "").split(",") if p]
    if "specforge_kimi" not in plugins:
        os.environ["SPECFORGE_PLUGINS"] = ",".join(plugins + ["specforge_kimi"])
    specforge_kimi.register()
    from specforge_kimi.training.cpu_shims import install_cpu_shims

    install_cpu_shims()  # no-op with CUDA; lets a CPU-only rank (tests, debugging) train
    from pydantic import ValidationError
    from specforge.cli import main as specforge_main

    try:
        return int(specforge_main(["train", *args.specforge_args]) or 0)
    except ValidationError as exc:  # SpecForge's own config schema: one line, not its traceback
        raise KimiInputError(f"SpecForge run config: {validation_summary(exc)}") from None


def _train_arguments(p: argparse.ArgumentParser) -> None:
    """``train``: everything is passed on to ``specforge train``."""
    p.description = (
        "Passes its arguments to `specforge train`, e.g. "
        "torchrun --nproc_per_node 8 -m specforge_kimi train -c run.yaml --role consumer"
    )
    p.add_argument(
        "specforge_args",
        nargs=argparse.REMAINDER,
        help="passed on: see `specforge train --help` (-c CONFIG, --role ...)",
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from specforge_kimi.demo.pipeline import DemoSettings, run_demo

    settings = DemoSettings(
        out_dir=args.out,
        steps=args.steps,
        pretrain_seconds=args.pretrain_seconds,
        pretrain_steps=args.pretrain_steps,
        seed=args.seed,
        progress=not args.no_progress,
        draft=args.draft,
    )
    result = run_demo(settings)
    return 0 if result["ok"] else 1


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    """``demo``: the output directory and the budgets."""
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--steps", type=int, default=300, help="SpecForge optimizer steps")
    p.add_argument("--pretrain-seconds", type=float, default=60.0, help="tiny-target pretraining budget")
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=0,
        help="also stop tiny-target pretraining after this many steps (0: the time budget only)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny target and the training")
    p.add_argument(
        "--draft",
        choices=("eagle3", "dflash", "both"),
        default="eagle3",
        help="draft family: eagle3 (default), dflash (a DFlash block draft) or both on the same target and "
        "held-out prompts, their acceptance side by side (default: eagle3)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="print nothing but errors (SpecForge's own output still goes to OUT/specforge.log)",
    )


#: ``--help`` lists the commands by stage; a command missing here is listed under "other"
COMMAND_GROUPS = {
    "data": ("prepare", "regenerate"),
    "train": ("setup", "doctor", "recipe", "launch", "watch", "stop", "train"),
    "evaluate": ("export", "export-check", "bench", "run-report"),
    "tools": ("inspect", "layer-ids", "capture-features", "train-offline"),
    "tiny / dev (tiny targets, the CPU demo)": ("demo", "tiny", "eval-draft", "target-text"),
}


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default unless it states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text.lower()
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or action.default == []
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


def _group_commands(p: argparse.ArgumentParser, sub) -> None:
    """Move the command list of ``--help`` into stage groups (:data:`COMMAND_GROUPS`)."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    sub._choices_actions.clear()  # the flat list argparse would print
    width = max(map(len, helps)) + 2
    listed: set[str] = set()
    lines = ["commands, by stage (specforge-kimi COMMAND --help for each one's arguments):"]
    for group, names in (*COMMAND_GROUPS.items(), ("other", tuple(sorted(helps)))):
        names = [n for n in names if n in helps and n not in listed]
        if not names:
            continue
        lines.append(f"  {group}:")
        for n in names:
            lines += textwrap.wrap(
                helps[n], 110, initial_indent=f"    {n:<{width}}", subsequent_indent=" " * (4 + width)
            )
        listed.update(names)
    p.epilog = "\n".join(lines)


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, ``module:function`` strings for its handler and its argument-adder, its help.

    Nothing is imported until the command's parser is built; ``--help`` needs only the names and helps.
    """

    name: str
    handler: str  #: ``module:function`` taking the parsed ``argparse.Namespace``, returning an exit code
    help: str  #: the one line ``specforge-kimi --help`` lists
    arguments: str  #: ``module:function`` adding the command's arguments (and description) to its parser

    def load(self) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
        """The argument-adder and the handler; :class:`CommandUnavailable` when either cannot be imported."""
        return _resolve(self, self.arguments), _resolve(self, self.handler)


class CommandUnavailable(Exception):
    """A command whose module fails to import: ``specforge-kimi <cmd>: cannot import <module>: <error>``."""


def _resolve(command: Command, ref: str) -> Callable:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 -- any import-time failure; the other commands still work
        reason = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
        reason = " ".join(reason.split())  # one line, whatever the exception's text
        raise CommandUnavailable(f"specforge-kimi {command.name}: cannot import {module_name}: {reason}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise CommandUnavailable(
            f"specforge-kimi {command.name}: cannot import {ref}: no {attr} in {module_name}"
        ) from None


_K = "specforge_kimi."

#: every subcommand, declared once; ``--help`` groups them by :data:`COMMAND_GROUPS`
COMMANDS: tuple[Command, ...] = (
    Command(
        "tiny",
        _K + "cli:_cmd_tiny",
        "write a tiny random Kimi-K2.5 checkpoint (K2.5 names and nesting)",
        _K + "cli:_tiny_arguments",
    ),
    Command(
        "inspect",
        _K + "cli:_cmd_inspect",
        "check a target checkpoint and print what SpecForge needs",
        _K + "cli:_inspect_arguments",
    ),
    Command(
        "layer-ids",
        _K + "cli:_cmd_layer_ids",
        "convert aux layer ids between SpecForge/SGLang, vLLM and HF",
        _K + "cli:_layer_ids_arguments",
    ),
    Command(
        "export",
        _K + "cli:_cmd_export",
        "export a checkpoint for SGLang by its draft architecture (EAGLE-3, or DFlash for DFLASH), checked",
        _K + "drafts.export:add_arguments",
    ),
    Command(
        "export-check",
        _K + "cli:_cmd_export_check",
        "check an exported SGLang draft against what its loader needs",
        _K + "cli:_export_check_arguments",
    ),
    Command(
        "train",
        _K + "cli:_cmd_train",
        "`specforge train ...` with the K2.5 adapter registered (torchrun-able)",
        _K + "cli:_train_arguments",
    ),
    Command(
        "recipe",
        _K + "cli:_cmd_recipe",
        "validate a recipe or render it to SpecForge config + launch commands",
        _K + "cli:_recipe_arguments",
    ),
    Command(
        "demo",
        _K + "cli:_cmd_demo",
        "CPU demo: tiny K2.5 -> features -> SpecForge EAGLE-3 training -> export",
        _K + "cli:_demo_arguments",
    ),
    Command(
        "prepare",
        _K + "data.prepare:run",
        "conversations JSONL -> pre-tokenized prompts + draft vocab mapping",
        _K + "data.prepare:add_arguments",
    ),
    Command(
        "regenerate",
        _K + "data.regenerate:run",
        "replace assistant turns with K2.5's own generations via an OpenAI-compatible server",
        _K + "data.regenerate:add_arguments",
    ),
    Command(
        "setup",
        _K + "setup.setup_patches:run",
        "apply our patches to SpecForge and SpecForge's + ours to the installed SGLang",
        _K + "setup.setup_patches:add_arguments",
    ),
    Command(
        "launch",
        _K + "run.launch:run",
        "co-located online run of a recipe on this node (server + Mooncake + trainer), with a live status line",
        _K + "run.launch:add_arguments",
    ),
    Command(
        "stop",
        _K + "run.stop:run",
        "stop every process of a run on this node (its launcher, trainer ranks a kill -9 left behind) and "
        "remove what they left; the run stays resumable",
        _K + "run.stop:add_arguments",
    ),
    Command(
        "watch",
        _K + "run.progress:run",
        "the live status line of an online run (started elsewhere or in the background)",
        _K + "run.progress:add_arguments",
    ),
    Command(
        "doctor",
        _K + "setup.doctor:run",
        "check versions, patches, CUDA, target, Mooncake and GPU budget (read-only)",
        _K + "setup.doctor:add_arguments",
    ),
    Command(
        "bench",
        _K + "evaluate.bench:run",
        "acceptance length + speedup of a draft through SGLang speculation (EAGLE3, or DFLASH for a block draft)",
        _K + "evaluate.bench:add_arguments",
    ),
    Command(
        "eval-draft",
        _K + "demo.draft_eval:run",
        "tiny targets only: simulated acceptance of checkpoints on held-out corpus conversations",
        _K + "demo.draft_eval:add_arguments",
    ),
    Command(
        "run-report",
        _K + "evaluate.run_report:run",
        "summarize an online run directory (steps, loss, ledger, disk, memory) and plot it",
        _K + "evaluate.run_report:add_arguments",
    ),
    Command(
        "capture-features",
        _K + "run.offline_twin:run_capture",
        "capture a recipe's prompts to SpecForge offline feature files through the recipe's capture server",
        _K + "run.offline_twin:add_capture_arguments",
    ),
    Command(
        "train-offline",
        _K + "run.offline_twin:run_train",
        "train a recipe's draft offline (SpecForge's trainer, in-process) on "
        "feature files, e.g. from capture-features; then export for SGLang",
        _K + "run.offline_twin:add_train_arguments",
    ),
    Command(
        "target-text",
        _K + "demo.target_text:run",
        "how predictable candidate targets' own greedy text is; names the lowest-entropy one",
        _K + "demo.target_text:add_arguments",
    ),
)


def _add_command(sub, command: Command, with_arguments: bool) -> None:
    """The command's parser; its module imported only ``with_arguments``. A module that fails to import leaves
    the command listed, its parser taking any arguments and its handler printing why it cannot run."""
    p = sub.add_parser(command.name, help=command.help)
    if not with_arguments:
        return
    try:
        add_arguments, handler = command.load()
    except CommandUnavailable as exc:
        p.description = str(exc)
        p.add_argument("rest", nargs=argparse.REMAINDER, help="not parsed: the command cannot run")
        p.set_defaults(func=_unavailable(str(exc)))
        return
    add_arguments(p)
    p.set_defaults(func=handler)


def _unavailable(reason: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        print(reason, file=sys.stderr)
        return 1

    return handler


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI: every command listed, with its arguments for all of them or, given ``only``, for that
    command alone (``""``: none, so ``--help`` imports no command module)."""
    from specforge_kimi import __version__

    p = _Parser(
        prog="specforge-kimi",
        description="Kimi-K2.5 speculative drafts (EAGLE-3, DFlash, DSpark) with SpecForge: data, the online run, "
        "evaluation and export.",
    )
    p.add_argument("--version", action="version", version=f"specforge-kimi {__version__}")
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser, help="one of the commands below"
    )
    for command in COMMANDS:
        _add_command(sub, command, with_arguments=only in (None, command.name))
    _group_commands(p, sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from specforge_kimi.console import quiet_known_notices

    quiet_known_notices()  # two import-time notices of the stack that say nothing about a run (console.KNOWN_NOTICES)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((c for c in COMMANDS if argv[:1] == [c.name]), None)
    if command is not None:
        try:
            command.load()
        except CommandUnavailable as exc:  # this command cannot run; the others, and --help, still do
            print(exc, file=sys.stderr)
            return 1
    if argv[:1] == ["train"] and not {"-h", "--help"} & set(argv[1:2]):
        # argparse's REMAINDER drops leading options ("train -c run.yaml"); hand them over whole
        args = argparse.Namespace(func=_cmd_train, specforge_args=argv[1:])
    else:
        args = build_parser(only=command.name if command else "").parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KimiInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
