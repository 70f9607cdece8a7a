"""The trainer memory plan's sdpa term against what SpecForge's eager TTT attention really keeps.

``recipes.memory_plan`` charges ``6 B x draft heads x ttt_length x max_length^2`` when
``trainer.attention_backend`` is ``sdpa``. Here SpecForge's own ``OnlineEagle3Model`` with a
small Llama EAGLE-3 draft (sdpa, bf16, CPU) runs forward at three sample lengths while a
saved-tensor hook records the storage kept for the backward; the quadratic coefficient fitted
through them must match the plan's. (flex_attention has no CPU backward, so its linear memory
is not measured here.)
"""

import pytest


@pytest.mark.slow
def test_sdpa_quadratic_term_matches_specforge():
    import torch

    from specforge_kimi.training.cpu_shims import install_cpu_shims

    install_cpu_shims()
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    heads, ttt, hidden, vocab, draft_vocab = 8, 3, 64, 512, 128
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=1,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        vocab_size=vocab,
        pad_token_id=vocab - 1,
    )
    cfg.draft_vocab_size = draft_vocab
    draft = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa").to(torch.bfloat16)
    draft.t2d.zero_()
    draft.t2d[:draft_vocab] = True
    model = OnlineEagle3Model(draft, length=ttt, attention_backend="sdpa")

    def kept(length: int) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(
                input_ids=torch.randint(0, vocab, (1, length)),
                attention_mask=torch.ones(1, length, dtype=torch.long),
                target=torch.randn(1, length, vocab, dtype=torch.bfloat16),
                loss_mask=torch.ones(1, length, 1, dtype=torch.long),
                hidden_states=torch.randn(1, length, 3 * hidden, dtype=torch.bfloat16),
            )
        return sum(storages.values())

    lengths = (128, 256, 384)
    b = [kept(n) for n in lengths]
    # second difference of equally spaced lengths isolates the quadratic coefficient: a = d2 / (2 h^2)
    h = lengths[1] - lengths[0]
    a = (b[2] - 2 * b[1] + b[0]) / (2 * h * h)
    planned = 6 * heads * ttt
    print(f"quadratic coefficient {a:.2f} B, planned {planned} B")
    assert a == pytest.approx(planned, rel=0.1), (a, planned, b)
