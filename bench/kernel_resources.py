"""Registers, spills and shared memory of our Triton kernels for an H100/H200 (sm_90), compiled on any machine,
no GPU needed: a quick check of a launch setting before timing it on the GPU. A kernel at 255 registers with a
spill stack runs out of registers; one under 128 registers per thread with 4 warps leaves room for more programs
per SM (an SM holds 65,536 registers).

    python bench/kernel_resources.py [--configs 64,4,3 64,4,3,32] [--head-dims 64 80] [--length 257] [--causal]
    python bench/kernel_resources.py --residual-norm [--configs 32,8,3 32,4,1] [--widths 768 1280]

Tiled attention (src/models/tiled_attention.py, the default): a config is BLOCK,WARPS,STAGES[,STEP] as in
bench/short_attention.py --tiled-configs (STAGES 0: the module's default for the head size). Residual norm
(src/models/residual_norm.py, `--residual-norm`, a bf16 branch output): a config is ROWS,WARPS[,STAGES] as in
bench/residual_norm.py --configs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from src.models import residual_norm, tiled_attention  # noqa: E402

ATTENTION_POINTERS = {"qkv": "*bf16", "out": "*bf16", "grad_out": "*bf16", "grad_qkv": "*bf16", "lse": "*fp32",
                      "delta": "*fp32"}
ATTENTION_INTEGERS = ("length", "heads", "head_dim", "lse_stride", "tiles")
ATTENTION_KERNELS = {  # name: (kernel, its pointer arguments, its float arguments)
    "forward": (tiled_attention._tiled_forward_kernel, ("qkv", "out", "lse"), ("scale_log2",)),
    "grad_query": (tiled_attention._tiled_grad_query_kernel, ("qkv", "out", "grad_out", "lse", "delta", "grad_qkv"),
                   ("scale", "scale_log2")),
    "grad_key": (tiled_attention._tiled_grad_key_kernel, ("qkv", "grad_out", "lse", "delta", "grad_qkv"),
                 ("scale", "scale_log2")),
}
RESIDUAL_NORM_KERNELS = {  # name: (kernel, its full signature, its own compile-time settings)
    "forward": (residual_norm._residual_norm_forward_kernel,
                {"x_ptr": "*fp32", "a_ptr": "*bf16", "a_bias_ptr": "*fp32", "gamma_ptr": "*fp32", "w_ptr": "*fp32",
                 "b_ptr": "*fp32", "x1_ptr": "*fp32", "y_ptr": "*bf16", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                 "rows": "i32", "width": "i32", "eps": "fp32"}, {"HAS_A_BIAS": True}),
    "backward": (residual_norm._residual_norm_backward_kernel,
                 {"grad_x1_ptr": "*fp32", "grad_y_ptr": "*bf16", "stream_ptr": "*fp32", "a_ptr": "*bf16",
                  "a_bias_ptr": "*fp32", "gamma_ptr": "*fp32", "w_ptr": "*fp32", "mean_ptr": "*fp32",
                  "rstd_ptr": "*fp32", "dx_ptr": "*fp32", "da_ptr": "*bf16", "partial_ptr": "*fp32", "rows": "i32",
                  "width": "i32", "programs": "i32"},
                 {"HAS_GRAD_X1": True, "STREAM_IS_SUM": False, "HAS_A_BIAS": True}),
}


def resources(kernel, signature: dict, constexprs: dict, options: dict) -> dict:
    """Compile one kernel for sm_90 and read its resource usage off the cubin."""
    signature = signature | {name: "constexpr" for name in constexprs}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(item.split(":") for item in next(line for line in usage.splitlines() if "REG:" in line).split()
                  if ":" in item and item.split(":")[0] in ("REG", "STACK"))
    return {"registers": int(fields["REG"]), "spill_stack_bytes": int(fields["STACK"]),
            "shared_bytes": compiled.metadata.shared}


def attention_rows(args: argparse.Namespace) -> Iterator[dict]:
    for config in args.configs:
        block, warps, stages, *step = (int(value) for value in config.split(","))
        tiled_attention.BLOCK, tiled_attention.WARPS = block, warps
        tiled_attention.STAGES, tiled_attention.STEP = stages or None, step[0] if step else None
        for head_dim in args.head_dims:
            meta = tiled_attention._launch_config(args.length, head_dim)["meta"]
            options = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]}
            constexprs = {name: value for name, value in meta.items() if not name.startswith("num_")}
            constexprs["CAUSAL"] = args.causal
            for name, (kernel, pointers, floats) in ATTENTION_KERNELS.items():
                signature = {p: ATTENTION_POINTERS[p] for p in pointers} | {i: "i32" for i in ATTENTION_INTEGERS}
                signature |= {f: "fp32" for f in floats}
                yield {"config": config, "head_dim": head_dim, "kernel": name,
                       **resources(kernel, signature, constexprs, options)}


def residual_norm_rows(args: argparse.Namespace) -> Iterator[dict]:
    for config in args.configs:
        rows, warps, *stages = (int(value) for value in config.split(","))
        for width in args.widths:
            settings = {"BLOCK_W": triton.next_power_of_2(width), "ROWS": rows, "STAGES": stages[0] if stages else 1}
            for name, (kernel, signature, own) in RESIDUAL_NORM_KERNELS.items():
                yield {"config": config, "width": width, "kernel": name,
                       **resources(kernel, signature, settings | own, {"num_warps": warps})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--residual-norm", action="store_true", help="the residual + LayerNorm kernels")
    parser.add_argument("--configs", nargs="+", default=None, help="default: 64,4,0 (attention), 32,4 (norm)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 80])
    parser.add_argument("--length", type=int, default=257)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--widths", nargs="+", type=int, default=[768, 1024, 1280])
    args = parser.parse_args()
    if args.configs is None:
        args.configs = [f"{residual_norm.ROWS},{residual_norm.WARPS},{residual_norm.STAGES}"] \
            if args.residual_norm else ["64,4,0"]
    for row in (residual_norm_rows if args.residual_norm else attention_rows)(args):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
