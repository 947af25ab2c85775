"""Registers, spills and shared memory of our Triton kernels for an H100/H200 (sm_90), compiled on any machine,
no GPU needed: a quick check of a launch setting before timing it on the GPU. A kernel at 255 registers with a
spill stack runs out of registers; one under 128 registers per thread with 4 warps leaves room for more programs
per SM (an SM holds 65,536 registers).

    python bench/kernel_resources.py [--configs 64,4,3 64,4,3,32] [--head-dims 64 80] [--length 257] [--causal]
    python bench/kernel_resources.py --residual-norm [--configs 32,8,3 32,4,1] [--widths 768 1280]
    python bench/kernel_resources.py --gelu

Tiled attention (src/kernels/attention/tiled.py, the default): a config is BLOCK,WARPS,STAGES[,STEP] as in
bench/short_attention.py --tiled-configs (STAGES 0: the module's default for the head size). Residual norm
(src/kernels/residual_norm.py, `--residual-norm`, a bf16 branch output): a config is ROWS,WARPS[,STAGES] as in
bench/residual_norm.py --configs.

Every row also counts the kernel's SASS instructions. `--gelu` compiles element-wise GELU kernels written here for
the count alone (bf16 in and out, 8 elements per thread), forward and backward: the exact GELU with CUDA's erf (the
arithmetic of F.gelu under torch.compile), with Φ from Abramowitz & Stegun's erf fit (`model.gelu=rational`'s
arithmetic, its exponential as libdevice's exp2f, which Inductor emits for torch.exp2; `rational_expf`, the same
fit with libdevice's expf, which Inductor emits for torch.exp, the form this fit replaced) and from Numerical Recipes'
erfc fit, the tanh form, and h·h, which moves the same bytes with almost no arithmetic. Per element, against the
memory time of its bytes, the count tells whether a kernel is bound by its arithmetic (at about 33.5·10¹² lane-
instructions/s on an H200).
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
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.language.extra import libdevice

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from src.kernels import residual_norm  # noqa: E402
from src.kernels.attention import tiled as tiled_attention  # noqa: E402

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
    sass = [line for line in compiled.asm["sass"].splitlines()
            if line.strip()[:3].endswith(":") and "NOP" not in line]  # nvdisasm's "--:-:-:-:2  FFMA ..." lines
    return {"registers": int(fields["REG"]), "spill_stack_bytes": int(fields["STACK"]),
            "shared_bytes": compiled.metadata.shared, "sass_instructions": len(sass)}


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


GELU_BLOCK, GELU_WARPS = 1024, 4  # 8 elements per thread


@triton.jit
def _density_exp(z, FORM: tl.constexpr):
    """e^{−z²/2} as TorchInductor emits it: torch.exp becomes libdevice's expf (without fast math), torch.exp2
    libdevice's exp2f, with log2(e)/2 folded into one constant."""
    if FORM == "rational_expf":
        return libdevice.exp(-0.5 * z * z)
    return libdevice.exp2(-0.7213475204444817 * z * z)


@triton.jit
def _cdf(z, FORM: tl.constexpr):
    """Φ(z) as each exact form computes it."""
    if FORM == "erf":
        return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    half_erfc = 0.0
    if FORM == "rational" or FORM == "rational_expf":  # src/kernels/gelu.py: A&S 7.1.26; its exp is the density's
        t = 1.0 / (1.0 + 0.3275911 * 0.7071067811865476 * tl.abs(z))
        p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        half_erfc = 0.5 * p * _density_exp(z, FORM)
    if FORM == "erfc_fit":
        x = tl.abs(z) * 0.7071067811865476
        t = 1.0 / (1.0 + 0.5 * x)
        p = ((((((((0.17087277 * t - 0.82215223) * t + 1.48851587) * t - 1.13520398) * t + 0.27886807) * t
                - 0.18628806) * t + 0.09678418) * t + 0.37409196) * t + 1.00002368) * t - 1.26551223
        half_erfc = 0.5 * t * tl.exp(p - x * x)
    return tl.where(z >= 0, 1.0 - half_erfc, half_erfc)


@triton.jit
def _gelu_forward(h_ptr, g_ptr, n, FORM: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(h_ptr + offsets, mask=offsets < n).to(tl.float32)
    if FORM == "square":
        g = z * z
    elif FORM == "tanh":
        g = 0.5 * z * (1.0 + (2.0 * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z)) - 1.0))
    else:
        g = z * _cdf(z, FORM)
    tl.store(g_ptr + offsets, g.to(tl.bfloat16), mask=offsets < n)


@triton.jit
def _gelu_backward(grad_ptr, h_ptr, dh_ptr, n, FORM: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(h_ptr + offsets, mask=offsets < n).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=offsets < n).to(tl.float32)
    if FORM == "square":
        derivative = 2.0 * z
    elif FORM == "tanh":
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        derivative = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    else:
        derivative = _cdf(z, FORM) + z * _density_exp(z, FORM) * 0.3989422804014327
    tl.store(dh_ptr + offsets, (grad * derivative).to(tl.bfloat16), mask=offsets < n)


def gelu_rows(args: argparse.Namespace) -> Iterator[dict]:
    for form in ("erf", "rational", "rational_expf", "erfc_fit", "tanh", "square"):
        for name, kernel, pointers in (("forward", _gelu_forward, ("h_ptr", "g_ptr")),
                                       ("backward", _gelu_backward, ("grad_ptr", "h_ptr", "dh_ptr"))):
            signature = {pointer: "*bf16" for pointer in pointers} | {"n": "i32"}
            row = resources(kernel, signature, {"FORM": form, "BLOCK": GELU_BLOCK}, {"num_warps": GELU_WARPS})
            per_thread = GELU_BLOCK // (32 * GELU_WARPS)
            yield {"form": form, "kernel": name, **row,
                   "sass_per_element": round(row["sass_instructions"] / per_thread, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--residual-norm", action="store_true", help="the residual + LayerNorm kernels")
    parser.add_argument("--gelu", action="store_true", help="instructions of GELU's forms, forward and backward")
    parser.add_argument("--configs", nargs="+", default=None, help="default: 64,4,0 (attention), 32,4 (norm)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 80])
    parser.add_argument("--length", type=int, default=257)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--widths", nargs="+", type=int, default=[768, 1024, 1280])
    args = parser.parse_args()
    if args.configs is None:
        args.configs = [f"{residual_norm.ROWS},{residual_norm.WARPS},{residual_norm.STAGES}"] \
            if args.residual_norm else ["64,4,0"]
    rows = gelu_rows if args.gelu else residual_norm_rows if args.residual_norm else attention_rows
    for row in rows(args):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
