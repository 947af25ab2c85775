"""The training run: `run` (train.py's entry: resolve the config, preflight, build, train) and `Trainer` (the
loop, with checkpointing, evaluation, metrics, spike detection and preemption in the modules beside it)."""

from src.trainer.run import hydra_overrides_for_rank, run
from src.trainer.trainer import Trainer

__all__ = ["Trainer", "hydra_overrides_for_rank", "run"]
