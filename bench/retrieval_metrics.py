"""Retrieval recall@k of a held-out set against OpenCLIP's `get_clip_metrics`, on the CPU where both compute it.

    python bench/retrieval_metrics.py [--samples 5000 20000] [--width 512] [--json OUT.json]

Both score N images against N captions and report recall@1/5/10 each way. OpenCLIP ranks by sorting each row of
the N × N scores (an int64 ranking as large as two score matrices, beside them); ours
(`src.trainer.evaluate.recall_at` over `score_chunks`) scores 1,024 rows at a time and counts the captions scored at
least as high as the correct one, so the N × N scores never exist at once. Random features have no ties, so the
two must give the same recalls (up to float32's mean); the benchmark checks that before it reports times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from src.trainer.evaluate import KS, recall_at, score_chunks  # noqa: E402


def ours(images: torch.Tensor, texts: torch.Tensor) -> dict[str, float]:
    return {f"{name}_R@{k}": value for name, queries, keys in (("image_to_text", images, texts),
                                                              ("text_to_image", texts, images))
            for k, value in recall_at(score_chunks(queries, keys), KS).items()}


def openclip(images: torch.Tensor, texts: torch.Tensor) -> dict[str, float]:
    from open_clip_train.train import get_clip_metrics

    metrics = get_clip_metrics(images, texts, torch.tensor(1.0))
    return {name: float(value) for name, value in metrics.items() if "_R@" in name}


def timed(fn, *args) -> tuple[float, dict[str, float]]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[5000, 20000], help="held-out set sizes N")
    parser.add_argument("--width", type=int, default=512, help="embedding width")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for n in args.samples:
        images = F.normalize(torch.randn(n, args.width), dim=1)
        texts = F.normalize(images + 0.25 * torch.randn(n, args.width), dim=1)  # paired captions, noisy: R@1 < 1
        ours_s, ours_metrics = timed(ours, images, texts)
        peer_s, peer_metrics = timed(openclip, images, texts)
        if any(abs(ours_metrics[name] - peer_metrics[name]) > 1e-6 for name in peer_metrics):
            raise SystemExit(f"N={n}: the recalls differ: ours {ours_metrics}, OpenCLIP's {peer_metrics}")
        row = {"samples": n, "ours_s": round(ours_s, 3), "openclip_s": round(peer_s, 3),
               "speedup": round(peer_s / ours_s, 2), "image_to_text_R@1": ours_metrics["image_to_text_R@1"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
