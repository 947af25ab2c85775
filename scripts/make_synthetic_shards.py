"""Write the synthetic coloured-shapes dataset as webdataset shards (train + held-out with classes.json).

    python scripts/make_synthetic_shards.py data/shapes --train 24000 --eval 1000 --train-shards 12

The trainer does the same on first use when `data.generate=true` (the `synthetic_shapes` data config).
"""

from __future__ import annotations

import argparse
import os

from src.tools.synthetic_shapes import CLASSES, make_synthetic_shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="writes OUT_DIR/train/train-*.tar and OUT_DIR/eval/eval-*.tar")
    parser.add_argument("--train", type=int, default=24000, help="training samples")
    parser.add_argument("--eval", type=int, default=1000, help="held-out samples")
    parser.add_argument("--train-shards", type=int, default=12, help="number of training shards")
    parser.add_argument("--eval-shards", type=int, default=2, help="number of held-out shards")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0, help="seed of images and captions")
    args = parser.parse_args(argv)
    for name in ("train", "eval", "train_shards", "eval_shards", "size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    train = os.path.join(args.out_dir, "train", f"train-{{000000..{args.train_shards - 1:06d}}}.tar")
    held_out = os.path.join(args.out_dir, "eval", f"eval-{{000000..{args.eval_shards - 1:06d}}}.tar")
    make_synthetic_shapes(train, held_out, args.train, args.eval, size=args.size, seed=args.seed)
    print(f"wrote {args.train} training samples to {train}")
    print(f"wrote {args.eval} held-out samples ({len(CLASSES)} classes) to {held_out}")
    print(f"train with: python train.py experiment=quickstart data.generate=false data.shards='{train}' "
          f"data.eval_shards='{held_out}'")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
