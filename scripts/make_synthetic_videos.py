"""Write short mp4 clips of coloured shapes moving left, right, up or down, with captions.

    python scripts/make_synthetic_videos.py data/moving_shapes --clips 2000 [--frames 32] [--size 64] [--fps 16]
        [--anywhere]

Writes OUT_DIR/clip_000000.mp4 ... (H.264) and OUT_DIR/captions.csv with the columns path, caption and
direction. A single frame cannot tell "moving left" from "moving right": only the order of frames can. With
--anywhere the shapes cross the frame at a random row or column, so averaging the frames does not even tell
horizontal from vertical motion (the video fine-tuning dataset is made so).
"""

from __future__ import annotations

import argparse

from src.tools.synthetic_videos import make_synthetic_videos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="folder for the clips and captions.csv")
    parser.add_argument("--clips", type=int, default=2000, help="number of clips")
    parser.add_argument("--frames", type=int, default=32, help="frames per clip")
    parser.add_argument("--size", type=int, default=64, help="frame side in pixels (even)")
    parser.add_argument("--fps", type=int, default=16, help="frame rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of shapes, colours, directions, captions")
    parser.add_argument("--anywhere", action="store_true", help="cross at a random row or column, not the middle")
    args = parser.parse_args(argv)
    try:
        table = make_synthetic_videos(args.out_dir, args.clips, args.frames, args.size, args.fps, args.seed,
                                      args.anywhere)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.clips} clips and {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
