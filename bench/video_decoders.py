"""PyAV vs torchcodec for the mp4-in-shard path: T frames at TSN segment times per clip, from the file bytes.

    python bench/video_decoders.py VIDEO [VIDEO ...] [--frames 8] [--passes 3] [--json out.json]

Both decoders get the same bytes and the same times and use one decoding thread; PyAV through our loader's
`video_frames` (one seek, then decoding forward), torchcodec through `VideoDecoder(..., seek_mode="approximate")`
and `get_frames_played_at`. torchcodec needs the system's FFmpeg shared libraries (e.g. Debian's libavcodec59).
Reports milliseconds per clip, interleaving the two decoders pass by pass.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from src.data.video_text import segment_times, video_frames


def torchcodec_frames(data: bytes, frames: int, rng: random.Random) -> torch.Tensor:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(data, seek_mode="approximate", num_ffmpeg_threads=1)
    duration = decoder.metadata.duration_seconds
    times = [min(t, duration - 1e-3) for t in segment_times(duration, frames, rng)]
    return decoder.get_frames_played_at(times).data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("videos", nargs="+")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clips = [open(path, "rb").read() for path in args.videos]
    decoders = {"pyav": lambda d, r: video_frames(d, args.frames, r), "torchcodec": lambda d, r: torchcodec_frames(
        d, args.frames, r)}
    seconds = {name: 0.0 for name in decoders}
    for p in range(args.passes):
        for name, decode in decoders.items():
            start = time.perf_counter()
            for i, data in enumerate(clips):
                out = decode(data, random.Random(f"{p}-{i}"))
                assert out.shape[0] == args.frames
            seconds[name] += time.perf_counter() - start
    result = {name: 1e3 * s / (args.passes * len(clips)) for name, s in seconds.items()}
    print(" ".join(f"{name}: {ms:.1f} ms/clip" for name, ms in result.items()),
          f"(pyav / torchcodec = {result['pyav'] / result['torchcodec']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms_per_clip": result, "clips": len(clips), "frames": args.frames, "command": " ".join(sys.argv),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_average": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
