"""SwitchBack's row-wise quantizer (`kernels.quantize_rows`) at ViT-H/14's shapes, by launch setting, against the
memory bandwidth: how far from its bytes is the 49 ms that quantization takes of an fp8 ViT-H/14 step?

    python bench/quantize_rows.py [--iters 20] [--rounds 3] [--tokens 65792] [--warps 1 2 4 8] [--colsum-rows 8 16 32]

For each width (1280: X of qkv, out_proj, c_fc and G of out_proj, c_proj; 3840: G of qkv; 5120: X of c_proj and
G of c_fc), with and without the column sums (the bias gradient, taken with G), every (BLOCK_R, num_warps) in
`--rows-per-block` × `--warps` is timed alone (with the column sums, for every rows-per-program in `--colsum-rows`,
`kernels._ROWS_PER_PROGRAM`), beside the setting the autotuner picks and two peers that move the same bytes without
a row reduction: PyTorch's cast to e4m3 (read 2 bytes, write 1) and a compiled x·s cast. Figures
are CUDA-event medians (bench/switchback.py's `interleaved_ms`), with the share of the bandwidth given by
`--bandwidth` that the 3 bytes per element reach.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.switchback import interleaved_ms  # noqa: E402
from src.models.switchback import kernels  # noqa: E402

WIDTHS = (1280, 3840, 5120)


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
    scale = torch.rand(args.tokens, 1, device="cuda") + 0.5
    scaled_cast = torch.compile(lambda x, s: (x * s).to(torch.float8_e4m3fn), dynamic=False)

    def quantize():
        kernels.quantize_rows(x, True, colsum)

    fns = {"autotuned": quantize, "torch_cast": lambda: x.to(torch.float8_e4m3fn),
           "compiled_scaled_cast": lambda: scaled_cast(x, scale)}
    block_c = 2 ** (width - 1).bit_length()
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
    ms = interleaved_ms(fns, args.iters, args.rounds)
    bound = 3 * x.numel() / (args.bandwidth * 1e12) * 1e3
    fastest = sorted((k for k in ms if k.startswith("r")), key=ms.get)[:args.top]
    return {"width": width, "column_sums": colsum, "bound_ms": round(bound, 4),
            **{k: round(ms[k], 4) for k in ("autotuned", "torch_cast", "compiled_scaled_cast")},
            "fastest": {k: round(ms[k], 4) for k in fastest},
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
    args = parser.parse_args()
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
