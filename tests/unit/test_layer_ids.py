"""The aux-layer-id table: SpecForge/SGLang ids, captured positions, HF indices, vLLM ids."""

import pytest

from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.layer_ids import (
    K25_DEFAULT_SPECFORGE_IDS,
    AuxLayers,
    default_dflash_ids,
    default_specforge_ids,
)

# (engine, ids, num_layers) -> captured positions (== HF hidden_states indices)
TABLE = [
    ("specforge", [1, 29, 57], 61, [2, 30, 58]),  # K2.5 default: SGLang shifts when first id is 1
    ("specforge", [2, 30, 58], 61, [2, 30, 58]),  # already-shifted ids are used as given
    ("sglang", [1, 29, 57], 61, [2, 30, 58]),
    ("sglang", [3, 30, 58], 61, [3, 30, 58]),
    ("specforge", [1, 2, 3], 6, [2, 3, 4]),
    ("vllm", [2, 30, 58], 61, [2, 30, 58]),  # vLLM: no shift
    ("vllm", [1, 29, 57], 61, [1, 29, 57]),
    ("hf", [2, 30, 58], 61, [2, 30, 58]),
]


@pytest.mark.parametrize("engine,ids,n,positions", TABLE)
def test_table(engine, ids, n, positions):
    aux = AuxLayers.from_engine(engine, ids, n)
    assert list(aux.positions) == positions
    assert aux.hf_indices() == positions
    assert aux.vllm_ids() == positions


def test_k25_default_maps_to_hf_2_30_58():
    aux = AuxLayers.from_specforge(K25_DEFAULT_SPECFORGE_IDS, 61)
    assert aux.hf_indices() == [2, 30, 58]
    # Exported SGLang ids must capture the same positions when SGLang applies its rule again.
    again = AuxLayers.from_sglang(aux.sglang_ids(), 61)
    assert again.positions == aux.positions


def test_default_ids_match_sglang_default():
    # SGLang's own default for DeepSeek-V3 is [2, L//2, L-3].
    for n in (61, 27, 12):
        aux = AuxLayers.from_specforge(default_specforge_ids(n), n)
        assert aux.hf_indices() == [2, n // 2, n - 3]
    assert default_specforge_ids(61) == K25_DEFAULT_SPECFORGE_IDS


def test_no_default_where_sglangs_formula_repeats_a_layer():
    assert default_specforge_ids(7) == (1, 2, 3)  # positions [2, 3, 4]
    for n in (4, 5, 6):
        with pytest.raises(KimiInputError, match="explicit aux layer ids"):
            default_specforge_ids(n)


@pytest.mark.parametrize(
    "engine,ids,n,msg",
    [
        ("specforge", [1, 29, 60], 61, "has residual positions 1..60"),  # 60 -> 61 after the shift
        ("vllm", [0, 3, 4], 8, "embedding output"),
        ("vllm", [2, 2, 4], 8, "duplicated"),
        ("vllm", [4, 2, 6], 8, "not ascending"),
        ("vllm", [], 8, "empty"),
        ("vllm", [2, 3, 8], 8, "has residual positions 1..7"),
        ("vllm", [2, "x", 4], 8, "must be integers"),
        ("vllm", [2, 3.5, 4], 8, "must be integers"),
        ("nope", [2, 3, 4], 8, "unknown engine"),
    ],
)
def test_invalid_ids(engine, ids, n, msg):
    with pytest.raises(KimiInputError, match=msg):
        AuxLayers.from_engine(engine, ids, n)


def test_position_one_first_is_unreachable_in_sglang():
    aux = AuxLayers.from_vllm([1, 3, 5], 8)
    with pytest.raises(KimiInputError, match="shifted to 2"):
        aux.sglang_ids()


# ---- DFlash/DSpark target layer ids: always +1 (capture after layer id) ------------------------------------------
DFLASH_TABLE = [
    ([1, 15, 30, 44, 58], 61, [2, 16, 31, 45, 59]),  # K2.5, SpecForge's/SGLang's default for 5 draft layers
    ([0, 1, 2, 3], 5, [1, 2, 3, 4]),  # the slice: at most 4 ids on 5 layers
    ([1, 2, 3, 4, 5], 8, [2, 3, 4, 5, 6]),  # the tiny target
]


@pytest.mark.parametrize("ids,n,positions", DFLASH_TABLE)
def test_dflash_table(ids, n, positions):
    aux = AuxLayers.from_engine("dflash", ids, n)
    assert list(aux.positions) == positions
    assert aux.dflash_ids() == ids
    assert aux.to_engine("dflash") == ids


def test_same_numbers_same_layers_only_when_eagle3_shifts():
    assert AuxLayers.from_specforge([1, 29, 57], 61) == AuxLayers.from_dflash([1, 29, 57], 61)
    assert AuxLayers.from_specforge([2, 30, 58], 61) != AuxLayers.from_dflash([2, 30, 58], 61)


def test_dflash_last_layer_refused():
    # SGLang accepts L-1 (< L) but capture point L never fires; we refuse it
    with pytest.raises(KimiInputError, match=r"takes 0\.\.59"):
        AuxLayers.from_dflash([1, 30, 60], 61)
    assert AuxLayers.from_dflash([1, 30, 59], 61).positions == (2, 31, 60)


@pytest.mark.parametrize("ids,msg", [([1, 1, 3], "duplicated"), ([3, 1], "not ascending"), ([-1, 2], "embedding")])
def test_dflash_invalid(ids, msg):
    with pytest.raises(KimiInputError, match=msg):
        AuxLayers.from_dflash(ids, 8)


def test_default_dflash_ids_k25():
    assert default_dflash_ids(61, 5) == (1, 15, 30, 44, 58)
    assert default_dflash_ids(61, 3) == (1, 30, 58)  # positions [2, 31, 59], not EAGLE-3's [2, 30, 58]
    assert default_dflash_ids(61, 6) == (1, 12, 24, 35, 47, 58)
    assert default_dflash_ids(61, 1) == (30,)


def test_default_dflash_ids_refuses_duplicates():
    with pytest.raises(KimiInputError, match=r"\[1, 1, 2, 2\].*explicitly"):
        default_dflash_ids(5, 4)


def test_default_dflash_ids_equal_sglang_and_specforge():
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids as sglang_ids
    from specforge.modeling.draft.dflash import build_target_layer_ids as specforge_ids

    compared = 0
    for layers in range(4, 94):
        for n in range(1, 9):
            want = sglang_ids(layers, n)
            assert specforge_ids(layers, n) == want
            if len(set(want)) != len(want):
                with pytest.raises(KimiInputError, match="repeated"):
                    default_dflash_ids(layers, n)
                continue
            assert list(default_dflash_ids(layers, n)) == want, (layers, n)
            compared += 1
    assert compared > 600
