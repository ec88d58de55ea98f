"""Model configuration (runtime/model/config.py): presets, the streaming geometry derived from a
config, and a config read back from its JSON form (a checkpoint's c2w_config.json)."""
import json

import pytest

from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.config import FULL, TINY, ModelConfig, preset


def test_streaming_geometry_is_the_same_for_both_presets():
    """480 samples per mel frame (hop 4 x 8 x 5 x 3), 2 mel frames per token, 8 cached mel frames
    = 3840 cached samples: tiny keeps every streaming constant of the full model."""
    for cfg in (FULL, TINY):
        assert (cfg.hift.samples_per_frame, cfg.up_rate, cfg.hift_mel_cache, cfg.hift_source_cache) == (480, 2, 8, 3840)
        assert (cfg.n_timesteps, cfg.dit.heads, cfg.dit.head_dim) == (10, 8, 64)
    assert (FULL.encoder.d_k, TINY.encoder.d_k) == (64, 32)


def test_a_config_round_trips_through_json():
    for cfg in (FULL, TINY):
        back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))      # lists come back as tuples
        assert back == cfg and back.to_json() == cfg.to_json()
    assert json.loads(TINY.to_json())["hift"]["upsample_rates"] == [8, 5, 3]
    assert TINY.to_json() != FULL.to_json() and " " not in TINY.to_json()      # canonical: no spaces, sorted keys


@pytest.mark.parametrize("edit, match", [
    ({"colour": "red"}, r"^model config: received unknown keys \['colour'\]; expected keys among \["),
    ({"hift": {"base_channels": 32, "hops": 4}}, r"^model config 'hift': received unknown keys \['hops'\]"),
])
def test_unknown_keys_are_refused_by_name(edit, match):
    with pytest.raises(C2WUserError, match=match):
        ModelConfig.from_dict({**TINY.to_dict(), **edit})


def test_preset_by_name():
    assert preset("tiny") is TINY and preset("full") is FULL
    with pytest.raises(C2WUserError, match=r"model preset: received 'small'; expected one of \['full', 'tiny'\]"):
        preset("small")
