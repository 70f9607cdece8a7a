"""A recipe compiled once into a frozen :class:`RunPlan`: the transport chosen and why, the memory split, the
SpecForge config, each role's command line and environment. Every command reads the plan, never the recipe's
checks again.

Scope: :func:`compile_plan` checks the schema (``plan.recipes``), asks the transports' strategies in turn
(``server.transport: auto`` takes the first that accepts; a named one must accept), computes the memory split
with the chosen one and validates the SpecForge config with SpecForge's own ``Config`` -- once. Errors are one
line (:class:`KimiInputError`). :meth:`RunPlan.write` puts the draft config, the SpecForge config and the launch
sheet into ``rendered_dir``; nothing else writes.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from specforge_kimi.durable import write_atomic
from specforge_kimi.errors import KimiInputError, validation_summary
from specforge_kimi.plan import roles, transport_plan
from specforge_kimi.plan.memory import memory_plan
from specforge_kimi.plan.recipes import AUTO, Recipe, read_recipe
from specforge_kimi.transport import registry
from specforge_kimi.transport.strategy import FeatureSizing, Transport


@dataclass(frozen=True)
class TransportChoice:
    """The transport a run gets: its ``name``, ``chosen_by`` (``recipe`` when ``server.transport`` names it,
    ``auto`` when the default picked it) and ``why``."""

    name: str
    chosen_by: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"transport": self.name, "chosen_by": self.chosen_by, "why": self.why}


@dataclass(frozen=True)
class RunPlan:
    """Everything a run of the recipe needs, computed once by :func:`compile_plan`."""

    recipe: Recipe  # schema-checked, ``server.transport`` resolved to the chosen name
    transport: TransportChoice
    memory: Mapping[str, Any]  # the memory split (``plan.memory.memory_plan``)
    rendered_dir: Path
    specforge_config: Mapping[str, Any]  # validated by SpecForge's ``Config``
    server_argv: tuple[str, ...]
    server_env: Mapping[str, str]
    process_env: Mapping[str, str]  # the producer's and every trainer rank's
    master_argv: tuple[str, ...]
    producer_argv: tuple[str, ...]
    consumer_argv: tuple[str, ...]
    strategy: Transport = field(compare=False, repr=False)
    mps_dirs: tuple[str, str] | None = None  # overlap.mps: the daemon's (pipe, log) directories

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def output_dir(self) -> Path:
        return Path(self.recipe.output_dir)

    @property
    def tp(self) -> int:
        return self.recipe.tp

    @property
    def draft_config(self) -> dict:
        """The draft config JSON, as the recipe wrote it (``plan.draft_config``)."""
        return self.recipe.trainer.draft.config()

    def sheet(self) -> dict:
        """The launch sheet (``launch.json``): environments, argvs, the memory split, the transport."""
        return {
            "env": dict(self.process_env),
            "server_env": dict(self.server_env),
            "mooncake_master": list(self.master_argv),
            "capture_server": list(self.server_argv),
            "producer": list(self.producer_argv),
            "consumer": list(self.consumer_argv),
            "memory_plan": dict(self.memory),
            "transport": self.transport.as_dict(),
            **({"mps": {"pipe_dir": self.mps_dirs[0], "log_dir": self.mps_dirs[1]}} if self.mps_dirs else {}),
        }

    def rendered(self) -> dict:
        """``{"specforge_config", "launch", "commands"}``: the config, the sheet and each argv as one shell line."""
        sheet = self.sheet()
        return {
            "specforge_config": json.loads(json.dumps(dict(self.specforge_config))),
            "launch": sheet,
            "commands": {k: shlex.join(v) for k, v in sheet.items() if isinstance(v, list)},
        }

    def report(self) -> dict:
        """What ``recipe validate`` prints."""
        r = self.recipe
        return {
            "name": self.name,
            "tp": self.tp,
            "family": r.trainer.family,
            "capture": {
                "method": r.trainer.family,
                "ids": r.capture_ids,
                "ids_are": "DFlash ids (position = id + 1)" if r.is_block else "SpecForge ids",
                "positions": list(r.capture_layers.positions),
                "feature_bytes_per_token": transport_plan.feature_bytes_per_token(r),
                "sample_bytes": transport_plan.sample_bytes(r),
            },
            "transport": self.transport.as_dict(),
            "memory_plan": dict(self.memory),
        }

    def write(self) -> dict:
        """Write ``draft_config.json``, ``specforge_run.yaml`` and ``launch.json`` into :attr:`rendered_dir`;
        returns :meth:`rendered`."""
        import yaml

        out = self.rendered()
        self.rendered_dir.mkdir(parents=True, exist_ok=True)
        # each file replaced whole (durable.write_atomic: no half-written file after a crash, links refused)
        write_atomic(self.rendered_dir / "draft_config.json", json.dumps(self.draft_config, indent=2))
        write_atomic(self.rendered_dir / "specforge_run.yaml", yaml.safe_dump(out["specforge_config"], sort_keys=False))
        write_atomic(self.rendered_dir / "launch.json", json.dumps(out["launch"], indent=2))
        return out


def refusal(recipe: Recipe, strategy: Transport, sizing: FeatureSizing) -> tuple[str | None, dict]:
    """Why ``strategy`` cannot serve ``recipe`` (its own refusal, or a memory split that does not fit with it), or
    None; and the memory split with it."""
    why = strategy.refusal(recipe, sizing)
    memory = {} if why else memory_plan(recipe, strategy, sizing)
    if memory and not memory["fits"]:
        why = f"memory split does not fit: {memory['why']}"
    return why, memory


def choose_transport(recipe: Recipe) -> tuple[Recipe, TransportChoice, dict]:
    """The recipe with its transport resolved, the choice and why, and the memory split with it. ``auto`` asks
    the strategies in ``registry.AUTO_ORDER`` and takes the first that accepts; a named one must accept (the ones
    ``auto`` would ask first are asked too, for the reason). ValueError (one line) when none does."""
    sizing = transport_plan.sizing(recipe)
    auto = recipe.server.transport == AUTO
    if auto:
        asked: list[tuple[Transport, str | None]] = []
        for strategy in registry.AUTO_ORDER:
            why, memory = refusal(recipe, strategy, sizing)
            if not why:
                break
            asked.append((strategy, why))
        else:
            raise ValueError(asked[-1][1])
    else:
        strategy = registry.get(recipe.server.transport)
        why, memory = refusal(recipe, strategy, sizing)
        if why:
            raise ValueError(why)
        before = registry.AUTO_ORDER[: registry.AUTO_ORDER.index(strategy)]
        asked = [(s, refusal(recipe, s, sizing)[0]) for s in before]
    reason = strategy.why_chosen(sizing)
    if reason is None:
        refused = [f"{s.name} would be refused: {w}" for s, w in asked if w]
        passed = [s.name for s, w in asked if not w]
        reason = "; ".join(refused) or f"named by the recipe ({', '.join(passed)} would apply here too)"
    resolved = recipe.model_copy(update={"server": recipe.server.model_copy(update={"transport": strategy.name})})
    return resolved, TransportChoice(strategy.name, "auto" if auto else "recipe", reason), memory


def _schema(source: Recipe | Mapping | str | Path) -> tuple[Recipe, str]:
    """The recipe (schema checked) and the prefix of its errors."""
    if isinstance(source, Recipe):
        return source, "recipe: "
    if isinstance(source, Mapping):
        try:
            return Recipe.model_validate(dict(source)), "recipe: "
        except ValidationError as exc:
            raise KimiInputError(f"recipe: {validation_summary(exc)}") from None
    return read_recipe(source), f"recipe {Path(source)}: "


def compile_plan(source: Recipe | Mapping | str | Path, *, rendered_dir: str | Path | None = None) -> RunPlan:
    """The :class:`RunPlan` of a recipe (a path, a raw mapping or a schema-checked :class:`Recipe`);
    ``rendered_dir`` (default ``<output_dir>/rendered``) is where :meth:`RunPlan.write` puts its files and what the
    SpecForge config names. One-line :class:`KimiInputError` for a recipe no transport can run."""
    from specforge.config import Config  # SpecForge's schema (heavy: only when a plan is compiled)

    recipe, label = _schema(source)
    try:
        recipe, choice, memory = choose_transport(recipe)
        strategy, sizing = registry.get(choice.name), transport_plan.sizing(recipe)
        runtime = transport_plan.runtime_config(recipe)
    except OverflowError as exc:  # sizes too large for byte arithmetic (1e308 GiB)
        raise KimiInputError(f"{label}a size in the recipe is out of range: {exc}") from None
    except ValueError as exc:
        raise KimiInputError(f"{label}{exc}") from None
    out = Path(rendered_dir) if rendered_dir is not None else Path(recipe.output_dir) / "rendered"
    config = roles.specforge_config(recipe, str(out / "draft_config.json"), runtime)
    try:
        Config.model_validate(config)  # SpecForge's own schema: unknown/invalid fields fail here
    except ValidationError as exc:
        raise KimiInputError(f"{label}SpecForge's config: {validation_summary(exc)}") from None
    config_path = str(out / "specforge_run.yaml")
    try:  # SpecForge's Mooncake config is built here; the recipe's schema checks its fields first
        server_env = roles.server_env(recipe, strategy, sizing)
    except ValidationError as exc:
        raise KimiInputError(f"{label}SpecForge's Mooncake config: {validation_summary(exc)}") from None
    return RunPlan(
        recipe=recipe,
        transport=choice,
        memory=MappingProxyType(memory),
        rendered_dir=out,
        specforge_config=MappingProxyType(config),
        server_argv=tuple(roles.server_argv(recipe)),
        server_env=MappingProxyType(server_env),
        process_env=MappingProxyType(roles.process_env(recipe, strategy)),
        master_argv=tuple(roles.master_argv(recipe)),
        producer_argv=tuple(roles.producer_argv(config_path)),
        consumer_argv=tuple(roles.consumer_argv(recipe, config_path)),
        strategy=strategy,
        mps_dirs=roles.mps_dirs(recipe),
    )


def load_recipe(path: str | Path) -> Recipe:
    """The recipe at ``path`` as its plan resolves it (schema, transport, memory split checked): for callers that
    need the recipe's sections only."""
    return compile_plan(path).recipe
