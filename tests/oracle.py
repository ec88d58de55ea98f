"""The step-audio2 reference modules, built from our configs: one place for the tests that compare
against them (model/test_encoder.py, model/test_dit.py, model/test_hift.py, test_stream.py).

step-audio2 is imported when a builder is called, so importing this module needs nothing; a test
module that uses it skips itself first (`pytest.importorskip`) when step-audio2 is not installed.
"""
from __future__ import annotations

import types

import torch

from c2w.runtime.model.config import DiTConfig, EncoderConfig, HiftConfig, ModelConfig


def oracle_encoder(cfg: EncoderConfig) -> torch.nn.Module:
    """UpsampleConformerEncoderV2 shaped as `cfg`, without dropout. Its `forward_chunk` is the plain
    function: upstream wraps it in torch.compile(backend="eager"), same maths, but dynamo
    re-traces it for every new chunk shape (~95 % of an oracle session's time)."""
    from cosyvoice2.transformer.upsample_encoder_v2 import UpsampleConformerEncoderV2
    enc = UpsampleConformerEncoderV2(
        input_size=cfg.width, output_size=cfg.width, attention_heads=cfg.heads, linear_units=cfg.ffn,
        num_blocks=cfg.blocks, num_up_blocks=cfg.up_blocks, up_stride=cfg.up_stride,
        up_scale_factor=cfg.up_stride, pre_lookahead_len=cfg.pre_lookahead,
        dropout_rate=0.0, positional_dropout_rate=0.0, attention_dropout_rate=0.0)
    enc.forward_chunk = types.MethodType(type(enc).forward_chunk.__wrapped__, enc)
    return enc.eval()


def oracle_dit(cfg: DiTConfig, mel_bins: int) -> torch.nn.Module:
    """The reference velocity estimator; its state-dict keys are ours (runtime/model/dit.py)."""
    from cosyvoice2.flow.decoder_dit import DiT
    return DiT(in_channels=cfg.in_channels, out_channels=mel_bins, mlp_ratio=cfg.mlp_ratio, depth=cfg.depth,
               num_heads=cfg.heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden).eval()


def oracle_cfm(estimator: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """The reference Euler solve with guidance around `estimator`."""
    from cosyvoice2.flow.flow_matching import CausalConditionalCFM
    return CausalConditionalCFM(estimator=estimator, inference_cfg_rate=cfg.cfg_rate).eval()


def oracle_flow(cfg: ModelConfig) -> torch.nn.Module:
    """The reference token-to-mel model (embedding, encoder, CFM): loads our flow.pt as it is."""
    from cosyvoice2.flow.flow import CausalMaskedDiffWithXvec
    e = cfg.encoder
    return CausalMaskedDiffWithXvec(
        input_size=e.width, output_size=cfg.mel_bins, spk_embed_dim=cfg.spk_embed_dim, vocab_size=cfg.vocab_size,
        encoder=oracle_encoder(e), decoder=oracle_cfm(oracle_dit(cfg.dit, cfg.mel_bins), cfg)).eval()


def oracle_hift(cfg: HiftConfig) -> torch.nn.Module:
    """The reference HiFT generator; its weights are in the parametrized weight-norm layout of
    upstream's hift.pt (runtime.model.hift.hift_state_dict_from_checkpoint folds them)."""
    from flashcosyvoice.modules.hifigan import ConvRNNF0Predictor, HiFTGenerator
    return HiFTGenerator(base_channels=cfg.base_channels, nb_harmonics=cfg.nb_harmonics,
                         f0_predictor=ConvRNNF0Predictor(cond_channels=cfg.f0_channels)).eval()


def sine_noise(seed: int, batch: int, cfg: HiftConfig, frames: int) -> torch.Tensor:
    """The noise the reference HiFT's source draws after `torch.manual_seed(seed)`, as (B, T, H)
    contiguous: it draws the initial phases `rand(B, H)`, then `randn_like` of a (B, T, H) view of a
    (B, H, T) tensor, which fills in (B, H, T) memory order. Leaves the global RNG advanced."""
    harmonics = cfg.nb_harmonics + 1
    torch.manual_seed(seed)
    torch.rand(batch, harmonics)
    shape = (batch, harmonics, frames * cfg.samples_per_frame)
    return torch.randn_like(torch.empty(shape).transpose(1, 2)).contiguous()
