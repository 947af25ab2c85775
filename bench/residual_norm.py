"""A residual add and the LayerNorm after it, x1 = x + γ·a and y = LayerNorm(x1), forward + backward, one
H200: the same ops compiled by TorchInductor against our fused kernels (src/kernels/residual_norm.py), taking
turns in the same rounds, at both towers' shapes.

    python bench/residual_norm.py [--iters 10] [--rounds 3] [--configs 32,4 16,8,2 ...]

`--configs` times our kernels at each ROWS,WARPS[,STAGES] (rows and warps per program, software-pipelining stages
of the loop over rows: residual_norm.ROWS, .WARPS, .STAGES; bench/kernel_resources.py --residual-norm shows their
registers), in the same rounds. The bound beside them: the bytes the fused kernels must move (forward: read x, a;
write x1, y; backward: read the two gradients, x, a; write dx, da) at the memory bandwidth `--bandwidth` (TB/s).
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
from src.kernels import residual_norm as rn  # noqa: E402

# (what, tokens, width): both towers at the throughput benchmark's batches
SHAPES = [("ViT-B/32 image tower", 1024 * 50, 768), ("ViT-L/14 image tower", 256 * 257, 1024),
          ("ViT-H/14 image tower", 256 * 257, 1280), ("ViT-B/32 text tower", 1024 * 77, 512),
          ("ViT-L/14 text tower", 256 * 77, 768), ("ViT-H/14 text tower", 256 * 77, 1024)]
BYTES_PER_ELEMENT = (4 + 2 + 4 + 2) + (4 + 2 + 4 + 2 + 4 + 2)  # forward, backward (float32 stream, bf16 branch)


def unfused(x, a, gamma, weight, bias):
    x1 = x + a * gamma
    return x1, F.layer_norm(x1, (x.shape[-1],), weight, bias, 1e-5).to(a.dtype)


def step(fn, leaves, grads, config: tuple[int, ...] | None = None):
    def run():
        if config is not None:
            rn.ROWS, rn.WARPS, rn.STAGES = (*config, 1)[:3]
        torch.autograd.backward(fn(*leaves), grads)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=[f"{rn.ROWS},{rn.WARPS},{rn.STAGES}"],
                        metavar="ROWS,WARPS[,STAGES]",
                        help="launch settings of our kernels to time")
    parser.add_argument("--bandwidth", type=float, default=4.0, help="TB/s for the bound (H200: 4.8 peak)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/residual_norm.py needs a CUDA GPU", file=sys.stderr)
        return 1
    for what, tokens, width in SHAPES:
        torch.manual_seed(0)
        leaves = [torch.randn(tokens, width, device="cuda"),
                  torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16),
                  *(torch.rand(width, device="cuda") + 0.5 for _ in range(3))]
        leaves = [t.requires_grad_() for t in leaves]
        grads = [torch.randn(tokens, width, device="cuda"),
                 torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)]
        ours = {f"ours {config}": step(rn.residual_norm, leaves, grads, tuple(map(int, config.split(","))))
                for config in args.configs}
        ms = interleaved_ms({"inductor": step(torch.compile(unfused), leaves, grads), **ours}, args.iters,
                            args.rounds)
        print(json.dumps({"shape": what, "tokens": tokens, "width": width,
                          **{name: round(value, 3) for name, value in ms.items()},
                          "speedup": ms["inductor"] / min(ms[name] for name in ours),
                          "bound_ms": BYTES_PER_ELEMENT * tokens * width / (args.bandwidth * 1e12) * 1e3,
                          "gpu": torch.cuda.get_device_name()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
