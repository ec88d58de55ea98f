"""The three exported units, declared as specs, and the ShapeKey that names one exact shape.

A spec says, for one component: the names of its key dims, how to build the unit module for a
key (a thin wrapper sharing the eager model's weights), the input/output names, example inputs
for a key, and the parity tolerance. Exporter, runtime and tests all go through these specs;
nothing else special-cases a component.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from c2w.runtime.errors import C2WUserError
from c2w.runtime.model.hift import REFUSED_DTYPES as HIFT_REFUSED_DTYPES
from c2w.runtime.ring import logical

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise C2WUserError("dtype", repr(name), f"one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True, order=True)
class ShapeKey:
    """One exact shape of one component: (component, dims in the spec's order, dtype name)."""
    component: str
    dims: tuple[int, ...]
    dtype: str

    @property
    def id(self) -> str:
        names = SPECS[self.component].dim_names
        return f"{self.component}-" + "-".join(f"{n}{v}" for n, v in zip(names, self.dims)) + f"-{self.dtype}"

    def dim(self, name: str) -> int:
        return self.dims[SPECS[self.component].dim_names.index(name)]

    @classmethod
    def named(cls, component: str, dtype: str, **dims: int) -> "ShapeKey":
        """A key from its dims by name, e.g. ShapeKey.named("cfm", "float32", B=1, T=50, L=100)."""
        names = spec(component).dim_names
        if set(dims) != set(names):
            raise C2WUserError(f"dims of a {component} key", sorted(dims), f"exactly the names {list(names)}")
        return cls(component, tuple(int(dims[n]) for n in names), dtype)

    def with_dims(self, **values: int) -> "ShapeKey":
        """The same key with the named dims replaced, e.g. key.with_dims(B=2)."""
        names = SPECS[self.component].dim_names
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise C2WUserError(f"dims of a {self.component} key", unknown, f"names among {list(names)}")
        return ShapeKey(self.component, tuple(int(values.get(n, v)) for n, v in zip(names, self.dims)), self.dtype)

    def to_dict(self) -> dict:
        return {"component": self.component, "dtype": self.dtype,
                **dict(zip(SPECS[self.component].dim_names, self.dims))}

    @classmethod
    def from_dict(cls, d: dict) -> "ShapeKey":
        comp = d.get("component")
        if comp not in SPECS:
            raise C2WUserError("shape key component", repr(comp), f"one of {sorted(SPECS)}")
        names = SPECS[comp].dim_names
        missing = [n for n in names if n not in d]
        if missing:
            raise C2WUserError(f"shape key for {comp}", f"no {missing}", f"all of {list(names)}")
        return cls(comp, tuple(int(d[n]) for n in names), d.get("dtype", "float32"))


# ----------------------------------------------------------------------------------------------
# unit modules: tensors in, tensors out, no state


class FlowEncoderUnit(nn.Module):
    """Holds only the encoder's modules, so an exported graph carries only their weights."""

    def __init__(self, model, last_chunk: bool):
        super().__init__()
        f = model.flow
        self.input_embedding, self.encoder, self.encoder_proj = f.input_embedding, f.encoder, f.encoder_proj
        self.last_chunk = last_chunk

    def forward(self, tokens, cnn_cache, att_cache):
        xs = self.input_embedding(tokens)
        h, cnn, att = self.encoder.forward_chunk(xs, cnn_cache, att_cache, self.last_chunk)
        return self.encoder_proj(h).transpose(1, 2).float(), cnn, att


class CFMUnit(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.solver = model.flow.solver()

    def forward(self, mu, spk, cond, x0, cnn_cache, att_cache):
        return self.solver(mu, spk, cond, x0, cnn_cache, att_cache)


class CFMStepUnit(nn.Module):
    """One Euler step of the CFM unit (the step's index as a (1,) int64 tensor, dt as a (1,) float32
    one), with its attention caches updated in place: what the AOTI backend compiles and replays n
    times (runtime.engines.aoti.EulerReplay, manifest extra "step_att": "in_place").

    Inputs: mu, spk, cond, x, the step's cnn cache, s, dt, `slots` (T,) int64, then one buffer
    (2B, heads, S, 2 head_dim) per DiT block. Each block writes the chunk's frames into slots
    `slots` of its buffer and attends to all S (Attention.forward_in_place): the buffers are the
    new caches, so the step returns only (x_next, new cnn cache). The replay keeps each stream's
    buffers from chunk to chunk and the order of their frames (runtime.ring.RingCache)."""

    def __init__(self, model):
        super().__init__()
        self.solver = model.flow.solver()

    def forward(self, mu, spk, cond, x, cnn_cache, s, dt, slots, *att_buffers):
        x, cnn, _ = self.solver.step(mu, spk, cond, x, cnn_cache, att_buffers, s, dt, att_slots=slots)
        return x, cnn


class HiftUnit(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.hift = model.hift

    def forward(self, mel, noise, source_cache=None):
        return self.hift(mel, noise, source_cache)


# ----------------------------------------------------------------------------------------------
# specs


@dataclass(frozen=True)
class ExportVariant:
    """What a backend that replays steps (AOTI) compiles instead of the whole unit, and what the
    runtime needs to know to replay it (runtime.engines.aoti reads the manifest extra)."""
    build: Callable[[object], nn.Module]                                    # (Code2Wav) -> module
    inputs: Callable[[object, list[torch.Tensor]], list[torch.Tensor]]      # (cfg, the unit's inputs)
    extra: Callable[[object], dict]                                         # (cfg) -> manifest extra


@dataclass(frozen=True)
class UnitSpec:
    name: str
    dim_names: tuple[str, ...]
    output_names: tuple[str, ...]
    input_names: Callable[[ShapeKey], tuple[str, ...]]
    input_shapes: Callable[[object, ShapeKey], tuple[tuple[int, ...], ...]]   # (cfg, key)
    input_dtypes: Callable[[ShapeKey], tuple[torch.dtype, ...]]
    output_dtypes: Callable[[ShapeKey], tuple[torch.dtype, ...]]
    build: Callable[[object, ShapeKey], nn.Module]                          # (Code2Wav, key)
    # dtype name -> rel-L2 bound of an engine against eager: the dtypes the unit's policy supports
    rtol: dict
    # dtype name -> why the policy refuses it (a measurement), for the error a profile gets
    refused_dtypes: dict = field(default_factory=dict)
    # dtype name -> why the unit needs TF32 off at that dtype (runtime.precision.check_policy)
    tf32_off: dict = field(default_factory=dict)
    # dims whose value selects a different unit module (keys differing only in others share one)
    module_dims: tuple[str, ...] = ()
    # dims that only set a cache's length: keys differing only in them compute on the same rows
    # and share most compiled kernels (a sharded export builds them together, exporter/export.py)
    cache_dims: tuple[str, ...] = ()
    export_variant: ExportVariant | None = None
    # dims an exported graph may leave dynamic, with the (min, max) it accepts; the others are static
    dynamic_dims: dict = field(default_factory=dict)                        # dim name -> (min, max)
    # (key, {dim name: dim object}) -> {input name: {axis: dim or expression of dims}}
    dynamic_axes: Callable[[ShapeKey, dict], dict] = lambda k, d: {}
    # keys of one graph variant share input names, ranks and static dims: one graph serves them
    graph_variant: Callable[[ShapeKey], str] = lambda k: k.component
    # backend name -> the unit's revision there, part of its artifacts' identity: bump it when the
    # unit's code changes what that backend builds in a way nothing else in the identity sees
    revisions: dict = field(default_factory=dict)

    def module_key(self, key: ShapeKey) -> tuple:
        """Keys with equal module keys are served by one unit module (and one set of weights)."""
        return (key.component,) + tuple(key.dim(n) for n in self.module_dims)

    def dynamic_shapes(self, key: ShapeKey, dims: dict) -> tuple[dict, ...]:
        """Per input, in input order: {axis: dims[name] or an expression of them} for the axes
        that vary between keys of the key's graph variant. `dims`: every name in dynamic_dims."""
        axes = self.dynamic_axes(key, dims)
        names = self.input_names(key)
        if set(axes) - set(names):
            raise ValueError(f"{self.name} dynamic axes for inputs {sorted(set(axes) - set(names))}: expected "
                             f"inputs among {list(names)}")
        return tuple(axes.get(n, {}) for n in names)

    def example_inputs(self, cfg, key: ShapeKey, generator: torch.Generator | None = None,
                       device="cpu", seed: int = 0) -> list[torch.Tensor]:
        """Random inputs of the key's exact shapes: tokens within the vocab, the HiFT source cache
        ~ N(0, 0.05) (the scale of the NSF source a chunk leaves behind), other caches ~ N(0, 0.5).

        Drawn from `generator` where it lives (default: a new one on `device`, seeded with `seed`),
        straight in each input's dtype. A B=32 CFM key's 4.2 G cache values drawn on the host in
        float32 and then copied took ~26 s and ~17 GB of host memory, in every shard building one.

        The source cache's scale matters under TF32: at N(0, 0.5), ten times a real source, the
        steady HiFT's speech moved by 2.5e-2 rel-L2 between exact fp32 and TF32-rounded convs
        (CPU emulation), and by 0.8-1.2e-2 between engine and eager on the H200, against 3.4e-3
        with a real chunk's cache (docs/numerics.md)."""
        g = generator or torch.Generator(device=torch.device(device)).manual_seed(seed)
        at = g.device
        out = []
        for name, shape, dtype in zip(self.input_names(key), self.input_shapes(cfg, key), self.input_dtypes(key)):
            if dtype == torch.int64:
                t = torch.randint(0, cfg.vocab_size, shape, generator=g, device=at)
            elif name == "cond":
                t = torch.zeros(shape, dtype=dtype, device=at)     # streaming chunks condition on nothing
            else:
                t = torch.randn(shape, generator=g, dtype=dtype, device=at)
                scale = SOURCE_STD if name == "source_cache" else 0.5 if "cache" in name else None
                if scale is not None:
                    t.mul_(scale)
            out.append(t.to(device=device, dtype=dtype))
        return out

    def tolerance(self, key: ShapeKey) -> float:
        return self.rtol[key.dtype]

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtype names this unit's precision policy supports (those with a tolerance)."""
        return tuple(sorted(self.rtol))

    def check_dtype(self, name: str, where: str | None = None) -> str:
        """`name` if the unit supports it, else a C2WUserError naming `where` (default: the
        component's precision), the supported dtypes and, for a refused one, why."""
        if name in self.rtol:
            return name
        why = f" ({self.refused_dtypes[name]})" if name in self.refused_dtypes else ""
        raise C2WUserError(where or f"precision.{self.name}", repr(name), f"one of {list(self.dtypes)}{why}")


def _enc_shapes(cfg, k: ShapeKey):
    B, N, C = k.dim("B"), k.dim("N"), k.dim("C")
    e = cfg.encoder
    return ((B, N), (B, e.width, 2 + 2 * e.up_stride), (e.blocks + e.up_blocks, B, e.heads, C, 2 * e.d_k))


def _cfm_shapes(cfg, k: ShapeKey):
    B, T, L = k.dim("B"), k.dim("T"), k.dim("L")
    m, d = cfg.mel_bins, cfg.dit
    return ((B, m, T), (B, cfg.spk_embed_dim), (B, m, T), (B, m, T),
            (cfg.n_timesteps, d.depth, 2 * B, 2 * d.hidden, 2),
            (cfg.n_timesteps, d.depth, 2 * B, d.heads, L, 2 * d.head_dim))


def _hift_shapes(cfg, k: ShapeKey):
    B, F, S = k.dim("B"), k.dim("F"), k.dim("S")
    h = cfg.hift
    shapes = ((B, cfg.mel_bins, F), (B, F * h.samples_per_frame, h.nb_harmonics + 1))
    return shapes + (((B, 1, S),) if S else ())


SOURCE_STD = 0.05     # std of the NSF source of a chunk (full model, random weights): sine_amp 0.1

# Engine vs eager for a float16 HiFT key (convolutions in float16, everything else float32). The
# f0 path is float32 and matches, but two float16 computations of the conv stack that round
# differently anywhere (another accumulation order, a fused Snake one float32 ulp off) decorrelate
# their float16 roundings over the 80 convolutions: the speech of two such computations differs
# by about as much as either differs from float32. Measured on the CPU, verification inputs, as
# rel-L2 of the speech: float16 vs float32 3.4-3.7e-3 (tiny, and full size with float16 rounding
# emulated; H200 full size, B=32 F=158: 3.7e-3 = 48.6 dB); float16 accumulated in float32 vs in
# float64, full size, 3.1-3.2e-3; ONNX Runtime on the CPU (it runs the convs in float32 on the
# float16 weights) vs eager float16, tiny, 2.9-3.0e-3; two fully decorrelated float16 computations
# at most ~sqrt(2) x 3.5e-3 = 4.9e-3 (a quarter-ulp bias on every conv output, full size: 4.2e-3).
# 8e-3 sits 1.6x above that limit and 4x below bfloat16 convolutions (3.3-4.1e-2 against float32).
HIFT_FLOAT16_RTOL = 8e-3


def _cfm_step_inputs(cfg, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The CFM unit's inputs -> one Euler step's (CFMStepUnit): the cnn cache of step 0, the step's
    index (int64) and dt as (1,) tensors, the chunk's slots, and step 0's attention cache as one
    buffer of T + L frames per block, the chunk's slots first (as the replay lays out a cache it
    is handed as a tensor)."""
    mu, spk, cond, x0, cnn, att = inputs
    T = mu.shape[2]
    s = torch.zeros(1, dtype=torch.int64, device=mu.device)
    dt = torch.full((1,), 0.1, dtype=torch.float32, device=mu.device)
    slots = torch.arange(T, dtype=torch.int64, device=mu.device)
    # new tensors, so that the ten steps' caches are freed once the caller drops them (a B=32 key's: ~8 GB)
    buffers = [torch.cat([a.new_zeros((*a.shape[:-2], T, a.shape[-1])), a], dim=-2) for a in att[0]]
    return [mu, spk, cond, x0, cnn[0].clone(), s, dt, slots, *buffers]


BATCH_RANGE = (1, 256)      # B of a graph with a dynamic batch


def _enc_dynamic(k: ShapeKey, d: dict) -> dict:
    # att_cache: (layers, B, heads, C, 2 d_k)
    return {"tokens": {0: d["B"], 1: d["N"]}, "cnn_cache": {0: d["B"]}, "att_cache": {1: d["B"], 3: d["C"]}}


def _cfm_dynamic(k: ShapeKey, d: dict) -> dict:
    # the estimator caches stack the conditional and unconditional (CFG) rows: 2B on axis 2
    return {"mu": {0: d["B"], 2: d["T"]}, "spk": {0: d["B"]}, "cond": {0: d["B"], 2: d["T"]},
            "x0": {0: d["B"], 2: d["T"]}, "cnn_cache": {2: 2 * d["B"]}, "att_cache": {2: 2 * d["B"], 4: d["L"]}}


def _hift_dynamic(k: ShapeKey, d: dict) -> dict:
    # HiFT's phase-interpolation tables are built for a static frame count: B varies, F does not
    # (one graph per F: 50, 58, 158 ... a handful per profile).
    return {n: {0: d["B"]} for n in SPECS["hift"].input_names(k)}


# HiFT's NSF phase reaches ~1.7e5 rad at 58 frames (cumulative phase x 480 before the sine), where a
# float32 ulp is ~0.016 rad: any backend that reorders the sums moves the sine by ~1e-3 relative.
# Eager-vs-oracle parity (same op order) is held to 1e-4 in tests; engines to this bound.
# float16 (convolutions in float16, everything else float32, TF32 off): HIFT_FLOAT16_RTOL.
_HIFT = {"float32": 5e-3, "float16": HIFT_FLOAT16_RTOL}
_MIXED = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}

SPECS: dict[str, UnitSpec] = {
    "flow_encoder": UnitSpec(
        name="flow_encoder", dim_names=("B", "N", "C", "last"),
        output_names=("mu", "new_cnn_cache", "new_att_cache"),
        input_names=lambda k: ("tokens", "cnn_cache", "att_cache"),
        input_shapes=_enc_shapes,
        input_dtypes=lambda k: (torch.int64, dtype_of(k.dtype), dtype_of(k.dtype)),
        output_dtypes=lambda k: (torch.float32, dtype_of(k.dtype), dtype_of(k.dtype)),
        build=lambda model, k: FlowEncoderUnit(model, bool(k.dim("last"))),
        rtol=_MIXED,
        module_dims=("last",),
        cache_dims=("C",),
        dynamic_dims={"B": BATCH_RANGE, "N": (4, 512), "C": (1, 4096)},
        dynamic_axes=_enc_dynamic,
        graph_variant=lambda k: "flow_encoder-last" if k.dim("last") else "flow_encoder",
        # 1: from 512 rows the attention is one fused call (runtime.model.encoder.FUSED_ATTENTION_ROWS)
        # 2: the three convolutions as one product each in the (B, T, D) layout, their weights
        # stored taps-outer (dit.conv_by_product, as the DiT's since its revision 2)
        # (3, the position scores split as q . P + v . P, each one product per head over every
        # query row, and AOTI 4, the caches written in place, were measured and taken back:
        # design notes 27 and 28)
        # 5: the position scores one product per head over every query row, their width rounded
        # up to a multiple of 8 (design note 29; numbered past the two taken back, whose builds
        # may still sit in a manifest)
        revisions={"aoti": 5, "onnxruntime": 5, "tensorrt": 5}),
    "cfm": UnitSpec(
        name="cfm", dim_names=("B", "T", "L"),
        output_names=("mel", "new_cnn_cache", "new_att_cache"),
        input_names=lambda k: ("mu", "spk", "cond", "x0", "cnn_cache", "att_cache"),
        input_shapes=_cfm_shapes,
        input_dtypes=lambda k: (torch.float32,) * 4 + (dtype_of(k.dtype),) * 2,
        output_dtypes=lambda k: (torch.float32, dtype_of(k.dtype), dtype_of(k.dtype)),
        build=lambda model, k: CFMUnit(model),
        rtol=_MIXED,
        # AOTI compiles one Euler step and the runtime replays it n_steps times (docs/aoti.md)
        export_variant=ExportVariant(build=lambda model: CFMStepUnit(model), inputs=_cfm_step_inputs,
                                     extra=lambda cfg: {"cfm_step": True, "n_steps": cfg.n_timesteps,
                                                        "step_att": "in_place"}),
        cache_dims=("L",),
        dynamic_dims={"B": BATCH_RANGE, "T": (2, 2048), "L": (1, 4096)},
        dynamic_axes=_cfm_dynamic,
        # Each revision computes the same solve as the one before (faster where measured: on
        # AOTI, benchmarks/h200/README.md; the ONNX Runtime and TensorRT forms are rebuilt with
        # it, their speed unmeasured); an artifact built before it is rebuilt. AOTI 1: on CUDA
        # the DiT MLP's first product takes its bias and GELU in cuBLASLt's epilogue
        # (benchmarks/h200/README.md, run 15; the ONNX graphs keep the ops).
        # AOTI 2, ONNX Runtime 1, TensorRT 1: each DiT convolution is one product over its input
        # rows with the taps summed shifted (CausalConvBlock._conv; run 17).
        # AOTI 3: the step returns only the chunk's frames of its attention cache (step_att; run 18c).
        # AOTI 4: the step updates its attention caches in place (step_att "in_place"; design note 21).
        # AOTI 5: on CUDA the q/k norms and the cache write are one Triton kernel (design note 23).
        # AOTI 6: on CUDA the conv block after each product is one Triton kernel (conv_norm_mish,
        # conv_residual_norm), and the DiT's conv weights are stored taps-outer (taps_outer_).
        # AOTI 7: on CUDA in float16, attention is a Triton kernel (design note 24).
        revisions={"aoti": 7, "onnxruntime": 1, "tensorrt": 1}),
    "hift": UnitSpec(
        name="hift", dim_names=("B", "F", "S"),
        output_names=("speech", "source"),
        input_names=lambda k: ("mel", "noise") + (("source_cache",) if k.dim("S") else ()),
        input_shapes=_hift_shapes,
        # float32 in and out under every policy: the mel comes float32 from the CFM (its Euler
        # state is float32 whatever the DiT's dtype), the f0 predictor and the NSF source are
        # float32, the source feeds the next chunk's source cache, the speech is float32 PCM.
        # float16 is a dtype of the convolutions inside, not of the unit's tensors.
        input_dtypes=lambda k: (torch.float32,) * (3 if k.dim("S") else 2),
        output_dtypes=lambda k: (torch.float32, torch.float32),
        build=lambda model, k: HiftUnit(model),
        rtol=_HIFT,
        refused_dtypes={DTYPE_NAMES[d]: why for d, why in HIFT_REFUSED_DTYPES.items()},
        # TF32 is process-wide; with it on, the f0 predictor's float32 convolutions round their
        # operands to 10 bits and move the NSF phases (HiFT under TF32: 38.7 dB; the float16
        # policy, measured with TF32 off: 48.6 dB)
        tf32_off={"float16": "its float32 parts, the f0 predictor above all, were measured with TF32 off; TF32 on "
                             "the f0 predictor moves the NSF phases: TF32 HiFT 38.7 dB against float32, float16 "
                             "convolutions with TF32 off 48.6 dB"},
        dynamic_dims={"B": BATCH_RANGE},
        dynamic_axes=_hift_dynamic,
        graph_variant=lambda k: f"hift-F{k.dim('F')}" + ("-cached" if k.dim("S") else ""),
        # AOTI 1: float16 convolutions as 2-D channels-last ones (runtime/model/hift.py, CastingConv1d).
        # AOTI 2: the packages' float16 conv weights in the order those convolutions read (the
        # model as loaded now goes through set_precision; AOTI 1 packages hold them contiguous).
        # AOTI 3: the f0 predictor's five convolutions as c2w's conv3_elu kernel (float32's
        # accuracy on the tensor cores) instead of cuDNN's float32 ones, and Snake's sine as
        # multiply-adds (hift.sin_squared_by_multiply_adds) instead of libdevice's sin.
        # AOTI 4: under float16 the f0 predictor's weights are stored tap-major (set_precision), so
        # the kernel reads them as they are: no copy per call.
        # AOTI 5: the f0 kernel's wide tile from half the GPU's SMs' worth of its programs (B=32
        # F=58 takes it: benchmarks/h200/README.md, run 35b).
        # AOTI 6: the wide tile 128x64 at 8 warps (run 36c: the f0 predictor alone 10 % faster at
        # B=32 F=158, no spills).
        revisions={"aoti": 6}),
}


def spec(component: str) -> UnitSpec:
    if component not in SPECS:
        raise C2WUserError("component", repr(component), f"one of {sorted(SPECS)}")
    return SPECS[component]


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of `shape` and `dtype`."""
    return math.prod(shape) * dtype.itemsize


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for tensors of one dtype and shape, through int64 views when both allow one
    (contiguous rows of a multiple of 8 bytes at 8-byte aligned addresses and strides, as the
    attention caches' rows of 2 d_k values are)."""
    def wide(t: torch.Tensor) -> bool:
        size = t.element_size()
        return (t.stride(-1) == 1 and t.data_ptr() % 8 == 0 and t.storage_offset() * size % 8 == 0
                and all(st * size % 8 == 0 for st in t.stride()[:-1]))
    if src.dim() and src.shape == dst.shape and src.dtype == dst.dtype and src.shape[-1] * src.element_size() % 8 == 0 and wide(src) and wide(dst):
        dst, src = dst.view(torch.int64), src.view(torch.int64)
    dst.copy_(src)


REL_L2_CHUNK = 1 << 24        # elements per float64 slice: 128 MiB per operand


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero).

    Accumulated over slices of REL_L2_CHUNK elements: a float64 copy of a whole B=32 stacked
    attention cache (~6e9 elements) would need ~47 GB of device memory."""
    if a.shape != b.shape:
        raise ValueError(f"rel_l2 of tensors of shapes {tuple(a.shape)} and {tuple(b.shape)}: expected equal "
                         "shapes (compare outputs of the same key)")
    a, b = a.reshape(-1), b.reshape(-1)
    num = den = 0.0
    for i in range(0, b.numel(), REL_L2_CHUNK):
        x, y = a[i:i + REL_L2_CHUNK].double(), b[i:i + REL_L2_CHUNK].double()
        den += y.pow(2).sum().item()
        num += (x - y).pow(2).sum().item()
    num, den = num ** 0.5, den ** 0.5
    return num / den if den > 0 else num


class EagerRunner:
    """Runs unit modules eagerly. The engine cache (runtime.cache) has the same `run` method and
    falls back to one of these for shapes it has no engine for."""

    def __init__(self, model):
        self.model = model
        self._units: dict[tuple, nn.Module] = {}

    def unit(self, key: ShapeKey) -> nn.Module:
        # Unit modules are thin wrappers; one per module key (the encoder's: per last-chunk flag).
        k = SPECS[key.component].module_key(key)
        if k not in self._units:
            self._units[k] = SPECS[key.component].build(self.model, key).eval()
        return self._units[k]

    @torch.inference_mode()
    def run(self, key: ShapeKey, inputs: list[torch.Tensor], trim=None) -> list[torch.Tensor]:
        """The unit's outputs, the last (its attention cache) trimmed by `trim` (a
        runtime.trim.CacheTrim, which imports this module) when one is given. A cache held as a
        runtime.ring.RingCache goes in as its logical tensor."""
        outs = list(self.unit(key)(*[logical(x) for x in inputs]))
        if trim is not None:
            outs[-1] = trim.apply(outs[-1])
        return outs
