"""Self-attention on short sequences, forward + backward from the fused QKV projection's output to its
gradient: PyTorch's SDPA (its own kernel choice, cuDNN on an H200; plus the views and the copy that
assembles dQ, dK, dV into one tensor) against our kernel (`model.attention_backend=triton_short`), bf16,
same run, the two taking turns.

    python bench/short_attention.py [--iters 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.switchback import interleaved_ms  # noqa: E402
from src.models.short_attention import short_attention  # noqa: E402
from src.models.transformer import sdpa_attention  # noqa: E402

# (what, batch, tokens, heads, head size, causal)
SHAPES = [
    ("ViT-B/32 image tower", 1024, 50, 12, 64, False),
    ("ViT-B/32 text tower", 1024, 77, 8, 64, True),
    ("ViT-L/14 text tower", 256, 77, 12, 64, True),
    ("ViT-H/14 text tower", 256, 77, 16, 64, True),
]


def steps(qkv: torch.Tensor, heads: int, causal: bool) -> dict:
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

    return {"sdpa_fwd_bwd": forward_backward(sdpa_attention), "ours_fwd_bwd": forward_backward(short_attention),
            "sdpa_fwd": forward(sdpa_attention), "ours_fwd": forward(short_attention)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for what, batch, length, heads, head_dim, causal in SHAPES:
        torch.manual_seed(0)
        qkv = torch.randn(batch, length, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16)
        qkv.requires_grad_()
        ms = interleaved_ms(steps(qkv, heads, causal), args.iters, args.rounds)
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
