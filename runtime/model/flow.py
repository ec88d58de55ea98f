"""The token-to-mel half of Code2Wav: token embedding, Conformer encoder, CFM solve.

`FlowModel.state_dict()` has exactly upstream `flow.pt`'s keys. The CFM noise table is not in
flow.pt upstream (a non-persistent `torch.randn` buffer, different in every process); here it is a
seeded table owned by the model, so eager, ONNX Runtime, AOTInductor and TensorRT all use the
same x0 values.
"""
from __future__ import annotations

import torch
from torch import nn

from c2w.runtime.model.config import ModelConfig
from c2w.runtime.model.dit import DiT, CFMSolver
from c2w.runtime.model.encoder import ConformerEncoder

NOISE_SEED = 1986


def cfm_noise_table(cfg: ModelConfig, seed: int = NOISE_SEED) -> torch.Tensor:
    """(1, mel_bins, noise_frames) float32 standard normal from a CPU generator (platform-stable)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(1, cfg.mel_bins, cfg.noise_frames, generator=g, dtype=torch.float32)


class _Decoder(nn.Module):
    """Holds the estimator under the upstream name `decoder.estimator`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.estimator = DiT(cfg.dit, cfg.mel_bins)


class FlowModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.encoder.width)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.mel_bins)
        self.encoder = ConformerEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.width, cfg.mel_bins)
        self.decoder = _Decoder(cfg)
        self.register_buffer("noise", cfm_noise_table(cfg), persistent=False)

    def solver(self) -> CFMSolver:
        return CFMSolver(self.decoder.estimator, self.spk_embed_affine_layer, self.cfg)

    def encode(self, tokens: torch.Tensor, cnn_cache, att_cache, last_chunk: bool):
        """tokens: (B, N) int64 incl. 3 lookahead tokens -> mu (B, 80, T), new caches.

        Caches None = prompt setup (no history). T = 2 (N - 3), or 2 N when last_chunk.
        """
        xs = self.input_embedding(tokens)
        h, cnn, att = self.encoder.forward_chunk(xs, cnn_cache, att_cache, last_chunk)
        return self.encoder_proj(h).transpose(1, 2), cnn, att
