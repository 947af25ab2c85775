"""Configuration checks that run before any expensive work (data generation, model weights, loader workers,
checkpoint loading). Every problem is reported at once, each naming its key and the fix."""

from __future__ import annotations

import os

from src.config import ModelConfig, TrainConfig
from src.data.loader import check_batch_size
from src.kernels.switchback.convert import check_linear_choice
from src.optim.factory import check_optimizer_name
from src.parallel.distributed import DistInfo
from src.parallel.mesh import check_sp_size
from src.trainer import checkpoint
from src.trainer.cuda_graph import check_cuda_graph

DATA_PARALLEL = ("ddp", "fsdp2")


def check_heads(model: ModelConfig) -> None:
    bad = [f"model.{name}.width={tower.width} is not divisible by model.{name}.heads={tower.heads}"
           for name, tower in (("vision", model.vision), ("text", model.text))
           if tower.heads < 1 or tower.width % tower.heads]
    if bad:
        raise ValueError("; ".join(bad) + ": set heads to a divisor of the width (heads of 64 channels are usual)")


def check_data_parallel(data_parallel: str, video: bool) -> None:
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"trainer.data_parallel={data_parallel!r} is not one of {', '.join(DATA_PARALLEL)}")
    if data_parallel == "fsdp2" and video:
        # Its evaluation runs on one sequence-parallel group while an FSDP2 forward needs every rank, and its
        # process groups, frozen blocks and checkpoints are built and tested for DDP.
        raise ValueError("trainer.data_parallel=fsdp2 does not support video fine-tuning (data.frames > 0), which "
                         "runs on data- and sequence-parallel groups of its own: use trainer.data_parallel=ddp")


def preflight(cfg: TrainConfig, dist_info: DistInfo, run_dir: str) -> None:
    """Raises ValueError listing every problem. Collective (it finds the checkpoint to resume on rank 0)."""
    model = cfg.model
    checks = [
        lambda: check_batch_size(cfg.data.batch_size, dist_info.world_size),
        lambda: check_sp_size(cfg.trainer.sp_size, dist_info.world_size),
        lambda: check_data_parallel(cfg.trainer.data_parallel, video=bool(cfg.data.frames)),
        lambda: check_heads(model),
        lambda: model.linear == "standard" or check_linear_choice(model.linear, model.linear_backend, dist_info.device),
        lambda: check_optimizer_name(cfg.optim.name),
        lambda: not cfg.trainer.cuda_graph or check_cuda_graph(dist_info.device, dist_info.world_size,
                                                               cfg.precision.scaler),
        lambda: checkpoint.find_resume(
            os.path.join(run_dir, "checkpoints"), cfg.trainer.resume, cfg.trainer.resume_required
        ),
    ]
    problems = []
    for check in checks:
        try:
            check()
        except (ValueError, FileNotFoundError) as err:
            problems.append(str(err))
    if problems:
        raise ValueError("the configuration cannot run:\n- " + "\n- ".join(problems))
