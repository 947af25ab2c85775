"""Is the MLP's exact GELU bound by memory or by its arithmetic? Compiled forward + backward on one H200, at the MLP
shapes of the throughput benchmark, taking turns in the same rounds:

- `exact`: F.gelu(h), as our blocks run it with `model.gelu=erf`;
- `rational`: the same GELU with Φ from a rational fit of erf (`model.gelu=rational`, src/kernels/gelu.py);
- `tanh`: F.gelu(h, approximate="tanh"), the same bytes with cheaper arithmetic;
- `square`: h * h, the same bytes (its gradient 2·h·dg reads h too) with almost no arithmetic: what the memory
  allows.

    python bench/gelu.py [--iters 10] [--rounds 3]

h is bf16 and its gradient bf16, as under autocast. Step profiles had Inductor's GELU kernels at about half
the memory bandwidth (docs/BENCHMARKS.md). If `exact` is well behind `tanh` and `square`, the erf is what costs,
and `rational` shows how much of it a cheaper erf wins back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.switchback import interleaved_ms  # noqa: E402
from src.kernels.gelu import rational_gelu  # noqa: E402

# (what, tokens, hidden): the MLP's hidden activations at the throughput benchmark's batches
SHAPES = [("ViT-B/32 image tower", 1024 * 50, 3072), ("ViT-B/32 text tower", 1024 * 77, 2048),
          ("ViT-L/14 image tower", 256 * 257, 4096), ("ViT-H/14 image tower", 256 * 257, 5120)]
FORMS = {"exact": F.gelu, "rational": rational_gelu, "tanh": lambda h: F.gelu(h, approximate="tanh"),
         "square": lambda h: h * h}
BYTES_PER_ELEMENT = (2 + 2) + (2 + 2 + 2)  # forward: read h, write g; backward: read dg and h, write dh


def step(fn, h, grad):
    def run():
        h.grad = None
        fn(h).backward(grad)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, default=4.8, help="TB/s for the bound (H200: 4.8 peak)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gelu.py needs a CUDA GPU", file=sys.stderr)
        return 1
    for what, tokens, hidden in SHAPES:
        torch._dynamo.reset()  # every shape compiled for itself (static shapes), as in the model
        h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
        grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ms = interleaved_ms({name: step(torch.compile(form, dynamic=False), h, grad) for name, form in FORMS.items()},
                            args.iters, args.rounds)
        bound = BYTES_PER_ELEMENT * tokens * hidden / (args.bandwidth * 1e12) * 1e3
        print(json.dumps({"shape": what, "tokens": tokens, "hidden": hidden,
                          **{name: round(value, 3) for name, value in ms.items()}, "bound_ms": round(bound, 3),
                          **{f"{name} share of bandwidth": round(bound / value, 2) for name, value in ms.items()},
                          "gpu": torch.cuda.get_device_name()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
