"""Registers, spills and shared memory of the tiled attention kernels (src/models/tiled_attention.py) for an
H100/H200 (sm_90), compiled on any machine, no GPU needed: a quick check of a launch setting before timing it on
the GPU. A kernel at 255 registers with a spill stack runs out of registers; one under 128 registers per thread
with 4 warps leaves room for more programs per SM.

    python bench/kernel_resources.py [--configs 64,4,3 64,4,3,32] [--head-dims 64 80] [--length 257] [--causal]

A config is BLOCK,WARPS,STAGES[,STEP] as in bench/short_attention.py --tiled-configs (STAGES 0: the module's
default for the head size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from src.models import tiled_attention  # noqa: E402

POINTERS = {"qkv": "*bf16", "out": "*bf16", "grad_out": "*bf16", "grad_qkv": "*bf16", "lse": "*fp32", "delta": "*fp32"}
INTEGERS = ("length", "heads", "head_dim", "lse_stride", "tiles")
KERNELS = {  # name: (kernel, its pointer arguments, its float arguments)
    "forward": (tiled_attention._tiled_forward_kernel, ("qkv", "out", "lse"), ("scale_log2",)),
    "grad_query": (tiled_attention._tiled_grad_query_kernel, ("qkv", "out", "grad_out", "lse", "delta", "grad_qkv"),
                   ("scale", "scale_log2")),
    "grad_key": (tiled_attention._tiled_grad_key_kernel, ("qkv", "grad_out", "lse", "delta", "grad_qkv"),
                 ("scale", "scale_log2")),
}


def resources(kernel, pointers, floats, meta: dict, causal: bool) -> dict:
    """Compile one kernel for sm_90 with the launch settings `meta` and read its resource usage off the cubin."""
    options = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]}
    constexprs = {name: value for name, value in meta.items() if not name.startswith("num_")} | {"CAUSAL": causal}
    signature = {name: POINTERS[name] for name in pointers} | {name: "i32" for name in INTEGERS}
    signature |= {name: "fp32" for name in floats} | {name: "constexpr" for name in constexprs}
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["64,4,0"], metavar="BLOCK,WARPS,STAGES[,STEP]")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 80])
    parser.add_argument("--length", type=int, default=257)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    for config in args.configs:
        block, warps, stages, *step = (int(value) for value in config.split(","))
        tiled_attention.BLOCK, tiled_attention.WARPS = block, warps
        tiled_attention.STAGES, tiled_attention.STEP = stages or None, step[0] if step else None
        for head_dim in args.head_dims:
            meta = tiled_attention._launch_config(args.length, head_dim)["meta"]
            for name, (kernel, pointers, floats) in KERNELS.items():
                print(json.dumps({"config": config, "head_dim": head_dim, "kernel": name,
                                  **resources(kernel, pointers, floats, meta, args.causal)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
