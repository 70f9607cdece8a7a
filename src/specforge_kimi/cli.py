"""``specforge-kimi``: thin subcommands over the modules; heavy imports happen per command.

Bad input (:class:`errors.KimiInputError`) prints one ``error: ...`` line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence

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


def _cmd_inspect(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specforge_kimi.targets.checkpoint import inspect_target

    info = asdict(inspect_target(args.target))
    info.pop("text")
    print(json.dumps(info, indent=2))
    return 0


def _cmd_layer_ids(args: argparse.Namespace) -> int:
    from specforge_kimi.targets.layer_ids import ENGINES, AuxLayers, parse_id_list

    given = parse_id_list(args.ids, "layer-ids")
    aux = AuxLayers.from_engine(args.engine, given, args.num_layers)
    # a recipe (and SpecForge's config) takes SpecForge ids: the ids as given when they are SpecForge's or
    # SGLang's own, else the SpecForge view of the captured positions
    recipe_ids = list(given) if args.engine in ("specforge", "sglang") else aux.specforge_ids()
    views: dict[str, list[int] | str] = {}
    for engine in ENGINES:
        try:
            views[engine] = aux.to_engine(engine)
        except KimiInputError as exc:
            views[engine] = f"unreachable: {exc}"
    if args.json:
        print(
            json.dumps(
                {"recipe_aux_layer_ids": recipe_ids, "captured_positions": list(aux.positions), **views}, indent=2
            )
        )
        return 0

    def ids(v) -> str:
        return ",".join(map(str, v)) if isinstance(v, list) else v

    rows = [
        ("recipe target.aux_layer_ids (SpecForge ids)", ids(recipe_ids)),
        ("captured positions = HF hidden_states indices", ids(list(aux.positions))),
        ("SGLang --spec-capture-aux-layer-ids", ids(recipe_ids)),
        ("vLLM ids", ids(views["vllm"])),
        ("exported drafts' eagle_aux_hidden_state_layer_ids", ids(views["sglang"])),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"aux layers of a {args.num_layers}-layer target, given as {args.engine} ids {ids(list(given))}:")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    same = (
        f" ({ids(list(aux.positions))} captures the same layers: SGLang shifts a list that starts at 1 by +1)"
        if recipe_ids[0] == 1
        else ""
    )
    print(f"put [{', '.join(map(str, recipe_ids))}] into the recipe's target.aux_layer_ids{same}")
    return 0


def _cmd_export_check(args: argparse.Namespace) -> int:
    from specforge_kimi.drafts.export import check_sglang_export

    print(json.dumps(check_sglang_export(args.draft, target_dir=args.target), indent=2))
    return 0


def _cmd_recipe(args: argparse.Namespace) -> int:
    from specforge_kimi.plan.recipes import load_recipe, memory_plan, render

    recipe = load_recipe(args.recipe)
    if args.action == "validate":
        if args.check_files:  # the data files against the target and each other (plan.inputs), one line each
            from specforge_kimi.plan.inputs import require_inputs

            require_inputs(recipe)
        from specforge_kimi.plan.transport_plan import choice

        report = {"name": recipe.name, "tp": recipe.tp, "transport": choice(recipe), "memory_plan": memory_plan(recipe)}
        print(json.dumps(report, indent=2))
        return 0
    out = render(recipe, args.out or f"{recipe.output_dir}/rendered")
    print(json.dumps(out["commands"], indent=2))
    return 0


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


def _cmd_demo(args: argparse.Namespace) -> int:
    from specforge_kimi.demo.pipeline import DemoSettings, run_demo

    settings = DemoSettings(
        out_dir=args.out,
        steps=args.steps,
        pretrain_seconds=args.pretrain_seconds,
        pretrain_steps=args.pretrain_steps,
        seed=args.seed,
        progress=not args.no_progress,
    )
    result = run_demo(settings)
    return 0 if result["ok"] else 1


#: ``--help`` lists the commands by stage; a command missing here is listed under "other"
COMMAND_GROUPS = {
    "data": ("prepare", "regenerate"),
    "train": ("setup", "doctor", "recipe", "launch", "watch", "stop", "train"),
    "evaluate": ("bench", "run-report", "export-check"),
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


def build_parser() -> argparse.ArgumentParser:
    from specforge_kimi import __version__
    from specforge_kimi.demo import prompt_rules  # light: the rule names for --pretrain-prompt-rule

    p = _Parser(
        prog="specforge-kimi",
        description="Kimi-K2.5 EAGLE-3 drafts with SpecForge: data, the online run, evaluation and export.",
    )
    p.add_argument("--version", action="version", version=f"specforge-kimi {__version__}")
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser, help="one of the commands below"
    )

    t = sub.add_parser("tiny", help="write a tiny random Kimi-K2.5 checkpoint (K2.5 names and nesting)")
    t.add_argument("out_dir", help="new directory for the checkpoint (config, safetensors, tokenizer)")
    t.add_argument("--layers", type=int, default=8, help="decoder layers (K2.5: 61; the first is dense)")
    t.add_argument("--hidden", type=int, default=512, help="hidden size (K2.5: 7168)")
    t.add_argument("--heads", type=int, default=8, help="attention heads (divisible by the TP size you test)")
    t.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (K2.5: 384)")
    t.add_argument("--experts-per-token", type=int, default=2, help="top-k routing (K2.5: 8)")
    t.add_argument("--moe-intermediate", type=int, default=256, help="routed expert intermediate size (K2.5: 2048)")
    t.add_argument("--dense-intermediate", type=int, default=1024, help="layer 0's dense MLP size (K2.5: 18432)")
    t.add_argument("--q-lora-rank", type=int, default=1536, help="MLA query low-rank size (K2.5: 1536)")
    t.add_argument("--vocab", type=int, default=163840, help="vocabulary (K2.5: 163840; must hold K2.5's special ids)")
    t.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    t.add_argument(
        "--int4-experts",
        action="store_true",
        help="routed experts as K2.5 ships them: compressed-tensors pack-quantized int4, symmetric, "
        "group 32 (weight_packed/weight_scale/weight_shape), K2.5's quantization_config; with "
        "--pretrain they are quantized after training and the held-out numbers are the quantized model's",
    )
    t.add_argument(
        "--init-device",
        default="cpu",
        help="device that generates (and quantizes) the random weights: cpu (default; the same bytes "
        "for a seed everywhere) or cuda (a K2.5-width checkpoint in seconds; other bytes than cpu's)",
    )
    t.add_argument(
        "--pretrain",
        type=float,
        default=0,
        metavar="SECONDS",
        help="pretrain on the synthetic structured corpus for SECONDS (writes pretrain.json)",
    )
    t.add_argument(
        "--pretrain-steps",
        type=int,
        default=10_000,
        metavar="N",
        help="also stop pretraining after N optimizer steps (whichever of SECONDS / N ends first)",
    )
    t.add_argument(
        "--no-pretrain-deterministic",
        dest="pretrain_deterministic",
        action="store_false",
        help="allow non-deterministic kernels (faster on CUDA; two runs of N steps then differ)",
    )
    t.add_argument("--device", default="auto", help="pretraining device: auto, cpu, cuda, cuda:N")
    t.add_argument("--pretrain-lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    t.add_argument("--pretrain-batch-size", type=int, default=32, metavar="B", help="sequences per optimizer step")
    t.add_argument(
        "--pretrain-precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="fp32, or bf16 autocast for the decoder's forward (weights, optimizer and loss in fp32)",
    )
    t.add_argument(
        "--pretrain-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="constant, or warm-up + cosine decay over --pretrain-steps (with "
        "--no-pretrain-deterministic: over the time budget if that ends first)",
    )
    t.add_argument(
        "--pretrain-loss",
        choices=("full", "corpus"),
        default="full",
        help="full: softmax over the whole vocab as the written checkpoint scores it (untrained "
        "tokens at logit 0); corpus: restricted to the corpus's tokens (earlier behaviour)",
    )
    t.add_argument(
        "--pretrain-prompt-rules",
        type=int,
        default=0,
        metavar="N",
        help="also pretrain on N chat/math/code prompts answered by a rule (specforge_kimi.demo.prompt_rules), "
        "so the target answers the bench's natural-language prompts by that rule, not at random",
    )
    t.add_argument(
        "--pretrain-prompt-rule",
        choices=sorted(prompt_rules.RULES),
        default=prompt_rules.DEFAULT_RULE,
        help="the rule of --pretrain-prompt-rules: echo (restate the prompt) or words (its first words, "
        "one per numbered line); specforge_kimi.demo.prompt_rules describes both",
    )
    t.set_defaults(func=_cmd_tiny)

    i = sub.add_parser("inspect", help="check a target checkpoint and print what SpecForge needs")
    i.add_argument("target", help="checkpoint directory (config.json + safetensors)")
    i.set_defaults(func=_cmd_inspect)

    lid = sub.add_parser("layer-ids", help="convert aux layer ids between SpecForge/SGLang, vLLM and HF")
    lid.add_argument("ids", help="comma-separated, e.g. 1,29,57")
    lid.add_argument(
        "--engine",
        default="specforge",
        choices=("specforge", "sglang", "vllm", "hf"),
        help="whose convention the ids are in",
    )
    lid.add_argument("--num-layers", type=int, default=61, help="target decoder layers (K2.5: 61)")
    lid.add_argument("--json", action="store_true", help="every convention as JSON instead of the table")
    lid.set_defaults(func=_cmd_layer_ids)

    e = sub.add_parser("export-check", help="check an exported SGLang draft against what its loader needs")
    e.add_argument("draft", help="exported draft directory (config.json + model.safetensors)")
    e.add_argument("--target", default=None, help="target checkpoint to check sizes and aux ids against")
    e.set_defaults(func=_cmd_export_check)

    tr = sub.add_parser(
        "train",
        help="`specforge train ...` with the K2.5 adapter registered (torchrun-able)",
        description="Passes its arguments to `specforge train`, e.g. "
        "torchrun --nproc_per_node 8 -m specforge_kimi train -c run.yaml --role consumer",
    )
    tr.add_argument(
        "specforge_args",
        nargs=argparse.REMAINDER,
        help="passed on: see `specforge train --help` (-c CONFIG, --role ...)",
    )
    tr.set_defaults(func=_cmd_train)

    rc = sub.add_parser("recipe", help="validate a recipe or render it to SpecForge config + launch commands")
    rc.add_argument(
        "action",
        choices=("validate", "render"),
        help="validate: schema + per-GPU memory split (writes nothing); render: write the SpecForge config, "
        "draft config and launch.json",
    )
    rc.add_argument("recipe", help="recipe YAML (recipes/*.yaml)")
    rc.add_argument("--out", default=None, help="render directory (default: OUTPUT_DIR/rendered)")
    rc.add_argument(
        "--check-files",
        action="store_true",
        help="validate: also check that the target, its tokenizer, the prompts and the vocab mapping exist and "
        "agree (vocab, special ids, draft vocab, max_length within the server's context)",
    )
    rc.set_defaults(func=_cmd_recipe)

    d = sub.add_parser("demo", help="CPU demo: tiny K2.5 -> features -> SpecForge EAGLE-3 training -> export")
    d.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    d.add_argument("--steps", type=int, default=300, help="SpecForge optimizer steps")
    d.add_argument("--pretrain-seconds", type=float, default=60.0, help="tiny-target pretraining budget")
    d.add_argument(
        "--pretrain-steps",
        type=int,
        default=0,
        help="also stop tiny-target pretraining after this many steps (0: the time budget only)",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the tiny target and the training")
    d.add_argument(
        "--no-progress",
        action="store_true",
        help="print nothing but errors (SpecForge's own output still goes to OUT/specforge.log)",
    )
    d.set_defaults(func=_cmd_demo)

    for name in (
        "data.prepare",
        "data.regenerate",
        "setup.setup_patches",
        "run.launch",
        "run.stop",
        "run.progress",
        "setup.doctor",
        "evaluate.bench",
        "demo.draft_eval",
        "evaluate.run_report",
        "run.offline_twin",
        "demo.target_text",
    ):
        try:
            module = __import__(f"specforge_kimi.{name}", fromlist=["add_parser"])
        except ModuleNotFoundError:
            continue
        module.add_parser(sub)
    _group_commands(p, sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from specforge_kimi.console import quiet_known_notices

    quiet_known_notices()  # two import-time notices of the stack that say nothing about a run (console.KNOWN_NOTICES)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"] and not {"-h", "--help"} & set(argv[1:2]):
        # argparse's REMAINDER drops leading options ("train -c run.yaml"); hand them over whole
        args = argparse.Namespace(func=_cmd_train, specforge_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
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
