import os
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from tests.conftest import CONFIGS, ROOT, compose_config

GROUPS = ["model", "data", "optim", "precision", "trainer", "logger", "experiment"]


def options(group: str) -> list[str]:
    return sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(CONFIGS, group)))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option):
    cfg = compose_config([f"{group}={option}", "data.shards=x.tar"])
    if group in ("model", "data", "optim", "precision", "logger"):
        assert getattr(cfg, group).name == option


def test_model_presets_match_openclip_architectures():
    huge = compose_config(["model=vit_huge", "data=synthetic_shapes"]).model
    assert (huge.vision.width, huge.vision.layers, huge.vision.patch_size) == (1280, 32, 14)
    assert (huge.text.width, huge.embed_dim) == (1024, 1024)


def test_experiment_overrides_groups_and_name():
    cfg = compose_config(["experiment=quickstart"])
    assert cfg.model.name == "vit_tiny" and cfg.data.name == "synthetic_shapes"
    assert cfg.experiment_name == "quickstart" and cfg.precision.dtype == "fp32"


def test_misspelled_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["optim.learning_rate=0.1"])
    assert "learning_rate" in str(err.value.__cause__ or err.value)


def test_wrong_type_fails_naming_key():
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_config(["trainer.max_steps=lots"])
    assert "max_steps" in str(err.value) + str(err.value.__cause__)


def test_help_lists_groups():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for group in GROUPS:
        assert f"\n{group}: " in out


def test_dry_run_builds_vit_huge_on_meta_device():
    out = subprocess.run(
        [sys.executable, "train.py", "model=vit_huge", "trainer.dry_run=true", "hydra.run.dir=/tmp/dry"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "total 986.24M parameters" in out.stdout


def test_missing_shards_say_which_key():
    out = subprocess.run(
        [sys.executable, "train.py", "data=laion_wds", "hydra.run.dir=/tmp/none"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0 and "data.shards" in out.stderr
