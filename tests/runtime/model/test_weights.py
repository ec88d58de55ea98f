"""Model loading: random specs, checkpoint directories, digests, bad checkpoints."""
import json

import pytest
import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.weights import load_model


def test_random_is_seeded_and_digest_tracks_weights():
    a, b, c = load_model("random:tiny"), load_model("random:tiny"), load_model("random:tiny:1")
    assert a.digest == b.digest != c.digest
    assert torch.equal(a.flow.noise, b.flow.noise) and a.flow.noise.shape == (1, 80, 30000)
    w = a.flow.decoder.estimator.final_layer.linear.weight
    assert w.abs().sum() > 0          # unlike upstream's init, the velocity is not identically zero


def test_checkpoint_dir_round_trip(tmp_path):
    m = load_model("random:tiny:3")
    torch.save(m.flow.state_dict(), tmp_path / "flow.pt")
    torch.save({"generator." + k: v for k, v in m.hift.state_dict().items()}, tmp_path / "hift.pt")
    (tmp_path / "c2w_config.json").write_text(json.dumps(m.cfg.to_dict()))
    assert load_model(str(tmp_path)).digest == m.digest


def test_checkpoint_for_another_config_lists_the_mismatches(tmp_path):
    m = load_model("random:tiny")
    torch.save(m.flow.state_dict(), tmp_path / "flow.pt")
    torch.save(m.hift.state_dict(), tmp_path / "hift.pt")
    # no c2w_config.json: the full preset is assumed, and the tiny tensors do not fit it
    with pytest.raises(C2WUserError, match=r"flow.pt': received \d+ missing, 0 unexpected, \d+ mismatched: missing keys \[.*\.\.\. \d+ more\].*shape mismatches \(received vs expected\)"
                                           r".*encoder.embed.out.0.weight: \(128, 128\) vs \(512, 512\)"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("spec,message", [
    ("random:huge", r"model preset: received 'huge'; expected one of \['full', 'tiny'\]"),
    ("random:tiny:x", r"model spec: received 'random:tiny:x'"),
    ("/no/such/dir", r"model spec: received '/no/such/dir'; expected 'random:full', 'random:tiny' or a checkpoint"),
])
def test_bad_model_specs(spec, message):
    with pytest.raises(C2WUserError, match=message):
        load_model(spec)


def test_missing_checkpoint_file(tmp_path):
    with pytest.raises(C2WUserError, match=r"checkpoint file: received '.*flow.pt' does not exist"):
        load_model(str(tmp_path))
