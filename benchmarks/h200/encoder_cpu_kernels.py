"""How many kernels Inductor builds for the full flow encoder, on the CPU (no GPU needed).

A proxy for comparing two forms of the encoder's code before a device run: it compiles
`ConformerEncoder` (random full-size weights, float32) with torch.compile at one exact shape and
counts Inductor's fused C++ kernels and the library calls (products, convolutions) in the code it
generates, then checks the compiled output against eager. Session 33 (benchmarks/h200/README.md)
compared the encoder's convolutions as products against `0a2733e`'s cuDNN form this way (check the
old form out with `git checkout 0a2733e -- runtime/model/encoder.py runtime/model/dit.py`).

Usage: python benchmarks/h200/encoder_cpu_kernels.py --batch 1 --tokens 28 --cache 300
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from c2w.runtime.model.config import FULL  # noqa: E402
from c2w.runtime.model.encoder import ConformerEncoder  # noqa: E402
from c2w.runtime.model.weights import init_random_  # noqa: E402


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=28)
    ap.add_argument("--cache", type=int, default=300, help="attention cache frames C (even)")
    a = ap.parse_args()
    enc = ConformerEncoder(FULL.encoder).eval()
    init_random_(enc, seed=0)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(a.batch, a.tokens, FULL.encoder.width, generator=g),
            torch.randn(enc.cnn_cache_shape(a.batch), generator=g),
            torch.randn(enc.att_cache_shape(a.batch, a.cache), generator=g))
    out, codes = run_and_get_code(torch.compile(enc, dynamic=False), *args)
    code = "\n".join(codes)
    fused = re.findall(r"^\s+(cpp_fused_\w+)\(", code, re.M)
    library = Counter(re.findall(r"extern_kernels\.(\w+)\(", code))
    worst = max(float((x - y).abs().max()) for x, y in zip(out, enc(*args)))
    print(f"B={a.batch} N={a.tokens} C={a.cache}: {len(fused)} fused kernels, "
          f"{sum(library.values())} library calls {dict(sorted(library.items()))}; "
          f"largest difference from eager {worst:.1e}")


if __name__ == "__main__":
    main()
