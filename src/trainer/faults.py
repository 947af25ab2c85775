"""Fault-injection hooks for `tests/reliability/`, set through environment variables of a real training
process. They are read once, at import; unset (always, outside those tests) they do nothing.

- `STABLECLIP_FAULT_LOSS="3:nan,4:inf"`: multiply the loss of steps 3 and 4 by NaN / Inf, so that every
  gradient of those steps is non-finite, as after a real overflow.
- `STABLECLIP_FAULT_GRAD="5:visual.conv1.weight"`: put one NaN into that parameter's gradient at step 5 (one
  bad tensor). Single-process runs only: on one rank of several it would make the ranks' updates differ.
- `STABLECLIP_FAULT_PAUSE="save:model@8"`: when a process reaches that point at step 8, print
  `fault hook: paused at save:model@8` to stderr and sleep `STABLECLIP_FAULT_PAUSE_S` seconds (default 60), so
  that a test can signal the process exactly there. Points: `step` (step N done, before the stop check), `eval`
  (evaluation started, rank 0), `save:start` (empty `step_N.tmp/` made), `save:<stem>` (`<stem>.pt` written: model,
  train_state; after the last one every file is there, not yet renamed), `save:renamed` (after the rename, before
  pruning), `prune` (old checkpoints renamed to `.deleting`, not yet removed); the `save` points and `prune` are
  rank 0's.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch


def parse_steps(spec: str) -> dict[int, str]:
    """"3:nan,4:inf" -> {3: "nan", 4: "inf"}."""
    return {int(step): value for step, value in (item.split(":", 1) for item in spec.split(",") if item)}


LOSS = {step: float(value) for step, value in parse_steps(os.environ.get("STABLECLIP_FAULT_LOSS", "")).items()}
GRAD = parse_steps(os.environ.get("STABLECLIP_FAULT_GRAD", ""))
PAUSE = os.environ.get("STABLECLIP_FAULT_PAUSE")
PAUSE_S = float(os.environ.get("STABLECLIP_FAULT_PAUSE_S", "60"))


def corrupt_loss(step: int, loss: torch.Tensor) -> torch.Tensor:
    return loss * LOSS[step] if step in LOSS else loss


def corrupt_grad(step: int, model: torch.nn.Module) -> None:
    if step in GRAD:
        grad = dict(model.named_parameters())[GRAD[step]].grad
        grad.view(-1)[0] = math.nan


def pause(point: str, step: int) -> None:
    if PAUSE == f"{point}@{step}":
        print(f"fault hook: paused at {PAUSE}", file=sys.stderr, flush=True)
        time.sleep(PAUSE_S)
