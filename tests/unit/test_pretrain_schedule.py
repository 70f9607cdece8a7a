"""The tiny target's pretraining learning-rate schedule (``tiny --pretrain-schedule cosine``)."""

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
