"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML files under `configs/` are merged onto `TrainConfig`, so a misspelled key, a value of the wrong type
or a choice outside its Enum fails when the config is composed, with the error naming the key. Every default
and the one-line meaning of each key live in the YAML files (tests/test_config_defaults.py enforces it); the
dataclasses only fix names and types and hold no values of their own, so a config is built by composing it
(src.trainer.run, tests/conftest.py's compose_config), never by calling a dataclass with partial arguments.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from src.openclip_architectures import openclip_value


class Choice(str, Enum):
    """A config key's set of allowed values. OmegaConf checks a YAML or command-line string against the member
    names at composition; each member is also the string itself (it compares, hashes, formats and prints as its
    value), so code reads `cfg.model.linear == "standard"` and writes plain strings to logs and checkpoints."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class CheckpointPolicy(Choice):
    none = "none"
    full = "full"
    selective = "selective"


class AttentionBackend(Choice):
    auto = "auto"
    triton_short = "triton_short"
    triton_tiled = "triton_tiled"
    flash = "flash"
    cudnn = "cudnn"
    efficient = "efficient"
    math = "math"


class ResidualNorm(Choice):
    auto = "auto"
    fused = "fused"
    unfused = "unfused"


class GeluForm(Choice):
    auto = "auto"
    erf = "erf"
    rational = "rational"


class Linear(Choice):
    standard = "standard"
    switchback_int8 = "switchback_int8"
    switchback_int8_memeff = "switchback_int8_memeff"
    switchback_int8_vectorwise = "switchback_int8_vectorwise"
    switchback_fp8 = "switchback_fp8"


class LinearBackend(Choice):
    cuda = "cuda"
    reference = "reference"


class VideoHead(Choice):
    xattn = "xattn"
    mean = "mean"


class FrameTokens(Choice):
    patches = "patches"
    cls = "cls"
    mean = "mean"


class TextQueries(Choice):
    all = "all"
    eot = "eot"


class XAttnImpl(Choice):
    lv_xattn = "lv_xattn"
    lv_xattn_gather = "lv_xattn_gather"
    ring = "ring"
    local = "local"


class DataMode(Choice):
    epoch = "epoch"
    resampled = "resampled"


class Interpolation(Choice):
    bicubic = "bicubic"
    bilinear = "bilinear"


class ResizeMode(Choice):
    crop = "crop"
    squash = "squash"


class ResizeOn(Choice):
    auto = "auto"
    workers = "workers"
    device = "device"


class DecodeOn(Choice):
    auto = "auto"
    workers = "workers"
    device = "device"


class LrSchedule(Choice):
    cosine = "cosine"
    constant = "constant"
    const_cooldown = "const_cooldown"


class CooldownShape(Choice):
    linear = "linear"
    sqrt = "sqrt"
    cosine = "cosine"


class OptimizerName(Choice):
    adamw = "adamw"
    stable_adamw = "stable_adamw"
    adamw8bit = "adamw8bit"


class Dtype(Choice):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Scaler(Choice):
    none = "none"
    dynamic = "dynamic"
    fixed = "fixed"


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DataParallel(Choice):
    ddp = "ddp"
    fsdp2 = "fsdp2"


class LossName(Choice):
    clip = "clip"
    siglip = "siglip"


class WandbMode(Choice):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class VisionConfig:
    image_size: int
    patch_size: int
    width: int
    layers: int
    heads: int
    mlp_ratio: float
    patch_dropout: float
    ln_pre_gain: float | None
    lock: bool
    unlocked_blocks: int


@dataclass
class TextConfig:
    context_length: int
    vocab_size: int
    width: int
    layers: int
    heads: int
    mlp_ratio: float
    lock: bool
    unlocked_blocks: int


@dataclass
class VideoConfig:
    """The video-language model on top of CLIP (src/models/video_clip.py); read when data.frames > 0."""

    head: VideoHead
    frame_tokens: FrameTokens
    text_queries: TextQueries
    head_layers: int
    head_heads: int
    head_mlp_ratio: float
    head_ls_init: float
    head_impl: XAttnImpl
    head_recompute: bool
    vision_trainable_blocks: int
    video_text_weight: float
    image_text_weight: float


@dataclass
class ModelConfig:
    name: str
    embed_dim: int
    vision: VisionConfig
    text: TextConfig
    ls_init_value: float | None
    quick_gelu: bool
    init_logit_scale: float
    max_logit_scale: float
    init_logit_bias: float | None
    grad_checkpointing: bool
    checkpoint_policy: CheckpointPolicy
    checkpoint_every: int
    attention_backend: AttentionBackend
    residual_norm: ResidualNorm
    gelu: GeluForm
    prune_last_block: bool
    linear: Linear
    linear_backend: LinearBackend
    fp8_fast_accum: bool
    init_from: str | None
    video: VideoConfig


@dataclass
class SourceConfig:
    shards: str
    weight: float


@dataclass
class DataConfig:
    name: str
    shards: str | None
    sources: list[SourceConfig]
    mode: DataMode
    samples_per_epoch: int | None
    max_bad_fraction: float
    shard_retries: int
    allow_pipe: bool
    max_image_pixels: int
    eval_shards: str | None
    batch_size: int
    num_workers: int | None
    shuffle_buffer: int
    crop_scale_min: float
    image_mean: list[float]
    image_std: list[float]
    interpolation: Interpolation
    resize_mode: ResizeMode
    resize_on: ResizeOn
    decode_on: DecodeOn
    decode_threads: int
    device_resize_max_side: int | None
    color_jitter: float
    color_jitter_prob: float
    grayscale_prob: float
    frames: int
    generate: bool
    generate_train_samples: int
    generate_eval_samples: int
    generate_seed: int
    hflip: bool


@dataclass
class OptimConfig:
    name: OptimizerName
    lr: float
    betas: list[float]
    eps: float
    weight_decay: float
    clip_threshold: float
    warmup_steps: int
    schedule: LrSchedule
    cooldown_steps: int
    cooldown_shape: CooldownShape
    min_lr_ratio: float
    grad_clip_norm: float | None
    layer_decay: float
    layer_scale_lr_scale: float


@dataclass
class PrecisionConfig:
    name: str
    dtype: Dtype
    scaler: Scaler
    fixed_scale: float


@dataclass
class SpikesConfig:
    """Loss/RMS spike heuristics of Wortsman et al. 2023 (appendix); used by src.trainer.spikes."""

    enabled: bool
    rms_threshold: float
    loss_std_factor: float
    window: int
    ignore_first: int
    merge_within: int
    attribution_min: int
    attribution_max: int
    alert: bool
    alert_wait_s: int


@dataclass
class HeldOutEvalConfig:
    """What is measured on data.eval_shards, the held-out split of the training data."""

    zeroshot: bool
    retrieval: bool
    val_loss: bool


@dataclass
class ZeroShotSetConfig:
    """One classification set of eval.zeroshot (every key is required in a list entry: null means the default)."""

    name: str
    path: str
    classnames: str | None
    templates: str | None


@dataclass
class ShardSetConfig:
    """One image-text shard set of eval.retrieval or eval.val_loss."""

    name: str
    shards: str


@dataclass
class EvalConfig:
    every: int
    batch_size: int
    compile: bool
    held_out: HeldOutEvalConfig
    zeroshot: list[ZeroShotSetConfig]
    retrieval: list[ShardSetConfig]
    val_loss: list[ShardSetConfig]


@dataclass
class TrainerConfig:
    seed: int
    max_steps: int
    stop_at_step: int | None
    log_every: int
    ckpt_every: int
    keep_last_k: int
    resume: str | None
    run_dir: str | None
    device: Device
    # true | false | auto (src/trainer/fast_path.py), checked by preflight's RANGES. Typed Any: Hydra 1.3 cannot
    # compose a Union[bool, str] field inside a nested schema (hydra issues #2502, #2738), and an Enum would refuse
    # the command line's `true`, which Hydra parses as a bool.
    compile: Any
    cuda_graph: Any
    dry_run: bool
    progress: bool
    resume_required: bool
    preempt_deadline_s: float
    max_nonfinite_steps: int | None
    sp_size: int
    data_parallel: DataParallel
    accum_steps: int
    ema_decay: float | None


@dataclass
class LoggerConfig:
    wandb: bool
    tensorboard: bool
    project: str
    entity: str | None
    mode: WandbMode
    run_name: str | None


@dataclass
class LossConfig:
    name: LossName


@dataclass
class TrainConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    precision: PrecisionConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    spikes: SpikesConfig
    loss: LossConfig
    eval: EvalConfig
    experiment_name: str


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("openclip"):  # configs/model/openclip.yaml: sizes from open_clip's model JSONs
        OmegaConf.register_new_resolver("openclip", openclip_value)


@functools.cache
def schema_keys(schema: type = TrainConfig, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of `schema` and its type; a key typed by a schema is followed by its own keys."""
    hints = typing.get_type_hints(schema)
    keys: dict[str, Any] = {}
    for field in dataclasses.fields(schema):
        key, hint = prefix + field.name, hints[field.name]
        keys[key] = hint
        if dataclasses.is_dataclass(hint):
            keys.update(schema_keys(hint, key + "."))
    return keys


def closest_key(key: str) -> str | None:
    """The schema key `key` most likely misspells: the closest whole key, or one whose last part is closest
    (trainer.lr -> optim.lr); None when nothing is close."""
    leaf = key.rpartition(".")[2]

    def similarity(candidate: str) -> tuple[float, float]:
        whole = difflib.SequenceMatcher(None, key, candidate).ratio()
        last = difflib.SequenceMatcher(None, leaf, candidate.rpartition(".")[2]).ratio() - 0.05
        return max(whole, last), whole

    best = max(schema_keys(), key=similarity)
    return best if similarity(best)[0] >= 0.7 else None


def unknown_key_message(key: str) -> str:
    match = closest_key(key)
    hint = f"did you mean {match}?" if match else "every key is documented in the YAML files under configs/"
    return f"{key} is not a config key: {hint}"


def is_schema_key(key: str) -> bool:
    """Whether `key` is a key of the schema, or lies inside a list or dictionary value of one."""
    keys = schema_keys()
    if key in keys:
        return True
    for end, char in enumerate(key):
        prefix = key[:end]
        if char in ".[" and prefix in keys and typing.get_origin(keys[prefix]) in (list, dict):
            return True
    return False


def unknown_override_keys(overrides: list[str], groups: Iterable[str]) -> list[str]:
    """Messages for command-line overrides whose key the schema lacks, with or without `+` or `++`. Hydra
    refuses a misspelled key without `+` and suggests adding it with `+`, which it then accepts and which the
    run would ignore; group choices (model=vit_b32) and hydra's own keys pass. An override that does not parse
    is left to Hydra's own message."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return []
    group_names = set(groups)
    return [unknown_key_message(o.key_or_group) for o in parsed
            if not o.is_hydra_override() and o.key_or_group not in group_names and not is_schema_key(o.key_or_group)]


# A shell brace range or list ({00000..41407}, {a,b}): a shard pattern, never a Hydra dictionary ({key: value}).
BRACE_PATTERN = re.compile(r"\{[^{}:]*(\.\.|,)[^{}:]*\}")


def quote_brace_patterns(overrides: list[str]) -> list[str]:
    """Overrides with a shard pattern quoted for Hydra. `data.shards='/data/{00000..41407}.tar'` reaches the
    program without its quotes, which the shell removes, and Hydra's grammar reads the braces as a dictionary and
    refuses them. A value holding a brace range or list is quoted here, unless it is quoted already, a list or
    dictionary, or holds an interpolation."""
    quoted = []
    for override in overrides:
        key, equals, value = override.partition("=")
        if equals and value and value[0] not in "'\"[{" and "${" not in value and BRACE_PATTERN.search(value):
            escaped = value.replace("'", "\\'")  # Hydra's quoted strings escape only quotes
            override = f"{key}='{escaped}'"
        quoted.append(override)
    return quoted


def unknown_keys(config: Any, prefix: str = "") -> list[str]:
    """Keys a composed config (a TrainConfig from OmegaConf.to_object) holds beyond its schema: added with `+`
    or `++`, which OmegaConf accepts even in struct mode and keeps as attributes."""
    fields = {field.name for field in dataclasses.fields(config)}
    found = [prefix + name for name in vars(config) if name not in fields]
    for name in fields:
        value = getattr(config, name)
        items = [(f"{name}.", value)] if dataclasses.is_dataclass(value) else (
            [(f"{name}[{i}].", item) for i, item in enumerate(value) if dataclasses.is_dataclass(item)]
            if isinstance(value, list) else [])
        for key_prefix, item in items:
            found += unknown_keys(item, prefix + key_prefix)
    return sorted(found)
