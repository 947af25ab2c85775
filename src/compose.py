"""A run's settings from command-line tokens, in-process, for tests, benchmarks and notebooks that build a Trainer
or its parts without `train.py`: the config from Hydra overrides, as `train.py` composes it, and module-level
settings that are not config keys (kernel launch parameters, `auto`'s thresholds) for the duration of a block."""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
from collections.abc import Iterator

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from src.config import TrainConfig, register_configs

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def compose_unresolved(overrides: list[str]) -> DictConfig:
    """The config Hydra hands `train.py OVERRIDES...`'s `run`: interpolations and checks left to `run`."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("train", overrides=overrides)


def compose_config(overrides: list[str]) -> TrainConfig:
    """The typed config of `train.py OVERRIDES...` (e.g. ["experiment=quickstart", "trainer.max_steps=10"])."""
    return OmegaConf.to_object(compose_unresolved(overrides))


@contextlib.contextmanager
def module_settings(assignments: list[str]) -> Iterator[None]:
    """Set each `MODULE.NAME=VALUE` (VALUE a Python literal) for the duration of the block, then put the old
    values back. A name the module does not have is an error, not a new attribute: a typo would otherwise time
    the defaults under another name."""
    saved = []
    try:
        for assignment in assignments:
            target, equals, literal = assignment.partition("=")
            module_name, _, name = target.rpartition(".")
            if not equals or not module_name:
                raise ValueError(f"{assignment!r} is not MODULE.NAME=VALUE, e.g. src.kernels.residual_norm.WARPS=4")
            module = importlib.import_module(module_name)
            if not hasattr(module, name):
                raise ValueError(f"{assignment!r}: {module_name} has no {name!r}")
            try:
                value = ast.literal_eval(literal)
            except (ValueError, SyntaxError) as error:
                raise ValueError(f"{assignment!r}: {literal!r} is not a Python literal") from error
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
