"""Reference hooks on the unwrapped K2.5 tree return exactly HF's output_hidden_states."""

import pytest
import torch
from torch import nn

from specforge_kimi.errors import KimiInputError
from specforge_kimi.targets.capture import capture, text_decoder
from specforge_kimi.targets.checkpoint import load_text_model
from specforge_kimi.targets.layer_ids import AuxLayers


class K25Wrapper(nn.Module):
    """K2.5's module tree shape: the DeepSeek-V3 causal LM lives at ``language_model``."""

    def __init__(self, lm):
        super().__init__()
        self.language_model = lm
        self.vision_tower = nn.Identity()


@pytest.fixture(scope="module")
def wrapped(tiny_dir):
    return K25Wrapper(load_text_model(tiny_dir))


def test_unwraps_to_language_model_layers(wrapped):
    assert text_decoder(wrapped) is wrapped.language_model.model


@pytest.mark.parametrize("specforge_ids", [[1, 2, 3], [2, 3, 4], [1, 3, 4]])
def test_hooks_equal_hf_hidden_states(wrapped, specforge_ids):
    torch.manual_seed(0)
    ids = torch.randint(0, 163840, (2, 23))
    aux = AuxLayers.from_specforge(specforge_ids, 6)
    cap = capture(wrapped, ids, aux)
    with torch.no_grad():
        hs = wrapped.language_model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    assert len(hs) == 7  # embedding + one per layer; the last is post-norm
    for chunk, p in zip(cap.aux.chunk(3, dim=-1), aux.hf_indices(), strict=False):
        torch.testing.assert_close(chunk, hs[p], rtol=0, atol=0)
    torch.testing.assert_close(cap.last, hs[-1], rtol=0, atol=0)
    assert cap.aux.shape == (2, 23, 3 * 64)


def test_captures_residual_entering_moe_layer_not_its_output(wrapped):
    ids = torch.randint(0, 163840, (1, 9))
    aux = AuxLayers.from_hf([2, 3, 4], 6)
    cap = capture(wrapped, ids, aux)
    with torch.no_grad():
        hs = wrapped.language_model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    # layer 2 is MoE: position 3 (its output) must differ from position 2 (its input)
    assert not torch.allclose(hs[2], hs[3])
    torch.testing.assert_close(cap.aux[..., :64], hs[2], rtol=0, atol=0)
    # and the last hidden state is post-norm, not the raw residual after the last layer
    assert (cap.last.pow(2).mean(-1).sqrt() - 1).abs().max() < 0.5


def test_aux_for_other_depth_rejected(wrapped):
    with pytest.raises(KimiInputError, match="validated for 61 layers"):
        capture(wrapped, torch.zeros(1, 3, dtype=torch.long), AuxLayers.from_specforge([1, 29, 57], 61))
