"""The ShapeKeys a stream's calls hit, simulated the way runtime.stream drives a stream.

Prompt P frames, then chunks of N tokens (2 (N - 3) mel frames each); the estimator cache goes
P -> P+T -> ... and is trimmed to P + 100 (the conformer cache too when `trim_conformer`); HiFT
sees T frames with no cache first, then T + 8 frames with the 3840-sample source cache; a final
chunk of n tokens (no lookahead) gives 2n frames. The planner (`stream_keys`: the schedule's
sweep) and the traffic model (exporter/traffic.py: whole sessions) both walk streams here.
"""
from __future__ import annotations

from c2w.runtime.model.config import ModelConfig
from c2w.runtime.trim import KEEP_RECENT
from c2w.runtime.units import ShapeKey


def _trim(n: int, prompt: int) -> int:
    return n if n <= prompt + KEEP_RECENT else prompt + KEEP_RECENT


def setup_keys(cfg: ModelConfig, profile, B: int) -> list[ShapeKey]:
    """The prompt set-up: encoder over P/2 tokens + 3 lookahead with empty caches, CFM over P frames."""
    P, prec = profile.schedule.prompt_frames, profile.precision
    return [ShapeKey.named("flow_encoder", prec.flow_encoder, B=B, N=P // cfg.up_rate + cfg.encoder.pre_lookahead,
                           C=0, last=0),
            ShapeKey.named("cfm", prec.cfm, B=B, T=P, L=0)]


def chunk_keys(cfg: ModelConfig, profile, B: int, N: int, chunks: int) -> tuple[list[list[ShapeKey]], int, int]:
    """Keys of `chunks` non-final chunks of N tokens, one list (encoder, CFM, HiFT) per chunk, and
    the conformer and estimator cache lengths (C, L) they leave."""
    s, prec = profile.schedule, profile.precision
    T = cfg.up_rate * (N - cfg.encoder.pre_lookahead)
    C = L = s.prompt_frames
    out = []
    for i in range(chunks):
        hift = dict(F=T, S=0) if i == 0 else dict(F=T + cfg.hift_mel_cache, S=cfg.hift_source_cache)
        out.append([ShapeKey.named("flow_encoder", prec.flow_encoder, B=B, N=N, C=C, last=0),
                    ShapeKey.named("cfm", prec.cfm, B=B, T=T, L=L),
                    ShapeKey.named("hift", prec.hift, B=B, **hift)])
        C = _trim(C + T, s.prompt_frames) if s.trim_conformer else C + T
        L = _trim(L + T, s.prompt_frames)
    return out, C, L


def tail_keys(cfg: ModelConfig, profile, B: int, n: int, C: int, L: int) -> list[ShapeKey]:
    """The final chunk of n tokens after caches of lengths C (conformer) and L (estimator)."""
    prec = profile.precision
    T = cfg.up_rate * n
    return [ShapeKey.named("flow_encoder", prec.flow_encoder, B=B, N=n, C=C, last=1),
            ShapeKey.named("cfm", prec.cfm, B=B, T=T, L=L),
            ShapeKey.named("hift", prec.hift, B=B, F=T + cfg.hift_mel_cache, S=cfg.hift_source_cache)]


def stream_keys(cfg: ModelConfig, profile) -> list[tuple[str, ShapeKey]]:
    """(category, key) for every chunk of every (batch, chunk size) stream of the schedule, in
    stream order: set-up, `max_chunks` chunks, each listed tail, then the profile's extra keys."""
    s = profile.schedule
    out = []
    for B in s.batch_sizes:
        if s.setup_keys:
            out += [("setup", k) for k in setup_keys(cfg, profile, B)]
        for N in s.chunk_tokens:
            chunks, C, L = chunk_keys(cfg, profile, B, N, s.max_chunks)
            for i, keys in enumerate(chunks):
                out += [("first" if i == 0 else "steady", k) for k in keys]
            for n in s.tail_tokens:
                out += [("tail", k) for k in tail_keys(cfg, profile, B, n, C, L)]
    out += [("extra", k) for k in profile.extra_keys]
    return out
