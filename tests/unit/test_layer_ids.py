"""The aux-layer-id table: SpecForge/SGLang ids, captured positions, HF indices, vLLM ids."""

import pytest

from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.layer_ids import K25_DEFAULT_SPECFORGE_IDS, AuxLayers, default_specforge_ids

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
