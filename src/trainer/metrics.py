"""One metrics logger with several sinks: JSONL (always), W&B and TensorBoard (optional), a progress bar; rank 0
only. Every sink gets the same metric names as metrics.jsonl."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets

from tqdm import tqdm

from src.config import LoggerConfig
from src.jsonl import iter_jsonl

log = logging.getLogger(__name__)


def truncate_jsonl(path: str, start_step: int, keep_eval: bool) -> None:
    """Keep only what a run resumed at `start_step` will not log again: the steps before it, and, with
    `keep_eval`, evaluations at `start_step` itself (a checkpoint that does not owe its step's evaluation: one
    written before the checkpoint came first, when evaluations ran before it). So each step is logged once."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:  # a crash mid-write can leave a torn last line: cut it off
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
    kept = [record for _, record in iter_jsonl(path) if record.get("step", -1) < start_step
            or (keep_eval and record.get("step") == start_step and any(key.startswith("eval/") for key in record))]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in kept)
    os.replace(tmp, path)


def jsonable(value):
    """JSON has no NaN or Infinity; keep them readable as strings rather than writing invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricLogger:
    def __init__(
        self, run_dir: str, cfg: LoggerConfig, *, enabled: bool, config: dict, start_step: int,
        max_steps: int, progress: bool, repeat_eval: bool = False,
    ):
        self.enabled = enabled
        self.run_dir = run_dir
        self.wandb_run = None
        self.tensorboard = None
        self.bar = None
        if not enabled:
            return
        self.files = {}
        for name in ("metrics.jsonl", "spikes.jsonl"):
            path = os.path.join(run_dir, name)
            truncate_jsonl(path, start_step, keep_eval=not repeat_eval)
            self.files[name] = open(path, "a")
        if cfg.wandb:
            self.wandb_run = self._init_wandb(cfg, config)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: imported when asked for

            # purge_step drops what an earlier attempt logged from the resumed step on, as metrics.jsonl is cut.
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start_step)
        if progress:
            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def _init_wandb(self, cfg: LoggerConfig, config: dict):
        import wandb  # heavy, and absent on some machines: imported only when asked for

        id_path = os.path.join(self.run_dir, "wandb_run_id")
        run_id = open(id_path).read().strip() if os.path.exists(id_path) else secrets.token_hex(4)
        with open(id_path, "w") as f:
            f.write(run_id)
        run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.run_name, mode=cfg.mode, dir=self.run_dir,
            config=config, id=run_id, resume="allow",
        )
        # Every panel, spike/* included, plots against the training step.
        run.define_metric("train/step")
        run.define_metric("*", step_metric="train/step")
        return run

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.event("metrics.jsonl", {"step": step, **metrics})
        if self.wandb_run is not None:
            self.wandb_run.log({"train/step": step, **metrics})
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(name, value, step)

    def event(self, filename: str, record: dict) -> None:
        """Append one record to a JSONL file of the run directory."""
        if self.enabled:
            self.files[filename].write(json.dumps({k: jsonable(v) for k, v in record.items()}) + "\n")

    def alert(self, title: str, text: str, wait_s: int) -> None:
        """A W&B alert (email/Slack, per the user's W&B settings), at most one per title every `wait_s`."""
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.alert(title=title, text=text, level=wandb.AlertLevel.WARN, wait_duration=wait_s)

    def flush(self, step: int, summary: dict) -> None:
        """Called every `log_every` steps: persist lines and refresh the progress bar."""
        if not self.enabled:
            return
        for f in self.files.values():
            f.flush()
        if self.tensorboard is not None:
            self.tensorboard.flush()
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({k.split("/")[-1]: f"{v:.4g}" for k, v in summary.items()}, refresh=True)

    def message(self, text: str) -> None:
        if self.enabled:
            log.info(text)

    def close(self) -> None:
        if not self.enabled:
            return
        for f in self.files.values():
            f.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
