from src.trainer.run import hydra_overrides_for_rank, run

__all__ = ["hydra_overrides_for_rank", "run"]
