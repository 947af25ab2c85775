"""The runtime data path, from shards to batches: shards.py (shard lists and each reader's share) -> reader.py
(one resumable stream of raw samples) -> loader.py (the training and evaluation loaders) -> image_text.py /
video_text.py (one sample decoded). Offline tools that write or check shards live in src/tools/."""

from src.data.loader import TrainLoader, eval_batches

__all__ = ["TrainLoader", "eval_batches"]
