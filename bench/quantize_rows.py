"""SwitchBack's row-wise quantizer (`kernels.quantize_rows`) at ViT-H/14's shapes, by launch setting, against the
memory bandwidth: how far from its bytes is the 49 ms that quantization takes of an fp8 ViT-H/14 step?

    python bench/quantize_rows.py [--iters 20] [--rounds 3] [--tokens 65792] [--warps 1 2 4 8] [--colsum-rows 8 16 32]
    TRITON_INTERPRET=1 python bench/quantize_rows.py --check   # the candidate's correctness alone, on the CPU

For each width (1280: X of qkv, out_proj, c_fc and G of out_proj, c_proj; 3840: G of qkv; 5120: X of c_proj and
G of c_fc), with and without the column sums (the bias gradient, taken with G), every (BLOCK_R, num_warps) in
`--rows-per-block` × `--warps` is timed alone (with the column sums, for every rows-per-program in `--colsum-rows`,
`kernels._ROWS_PER_PROGRAM`), beside the setting the autotuner picks and two peers that move the same bytes without
a row reduction: PyTorch's cast to e4m3 (read 2 bytes, write 1) and a compiled x·s cast. Figures
are CUDA-event medians (bench/switchback.py's `interleaved_ms`), with the share of the bandwidth given by
`--bandwidth` that the 3 bytes per element reach.

A candidate is timed too, with and without column sums: `quantize_rows_split`, the same arithmetic with each row
loaded as two power-of-two pieces (1280 = 1024 + 256, 5120 = 4096 + 1024) instead of one padded to the next power
of two (2048, 8192), where main's kernel leaves 37.5% of its lanes idle. It is checked against main's kernel (bit
for bit; the column sums to float rounding) before it is timed; `--check` runs only that check, at small shapes
with zero rows and rounding ties, on a GPU or through Triton's interpreter (as CI runs it:
tests/test_switchback_kernels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton.language as tl  # noqa: E402

from bench.switchback import interleaved_ms  # noqa: E402
from src.kernels.switchback import kernels  # noqa: E402
from src.kernels.triton_interpreter import interpreting  # noqa: E402

WIDTHS = (1280, 3840, 5120)


@triton.jit
def _quantize_rows_split_kernel(x_ptr, q_ptr, scale_ptr, colsum_ptr, R, C, stride_r, ROWS: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                                HAS_B: tl.constexpr, FP8: tl.constexpr, COLSUM: tl.constexpr):
    """kernels._quantize_rows_kernel with each row as columns [0, BLOCK_A) and [BLOCK_A, C): ROWS rows per
    program, BLOCK_R at a time, and with COLSUM their column sums in the program's row of colsum_ptr."""
    cols_a = tl.arange(0, BLOCK_A)
    cols_b = BLOCK_A + tl.arange(0, BLOCK_B)
    sum_a = tl.zeros((BLOCK_A,), tl.float32)
    sum_b = tl.zeros((BLOCK_B,), tl.float32)
    for start in tl.range(0, ROWS, BLOCK_R, num_stages=3):  # pipelined as main's kernel is
        rows = tl.program_id(0).to(tl.int64) * ROWS + start + tl.arange(0, BLOCK_R)
        in_rows = rows[:, None] < R
        xa = tl.load(x_ptr + rows[:, None] * stride_r + cols_a[None, :], mask=in_rows, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(xa), axis=1)
        mask_b = in_rows & (cols_b[None, :] < C)
        xb = tl.zeros((BLOCK_R, BLOCK_B), tl.float32)
        if HAS_B:
            xb = tl.load(x_ptr + rows[:, None] * stride_r + cols_b[None, :], mask=mask_b, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xb), axis=1))
        amax = kernels._nonzero(amax)
        tl.store(q_ptr + rows[:, None] * C + cols_a[None, :], kernels._quantize_values(xa, amax[:, None], FP8),
                 mask=in_rows)
        if HAS_B:
            tl.store(q_ptr + rows[:, None] * C + cols_b[None, :], kernels._quantize_values(xb, amax[:, None], FP8),
                     mask=mask_b)
        tl.store(scale_ptr + rows, kernels._dequantize_scale(amax, FP8), mask=rows < R)
        if COLSUM:
            sum_a += tl.sum(xa, axis=0)
            sum_b += tl.sum(xb, axis=0)
    if COLSUM:
        base = colsum_ptr + tl.program_id(0).to(tl.int64) * C
        tl.store(base + cols_a, sum_a)
        if HAS_B:
            tl.store(base + cols_b, sum_b, mask=cols_b < C)


def largest_power_of_2(n: int) -> int:
    """The first piece of a row of n columns in quantize_rows_split."""
    return 2 ** (n.bit_length() - 1)


def quantize_rows_split(x: torch.Tensor, fp8: bool, block_r: int = 1, warps: int = 4, column_sums: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scale [R, 1], column sums or None) of a row-contiguous 2-D x, as kernels.quantize_rows(x, fp8,
    column_sums) gives them; with column sums each program walks kernels._ROWS_PER_PROGRAM rows, as the kernel's
    do."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"quantize_rows_split needs rows contiguous in memory, got strides {x.stride()}")
    block_a = largest_power_of_2(cols)
    rest = cols - block_a
    per_program = kernels._ROWS_PER_PROGRAM if column_sums else block_r
    programs = triton.cdiv(rows, per_program)
    q = torch.empty((rows, cols), dtype=kernels._quantized_dtype(fp8), device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    partial = torch.empty((programs, cols) if column_sums else (1,), dtype=torch.float32, device=x.device)
    _quantize_rows_split_kernel[(programs,)](
        x, q, scale, partial, rows, cols, x.stride(0), ROWS=per_program, BLOCK_R=block_r, BLOCK_A=block_a,
        BLOCK_B=triton.next_power_of_2(max(rest, 1)), HAS_B=rest > 0, FP8=fp8, COLSUM=column_sums,
        num_warps=warps)
    return q, scale, partial.sum(0) if column_sums else None


def check_against_kernel(x: torch.Tensor, fp8: bool, column_sums: bool, block_r: int = 1) -> None:
    """Raise AssertionError unless quantize_rows_split(x) gives kernels.quantize_rows(x)'s q and scales bit for bit,
    and its column sums to float rounding."""
    q, scale, sums = kernels.quantize_rows(x, fp8, column_sums)
    split_q, split_scale, split_sums = quantize_rows_split(x, fp8, block_r=block_r, column_sums=column_sums)
    bits = torch.uint8 if fp8 else torch.int8
    if not (torch.equal(split_q.view(bits), q.view(bits)) and torch.equal(split_scale, scale)):
        raise AssertionError(f"quantize_rows_split differs from kernels.quantize_rows at shape {tuple(x.shape)}, "
                             f"fp8={fp8}, column_sums={column_sums}, block_r={block_r}")
    if column_sums:
        torch.testing.assert_close(split_sums, sums, rtol=1e-5, atol=1e-3)
    elif split_sums is not None:
        raise AssertionError("quantize_rows_split returned column sums it was not asked for")


def check(device: torch.device) -> None:
    """check_against_kernel at small shapes (a row narrower than its first piece, one of two pieces, a block of
    several rows) of bf16 rows of very different magnitudes, with an all-zero row and values on rounding ties."""
    for rows, cols, block_r in ((37, 300, 2), (16, 1280, 1), (5, 64, 4), (3, 5, 1)):
        generator = torch.Generator().manual_seed(rows * cols)
        x = torch.randn(rows, cols, generator=generator) * torch.rand(rows, 1, generator=generator) * 10
        x[min(3, rows - 1)] = 0
        x[0, :4] = torch.tensor([127.0, -63.5, 0.5, 2.5])[:cols]
        for fp8 in (False, True):
            for column_sums in (False, True):
                check_against_kernel(x.to(device, torch.bfloat16), fp8, column_sums, block_r)


def with_config(config, rows_per_program: int, fn):
    """fn run with the autotuner held to one config (its cache cleared so that the config is the one used) and
    `rows_per_program` rows behind each partial column sum."""
    tuner = kernels._quantize_rows_kernel

    def run():
        saved = tuner.configs, tuner.cache, kernels._ROWS_PER_PROGRAM
        tuner.configs, tuner.cache, kernels._ROWS_PER_PROGRAM = [config], {}, rows_per_program
        try:
            fn()
        finally:
            tuner.configs, tuner.cache, kernels._ROWS_PER_PROGRAM = saved
    return run


def time_width(width: int, colsum: bool, args: argparse.Namespace) -> dict:
    x = torch.randn(args.tokens, width, device="cuda", dtype=torch.bfloat16)
    cast_scale = torch.rand(args.tokens, 1, device="cuda") + 0.5
    scaled_cast = torch.compile(lambda x, s: (x * s).to(torch.float8_e4m3fn), dynamic=False)

    def quantize():
        kernels.quantize_rows(x, True, colsum)

    fns = {"autotuned": quantize, "torch_cast": lambda: x.to(torch.float8_e4m3fn),
           "compiled_scaled_cast": lambda: scaled_cast(x, cast_scale)}
    block_c = triton.next_power_of_2(width)
    for rows_per_program in args.colsum_rows if colsum else [kernels._ROWS_PER_PROGRAM]:
        for block_r in args.rows_per_block:
            if block_r * block_c > 16384 or (colsum and rows_per_program % block_r):
                continue
            for warps in args.warps:
                if block_r * block_c > 128 * 32 * warps:  # over 128 values a thread: spills, not worth timing
                    continue
                name = f"r{block_r}_w{warps}" + (f"_p{rows_per_program}" if colsum else "")
                fns[name] = with_config(triton.Config({"BLOCK_R": block_r}, num_warps=warps), rows_per_program,
                                        quantize)
    check_against_kernel(x, True, colsum)
    for block_r in args.rows_per_block:
        for warps in args.warps:
            if block_r * largest_power_of_2(width) <= 128 * 32 * warps and kernels._ROWS_PER_PROGRAM % block_r == 0:
                fns[f"split_r{block_r}_w{warps}"] = (
                    lambda block_r=block_r, warps=warps: quantize_rows_split(x, True, block_r, warps, colsum))
    ms = interleaved_ms(fns, args.iters, args.rounds)
    bound = 3 * x.numel() / (args.bandwidth * 1e12) * 1e3
    fastest = sorted((k for k in ms if k.startswith("r")), key=ms.get)[:args.top]
    split = sorted((k for k in ms if k.startswith("split_")), key=ms.get)[:args.top]
    return {"width": width, "column_sums": colsum, "bound_ms": round(bound, 4),
            **{k: round(ms[k], 4) for k in ("autotuned", "torch_cast", "compiled_scaled_cast")},
            "fastest": {k: round(ms[k], 4) for k in fastest},
            **({"split_fastest": {k: round(ms[k], 4) for k in split}} if split else {}),
            "autotuned_share_of_bandwidth": round(bound / ms["autotuned"], 2),
            "fastest_share_of_bandwidth": round(bound / ms[fastest[0]], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256 * 257)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows-per-block", nargs="+", type=int, default=[1, 2, 4, 8], help="BLOCK_R values")
    parser.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--colsum-rows", nargs="+", type=int, default=[kernels._ROWS_PER_PROGRAM])
    parser.add_argument("--top", type=int, default=6, help="settings printed per shape, fastest first")
    parser.add_argument("--bandwidth", type=float, default=4.8, help="TB/s (H200: 4.8 peak)")
    parser.add_argument("--check", action="store_true",
                        help="only check the candidate against the kernel (on the CPU under TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.check:
        check(torch.device("cpu" if interpreting() else "cuda"))
        print("quantize_rows_split matches kernels.quantize_rows")
        return 0
    if not torch.cuda.is_available():
        print("bench/quantize_rows.py needs a CUDA GPU", file=sys.stderr)
        return 1
    for width in WIDTHS:
        for colsum in (False, True):
            print(json.dumps(time_width(width, colsum, args)), flush=True)
    picked = kernels._quantize_rows_kernel.cache
    print(json.dumps({"autotuner_picked": {str(key): str(config) for key, config in picked.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
