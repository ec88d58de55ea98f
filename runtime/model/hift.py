"""HiFT vocoder (mel -> 24 kHz waveform), rewritten to export cleanly.

Same function and state-dict layout as the step-audio2 / CosyVoice2 `HiFTGenerator` once its weight
norm is folded, with these changes so that every backend computes the same thing:

- The NSF source's Gaussian noise is an input (`noise`), not a `randn_like` inside the graph.
- The random initial phase upstream adds to the harmonics is dropped: it is added at time sample 0
  only, and the 1/480 linear decimation that follows reads samples 480*i + 239 and 480*i + 240 of
  every frame i, never sample 0, so it cannot change the output (tests/runtime/model/test_hift.py
  checks this on the oracle with different phases).
- STFT / ISTFT are real-valued convolutions (no complex tensors, no DFT/ScatterND in ONNX).
- The harmonic phase arithmetic reproduces torch CPU's float32 results bit for bit using plain
  float32 ops (see NsfSource): on CPU the source equals the oracle's exactly.

Precision note. The reference accumulates harmonic phases in float32 up to ~1e4 rad, where one
rounding is ~1e-3 rad. Its output is therefore ill-conditioned in f0 at the ulp level: an f0 one ulp
off (another conv algorithm, batch size or backend) moves the source by ~5e-5 and the speech by
~5e-4 rel-L2 (random weights). Compare backends with that in mind, and keep TF32 away from the f0
predictor: a 1e-3 relative f0 error there shifts late harmonics by radians.

Every convolution holds the folded weight (state-dict compatible with nn.Conv1d /
nn.ConvTranspose1d); use `hift_state_dict_from_checkpoint` to turn a raw `hift.pt` into this layout.

Precision policies (`HiftVocoder.set_precision`, docs/numerics.md):
- float32: everything float32 (what the step-audio2 oracle parity holds bit for bit on CPU).
- float16: the convolutions of the decoder's conv stack (`CONV_STACK`) in float16, everything else
  float32. Each of those convolutions casts its float32 input to float16 and its float16 output
  back to float32 (`CastingConv1d`), so Snake, leaky ReLU and the residual sums stay float32; the
  f0 predictor, the NSF source, the STFT and the ISTFT are float32 (TF32 off: runtime.precision).
  Measured on the H200 at B=32 F=158: 48.6 dB SNR against float32 (TF32: 38.7 dB).
- bfloat16 is refused: the same scheme in bfloat16 measured 27.7-29.7 dB (REFUSED_DTYPES).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from c2w.runtime.errors import C2WUserError, check_shape, state_dict_mismatch
from c2w.runtime.model.config import HiftConfig
from c2w.runtime.model.dit import tap_major_, triton_kernels_for

MEL_BINS = 80

# The decoder's conv stack: the submodules whose convolutions a reduced-precision policy runs in
# its dtype. Not the f0 predictor (its f0 sets the NSF phases, ill-conditioned: see above) and not
# the STFT / ISTFT (fixed kernels, float32 buffers).
CONV_STACK = ("conv_pre", "ups", "source_downs", "source_resblocks", "resblocks", "conv_post")
PRECISIONS = (torch.float32, torch.float16)
# what HiFT's policy refuses and why (measured: benchmarks/h200/README.md, hift_precision.json)
REFUSED_DTYPES = {
    torch.bfloat16: "bfloat16 convolutions measured 27.7-29.7 dB SNR against float32 at B=32 F=158 on the "
                    "H200 (float16: 48.6 dB), below the fidelity bar (HiFT alone >= 44.2 dB for a 38.3 dB "
                    "session to lose at most 1 dB); docs/numerics.md",
}


def _channels_last_convs() -> bool:
    """Whether reduced-precision convolutions run as 2-D channels-last ones: outside an ONNX export
    (TensorRT and ONNX Runtime choose their own layouts)."""
    return not torch.onnx.is_in_onnx_export()


def _channels_last_2d(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, C, T) -> (B, C, 1, T) in `dtype` and channels-last memory: the cast and the layout in one copy."""
    return x.unsqueeze(2).to(dtype, memory_format=torch.channels_last)


class CastingConv1d(nn.Conv1d):
    """nn.Conv1d that computes in its weight's dtype and returns its input's dtype.

    x: (B, C_in, T) float32 -> (B, C_out, T') float32. With float32 weights it is nn.Conv1d
    exactly (the dtype test is resolved when a graph is traced: no cast in a float32 graph). With
    float16 weights the input is rounded to float16, the convolution runs in float16 (cuDNN
    accumulates in float32) and its float16 output is widened back, so what follows stays float32.
    In float16 it runs as a 2-D convolution over (B, C, 1, T) in channels-last layout, with the
    weight stored to match (`HiftVocoder.set_precision`): given a 1-D convolution, PyTorch hands
    cuDNN NCHW tensors, and cuDNN's float16 kernels turned each input and weight to NHWC and each
    output back, 7.5 of the B=32 HiFT's 20.3 ms on the H200 (benchmarks/h200/README.md, run 17b; held
    channels-last it took 13.0 ms, run 18a; docs/design-notes.md, note 17). The output is
    (B, C_out, T') with channels-last strides; the ops after it keep that layout.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        if not _channels_last_convs():
            return super().forward(x.to(self.weight.dtype)).to(x.dtype)
        y = F.conv2d(_channels_last_2d(x, self.weight.dtype), self.weight.unsqueeze(2), self.bias,
                     (1, self.stride[0]), (0, self.padding[0]), (1, self.dilation[0]), self.groups)
        return y.squeeze(2).to(x.dtype)


class CastingConvTranspose1d(nn.ConvTranspose1d):
    """nn.ConvTranspose1d with CastingConv1d's dtype and layout rules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        if not _channels_last_convs():
            return super().forward(x.to(self.weight.dtype)).to(x.dtype)
        y = F.conv_transpose2d(_channels_last_2d(x, self.weight.dtype), self.weight.unsqueeze(2), self.bias,
                               (1, self.stride[0]), (0, self.padding[0]), (0, self.output_padding[0]),
                               self.groups, (1, self.dilation[0]))
        return y.squeeze(2).to(x.dtype)


def _same_padding(kernel: int, dilation: int = 1) -> int:
    return dilation * (kernel - 1) // 2


# pi = _PI_HI + _PI_LO, _PI_HI with 8 significant bits: k * _PI_HI is exact for |k| < 2^16
_PI_HI, _PI_LO = 3.140625, 9.676535897932e-4
# sin r = r (1 + r^2 (-1/3! + r^2 (1/5! - ...))) to r^11: within 6e-8 of sin r on [-pi/2, pi/2]
_SIN_TAYLOR = (-1 / 6, 1 / 120, -1 / 5040, 1 / 362880, -1 / 39916800)


def sin_squared_by_multiply_adds(z: torch.Tensor) -> torch.Tensor:
    """sin(z)^2 in float32 within 4e-7 of the exact value for |z| < 2^16 pi (torch.sin's, squared:
    1e-7), from ops that are multiply-adds on the GPU: z less its nearest multiple of pi (sin^2 has
    period pi; k pi in two parts, Cody and Waite's reduction), then sin's Taylor series to r^11."""
    k = torch.round(z * (1 / math.pi))
    r = (z - k * _PI_HI) - k * _PI_LO
    r2 = r * r
    poly = _SIN_TAYLOR[-1]
    for c in reversed(_SIN_TAYLOR[:-1]):
        poly = c + r2 * poly
    sine = r + r * r2 * poly
    return sine * sine


def _sine_as_multiply_adds(on_cuda: bool) -> bool:
    """Whether Snake's sine is traced as `sin_squared_by_multiply_adds`: on CUDA, for a compiler
    (torch.export, torch.compile) that fuses the multiply-adds into the kernels around Snake, and
    not in an ONNX export. With torch.sin (libdevice's sin and its argument reduction) those fused
    kernels ran slower than their bytes allow (benchmarks/h200/README.md, run 32). Eager keeps
    torch.sin: op by op, the multiply-adds are some twenty kernels over every activation, and
    eager HiFT, the runtime's fallback, ran 2.5x slower with them (run 35)."""
    return on_cuda and torch.compiler.is_compiling() and not torch.onnx.is_in_onnx_export()


def _sin_squared(z: torch.Tensor) -> torch.Tensor:
    """Snake's sin(z)^2; torch.sin's wherever `_sine_as_multiply_adds` says no, which the
    step-audio2 oracle parity holds on the CPU."""
    if _sine_as_multiply_adds(z.is_cuda):
        return sin_squared_by_multiply_adds(z)
    return torch.sin(z).pow(2)


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, one alpha per channel (BigVGAN's periodic activation)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (B, C, T)
        a = self.alpha[None, :, None]
        # 1e-9 keeps the upstream guard against alpha == 0 so trained values behave identically.
        return x + (1.0 / (a + 1e-9)) * _sin_squared(x * a)


class ResBlock(nn.Module):
    """Three (Snake, dilated conv, Snake, conv) residual branches applied in sequence."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            CastingConv1d(channels, channels, kernel, dilation=d, padding=_same_padding(kernel, d)) for d in dilations)
        self.convs2 = nn.ModuleList(
            CastingConv1d(channels, channels, kernel, padding=_same_padding(kernel)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class F0Predictor(nn.Module):
    """mel (B, 80, F) -> f0 in Hz (B, F): five k=3 convs with ELU, a linear head, abs.

    On CUDA (outside an ONNX export) each conv with its ELU is one Triton kernel with float32's
    accuracy on the tensor cores (runtime.model.triton_kernels.conv3_elu), over (B, F, C) rows;
    cuDNN's float32 convolutions, TF32 off, took 1.28 ms of the B=32 F=158 HiFT's 12.4 ms of kernel
    time on the H200 (benchmarks/h200/README.md, run 18c; the kernel: run 32). The kernel's weight
    reads coalesce only in tap-major order ((c_out, 3, c_in) memory), 5.5x faster than in upstream's
    (run 32a). Under the float16 policy the weights are stored so (`HiftVocoder.set_precision`) and
    read as they are; under float32 they keep upstream's layout, which torch CPU's oracle parity
    holds (stored in another order, its float32 convolutions round differently, and the NSF phases
    turn that into 2e-4 of the speech; the bound is 1e-4), and the kernel is handed a tap-major
    copy (five copies of 3 MiB at most per call). Without the kernel, PyTorch's convolutions get
    upstream's layout either way, so f0 and the NSF source are the same bits under both policies.
    """

    def __init__(self, in_channels: int, channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv1d(in_channels if i == 0 else channels, channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)

    def store_weights(self, tap_major: bool) -> None:
        """Store the five conv weights tap-major (the order the kernel reads as it is; the float16
        policy's) or in upstream's layout (the float32 policy's); values unchanged."""
        for conv in self.condnet[::2]:
            if tap_major:
                tap_major_(conv)
            else:
                conv.weight.data = conv.weight.data.contiguous()

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        kernels = triton_kernels_for(mel)
        h = mel.transpose(1, 2)                            # (B, F, 80), a view
        for conv, elu in zip(self.condnet[::2], self.condnet[1::2]):
            if kernels is not None and kernels.conv3_fits(h, conv):
                tap_major = conv.weight.transpose(1, 2).contiguous().transpose(1, 2)   # a view if stored so
                h = kernels.conv3_elu(h, tap_major, conv.bias, True)
            else:       # upstream's layout whatever the storage: the float32 bits of the oracle parity
                h = elu(conv._conv_forward(h.transpose(1, 2), conv.weight.contiguous(), conv.bias)).transpose(1, 2)
        return self.classifier(h).squeeze(-1).abs()        # (B, F)


class NsfSource(nn.Module):
    """Harmonic-plus-noise excitation from frame-rate f0 (upstream `SourceModuleHnNSF2`).

    Harmonic phases reach ~1e4 rad, where one float32 rounding is ~1e-3 rad and moves the source
    by 1e-4..1e-3 (rel-L2). So this follows the reference's float32 arithmetic step for step and
    reproduces torch CPU's results bit for bit, with ops every backend computes identically
    (see `_prefix_sum_f32` and `_upsample_phase`). Upstream's first step, a 1/480 linear
    decimation of the per-sample phase increment, reads two samples inside the same mel frame, and
    f0 is constant within a frame, so it is exactly the frame's own value: we start at frame rate.
    """

    def __init__(self, cfg: HiftConfig):
        super().__init__()
        self.hop = cfg.samples_per_frame
        self.sampling_rate = cfg.sampling_rate
        self.sine_amp = cfg.nsf_alpha
        self.noise_std = cfg.nsf_sigma
        self.voiced_threshold = cfg.voiced_threshold
        self.register_buffer("harmonics", torch.arange(1, cfg.nb_harmonics + 2, dtype=torch.float32),
                             persistent=False)
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)

    def forward(self, f0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """f0: (B, F) Hz; noise: (B, hop*F, H) standard normal -> source (B, 1, hop*F)."""
        b, frames = f0.shape
        # Cycles per sample for each harmonic, wrapped to [0, 1). f0 >= 0, so x - floor(x) is the
        # exact float remainder (upstream's `% 1`) and exports without a float Mod.
        rad = f0.unsqueeze(-1) * self.harmonics / self.sampling_rate        # (B, F, H)
        rad = rad - torch.floor(rad)
        phase = _prefix_sum_f32(rad, dim=1) * 2 * math.pi                  # (B, F, H) rad at frame centres
        phase = _upsample_phase(phase.transpose(1, 2) * self.hop, self.hop)  # (B, H, T)
        sines = torch.sin(phase).transpose(1, 2) * self.sine_amp            # (B, T, H)

        uv = (f0 > self.voiced_threshold).to(f0.dtype)                      # (B, F)
        uv = uv.unsqueeze(-1).expand(b, frames, self.hop).reshape(b, frames * self.hop, 1)   # (B, T, 1)
        noise_amp = uv * self.noise_std + (1 - uv) * (self.sine_amp / 3)
        excitation = sines * uv + noise_amp * noise                         # (B, T, H)
        return torch.tanh(self.l_linear(excitation)).transpose(1, 2)        # (B, 1, T)


# ---- float32 arithmetic that reproduces torch CPU bit for bit on every backend ----------------
# torch CPU accumulates float cumsum in double and computes linear interpolation with fused
# multiply-adds; ONNX Runtime / TensorRT do neither. The helpers below get the same bits from
# plain float32 ops by making every intermediate result exact (error-free transformations). They
# rely on each op being rounded on its own: a backend that contracts a*b+c into an FMA stays
# within ~1 ulp of the phase instead of matching exactly.

def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s + e == a + b exactly, s = fl(a + b) (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _dekker_split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a == hi + lo, each with <= 12 significant bits, so products of halves are exact."""
    c = a * 4097.0
    hi = c - (c - a)
    return hi, a - hi


def _prefix_sum_f32(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Cumulative sum of x in [0, 1), correctly rounded to float32 (= torch CPU's double-accumulated
    cumsum), whatever order the backend adds in.

    x is cut at two binary grids so that the running sums of each part are exact in float32; the
    parts are then combined with one error-free addition.
    """
    n = x.shape[dim]
    m1 = 24 - math.ceil(math.log2(n + 1))          # n terms < 1 on a 2^-m1 grid: sums fit 24 bits
    m2 = 2 * m1
    coarse = torch.floor(x * 2.0 ** m1) * 2.0 ** -m1
    rest = x - coarse
    fine = torch.floor(rest * 2.0 ** m2) * 2.0 ** -m2
    tail = rest - fine                              # < 2^-m2: its own rounding is far below 1 ulp
    s, e = _two_sum(torch.cumsum(coarse, dim), torch.cumsum(fine, dim))
    return s + (e + torch.cumsum(tail, dim))


@functools.lru_cache(maxsize=16)
def _upsample_weights(frames: int, hop: int) -> tuple[np.ndarray, ...]:
    """Weights of torch's `F.interpolate(scale_factor=hop, mode="linear")` (align_corners=False),
    float32, one per output sample: (l0, l0 high half, l0 low half, l1).

    torch computes the source position as fma(float32(1/hop), t + 0.5, -0.5): exact in float64,
    then rounded once. Depends on t itself (not t mod hop) because of that rounding.
    """
    t = np.arange(frames * hop, dtype=np.float64)
    src = (np.float64(np.float32(1.0 / hop)) * (t + 0.5) - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0))
    i0 = np.minimum(np.floor(src), np.float32(frames - 1))
    # _upsample_phase assumes the frame structure below; float32 positions break it after
    # ~10600 frames (212 s) for hop 480, so longer inputs are refused instead of silently wrong.
    bad = np.flatnonzero(i0.astype(np.int64) != np.clip((t.astype(np.int64) - hop // 2) // hop, 0, frames - 1))
    if bad.size:
        raise C2WUserError("mel frames per HiFT call", frames, f"fewer than {bad[0] // hop}",
                           "Vocode long audio in chunks (the streaming driver does).")
    l1 = np.clip(src - i0, np.float32(0), np.float32(1)).astype(np.float32)
    l0 = (np.float32(1) - l1).astype(np.float32)
    c = (l0 * np.float32(4097)).astype(np.float32)
    l0_hi = (c - (c - l0)).astype(np.float32)                           # Dekker split, see below
    tables = (l0, l0_hi, (l0 - l0_hi).astype(np.float32), l1)
    for a in tables:
        a.setflags(write=False)
    return tables


def _upsample_phase(v: torch.Tensor, hop: int) -> torch.Tensor:
    """v: (B, H, F) -> (B, H, F*hop), bit-identical to torch CPU's F.interpolate(v, scale_factor=hop,
    mode="linear"), which evaluates fma(l0, v[i0], fl(l1 * v[i1])).

    Sample t = hop*i + j interpolates frames (i-1, i) for j < hop/2 and (i, i+1) otherwise, with
    the ends held; the weights are static constants for the static length.
    """
    b, h, frames = v.shape
    half = hop // 2
    vp = torch.cat([v[..., :1], v, v[..., -1:]], dim=-1)                # (B, H, F+2), ends held

    def per_sample(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        # first/second: (B, H, F) -> (B, H, F*hop), first half of each frame from `first`
        return torch.cat([first.unsqueeze(-1).expand(b, h, frames, half),
                          second.unsqueeze(-1).expand(b, h, frames, hop - half)], dim=-1).reshape(b, h, frames * hop)

    left = per_sample(vp[..., :frames], vp[..., 1:frames + 1])          # v[i0]
    right = per_sample(vp[..., 1:frames + 1], vp[..., 2:])              # v[i1]
    l0, l0_hi, l0_lo, l1 = _on_device(_upsample_weights, (frames, hop), v.device)
    r = right * l1
    # fma(l0, left, r) = fl(p + e + r), where p + e == left * l0 exactly (Dekker's product)
    p = left * l0
    left_hi, left_lo = _dekker_split(left)
    e = ((left_hi * l0_hi - p) + left_hi * l0_lo + left_lo * l0_hi) + left_lo * l0_lo
    s, e2 = _two_sum(p, r)
    return s + (e + e2)


def _hann_periodic(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)
    return 0.5 - 0.5 * torch.cos(2 * math.pi * k / n)


@functools.lru_cache(maxsize=16)
def _window_envelope(frames: int, n_fft: int, hop: int) -> np.ndarray:
    """Overlap-added squared window of `frames` frames, trimmed n_fft/2 each side: what
    torch.istft(center=True) divides by. (hop*(frames-1),) float32; 1.5 inside, lower at the ends."""
    # numpy, not torch: this runs while torch.export traces forward (fake tensors have no data)
    w2 = (0.5 - 0.5 * np.cos(2 * math.pi * np.arange(n_fft, dtype=np.float64) / n_fft)) ** 2
    env = np.zeros(hop * (frames - 1) + n_fft)
    for f in range(frames):
        env[f * hop:f * hop + n_fft] += w2
    env = env[n_fft // 2:n_fft // 2 + hop * (frames - 1)].astype(np.float32)
    env.setflags(write=False)
    return env


def _on_device(tables, args: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The numpy constants `tables(*args)` (one array or a tuple of them) as tensors on `device`.
    Traced (torch.export, torch.compile, an ONNX export) or off CUDA: torch.tensor, which a trace
    keeps as constants of its graph. Eager on CUDA: asynchronous copies from pinned host copies
    (`_pinned`), where torch.tensor's pageable copies stalled the host on every call and stopped a
    CUDA graph's capture of eager HiFT (benchmarks/h200/README.md, the bench's eager-graph cell)."""
    if device.type != "cuda" or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export():
        return tuple(torch.tensor(t, device=device) for t in _arrays(tables, args))
    return tuple(t.to(device, non_blocking=True) for t in _pinned(tables, args))


def _arrays(tables, args: tuple) -> tuple[np.ndarray, ...]:
    found = tables(*args)
    return found if isinstance(found, tuple) else (found,)


@functools.lru_cache(maxsize=64)
def _pinned(tables, args: tuple) -> tuple[torch.Tensor, ...]:
    """Pinned host copies of `tables(*args)`, kept for the 64 latest (tables, args). A CUDA graph
    captured over eager HiFT copies from them at every replay: replay it while its frame count is
    among those 64 (c2w bench captures and times at once)."""
    return tuple(torch.from_numpy(np.array(t)).pin_memory() for t in _arrays(tables, args))


def _fourier_rows(n_fft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(analysis, synthesis) kernels, each (n_fft + 2, 1, n_fft) float32, rows [real bins; imag bins].

    analysis:  X_k = sum_n w[n] x[n] e^{-2 pi i k n / N}  (torch.stft, onesided, unnormalized)
    synthesis: w[n] * irfft(X)[n], where irfft counts bins 1..N/2-1 twice and ignores the imaginary
               part of DC and Nyquist (as torch.fft.irfft does).
    """
    bins = n_fft // 2 + 1
    w = _hann_periodic(n_fft)
    k = torch.arange(bins, dtype=torch.float64)[:, None]
    n = torch.arange(n_fft, dtype=torch.float64)[None, :]
    ang = 2 * math.pi * k * n / n_fft
    cos, sin = torch.cos(ang), torch.sin(ang)
    sin[0] = 0.0
    sin[-1] = 0.0                                     # exact zeros where sin(pi n) only rounds to ~1e-16
    analysis = torch.cat([cos * w, -sin * w], dim=0)
    weight = torch.full((bins, 1), 2.0, dtype=torch.float64)
    weight[0] = weight[-1] = 1.0
    synthesis = torch.cat([weight * cos, -weight * sin], dim=0) * w / n_fft
    return analysis.float().unsqueeze(1), synthesis.float().unsqueeze(1)


class HiftVocoder(nn.Module):
    """HiFT generator (NSF source + iSTFTNet decoder) with folded weights, export-friendly."""

    def __init__(self, cfg: HiftConfig, mel_bins: int = MEL_BINS):
        super().__init__()
        self.cfg = cfg
        self.mel_bins = mel_bins
        self.hop_samples = cfg.samples_per_frame
        self.n_fft, self.stft_hop = cfg.n_fft, cfg.hop
        n_bins2 = cfg.n_fft + 2                        # real + imaginary parts of n_fft/2 + 1 bins
        base = cfg.base_channels

        self.m_source = NsfSource(cfg)
        self.f0_predictor = F0Predictor(mel_bins, cfg.f0_channels)
        self.conv_pre = CastingConv1d(mel_bins, base, 7, padding=3)
        self.ups = nn.ModuleList(
            CastingConvTranspose1d(base // 2 ** i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernels)))

        # Source branch i brings the source spectrogram (hop_samples/stft_hop frames per mel frame)
        # down to the length of decoder stage i: stride = product of the upsample rates after stage i.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (k, d) in enumerate(zip(cfg.source_resblock_kernels, cfg.source_resblock_dilations)):
            ch = base // 2 ** (i + 1)
            stride = math.prod(cfg.upsample_rates[i + 1:])
            if stride == 1:
                self.source_downs.append(CastingConv1d(n_bins2, ch, 1))
            else:
                self.source_downs.append(CastingConv1d(n_bins2, ch, 2 * stride, stride, padding=stride // 2))
            self.source_resblocks.append(ResBlock(ch, k, d))

        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernels, cfg.resblock_dilations))
        self.conv_post = CastingConv1d(base // 2 ** len(cfg.upsample_rates), n_bins2, 7, padding=3)

        analysis, synthesis = _fourier_rows(cfg.n_fft)
        self.register_buffer("stft_kernel", analysis, persistent=False)        # (N+2, 1, N)
        self.register_buffer("istft_kernel", synthesis, persistent=False)      # (N+2, 1, N)

    # ---- precision policy ----
    def precision_modules(self) -> list[nn.Module]:
        """The convolutions a policy's dtype applies to: those of CONV_STACK. Everything else
        (f0 predictor, NSF source, Snake alphas, STFT / ISTFT kernels) is float32 under every
        policy."""
        return [m for name in CONV_STACK for m in getattr(self, name).modules()
                if isinstance(m, (CastingConv1d, CastingConvTranspose1d))]

    @property
    def precision(self) -> torch.dtype:
        """The policy's dtype: that of the conv stack's convolutions."""
        return self.conv_pre.weight.dtype

    def set_precision(self, dtype: torch.dtype) -> "HiftVocoder":
        """Apply a precision policy (module docstring): the conv stack's convolutions (weights and
        biases) in `dtype`, float32 or float16; nothing else changes dtype. bfloat16 is refused
        (REFUSED_DTYPES says why)."""
        if dtype not in PRECISIONS:
            why = REFUSED_DTYPES.get(dtype, "not a supported dtype")
            raise C2WUserError("HiFT precision", str(dtype).removeprefix("torch."),
                               f"one of {[str(d).removeprefix('torch.') for d in PRECISIONS]} ({why})")
        for m in self.precision_modules():
            m.to(dtype)
            if dtype == torch.float16:
                tap_major_(m)                         # read as it is by the channels-last convolution
            else:
                m.weight.data = m.weight.data.contiguous()
        self.f0_predictor.store_weights(tap_major=dtype == torch.float16)
        return self

    # ---- eager-only validation (kept out of forward so the exported graph has no checks) ----
    def check_inputs(self, mel: torch.Tensor, noise: torch.Tensor, source_cache: torch.Tensor | None = None) -> None:
        """Raise C2WUserError unless the shapes/dtypes match forward's contract."""
        if mel.dim() != 3:
            raise C2WUserError("tensor 'mel'", f"shape {tuple(mel.shape)}", f"3 dims (B, {self.mel_bins}, F)")
        b, _, frames = mel.shape
        check_shape("mel", mel, (b, self.mel_bins, frames), torch.float32)
        samples = frames * self.hop_samples
        check_shape("noise", noise, (b, samples, self.cfg.nb_harmonics + 1), torch.float32)
        if source_cache is not None:
            s = source_cache.shape[-1] if source_cache.dim() == 3 else -1
            if not 0 <= s <= samples:
                raise C2WUserError("tensor 'source_cache'", f"shape {tuple(source_cache.shape)}",
                                   f"shape ({b}, 1, S) with S <= {samples}")
            check_shape("source_cache", source_cache, (b, 1, s), torch.float32)

    def forward(self, mel: torch.Tensor, noise: torch.Tensor,
                source_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """mel: (B, 80, F) float32; noise: (B, 480F, H) standard normal, H = nb_harmonics + 1;
        source_cache: (B, 1, S) float32 or None.

        Returns speech (B, 480F) and source (B, 1, 480F), the excitation after its first S samples
        were replaced by source_cache (what the streaming driver caches for the next chunk).
        """
        f0 = self.f0_predictor(mel)                                  # (B, F)
        source = self.m_source(f0, noise)                            # (B, 1, T)
        if source_cache is not None and source_cache.shape[-1] > 0:
            source = torch.cat([source_cache, source[:, :, source_cache.shape[-1]:]], dim=2)
        return self.decode(mel, source), source

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel: (B, 80, F), source: (B, 1, 480F) -> speech (B, 480F) in [-audio_limit, audio_limit]."""
        cfg = self.cfg
        s_spec = self._stft(source)                                  # (B, N+2, 120F + 1)
        x = self.conv_pre(mel)
        n_res = len(cfg.resblock_kernels)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")                 # 120F -> 120F + 1 STFT frames
            x = x + self.source_resblocks[i](self.source_downs[i](s_spec))
            acc = self.resblocks[i * n_res](x)
            for j in range(1, n_res):
                acc = acc + self.resblocks[i * n_res + j](x)
            x = acc / n_res
        x = self.conv_post(F.leaky_relu(x))                          # default slope 0.01, as upstream
        bins = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])                               # upstream's choice; kept
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        speech = self._istft(spec)
        return speech.clamp(-cfg.audio_limit, cfg.audio_limit)

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 1, T) -> (B, N+2, T/hop + 1), = torch.stft(center=True, reflect, hann periodic)."""
        pad = self.n_fft // 2
        x = F.pad(x, (pad, pad), mode="reflect")
        return F.conv1d(x, self.stft_kernel, stride=self.stft_hop)

    def _istft(self, spec: torch.Tensor) -> torch.Tensor:
        """spec: (B, N+2, L) [real; imag] -> (B, hop*(L-1)), = torch.istft(center=True, hann periodic)."""
        frames = spec.shape[-1]
        frames_out = F.conv_transpose1d(spec, self.istft_kernel, stride=self.stft_hop)        # (B, 1, ...)
        pad = self.n_fft // 2
        length = self.stft_hop * (frames - 1)
        envelope, = _on_device(_window_envelope, (frames, self.n_fft, self.stft_hop), spec.device)
        return frames_out[:, 0, pad:pad + length] / envelope


# ---------------------------------------------------------------------------------------------
# Checkpoint loading
# ---------------------------------------------------------------------------------------------
_WEIGHT_NORM_SPELLINGS = (
    (".weight_g", ".weight_v"),                                             # torch.nn.utils.weight_norm
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),  # parametrizations
)


def _shape(value) -> tuple[int, ...] | str:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def expected_hift_shapes(cfg: HiftConfig, mel_bins: int = MEL_BINS) -> dict[str, tuple[int, ...]]:
    """Key -> shape of HiftVocoder(cfg).state_dict(), built on the meta device (no allocation)."""
    with torch.device("meta"):
        model = HiftVocoder(cfg, mel_bins)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def hift_state_dict_from_checkpoint(sd: dict, cfg: HiftConfig, mel_bins: int = MEL_BINS) -> dict:
    """Raw `hift.pt` state dict -> folded state dict for `HiftVocoder(cfg)`.

    Accepts an optional `generator.` key prefix and either weight-norm spelling; folds
    weight = g * v / ||v|| (norm over all dims but 0, for ConvTranspose1d too, as torch's
    weight_norm does). Raises one C2WUserError listing every missing key, unexpected key and shape
    mismatch, so a checkpoint for another config fails with the whole picture.
    """
    prefix = "generator."
    raw = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in sd.items()}

    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    bad_pairs: list[str] = []
    for key in raw:
        for g_suffix, v_suffix in _WEIGHT_NORM_SPELLINGS:
            v_key = key[: -len(g_suffix)] + v_suffix
            if key.endswith(g_suffix) and v_key in raw:
                g, v = raw[key], raw[v_key]
                consumed.update((key, v_key))
                if _shape(g) != (v.shape[0],) + (1,) * (v.dim() - 1):
                    bad_pairs.append(f"{key} {_shape(g)} does not fit {v_key} {_shape(v)}")
                else:
                    out[key[: -len(g_suffix)] + ".weight"] = torch._weight_norm(v, g, 0)
    for key, value in raw.items():
        if key not in consumed:
            out[key] = value

    pairs = [f"weight-norm pairs that do not fit [{'; '.join(bad_pairs)}]"] if bad_pairs else []
    problems = state_dict_mismatch({k: _shape(v) for k, v in out.items()}, expected_hift_shapes(cfg, mel_bins),
                                   also=pairs, shown=None)      # every key: a HiFT has a few hundred
    if problems:
        raise C2WUserError(
            f"HiFT checkpoint for base_channels={cfg.base_channels}, f0_channels={cfg.f0_channels}, "
            f"nb_harmonics={cfg.nb_harmonics}", problems,
            "every HiftVocoder key with its shape",
            "Check that the checkpoint belongs to the selected model preset.")
    return out
