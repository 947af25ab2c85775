"""Self-attention at CLIP's sequence lengths, forward + backward from the fused QKV projection's output to its
gradient: PyTorch's SDPA (its own kernel choice, cuDNN on an H200; plus the views and the copy that
assembles dQ, dK, dV into one tensor) against our kernels (`model.attention_backend=triton_short` up to 128
tokens, `triton_tiled` beyond), bf16, same run, taking turns.

    python bench/short_attention.py [--iters 20] [--rounds 5] [--tiled-configs 64,4,3 64,4,3,32]
        [--short-configs 128,8 64,8] [--shapes "L/14"]

--tiled-configs also times the tiled kernel, at every shape (the text towers' too, causal tiles skipped), with
the given (tile rows, warps, pipelining stages[, rows per loop step]) in place of tiled_attention.py's BLOCK,
WARPS, STAGES, STEP, in the same rounds. --short-configs likewise times the one-tile kernel, at the shapes it
takes, with (first block's rows, warps) in place of short_attention.py's FIRST_ROWS and WARPS.
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
from src.kernels.attention import short as short_attention_module  # noqa: E402
from src.kernels.attention import tiled as tiled_attention  # noqa: E402
from src.kernels.attention.short import MAX_LENGTH, short_attention  # noqa: E402
from src.models.transformer import sdpa_attention  # noqa: E402

# (what, batch, tokens, heads, head size, causal)
SHAPES = [
    ("ViT-B/32 image tower", 1024, 50, 12, 64, False),
    ("ViT-B/32 text tower", 1024, 77, 8, 64, True),
    ("ViT-L/14 text tower", 256, 77, 12, 64, True),
    ("ViT-H/14 text tower", 256, 77, 16, 64, True),
    ("ViT-B/16 image tower", 512, 197, 12, 64, False),
    ("ViT-L/14 image tower", 256, 257, 16, 64, False),
    ("ViT-H/14 image tower", 256, 257, 16, 80, False),
]


SETTINGS = ("BLOCK", "WARPS", "STAGES", "STEP")
SHORT_SETTINGS = ("FIRST_ROWS", "WARPS")


def with_settings(step, settings: tuple[int, ...], module=tiled_attention, names: tuple[str, ...] = SETTINGS):
    """`step` (forward, and backward where it has one) with `module`'s launch settings `names` (tiled_attention's
    BLOCK, WARPS, STAGES[, STEP] by default) set to `settings` (those not given: None)."""
    values = {name: None for name in names} | dict(zip(names, settings))

    def run():
        saved = {name: getattr(module, name) for name in names}
        for name, value in values.items():
            setattr(module, name, value)
        try:
            step()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
    return run


def steps(qkv: torch.Tensor, heads: int, causal: bool, tiled_configs: list[tuple[int, ...]],
          short_configs: list[tuple[int, ...]]) -> dict:
    ours = short_attention if qkv.shape[1] <= MAX_LENGTH else tiled_attention.tiled_attention
    grad_out = torch.randn(*qkv.shape[:2], qkv.shape[2] // 3, device=qkv.device, dtype=qkv.dtype)

    def forward_backward(attention):
        def run():
            torch.autograd.grad(attention(qkv, heads, causal), qkv, grad_out)
        return run

    def forward(attention):
        def run():
            with torch.no_grad():
                attention(qkv, heads, causal)
        return run

    timed = {"sdpa_fwd_bwd": forward_backward(sdpa_attention), "ours_fwd_bwd": forward_backward(ours),
             "sdpa_fwd": forward(sdpa_attention), "ours_fwd": forward(ours)}
    for settings in tiled_configs:  # at every length: the tiled kernel also runs sequences the one-tile one takes
        name = "tiled_" + "_".join(map(str, settings))
        step = with_settings(forward_backward(tiled_attention.tiled_attention), settings)
        try:
            step()
        except triton.runtime.errors.OutOfResources as error:  # e.g. too many stages of large tiles
            print(json.dumps({"skipped": name, "shape": list(qkv.shape), "why": str(error)}))
            continue
        timed[name + "_fwd_bwd"] = step
        timed[name + "_fwd"] = with_settings(forward(tiled_attention.tiled_attention), settings)
    for settings in short_configs if qkv.shape[1] <= MAX_LENGTH else []:
        name = "short_" + "_".join(map(str, settings))
        timed[name + "_fwd_bwd"] = with_settings(forward_backward(short_attention), settings, short_attention_module,
                                                 SHORT_SETTINGS)
        timed[name + "_fwd"] = with_settings(forward(short_attention), settings, short_attention_module,
                                             SHORT_SETTINGS)
    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiled-configs", nargs="*", default=[], metavar="BLOCK,WARPS,STAGES[,STEP]",
                        help="other launch settings of the tiled kernel to time, e.g. 128,8,2 or 64,4,3,32")
    parser.add_argument("--short-configs", nargs="*", default=[], metavar="FIRST_ROWS,WARPS",
                        help="other settings of the one-tile kernel to time, e.g. 128,8 (one tile) or 64,8")
    parser.add_argument("--shapes", nargs="*", default=[], help="only the shapes whose name contains one of these")
    args = parser.parse_args()
    tiled_configs = [tuple(int(v) for v in config.split(",")) for config in args.tiled_configs]
    short_configs = [tuple(int(v) for v in config.split(",")) for config in args.short_configs]
    for what, batch, length, heads, head_dim, causal in SHAPES:
        if args.shapes and not any(name in what for name in args.shapes):
            continue
        torch.manual_seed(0)
        qkv = torch.randn(batch, length, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16)
        qkv.requires_grad_()
        ms = interleaved_ms(steps(qkv, heads, causal, tiled_configs, short_configs), args.iters, args.rounds)
        # Bytes the fused forward and backward must move, in units of the QKV tensor (O and dO are a third of it):
        # Q, K, V in and O out (4/3); Q, K, V, O, dO in and dQKV out (8/3).
        qkv_bytes = qkv.numel() * qkv.element_size()
        forward_bytes, backward_bytes = qkv_bytes * 4 / 3, qkv_bytes * 8 / 3
        print(json.dumps({
            "shape": what, "batch": batch, "tokens": length, "heads": heads, "head_dim": head_dim, "causal": causal,
            **{name: round(value, 3) for name, value in ms.items()},
            "speedup_fwd_bwd": ms["sdpa_fwd_bwd"] / ms["ours_fwd_bwd"], "speedup_fwd": ms["sdpa_fwd"] / ms["ours_fwd"],
            "ours_fwd_bwd_tb_per_s": (forward_bytes + backward_bytes) / ms["ours_fwd_bwd"] / 1e9,
            "gpu": torch.cuda.get_device_name(),
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
