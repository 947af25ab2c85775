"""train.py with faults injected from outside: the reliability tests run this script instead of train.py (also as
torchrun's worker). It wraps the Trainer's and the checkpoint writer's functions as the environment variables
below ask, then runs train.py's entry point unchanged; with none of them set it is train.py.

- `STABLECLIP_FAULT_LOSS="3:nan,4:inf"`: multiply the loss of steps 3 and 4 by NaN / Inf, so that every gradient of
  those steps is non-finite, as after a real overflow.
- `STABLECLIP_FAULT_GRAD="5:visual.conv1.weight"`: put one NaN into that parameter's gradient at step 5, after the
  backward and before unscaling and clipping (one bad tensor). Single-process runs only: on one rank of several it
  would make the ranks' updates differ.
- `STABLECLIP_FAULT_PAUSE="save:model@8"`: when a process reaches that point at step 8, print
  `fault hook: paused at save:model@8` to stderr and sleep `STABLECLIP_FAULT_PAUSE_S` seconds (default 60), so that
  a test can signal the process exactly there. Points: `step` (step N done, before the stop check), `eval`
  (evaluation started, rank 0), `save:start` (empty `step_N.tmp/` made), `save:<stem>` (`<stem>.pt` written: model,
  train_state; after the last one every file is there, not yet renamed), `save:renamed` (after the rename, before
  pruning), `prune` (old checkpoints renamed to `.deleting`, not yet removed); the `save` points and `prune` are
  rank 0's.
"""

from __future__ import annotations

import functools
import math
import os
import re
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from src.trainer import checkpoint, trainer  # noqa: E402
from src.trainer.fast_path import AUTO  # noqa: E402
from src.trainer.state import SHARED_FILES  # noqa: E402

STEP_TMP = re.compile(r"step_(\d+)\.tmp$")


def parse_steps(spec: str) -> dict[int, str]:
    """"3:nan,4:inf" -> {3: "nan", 4: "inf"}."""
    return {int(step): value for step, value in (item.split(":", 1) for item in spec.split(",") if item)}


def pause_at(pause: str | None, seconds: float):
    """pause(point, step): hold the process there if `pause` names it."""
    def pause_if(point: str, step: int) -> None:
        if pause == f"{point}@{step}":
            print(f"fault hook: paused at {pause}", file=sys.stderr, flush=True)
            time.sleep(seconds)
    return pause_if


def check_no_recorded_step(cfg) -> None:
    """A recorded step would hold the fault of the step it was recorded at, and replay it at every step: `auto`
    is turned off, an explicit `true` refused."""
    if cfg.trainer.cuda_graph == AUTO:
        cfg.trainer.cuda_graph = False
    if cfg.trainer.cuda_graph is True:
        raise ValueError("trainer.cuda_graph=true would record the injected fault's step once and replay it: unset "
                         "STABLECLIP_FAULT_LOSS and STABLECLIP_FAULT_GRAD, or set trainer.cuda_graph=false")


def inject_loss(losses: dict[int, float]) -> None:
    forward_loss = trainer.Trainer.forward_loss

    @functools.wraps(forward_loss)
    def corrupted(self, batch):
        loss = forward_loss(self, batch)
        return loss * losses[self.progress.step] if self.progress.step in losses else loss

    trainer.Trainer.forward_loss = corrupted


def inject_grad(grads: dict[int, str]) -> None:
    """Wraps the scaler's `unscale_`, which the step calls right after the backward."""
    init = trainer.Trainer.__init__

    @functools.wraps(init)
    def with_bad_gradient(self, *args, **kwargs):
        init(self, *args, **kwargs)
        unscale = self.scaler.unscale_

        def unscale_(optimizer):
            if self.progress.step in grads:
                grad = dict(self.model.named_parameters())[grads[self.progress.step]].grad
                grad.view(-1)[0] = math.nan
            unscale(optimizer)

        self.scaler.unscale_ = unscale_

    trainer.Trainer.__init__ = with_bad_gradient


def inject_pauses(pause) -> None:
    init, run_eval = trainer.Trainer.__init__, trainer.Trainer.run_eval

    @functools.wraps(init)
    def pausing_after_steps(self, *args, **kwargs):
        init(self, *args, **kwargs)
        requested = self.preemption.requested

        def stop_requested() -> bool:  # asked once per step, right after the step
            pause("step", self.progress.step)
            return requested()

        self.preemption.requested = stop_requested

    @functools.wraps(run_eval)
    def pausing_eval(self):
        if self.dist.is_main:
            pause("eval", self.progress.step)
        return run_eval(self)

    fsync_save, retire_old = checkpoint.fsync_save, checkpoint.retire_old

    @functools.wraps(fsync_save)
    def pausing_save(obj, path: str) -> None:
        step = int(STEP_TMP.search(os.path.dirname(path)).group(1))
        name = os.path.basename(path)
        if name == "rank_0.pt":  # rank 0's first file of a save: the directory is still empty
            pause("save:start", step)
        fsync_save(obj, path)
        stem = name.removesuffix(".pt")
        if stem in SHARED_FILES:
            pause(f"save:{stem}", step)

    @functools.wraps(retire_old)
    def pausing_prune(checkpoints: str, keep_last_k: int) -> None:
        # Rank 0, right after renaming the new checkpoint, which is the newest complete one.
        step = int(os.path.basename(checkpoint.complete_checkpoints(checkpoints)[-1]).removeprefix("step_"))
        pause("save:renamed", step)
        retire_old(checkpoints, keep_last_k)
        pause("prune", step)

    trainer.Trainer.__init__, trainer.Trainer.run_eval = pausing_after_steps, pausing_eval
    checkpoint.fsync_save, checkpoint.retire_old = pausing_save, pausing_prune


def install(env: dict[str, str]) -> None:
    losses = {step: float(value) for step, value in parse_steps(env.get("STABLECLIP_FAULT_LOSS", "")).items()}
    grads = parse_steps(env.get("STABLECLIP_FAULT_GRAD", ""))
    if losses or grads:
        init = trainer.Trainer.__init__

        @functools.wraps(init)
        def checked(self, cfg, *args, **kwargs):
            check_no_recorded_step(cfg)
            init(self, cfg, *args, **kwargs)

        trainer.Trainer.__init__ = checked
    if losses:
        inject_loss(losses)
    if grads:
        inject_grad(grads)
    if env.get("STABLECLIP_FAULT_PAUSE"):
        inject_pauses(pause_at(env["STABLECLIP_FAULT_PAUSE"], float(env.get("STABLECLIP_FAULT_PAUSE_S", "60"))))


if __name__ == "__main__":
    install(dict(os.environ))
    sys.argv[0] = os.path.join(ROOT, "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
