"""The token-to-mel half (runtime/model/flow.py): the seeded CFM noise table, upstream flow.pt's
parameter names, and the mel frames a chunk of tokens encodes to."""
import pytest
import torch

from c2w.runtime.model.config import TINY
from c2w.runtime.model.flow import NOISE_SEED, FlowModel, cfm_noise_table


@pytest.fixture(scope="module")
def flow():
    torch.manual_seed(0)
    return FlowModel(TINY).eval()


def test_the_noise_table_is_seeded_and_not_saved(flow):
    """The same standard-normal table in every process (a CPU generator), owned by the model but
    not in its state dict, as upstream's flow.pt has none."""
    table = cfm_noise_table(TINY)
    assert table.shape == (1, 80, 30000) and table.dtype == torch.float32
    assert torch.equal(table, cfm_noise_table(TINY, NOISE_SEED)) and not torch.equal(table, cfm_noise_table(TINY, 1))
    assert abs(table.mean().item()) < 0.01 and abs(table.std().item() - 1) < 0.01
    assert torch.equal(flow.noise, table) and "noise" not in flow.state_dict()


def test_parameter_names_are_upstream_flow_pts(flow):
    names = {k.split(".")[0] for k in flow.state_dict()}
    assert names == {"input_embedding", "spk_embed_affine_layer", "encoder", "encoder_proj", "decoder"}
    assert any(k.startswith("decoder.estimator.") for k in flow.state_dict())


@pytest.mark.parametrize("n, last, frames", [(28, False, 50), (28, True, 56), (13, True, 26)])
def test_a_chunk_of_n_tokens_encodes_to_2_mel_frames_per_token_less_the_lookahead(flow, n, last, frames):
    tokens = torch.randint(0, TINY.vocab_size, (2, n), generator=torch.Generator().manual_seed(n))
    with torch.inference_mode():
        mu, cnn, att = flow.encode(tokens, None, None, last)
    assert mu.shape == (2, 80, frames) and bool(torch.isfinite(mu).all())
    assert att.shape[1] == 2 and cnn.shape[0] == 2
