"""Offline data tools, run before training (scripts/*.py are their command lines): write image-text shards
(shard_writer.py), check shards (shard_inspect.py), pack videos into shards of frames (video_pack.py), and
generate the synthetic image and video datasets (synthetic_shapes.py, synthetic_videos.py). Tools may use
src/data/ (the shard format); the runtime data path never imports a tool."""

from src.tools.shard_inspect import inspect_shards
from src.tools.shard_writer import make_shards
from src.tools.synthetic_shapes import make_synthetic_shapes
from src.tools.synthetic_videos import make_synthetic_video_shards, make_synthetic_videos
from src.tools.video_pack import pack_videos

__all__ = [
    "inspect_shards", "make_shards", "make_synthetic_shapes", "make_synthetic_video_shards", "make_synthetic_videos",
    "pack_videos",
]
