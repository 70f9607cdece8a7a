"""d2t/t2d: selection, SpecForge's file format and loader, round trip, wrong-target detection."""

from __future__ import annotations

import json

import pytest
import torch

from specforge_kimi.data.tokenizer import K25_EMITTED_SPECIAL_TOKENS, K25_SPECIAL_TOKENS
from specforge_kimi.data.vocab_mapping import (
    VocabMapping,
    build_vocab_mapping,
    emitted_special_ids,
    load_vocab_mapping,
    save_vocab_mapping,
    select_draft_tokens,
    sidecar_path,
    validate_vocab_mapping,
)
from specforge_kimi.errors import KimiInputError

SPECIALS = sorted(K25_SPECIAL_TOKENS[n] for n in K25_EMITTED_SPECIAL_TOKENS)


def test_emitted_specials_are_the_chat_and_tool_tokens():
    assert SPECIALS == emitted_special_ids() == [
        163585, 163586, 163595, 163596, 163597, 163598, 163599, 163606, 163607,
    ]  # fmt: skip


def test_selection_order_specials_then_frequency_then_lowest_ids():
    counts = {500: 7, 400: 7, 300: 9, 12: 1, 163586: 3}
    # 9 specials + 300 (9) + 400, 500 (7, lower id first) + 163586 already in; then 12; fill 0, 1
    chosen = select_draft_tokens(counts, draft_vocab_size=15)
    assert chosen == sorted([*SPECIALS, 300, 400, 500, 12, 0, 1])
    tight = select_draft_tokens(counts, draft_vocab_size=11)
    assert tight == sorted([*SPECIALS, 300, 400])


def test_selection_errors():
    with pytest.raises(KimiInputError, match="cannot hold"):
        select_draft_tokens({}, draft_vocab_size=4)
    with pytest.raises(KimiInputError, match="outside the target vocab"):
        select_draft_tokens({163840: 1}, draft_vocab_size=20)


def test_d2t_t2d_agree_and_have_specforge_dtypes():
    mapping = build_vocab_mapping({i: 1000 - i for i in range(1000)}, draft_vocab_size=64)
    assert mapping.d2t.dtype == torch.int64 and mapping.d2t.shape == (64,)
    assert mapping.t2d.dtype == torch.bool and mapping.t2d.shape == (163840,)
    ids = mapping.draft_ids
    assert ids == sorted(ids)
    assert torch.equal(torch.nonzero(mapping.t2d).flatten(), torch.tensor(ids))
    for draft_id, target_id in enumerate(ids):
        assert draft_id + int(mapping.d2t[draft_id]) == target_id
        assert bool(mapping.t2d[target_id])
    assert set(SPECIALS) <= set(ids)
    # the 55 non-special slots are the most frequent ids 0..54
    assert [i for i in ids if i not in SPECIALS] == list(range(55))
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency

    validate_vocab_mapping_consistency(mapping.t2d, mapping.d2t)


def test_round_trip_through_specforge_loader(tmp_path):
    mapping = build_vocab_mapping({5: 10, 7: 3, 163586: 40}, draft_vocab_size=32)
    path = save_vocab_mapping(mapping, tmp_path / "vocab_mapping.pt")
    raw = torch.load(path)  # exactly SpecForge's call (weights-only by default)
    assert set(raw) == {"d2t", "t2d"}
    assert torch.equal(raw["d2t"], mapping.d2t) and torch.equal(raw["t2d"], mapping.t2d)

    from specforge.modeling.draft.base import Eagle3DraftModel

    class Buffers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("t2d", torch.ones(163840, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(32, dtype=torch.int64))

    draft = Buffers()
    Eagle3DraftModel.load_vocab_mapping(draft, str(path))
    assert torch.equal(draft.d2t, mapping.d2t) and torch.equal(draft.t2d, mapping.t2d)

    loaded = load_vocab_mapping(path)
    assert loaded.meta["target"] == "kimi-k2.5"
    assert loaded.meta["special_tokens"] == K25_SPECIAL_TOKENS
    assert loaded.meta["coverage"] == 1.0
    assert torch.equal(loaded.d2t, mapping.d2t)


def test_save_is_deterministic(tmp_path):
    counts = {i: (i * 7919) % 101 for i in range(5000)}
    a = save_vocab_mapping(build_vocab_mapping(counts, draft_vocab_size=512), tmp_path / "a.pt")
    b = save_vocab_mapping(build_vocab_mapping(counts, draft_vocab_size=512), tmp_path / "b.pt")
    assert a.read_bytes() == b.read_bytes()


def _mapping(ids: list[int], vocab: int = 163840) -> VocabMapping:
    ids = sorted(ids)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    d2t = torch.tensor(ids, dtype=torch.int64) - torch.arange(len(ids))
    return VocabMapping(d2t=d2t, t2d=t2d, meta={})


def test_mapping_for_another_vocab_is_rejected():
    with pytest.raises(KimiInputError, match="vocabulary of 151936 ids.*another target"):
        validate_vocab_mapping(_mapping(list(range(100)), vocab=151936))


def test_mapping_without_k25_specials_is_rejected():
    # e.g. SpecForge's own frequency-only mapping for another chat format
    with pytest.raises(KimiInputError, match=r"lacks special tokens.*</think> \(163607\)"):
        validate_vocab_mapping(_mapping(list(range(100)) + [163586]))


def test_inconsistent_mapping_is_rejected():
    mapping = _mapping([*SPECIALS, 1, 2, 3])
    broken = VocabMapping(d2t=mapping.d2t + 1, t2d=mapping.t2d, meta={})
    with pytest.raises(KimiInputError, match="disagree"):
        validate_vocab_mapping(broken)
    with pytest.raises(KimiInputError, match="int64"):
        validate_vocab_mapping(VocabMapping(d2t=mapping.d2t.int(), t2d=mapping.t2d, meta={}))


def test_sidecar_of_another_target_or_tokenizer_is_rejected(tmp_path):
    path = save_vocab_mapping(build_vocab_mapping({}, draft_vocab_size=16), tmp_path / "m.pt")
    meta = json.loads(sidecar_path(path).read_text())
    sidecar_path(path).write_text(json.dumps({**meta, "target": "kimi-k2"}))
    with pytest.raises(KimiInputError, match="target 'kimi-k2'"):
        load_vocab_mapping(path)
    specials = {**meta["special_tokens"], "<think>": 163608}
    sidecar_path(path).write_text(json.dumps({**meta, "special_tokens": specials}))
    with pytest.raises(KimiInputError, match="another tokenizer"):
        load_vocab_mapping(path)


def test_unreadable_file(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_text("nope")
    with pytest.raises(KimiInputError, match="cannot be read"):
        load_vocab_mapping(bad)
