"""How close a Triton bf16 matmul with TMA loads comes to cuBLAS at the MLP's fc1 shapes, one H200: one program
per output tile against a persistent kernel (one program per SM walking the tiles, with and without a flattened
loop), each with a plain epilogue and with the GELU epilogue (h = x Wᵀ + b and GELU(h) both written).

It is the evidence behind two choices (docs/BENCHMARKS.md): the int8 SwitchBack matmul is persistent
with a flattened loop, and the GELU stays in Inductor's element-wise kernels instead of a Triton matmul epilogue.

    python bench/triton_matmul.py [--configs 128,256,64,8,3 ...]

Times are `triton.testing.do_bench` medians (L2 flushed), one configuration after another; cuBLAS is timed
first and last, and the two show the drift in between.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from src.kernels.attention.short import _dot  # noqa: E402
from src.kernels.switchback.kernels import _grouped_tile, _persistent_programs  # noqa: E402

# (what, tokens, width, hidden): fc1 of the image towers at the throughput benchmark's batch
SHAPES = [("ViT-L/14 fc1", 256 * 257, 1024, 4096), ("ViT-H/14 fc1", 256 * 257, 1280, 5120)]
# BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
CONFIGS = ["128,256,64,8,3", "128,256,64,8,4", "256,128,64,8,3", "128,128,64,4,4", "128,128,64,8,4",
           "128,128,128,8,3", "128,256,128,8,2"]
KINDS = ("one tile per program", "persistent", "persistent, flattened loop")


@triton.jit
def _store(acc, bias_ptr, h_desc, out_desc, off_m, off_n, N, GELU: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """The tile in two column halves (as src/models' epilogues do, to keep registers): acc, or with GELU
    h = acc + bias to h_desc and exact GELU(h) to out_desc."""
    halves = tl.split(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)).permute(0, 2, 1))
    for half in tl.static_range(2):
        start = off_n + half * (BLOCK_N // 2)
        if GELU:
            cols = start + tl.arange(0, BLOCK_N // 2)
            bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            h = (halves[half] + bias[None, :]).to(out_desc.dtype)
            h_desc.store([off_m, start], h)
            h = h.to(tl.float32)
            out_desc.store([off_m, start], (h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))).to(h_desc.dtype))
        else:
            out_desc.store([off_m, start], halves[half].to(out_desc.dtype))


@triton.jit
def _matmul_kernel(a_desc, b_desc, bias_ptr, h_desc, out_desc, M, N, K, GELU: tl.constexpr,
                   FLATTEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    """A [M, K] times B [N, K] transposed. Launched with one program per tile, each walks one tile; with fewer
    programs, each walks every num_programs-th tile (persistent)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            acc += _dot(a_desc.load([off_m, k * BLOCK_K]), b_desc.load([off_n, k * BLOCK_K]).T)
        _store(acc, bias_ptr, h_desc, out_desc, off_m, off_n, N, GELU, BLOCK_M, BLOCK_N)


def launcher(kind: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, h: torch.Tensor, out: torch.Tensor,
             gelu: bool, config: str):
    """A no-argument function that runs the kernel of `kind` with `config` ("BLOCK_M,BLOCK_N,BLOCK_K,warps,
    stages"), writing out (and h with gelu)."""
    block_m, block_n, block_k, warps, stages = (int(v) for v in config.split(","))
    (m, k), n = a.shape, b.shape[0]
    descriptors = (TensorDescriptor.from_tensor(a, [block_m, block_k]),
                   TensorDescriptor.from_tensor(b, [block_n, block_k]), bias,
                   TensorDescriptor.from_tensor(h, [block_m, block_n // 2]),
                   TensorDescriptor.from_tensor(out, [block_m, block_n // 2]))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = tiles if kind == KINDS[0] else min(tiles, _persistent_programs(a.device))
    return lambda: _matmul_kernel[(programs,)](
        *descriptors, m, n, k, GELU=gelu, FLATTEN=kind == KINDS[2], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def measure(what: str, tokens: int, width: int, hidden: int, configs: list[str]) -> dict:
    """One shape: cuBLAS first and last, and each kind of kernel at its best configuration."""
    torch.manual_seed(0)
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(hidden, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    bias = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    h, out = (torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = torch.addmm(bias, x, weight.t())
    row = {"shape": what, "tokens": tokens, "width": width, "hidden": hidden,
           "cublas_addmm_ms": _bench(lambda: torch.addmm(bias, x, weight.t())),
           "cublas_addmm_then_gelu_ms": _bench(lambda: torch.nn.functional.gelu(torch.addmm(bias, x, weight.t())))}
    for kind in KINDS:
        for gelu in (False, True):
            times = {}
            for config in configs:
                run = launcher(kind, x, weight, bias, h, out, gelu, config)
                run()
                got = h if gelu else out + bias
                if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                    raise SystemExit(f"{kind} {config}: wrong result, max error "
                                     f"{(got.float() - want.float()).abs().max().item()}")
                times[config] = _bench(run)
            best = min(times, key=times.get)
            row[f"{kind}{', GELU epilogue' if gelu else ''}"] = {
                "best_ms": times[best], "best_config": best,
                "vs_cublas_addmm": row["cublas_addmm_ms"] / times[best],
                "all_ms": {config: round(ms, 3) for config, ms in times.items()}}
    row["cublas_addmm_again_ms"] = _bench(lambda: torch.addmm(bias, x, weight.t()))
    row["gpu"] = torch.cuda.get_device_name()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/triton_matmul.py needs a CUDA GPU of compute capability 9.0 or newer", file=sys.stderr)
        return 1
    for shape in SHAPES:
        print(json.dumps(measure(*shape, args.configs)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
