from src.optim.factory import build_optimizer, optimizer_step
from src.optim.param_groups import param_groups_for_weight_decay
from src.optim.schedule import build_scheduler

__all__ = ["build_optimizer", "build_scheduler", "optimizer_step", "param_groups_for_weight_decay"]
