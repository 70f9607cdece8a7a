"""The GPU capture parity test's cases and checks (tests/capture_parity_cases.py) on the CPU: each capture method on
each layout, the ids a method sends and the positions they mean, and the strict layer-identity check catching a
capture one layer off (synthetic hidden states; no server)."""

from pathlib import Path

import pytest
import torch
import yaml
from capture_parity_cases import (
    CASES,
    CONFIGS,
    METHODS,
    capture_ids,
    captures_last,
    case_name,
    compare_runs,
    compare_to_reference,
    failures,
    reference_positions,
    run_name,
)

from specforge_kimi.targets.layer_ids import AuxLayers, default_specforge_ids

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_every_method_on_every_layout_tp1_first():
    names = [case_name(*c) for c in CASES]
    assert len(set(names)) == len(names) == len(METHODS) * len(CONFIGS)
    assert set(METHODS) == {"eagle3", "dflash"}
    # EAGLE-3's runs keep the names the committed summaries (bench/results/capture_parity_*.json) use
    assert [case_name("eagle3", *c) for c in CONFIGS] == [run_name(*c) for c in CONFIGS]
    for method in METHODS:
        mine = [c[1:] for c in CASES if c[0] == method]
        assert mine == CONFIGS and mine[0] == (1, False, 1, 1)  # the TP>1 runs compare against it
    assert case_name("dflash", 8, False, 1, 8) == "dflash_tp8_fusion-off_dp8"


def test_dflash_ids_are_the_recipes_and_land_one_later():
    """DFlash on the tiny target: the tiny DFlash recipe's 5 ids, positions ids + 1, no last hidden state; on K2.5's
    width the slice recipe's 4 (0 is a valid DFlash id: position 1). EAGLE-3 keeps SGLang's default and its last."""
    ids, aux = capture_ids("dflash", "tiny", 8)
    tiny = yaml.safe_load((RECIPES / "tiny-k25-tp1-h200-dflash.yaml").read_text())
    assert list(ids) == tiny["trainer"]["draft"]["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert tiny["target"]["num_layers"] == 8
    assert aux.positions == (2, 3, 4, 5, 6)
    ids, aux = capture_ids("dflash", "k25-int4", 5)
    sl = yaml.safe_load((RECIPES / "kimi-k25-slice-h200-dflash.yaml").read_text())
    assert list(ids) == sl["trainer"]["draft"]["dflash_config"]["target_layer_ids"] == [0, 1, 2, 3]
    assert aux.positions == (1, 2, 3, 4)
    ids, aux = capture_ids("eagle3", "tiny", 8)
    assert ids == default_specforge_ids(8) and aux == AuxLayers.from_specforge(ids, 8)
    assert capture_ids("eagle3", "k25-int4", 5)[1].positions == (2, 3, 4)
    assert captures_last("eagle3") and not captures_last("dflash")
    with pytest.raises(ValueError, match="dspark"):
        capture_ids("dspark", "tiny", 8)
    both = [capture_ids(m, "tiny", 8)[1] for m in METHODS]
    assert reference_positions(both, 8) == [1, 2, 3, 4, 5, 6, 7]
    assert reference_positions([capture_ids("dflash", "k25-int4", 5)[1]], 5) == [0, 1, 2, 3, 4, 5]


def _hidden_states(layers: int, tokens: int = 40, hidden: int = 16) -> dict:
    """Stand-ins for HF ``hidden_states[0..L]``: independent per position (adjacent residuals far apart)."""
    gen = torch.Generator().manual_seed(0)
    return {q: torch.randn(tokens, hidden, generator=gen) for q in range(layers + 1)}


def _capture(hs: dict, positions, gen) -> torch.Tensor:
    """What a server would write for ``positions``, in bf16 with a little noise."""
    out = torch.cat([hs[p] for p in positions], dim=-1)
    return (out + 1e-3 * torch.randn(out.shape, generator=gen)).to(torch.bfloat16)


def test_identity_check_catches_a_capture_one_layer_off():
    """A DFlash capture at positions ids + 1 passes every tolerance with no last hidden state; the same ids read the
    EAGLE-3 way with no shift (positions = ids) or one too far fail the layer-identity margin in every slot; a
    wrong-width capture is refused; EAGLE-3's last hidden state is still checked (the residual before the last
    layer in its place fails)."""
    layers, hidden = 8, 16
    hs = _hidden_states(layers, hidden=hidden)
    ref = [{"hs": hs, "last": hs[layers]}]
    gen = torch.Generator().manual_seed(1)
    ids, aux = capture_ids("dflash", "tiny", layers)

    def check(captures, aux=aux):
        return failures(compare_to_reference(captures, ref, aux, hidden=hidden, num_layers=layers), with_identity=True)

    rows = compare_to_reference({0: (_capture(hs, aux.positions, gen), None)}, ref, aux, hidden=hidden, num_layers=8)
    assert rows[0]["last"] is None and [s["hf_index"] for s in rows[0]["aux"]] == [2, 3, 4, 5, 6]
    assert failures(rows, with_identity=True) == []
    for wrong in (list(ids), [i + 2 for i in ids]):
        bad = check({0: (_capture(hs, wrong, gen), None)})
        margins = [b for b in bad if "layer-identity margin" in b]
        assert len(margins) == len(ids), bad
    with pytest.raises(AssertionError, match="aux shape"):
        check({0: (_capture(hs, aux.positions[:4], gen), None)})

    _ids, e3 = capture_ids("eagle3", "tiny", layers)
    last = (hs[layers] + 1e-3 * torch.randn(hs[layers].shape, generator=gen)).to(torch.bfloat16)
    assert check({0: (_capture(hs, e3.positions, gen), last)}, e3) == []
    bad = check({0: (_capture(hs, e3.positions, gen), hs[layers - 1].to(torch.bfloat16))}, e3)
    assert bad and all(" last: " in b for b in bad), bad


def test_tp_comparison_without_a_last_hidden_state():
    hs = _hidden_states(8)
    gen = torch.Generator().manual_seed(2)
    a = {0: (_capture(hs, (2, 3, 4, 5, 6), gen), None)}
    rows = compare_runs(a, a, [40])
    assert rows[0]["last"] is None and rows[0]["aux"]["bitwise_equal"] and failures(rows, with_identity=False) == []
    b = {0: (_capture(hs, (1, 2, 3, 4, 5), gen), None)}
    assert failures(compare_runs(b, a, [40]), with_identity=False)
