"""One SwitchBack linear layer, forward + backward, against bf16 F.linear at ViT-H/14 shapes, all in one run.

    python bench/switchback.py [--tokens 65792] [--iters 20] [--rounds 3] [--json out.json]

Times are CUDA-event medians of GPU time (the host queues each call while the GPU sleeps, so a slow host does not
count, as in a training step whose host runs ahead): the median of per-round medians, the variants taking turns in
each round. For bf16 `F.linear` and each SwitchBack variant on the cuda backend (fp8 also with
`fp8_fast_accum=False`, as `switchback_fp8+promoted_accum`): the layer's forward + backward, the share of the
SwitchBack layer's time spent quantizing, and the memory a layer saves for backward (switchback_int8_memeff keeps
only int8 inputs). Then the forward matmul of each layer alone: bf16 cuBLAS, cuBLAS int8 (`torch._int_mm`), our int8
kernel with plain and with TMA loads (`kernels.int8_matmul`), and cuBLAS fp8 with and without fast accumulation,
forward and input gradient, with the fp8 matmul's error against float64 beside the quantization's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from src.kernels.switchback import VARIANTS, kernels, switchback_linear
from src.kernels.switchback.functions import quantize_rows, quantize_tensor

SHAPES = {"qkv 1280->3840": (1280, 3840), "fc1 1280->5120": (1280, 5120), "fc2 5120->1280": (5120, 1280)}


HOST_HEADSTART_CYCLES = 50_000_000  # about 25 ms of GPU clock cycles: longer than the host takes to queue one call


def time_ms(fn, iters: int) -> float:
    """GPU milliseconds of one call (median). The GPU first sleeps while the host queues the call, so the time is
    the GPU's own, as in a training step whose host runs ahead, not that of the host launching the kernels."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_HEADSTART_CYCLES)
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


PROMOTED = "+promoted_accum"  # "switchback_fp8+promoted_accum": the fp8 layer with fp8_fast_accum=False


def linear(x, w, b, variant):
    variant, promoted, _ = variant.partition(PROMOTED)
    return F.linear(x, w, b) if variant == "bf16" else switchback_linear(x, w, b, variant, "cuda", not promoted)


def layer_step(x, w, b, g, variant):
    def step():
        xi = x.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = linear(xi, w, b, variant)
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
        y = linear(xi, w, b, variant)
    del xi
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return held


def matmuls(tokens: int, k: int, n: int, iters: int, rounds: int) -> dict:
    """Milliseconds of the layer's forward matmul [tokens, k] x [k, n] alone, by kernel; for fp8 also its input
    gradient's [tokens, n] x [n, k], with and without fast accumulation, beside bf16's."""
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qa = torch.randint(-127, 128, (tokens, k), device="cuda", dtype=torch.int8)
    qw = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    sa, sw = torch.rand(tokens, 1, device="cuda"), torch.rand(1, n, device="cuda")
    fns = {"bf16": lambda: a @ w.t(), "cublas_int8": lambda: torch._int_mm(qa, qw.t())}
    for kernel in ("pointer", "tma"):
        fns[f"ours_int8_{kernel}"] = (
            lambda kernel=kernel: kernels.int8_matmul(qa, sa, qw.t(), sw, None, torch.bfloat16, kernel=kernel))
    if torch.cuda.get_device_capability() >= (8, 9):
        # fp8 row-wise, forward [tokens, k] x [k, n] and input gradient [tokens, n] x [n, k]
        fa, fw = qa.to(torch.float8_e4m3fn), qw.to(torch.float8_e4m3fn)
        fg, fwt = torch.randn(tokens, n, device="cuda").to(torch.float8_e4m3fn), fw.t().contiguous()
        sk, gb = torch.rand(1, k, device="cuda"), torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        fns["bf16_input_grad"] = lambda: gb @ w
        for fast in (False, True):
            suffix = "_fast_accum" if fast else ""
            fns[f"fp8{suffix}"] = lambda fast=fast: torch._scaled_mm(
                fa, fw.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast)
            fns[f"fp8_input_grad{suffix}"] = lambda fast=fast: torch._scaled_mm(
                fg, fwt.t(), scale_a=sa, scale_b=sk, out_dtype=torch.bfloat16, use_fast_accum=fast)
    return interleaved_ms(fns, iters, rounds)


def accumulation_error(tokens: int, k: int, n: int) -> dict:
    """The fp8 matmul's error against float64 arithmetic on the same quantized operands, with and without fast
    accumulation, beside the quantization's own error (float64 on the unquantized operands): relative
    Frobenius norms of the differences. Activations with a few large columns, as LayerNorm outputs have.
    (bf16 output rounding adds about 0.1%.)"""
    torch.manual_seed(0)
    x = torch.randn(tokens, k, device="cuda")
    x[:, :8] *= 20
    x = x.bfloat16()
    w = torch.randn(n, k, device="cuda") * k ** -0.5
    v = VARIANTS["switchback_fp8"]
    qx, sx, _ = quantize_rows(v, "cuda", x)
    qw, _, row_scales, _ = quantize_tensor(v, "cuda", w)
    sw = row_scales[0, 0]  # one scale for W
    exact = (qx.double() * sx.double()) @ (qw.double() * sw.double()).t()
    unquantized = x.double() @ w.double().t()

    def rel(y):
        return ((y - exact).norm() / exact.norm()).item()
    result = {"quantization_error": ((exact - unquantized).norm() / unquantized.norm()).item()}
    one = torch.ones((), device="cuda")
    for fast in (False, True):
        # Row-wise scaling writes only bf16, whose rounding would hide the accumulator's: unit tensor-wise scales
        # give the float32 sums, scaled afterwards in float64.
        y = torch._scaled_mm(qx, qw.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
        result["fast_accum_error" if fast else "accum_error"] = rel(y.double() * sx.double() * sw.double())
    return result


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
    variants = ["bf16", *(v for v in VARIANTS if fp8 or not VARIANTS[v].fp8), *([f"switchback_fp8{PROMOTED}"] * fp8)]
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
            if variant in VARIANTS:
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
               **{f"{kernel}_speedup_vs_bf16": times[peer] / ms for kernel, ms in times.items()
                  if kernel != (peer := "bf16_input_grad" if "input_grad" in kernel else "bf16")}}
        if fp8:
            for direction, (inner, outer) in (("forward", (k, n)), ("input_grad", (n, k))):
                errors = accumulation_error(args.tokens, inner, outer)
                row.update({f"{direction}_{name}": error for name, error in errors.items()})
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
