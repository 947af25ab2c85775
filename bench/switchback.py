"""One SwitchBack linear layer, forward + backward, against bf16 F.linear at ViT-H/14 shapes, all in one run.

    python bench/switchback.py [--tokens 65792] [--iters 20] [--json out.json]

Times (CUDA events, median) for bf16 `F.linear` and each SwitchBack variant on the cuda backend, the share
of the SwitchBack layer's time spent quantizing, and peak memory of a layer's saved activations
(switchback_int8_memeff keeps only int8 inputs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from src.models.switchback import VARIANTS, switchback_linear
from src.models.switchback.functions import quantize_rows, quantize_tensor

SHAPES = {"qkv 1280->3840": (1280, 3840), "fc1 1280->5120": (1280, 5120), "fc2 5120->1280": (5120, 1280)}


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def layer_step(x, w, b, g, variant):
    def step():
        xi = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.linear(xi, w, b) if variant == "bf16" else switchback_linear(xi, w, b, variant, "cuda")
        y.backward(g)
    return step


def quantizers(v, x, w, g) -> dict:
    """The quantizations of one layer's training step: X row-wise, G row-wise with the bias gradient's column
    sums, and W (once with its transpose where both passes scale it per tensor, else twice)."""
    def weight():
        if v.weight_dim_forward is None:
            quantize_tensor(v, "cuda", w)
        else:
            quantize_rows(v, "cuda", w), quantize_rows(v, "cuda", w.t())
    return {"x": lambda: quantize_rows(v, "cuda", x), "g": lambda: quantize_rows(v, "cuda", g, column_sums=True),
            "w": weight}


def saved_bytes(x, w, b, variant) -> int:
    """Memory autograd keeps for backward after the forward pass. The layer's input is made an intermediate
    (as in a network, where only the graph holds it), so a variant that keeps int8 X frees the bf16 one."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    xi = x.detach().requires_grad_() * 1.0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = F.linear(xi, w, b) if variant == "bf16" else switchback_linear(xi, w, b, variant, "cuda")
    del xi
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256 * 257)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/switchback.py needs a CUDA GPU", file=sys.stderr)
        return 2
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    variants = ["bf16", *(v for v in VARIANTS if fp8 or not VARIANTS[v].fp8)]
    rows = []
    for name, (k, n) in SHAPES.items():
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", requires_grad=True)
        b = torch.zeros(n, device="cuda", requires_grad=True)
        g = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        base = None
        for variant in variants:
            ms = time_ms(layer_step(x, w, b, g, variant), args.iters)
            base = base or ms
            row = {"layer": name, "variant": variant, "ms": ms, "speedup_vs_bf16": base / ms,
                   "saved_activation_mib": saved_bytes(x, w, b, variant) / 2**20}
            if variant != "bf16":
                parts = {name: time_ms(fn, args.iters) for name, fn in quantizers(VARIANTS[variant], x, w, g).items()}
                quant_ms = sum(parts.values())
                row["quantize_ms"], row["quantize_share"] = quant_ms, quant_ms / ms
                row.update({f"quantize_{name}_ms": t for name, t in parts.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
