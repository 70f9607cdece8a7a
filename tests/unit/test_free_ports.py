"""Ports for servers we start: free, distinct, and at most 55535 (SGLang 0.5.14 serves gRPC on
``--port + 10000`` and refuses to start when that passes 65535); recipes enforce the same bound."""

import copy
from pathlib import Path

import pytest
import yaml

from specforge_kimi.run.services import MAX_SERVER_PORT, free_ports

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp2-h200x2.yaml"


def test_free_ports_are_distinct_and_bounded():
    ports = free_ports(200)  # enough draws that the ephemeral range (up to 60999) shows up
    assert len(set(ports)) == 200
    assert all(0 < p <= MAX_SERVER_PORT for p in ports)


def test_recipe_rejects_a_server_port_sglang_cannot_use():
    from pydantic import ValidationError

    from specforge_kimi.plan.recipes import Recipe

    raw = copy.deepcopy(yaml.safe_load(RECIPE.read_text()))
    raw["server"]["port"] = 60000
    with pytest.raises(ValidationError, match="less than or equal to 55535"):
        Recipe.model_validate(raw)
    raw["server"]["port"] = 55535
    Recipe.model_validate(raw)
