"""The tiny target's pretraining: learning-rate schedule (``--pretrain-schedule``) and loss (``--pretrain-loss``)."""

import pytest

from specforge_kimi.errors import KimiInputError
from specforge_kimi.pretrain import cosine_scale, pretrain


def test_cosine_scale_warms_up_then_decays_to_the_floor():
    assert cosine_scale(0.0) == 0.0
    assert cosine_scale(0.015) == pytest.approx(0.5)
    assert cosine_scale(0.03) == pytest.approx(1.0)
    assert cosine_scale(1.0) == pytest.approx(0.05) and cosine_scale(7.0) == pytest.approx(0.05)
    tail = [cosine_scale(0.03 + i * 0.097) for i in range(11)]
    assert all(a > b for a, b in zip(tail, tail[1:]))


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

    from specforge_kimi.target import load_text_model

    seq = [5, 17, 3, 17, 5, 99, 3, 17]
    res = pretrain(str(tiny_dir), [seq], str(tmp_path / "out"), seconds=60, max_steps=1, batch_size=2, lr=0.0,
                   progress=False, loss=loss)
    model = load_text_model(str(tmp_path / "out")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    full_ce = F.cross_entropy(logits, torch.tensor(seq[1:])).item()
    assert (res.first_loss == pytest.approx(full_ce, rel=1e-4)) == (loss == "full"), (res.first_loss, full_ce)


def test_unknown_loss_is_refused(tmp_path):
    with pytest.raises(KimiInputError, match="full or corpus"):
        pretrain(str(tmp_path), [[1, 2, 3]], str(tmp_path / "out"), loss="all")
