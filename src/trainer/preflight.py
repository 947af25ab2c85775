"""Configuration checks that run before any expensive work (data generation, model weights, loader workers,
checkpoint loading). Every problem is reported at once, each naming its key and the fix.

This is the one place a run's configuration is checked: a choice outside its set already fails at composition
(the schema types it with its Enum), and what composition cannot see (ranges, rules between keys, the world size,
the device, the checkpoint to resume) is checked here. Check functions live where their knowledge does (the
loader's batch split, SwitchBack's devices, a CUDA graph's limits) and are called from here."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

from src.config import ModelConfig, TrainConfig
from src.data.loader import check_batch_size
from src.data.shards import check_pipe_allowed
from src.kernels.switchback.convert import check_linear_choice
from src.parallel.distributed import DistInfo
from src.parallel.mesh import check_sp_size
from src.trainer import checkpoint
from src.trainer.cuda_graph import check_cuda_graph

# (key, holds for a valid value, the valid range in words): numeric keys whose range is plain from their meaning.
RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("data.batch_size", lambda v: v >= 1, "at least 1"),
    ("data.num_workers", lambda v: v is None or v >= 0, "0 or more (or null)"),
    ("data.shuffle_buffer", lambda v: v >= 1, "at least 1"),
    ("data.frames", lambda v: v >= 0, "0 (images) or more"),
    ("data.crop_scale_min", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("data.max_bad_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("data.shard_retries", lambda v: v >= 0, "0 or more"),
    ("data.max_image_pixels", lambda v: v >= 1, "at least 1"),
    ("optim.lr", lambda v: math.isfinite(v) and v > 0, "a finite number above 0"),
    ("optim.eps", lambda v: math.isfinite(v) and v > 0, "a finite number above 0"),
    ("optim.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("optim.weight_decay", lambda v: math.isfinite(v) and v >= 0, "a finite number, 0 or more"),
    ("optim.warmup_steps", lambda v: v >= 0, "0 or more"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.grad_clip_norm", lambda v: v is None or (math.isfinite(v) and v > 0), "a finite number above 0 (or null)"),
    ("precision.fixed_scale", lambda v: math.isfinite(v) and v > 0, "a finite number above 0"),
    ("trainer.max_steps", lambda v: v >= 1, "at least 1"),
    ("trainer.log_every", lambda v: v >= 1, "at least 1"),
    ("trainer.ckpt_every", lambda v: v >= 0, "0 (end only) or more"),
    ("trainer.keep_last_k", lambda v: v >= 1, "at least 1"),
    ("trainer.eval.every", lambda v: v >= 0, "0 (end only) or more"),
    ("trainer.eval.batch_size", lambda v: v >= 1, "at least 1"),
    ("trainer.preempt_deadline_s", lambda v: v > 0, "above 0"),
    ("trainer.max_nonfinite_steps", lambda v: v is None or v >= 0, "0 or more (or null)"),
    ("model.checkpoint_every", lambda v: v >= 1, "at least 1"),
    ("model.vision.patch_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
)


def range_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    for key, valid, allowed in RANGES:
        value = functools.reduce(getattr, key.split("."), cfg)
        if not valid(value):
            problems.append(f"{key}={value} is out of range: set it to {allowed}")
    return problems


def check_heads(model: ModelConfig, video: bool) -> None:
    towers = [(f"model.{name}.width", tower.width, f"model.{name}.heads", tower.heads)
              for name, tower in (("vision", model.vision), ("text", model.text))]
    if video:  # the head's cross-attention runs at the text tower's width
        towers.append(("model.text.width", model.text.width, "model.video.head_heads", model.video.head_heads))
    bad = [f"{width_key}={width} is not divisible by {heads_key}={heads}"
           for width_key, width, heads_key, heads in towers if heads < 1 or width % heads]
    if bad:
        raise ValueError("; ".join(bad) + ": set heads to a divisor of the width (heads of 64 channels are usual)")


def check_data_parallel(data_parallel: str, video: bool) -> None:
    if data_parallel == "fsdp2" and video:
        # Its evaluation runs on one sequence-parallel group while an FSDP2 forward needs every rank, and its
        # process groups, frozen blocks and checkpoints are built and tested for DDP.
        raise ValueError("trainer.data_parallel=fsdp2 does not support video fine-tuning (data.frames > 0), which "
                         "runs on data- and sequence-parallel groups of its own: use trainer.data_parallel=ddp")


def preflight(cfg: TrainConfig, dist_info: DistInfo, run_dir: str) -> None:
    """Raises ValueError listing every problem. Collective (it finds the checkpoint to resume on rank 0)."""
    model, video = cfg.model, bool(cfg.data.frames)
    checks = [
        lambda: check_batch_size(cfg.data.batch_size, dist_info.world_size),
        lambda: check_pipe_allowed(cfg.data),
        lambda: check_sp_size(cfg.trainer.sp_size, dist_info.world_size),
        lambda: check_data_parallel(cfg.trainer.data_parallel, video),
        lambda: check_heads(model, video),
        lambda: model.linear == "standard" or check_linear_choice(model.linear, model.linear_backend, dist_info.device),
        lambda: not cfg.trainer.cuda_graph or check_cuda_graph(dist_info.device, dist_info.world_size,
                                                               cfg.precision.scaler),
        lambda: checkpoint.find_resume(
            os.path.join(run_dir, "checkpoints"), cfg.trainer.resume, cfg.trainer.resume_required
        ),
    ]
    problems = range_problems(cfg)
    for check in checks:
        try:
            check()
        except (ValueError, FileNotFoundError) as err:
            problems.append(str(err))
    if problems:
        raise ValueError("the configuration cannot run:\n- " + "\n- ".join(problems))
