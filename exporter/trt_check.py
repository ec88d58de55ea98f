"""Will the TensorRT ONNX parser take this graph, and will the engine compute what eager computes?

`check_onnx_for_tensorrt` reads an ONNX model (path or ModelProto) and returns every problem it finds
as a `Finding`, without TensorRT installed. It walks the main graph, every If/Loop/Scan body and every
local function that is called, and checks:

- the default-domain opset against the range the parser accepts for the target TensorRT version;
- each node's op type against the ONNX-TensorRT operator matrix (`OP_SUPPORT`, below), with the
  first TensorRT version where an op arrived and the restrictions this project can verify
  (Attention, STFT, LayerNormalization, ScatterND, Constant);
- ops whose result differs from eager (Random*: TensorRT ignores the seed) or that block CUDA graphs
  (data-dependent output shapes: NonZero, NonMaxSuppression);
- dtypes on inputs, outputs, initializers, value_info, Constant values and Cast targets
  (complex and float64/string/unsigned... are errors; quantized types only through Q/DQ);
- initializers duplicated by content (the dynamo exporter with optimize=True folds per-step weight
  copies; docs/tensorrt.md), and the total initializer bytes (one "info" finding);
- graph input/output dims: concrete ints, or a dim_param named in `allow_dynamic` (the dims the
  multi-profile engine gets one exact-shape profile per ShapeKey for); an output dim may be an
  expression of allowed names, e.g. "2*T + 4".

Source of the op data: onnx/onnx-tensorrt `docs/operators.md` for TensorRT 10.15 ("opset 9 to
opset 24") and `docs/Changelog.md` (Attention in 10.14; RMSNormalization, RotaryEmbedding and
TensorScatter in 10.15), plus the TensorRT 11.5 release notes (opset 25). The data is claimed for
c2w's TensorRT floor and later only (runtime.engines.tensorrt.MIN_VERSION); older targets are refused.
"""
from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from c2w.runtime.engines.tensorrt import FLOOR, MIN_VERSION, check_trt_version
from c2w.runtime.errors import C2WUserError

SEVERITIES = ("error", "warning", "info")
MIN_OPSET = 9

# Highest default-domain opset the parser of a TensorRT release accepts; a row holds from its
# version until the next row. Rows marked "inferred" come from the ONNX submodule version the
# Changelog names (1.17 -> opset 22, 1.18 -> opset 23), not from a published range.
MAX_OPSET: tuple[tuple[tuple[int, int], int, str], ...] = (
    ((10, 0), 20, "operators.md, TensorRT 10.0"),
    ((10, 6), 22, "inferred: ONNX submodule 1.17 (Changelog 10.6)"),
    ((10, 11), 23, "inferred: ONNX submodule 1.18 (Changelog 10.11)"),
    ((10, 15), 24, "operators.md, TensorRT 10.15"),
    ((11, 5), 25, "TensorRT 11.5 release notes (opset 25, ONNX 1.22)"),
)


@dataclass(frozen=True)
class OpSupport:
    supported: bool
    since: tuple[int, int] | None = None   # first TensorRT version whose parser imports it
    note: str = ""                          # what TensorRT accepts / what to do instead


def _y(since: tuple[int, int] | None = None, note: str = "") -> OpSupport:
    return OpSupport(True, since, note)


def _n(note: str = "") -> OpSupport:
    return OpSupport(False, None, note)


_SUPPORTED_PLAIN = """
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization
BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos
Cosh CumSum DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand
EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool
GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU HammingWindow HannWindow
HardSigmoid HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN
LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool
MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg Not OneHot Or Pad
ParametricSoftplus Pow PRelu QuantizeLinear Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum
ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape
Resize ReverseSequence RNN RoiAlign Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu
Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt
Squeeze STFT Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
NonZero NonMaxSuppression RandomNormal RandomNormalLike RandomUniform RandomUniformLike
"""

_UNSUPPORTED_PLAIN = """
AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad
Compress ConcatFromSequence ConvInteger Det DynamicQuantizeLinear ImageDecoder MatMulInteger
MaxRoiPool MaxUnpool MelWeightMatrix Multinomial NegativeLogLikelihoodLoss Optional
OptionalGetElement OptionalHasElement QLinearConv QLinearMatMul RegexFullMatch SequenceAt
SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength SequenceMap
SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer StringSplit TfIdfVectorizer
Unique
"""

OP_SUPPORT: dict[str, OpSupport] = {
    **{op: _y() for op in _SUPPORTED_PLAIN.split()},
    **{op: _n() for op in _UNSUPPORTED_PLAIN.split()},
    "Attention": _y((10, 14), "4-D Q/K/V only; no past_key/past_value/nonpad_kv_seqlen inputs, no "
                              "present_*/qk_matmul_output outputs, no softcap/qk_matmul_output_mode"),
    "RMSNormalization": _y((10, 15)),
    "RotaryEmbedding": _y((10, 15), "position_ids must be int64"),
    "TensorScatter": _y((10, 15), "past_cache and update 4-D, axis -2"),
    "DFT": _n("rewrite STFT/ISTFT as real strided conv1d / conv_transpose1d (docs/tensorrt.md)"),
}

RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"})
DATA_DEPENDENT_OPS = frozenset({"NonZero", "NonMaxSuppression"})
DEFAULT_DOMAINS = ("", "ai.onnx")

# ONNX element types by TensorRT support (names from onnx.TensorProto.DataType).
OK_DTYPES = frozenset({"FLOAT", "FLOAT16", "BFLOAT16", "INT32", "INT64", "BOOL"})
IO_ONLY_DTYPES = frozenset({"UINT8"})          # "only supported as network input or output"
QUANTIZED_DTYPES = frozenset({"INT8", "INT4", "FLOAT8E4M3FN", "FLOAT4E2M1", "FLOAT8E8M0"})
COMPLEX_DTYPES = frozenset({"COMPLEX64", "COMPLEX128"})

# Duplicates smaller than this are exporter scalars (shape constants, eps); they cost nothing.
DUPLICATE_MIN_BYTES = 1024


@dataclass(frozen=True)
class Finding:
    severity: str       # "error" | "warning" | "info"
    code: str           # stable machine-readable kind, e.g. "unsupported-op", "complex-dtype"
    message: str        # what was found and what TensorRT accepts
    node: str = ""      # node or tensor name ("" for model-level findings)
    op_type: str = ""
    where: str = "main"  # graph path: "main", "main/If_3.then_branch", "function:domain.Name"

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding severity {self.severity!r} not in {SEVERITIES}")


def max_opset_for(trt: tuple[int, int]) -> tuple[int, str]:
    best = MAX_OPSET[0]
    for row in MAX_OPSET:
        if row[0] <= trt:
            best = row
    return best[1], best[2]


def _vstr(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def _dtype_name(elem_type: int) -> str:
    import onnx
    try:
        return onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"<unknown {elem_type}>"


class _Checker:
    def __init__(self, model, trt: tuple[int, int], allow_dynamic: frozenset[str]):
        self.model = model
        self.trt = trt
        self.allow_dynamic = allow_dynamic
        self.findings: list[Finding] = []
        self.functions = {(f.domain, f.name, getattr(f, "overload", "")): f for f in model.functions}
        self.walked_functions: set[tuple[str, str, str]] = set()
        self._types: dict[str, object] | None = None   # value name -> TypeProto, lazily
        self._consumed: set[str] = set()
        # content hash -> (count, nbytes, first name); filled while walking
        self.tensor_hashes: dict[tuple[int, str], list] = {}
        self.total_bytes = 0
        self.tensor_count = 0
        self.unhashed_external = 0

    def add(self, severity, code, message, node="", op_type="", where="main"):
        self.findings.append(Finding(severity, code, message, node, op_type, where))

    # ---- types ------------------------------------------------------------------------------
    def types(self) -> dict[str, object]:
        """Value name -> TypeProto, from shape inference when it works, else declared value_info."""
        if self._types is None:
            import onnx
            model = self.model
            try:
                model = onnx.shape_inference.infer_shapes(self.model, strict_mode=False)
            except (onnx.shape_inference.InferenceError, ValueError) as e:
                self.add("info", "shape-inference-skipped",
                         f"ONNX shape inference failed ({str(e)[:200]}); restriction checks use the "
                         "declared value_info only")
            table = {}
            for vi in (*model.graph.input, *model.graph.output, *model.graph.value_info):
                table[vi.name] = vi.type
            for init in model.graph.initializer:
                table.setdefault(init.name, _tensor_type(init.data_type, init.dims))
            self._types = table
        return self._types

    # ---- dtypes -----------------------------------------------------------------------------
    def check_dtype(self, elem_type: int, what: str, name: str, where: str, io: bool = False,
                    node: str = "", op_type: str = ""):
        if elem_type == 0:       # UNDEFINED: type unknown in value_info, nothing to check
            return
        dt = _dtype_name(elem_type)
        label = node or name
        if dt in OK_DTYPES or (io and dt in IO_ONLY_DTYPES):
            return
        if dt in COMPLEX_DTYPES:
            self.add("error", "complex-dtype",
                     f"{what} '{name}' has complex dtype {dt}; TensorRT has no complex types. "
                     "Carry real and imaginary parts as separate real tensors (or a trailing dim of 2).",
                     label, op_type, where)
        elif dt in IO_ONLY_DTYPES:
            self.add("error", "unsupported-dtype",
                     f"{what} '{name}' has dtype {dt}, which TensorRT accepts only on network "
                     "inputs/outputs; use int32 inside the graph.", label, op_type, where)
        elif dt in QUANTIZED_DTYPES:
            self.add("warning", "quantized-dtype",
                     f"{what} '{name}' has dtype {dt}; TensorRT supports it only through explicit "
                     "quantization (QuantizeLinear/DequantizeLinear), not as a plain tensor type.",
                     label, op_type, where)
        else:
            extra = (" TensorRT would silently cast it down to float32, so the engine would not "
                     "compute what eager computes; export float32." if dt == "DOUBLE" else "")
            self.add("error", "unsupported-dtype",
                     f"{what} '{name}' has dtype {dt}; TensorRT accepts FLOAT, FLOAT16, BFLOAT16, "
                     f"INT32, INT64, BOOL (UINT8 on I/O, INT8/INT4/FP8/FP4 via Q/DQ).{extra}",
                     label, op_type, where)

    def check_type_proto(self, tp, what: str, name: str, where: str, io: bool = False):
        kind = tp.WhichOneof("value")
        if kind == "tensor_type":
            self.check_dtype(tp.tensor_type.elem_type, what, name, where, io)
        elif kind is not None:
            self.add("error", "non-tensor-type",
                     f"{what} '{name}' is a {kind}; TensorRT accepts tensors only (no sequences, "
                     "maps or optionals).", name, "", where)

    # ---- constant tensors --------------------------------------------------------------------
    def account_tensor(self, t, where: str, what: str):
        """Count bytes and hash content of one initializer / Constant value for duplicate search."""
        import onnx
        self.check_dtype(t.data_type, what, t.name or what, where)
        if t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data:
            self.unhashed_external += 1
            info = {e.key: e.value for e in t.external_data}
            self.total_bytes += int(info.get("length", 0) or 0)
            self.tensor_count += 1
            return
        data = _tensor_bytes(t)
        self.total_bytes += len(data)
        self.tensor_count += 1
        if len(data) < DUPLICATE_MIN_BYTES:
            return
        key = (t.data_type, hashlib.sha256(data).hexdigest())
        entry = self.tensor_hashes.setdefault(key, [0, len(data), []])
        entry[0] += 1
        entry[2].append(f"{where}:{t.name}" if where != "main" else t.name)

    # ---- graph walk --------------------------------------------------------------------------
    def walk_graph(self, graph, where: str, opset: int, is_main: bool):
        for init in graph.initializer:
            self.account_tensor(init, where, "initializer")
        if len(graph.sparse_initializer):
            self.add("error", "sparse-initializer",
                     f"{len(graph.sparse_initializer)} sparse initializer(s); the TensorRT parser "
                     "takes dense initializers only.", "", "", where)
        init_names = {i.name for i in graph.initializer}
        for vi in graph.input:
            if vi.name not in init_names:
                self.check_type_proto(vi.type, "graph input", vi.name, where, io=is_main)
        for vi in graph.output:
            self.check_type_proto(vi.type, "graph output", vi.name, where, io=is_main)
        for vi in graph.value_info:
            self.check_type_proto(vi.type, "value", vi.name, where)
        for node in graph.node:
            self._consumed.update(node.input)
        self._consumed.update(o.name for o in graph.output)
        for i, node in enumerate(graph.node):
            self.check_node(node, where, opset, graph, i)

    def check_node(self, node, where: str, opset: int, graph, index: int):
        import onnx
        name = node.name or f"{node.op_type}#{index}"
        fkey = (node.domain, node.op_type, getattr(node, "overload", ""))
        if fkey in self.functions:
            # The parser inlines local functions (since 9.0): what matters is the body.
            if fkey not in self.walked_functions:
                self.walked_functions.add(fkey)
                f = self.functions[fkey]
                f_opset = _default_opset(f.opset_import)
                fwhere = f"function:{f.domain}.{f.name}" if f.domain else f"function:{f.name}"
                for i, fn in enumerate(f.node):
                    self._consumed.update(fn.input)
                self._consumed.update(f.output)
                for i, fn in enumerate(f.node):
                    self.check_node(fn, fwhere, f_opset if f_opset is not None else opset, None, i)
            return
        if node.domain not in DEFAULT_DOMAINS:
            self.add("error", "custom-domain-op",
                     f"op {node.domain}::{node.op_type} is outside the default ONNX domain and no "
                     "local function defines it; TensorRT would need a plugin for it.",
                     name, node.op_type, where)
            return
        self.check_op(node, name, where)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                self.walk_graph(attr.g, f"{where}/{name}.{attr.name}", opset, False)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for j, g in enumerate(attr.graphs):
                    self.walk_graph(g, f"{where}/{name}.{attr.name}[{j}]", opset, False)

    def check_op(self, node, name: str, where: str):
        op = node.op_type
        rule = OP_SUPPORT.get(op)
        if rule is None:
            self.add("error", "unknown-op",
                     f"op {op} is not in the ONNX-TensorRT operator matrix (TensorRT "
                     f"{_vstr(self.trt)}); the parser will reject it unless a plugin provides it.",
                     name, op, where)
            return
        if not rule.supported:
            self.add("error", "unsupported-op",
                     f"op {op} is not supported by the TensorRT ONNX parser."
                     + (f" Instead: {rule.note}." if rule.note else ""), name, op, where)
            return
        if rule.since is not None and self.trt < rule.since:
            self.add("error", "op-needs-newer-trt",
                     f"op {op} is imported by the TensorRT parser only from {_vstr(rule.since)}; "
                     f"target is {_vstr(self.trt)}. Decompose it in the exporter or raise the "
                     "TensorRT floor.", name, op, where)
            return
        if op in RANDOM_OPS:
            self.add("error", "random-op",
                     f"op {op}: TensorRT ignores the seed, so the engine cannot reproduce eager. "
                     "Pass the noise/phase in as an explicit input or a seeded constant.",
                     name, op, where)
        elif op in DATA_DEPENDENT_OPS:
            self.add("warning", "data-dependent-shape",
                     f"op {op} has a data-dependent output shape: it blocks CUDA-graph capture and "
                     "exact-shape planning. Replace it with a static-shape formulation (masks, Where).",
                     name, op, where)
        restriction = getattr(self, f"restrict_{op}", None)
        if restriction is not None:
            restriction(node, name, where)

    # ---- per-op restrictions TensorRT documents and this checker can verify ------------------
    def _attr(self, node, key, default=None):
        import onnx
        for a in node.attribute:
            if a.name == key:
                return onnx.helper.get_attribute_value(a)
        return default

    def _is_constant(self, name: str) -> bool:
        return name in self._constant_names()

    def _constant_names(self) -> set[str]:
        if not hasattr(self, "_consts"):
            consts = set()
            for g in _all_graphs(self.model.graph):
                consts.update(i.name for i in g.initializer)
                consts.update(n.output[0] for n in g.node if n.op_type == "Constant" and n.output)
            self._consts = consts
        return self._consts

    def _shape(self, name: str) -> tuple | None:
        tp = self.types().get(name)
        if tp is None or tp.WhichOneof("value") != "tensor_type" or not tp.tensor_type.HasField("shape"):
            return None
        return tuple(d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim)

    def _elem(self, name: str) -> str | None:
        tp = self.types().get(name)
        if tp is None or tp.WhichOneof("value") != "tensor_type" or tp.tensor_type.elem_type == 0:
            return None
        return _dtype_name(tp.tensor_type.elem_type)

    def restrict_Attention(self, node, name, where):
        bad = []
        for idx, label in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
            if len(node.input) > idx and node.input[idx]:
                bad.append(f"input {label}")
        for idx, label in ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output")):
            if len(node.output) > idx and node.output[idx]:
                bad.append(f"output {label}")
        if self._attr(node, "softcap", 0.0):
            bad.append("attribute softcap")
        if self._attr(node, "qk_matmul_output_mode", 0):
            bad.append("attribute qk_matmul_output_mode")
        if self._attr(node, "q_num_heads") is not None or self._attr(node, "kv_num_heads") is not None:
            bad.append("3-D form (q_num_heads/kv_num_heads attributes)")
        for idx, label in ((0, "Q"), (1, "K"), (2, "V")):
            shape = self._shape(node.input[idx]) if len(node.input) > idx else None
            if shape is not None and len(shape) != 4:
                bad.append(f"{label} of rank {len(shape)}")
        if bad:
            self.add("error", "op-restriction",
                     f"Attention uses {', '.join(bad)}; TensorRT accepts 4-D Q/K/V (+ optional "
                     "attn_mask) with output Y only.", name, "Attention", where)

    def restrict_STFT(self, node, name, where):
        errors, unknown = [], []
        if len(node.input) < 2 or not self._is_constant(node.input[1]):
            errors.append("frame_step is not an initializer")
        if len(node.input) < 3 or not node.input[2]:
            unknown.append("no window input (TensorRT documents the window as an initializer)")
        elif not self._is_constant(node.input[2]):
            errors.append("window is not an initializer")
        elem = self._elem(node.input[0])
        if elem is None:
            unknown.append("signal dtype unknown")
        elif elem != "FLOAT":
            errors.append(f"signal dtype {elem}")
        shape = self._shape(node.input[0])
        if shape is None or not shape or shape[-1] is None:
            unknown.append("signal shape unknown (cannot tell real from complex)")
        elif shape[-1] != 1:
            errors.append(f"signal last dim {shape[-1]} (complex input)")
        if errors:
            self.add("error", "op-restriction",
                     f"STFT: {'; '.join(errors)}. TensorRT takes STFT only on a real float32 signal "
                     "with constant frame_step and window.", name, "STFT", where)
        elif unknown:
            self.add("warning", "op-restriction",
                     f"STFT: could not verify {'; '.join(unknown)}. TensorRT takes STFT only on a "
                     "real float32 signal with constant frame_step and window; the real-conv "
                     "rewrite (docs/tensorrt.md) avoids the question.", name, "STFT", where)

    def restrict_LayerNormalization(self, node, name, where):
        extra = [o for o in node.output[1:] if o]
        if not extra:
            return
        used = [o for o in extra if o in self._consumed]
        if used:
            self.add("error", "op-restriction",
                     f"LayerNormalization output(s) {used} (Mean/InvStdDev) are consumed; TensorRT "
                     "imports only the first output Y.", name, "LayerNormalization", where)
        else:
            self.add("warning", "op-restriction",
                     f"LayerNormalization declares unused output(s) {extra}; TensorRT imports only "
                     "Y. Drop them in the exporter.", name, "LayerNormalization", where)

    def restrict_ScatterND(self, node, name, where):
        red = self._attr(node, "reduction", b"none")
        red = red.decode() if isinstance(red, bytes) else str(red)
        if red != "none":
            self.add("error", "op-restriction",
                     f"ScatterND reduction '{red}'; TensorRT supports reduction 'none' only.",
                     name, "ScatterND", where)

    def restrict_Constant(self, node, name, where):
        import onnx
        for a in node.attribute:
            if a.name in ("sparse_value", "value_string", "value_strings"):
                self.add("error", "op-restriction",
                         f"Constant with attribute {a.name}; TensorRT takes dense numeric values only.",
                         name, "Constant", where)
            elif a.type == onnx.AttributeProto.TENSOR:
                self.account_tensor(a.t, where, f"Constant '{node.output[0] if node.output else name}'")

    def restrict_ConstantOfShape(self, node, name, where):
        import onnx
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                self.check_dtype(a.t.data_type, "ConstantOfShape value", name, where, node=name,
                                 op_type=node.op_type)

    def restrict_Cast(self, node, name, where):
        to = self._attr(node, "to")
        if to is not None:
            self.check_dtype(int(to), "Cast target", node.output[0] if node.output else name, where,
                             node=name, op_type=node.op_type)

    # ---- whole-model checks ------------------------------------------------------------------
    def check_io_dims(self):
        graph = self.model.graph
        init_names = {i.name for i in graph.initializer}
        seen_params: set[str] = set()
        for kind, values in (("input", graph.input), ("output", graph.output)):
            for vi in values:
                if vi.name in init_names or vi.type.WhichOneof("value") != "tensor_type":
                    continue
                tt = vi.type.tensor_type
                if not tt.HasField("shape"):
                    self.add("error", "unknown-rank",
                             f"graph {kind} '{vi.name}' has no shape; TensorRT profiles need every "
                             "I/O rank and dim declared.", vi.name)
                    continue
                for axis, d in enumerate(tt.shape.dim):
                    if d.HasField("dim_value") and d.dim_value > 0:
                        continue
                    param = d.dim_param if d.HasField("dim_param") else ""
                    names = dim_param_names(param)
                    if kind == "input":
                        seen_params |= names
                    # A derived dim ("2*B", "L + T") is fine when every name in it is allowed:
                    # each profile fixes the names, so the expression is fixed too.
                    ok = bool(names) and names <= self.allow_dynamic
                    if not ok:
                        what = f"dim_param '{param}'" if param else "an unnamed unknown dim"
                        self.add("error", "dynamic-dim",
                                 f"graph {kind} '{vi.name}' axis {axis} is {what}; expected a concrete "
                                 f"int or a named dim in allow_dynamic {sorted(self.allow_dynamic)} "
                                 "(one exact-shape optimization profile per key sets it).", vi.name)
        for unused in sorted(self.allow_dynamic - seen_params):
            self.add("warning", "unused-dynamic-dim",
                     f"allow_dynamic names '{unused}', but no graph input has that dim_param "
                     f"(names in input dim_params: {sorted(seen_params)}).")

    def report_duplicates(self):
        dup_bytes, groups = 0, []
        for (_, _), (count, nbytes, names) in self.tensor_hashes.items():
            if count > 1:
                dup_bytes += (count - 1) * nbytes
                groups.append((nbytes * (count - 1), names))
        if groups:
            groups.sort(reverse=True)
            shown = "; ".join("=".join(n[:4]) + ("..." if len(n) > 4 else "") for _, n in groups[:5])
            self.add("error", "duplicate-initializers",
                     f"{sum(len(n) - 1 for _, n in groups)} constant tensor(s) repeat another's "
                     f"content: {dup_bytes} duplicated bytes in {len(groups)} group(s) ({shown}). "
                     "TensorRT stores each copy; export with optimize=False or dedupe initializers "
                     "by content.", groups[0][1][0])
        uniq = self.total_bytes - dup_bytes
        msg = (f"{self.tensor_count} constant tensors, {self.total_bytes} bytes total, {uniq} bytes "
               "after removing duplicates")
        if self.unhashed_external:
            msg += (f"; {self.unhashed_external} external-data tensor(s) not loaded, so not checked "
                    "for duplicates")
        self.add("info", "initializer-bytes", msg)


# Functions torch.export writes into symbolic dims (sympy printing), not dim names.
_SYMPY_FUNCS = {"Min", "Max", "Mod", "FloorDiv", "CeilDiv", "floor", "ceiling", "Abs", "PythonMod", "CleanDiv"}


def dim_param_names(param: str) -> set[str]:
    """Dim names in a dim_param: 'B' -> {'B'}, '2*T + 4' -> {'T'}, 'Min(C, C//2)' -> {'C'}, '' -> set()."""
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", param or "")) - _SYMPY_FUNCS


def _tensor_type(elem_type: int, dims) -> object:
    import onnx
    return onnx.helper.make_tensor_type_proto(elem_type, list(dims))


def _tensor_bytes(t) -> bytes:
    if t.raw_data:
        return bytes(t.raw_data)
    from onnx import numpy_helper
    return numpy_helper.to_array(t).tobytes()


def _default_opset(opset_import) -> int | None:
    for o in opset_import:
        if o.domain in DEFAULT_DOMAINS:
            return int(o.version)
    return None


def _all_graphs(graph) -> Iterator[object]:
    import onnx
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_graphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_graphs(g)


def _load(model_or_path):
    import onnx
    if isinstance(model_or_path, (str, Path)):
        path = Path(model_or_path)
        if not path.is_file():
            raise C2WUserError("ONNX model", str(path), "an existing .onnx file")
        return onnx.load(str(path)), path
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path, None
    raise C2WUserError("ONNX model", type(model_or_path).__name__, "a path or an onnx.ModelProto")


def check_onnx_for_tensorrt(model_or_path, trt_version: str = FLOOR,
                            allow_dynamic: frozenset[str] = frozenset()) -> list[Finding]:
    """Every reason the TensorRT `trt_version` ONNX parser would reject `model_or_path`, or build an
    engine that does not compute what eager computes. Errors first-class, warnings for what cannot
    be verified statically, one "info" summary of constant bytes. Never needs TensorRT."""
    import onnx
    trt = check_trt_version(trt_version, "TensorRT version",
                            "The operator data in exporter/trt_check.py is only claimed for those.")
    model, path = _load(model_or_path)
    checker = _Checker(model, trt, frozenset(allow_dynamic))

    try:
        onnx.checker.check_model(str(path) if path is not None else model)
    except onnx.checker.ValidationError as e:
        checker.add("error", "invalid-onnx", f"onnx.checker rejects the model: {str(e)[:300]}")
    except ValueError as e:     # > 2 GB proto in memory: the checker needs the path form
        checker.add("info", "onnx-checker-skipped", f"onnx.checker not run: {str(e)[:200]}")

    opset = _default_opset(model.opset_import)
    max_opset, source = max_opset_for(trt)
    if opset is None:
        checker.add("error", "opset", "the model imports no default-domain opset; TensorRT's parser "
                    f"accepts opset {MIN_OPSET}..{max_opset}.")
        opset = MIN_OPSET
    elif opset < MIN_OPSET:
        checker.add("error", "opset", f"default-domain opset {opset}; the TensorRT parser accepts "
                    f"opset {MIN_OPSET} and later.")
    elif opset > max_opset:
        checker.add("error", "opset", f"default-domain opset {opset}; the TensorRT {_vstr(trt)} "
                    f"parser accepts up to opset {max_opset} ({source}). Export with a lower opset.")

    checker.walk_graph(model.graph, "main", opset, True)
    checker.check_io_dims()
    checker.report_duplicates()
    return checker.findings


def initializer_bytes(model_or_path) -> tuple[int, int]:
    """(total, duplicated) bytes of constant tensors (initializers + Constant values), everywhere."""
    model, _ = _load(model_or_path)
    c = _Checker(model, MIN_VERSION, frozenset())
    c.walk_graph(model.graph, "main", _default_opset(model.opset_import) or MIN_OPSET, True)
    dup = sum((n - 1) * b for n, b, _ in c.tensor_hashes.values() if n > 1)
    return c.total_bytes, dup


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def format_findings(findings: Iterable[Finding]) -> str:
    """One line per finding, errors first, then a tally line."""
    findings = list(findings)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    lines = []
    for f in sorted(findings, key=lambda f: order[f.severity]):
        loc = ""
        if f.node or f.op_type:
            loc = f" [{f.op_type + ' ' if f.op_type else ''}{f.node!r} in {f.where}]"
        elif f.where != "main":
            loc = f" [{f.where}]"
        lines.append(f"{f.severity.upper():7s} {f.code}{loc}: {f.message}")
    counts = defaultdict(int)
    for f in findings:
        counts[f.severity] += 1
    lines.append(", ".join(f"{counts[s]} {s}(s)" for s in SEVERITIES))
    return "\n".join(lines)
