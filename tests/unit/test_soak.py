"""The soak's flatness verdicts (``tests/soak.py``) on synthetic samples: a flat series with noise passes, a
leak above the stated bound fails, growth inside the warm-up is not judged."""

from __future__ import annotations

import random

from soak import MIB, drift, rise, role, verdicts


def _samples(rss, steps=5000, every=25, seed=0):
    rng = random.Random(seed)
    return [
        {
            "t": i,
            "step": s,
            "processes": {"trainer-rank:11": {"rss_bytes": rss(s) + rng.uniform(-8, 8) * MIB, "fds": 40}},
            "mooncake_allocated_bytes": int(rng.uniform(0, 200) * MIB),
            "mooncake_keys": rng.randint(0, 400),
        }
        for i, s in enumerate(range(1, steps + 1, every))
    ]


def test_drift_and_rise():
    assert abs(drift([(0, 0.0), (10, 5.0), (20, 10.0)]) - 10.0) < 1e-9
    assert drift([(0, 3.0), (10, 3.0), (20, 3.0)]) == 0.0
    assert rise([(s, float(s)) for s in range(9)]) == 6.0  # medians of [0, 1, 2] and [6, 7, 8]


def test_flat_series_pass_and_warmup_growth_is_not_judged():
    base = 2000 * MIB
    v = verdicts(_samples(lambda s: base + (300 * MIB if s > 500 else s * 0.6 * MIB)), 5000)
    assert v["trainer-rank:11/rss_bytes"]["flat"] and v["trainer-rank:11/fds"]["flat"]
    assert v["mooncake_allocated_bytes"]["flat"] and v["mooncake_keys"]["flat"]


def test_a_leak_above_the_bound_fails():
    base = 2000 * MIB  # bound: max(64 MiB, 5% of ~2.2 GiB) = ~110 MiB
    v = verdicts(_samples(lambda s: base + s * 64 * 1024), 5000)  # 64 KiB a step: a rise of ~167 MiB
    assert not v["trainer-rank:11/rss_bytes"]["flat"]
    v = verdicts(_samples(lambda s: base + s * 8 * 1024), 5000)  # 8 KiB a step: ~21 MiB, below the bound
    assert v["trainer-rank:11/rss_bytes"]["flat"]
    leak = _samples(lambda s: base)
    for i, sample in enumerate(leak):
        sample["mooncake_keys"] += i * 10  # features never released: ~2,000 keys more by the end
    assert not verdicts(leak, 5000)["mooncake_keys"]["flat"]
    falling = verdicts(_samples(lambda s: base - s * 64 * 1024), 5000)["trainer-rank:11/rss_bytes"]
    assert falling["flat"] and falling["rise"] < -falling["bound"]  # memory given back: reported, not a leak


def test_roles_by_command_line():
    assert (
        role("python -m torch.distributed.run --standalone -m specforge_kimi train -c x --role consumer") == "torchrun"
    )
    assert role("python -m specforge_kimi train -c x --role consumer") == "trainer-rank"
    assert role("python -m specforge_kimi train -c x --role producer") == "producer"
    assert role("python -c from mooncake.cli import main; main() --rpc_port=1") == "mooncake-master"
    assert role("python -m specforge_kimi.capture_server --model-path t") == "capture-server"
