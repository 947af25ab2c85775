"""Configuration checks that run before any expensive work (data generation, model weights, loader workers,
checkpoint loading). Every problem is reported at once, each naming its key and the fix.

This is the one place a run's configuration is checked: a choice outside its set already fails at composition
(the schema types it with its Enum), and what composition cannot see (ranges, rules between keys, the world size,
the device, the checkpoint to resume) is checked here. Check functions live where their knowledge does (the
loader's batch split, SwitchBack's devices, a CUDA graph's limits) and are called from here."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from src.config import DataConfig, LoggerConfig, ModelConfig, TrainConfig, unknown_key_message, unknown_keys
from src.data.device_crop import device_path_blocker, resolve_resize_on
from src.data.device_decode import nvimgcodec_missing, resolve_decode_on
from src.data.loader import PREFETCH_FACTOR, check_batch_size, image_folder, loader_shared_memory, resolve_sources
from src.data.processes import check_worker_temp_dir
from src.data.shards import check_pipe_allowed, expand_shards, is_local, read_sizes
from src.kernels.switchback.convert import check_linear_choice
from src.parallel.distributed import DistInfo
from src.parallel.mesh import check_sp_size
from src.trainer import checkpoint
from src.trainer.cuda_graph import check_cuda_graph
from src.trainer.evaluate import EvalSet, class_prompts, eval_sets, listed_sets
from src.trainer.fast_path import AUTO
from src.trainer.grad_cache import check_accum_steps
from src.trainer.memory import available_memory, check_memory, estimate_memory
from src.trainer.pretrained import (
    OPENCLIP,
    check_openclip_architecture,
    model_file,
    openclip_name,
    openclip_weights_file,
)

log = logging.getLogger(__name__)


class ConfigurationError(ValueError):
    """A run that cannot start as configured: the message names every bad key, its value and the fix."""

FINITE = math.isfinite
# (key, holds for a valid value, the valid range in words): every numeric key whose range is plain from its meaning.
# tests/test_config.py checks that every numeric key of src/config.py has a row, or a check of its own below
# (trainer.sp_size against the world size, data.sources' weights with the sources).
RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("model.embed_dim", lambda v: v >= 1, "at least 1"),
    ("model.vision.image_size", lambda v: v >= 1, "at least 1"),
    ("model.vision.patch_size", lambda v: v >= 1, "at least 1"),
    ("model.vision.width", lambda v: v >= 1, "at least 1"),
    ("model.vision.layers", lambda v: v >= 1, "at least 1"),
    ("model.vision.heads", lambda v: v >= 1, "at least 1"),
    ("model.vision.mlp_ratio", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("model.vision.patch_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("model.vision.ln_pre_gain", lambda v: v is None or (FINITE(v) and v > 0), "a finite number above 0 (or null)"),
    ("model.vision.unlocked_blocks", lambda v: v >= 0, "0 or more"),
    ("model.text.context_length", lambda v: v >= 2, "at least 2 (start and end of text)"),
    ("model.text.vocab_size", lambda v: v >= 1, "at least 1"),
    ("model.text.width", lambda v: v >= 1, "at least 1"),
    ("model.text.layers", lambda v: v >= 1, "at least 1"),
    ("model.text.heads", lambda v: v >= 1, "at least 1"),
    ("model.text.mlp_ratio", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("model.text.unlocked_blocks", lambda v: v >= 0, "0 or more"),
    ("model.ls_init_value", lambda v: v is None or (FINITE(v) and v >= 0), "a finite number, 0 or more (or null)"),
    ("model.init_logit_scale", FINITE, "a finite number"),
    ("model.max_logit_scale", FINITE, "a finite number"),
    ("model.init_logit_bias", lambda v: v is None or FINITE(v), "a finite number (or null: no bias)"),
    ("model.checkpoint_every", lambda v: v >= 1, "at least 1"),
    ("model.video.head_layers", lambda v: v >= 0, "0 or more"),
    ("model.video.head_heads", lambda v: v >= 1, "at least 1"),
    ("model.video.head_mlp_ratio", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("model.video.head_ls_init", lambda v: FINITE(v) and v >= 0, "a finite number, 0 or more"),
    ("model.video.vision_trainable_blocks", lambda v: v >= -1, "-1 (all), 0 (frozen) or more"),
    ("model.video.video_text_weight", lambda v: FINITE(v) and v >= 0, "a finite number, 0 or more"),
    ("model.video.image_text_weight", lambda v: FINITE(v) and v >= 0, "a finite number, 0 or more"),
    ("data.samples_per_epoch", lambda v: v is None or v >= 1, "at least 1 (or null: the total from sizes.json)"),
    ("data.max_bad_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("data.shard_retries", lambda v: v >= 0, "0 or more"),
    ("data.batch_size", lambda v: v >= 1, "at least 1"),
    ("data.num_workers", lambda v: v is None or v >= 0, "0 or more (or null)"),
    ("data.shuffle_buffer", lambda v: v >= 1, "at least 1"),
    ("data.crop_scale_min", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("data.image_mean", lambda v: len(v) == 3 and all(FINITE(m) for m in v), "three finite numbers (R, G, B)"),
    ("data.image_std", lambda v: len(v) == 3 and all(FINITE(s) and s > 0 for s in v),
     "three finite numbers above 0 (R, G, B)"),
    ("data.device_resize_max_side", lambda v: v is None or v >= 1, "at least 1 (or null: 8/7 of the image size + 2)"),
    ("data.decode_threads", lambda v: v >= 1, "at least 1"),
    ("data.color_jitter", lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    ("data.color_jitter_prob", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("data.grayscale_prob", lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    ("data.frames", lambda v: v >= 0, "0 (images) or more"),
    ("data.generate_train_samples", lambda v: v >= 0, "0 or more"),
    ("data.generate_eval_samples", lambda v: v >= 0, "0 or more"),
    ("data.generate_seed", lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    ("optim.lr", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("data.max_image_pixels", lambda v: v >= 1, "at least 1"),
    ("optim.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("optim.eps", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("optim.weight_decay", lambda v: FINITE(v) and v >= 0, "a finite number, 0 or more"),
    ("optim.clip_threshold", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("optim.warmup_steps", lambda v: v >= 0, "0 or more"),
    ("optim.cooldown_steps", lambda v: v >= 0, "0 or more"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.grad_clip_norm", lambda v: v is None or (FINITE(v) and v > 0), "a finite number above 0 (or null)"),
    ("optim.layer_decay", lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    ("optim.layer_scale_lr_scale", lambda v: FINITE(v) and v > 0, "a finite number above 0 (1 = the gammas at lr)"),
    ("precision.fixed_scale", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("spikes.rms_threshold", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("spikes.loss_std_factor", FINITE, "a finite number (below 0 flags every step, as tests do)"),
    ("spikes.window", lambda v: v >= 2, "at least 2 (a standard deviation needs two losses)"),
    ("spikes.ignore_first", lambda v: v >= 0, "0 or more"),
    ("spikes.merge_within", lambda v: v >= 0, "0 or more"),
    ("spikes.attribution_min", lambda v: v >= 0, "0 or more"),
    ("spikes.attribution_max", lambda v: v >= 0, "0 or more"),
    ("spikes.alert_wait_s", lambda v: v >= 0, "0 or more"),
    ("eval.every", lambda v: v >= 0, "0 (end only) or more"),
    ("eval.batch_size", lambda v: v >= 1, "at least 1"),
    # np.random.seed takes 32 bits, and each rank seeds with trainer.seed + its rank.
    ("trainer.seed", lambda v: 0 <= v < 2**31, "in [0, 2**31)"),
    ("trainer.max_steps", lambda v: v >= 1, "at least 1"),
    ("trainer.stop_at_step", lambda v: v is None or v >= 1, "at least 1 (or null)"),
    ("trainer.log_every", lambda v: v >= 1, "at least 1"),
    ("trainer.ckpt_every", lambda v: v >= 0, "0 (end only) or more"),
    ("trainer.keep_last_k", lambda v: v >= 1, "at least 1"),
    ("trainer.preempt_deadline_s", lambda v: FINITE(v) and v > 0, "a finite number above 0"),
    ("trainer.max_nonfinite_steps", lambda v: v is None or v >= 0, "0 or more (or null)"),
    ("trainer.accum_steps", lambda v: v >= 1, "at least 1 (1: no accumulation)"),
    ("trainer.ema_decay", lambda v: v is None or 0 < v < 1, "in (0, 1), e.g. 0.9999 (or null: no EMA)"),
    ("trainer.compile", lambda v: isinstance(v, bool) or v == AUTO, "true, false or auto"),
    ("trainer.cuda_graph", lambda v: isinstance(v, bool) or v == AUTO, "true, false or auto"),
)
# (keys, holds for valid values, the rule in words): ranges that depend on another key.
RELATIONS: tuple[tuple[tuple[str, ...], Callable[..., bool], str], ...] = (
    (("model.vision.image_size", "model.vision.patch_size"), lambda size, patch: size % patch == 0,
     "model.vision.image_size must be a multiple of model.vision.patch_size"),
    (("data.device_resize_max_side", "model.vision.image_size"), lambda side, size: side is None or side >= size,
     "data.device_resize_max_side must be at least model.vision.image_size (a crop resized in the workers fills "
     "size x size pixels of the canvas); null picks 8/7 of it and a 2-px border"),
    (("model.init_logit_scale", "model.max_logit_scale"), lambda init, top: init <= top,
     "model.init_logit_scale must not exceed model.max_logit_scale (the scale is clamped there after every step)"),
    (("spikes.attribution_min", "spikes.attribution_max"), lambda low, high: low <= high,
     "spikes.attribution_min must not exceed spikes.attribution_max"),
    # A bias added to every logit cancels in a softmax: it would get no gradient, which DDP refuses.
    (("loss.name", "model.init_logit_bias"), lambda loss, bias: loss != "clip" or bias is None,
     "loss=clip's softmax ignores a bias added to every logit: set model.init_logit_bias=null, or use loss=siglip"),
    (("loss.name", "data.frames"), lambda loss, frames: loss == "clip" or frames == 0,
     "video fine-tuning (data.frames > 0) trains with its own softmax losses (src/trainer/video_trainer.py): "
     "use loss=clip"),
    (("optim.schedule", "optim.cooldown_steps", "optim.warmup_steps", "trainer.max_steps"),
     lambda schedule, cooldown, warmup, steps: schedule != "const_cooldown" or 1 <= cooldown <= steps - warmup,
     "optim.schedule=const_cooldown needs optim.cooldown_steps from 1 to trainer.max_steps - optim.warmup_steps "
     "(the cooldown follows the warmup; about 20% of trainer.max_steps is usual)"),
    *(rule for tower, name in (("vision", "image"), ("text", "text")) for rule in (
        ((f"model.{tower}.unlocked_blocks", f"model.{tower}.layers"), lambda blocks, layers: blocks <= layers,
         f"model.{tower}.unlocked_blocks must not exceed the {name} tower's depth, model.{tower}.layers"),
        ((f"model.{tower}.lock", f"model.{tower}.unlocked_blocks"), lambda lock, blocks: lock or blocks == 0,
         f"unlocked_blocks leaves blocks of a locked tower trainable: set model.{tower}.lock=true (or "
         f"model.{tower}.unlocked_blocks=0)"),
    )),
    (("model.video.vision_trainable_blocks", "model.vision.layers"), lambda blocks, layers: blocks <= layers,
     "model.video.vision_trainable_blocks must not exceed the image tower's depth, model.vision.layers"),
    (("data.frames", "model.vision.lock"), lambda frames, lock: frames == 0 or not lock,
     "a video run locks the image tower with model.video.vision_trainable_blocks (0: all of it, k: all but its "
     "last k blocks, -1: none): leave model.vision.lock=false"),
)


def value_of(cfg: TrainConfig, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def range_problems(cfg: TrainConfig) -> list[str]:
    problems = []
    for key, valid, allowed in RANGES:
        value = value_of(cfg, key)
        if not valid(value):
            problems.append(f"{key}={value} is out of range: set it to {allowed}")
    if problems:  # a relation between values already out of range says nothing more (and may divide by 0)
        return problems
    for keys, valid, rule in RELATIONS:
        values = [value_of(cfg, key) for key in keys]
        if not valid(*values):
            problems.append(", ".join(f"{k}={v}" for k, v in zip(keys, values)) + f": {rule}")
    return problems


def check_heads(model: ModelConfig, video: bool) -> None:
    towers = [(f"model.{name}.width", tower.width, f"model.{name}.heads", tower.heads)
              for name, tower in (("vision", model.vision), ("text", model.text))]
    if video:  # the head's cross-attention runs at the text tower's width
        towers.append(("model.text.width", model.text.width, "model.video.head_heads", model.video.head_heads))
    bad = [f"{width_key}={width} is not divisible by {heads_key}={heads}"
           for width_key, width, heads_key, heads in towers if heads >= 1 and width % heads]  # RANGES: heads < 1
    if bad:
        raise ValueError("; ".join(bad) + ": set heads to a divisor of the width (heads of 64 channels are usual)")


def check_data_parallel(data_parallel: str, video: bool) -> None:
    if data_parallel == "fsdp2" and video:
        # Its evaluation runs on one sequence-parallel group while an FSDP2 forward needs every rank, and its
        # process groups, frozen blocks and checkpoints are built and tested for DDP.
        raise ValueError("trainer.data_parallel=fsdp2 does not support video fine-tuning (data.frames > 0), which "
                         "runs on data- and sequence-parallel groups of its own: use trainer.data_parallel=ddp")


def check_resize_on(data: DataConfig) -> None:
    blocker = device_path_blocker(data) if data.resize_on == "device" else None
    if blocker:
        raise ValueError(f"data.resize_on=device cannot apply here: {blocker}. Set data.resize_on=auto (the device "
                         "where it can) or workers")


def check_decode_on(data: DataConfig, device: torch.device) -> None:
    if data.decode_on != "device":
        return
    blocker = device_path_blocker(data)
    if blocker:
        raise ValueError(f"data.decode_on=device cannot apply here: {blocker}. Set data.decode_on=auto (the device "
                         "where it can) or workers")
    missing = nvimgcodec_missing() if device.type == "cuda" else None
    if missing:
        raise ValueError(f"data.decode_on=device decodes with nvImageCodec, but {missing}. Install it, or set "
                         "data.decode_on=auto or workers")


SHARED_MEMORY = "/dev/shm"  # where torch's DataLoader puts the batches its workers hand over (Linux)


def check_loader_shared_memory(cfg: TrainConfig, dist_info: DistInfo) -> None:
    """Refuses a loader whose prefetched batches would not fit in /dev/shm: the workers would die of SIGBUS
    ("bus error") mid-run, as in a container with Docker's default of 64 MB. Ranks of one node share it. JPEGs
    decoded on the device travel undecoded, of sizes unknown before the run: that path is not checked."""
    device, world = dist_info.device, dist_info.world_size
    if not cfg.data.num_workers or not os.path.isdir(SHARED_MEMORY) or resolve_decode_on(cfg.data, device)[0]:
        return
    image_size = cfg.model.vision.image_size
    canvas = 0 if cfg.data.frames else resolve_resize_on(cfg.data, image_size, device)[0]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = ranks * loader_shared_memory(cfg.data, image_size, cfg.model.text.context_length, canvas, world)
    free = shutil.disk_usage(SHARED_MEMORY).free
    if need > free:
        raise ValueError(
            f"the loader's workers may hold {need / 1e9:.2f} GB of shared memory ({ranks} rank(s) x "
            f"data.num_workers={cfg.data.num_workers} x {PREFETCH_FACTOR + 1} batches of "
            f"{cfg.data.batch_size // world} samples), but {SHARED_MEMORY} has {free / 1e9:.2f} GB free: lower "
            "data.num_workers or data.batch_size, or give the machine more (in Docker: --shm-size=16g)")


def readable(path: str) -> str | None:
    """Why `path` cannot be read, or None. Opening it and reading one byte is what a reader does first."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        return err.strerror or str(err)
    return None


def check_eval_shards(pattern: str, key: str = "data.eval_shards") -> None:
    """The held-out shards exist and open: the evaluation otherwise fails at its first step, after training steps
    and before that step's checkpoint."""
    shards = expand_shards(pattern, key=key)
    unreadable = [f"{shard!r} ({why})" for shard in shards if is_local(shard) and (why := readable(shard))]
    if unreadable:
        raise FileNotFoundError(f"{key}: {len(unreadable)} of {len(shards)} shards cannot be read: "
                                f"{', '.join(unreadable[:3])}: fix their permissions or the pattern")


def check_eval_set(eval_set: EvalSet) -> None:
    """A set of eval.zeroshot, eval.retrieval or eval.val_loss: its image folder lists images in class directories
    (torchvision's ImageFolder), or its shards open; a zero-shot set has its class names and templates."""
    if eval_set.folder and eval_set.captions:
        raise ValueError(f"{eval_set.key}.shards={eval_set.path!r} is a directory: retrieval and the validation loss "
                         "need image-text shards")
    if eval_set.folder:
        try:
            image_folder(eval_set.path)
        except (FileNotFoundError, OSError) as err:
            raise FileNotFoundError(f"{eval_set.key}.path={eval_set.path!r} is not an image folder "
                                    f"root/<class>/<image> ({err})") from None
    else:
        check_eval_shards(eval_set.path, f"{eval_set.key}.{'path' if eval_set.zeroshot else 'shards'}")
    if eval_set.zeroshot:
        try:
            class_prompts(eval_set)
        except (KeyError, TypeError) as err:
            raise ValueError(f"{eval_set.key}: the classes.json beside {eval_set.path!r} holds no class list "
                             f"({type(err).__name__}: {err}): write {{\"classes\": [names]}}") from None


def check_eval_lists(cfg: TrainConfig) -> None:
    """The lists of evaluation sets belong to an image run and give each set one name."""
    if (cfg.eval.zeroshot or cfg.eval.retrieval or cfg.eval.val_loss) and cfg.data.frames:
        raise ValueError("eval.zeroshot, eval.retrieval and eval.val_loss list image-text sets, but video fine-tuning "
                         "(data.frames > 0) evaluates data.eval_shards only: empty the lists")
    eval_sets(cfg)


def eval_set_checks(cfg: TrainConfig) -> list[Callable[[], Any]]:
    """The lists, then each listed set by itself (data.eval_shards has its own checks)."""
    entries = [] if cfg.data.frames else listed_sets(cfg)
    return [lambda: check_eval_lists(cfg), *(functools.partial(check_eval_set, s) for s in entries)]


def check_classes(pattern: str) -> None:
    """Zero-shot classification's classes.json beside the held-out shards, readable as a class list."""
    try:
        first = expand_shards(pattern, key="data.eval_shards")[0]
    except FileNotFoundError:  # check_eval_shards reports it
        return
    if not is_local(first):
        return
    path = os.path.join(os.path.dirname(first), "classes.json")
    fix = (f"write {path} ({{\"classes\": [names], \"templates\": [optional prompts]}}) or set "
           "eval.held_out.zeroshot=false")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"eval.held_out.zeroshot=true needs classes.json beside data.eval_shards, and {path} "
                                f"does not exist: {fix}")
    try:
        with open(path) as f:
            classes = json.load(f)["classes"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"eval.held_out.zeroshot=true: {path} cannot be read as a class list "
                         f"({type(err).__name__}: {err}): {fix}") from None
    if not isinstance(classes, list) or not classes:
        raise ValueError(f"eval.held_out.zeroshot=true: {path} holds no classes: {fix}")


def check_init_from(spec: str, model: ModelConfig) -> None:
    if spec.startswith(OPENCLIP) and (name := openclip_name(spec.removeprefix(OPENCLIP))):
        check_openclip_architecture(model, *name)
        openclip_weights_file(*name)  # from the cache, or downloaded now: the user asked for these weights by name
    elif spec.startswith(OPENCLIP):
        path = spec.removeprefix(OPENCLIP)
        if why := readable(path):
            raise FileNotFoundError(f"model.init_from={spec!r}: {path!r} cannot be read ({why}): give the path of "
                                    "an OpenCLIP checkpoint file")
    else:
        model_file(spec)


def check_loggers(cfg: LoggerConfig) -> None:
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("logger.wandb=true but wandb is not installed: pip install wandb, or logger=none")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("logger.tensorboard=true but tensorboard is not installed: pip install tensorboard "
                         "(or pip install -e '.[tensorboard]'), or logger=none")


def check_generated_data(data: DataConfig) -> None:
    """Generated data already on disk is used as it is (src/trainer/run.py writes it only where it is missing), so
    it must hold the counts the keys ask for: a run on data written with other counts would train on it silently.
    Only data written whole is checked (the held-out split, written last, has its sizes.json): the rest is rewritten."""
    if not (data.shards and data.eval_shards
            and os.path.isfile(os.path.join(os.path.dirname(data.eval_shards), "sizes.json"))):
        return
    problems = []
    for key, pattern, want in (("data.generate_train_samples", data.shards, data.generate_train_samples),
                               ("data.generate_eval_samples", data.eval_shards, data.generate_eval_samples)):
        sizes = read_sizes(expand_shards(pattern))
        if sizes is not None and (held := sum(sizes.values())) != want:
            directory = os.path.dirname(pattern) or "."
            problems.append(f"{key}={want}, but {directory} already holds generated data of {held} samples, written "
                            f"with another count: delete {directory} to write it again, or set {key}={held}")
    if problems:
        raise ValueError("; ".join(problems))


def input_checks(cfg: TrainConfig) -> list[Callable[[], Any]]:
    """Every input a run reads, checked as cheaply as it can be: shards exist (and held-out ones open), files
    named by keys exist. Generated data (data.generate) is written after preflight, so it need not exist; where
    it does, it must be what the keys ask for."""
    data = cfg.data
    return [
        lambda: data.generate or resolve_sources(data),
        lambda: not data.generate or check_generated_data(data),
        lambda: data.generate or not data.eval_shards or check_eval_shards(data.eval_shards),
        # Video evaluation has no zero-shot classification.
        lambda: (data.generate or not data.eval_shards or data.frames or not cfg.eval.held_out.zeroshot
                 or check_classes(data.eval_shards)),
        *eval_set_checks(cfg),
        lambda: not cfg.model.init_from or check_init_from(cfg.model.init_from, cfg.model),
        lambda: check_loggers(cfg.logger),
    ]


def preflight(cfg: TrainConfig, dist_info: DistInfo, run_dir: str) -> None:
    """Raises ConfigurationError listing every problem. Collective (it finds the checkpoint to resume on rank 0)."""
    model, video = cfg.model, bool(cfg.data.frames)
    checks = [
        lambda: check_batch_size(cfg.data.batch_size, dist_info.world_size),
        lambda: check_pipe_allowed(cfg.data),
        lambda: check_sp_size(cfg.trainer.sp_size, dist_info.world_size),
        lambda: check_data_parallel(cfg.trainer.data_parallel, video),
        lambda: check_heads(model, video),
        lambda: check_resize_on(cfg.data),
        lambda: check_decode_on(cfg.data, dist_info.device),
        lambda: check_loader_shared_memory(cfg, dist_info),
        lambda: check_worker_temp_dir(cfg.data.num_workers),
        lambda: model.linear == "standard" or check_linear_choice(model.linear, model.linear_backend, dist_info.device),
        # `auto` records only where a recording works (src/trainer/fast_path.py): only `true` can be refused.
        lambda: cfg.trainer.cuda_graph is not True or check_cuda_graph(dist_info.device, dist_info.world_size,
                                                                       cfg.precision.scaler),
        lambda: check_accum_steps(cfg.trainer.accum_steps, cfg.data.batch_size, dist_info.world_size, video,
                                  cfg.trainer.cuda_graph is True),
        lambda: checkpoint.find_resume(
            os.path.join(run_dir, "checkpoints"), cfg.trainer.resume, cfg.trainer.resume_required,
            rank=dist_info.rank, checksums=False,
        ),
        *input_checks(cfg),
    ]
    problems = [unknown_key_message(key) for key in unknown_keys(cfg)] + range_problems(cfg)
    for check in checks:
        try:
            check()
        except (ValueError, FileNotFoundError) as err:
            problems.append(str(err))
    if not problems:  # the estimate builds the model on the meta device, which needs a sound model config
        estimate = estimate_memory(cfg, dist_info.world_size)
        available, where = available_memory(dist_info.device)
        if dist_info.is_main:
            log.info("expected memory per rank: %s (%.1f GB available: %s)", estimate.describe(), available / 1e9,
                     where)
        try:
            check_memory(estimate, available, where)
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ConfigurationError("the configuration cannot run:\n- " + "\n- ".join(problems))
