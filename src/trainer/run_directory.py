"""What Hydra creates for a run before our code starts (the run directory, its .hydra/ and log, missing parents),
and its removal when the run is refused at the start, so that a refused run leaves nothing behind."""

from __future__ import annotations

import os
import shutil
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class NewRunDirectory(Callback):
    """Hydra callback (configs/train.yaml): before Hydra makes the run directory, note which of it and its parents
    do not exist yet, so that a run refused at the start removes exactly what its start created."""

    missing: list[str] = []  # the run directory first, then each parent Hydra will create

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            path = os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))
        except OmegaConfBaseException:  # it names Hydra's runtime values, unknown before the job starts
            return
        missing = []
        while not os.path.exists(path):
            missing.append(path)
            path = os.path.dirname(path)
        NewRunDirectory.missing = missing


def remove_new_run_directory(run_dir: str) -> None:
    """After a refused start: the run directory (Hydra's .hydra/ and log in it) and the parents Hydra made for it,
    if this invocation created them; a directory that existed before stays as it was."""
    missing = NewRunDirectory.missing
    if not missing or missing[0] != os.path.abspath(run_dir):
        return
    shutil.rmtree(missing[0], ignore_errors=True)
    for parent in missing[1:]:
        try:
            os.rmdir(parent)
        except OSError:  # not empty: another run's directory is in it now
            return
