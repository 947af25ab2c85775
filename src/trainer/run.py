"""Entry point behind `train.py`: settle the run directory, then hand over to the Trainer."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterator
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from src.config import ModelConfig, TrainConfig
from src.data.device_decode import widen_cuda_queues
from src.data.loader import default_num_workers
from src.jsonl import iter_jsonl
from src.models.clip import build_model, count_parameters
from src.parallel.distributed import barrier, broadcast_object, destroy, env_rank, init_distributed
from src.tools.synthetic_shapes import make_synthetic_shapes
from src.tools.synthetic_videos import make_synthetic_video_shards
from src.trainer.checkpoint import complete_checkpoints
from src.trainer.preflight import ConfigurationError, preflight
from src.trainer.run_directory import remove_new_run_directory
from src.trainer.run_lock import lock_run_dir
from src.trainer.trainer import Trainer, image_text_parts
from src.trainer.video_trainer import video_parts

log = logging.getLogger(__name__)


def hydra_overrides_for_rank() -> list[str]:
    """Every torchrun rank runs Hydra; only rank 0 may write its outputs and logs. The others use the
    current directory as Hydra's output dir (nothing is created) and get rank 0's run directory later."""
    if env_rank() == 0:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled"]


def dry_run(cfg: ModelConfig) -> None:
    counts = count_parameters(build_model(cfg, "meta"))
    print(f"model={cfg.name}: " + ", ".join(f"{k} {v / 1e6:.2f}M parameters" for k, v in counts.items()))


def refuse(err: ConfigurationError, run_dir: str | None) -> NoReturn:
    """One message, no traceback (HYDRA_FULL_ERROR=1 gives it, as for Hydra's own errors), nothing left behind."""
    if run_dir is not None:
        remove_new_run_directory(run_dir)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    raise SystemExit(f"error: {err}")


def resolve(dict_cfg: DictConfig) -> TrainConfig:
    try:
        return OmegaConf.to_object(dict_cfg)
    except MissingMandatoryValue as err:
        raise ConfigurationError(
            f"config key {err.full_key} has no value: set it on the command line ({err.full_key}=...)"
            + (" or pick data=synthetic_shapes" if err.full_key == "data.shards" else "")
        ) from None
    except InterpolationResolutionError as err:  # e.g. model=openclip with a model.name it cannot build
        cause: BaseException = err
        while isinstance(cause, InterpolationResolutionError) and cause.__context__ is not None:
            cause = cause.__context__  # the resolver's own error, without OmegaConf's wrapping
        raise ConfigurationError(str(cause)) from None


GENERATION_LOCK = ".generating.lock"


@contextlib.contextmanager
def generation_lock(directory: str) -> Iterator[None]:
    """Held while this process writes generated data into `directory` (made if absent). Two runs started at once
    on the same generated data (the AdamW and StableAdamW runs of a comparison, say) would both write the same
    shards and break each other's; the second waits for the first, then finds the data complete. The kernel
    releases the lock when the process ends however it ends."""
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, GENERATION_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is writing the generated data in %s", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_synthetic_data(cfg: TrainConfig, is_main: bool) -> None:
    if not cfg.data.generate:
        return
    # Each generator writes this file beside the held-out shards last, when the dataset is complete.
    marker = "sizes.json" if cfg.data.frames else "classes.json"
    make = make_synthetic_video_shards if cfg.data.frames else make_synthetic_shapes
    held_out = os.path.dirname(cfg.data.eval_shards) or "."
    complete = os.path.join(held_out, marker)
    if is_main and not os.path.isfile(complete):  # complete data is only read: it may sit where nothing is written
        with generation_lock(held_out):
            if not os.path.isfile(complete):  # another run may have written it meanwhile
                make(
                    cfg.data.shards, cfg.data.eval_shards, cfg.data.generate_train_samples,
                    cfg.data.generate_eval_samples, size=cfg.model.vision.image_size, seed=cfg.data.generate_seed,
                )
    barrier()


def report_nothing_to_train(trainer: Trainer) -> None:
    """A resumed checkpoint at or past the last step leaves nothing to train: say so, rather than exit 0 silently."""
    cfg, step = trainer.cfg.trainer, trainer.progress.step
    end = cfg.max_steps if cfg.stop_at_step is None else min(cfg.stop_at_step, cfg.max_steps)
    if step < end:
        return
    key = "trainer.max_steps" if end == cfg.max_steps else "trainer.stop_at_step"
    where = f"the checkpoint {trainer.resumed_from} is at step {step}" if trainer.resumed_from else f"step {step}"
    log.warning("nothing to train: %s, and %s=%d. To train further, raise %s", where, key, end, key)


def last_evaluation(run_dir: str) -> dict[str, float]:
    """The newest evaluation's metrics in the run's metrics.jsonl (an evaluation logs them on a line of their own)."""
    latest: dict[str, float] = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    for _, record in iter_jsonl(path) if os.path.isfile(path) else ():
        evaluation = {k: v for k, v in record.items() if k.startswith("eval")}
        if evaluation:
            latest = evaluation
    return latest


def run_summary(run_dir: str, overrides: list[str]) -> str:
    """What a finished (or stopped) run prints last: where it is, its final evaluation, and the next commands."""
    checkpoints = complete_checkpoints(os.path.join(run_dir, "checkpoints"))
    kept = [o for o in overrides if not o.startswith(("trainer.run_dir=", "trainer.resume="))]
    # key='value' is already a shell word (the shell drops the quotes, train.py puts them back for Hydra).
    words = [o if re.fullmatch(r"[\w.+~]+='[^']*'", o) else shlex.quote(o) for o in kept]
    resume = " ".join(["python train.py", *words, f"trainer.run_dir={shlex.quote(run_dir)}", "trainer.resume=latest"])
    evaluation = last_evaluation(run_dir)
    lines = [
        f"run directory: {run_dir}",
        "final evaluation: " + (", ".join(f"{k}={v:.4f}" for k, v in evaluation.items()) if evaluation else "none"),
        f"newest checkpoint: {checkpoints[-1] if checkpoints else 'none'}",
        f"resume it (raise trainer.max_steps to train further): {resume}",
        f"plot it: python scripts/plot_run.py {shlex.quote(run_dir)}",
    ]
    if checkpoints:
        lines.append(f"export it to OpenCLIP: python scripts/export_openclip.py {shlex.quote(checkpoints[-1])} "
                     "-o model.safetensors")
    return "\n".join(lines)


def run(dict_cfg: DictConfig) -> None:
    try:
        cfg = resolve(dict_cfg)
    except ConfigurationError as err:
        refuse(err, HydraConfig.get().runtime.output_dir)
    if cfg.trainer.dry_run:  # needs nothing but the model: no data, no process group, no run directory
        dry_run(cfg.model)
        remove_new_run_directory(HydraConfig.get().runtime.output_dir)
        return
    if cfg.data.num_workers is None:
        cfg.data.num_workers = default_num_workers()
    widen_cuda_queues()  # before init_distributed, which starts CUDA
    dist_info = init_distributed(cfg.trainer.device)
    try:
        run_dir = HydraConfig.get().runtime.output_dir if dist_info.is_main else None
        cfg.trainer.run_dir = run_dir = broadcast_object(run_dir)
        try:
            preflight(cfg, dist_info, run_dir)
        except ConfigurationError as err:
            refuse(err, run_dir if dist_info.is_main else None)
        if dist_info.is_main:
            os.makedirs(run_dir, exist_ok=True)
        with lock_run_dir(run_dir, dist_info.is_main):  # before anything in it is written
            if dist_info.is_main:
                OmegaConf.save(OmegaConf.structured(cfg), os.path.join(run_dir, "config.yaml"))
                log.info("run directory: %s (command: %s)", run_dir, " ".join(sys.argv))
            ensure_synthetic_data(cfg, dist_info.is_main)
            trainer = Trainer(cfg, run_dir, dist_info, video_parts if cfg.data.frames else image_text_parts)
            if dist_info.is_main:
                report_nothing_to_train(trainer)
            trainer.fit()
            if dist_info.is_main:
                print(run_summary(run_dir, HydraConfig.get().overrides.task), flush=True)
    finally:
        destroy()
