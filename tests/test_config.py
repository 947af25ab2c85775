import os
import subprocess
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from src.config import AttentionBackend, Choice, DataParallel, OptimizerName
from src.parallel.distributed import DistInfo
from src.trainer.preflight import preflight
from tests.conftest import CONFIGS, ROOT, compose_config

GROUPS = ["model", "data", "optim", "precision", "trainer", "logger", "spikes", "experiment"]
CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def options(group: str) -> list[str]:
    # A group's base.yaml holds the keys its options share; it is no option of its own.
    return sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(CONFIGS, group)) if f != "base.yaml")


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


@pytest.mark.parametrize("override,allowed", [
    ("optim.name=sgd", OptimizerName.values()),
    ("trainer.data_parallel=zero3", DataParallel.values()),
    ("model.attention_backend=fast", AttentionBackend.values()),
])
def test_a_choice_outside_its_set_fails_at_composition_naming_key_and_values(override, allowed):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config([override])
    message = str(err.value.__cause__)
    assert override.split("=")[0] in message and f"expected one of [{', '.join(allowed)}]" in message


def test_choices_compose_to_enum_members_that_equal_their_strings():
    cfg = compose_config(["experiment=quickstart"])
    assert isinstance(cfg.model.linear, Choice) and cfg.model.linear == "standard"
    assert f"{cfg.precision.dtype}" == str(cfg.precision.dtype) == "fp32" and {"fp32": 1}[cfg.precision.dtype] == 1


def preflight_problems(tmp_path, overrides: list[str]) -> str:
    cfg = compose_config(["experiment=quickstart", *overrides])
    with pytest.raises(ValueError, match="the configuration cannot run") as err:
        preflight(cfg, CPU, str(tmp_path))
    return str(err.value)


def test_preflight_reports_every_out_of_range_key_with_its_range(tmp_path):
    message = preflight_problems(tmp_path, [
        "data.batch_size=0", "optim.lr=-1", "trainer.log_every=0", "trainer.max_steps=0", "optim.betas=[0.9,1.5]",
        "data.crop_scale_min=0", "trainer.keep_last_k=0", "model.checkpoint_every=0",
    ])
    for problem in ("data.batch_size=0 is out of range: set it to at least 1",
                    "optim.lr=-1.0 is out of range: set it to a finite number above 0",
                    "trainer.log_every=0 is out of range: set it to at least 1",
                    "trainer.max_steps=0 is out of range", "optim.betas=[0.9, 1.5] is out of range",
                    "data.crop_scale_min=0.0 is out of range", "trainer.keep_last_k=0 is out of range",
                    "model.checkpoint_every=0 is out of range"):
        assert problem in message, problem


def test_preflight_rejects_a_non_finite_learning_rate(tmp_path):
    assert "optim.lr=nan is out of range" in preflight_problems(tmp_path, ["optim.lr=nan"])


def test_preflight_passes_every_preset(tmp_path):
    for experiment in options("experiment"):
        preflight(compose_config([f"experiment={experiment}"]), CPU, str(tmp_path))


def test_preflight_rejects_fsdp2_for_video(tmp_path):
    cfg = compose_config(["experiment=video_finetune", "trainer.data_parallel=fsdp2"])
    with pytest.raises(ValueError, match="fsdp2 does not support video fine-tuning"):
        preflight(cfg, CPU, str(tmp_path))


def test_preflight_checks_the_video_heads_divide_the_text_width(tmp_path):
    message = preflight_problems(tmp_path, ["data=synthetic_videos", "model.video.head_heads=5"])
    assert "model.text.width=96 is not divisible by model.video.head_heads=5" in message
    image_only = compose_config(["experiment=quickstart", "model.video.head_heads=5"])
    preflight(image_only, CPU, str(tmp_path))  # an image run builds no video head


def test_preflight_checks_cuda_graph_limits_once_at_start(tmp_path):
    message = preflight_problems(tmp_path, ["trainer.cuda_graph=true"])
    assert "trainer.cuda_graph=true records CUDA kernels, but the trainer runs on cpu" in message


def test_run_outputs_hold_plain_strings(tmp_path):
    """config.yaml and W&B's config show a choice as its string; nothing saved with torch.save holds an Enum."""
    from omegaconf import OmegaConf

    cfg = compose_config(["experiment=quickstart"])
    OmegaConf.save(OmegaConf.structured(cfg), tmp_path / "config.yaml")
    assert "  linear: standard\n" in (tmp_path / "config.yaml").read_text()
    as_dict = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert type(as_dict["model"]["linear"]) is str
