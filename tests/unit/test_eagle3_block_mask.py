"""The eagle3-block-mask seam on the CPU: the BlockMask it counts per block is PyTorch's ``create_block_mask`` of
SpecForge's ``generate_eagle3_mask``, tensor for tensor (partial sample lengths, every TTT position, sequence
lengths that are and are not multiples of the block, several block sizes); installed, SpecForge's flex attention
layer gives the same output, and only a tagged mask takes the counted path."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("specforge")

from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from specforge_kimi.drafts import eagle3_block_mask as seam  # noqa: E402

FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


@pytest.fixture
def installed():
    seam.install_eagle3_block_mask(force=True)
    yield
    seam.uninstall_eagle3_block_mask()


def _tagged(seq_lengths, q_len, kv_len, lck):
    from specforge.modeling.draft.flex_attention import generate_eagle3_mask

    mask_mod = generate_eagle3_mask(seq_lengths, q_len, kv_len, lck)
    setattr(mask_mod, seam.TAG, (seq_lengths, q_len, kv_len))
    return mask_mod


@pytest.mark.parametrize(
    "q_len,positions,block",
    [(1, 1, 4), (5, 3, 4), (8, 2, 4), (7, 4, 2), (33, 2, 8), (64, 7, 16), (100, 1, 128), (129, 2, 128), (300, 4, 128)],
)
def test_counted_block_mask_is_create_block_masks(q_len, positions, block):
    rng = random.Random(q_len * 31 + positions)
    for batch in (1, 3):
        lengths = torch.tensor([rng.randint(0, q_len) for _ in range(batch)])
        if batch == 3:
            lengths[0] = q_len  # one sample filling the batch's length
        kv_len = positions * q_len
        mask_mod = _tagged(lengths, q_len, kv_len, positions - 1)
        ref = create_block_mask(mask_mod, batch, 1, q_len, kv_len, "cpu", BLOCK_SIZE=block)
        got = seam.eagle3_block_mask(mask_mod, batch, 1, q_len, kv_len, "cpu", block)
        for field in FIELDS:
            assert torch.equal(getattr(ref, field), getattr(got, field)), (field, lengths.tolist())
        assert got.mask_mod is mask_mod and got.seq_lengths == (q_len, kv_len)


def test_block_counts_are_the_entries_kept():
    lengths = torch.tensor([11, 0, 16])
    q_len, kv_len = 16, 48
    from torch.nn.attention.flex_attention import create_mask

    dense = create_mask(_tagged(lengths, q_len, kv_len, 2), 3, 1, q_len, kv_len, "cpu")[:, 0]  # every entry
    counts = seam.block_counts(lengths, q_len, kv_len, 4, 8)
    expected = dense.view(3, 4, 4, 6, 8).sum(dim=(2, 4))
    assert torch.equal(counts, expected)
    assert counts[1].sum() == 0  # an empty sample keeps nothing


def test_a_mask_built_for_other_lengths_is_refused():
    mask_mod = _tagged(torch.tensor([4]), 8, 16, 1)
    with pytest.raises(ValueError, match="built for Q_LEN 8, KV_LEN 16; asked for 8, 24"):
        seam.eagle3_block_mask(mask_mod, 1, 1, 8, 24, "cpu", 4)


def test_installed_only_tagged_masks_are_counted(installed, monkeypatch):
    from specforge.modeling.draft import llama3_eagle

    assert seam.installed()
    mask_mod = llama3_eagle.generate_eagle3_mask(torch.tensor([5]), 8, 16, 1)
    assert getattr(mask_mod, seam.TAG)[1:] == (8, 16)
    calls = []
    monkeypatch.setattr(seam, "eagle3_block_mask", lambda *a, **k: calls.append(a) or "counted")
    assert llama3_eagle.create_block_mask(mask_mod, 1, 1, 8, 16, "cpu") == "counted"
    assert llama3_eagle.compile_friendly_create_block_mask(mask_mod, 1, 1, 8, 16, "cpu") == "counted"
    plain = llama3_eagle.create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 8, 8, "cpu")  # untagged: PyTorch's
    assert plain.kv_num_blocks.tolist() == [[[1]]] and len(calls) == 2


def test_uninstalled_is_specforges_own():
    from specforge.modeling.draft import flex_attention as sf_flex
    from specforge.modeling.draft import llama3_eagle

    seam.install_eagle3_block_mask(force=True)
    seam.uninstall_eagle3_block_mask()
    assert not seam.installed() and llama3_eagle.generate_eagle3_mask is sf_flex.generate_eagle3_mask
    assert llama3_eagle.create_block_mask is create_block_mask
    assert seam.install_eagle3_block_mask() is False  # not requested: nothing installed


def _flex_layer():
    from specforge.modeling.draft.llama3_eagle import LlamaFlexAttention
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256
    )
    torch.manual_seed(0)
    return LlamaFlexAttention(cfg).float()


def _ttt(layer, hidden, mask, positions=3):
    """SpecForge's eagle3 step's use of the layer: one call per TTT position, the KV cache growing."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    pos = torch.arange(hidden.shape[1]).unsqueeze(0)
    outs = []
    for i in range(positions):
        outs.append(layer(hidden * (1 + i), attention_mask=mask, position_ids=pos, past_key_values=cache))
    return torch.stack(outs)


def test_the_flex_layer_gives_the_same_output(installed):
    """Forward only: PyTorch's flex attention has no CPU backward. The backward kernel reads the same BlockMask
    tensors (test_counted_block_mask_is_create_block_masks), so its gradients are the same too."""
    layer = _flex_layer().requires_grad_(False)
    hidden = torch.randn(2, 24, 128)  # the layer attends over [embedding, hidden]
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0
    with torch.no_grad():
        out = _ttt(layer, hidden, mask)
        seam.uninstall_eagle3_block_mask()
        ref = _ttt(layer, hidden, mask)
    assert torch.equal(out, ref) and out.abs().sum() > 0
