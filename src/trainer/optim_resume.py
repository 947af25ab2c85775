"""What a resumed run does when its optimizer settings differ from those its checkpoint was saved with.

After a stop on non-finite steps the advice is to resume with a lower `optim.lr` or with `optim=stable_adamw`
(docs/reliability.md, 5), so neither change may be ignored:

- The learning-rate schedule (`optim.lr`, `optim.schedule`, `optim.warmup_steps`, `optim.cooldown_steps`,
  `optim.cooldown_shape`, `optim.min_lr_ratio`, `trainer.max_steps`) follows the configuration. The checkpoint
  gives the scheduler only its position: from the resumed step on, the learning rate is the new schedule's at that
  step. A larger `trainer.max_steps` extends a run: `constant` keeps its lr, `const_cooldown` moves its cooldown to
  the new end, and `cosine` is stretched over the new length, so its lr jumps to the new curve's (the log line
  says which).
- The optimizer itself (`optim.name`, the class `precision.scaler` picks, and every value its parameter groups
  hold: betas, eps, weight_decay, StableAdamW's clip_threshold): if any of it differs, the weights are loaded
  and the optimizer starts with fresh moments (step count 0). Moments made by another optimizer, or averaged
  with other betas, are not this optimizer's state; another class's state dict does not even load (torch's fused
  AdamW's groups say fused=True, which StableAdamW reads as "use the fused Triton kernels"). One policy for every
  hyperparameter keeps it predictable: a resume keeps the moments exactly when the optimizer is the same one.
- Which parameters train and at which learning-rate scale (`optim.layer_decay`, `optim.layer_scale_lr_scale`,
  `model.vision.lock`, `model.text.lock`, their `unlocked_blocks`, and a video run's
  `model.video.vision_trainable_blocks`): they make the parameter groups, so a change is treated as a change of the
  optimizer. The weights load (frozen ones too) and the optimizer starts fresh for the new groups.
- `optim.grad_clip_norm` is read at every step, so it applies from the resumed step with nothing to restore.

Either way one log line names each change and what it does. The settings are saved as plain data next to the
torch state dicts in the checkpoint's `optimizer` and `scheduler` entries. Checkpoints from before they were are
compared on what their state dicts hold (the learning rate, the parameter groups' hyperparameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from src.config import TrainConfig
from src.trainer.checkpoint import OptimizerState

OPTIMIZER_KIND = SCHEDULE = "settings"  # the key each entry adds to its torch state dict
# Parameter-group keys the schedule sets (and the parameters themselves): not the optimizer's identity. A
# group's lr_scale (layer decay) is part of the kind, as optim.layer_decay.
SCHEDULED = ("params", "lr", "initial_lr", "lr_scale")
# The settings that decide the parameter groups, as checkpoints from before they were saved trained with them.
GROUPS_BEFORE_SAVED = {"optim.layer_decay": 1.0, "optim.layer_scale_lr_scale": 1.0,
                       "model.vision.lock": False, "model.vision.unlocked_blocks": 0,
                       "model.text.lock": False, "model.text.unlocked_blocks": 0}
CONFIG_KEYS = {"betas": "optim.betas", "eps": "optim.eps", "weight_decay": "optim.weight_decay",
               "clip_threshold": "optim.clip_threshold"}


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key} {self.saved} -> {self.now}"


def group_settings(groups: list[dict]) -> list[dict]:
    """Each parameter group's hyperparameters, tuples as lists (a state dict gathered under FSDP2 holds lists)."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k not in SCHEDULED} for g in groups]


def optimizer_changes(
    saved_kind: dict | None, saved_groups: list[dict], kind: dict, groups: list[dict]
) -> list[Change]:
    """What differs between the optimizer a checkpoint saved and the one this run built. A setting the checkpoint
    did not record is not compared (but the groups still are)."""
    if saved_kind is not None:
        saved_kind = {**GROUPS_BEFORE_SAVED, **saved_kind}
        changes = [Change(key, saved_kind[key], value) for key, value in kind.items()
                   if key in saved_kind and saved_kind[key] != value]
        if changes:
            return changes
    old, new = group_settings(saved_groups), group_settings(groups)
    if len(old) != len(new) or any(a.keys() != b.keys() for a, b in zip(old, new)):
        # A checkpoint from before the kind was saved, of another optimizer class.
        return [Change("optimizer", "another optimizer class", kind["class"])]
    found: dict[str, Change] = {}
    for a, b in zip(old, new):
        for key in a:
            if a[key] != b[key] and key not in found:
                found[key] = Change(CONFIG_KEYS.get(key, f"the optimizer's {key}"), a[key], b[key])
    return list(found.values())


class ResumedOptimizer:
    """The checkpoint's `optimizer` entry: the torch state dict and the optimizer's kind. Loading keeps the moments
    only if the optimizer is the same one; `changes` says what differed."""

    def __init__(self, optimizer_state: OptimizerState, cfg: TrainConfig):
        self.optimizer_state = optimizer_state
        vision, text = cfg.model.vision, cfg.model.text
        self.kind = {"optim.name": str(cfg.optim.name), "class": type(optimizer_state.optimizer).__name__,
                     "optim.layer_decay": cfg.optim.layer_decay,
                     "optim.layer_scale_lr_scale": cfg.optim.layer_scale_lr_scale,
                     "model.vision.lock": vision.lock, "model.vision.unlocked_blocks": vision.unlocked_blocks,
                     "model.text.lock": text.lock, "model.text.unlocked_blocks": text.unlocked_blocks}
        if cfg.data.frames:
            self.kind["model.video.vision_trainable_blocks"] = cfg.model.video.vision_trainable_blocks
        self.changes: list[Change] = []

    def state_dict(self) -> dict:
        return {**self.optimizer_state.state_dict(), OPTIMIZER_KIND: self.kind}

    def load_state_dict(self, saved: dict) -> None:
        saved = dict(saved)
        saved_kind = saved.pop(OPTIMIZER_KIND, None)
        if "param_groups" in saved:  # absent only where FSDP2 gathered an optimizer that had no state yet
            groups = self.optimizer_state.optimizer.param_groups  # as built: nothing has loaded them yet
            self.changes = optimizer_changes(saved_kind, saved["param_groups"], self.kind, groups)
        if not self.changes:
            self.optimizer_state.load_state_dict(saved)


class ResumedSchedule:
    """The checkpoint's `scheduler` entry: LambdaLR's state dict and the schedule's settings. Loading restores
    the position only; the learning rates are the configured schedule's there. `changes` says what differed."""

    def __init__(self, scheduler: LambdaLR, cfg: TrainConfig):
        self.scheduler = scheduler
        # optim.lr is saved as set: the first group's lr is scaled by layer decay.
        self.settings = {"optim.lr": cfg.optim.lr, "optim.warmup_steps": cfg.optim.warmup_steps,
                         "optim.min_lr_ratio": cfg.optim.min_lr_ratio,
                         "trainer.max_steps": cfg.trainer.max_steps, "optim.schedule": str(cfg.optim.schedule),
                         "optim.cooldown_steps": cfg.optim.cooldown_steps,
                         "optim.cooldown_shape": str(cfg.optim.cooldown_shape)}
        self.changes: list[Change] = []

    def state_dict(self) -> dict:
        return {**self.scheduler.state_dict(), SCHEDULE: self.settings}

    def load_state_dict(self, saved: dict) -> None:
        saved = dict(saved)
        scheduler, base_lrs = self.scheduler, list(self.scheduler.base_lrs)
        old = {"optim.lr": saved["base_lrs"][0], **saved.pop(SCHEDULE, {})}
        new = {"optim.lr": base_lrs[0], **self.settings}
        # Keys a checkpoint did not record are not compared; the new schedule applies to them all the same.
        self.changes = [Change(key, old[key], value) for key, value in new.items() if key in old and old[key] != value]
        scheduler.load_state_dict(saved)  # the position (last_epoch), then the configured peak learning rates
        scheduler.base_lrs = base_lrs
        # What LambdaLR.step() would have set at this position, so an unchanged resume is bit-identical.
        for group, base, schedule in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = base, base * schedule(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def length_note(schedule: ResumedSchedule, step: int) -> str:
    """What a changed `trainer.max_steps` does to this schedule from the resumed `step`."""
    changed = {c.key: c for c in schedule.changes}
    if "trainer.max_steps" not in changed:
        return ""
    kind, old_steps = schedule.settings["optim.schedule"], changed["trainer.max_steps"].saved
    if kind == "cosine":
        return " (the cosine is re-stretched over the new trainer.max_steps: the lr moves to the new curve's)"
    if kind == "const_cooldown":
        old_cooldown = changed["optim.cooldown_steps"].saved if "optim.cooldown_steps" in changed \
            else schedule.settings["optim.cooldown_steps"]
        into = step - (old_steps - old_cooldown)
        if into > 0:
            return (f" (the cooldown moves to the new end; the checkpoint was already {into} steps into the old "
                    "cooldown, so the lr goes back up to the constant value)")
        return " (the cooldown moves to the new end)"
    return " (the constant lr goes on)"


def resume_summary(optimizer: ResumedOptimizer, schedule: ResumedSchedule, step: int) -> str | None:
    """One line naming every setting that differs from the checkpoint's and what the run does about it."""
    parts = []
    if schedule.changes:
        parts.append(", ".join(map(str, schedule.changes)) + f": the schedule follows them from step {step}"
                     + length_note(schedule, step))
    if optimizer.changes:
        parts.append(", ".join(map(str, optimizer.changes)) + ": weights loaded, the optimizer starts with fresh "
                     "moments (the checkpoint's belong to another optimizer or other parameter groups)")
    return "resumed with changed optimizer settings: " + "; ".join(parts) if parts else None
