"""The tiny target's pretraining: learning-rate schedule (``--pretrain-schedule``) and loss (``--pretrain-loss``)."""

import pytest

from specforge_kimi.demo.pretrain import cosine_scale, pretrain
from specforge_kimi.errors import KimiInputError


def test_cosine_scale_warms_up_then_decays_to_the_floor():
    assert cosine_scale(0.0) == 0.0
    assert cosine_scale(0.015) == pytest.approx(0.5)
    assert cosine_scale(0.03) == pytest.approx(1.0)
    assert cosine_scale(1.0) == pytest.approx(0.05) and cosine_scale(7.0) == pytest.approx(0.05)
    tail = [cosine_scale(0.03 + i * 0.097) for i in range(11)]
    assert all(a > b for a, b in zip(tail, tail[1:], strict=False))


def test_unknown_schedule_is_refused(tmp_path):
    with pytest.raises(KimiInputError, match="constant or cosine"):
        pretrain(str(tmp_path), [[1, 2, 3]], str(tmp_path / "out"), schedule="linear")


@pytest.mark.parametrize("loss", ["full", "corpus"])
def test_training_loss_is_the_written_checkpoints_cross_entropy(tmp_path, tiny_dir, loss):
    """With ``loss="full"`` the step loss is the full-vocabulary cross-entropy of the checkpoint
    as written (unused head rows zeroed); the corpus-restricted loss is not (it leaves out the
    untrained tokens' mass). lr 0, so the written weights are the ones the step scored."""
    import torch
    import torch.nn.functional as F

    from specforge_kimi.targets.checkpoint import load_text_model

    seq = [5, 17, 3, 17, 5, 99, 3, 17]
    res = pretrain(
        str(tiny_dir),
        [seq],
        str(tmp_path / "out"),
        seconds=60,
        max_steps=1,
        batch_size=2,
        lr=0.0,
        progress=False,
        loss=loss,
    )
    model = load_text_model(str(tmp_path / "out")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    full_ce = F.cross_entropy(logits, torch.tensor(seq[1:])).item()
    assert (res.first_loss == pytest.approx(full_ce, rel=1e-4)) == (loss == "full"), (res.first_loss, full_ce)


def test_unknown_loss_is_refused(tmp_path):
    with pytest.raises(KimiInputError, match="full or corpus"):
        pretrain(str(tmp_path), [[1, 2, 3]], str(tmp_path / "out"), loss="all")


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_step_bounded_pretraining_repeats_bit_for_bit(tmp_path, tiny_dir, schedule):
    """Deterministic (the default) and step-bounded: two runs write identical weights and losses,
    and leave torch's global deterministic-algorithms setting as they found it. With the cosine
    schedule too: its warm-up and decay follow the step count, not the clock (on the H200 a cosine
    schedule that also read the clock parted two runs at step 1)."""
    import torch
    from safetensors.torch import load_file

    seqs = [[5, 17, 3, 17, 5, 99, 3, 17], [8, 9, 10, 11, 12, 13], [99, 5, 5, 17, 3]]
    before = torch.are_deterministic_algorithms_enabled()
    runs = [
        pretrain(
            str(tiny_dir),
            seqs,
            str(tmp_path / f"out{i}"),
            seconds=600,
            max_steps=4,
            batch_size=3,
            progress=False,
            schedule=schedule,
        )
        for i in range(2)
    ]
    assert torch.are_deterministic_algorithms_enabled() == before
    assert runs[0].steps == runs[1].steps == 4 and runs[0].losses == runs[1].losses
    for f in sorted((tmp_path / "out0").glob("*.safetensors")):
        a, b = load_file(f), load_file(tmp_path / "out1" / f.name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f.name


def test_step_bound_must_be_positive(tmp_path):
    from specforge_kimi.demo.pretrain import pretrain_structured_target
    from specforge_kimi.targets.tiny import TinySpec

    with pytest.raises(KimiInputError, match="--pretrain-steps must be positive"):
        pretrain_structured_target(tmp_path / "t", TinySpec(), seconds=10, max_steps=0)


def test_bf16_precision_runs_the_forward_under_autocast(tmp_path, tiny_dir):
    """``precision="bf16"``: the same step scores within bf16 rounding of the fp32 one, but not
    bit-equal (so the autocast is really on); the weights it trains stay float32."""
    seq = [5, 17, 3, 17, 5, 99, 3, 17]
    kw = dict(seconds=60, max_steps=1, batch_size=2, lr=0.0, progress=False)
    fp32 = pretrain(str(tiny_dir), [seq], str(tmp_path / "a"), precision="fp32", **kw)
    bf16 = pretrain(str(tiny_dir), [seq], str(tmp_path / "b"), precision="bf16", **kw)
    assert bf16.first_loss == pytest.approx(fp32.first_loss, rel=2e-2)
    assert bf16.first_loss != fp32.first_loss


@pytest.mark.parametrize(
    "bad, match", [(dict(precision="fp16"), "fp32 or bf16"), (dict(batch_size=0), "batch size must be positive")]
)
def test_bad_precision_or_batch_size_is_refused(tmp_path, bad, match):
    with pytest.raises(KimiInputError, match=match):
        pretrain(str(tmp_path), [[1, 2, 3]], str(tmp_path / "out"), **bad)


SMALL = dict(
    layers=2,
    hidden=64,
    heads=4,
    experts=4,
    experts_per_token=2,
    moe_intermediate=32,
    dense_intermediate=64,
    q_lora_rank=32,
    vision_hidden=32,
    vision_heads=4,
)


def test_prompt_rules_are_trained_on_and_scored_on_the_bench_prompts(tmp_path):
    """``prompt_rules=N``: N rule conversations join the corpus in training (the step losses change),
    and pretrain.json scores the rule on the bench's own 96 prompts; the structured numbers stay."""
    from specforge_kimi.demo.pretrain import pretrain_structured_target
    from specforge_kimi.targets.tiny import TinySpec

    kw = dict(seconds=300, max_steps=2, progress=False, heldout=2, conversations=8, batch_size=4)
    plain = pretrain_structured_target(tmp_path / "plain", TinySpec(**SMALL), **kw)
    ruled = pretrain_structured_target(tmp_path / "ruled", TinySpec(**SMALL), prompt_rules=8, **kw)
    assert "prompt_rules" not in plain
    pr = ruled["prompt_rules"]
    assert pr["conversations"] == 8 and pr["rows"] == 8 and pr["tokens"] > 0 and pr["rule"] == "echo"
    assert pr["heldout"]["conversations"] == 96 and pr["heldout"]["answer_tokens"] > 0
    assert 0 <= pr["heldout"]["greedy_accuracy"] <= 1
    assert ruled["train"]["losses"] != plain["train"]["losses"]
    assert ruled["heldout"].keys() == plain["heldout"].keys()
    words = pretrain_structured_target(tmp_path / "words", TinySpec(**SMALL), prompt_rules=8, prompt_rule="words", **kw)
    assert words["prompt_rules"]["rule"] == "words" and words["prompt_rules"]["tokens"] != pr["tokens"]


@pytest.mark.parametrize(
    "n, rule, match",
    [
        (-1, "echo", "must be >= 0"),
        (10_000, "echo", "distinct prompts"),
        (8, "shout", "--pretrain-prompt-rule 'shout'"),
    ],
)
def test_bad_prompt_rule_counts_are_refused(tmp_path, n, rule, match):
    from specforge_kimi.demo.pretrain import pretrain_structured_target
    from specforge_kimi.targets.tiny import TinySpec

    with pytest.raises(KimiInputError, match=match):
        pretrain_structured_target(
            tmp_path / "t", TinySpec(**SMALL), seconds=10, max_steps=1, prompt_rules=n, prompt_rule=rule, progress=False
        )
