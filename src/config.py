"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML files under `configs/` are merged onto `TrainConfig`, so a misspelled key or a value of the
wrong type fails when the config is composed, with Hydra's error naming the key. Defaults and the
one-line meaning of each key live in the YAML files; the dataclasses only fix names and types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


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


class WandbMode(Choice):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class VisionConfig:
    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    patch_dropout: float = 0.0


@dataclass
class TextConfig:
    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    layers: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0


@dataclass
class VideoConfig:
    """The video-language model on top of CLIP (src/models/video_clip.py); read when data.frames > 0."""

    head: str = "xattn"
    frame_tokens: str = "patches"
    text_queries: str = "all"
    head_layers: int = 2
    head_heads: int = 8
    head_mlp_ratio: float = 4.0
    head_ls_init: float = 0.0
    head_impl: str = "lv_xattn"
    head_recompute: bool = True
    vision_trainable_blocks: int = -1
    video_text_weight: float = 1.0
    image_text_weight: float = 0.0


@dataclass
class ModelConfig:
    name: str = MISSING
    embed_dim: int = 512
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    ls_init_value: float | None = 0.0
    quick_gelu: bool = False
    init_logit_scale: float = math.log(1 / 0.07)
    max_logit_scale: float = math.log(100)
    grad_checkpointing: bool = False  # the older spelling of checkpoint_policy=full; old configs still compose
    checkpoint_policy: str = "none"
    checkpoint_every: int = 1
    attention_backend: str = "auto"
    residual_norm: str = "auto"
    gelu: str = "auto"
    prune_last_block: bool = True
    linear: str = "standard"
    linear_backend: str = "cuda"
    fp8_fast_accum: bool = True
    init_from: str | None = None
    video: VideoConfig = field(default_factory=VideoConfig)


@dataclass
class SourceConfig:
    shards: str = MISSING
    weight: float = 1.0


@dataclass
class DataConfig:
    name: str = MISSING
    shards: str | None = None
    sources: list[SourceConfig] = field(default_factory=list)
    mode: str = "epoch"
    samples_per_epoch: int | None = None
    max_bad_fraction: float = 0.01
    shard_retries: int = 2
    eval_shards: str | None = None
    batch_size: int = 256
    num_workers: int | None = None
    shuffle_buffer: int = 1000
    crop_scale_min: float = 0.9
    frames: int = 0
    generate: bool = False
    generate_train_samples: int = 0
    generate_eval_samples: int = 0
    generate_seed: int = 0
    hflip: bool = True


@dataclass
class OptimConfig:
    name: str = MISSING
    lr: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    weight_decay: float = 0.2
    clip_threshold: float = 1.0
    warmup_steps: int = 100
    min_lr_ratio: float = 0.0
    grad_clip_norm: float | None = None


@dataclass
class PrecisionConfig:
    name: str = MISSING
    dtype: str = "bf16"
    scaler: str = "none"
    fixed_scale: float = 65536.0


@dataclass
class SpikesConfig:
    """Loss/RMS spike heuristics of Wortsman et al. 2023 (appendix); used by src.trainer.spikes."""

    enabled: bool = True
    rms_threshold: float = 2.3
    loss_std_factor: float = 3.2
    window: int = 100
    ignore_first: int = 1000
    merge_within: int = 10
    attribution_min: int = 1
    attribution_max: int = 8
    alert: bool = True
    alert_wait_s: int = 300


@dataclass
class EvalConfig:
    every: int = 500
    batch_size: int = 256
    zeroshot: bool = True
    retrieval: bool = True


@dataclass
class TrainerConfig:
    seed: int = 0
    max_steps: int = 1000
    stop_at_step: int | None = None
    log_every: int = 10
    ckpt_every: int = 500
    keep_last_k: int = 3
    resume: str | None = None
    run_dir: str | None = None
    device: str = "auto"
    compile: bool = False
    cuda_graph: bool = False
    dry_run: bool = False
    progress: bool = True
    eval: EvalConfig = field(default_factory=EvalConfig)
    resume_required: bool = False
    preempt_deadline_s: float = 120.0
    max_nonfinite_steps: int | None = 20
    sp_size: int = 1
    data_parallel: str = "ddp"


@dataclass
class LoggerConfig:
    name: str = MISSING
    wandb: bool = False
    project: str = "stableclip"
    entity: str | None = None
    mode: str = "offline"
    run_name: str | None = None


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    spikes: SpikesConfig = field(default_factory=SpikesConfig)
    experiment_name: str = "default"


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
