"""The aux-layer-id convention: the one place where layer ids are converted between engines.

Scope: EAGLE-3 aux hidden states and DFlash/DSpark target layers of a DeepSeek-V3-style target (Kimi-K2.5's text
model).

Every id list here is reduced to *captured positions*: position ``p`` is the residual stream
entering decoder layer ``p`` (after layer ``p-1``'s all-reduce and residual add), which is
exactly transformers' ``output_hidden_states[p]`` (index 0 is the embedding output).

- SpecForge ids are what a SpecForge run config, ``--spec-capture-aux-layer-ids`` and a draft's
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` carry. SGLang 0.5.14's
  ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`` shifts every id by +1 when the first id
  is 1, and uses the ids as given otherwise; capture then happens at the start of that layer.
  So SpecForge/SGLang ids ``[1, 29, 57]`` and ``[2, 30, 58]`` both capture positions
  ``[2, 30, 58]``.
- vLLM captures ``hidden_states + residual`` at the start of layer ``id`` with no shift, so its
  ids equal positions.
- HF indices equal positions.

- DFlash ids (a block draft's ``dflash_config.target_layer_ids``, ``--spec-capture-aux-layer-ids`` with
  ``--spec-capture-method dflash|dspark``) always mean "after layer ``id``": SGLang 0.5.14's
  ``set_dflash_layers_to_capture`` captures at ``id + 1`` and SpecForge's HF path reads
  ``output_hidden_states[id + 1]``. So DFlash ``[1, 15, 30, 44, 58]`` captures positions
  ``[2, 16, 31, 45, 59]``; EAGLE-3 ``[1, 29, 57]`` and DFlash ``[1, 29, 57]`` capture the same
  positions, EAGLE-3 ``[2, 30, 58]`` and DFlash ``[2, 30, 58]`` do not. Valid DFlash ids are
  ``0..L-2`` (capture point ``L`` never fires).

EAGLE-3 exports write positions for both engines (SGLang then uses them unshifted), so no reader has to
know the shift. Position 1 cannot be the first captured position in SGLang 0.5.14 (id 1 is
shifted to 2) and position 0 is the embedding output, which EAGLE-3 never uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specforge_kimi.errors import KimiInputError

#: SpecForge's default for a 61-layer DeepSeek-V3/Kimi-K2.5 target (configs/deepseek-v3-671b-eagle3.json).
K25_DEFAULT_SPECFORGE_IDS = (1, 29, 57)
ENGINES = ("specforge", "sglang", "vllm", "hf", "dflash")


def default_specforge_ids(num_layers: int) -> tuple[int, ...]:
    """SGLang's own default for DeepSeek-V2/V3 when no ids are given: ``[2, L//2, L-3]``.

    Expressed as SpecForge ids with first id 1 (so SGLang's shift yields ``[2, L//2, L-3]``
    again); for 61 layers this is K2.5's ``[1, 29, 57]``.
    """
    positions = (2, num_layers // 2, num_layers - 3)
    if num_layers < 5 or len(set(positions)) < 3:
        # SGLang's formula repeats a layer below 7 layers ([2, 3, 3] for 6): no valid default
        raise KimiInputError(
            f"SGLang's default aux layers [2, L//2, L-3] are {list(positions)} for a {num_layers}-layer "
            "target (not 3 distinct layers); pass explicit aux layer ids"
        )
    return (1, num_layers // 2 - 1, num_layers - 4)


def default_dflash_ids(num_layers: int, n: int) -> tuple[int, ...]:
    """The DFlash ids SpecForge and SGLang pick when a draft names none (``build_target_layer_ids``, identical in
    both): ``[L//2]`` for one layer, else ``round(1 + i * (L - 4) / (n - 1))`` for ``i`` in ``0..n-1``.

    Refused when the formula repeats a layer (``[1, 2, 2, 3]`` for 5 layers and 4 ids) or names none."""
    if num_layers < 4 or n < 1:
        raise KimiInputError(f"no default DFlash layer ids for {n} layers of a {num_layers}-layer target")
    if n == 1:
        ids = (num_layers // 2,)
    else:
        ids = tuple(int(round(1 + i * (num_layers - 4) / (n - 1))) for i in range(n))
    if len(set(ids)) != len(ids):
        raise KimiInputError(
            f"the default DFlash layer ids for {n} layers of a {num_layers}-layer target are {list(ids)} "
            "(a layer repeated); name dflash_config.target_layer_ids explicitly"
        )
    return ids


def _as_ints(ids: Iterable[int], what: str) -> tuple[int, ...]:
    out = []
    for i in ids:
        if (
            isinstance(i, bool)
            or not isinstance(i, int)
            and not (isinstance(i, str) and i.strip().lstrip("-").isdigit())
        ):
            raise KimiInputError(f"{what}: aux layer ids must be integers, got {i!r}")
        out.append(int(i))
    return tuple(out)


def parse_id_list(text: str, what: str) -> list[int]:
    """``"1,29,57"`` -> ``[1, 29, 57]``; anything else is a :class:`KimiInputError` naming ``what``."""
    return list(_as_ints(text.split(","), what))


@dataclass(frozen=True)
class AuxLayers:
    """Captured positions of the aux hidden states for a target with ``num_layers`` layers."""

    positions: tuple[int, ...]
    num_layers: int

    def __post_init__(self) -> None:
        p, n = self.positions, self.num_layers
        if n < 2:
            raise KimiInputError(f"target has {n} layers; aux capture needs at least 2")
        if not p:
            raise KimiInputError("aux layer ids are empty")
        if len(set(p)) != len(p):
            raise KimiInputError(f"captured positions {list(p)} are duplicated")
        if list(p) != sorted(p):
            raise KimiInputError(f"captured positions {list(p)} are not ascending")
        if p[0] < 1:
            raise KimiInputError(
                f"captured positions {list(p)} include 0, the embedding output; "
                "EAGLE-3 needs decoder-layer residuals (positions 1..L-1)"
            )
        if p[-1] > n - 1:
            raise KimiInputError(
                f"captured positions {list(p)} include {p[-1]}, but a {n}-layer target "
                f"has residual positions 1..{n - 1} only"
            )

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_specforge(cls, ids: Sequence[int], num_layers: int) -> AuxLayers:
        """From SpecForge/SGLang ids (SGLang 0.5.14 shifts all by +1 when the first is 1)."""
        ids = _as_ints(ids, "SpecForge")
        if not ids:
            raise KimiInputError("aux layer ids are empty")
        shift = 1 if ids[0] == 1 else 0
        try:
            return cls(tuple(i + shift for i in ids), num_layers)
        except KimiInputError as exc:  # say what the user wrote, then what it captures
            raise KimiInputError(f"SpecForge aux layer ids {list(ids)}: {exc}") from None

    from_sglang = from_specforge

    @classmethod
    def from_dflash(cls, ids: Sequence[int], num_layers: int) -> AuxLayers:
        """From DFlash/DSpark target layer ids (always +1: capture after layer ``id``); ids ``0..L-2``."""
        ids = _as_ints(ids, "DFlash")
        if ids and max(ids) > num_layers - 2:
            raise KimiInputError(
                f"DFlash target layer ids {list(ids)} include {max(ids)}, but a {num_layers}-layer target takes "
                f"0..{num_layers - 2} (the output of layer {num_layers - 1} is never captured)"
            )
        try:
            return cls(tuple(i + 1 for i in ids), num_layers)
        except KimiInputError as exc:
            raise KimiInputError(f"DFlash target layer ids {list(ids)}: {exc}") from None

    @classmethod
    def from_vllm(cls, ids: Sequence[int], num_layers: int) -> AuxLayers:
        """From vLLM ids (no shift)."""
        return cls(_as_ints(ids, "vLLM"), num_layers)

    @classmethod
    def from_hf(cls, indices: Sequence[int], num_layers: int) -> AuxLayers:
        """From transformers ``output_hidden_states`` indices."""
        return cls(_as_ints(indices, "HF"), num_layers)

    @classmethod
    def from_engine(cls, engine: str, ids: Sequence[int], num_layers: int) -> AuxLayers:
        """Dispatch on an engine name from :data:`ENGINES`."""
        try:
            ctor = {
                "specforge": cls.from_specforge,
                "sglang": cls.from_sglang,
                "vllm": cls.from_vllm,
                "hf": cls.from_hf,
                "dflash": cls.from_dflash,
            }[engine]
        except KeyError:
            raise KimiInputError(f"unknown engine {engine!r}; expected one of {ENGINES}") from None
        return ctor(ids, num_layers)

    # ---- views --------------------------------------------------------------------------
    def sglang_ids(self) -> list[int]:
        """Ids SGLang 0.5.14 captures these positions with (written into exported drafts)."""
        if self.positions[0] == 1:
            raise KimiInputError("position 1 cannot be the first aux position in SGLang 0.5.14: id 1 is shifted to 2")
        return list(self.positions)

    def specforge_ids(self) -> list[int]:
        """Ids for a SpecForge config / ``--spec-capture-aux-layer-ids`` (same rule as SGLang)."""
        return self.sglang_ids()

    def vllm_ids(self) -> list[int]:
        return list(self.positions)

    def hf_indices(self) -> list[int]:
        return list(self.positions)

    def dflash_ids(self) -> list[int]:
        """DFlash target layer ids capturing these positions (``positions - 1``)."""
        return [p - 1 for p in self.positions]

    def to_engine(self, engine: str) -> list[int]:
        try:
            view = {
                "specforge": self.specforge_ids,
                "sglang": self.sglang_ids,
                "vllm": self.vllm_ids,
                "hf": self.hf_indices,
                "dflash": self.dflash_ids,
            }[engine]
        except KeyError:
            raise KimiInputError(f"unknown engine {engine!r}; expected one of {ENGINES}") from None
        return view()
