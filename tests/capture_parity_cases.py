"""Capture parity's cases and checks, CPU-testable (``tests/gpu/test_capture_parity.py`` runs them on the GPU;
``tests/unit/test_capture_parity_cases.py`` checks them here).

The cases: each capture method (:data:`METHODS`) on each server layout (:data:`CONFIGS`). A method decides the ids
the server gets and what comes back: ``eagle3`` sends SpecForge ids (SGLang shifts all by +1 when the first is 1)
and captures the aux layers and the last hidden state; ``dflash`` sends DFlash ids (always +1: positions = ids + 1,
:mod:`specforge_kimi.targets.layer_ids`) and captures N layers, ``hidden_states`` [T, N*H], no last hidden. Both are
held to the same tolerances and the same strict layer-identity check (:func:`failures`).
"""

from __future__ import annotations

#: the capture methods the parity test runs (SpecForge's ``--spec-capture-method``; dspark rides dflash's capture)
METHODS = ("eagle3", "dflash")
#: (tp, fusion, ep, dp attention groups). Fusion-on at TP=2 after fusion-off: it may stall. The TP=8 layouts
#: (issue 8) run where 8 GPUs are; elsewhere they skip: plain TP, fusion on, expert parallel 8 (each rank
#: holds one of the 8 experts and the MoE output is all-reduced over ranks that computed different experts),
#: attention data parallel 8 (--enable-dp-attention --dp-size 8: each rank attends over its own requests,
#: tokens are gathered for the MoE and scattered back, and every rank is its group's capture writer).
#: ``-k "tp1_fusion-off or tp8"`` runs the TP=8 set with the TP=1 base it is compared against.
CONFIGS = [
    (1, False, 1, 1),
    (1, True, 1, 1),
    (2, False, 1, 1),
    (2, True, 1, 1),
    (8, False, 1, 1),
    (8, True, 1, 1),
    (8, False, 8, 1),
    (8, False, 1, 8),
]
#: every method on every layout, each method's TP=1 base first (the TP>1 runs compare against it)
CASES = [(method, *config) for method in METHODS for config in CONFIGS]
#: SpecForge ids: SGLang's default for the 8-layer tiny (None); K2.5's slice taps positions 2, 3, 4 of its 5 layers.
EAGLE3_IDS = {"tiny": None, "k25-int4": (1, 2, 3)}
#: DFlash ids: 5 on the 8-layer tiny (positions 2..6, recipes/tiny-k25-tp1-h200-dflash.yaml), the 4 the 5-layer
#: slice has room for (positions 1..4, recipes/kimi-k25-slice-h200-dflash.yaml)
DFLASH_IDS = {"tiny": (1, 2, 3, 4, 5), "k25-int4": (0, 1, 2, 3)}
COS_MIN = 0.99
MARGIN_MIN = 5.0
#: SGLang fuses all-reduce + residual + RMSNorm only for batches of <= 2048 tokens
#: (communicator.FUSE_ALLREDUCE_MAX_BATCH_SIZE); larger batches take the unfused path.
MAX_BATCH_TOKENS = 2048


def rel_bound(tokens: int) -> float:
    return 0.02 + 0.04 * tokens / 1024


def run_name(tp: int, fusion: bool, ep: int = 1, dp: int = 1) -> str:
    return (
        f"tp{tp}_fusion-{'on' if fusion else 'off'}" + (f"_ep{ep}" if ep > 1 else "") + (f"_dp{dp}" if dp > 1 else "")
    )


def case_name(method: str, tp: int, fusion: bool, ep: int = 1, dp: int = 1) -> str:
    """A case's run name: EAGLE-3's as before the methods (the committed summaries' keys), others prefixed."""
    name = run_name(tp, fusion, ep, dp)
    return name if method == "eagle3" else f"{method}_{name}"


def captures_last(method: str) -> bool:
    """Whether the method's capture carries the last hidden state (EAGLE-3 yes; DFlash no)."""
    return method == "eagle3"


def capture_ids(method: str, target: str, num_layers: int):
    """The ids the server gets for ``method`` on ``target`` and their captured positions: ``(ids, AuxLayers)``."""
    from specforge_kimi.targets.layer_ids import AuxLayers, default_specforge_ids

    if method == "eagle3":
        ids = tuple(EAGLE3_IDS[target] or default_specforge_ids(num_layers))
        return ids, AuxLayers.from_specforge(ids, num_layers)
    if method == "dflash":
        ids = DFLASH_IDS[target]
        return ids, AuxLayers.from_dflash(ids, num_layers)
    raise ValueError(f"capture method {method!r}: expected one of {', '.join(METHODS)}")


def reference_positions(aux_layers, num_layers: int) -> list[int]:
    """The HF ``hidden_states`` indices the checks read: each captured position and its neighbours (the identity
    check), the residual before the last layer and the final one (the last hidden state's)."""
    return sorted({q for aux in aux_layers for p in aux.positions for q in (p - 1, p, p + 1)} | {num_layers - 1})


def _rel(x, y) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm())


def _cos(x, y):
    import torch

    return torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)


def _slot(k: int, chunk, p: int, hs: dict) -> dict:
    right = hs[p]
    cos, rel = _cos(chunk, right), _rel(chunk, right)
    rel_prev, rel_next = _rel(chunk, hs[p - 1]), _rel(chunk, hs[p + 1])
    return {
        "slot": k,
        "hf_index": p,
        "cos_min": float(cos.min()),
        "cos_mean": float(cos.mean()),
        "rel": rel,
        "rel_vs_prev": rel_prev,
        "rel_vs_next": rel_next,
        "margin": min(rel_prev, rel_next) / max(rel, 1e-12),
    }


def compare_to_reference(captures: dict, reference: list, aux, *, hidden: int, num_layers: int) -> list[dict]:
    """Per prompt, each captured slot against HF ``hidden_states[p]`` (and its neighbours), and the last hidden state
    when the capture has one (``captures[i] = (aux [T, N*H], last [T, H] or None)``; ``reference[i]``:
    ``{"hs": {index: [T, H]}, "last": [T, H]}``)."""
    rows = []
    n = len(aux.positions)
    for i, ref in enumerate(reference):
        aux_sg, last_sg = captures[i]
        tokens = ref["last"].shape[0]
        assert tuple(aux_sg.shape) == (tokens, n * hidden), f"prompt {i}: aux shape {tuple(aux_sg.shape)}"
        slots = [
            _slot(k, c, p, ref["hs"])
            for k, (c, p) in enumerate(zip(aux_sg.chunk(n, dim=-1), aux.positions, strict=True))
        ]
        row = {"prompt": i, "tokens": tokens, "rel_bound": rel_bound(tokens), "aux": slots, "last": None}
        if last_sg is not None:
            assert tuple(last_sg.shape) == (tokens, hidden), f"prompt {i}: last shape {tuple(last_sg.shape)}"
            cos, rel = _cos(last_sg, ref["last"]), _rel(last_sg, ref["last"])
            pre_norm = _rel(last_sg, ref["hs"][num_layers - 1])
            row["last"] = {
                "hf_index": -1,
                "cos_min": float(cos.min()),
                "cos_mean": float(cos.mean()),
                "rel": rel,
                "rel_vs_residual_before_last_layer": pre_norm,
                "margin": pre_norm / max(rel, 1e-12),
            }
        rows.append(row)
    return rows


def compare_runs(a: dict, b: dict, lengths) -> list[dict]:
    """Two runs' captures prompt by prompt (TP>1 against TP=1): cosine, relative error, bitwise equality."""
    rows = []
    for i, tokens in enumerate(lengths):
        row = {"prompt": i, "tokens": tokens, "rel_bound": rel_bound(tokens), "last": None}
        for name, x, y in (("aux", a[i][0], b[i][0]), ("last", a[i][1], b[i][1])):
            if x is None or y is None:
                continue
            cos = _cos(x, y)
            row[name] = {
                "cos_min": float(cos.min()),
                "cos_mean": float(cos.mean()),
                "rel": _rel(x, y),
                "bitwise_equal": bool((x == y).all()),
            }
        rows.append(row)
    return rows


def failures(rows: list[dict], *, with_identity: bool) -> list[str]:
    """Every tolerance a row misses: per-token cosine >= :data:`COS_MIN`, relative error <= :func:`rel_bound`, and
    (``with_identity``) the layer-identity margin >= :data:`MARGIN_MIN`."""
    bad = []
    for r in rows:
        entries = (
            [(f"aux slot {s['slot']} (hf {s['hf_index']})", s) for s in r["aux"]]
            if isinstance(r["aux"], list)
            else [("aux", r["aux"])]
        )
        if r.get("last") is not None:
            entries.append(("last", r["last"]))
        for label, m in entries:
            where = f"prompt {r['prompt']} ({r['tokens']} tok) {label}"
            if m["cos_min"] < COS_MIN:
                bad.append(f"{where}: per-token cosine min {m['cos_min']:.5f} < {COS_MIN}")
            if m["rel"] > r["rel_bound"]:
                bad.append(f"{where}: rel err {m['rel']:.4f} > bound {r['rel_bound']:.4f}")
            if with_identity and m["margin"] < MARGIN_MIN:
                bad.append(f"{where}: layer-identity margin {m['margin']:.2f} < {MARGIN_MIN}")
    return bad
