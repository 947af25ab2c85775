"""The patch embedding as cuDNN's strided convolution against the same weights applied as one matmul over
unfolded patches (`VisionTransformer.embed_patches`), forward + backward, bf16 autocast, same run.

    python bench/patch_embed.py [--batch 1024] [--patch 32] [--width 768]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.switchback import time_ms  # noqa: E402
from src.models.vision import VisionTransformer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--patch", type=int, default=32)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    tower = VisionTransformer(224, args.patch, args.width, 1, 12, 4.0, 512, 0.0, 0.0, False).cuda()
    images = torch.randn(args.batch, 3, 224, 224, device="cuda")

    def step(embed):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = embed(images)
            out.float().sum().backward()
        return run

    conv = time_ms(step(lambda x: tower.conv1(x).flatten(2).transpose(1, 2)), args.iters)
    matmul = time_ms(step(tower.embed_patches), args.iters)
    print(json.dumps({"batch": args.batch, "patch": args.patch, "width": args.width, "conv_ms": conv,
                      "matmul_ms": matmul, "speedup": conv / matmul, "gpu": torch.cuda.get_device_name()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
