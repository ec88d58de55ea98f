"""Streaming Code2Wav for a batch of B streams with equal shapes (upstream token2wav semantics).

    driver = StreamDriver(model, runner)          # runner: EagerRunner or an EngineCache
    state = driver.setup(prompt_tokens, prompt_mel, spk)
    pcm = driver.step(state, tokens)              # (B, samples) float32 in [-0.99, 0.99]
    pcm = driver.step(state, tail_tokens, last=True)

Per chunk: flow encoder -> CFM solve -> HiFT, each through `runner.run(ShapeKey, inputs, trim)`, so
the same driver serves eager and engines. Cache handling lives here: the CFM noise slice at the
estimator cache length, which caches are trimmed to P + 100 frames (estimator always, conformer
optionally; the runner returns them trimmed, runtime.trim; the estimator's goes in as a
runtime.ring.RingCache and may come back as one, its frames where an engine wrote them), and HiFT's 8-frame mel / 3840-sample
source caches with the Hamming cross-fade.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from c2w.runtime.errors import C2WUserError, check_shape
from c2w.runtime.ring import RingCache
from c2w.runtime.trim import CacheTrim
from c2w.runtime.units import DTYPE_NAMES, SPECS, ShapeKey


@dataclass
class StreamState:
    """Everything one batch of streams carries between chunks (all tensors on the model's device).

    `StreamDriver.step` replaces these fields, and an in-place engine writes the next chunk's
    frames into free slots of the estimator cache's buffer when it is a RingCache: to run two
    chunks from one state, give the second its own copy of the caches (RingCache.clone keeps
    the layout)."""
    prompt_frames: int                 # P
    spk: torch.Tensor                  # (B, 192) raw speaker embedding
    conformer_cnn: torch.Tensor        # (B, width, 6)
    conformer_att: torch.Tensor        # (blocks + up_blocks, B, heads, C, 2 d_k)
    estimator_cnn: torch.Tensor        # (steps, depth, 2B, 2 hidden, 2)
    estimator_att: torch.Tensor | RingCache   # (steps, depth, 2B, heads, L, 2 head_dim); a ring: runtime.ring
    hift_mel: torch.Tensor             # (B, 80, 0 or 8)
    hift_source: torch.Tensor          # (B, 1, 0 or 3840)
    hift_speech: torch.Tensor          # (B, 0 or 3840)
    generators: list                   # one torch.Generator per row: HiFT excitation noise
    chunks: int = 0
    finished: bool = False

    @property
    def batch(self) -> int:
        return self.spk.shape[0]


def as_tensor(name: str, x) -> torch.Tensor:
    """A torch tensor or a numpy array (converted without a copy where possible); anything else is
    a user error."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise C2WUserError(f"'{name}'", f"a {type(x).__name__}", "a torch.Tensor or a numpy array")


def check_tokens(cfg, name: str, tokens, batch: int | None, min_len: int) -> torch.Tensor:
    """tokens: (B, N) integer ids in [0, vocab); returns them as a tensor."""
    tokens = as_tensor(name, tokens)
    if tokens.dtype not in (torch.int32, torch.int64):
        raise C2WUserError(f"tensor '{name}'", f"dtype {tokens.dtype}", "int64 (or int32) token ids")
    if tokens.dim() != 2 or (batch is not None and tokens.shape[0] != batch) or tokens.shape[1] < min_len:
        raise C2WUserError(f"tensor '{name}'", f"shape {tuple(tokens.shape)}",
                           f"(B{'=' + str(batch) if batch else ''}, N >= {min_len})")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise C2WUserError(f"tensor '{name}'", f"token ids in [{lo}, {hi}]", f"ids in [0, {cfg.vocab_size - 1}]")
    return tokens


def check_features(name: str, x, shape: tuple) -> torch.Tensor:
    """A float tensor (or numpy array) of exactly `shape` with only finite values."""
    x = as_tensor(name, x)
    check_shape(name, x, shape)
    if not x.is_floating_point():
        raise C2WUserError(f"tensor '{name}'", f"dtype {x.dtype}", "a floating-point dtype")
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise C2WUserError(f"tensor '{name}'", f"{bad} NaN or infinite values", "finite values only",
                           "Check the upstream feature extraction (mel, speaker embedding).")
    return x


def draw_noise(generators: list, shape: tuple, device) -> torch.Tensor:
    """(B, ...) standard normal noise, row i drawn from generators[i] alone: a stream's excitation
    does not depend on which streams it is batched with."""
    rows = [torch.randn((1,) + tuple(shape[1:]), generator=g, device=device) for g in generators]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


@dataclass
class StreamDriver:
    model: object                                   # runtime.model.weights.Code2Wav
    runner: object                                  # .run(ShapeKey, inputs, trim) -> outputs
    trim_conformer: bool = False                    # MiniCPM-o trims it too; step-audio2 1.0 does not
    seed: int = 0
    _window: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ helpers
    @property
    def cfg(self):
        return self.model.cfg

    def _dtype(self, component: str) -> torch.dtype:
        return self.model.component_dtype(component)

    def _key(self, component: str, **dims: int) -> ShapeKey:
        return ShapeKey.named(component, DTYPE_NAMES[self._dtype(component)], **dims)

    def _fade_window(self, device) -> torch.Tensor:
        n = 2 * self.cfg.hift_source_cache
        if device not in self._window:
            self._window[device] = torch.hamming_window(n, periodic=False, dtype=torch.float64).float().to(device)
        return self._window[device]

    def _device(self):
        return next(self.model.flow.parameters()).device

    # ------------------------------------------------------------------ prompt setup
    @torch.inference_mode()
    def setup(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor, spk: torch.Tensor,
              lookahead: torch.Tensor | None = None) -> StreamState:
        """prompt_tokens: (B, P/2) int; prompt_mel: (B, P, 80) float; spk: (B, 192) float.

        lookahead: (B, 3) tokens appended as the prompt's lookahead; upstream passes the prompt's
        first 3 tokens, which is the default. Runs the encoder over the prompt tokens with empty
        caches (key C=0) and the CFM over the prompt frames with the prompt's mel as `cond` (key
        L=0), through the runner like any chunk: engines where the directory has these keys.
        """
        cfg, dev = self.cfg, self._device()
        prompt_tokens = check_tokens(cfg, "prompt_tokens", prompt_tokens, None, 1)
        B, n_tok = prompt_tokens.shape
        P = n_tok * cfg.up_rate
        prompt_mel = check_features("prompt_mel", prompt_mel, (B, P, cfg.mel_bins))
        spk = check_features("spk", spk, (B, cfg.spk_embed_dim))
        la = prompt_tokens[:, : cfg.encoder.pre_lookahead] if lookahead is None else lookahead
        tokens = torch.cat([prompt_tokens, la], 1).to(dev, torch.int64)
        key = self._key("flow_encoder", B=B, N=tokens.shape[1], C=0, last=0)
        mu, ccnn, catt = self.runner.run(key, [tokens] + self._empty_caches(key, dev))
        key = self._key("cfm", B=B, T=P, L=0)
        spk = spk.to(dev, torch.float32)
        x0 = self.model.flow.noise[:, :, :P].expand(B, -1, -1).to(dev)
        cond = prompt_mel.to(dev, torch.float32).transpose(1, 2)
        _, est_cnn, est_att = self.runner.run(key, [mu, spk, cond, x0] + self._empty_caches(key, dev))
        gens = [torch.Generator(device=dev).manual_seed(self.seed) for _ in range(B)]
        empty = torch.zeros(B, 0, device=dev)
        return StreamState(P, spk, ccnn, catt, est_cnn, est_att,
                           hift_mel=torch.zeros(B, cfg.mel_bins, 0, device=dev),
                           hift_source=torch.zeros(B, 1, 0, device=dev), hift_speech=empty, generators=gens)

    def _empty_caches(self, key: ShapeKey, device) -> list[torch.Tensor]:
        """The two cache inputs (cnn, att: the last two of the encoder's and the CFM's inputs) of
        a set-up key: zeros, the attention cache with no frames (C or L = 0)."""
        spec = SPECS[key.component]
        shapes, dtypes = spec.input_shapes(self.cfg, key)[-2:], spec.input_dtypes(key)[-2:]
        return [torch.zeros(shape, dtype=dt, device=device) for shape, dt in zip(shapes, dtypes)]

    # ------------------------------------------------------------------ one chunk
    @torch.inference_mode()
    def step(self, state: StreamState, tokens: torch.Tensor, last: bool = False,
             hift_noise: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, N) int; non-final chunks end with 3 lookahead tokens (the next chunk
        starts with them), so they yield 2 (N - 3) mel frames; the last chunk yields 2 N.

        hift_noise: optional (B, 480 F, 9) excitation noise (tests pass the oracle's draw);
        by default row i is drawn from the state's generators[i].
        Returns (B, samples) float32 PCM: 480 per mel frame, less the 3840 held back for the
        cross-fade on non-final chunks (all of it on the last).
        """
        if state.finished:
            raise C2WUserError("stream state", "a state whose last chunk was already run",
                               "a live state", "Call setup() again for a new utterance.")
        cfg, B, dev = self.cfg, state.batch, self._device()
        la = cfg.encoder.pre_lookahead
        tokens = check_tokens(cfg, "tokens", tokens, B, 1 if last else la + 1).to(dev, torch.int64)

        # flow encoder
        trim = CacheTrim(state.prompt_frames)
        C = state.conformer_att.shape[3]
        mu, state.conformer_cnn, state.conformer_att = self.runner.run(
            self._key("flow_encoder", B=B, N=tokens.shape[1], C=C, last=int(last)),
            [tokens, state.conformer_cnn, state.conformer_att], trim if self.trim_conformer else None)
        T = mu.shape[2]

        # CFM
        L = state.estimator_att.shape[4]
        if L + T > cfg.noise_frames:
            raise C2WUserError("estimator cache", f"{L + T} frames", f"at most {cfg.noise_frames} (the noise table)")
        x0 = self.model.flow.noise[:, :, L:L + T].expand(B, -1, -1).to(dev)
        cond = torch.zeros(B, cfg.mel_bins, T, device=dev)
        # as a ring, so that an engine that updates the cache in place keeps it where it is
        mel, state.estimator_cnn, state.estimator_att = self.runner.run(
            self._key("cfm", B=B, T=T, L=L),
            [mu, state.spk, cond, x0, state.estimator_cnn, RingCache.of(state.estimator_att)], trim)

        # HiFT
        pcm = self._vocode(state, mel, last, hift_noise)
        state.chunks += 1
        state.finished = last
        return pcm

    def _vocode(self, state: StreamState, mel: torch.Tensor, last: bool, noise) -> torch.Tensor:
        cfg, B = self.cfg, state.batch
        spf, n_src = cfg.hift.samples_per_frame, cfg.hift_source_cache
        mel = torch.cat([state.hift_mel, mel], dim=2)
        F_, S = mel.shape[2], state.hift_source.shape[2]
        if noise is None:
            noise = draw_noise(state.generators, (B, F_ * spf, cfg.hift.nb_harmonics + 1), mel.device)
        inputs = [mel, noise] + ([state.hift_source] if S else [])
        speech, source = self.runner.run(self._key("hift", B=B, F=F_, S=S), inputs)
        if state.hift_speech.shape[1]:
            w = self._fade_window(speech.device)
            head = speech[:, :n_src] * w[:n_src] + state.hift_speech * w[n_src:]
            speech = torch.cat([head, speech[:, n_src:]], dim=1)
        state.hift_mel = mel[:, :, -cfg.hift_mel_cache:]
        state.hift_source = source[:, :, -n_src:]
        state.hift_speech = speech[:, -n_src:]
        return speech if last else speech[:, :-n_src]
