"""The ``eagle3-block-mask`` seam: the EAGLE-3 flex attention's block mask counted per block instead of per entry.

Scope: SpecForge 0.2.0's ``LlamaFlexAttention`` (``specforge.modeling.draft.llama3_eagle``), which at every TTT
position builds a flex-attention ``BlockMask`` for ``generate_eagle3_mask`` (``specforge.modeling.draft.
flex_attention``): causal over the first ``Q_LEN`` keys, plus, for each earlier TTT position's keys, the one key
at the query's own position (``(kv - q) % Q_LEN == 0``), all within the sample's length. PyTorch's
``create_block_mask`` evaluates that mask at every (query, key) pair -- a [B, Q_LEN, KV_LEN] boolean tensor, with
``KV_LEN = (position + 1) x Q_LEN`` -- and then sums it per block, at every TTT position of every step: work and
memory that grow with the square of the sample length (its cost in a profile: bench/REPORT.md's step profiles).

With ``SPECFORGE_KIMI_EAGLE3_BLOCK_MASK=1`` in the process (recipe ``trainer.step_eagle3_block_mask``, set by
``training.step_knobs``), :func:`install_eagle3_block_mask` makes ``generate_eagle3_mask`` tag the mask function it
returns with its parameters, and ``create_block_mask`` (both names ``LlamaFlexAttention.forward`` calls: the eager
one and SpecForge's compiled one) build a tagged mask's block tensors from those parameters: the number of true
entries of each (query block, key block) pair in closed form (:func:`block_counts`), a block full when every entry
of it is true and partial when some are, then PyTorch's own ``_create_sparse_block_from_block_mask`` -- the same
steps ``create_block_mask`` takes after its per-entry sum, so the ``BlockMask`` is the same tensors (tested against
``create_block_mask``) and flex attention computes the same values. Partial blocks still apply the original mask
function inside the kernel. An untagged mask goes to PyTorch's ``create_block_mask`` unchanged.

Without the variable (or with ``0``) nothing is replaced. :func:`uninstall_eagle3_block_mask` puts SpecForge's
functions back (tests).
"""

from __future__ import annotations

import os

import specforge_kimi.environment as _env

BLOCK_MASK_ENV = _env.EAGLE3_BLOCK_MASK.name
#: the attribute a tagged mask function carries: (seq_lengths, Q_LEN, KV_LEN)
TAG = "_specforge_kimi_eagle3_mask"
#: SpecForge's functions while the seam is installed: module -> {name: original}
_ORIGINAL: dict = {}


def requested() -> bool:
    """Whether this process was asked for the seam (the variable is ``1``)."""
    return os.environ.get(BLOCK_MASK_ENV, "0") == "1"


def _causal_count(qa, qb, ka, kb):
    """True entries of ``kv <= q`` for q in [qa, qb] and kv in [ka, kb] (empty ranges count 0), elementwise."""
    import torch

    # q in [max(qa, ka), min(qb, kb)] contributes q - ka + 1; q in [max(qa, kb + 1), qb] contributes kb - ka + 1
    lo, hi = torch.maximum(qa, ka), torch.minimum(qb, kb)
    n1 = (hi - lo + 1).clamp(min=0)
    first, last = lo - ka + 1, hi - ka + 1
    s1 = torch.where(n1 > 0, (first + last) * n1 // 2, torch.zeros_like(n1))
    n2 = (qb - torch.maximum(qa, kb + 1) + 1).clamp(min=0)
    width = (kb - ka + 1).clamp(min=0)
    return torch.where((qb >= qa) & (kb >= ka), s1 + n2 * width, torch.zeros_like(n1))


def block_counts(seq_lengths, q_len: int, kv_len: int, q_block: int, kv_block: int):
    """[B, n_q_blocks, n_kv_blocks] int64: how many (q, kv) pairs of each block ``generate_eagle3_mask`` keeps.

    Causal part (kv < Q_LEN): q >= kv, both below the sample's length. Suffix part (kv >= Q_LEN): kv = q + j Q_LEN
    for a j >= 1, ``kv % Q_LEN`` below the length. Rows past ``q_len`` and columns past ``kv_len`` (a last block's
    padding) count nothing, as PyTorch pads the per-entry mask with False."""
    import torch

    dev = seq_lengths.device
    sl = seq_lengths.to(torch.int64).view(-1, 1, 1)
    nq, nk = -(-q_len // q_block), -(-kv_len // kv_block)
    q0 = (torch.arange(nq, device=dev, dtype=torch.int64) * q_block).view(1, -1, 1)
    k0 = (torch.arange(nk, device=dev, dtype=torch.int64) * kv_block).view(1, 1, -1)
    q1 = (q0 + q_block - 1).clamp(max=q_len - 1)
    k1 = (k0 + kv_block - 1).clamp(max=kv_len - 1)
    q_hi = torch.minimum(q1, sl - 1)  # real query rows of the sample
    causal = _causal_count(q0, q_hi, k0, torch.minimum(torch.minimum(k1, sl - 1), torch.full_like(k1, q_len - 1)))
    total = causal
    segments = -(-kv_len // q_len)  # key segments: 0 is the causal one, 1.. the earlier TTT positions' keys
    for j in range(1, segments):
        # keys of segment j inside the block, as query positions r = kv - j Q_LEN, meeting the rows and the length
        ra = torch.maximum(k0, torch.full_like(k0, j * q_len)) - j * q_len
        rb = torch.minimum(k1, torch.full_like(k1, (j + 1) * q_len - 1)) - j * q_len
        lo = torch.maximum(ra, q0)
        hi = torch.minimum(torch.minimum(rb, q_hi), sl - 1)
        total = total + (hi - lo + 1).clamp(min=0)
    return total


def eagle3_block_mask(mask_mod, batch: int, heads: int, q_len: int, kv_len: int, device, block_size=128):
    """The ``BlockMask`` ``create_block_mask(mask_mod, batch, heads, q_len, kv_len, device, block_size)`` returns for
    a mask function :func:`install_eagle3_block_mask` tagged, from :func:`block_counts`."""
    import torch
    from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask

    seq_lengths, tag_q, tag_kv = getattr(mask_mod, TAG)
    if (tag_q, tag_kv) != (q_len, kv_len):
        raise ValueError(f"eagle3 block mask: built for Q_LEN {tag_q}, KV_LEN {tag_kv}; asked for {q_len}, {kv_len}")
    qb, kb = (block_size, block_size) if isinstance(block_size, int) else block_size
    counts = block_counts(seq_lengths.to(device), q_len, kv_len, qb, kb)
    if counts.shape[0] != batch:
        counts = counts.expand(batch, -1, -1)
    full = counts == qb * kb
    partial = (counts > 0) & ~full
    shape = (batch, heads, counts.shape[1], counts.shape[2])
    dense = tuple(t.unsqueeze(1).expand(shape).to(torch.int8) for t in (partial, full))
    return _create_sparse_block_from_block_mask(dense, mask_mod, (q_len, kv_len), qb, kb)


def _tagging(generate):
    def generate_eagle3_mask(seq_lengths, Q_LEN, KV_LEN, lck=0):
        mask_mod = generate(seq_lengths=seq_lengths, Q_LEN=Q_LEN, KV_LEN=KV_LEN, lck=lck)
        setattr(mask_mod, TAG, (seq_lengths, Q_LEN, KV_LEN))
        return mask_mod

    return generate_eagle3_mask


def _counting(create, *, block_size: bool = True):
    """A ``create_block_mask`` that builds a tagged mask's ``BlockMask`` from block counts and hands any other mask
    to ``create`` (``block_size`` False: SpecForge's compiled one, which takes no ``BLOCK_SIZE``)."""

    def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, **kw):
        if getattr(mask_mod, TAG, None) is not None and not kw:
            return eagle3_block_mask(mask_mod, B or 1, H or 1, Q_LEN, KV_LEN, device, BLOCK_SIZE)
        return create(mask_mod, B, H, Q_LEN, KV_LEN, device, *((BLOCK_SIZE,) if block_size else ()), **kw)

    return create_block_mask


def install_eagle3_block_mask(force: bool = False) -> bool:
    """Install the seam when :func:`requested` (or ``force``); True when it is installed after the call."""
    if not (force or requested()):
        return bool(_ORIGINAL)
    if _ORIGINAL:
        return True
    from specforge.modeling.draft import flex_attention as sf_flex
    from specforge.modeling.draft import llama3_eagle

    _ORIGINAL[llama3_eagle] = {
        name: getattr(llama3_eagle, name)
        for name in ("generate_eagle3_mask", "create_block_mask", "compile_friendly_create_block_mask")
    }
    llama3_eagle.generate_eagle3_mask = _tagging(sf_flex.generate_eagle3_mask)
    llama3_eagle.create_block_mask = _counting(_ORIGINAL[llama3_eagle]["create_block_mask"])
    llama3_eagle.compile_friendly_create_block_mask = _counting(
        _ORIGINAL[llama3_eagle]["compile_friendly_create_block_mask"], block_size=False
    )
    return True


def installed() -> bool:
    """Whether the seam is installed in this process."""
    return bool(_ORIGINAL)


def uninstall_eagle3_block_mask() -> None:
    """SpecForge's functions back (tests)."""
    for module, names in _ORIGINAL.items():
        for name, fn in names.items():
            setattr(module, name, fn)
    _ORIGINAL.clear()
