"""The co-located overlap model (``specforge_kimi.plan.overlap``): the serial sum, the ceiling, one GPU's time per
token and the hidden fraction a measured rate implies -- the arithmetic bench/overlap_rates.py, bench/sizing.py and
bench/report.py share."""

import pytest

from specforge_kimi.plan import overlap

US = 1e-6


def test_serial_sum_is_the_stages_taking_turns():
    assert overlap.serial_rate(50000.0, 12500.0) == pytest.approx(10000.0)
    assert overlap.serial_rate(3.0, 6.0) == pytest.approx(2.0)


def test_hidden_fraction_is_how_much_of_the_smaller_stage_the_overlap_hides():
    # prefill 2e-5 s a token, trainer 8e-5: taking turns 1e-4 (10,000 tok/s), the ceiling the trainer alone
    assert overlap.hidden_fraction(10000.0, 50000.0, 12500.0) == pytest.approx(0.0)
    assert overlap.hidden_fraction(12500.0, 50000.0, 12500.0) == pytest.approx(1.0)
    assert overlap.hidden_fraction(12500.0, 12500.0, 50000.0) == pytest.approx(1.0)  # whichever stage is smaller
    assert overlap.hidden_fraction(9000.0, 50000.0, 12500.0) < 0  # slower than taking turns
    assert overlap.ceiling_rate(50000.0, 12500.0) == 12500.0


def test_gpu_time_per_token_and_the_hidden_fraction_invert_each_other_with_a_tax():
    # 20 us prefill + 100 us training per token; half the prefill hidden; 1 us tax -> 111 us
    assert overlap.gpu_s_per_token(50_000, 10_000, 0.5, tax_s=1 * US) == pytest.approx(111 * US)
    assert overlap.hidden_fraction(1 / (111 * US), 50_000, 10_000, tax_s=1 * US) == pytest.approx(0.5)
    assert overlap.gpu_s_per_token(50_000, 10_000, 1.0) == pytest.approx(100 * US)  # never faster than the slower
    assert overlap.gpu_s_per_token(10_000, 50_000, 0.0) == pytest.approx(120 * US)
    for hidden in (-0.5, 0.0, 0.3, 1.0):
        rate = 1 / overlap.gpu_s_per_token(41_000, 7_900, hidden, tax_s=2 * US)
        assert overlap.hidden_fraction(rate, 41_000, 7_900, tax_s=2 * US) == pytest.approx(hidden)
