"""What a Triton kernel will ask of a GPU, found with no GPU: each launch a piece of code makes is
recorded instead of run, compiled for a compute capability by Triton's own compiler and ptxas,
and read back (shared memory per program, registers per thread, stack bytes: register spills).

Run 35 spent a device call on a kernel that asked for 561,152 bytes of shared memory where an
H100 has 232,448; Triton's interpreter, which the CPU tests use, never allocates any. A compile
here specializes the arguments as a launch on the GPU would (Triton 3.6-3.9's rules: pointers
aligned to 16 bytes and integers divisible by 16 are marked so, integers equal to 1 become
constants), because the alignment decides what the pipeliner does: compiled without it, the same
kernel asked for 16 KB.

Needs Triton's JIT (not TRITON_INTERPRET=1): run it in a process of its own.
Usage: python3 benchmarks/h200/kernel_resources.py   (the product's Triton kernels at the H200
keys' shapes, one JSON line each; tests/test_kernel_resources.py holds them to the H100's limits)
"""
from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

H100_SHARED_BYTES = 232_448          # the most shared memory one program may use on compute capability 9.0
_POINTERS = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64",
             torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}


@dataclass
class Launch:
    fn: JITFunction
    args: dict                       # every parameter by name, constexprs included
    options: dict                    # num_warps, num_stages, launch_cooperative_grid, ...

    @property
    def name(self) -> str:
        return self.fn.__name__


@contextmanager
def recorded():
    """Within it, launching a @triton.jit kernel records a Launch in the yielded list and runs
    nothing (outputs stay as allocated)."""
    launches: list[Launch] = []
    real = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args))
        named.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        for p in self.params:                        # parameters left to their defaults
            if p.name not in named and p.default is not inspect.Parameter.empty:
                named[p.name] = p.default
        launches.append(Launch(self, named, {k: v for k, v in kwargs.items() if k not in self.arg_names}))
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = real


def compile_for(launch: Launch, arch: int = 90):
    """The launch's kernel compiled for CUDA compute capability `arch`, specialized as the launch
    would be on a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = launch.fn
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = launch.args.get(p.name)
        if p.is_constexpr or value is None:
            signature[p.name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = _POINTERS[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not p.do_not_specialize:
                signature[p.name], constexprs[(i,)] = "constexpr", 1
            else:
                signature[p.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                if value % 16 == 0 and not p.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: argument {p.name} is a {type(value).__name__}; no rule for it here")
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def usage(compiled) -> dict:
    """{"shared", "registers", "stack"} of a compiled kernel: shared memory per program (bytes),
    registers per thread and stack bytes per thread as ptxas left them (cuobjdump -res-usage)."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    registers, stack = (int(re.search(rf"\b{field}:(\d+)", text).group(1)) for field in ("REG", "STACK"))
    return {"shared": compiled.metadata.shared, "registers": registers, "stack": stack}


# the product's shapes where its Triton kernels run largest and smallest (benchmarks/h200/h200_core.yaml):
# a DiT block of the in-place step at b sequences (2 per stream: CFG), T frames, L cached; HiFT's
# f0 predictor at B sequences of F mel frames
DIT_SHAPES = ((2, 50, 400), (64, 150, 400))
F0_SHAPES = ((1, 58), (32, 158))


def product_launches() -> list[tuple[str, Launch]]:
    """Each Triton launch the product makes at DIT_SHAPES and F0_SHAPES, recorded through the
    model's own code (its CUDA path taken on CPU tensors), labelled by shape."""
    from c2w.runtime.model import dit, hift
    from c2w.runtime.model import triton_kernels as kernels
    from c2w.runtime.model.config import FULL
    found = []
    real = dit.triton_kernels_for, hift.triton_kernels_for
    dit.triton_kernels_for = hift.triton_kernels_for = lambda x: kernels
    try:
        with torch.inference_mode():
            cfg = FULL.dit
            block = dit.DiTBlock(cfg).half()
            for b, frames, cache in DIT_SHAPES:
                x = torch.zeros(b, frames, cfg.hidden, dtype=torch.float16)
                mod = torch.zeros(1, 1, 9 * cfg.hidden, dtype=torch.float16)
                cnn = torch.zeros(b, 2 * cfg.hidden, 2, dtype=torch.float16)
                kv = torch.zeros(b, cfg.heads, cache + frames, 2 * cfg.head_dim, dtype=torch.float16)
                with recorded() as launches:
                    block.modulated(x, mod, cnn, kv, torch.arange(cache, cache + frames))
                found += [(f"dit b={b} T={frames} L={cache}", launch) for launch in launches]
            predictor = hift.F0Predictor(FULL.mel_bins, FULL.hift.f0_channels)
            predictor.store_weights(tap_major=True)
            for b, frames in F0_SHAPES:
                with recorded() as launches:
                    predictor(torch.zeros(b, FULL.mel_bins, frames))
                found += [(f"f0 B={b} F={frames}", launch) for launch in launches]
    finally:
        dit.triton_kernels_for, hift.triton_kernels_for = real
    return found


def main() -> None:
    for label, launch in product_launches():
        print(json.dumps({"shape": label, "kernel": launch.name, **usage(compile_for(launch))}), flush=True)


if __name__ == "__main__":
    main()
