"""One SwitchBack linear layer, forward + backward, against bf16 F.linear at ViT-H/14 shapes, all in one run.

    python bench/switchback.py [--tokens 65792] [--iters 20] [--rounds 3] [--json out.json]

Times are CUDA-event medians: the median of per-round medians, the variants taking turns in each round. For
bf16 `F.linear` and each SwitchBack variant on the cuda backend: the layer's forward + backward, the share of
the SwitchBack layer's time spent quantizing, and the memory a layer saves for backward
(switchback_int8_memeff keeps only int8 inputs). Then the forward matmul of each layer alone: bf16 cuBLAS,
cuBLAS int8 (`torch._int_mm`), and our int8 kernel with plain and with TMA loads (`kernels.int8_matmul`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from src.models.switchback import VARIANTS, kernels, switchback_linear
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


def interleaved_ms(fns: dict, iters: int, rounds: int) -> dict:
    """Each function's median over `rounds` rounds of `time_ms`, the functions taking turns within a round,
    so that a drift of the GPU's clocks or a neighbour's load falls on all of them alike."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_ms(fn, iters))
    return {name: sorted(times)[len(times) // 2] for name, times in samples.items()}


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


def matmuls(tokens: int, k: int, n: int, iters: int, rounds: int) -> dict:
    """Milliseconds of the layer's forward matmul [tokens, k] x [k, n] alone, by kernel."""
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qa = torch.randint(-127, 128, (tokens, k), device="cuda", dtype=torch.int8)
    qw = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    sa, sw = torch.rand(tokens, 1, device="cuda"), torch.rand(1, n, device="cuda")
    fns = {"bf16": lambda: a @ w.t(), "cublas_int8": lambda: torch._int_mm(qa, qw.t())}
    for kernel in ("pointer", "tma"):
        fns[f"ours_int8_{kernel}"] = (
            lambda kernel=kernel: kernels.int8_matmul(qa, sa, qw.t(), sw, None, torch.bfloat16, kernel=kernel))
    return interleaved_ms(fns, iters, rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256 * 257)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in which the variants take turns")
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
        times = interleaved_ms({v: layer_step(x, w, b, g, v) for v in variants}, args.iters, args.rounds)
        for variant in variants:
            ms = times[variant]
            row = {"layer": name, "variant": variant, "ms": ms, "speedup_vs_bf16": times["bf16"] / ms,
                   "saved_activation_mib": saved_bytes(x, w, b, variant) / 2**20}
            if variant != "bf16":
                parts = interleaved_ms(quantizers(VARIANTS[variant], x, w, g), args.iters, args.rounds)
                quant_ms = sum(parts.values())
                row["quantize_ms"], row["quantize_share"] = quant_ms, quant_ms / ms
                row.update({f"quantize_{name}_ms": t for name, t in parts.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    matmul_rows = []
    for name, (k, n) in SHAPES.items():
        times = matmuls(args.tokens, k, n, args.iters, args.rounds)
        row = {"layer": name, **{f"{kernel}_ms": ms for kernel, ms in times.items()},
               **{f"{kernel}_speedup_vs_bf16": times["bf16"] / ms for kernel, ms in times.items() if kernel != "bf16"}}
        matmul_rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows,
              "matmuls": matmul_rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
