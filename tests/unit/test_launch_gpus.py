"""``plan.devices.node_gpus``: a node's GPUs follow the launching environment's CUDA_VISIBLE_DEVICES."""

import pytest

from specforge_kimi.errors import KimiInputError
from specforge_kimi.plan.devices import node_gpus


def test_default_is_the_first_devices():
    assert node_gpus(2, {}) == "0,1"
    assert node_gpus(1, {"CUDA_VISIBLE_DEVICES": ""}) == "0"


def test_takes_the_listed_devices_in_order():
    assert node_gpus(1, {"CUDA_VISIBLE_DEVICES": "1"}) == "1"
    assert node_gpus(2, {"CUDA_VISIBLE_DEVICES": "3, 2,7"}) == "3,2"


def test_too_few_listed_devices_is_a_clear_error():
    with pytest.raises(KimiInputError, match="lists 1 device.*needs 2"):
        node_gpus(2, {"CUDA_VISIBLE_DEVICES": "1"})
