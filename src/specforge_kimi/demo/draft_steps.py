"""What the demo's draft families (EAGLE-3 in :mod:`pipeline`, DFlash in :mod:`block_draft`) do the same way.

Scope: the one-layer draft config's shared keys, step 5 (SpecForge's own offline trainer on the captured features,
its steps on the console's training bar) and the training-loss means the summaries report. Each family keeps what
differs: its architecture keys, its strategy and overrides, its evaluation and export.
"""

from __future__ import annotations

from pathlib import Path


def one_layer_draft(hidden: int) -> dict:
    """The config keys the demo's drafts share: one decoder layer at the target's width (4 heads, SiLU MLP of
    ``4 * hidden``), K2.5's vocabulary and special ids, an untied head."""
    from specforge_kimi.targets.tiny import K25_BOS, K25_EOS, K25_PAD, K25_VOCAB

    return {
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": hidden // 4,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "vocab_size": K25_VOCAB,
        "bos_token_id": K25_BOS,
        "eos_token_id": K25_EOS,
        "pad_token_id": K25_PAD,
        "tie_word_embeddings": False,
    }


def train_draft(
    s,
    inp,
    say,
    log: Path,
    steps,
    *,
    family: str,
    detail: str,
    draft_config_path: Path,
    vocab_mapping_path: str | None,
    output_dir: Path,
    strategy: str = "eagle3",
    extra_overrides: dict | None = None,
    stage: str = "[5/6]",
) -> dict:
    """Step 5: SpecForge's own training (:func:`specforge_kimi.training.offline.train_offline`, ``strategy``) of the
    draft ``draft_config_path`` on the demo's captured features (``inp``, a ``DemoInputs``), ``s.steps`` steps with
    the settings ``s``; its steps shown on ``steps.bar``; the features' dtype is the draft's. ``stage`` heads the
    console line and the bar (the demo's step number; a study that trains as the demo does names its own)."""
    from specforge_kimi.console import Progress
    from specforge_kimi.training.offline import train_offline

    say(f"{stage} SpecForge {family} training, {s.steps} steps ({detail}); its log: {log}")
    steps.bar = Progress(f"{stage} train", s.steps, unit="step", enabled=s.progress)
    try:
        return train_offline(
            target_dir=str(inp.target_dir),
            draft_config_path=str(draft_config_path),
            hidden_states_path=str(inp.feat_dir),
            vocab_mapping_path=vocab_mapping_path,
            output_dir=str(output_dir),
            max_steps=s.steps,
            ttt_length=s.ttt_length,
            learning_rate=s.learning_rate,
            max_length=2048,
            seed=s.seed,
            embedding_key=inp.info.embedding_key,
            lm_head_key=inp.info.lm_head_key,
            chat_template="kimi-k2.5",
            strategy=strategy,
            extra_overrides={"model.torch_dtype": str(inp.feat_dtype).replace("torch.", ""), **(extra_overrides or {})},
        )
    finally:
        steps.bar.close()
        steps.bar = None


def loss_means(losses: list[float]) -> tuple[int, float, float]:
    """``(k, first, last)``: the mean training loss over the first and the last ``k`` steps, ``k`` a fifth of the
    steps (at least 1, at most 50)."""
    k = max(1, min(50, len(losses) // 5))
    return k, sum(losses[:k]) / k, sum(losses[-k:]) / k
