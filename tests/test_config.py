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
    if group in ("model", "data", "optim", "precision") and (group, option) != ("model", "openclip"):
        assert getattr(cfg, group).name == option
    if (group, option) == ("model", "openclip"):  # named by the open_clip architecture it builds
        assert cfg.model.name == "ViT-B-32" and cfg.model.vision.patch_size == 32
    if group == "logger":  # its options switch sinks on; several merge at once
        assert (cfg.logger.wandb, cfg.logger.tensorboard) == (option == "wandb", option == "tensorboard")


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
    assert "train.py -m " in out and "--cfg job" in out and "hydra.verbose=true" in out


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
    """Every preset a CPU can run; the *_gpu ones are sized for one GPU (a CPU's preflight rightly refuses their
    memory) and run at CPU size in tests/test_gpu_presets.py."""
    cpu_presets = [name for name in options("experiment") if not name.endswith("_gpu")]
    assert len(cpu_presets) >= 3 and len(options("experiment")) - len(cpu_presets) == 2
    for experiment in cpu_presets:
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


NUMERIC = (int, float, int | None, float | None, list[float])
CHECKED_OUTSIDE_RANGES = {"trainer.sp_size"}  # against the world size: check_sp_size


def test_every_numeric_key_has_a_valid_range():
    from src.config import schema_keys
    from src.trainer.preflight import RANGES

    numeric = {key for key, hint in schema_keys().items() if hint in NUMERIC}
    assert numeric - {key for key, _, _ in RANGES} - CHECKED_OUTSIDE_RANGES == set()


@pytest.mark.parametrize("overrides,message", [
    (["data.batch_size=0"], "data.batch_size=0 is out of range: set it to at least 1"),
    (["data.batch_size=-8"], "data.batch_size=-8 is out of range: set it to at least 1"),
    (["data.mode=resampled", "data.samples_per_epoch=0"], "data.samples_per_epoch=0 is out of range: set it to at "
                                                          "least 1"),
    (["data.shuffle_buffer=0"], "data.shuffle_buffer=0 is out of range: set it to at least 1"),
    (["trainer.log_every=0"], "trainer.log_every=0 is out of range: set it to at least 1"),
    (["data.num_workers=-1"], "data.num_workers=-1 is out of range: set it to 0 or more"),
    (["optim.lr=nan"], "optim.lr=nan is out of range: set it to a finite number above 0"),
    (["optim.lr=inf"], "optim.lr=inf is out of range: set it to a finite number above 0"),
    (["optim.lr=0"], "optim.lr=0.0 is out of range: set it to a finite number above 0"),
    (["model.vision.ln_pre_gain=0"], "model.vision.ln_pre_gain=0.0 is out of range: set it to a finite number above 0"),
    (["data.crop_scale_min=0"], "data.crop_scale_min=0.0 is out of range: set it to in (0, 1]"),
    (["data.crop_scale_min=1.5"], "data.crop_scale_min=1.5 is out of range: set it to in (0, 1]"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 is out of range: set it to at least 1"),
    (["trainer.max_steps=-5"], "trainer.max_steps=-5 is out of range: set it to at least 1"),
    (["trainer.ckpt_every=-1"], "trainer.ckpt_every=-1 is out of range: set it to 0 (end only) or more"),
    (["trainer.keep_last_k=-2"], "trainer.keep_last_k=-2 is out of range: set it to at least 1"),
    (["spikes.window=1"], "spikes.window=1 is out of range"),
    (["trainer.seed=-1"], "trainer.seed=-1 is out of range"),
    (["model.vision.patch_size=5"], "model.vision.image_size=32, model.vision.patch_size=5: model.vision.image_size "
                                    "must be a multiple of model.vision.patch_size"),
    (["spikes.attribution_min=9"], "spikes.attribution_min must not exceed spikes.attribution_max"),
])
def test_preflight_refuses_each_value_that_makes_no_sense(tmp_path, overrides, message):
    assert message in preflight_problems(tmp_path, overrides)


def test_keys_added_with_plus_that_the_schema_lacks_are_refused_with_the_closest_key(tmp_path):
    message = preflight_problems(tmp_path, ["+trainer.max_stepz=3", "++trainer.lr=0.1", "+foo=1"])
    assert "trainer.max_stepz is not a config key: did you mean trainer.max_steps?" in message
    assert "trainer.lr is not a config key: did you mean optim.lr?" in message
    assert "foo is not a config key" in message


def test_preflight_checks_the_inputs_it_can_reach_cheaply(tmp_path, shapes):
    """Missing training and held-out shards, a zero-shot run without classes.json and a missing init_from are
    found before the first step, each naming its key."""
    import shutil

    from tests.conftest import data_overrides

    eval_dir = tmp_path / "eval"
    shutil.copytree(os.path.dirname(shapes["eval_shards"]), eval_dir)
    (eval_dir / "classes.json").unlink()
    train_pattern = shapes["shards"].replace("000007", "000009")  # shards 8 and 9 do not exist
    message = preflight_problems(tmp_path, [
        *data_overrides(shapes), f"data.shards='{train_pattern}'",
        f"data.eval_shards='{eval_dir}/eval-{{000000..000002}}.tar'", f"model.init_from={tmp_path}/nothing",
    ])
    assert "data.shards=" in message and "2 of 10 shards do not exist" in message
    assert "data.eval_shards=" in message and "1 of 3 shards do not exist" in message
    assert f"model.init_from='{tmp_path}/nothing' names no checkpoint" in message
    held_out = [*data_overrides(shapes), f"data.eval_shards='{eval_dir}/eval-{{000000..000001}}.tar'"]
    message = preflight_problems(tmp_path, held_out)
    assert (f"eval.held_out.zeroshot=true needs classes.json beside data.eval_shards, and {eval_dir}/classes.json "
            "does not exist") in message and "or set eval.held_out.zeroshot=false" in message
    (eval_dir / "classes.json").write_text("{not json")
    assert f"{eval_dir}/classes.json cannot be read as a class list" in preflight_problems(tmp_path, held_out)
    preflight(compose_config(["experiment=quickstart", *held_out, "eval.held_out.zeroshot=false"]), CPU, str(tmp_path))


def test_no_training_data_is_found_by_preflight(tmp_path):
    cfg = compose_config(["model=vit_huge", "optim=stable_adamw"])
    with pytest.raises(ValueError, match="no training data: set data.shards"):
        preflight(cfg, CPU, str(tmp_path))


def test_preflight_logs_the_expected_memory(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="src.trainer.preflight"):
        preflight(compose_config(["experiment=quickstart"]), CPU, str(tmp_path))
    line = next(r.getMessage() for r in caplog.records if "expected memory per rank" in r.getMessage())
    assert "5.4M parameters" in line and "optimizer state" in line and "per sample x 128 samples" in line
    assert "GB available: this machine's" in line


def test_the_memory_check_refuses_vit_b32_at_batch_4096_on_24_gb_and_passes_what_fits():
    from src.trainer.memory import check_memory, estimate_memory

    estimate = estimate_memory(compose_config(["model=vit_b32", "data.shards=x", "data.batch_size=4096"]), 1)
    assert estimate.parameters == 151_308_033 and estimate.optimizer_bytes == 8 * estimate.parameters
    with pytest.raises(ValueError, match=r"the run needs about 14\d\.\d GB per rank") as err:
        check_memory(estimate, 24e9, "this machine's RAM")
    assert "more than 1.5x the 24.0 GB of this machine's RAM" in str(err.value)
    assert "a smaller data.batch_size (about 98" in str(err.value) and "model.checkpoint_policy=full" in str(err.value)
    # Checkpointing keeps about a block input per block: the same run then fits 24 GB.
    check_memory(estimate_memory(compose_config(["model=vit_b32", "data.shards=x", "data.batch_size=4096",
                                                 "model.checkpoint_policy=full"]), 1), 24e9, "RAM")
    # FSDP2 shards the weights, gradients and moments; the activations are per rank anyway.
    sharded = estimate_memory(compose_config(["model=vit_b32", "data.shards=x", "trainer.data_parallel=fsdp2"]), 8)
    assert sharded.optimizer_bytes == estimate.optimizer_bytes / 8 and sharded.samples == 512


@pytest.mark.parametrize("model, batch, overrides, peak_gib", [
    ("vit_b32", 1024, [], 33.27), ("vit_b32", 1024, ["model.checkpoint_policy=full"], 7.44),
    ("vit_b32", 1024, ["precision=fp32"], 60.11), ("vit_b16", 512, ["model.checkpoint_policy=selective"], 27.61),
    ("vit_l14", 256, [], 64.66), ("vit_l14", 256, ["model.checkpoint_policy=full"], 14.30),
    ("vit_huge", 128, [], 65.61), ("vit_huge", 128, ["model.checkpoint_policy=full"], 19.43),
])
def test_the_memory_estimate_is_near_the_peaks_measured_on_a_gpu(model, batch, overrides, peak_gib):
    """The peaks of docs/BENCHMARKS.md's "Memory estimate" table (H200, bench/throughput.py): the estimate stays
    within 15% of each, so preflight's 1.5x margin refuses only runs that cannot fit."""
    from src.trainer.memory import estimate_memory

    cfg = compose_config([f"model={model}", f"data.batch_size={batch}", "data.shards=x", *overrides])
    assert estimate_memory(cfg, 1).total / 2**30 == pytest.approx(peak_gib, rel=0.15)


def test_a_logger_whose_package_is_missing_is_refused_with_the_install_command(monkeypatch):
    import importlib.util

    from src.trainer.preflight import check_loggers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name))
    with pytest.raises(ValueError, match=r"logger.tensorboard=true but tensorboard is not installed: pip install"):
        check_loggers(compose_config(["logger=[wandb,tensorboard]"]).logger)
    check_loggers(compose_config(["logger=wandb"]).logger)
