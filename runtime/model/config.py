"""Model configuration: one frozen dataclass with presets `full` (MiniCPM-o 4.5 Code2Wav) and `tiny`.

`tiny` keeps the architecture and every streaming constant (25 Hz tokens, 50 Hz mel, 480 samples per
mel frame, 10 Euler steps, the DiT head layout 8 x 64 that the step-audio2 oracle hard-codes) and
shrinks widths and depths so the whole pipeline runs in seconds on 2 CPU cores.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from c2w.runtime.errors import C2WUserError


@dataclass(frozen=True)
class EncoderConfig:
    width: int = 512            # token embedding size == conformer width
    heads: int = 8
    ffn: int = 2048
    blocks: int = 6             # conformer blocks before the x2 upsample
    up_blocks: int = 4          # conformer blocks after it
    up_stride: int = 2
    pre_lookahead: int = 3      # tokens of right context the lookahead conv consumes

    @property
    def d_k(self) -> int:
        return self.width // self.heads


@dataclass(frozen=True)
class DiTConfig:
    hidden: int = 512
    depth: int = 16
    heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0
    in_channels: int = 320      # x, mu, spk, cond: 4 x 80
    freq_embed: int = 256       # sinusoidal timestep embedding size


@dataclass(frozen=True)
class HiftConfig:
    base_channels: int = 512
    f0_channels: int = 512      # f0 predictor conv width
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernels: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop: int = 4
    resblock_kernels: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernels: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99

    @property
    def samples_per_frame(self) -> int:
        n = self.hop
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class ModelConfig:
    name: str = "full"
    vocab_size: int = 6561
    silence_token: int = 4218
    spk_embed_dim: int = 192
    mel_bins: int = 80
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    noise_frames: int = 30000   # CFM noise table length (600 s at 50 Hz)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    hift: HiftConfig = field(default_factory=HiftConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): the config part of the model digest."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        subs = {"encoder": EncoderConfig, "dit": DiTConfig, "hift": HiftConfig}
        kw = {}
        for k, v in d.items():
            if k in subs:
                kw[k] = _build(subs[k], v, f"model config '{k}'")
            else:
                kw[k] = v
        return _build(cls, kw, "model config")

    # Streaming geometry used everywhere (encoder output frames per token, HiFT caches).
    @property
    def up_rate(self) -> int:
        return self.encoder.up_stride

    @property
    def hift_mel_cache(self) -> int:
        return 8                                        # 160 ms of mel context

    @property
    def hift_source_cache(self) -> int:
        return self.hift_mel_cache * self.hift.samples_per_frame   # 3840 samples


def _tuplify(v):
    return tuple(_tuplify(x) for x in v) if isinstance(v, (list, tuple)) else v


def _build(cls, d: dict, what: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise C2WUserError(what, f"unknown keys {unknown}", f"keys among {sorted(names)}")
    return cls(**{k: _tuplify(v) for k, v in d.items()})


FULL = ModelConfig()
TINY = ModelConfig(
    name="tiny",
    encoder=EncoderConfig(width=128, heads=4, ffn=256, blocks=2, up_blocks=1),
    dit=DiTConfig(depth=2),     # width stays 512 / 8 x 64: the oracle's streaming CFM hard-codes it
    hift=HiftConfig(base_channels=32, f0_channels=32),
)
PRESETS = {"full": FULL, "tiny": TINY}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise C2WUserError("model preset", repr(name), f"one of {sorted(PRESETS)}")
    return PRESETS[name]
