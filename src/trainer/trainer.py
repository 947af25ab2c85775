"""The Trainer: the training loop, precision, data parallelism, logging and checkpoints, around the parts of a run
(model, loader, loss, evaluation) that builder functions make: `image_text_parts` here, `video_parts` for video
fine-tuning (src/trainer/video_trainer.py), or a benchmark's own."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from src.config import TrainConfig
from src.data.device_crop import resize_crops, resolve_resize_on
from src.data.device_decode import DeviceDecoder, resolve_decode_on
from src.data.image_text import ImageNormalizer, Preprocess
from src.data.loader import TrainLoader
from src.kernels.dispatch import apply_kernels
from src.models import clip
from src.models.locking import forward_order, image_tower, layer_depths
from src.optim import build_optimizer, build_scheduler
from src.optim.grad_norm import clip_grad_norm
from src.optim.rms import update_rms
from src.optim.scalers import build_scaler
from src.parallel.distributed import DistInfo, all_reduce_mean, barrier
from src.parallel.parallelize import apply_compile, apply_fsdp, unsharded_root
from src.trainer import checkpoint
from src.trainer.cuda_graph import GraphedForwardBackward
from src.trainer.ema import EMA_FILE, ModelEMA
from src.trainer.evaluate import EvaluationStopped, eval_sets, evaluate
from src.trainer.fast_path import resolve_compile, resolve_fast_path
from src.trainer.grad_cache import Features, FeaturesFn, FeaturesLoss, accumulate_gradients
from src.trainer.loss import contrastive_loss
from src.trainer.metrics import MetricLogger
from src.trainer.optim_resume import ResumedOptimizer, ResumedSchedule, resume_summary
from src.trainer.preemption import Preemption
from src.trainer.pretrained import load_pretrained
from src.trainer.spikes import SpikeDetector
from src.trainer.state import Progress, RNGState, TrainState

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
METRIC_NAMES = {
    "loss": "train/loss", "grad_norm": "train/grad_norm", "skipped_step": "train/skipped_step",
    "logit_scale": "train/logit_scale", "skipped_tensors": "scaler/skipped_tensors", "scale": "scaler/scale",
    "rms_patch_embed": "optim/rms/patch_embed", "rms_max": "optim/rms_max", "clipped_frac": "optim/clipped_frac",
    "logit_bias": "train/logit_bias",  # models with a bias (loss=siglip) only
}


def autocast_dtype(dtype: str) -> torch.dtype | None:
    """The dtype `precision.dtype` names, None for fp32 (no autocast)."""
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"precision.dtype={dtype!r} is not supported: choose one of " + ", ".join(AUTOCAST_DTYPES))
    return AUTOCAST_DTYPES[dtype]


class Loader(Protocol):
    """An endless iterator of batches (tensors by name, on the host or the device). A run that trains with `fit`
    also needs `state_dict`/`load_state_dict` (checkpoints), `bad_counts()` and `epoch` (metrics) and `close()`
    (the end of `fit`), as `TrainLoader` has them; stepping `train_step` by hand needs only batches."""

    def __next__(self) -> dict[str, torch.Tensor]: ...


@dataclass
class TrainParts:
    """What a kind of run trains, built before the Trainer compiles, wraps and optimizes the model. Image-text
    runs get theirs from `image_text_parts`, video runs from src.trainer.video_trainer's `video_parts`.

    - `loss(forward_model, batch)`: the training loss of one batch (called under autocast; `forward_model` is
      the model as the Trainer wrapped it for data parallelism).
    - `evaluate(model, autocast, stop)`: the evaluation's results on the rank that logs them, None on the others
      (which may still take part); `stop` (or None) is asked before each forward, and EvaluationStopped raised
      once it says so.
    - `patch_embed`: the parameter whose update RMS spike detection follows.
    - `features(forward_model, batch)` and `features_loss(features)`, where the loss is a function of per-sample
      features (and the model's 0-dim scalars): `loss` split in two, for trainer.accum_steps > 1
      (src/trainer/grad_cache.py). None where it is not (the video head scores clip and caption together)."""

    model: nn.Module
    loader: Loader
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    evaluate: Callable[[nn.Module, Callable[[], contextlib.AbstractContextManager], Callable[[], bool] | None],
                       dict[str, float] | None]
    patch_embed: str
    features: FeaturesFn | None = None
    features_loss: FeaturesLoss | None = None


BuildParts = Callable[[TrainConfig, DistInfo], TrainParts]


def shards_model(cfg: TrainConfig, dist_info: DistInfo) -> bool:
    """Whether FSDP2 shards the model. One rank has nothing to shard: it runs the plain model, as DDP does."""
    return cfg.trainer.data_parallel == "fsdp2" and dist_info.world_size > 1


def build_model(cfg: TrainConfig, architecture: Callable[[], nn.Module]) -> nn.Module:
    """The model a run trains: `architecture()`, initialised from trainer.seed (identical weights on every rank),
    run with the kernels model.* picks (src/kernels/dispatch.py), then loaded with the weights model.init_from
    names."""
    torch.manual_seed(cfg.trainer.seed)
    model = apply_kernels(architecture(), cfg.model)
    if cfg.model.init_from:
        log.info("model weights from %s", load_pretrained(model, cfg.model.init_from))
    return model


def spike_parameter(model: nn.Module, visual_path: list[nn.Parameter]) -> str:
    """The parameter whose update RMS spike detection follows: the first trained one of `visual_path` (in forward
    order), which is the patch embedding, where the paper finds RMS spikes 1-8 steps before loss spikes; in a
    partly locked image tower the first trained block's; with nothing of the path trained (LiT), the first trained
    parameter of the model."""
    names = {p: name for name, p in model.named_parameters()}
    trained = [p for p in visual_path if p.requires_grad] or [p for p in names if p.requires_grad]
    return names[trained[0]]


def image_normalizer(cfg: TrainConfig, device: torch.device) -> ImageNormalizer:
    return ImageNormalizer(device, mean=cfg.data.image_mean, std=cfg.data.image_std,
                           dtype=autocast_dtype(cfg.precision.dtype) or torch.float32,
                           compile=resolve_compile(cfg, device)[0])


def device_decoder(cfg: TrainConfig, device: torch.device) -> DeviceDecoder:
    """data.decode_on=device: the batched crop kernels on a GPU, torchvision's resize (the reference) on a CPU."""
    resize = None
    if device.type == "cuda":
        from src.kernels.resized_crop import resize_crops as resize
    return DeviceDecoder(device, cfg.model.vision.image_size, cfg.data.decode_threads, resize)


def image_text_parts(cfg: TrainConfig, dist_info: DistInfo, loader: Loader | None = None) -> TrainParts:
    """The parts of a CLIP run on image-text pairs. `loader`: batches from elsewhere (a benchmark's, already on
    the device) instead of the webdataset loader."""
    if cfg.data.frames:
        raise ValueError(
            f"data.frames={cfg.data.frames} loads video clips, but the CLIP trainer takes images: use "
            "experiment=video_finetune for video, or data.frames=0"
        )
    device = dist_info.device
    model = build_model(cfg, lambda: clip.build_model(cfg.model, device))
    if loader is None:
        image_size = cfg.model.vision.image_size
        on_device, where = resolve_decode_on(cfg.data, device)
        canvas = 0
        if not on_device:  # the workers decode; they or the device resize the crops
            canvas, where = resolve_resize_on(cfg.data, image_size, device)
        if dist_info.is_main:
            log.info(where)
        loader = TrainLoader(
            cfg.data, image_size=image_size, context_length=cfg.model.text.context_length,
            seed=cfg.trainer.seed, rank=dist_info.rank, world_size=dist_info.world_size,
            # Pinned where the device decodes too: nvImageCodec took 66 ms a batch of 1,024 photographs to read
            # their code streams from pageable memory against 14 ms pinned, and the whole step lost a fifth.
            pin_memory=device.type == "cuda", canvas=canvas,
            decoder=device_decoder(cfg, device) if on_device else None,
        )
    normalize = image_normalizer(cfg, device)
    contrastive = contrastive_loss(cfg.loss)
    sets = eval_sets(cfg)
    # The validation loss runs on rank 0 alone, over a group of that one rank (creating it takes every rank).
    solo_group = dist.new_group([0]) if dist_info.world_size > 1 else None

    def features(forward_model: nn.Module, batch: dict[str, torch.Tensor]) -> Features:
        """The model's outputs: image and text features, logit scale, and the logit bias of loss=siglip."""
        images = batch["images"].to(device, non_blocking=True)
        if "boxes" in batch:  # canvases of crops to resize here (data.resize_on)
            images = resize_crops(images, batch["boxes"].to(device, non_blocking=True), cfg.model.vision.image_size)
        images = normalize(images)
        tokens = batch["tokens"].to(device, non_blocking=True)
        return forward_model(images, tokens)

    def features_loss(outputs: Features, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The loss of a batch's outputs over the ranks of `group`: training's, and the validation loss.
        (image features, text features, logit scale) and, when the model has one (loss=siglip), the logit bias."""
        image_features, text_features, logit_scale, *logit_bias = outputs
        return contrastive(image_features.float(), text_features.float(), logit_scale.float(),
                           logit_bias[0].float() if logit_bias else None, group)

    def loss(forward_model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return features_loss(features(forward_model, batch))

    def evaluate_images(model: nn.Module, autocast: Callable, stop: Callable[[], bool] | None,
                        ) -> dict[str, float] | None:
        """On every rank, each encoding its share of each set, on the unwrapped model; rank 0 gets the results."""
        def val_loss(image_features, text_features, group):
            bias = () if model.logit_bias is None else (model.logit_bias.detach().cpu(),)
            return features_loss((image_features, text_features, model.logit_scale.detach().exp().cpu(), *bias), group)

        with unsharded_root(model):
            return evaluate(
                model, sets, loss=val_loss, batch_size=cfg.eval.batch_size, image_size=cfg.model.vision.image_size,
                context_length=cfg.model.text.context_length, num_workers=cfg.data.num_workers,
                max_image_pixels=cfg.data.max_image_pixels, retries=cfg.data.shard_retries, device=device,
                prepare_images=normalize, autocast=autocast, lockstep=shards_model(cfg, dist_info),
                solo_group=solo_group, is_main=dist_info.is_main, preprocess=Preprocess.from_config(cfg.data),
                progress=cfg.trainer.progress and dist_info.is_main, stop=stop,
            )

    return TrainParts(model, loader, loss, evaluate_images, spike_parameter(model, forward_order(image_tower(model))),
                      features, features_loss)


class Trainer:
    """The loop, precision, data parallelism, logging and checkpoints around the parts `build_parts` makes."""

    def __init__(self, cfg: TrainConfig, run_dir: str, dist_info: DistInfo, build_parts: BuildParts = image_text_parts):
        self.cfg, self.run_dir, self.dist = cfg, run_dir, dist_info
        self.device = dist_info.device
        self.autocast_dtype = autocast_dtype(cfg.precision.dtype)
        self.preemption = Preemption(cfg.trainer.preempt_deadline_s)
        self.fast_path = resolve_fast_path(cfg, self.device, dist_info.world_size)
        if dist_info.is_main:
            log.info(self.fast_path.summary())
        self.sharded = shards_model(cfg, dist_info)
        self.parts = build_parts(cfg, dist_info)
        self.model, self.loader = self.parts.model, self.parts.loader
        if self.fast_path.compile:
            apply_compile(self.model)
        # The same seed on every rank gave identical initial weights; per-rank streams from here on.
        torch.manual_seed(cfg.trainer.seed + dist_info.rank)
        random.seed(cfg.trainer.seed + dist_info.rank)
        np.random.seed(cfg.trainer.seed + dist_info.rank)
        self.forward_model = self.model
        if self.sharded:
            apply_fsdp(self.model, init_device_mesh(self.device.type, (dist_info.world_size,)))
        elif dist_info.world_size > 1:
            self.forward_model = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.scaler = build_scaler(cfg.precision, self.device)
        self.optimizer = build_optimizer(cfg.optim, self.model, per_tensor_skips=self.scaler.skips_tensors,
                                         depths=layer_depths(self.model))
        self.graphed = None
        if self.fast_path.cuda_graph:
            self.graphed = GraphedForwardBackward(self.forward_backward, list(self.model.parameters()), self.device,
                                                  eager_on_failure=self.fast_path.cuda_graph_auto)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.trainer.max_steps)
        # After FSDP2's sharding: each rank then averages its own shards.
        self.ema = ModelEMA(self.model, cfg.trainer.ema_decay) if cfg.trainer.ema_decay is not None else None
        self.patch_embed = dict(self.model.named_parameters())[self.parts.patch_embed]
        self.rms_params: list[torch.nn.Parameter] = []  # update_rms's parameters, in the order of its RMS tensor
        self.param_names = {id(p): name for name, p in self.model.named_parameters()}
        self.spikes = SpikeDetector(cfg.spikes)
        self.progress = Progress(world_size=dist_info.world_size)
        # A resume applies changed optimizer settings (src/trainer/optim_resume.py) and says which.
        self.resumed_optimizer = ResumedOptimizer(checkpoint.OptimizerState(self.model, self.optimizer), cfg)
        self.resumed_schedule = ResumedSchedule(self.scheduler, cfg)
        self.state = TrainState(
            model=checkpoint.ModelState(self.model), progress=self.progress,
            shared={"optimizer": self.resumed_optimizer, "scheduler": self.resumed_schedule,
                    "scaler": self.scaler, "spikes": self.spikes},
            per_rank={"data": self.loader, "rng": RNGState()},
            files={EMA_FILE: self.ema} if self.ema is not None else {},
        )
        # Held-out data, or a set of eval.zeroshot / retrieval / val_loss, to evaluate on.
        self.evaluates = bool(cfg.data.eval_shards or cfg.eval.zeroshot or cfg.eval.retrieval or cfg.eval.val_loss)
        self.checkpoints = os.path.join(run_dir, "checkpoints")
        self.resumed_from: str | None = None  # the checkpoint directory this run resumed from
        if cfg.trainer.resume:
            self.resume(cfg.trainer.resume)
        # The metrics logger cuts its files back to the resumed step: it has no state of its own to save.
        self.metrics = MetricLogger(
            run_dir, cfg.logger, enabled=dist_info.is_main,
            config=OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True),
            start_step=self.progress.step, max_steps=cfg.trainer.max_steps, progress=cfg.trainer.progress,
            repeat_eval=self.progress.eval_pending,
        )

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of one batch, under autocast."""
        return self.parts.loss(self.forward_model, batch)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Everything before the optimizer: loss, backward, unscaling, clipping (what `trainer.cuda_graph` records).
        Device tensors only."""
        if self.cfg.trainer.accum_steps > 1:
            loss = accumulate_gradients(self.parts.features, self.parts.features_loss, self.forward_model, batch,
                                        self.cfg.trainer.accum_steps, scale=self.scaler.scale,
                                        autocast=self.autocast, device=self.device)
        else:
            with self.autocast():
                loss = self.forward_loss(batch)
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.gradients(), self.cfg.optim.grad_clip_norm, divisor=self.scaler.divisor,
                                   ignore_nonfinite=self.scaler.skips_tensors)
        # Gradients are averaged across ranks by now (under FSDP2 the norm adds up every rank's shards), so every
        # rank takes the same decision. (The fixed scaler's norm leaves non-finite tensors out: the optimizer skips
        # those one by one instead, also agreeing across shards.)
        return {"loss": loss.detach(), "grad_norm": grad_norm, "found_inf": (~grad_norm.isfinite()).float()}

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward, backward, update. Returns device tensors only: nothing here waits for the device."""
        if self.graphed is None:
            outputs = self.forward_backward(batch)
        else:
            outputs = self.graphed(batch)
        found_inf = outputs["found_inf"]
        self.scaler.step(self.optimizer, found_inf)
        num_grads = len(self.gradients())
        values = {"loss": outputs["loss"], "grad_norm": outputs["grad_norm"], "skipped_step": found_inf,
                  "logit_scale": self.model.logit_scale.detach().exp()}
        if getattr(self.model, "logit_bias", None) is not None:
            values["logit_bias"] = self.model.logit_bias.detach().clone()
        values.update(self.rms_metrics(num_grads, found_inf))
        if self.scaler.skips_tensors:  # every tensor skipping its own update applies nothing either
            values["skipped_step"] = (values["skipped_tensors"] >= num_grads).float()
        scale = self.scaler.current_scale()
        if scale is not None:
            values["scale"] = scale.detach().clone()
        if self.graphed is None or not self.graphed.captured:
            # A recorded backward writes its gradients into the same tensors at every replay: they must stay.
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.model.clamp_logit_scale()
        if self.ema is not None:
            self.ema.update()
        return values

    def rms_metrics(self, num_tensors: int, found_inf: torch.Tensor) -> dict[str, torch.Tensor]:
        skipped = getattr(self.optimizer, "last_skipped", None)
        values = {"skipped_tensors": skipped.float() if self.scaler.skips_tensors else found_inf * num_tensors}
        rms = update_rms(self.optimizer) if self.cfg.spikes.enabled else None
        if rms is not None:
            params, per_tensor = rms
            patch = next(i for i, p in enumerate(params) if p is self.patch_embed)
            values["rms_patch_embed"] = per_tensor[patch]
            values["rms_max"] = per_tensor.max()
            values["rms_max_tensor"] = per_tensor.argmax()  # an index into params, named at the logging sync
            self.rms_params = params
            values["clipped_frac"] = (per_tensor > self.cfg.optim.clip_threshold).float().mean()
        return values

    def fit(self) -> None:
        cfg = self.cfg.trainer
        end = cfg.max_steps if cfg.stop_at_step is None else min(cfg.stop_at_step, cfg.max_steps)
        pending: list[tuple[int, float, dict[str, torch.Tensor]]] = []
        window_start = time.perf_counter()
        if self.progress.eval_pending and not self.run_eval():  # a stop signal ended the owed evaluation again
            self.metrics.close()
            return
        self.progress.eval_pending = False
        with contextlib.closing(self.loader):  # its workers and decode threads end with the loop, however it ends
            while self.progress.step < end:
                batch = next(self.loader)
                # train/lr is optim.lr's schedule: the last parameter group is at depth 0, unscaled by layer decay.
                lr = self.scheduler.get_last_lr()[-1]
                pending.append((self.progress.step, lr, self.train_step(batch)))
                self.progress.step += 1
                stop = self.preemption.requested()
                if stop or self.progress.step % cfg.log_every == 0 or self.progress.step == end:
                    records, window_start = self.flush_metrics(pending, window_start)
                    self.check_zero_gradient(records)
                    pending = []
                    self.check_nonfinite()
                every = self.cfg.eval.every
                evaluate_now = every > 0 and self.progress.step % every == 0
                evaluate_now = self.evaluates and (evaluate_now or self.progress.step == cfg.max_steps)
                # A step's checkpoint comes before its evaluation, whatever trainer.ckpt_every says, and records that
                # the evaluation is owed: a crash, a failure or a stop signal in the evaluation then loses no
                # training, and the resumed run evaluates first. On a stop signal the evaluation (it can take long)
                # is left to the resumed run, and so is the rest of one that the signal interrupts.
                self.progress.eval_pending = evaluate_now
                due = (cfg.ckpt_every > 0 and self.progress.step % cfg.ckpt_every == 0) or self.progress.step == end
                if stop or due or evaluate_now:
                    self.save()
                if stop:
                    self.stopped("")
                    break
                if evaluate_now and not self.run_eval():
                    break
                self.progress.eval_pending = False
        self.metrics.close()

    def check_nonfinite(self) -> None:
        """Skipped steps change no weight, so the weights now are those of the last good update: save them."""
        limit, streak, step = self.cfg.trainer.max_nonfinite_steps, self.progress.nonfinite_streak, self.progress.step
        if limit is None or streak <= limit:
            return
        self.save()
        raise RuntimeError(
            f"the last {streak} steps had non-finite gradients and were skipped, more than "
            f"trainer.max_nonfinite_steps={limit}: stopping. The checkpoint of step {step} holds the weights "
            f"as they were after step {step - streak}. Lower optim.lr, try optim=stable_adamw "
            "or check the data near this step, then continue with trainer.resume=latest"
        )

    def check_zero_gradient(self, records: list[dict]) -> None:
        """Stop a run whose gradient was exactly 0 at every step of a logging window: nothing in it trains. The
        values came over with the window's metrics, so this costs no host sync."""
        if not records or any(r["train/grad_norm"] != 0.0 or r["train/skipped_step"] for r in records):
            return
        first, last, batch = records[0]["step"], records[-1]["step"], self.cfg.data.batch_size
        loss = records[-1]["train/loss"]
        raise RuntimeError(
            f"train/grad_norm was exactly 0 at every step from {first} to {last} (loss {loss:.4f}, "
            f"ln(data.batch_size={batch}) = {math.log(batch):.4f}): the loss gives no gradient, so nothing trains. "
            "It happens when every image embedding and every text embedding of a batch are identical, and so are "
            "the logits: with model.ls_init_value=0 every block starts as the identity, so a tower's embedding "
            "depends only on its pooled token (the image class token; the end-of-text token and its position), and "
            "captions that all have the same token length give one text embedding. Set model.ls_init_value to a "
            "small non-zero value (1e-4 keeps blocks within 1e-4 of the identity) or null, or train on captions of "
            "varied length; a global batch of one sample has nothing to contrast either (raise data.batch_size)"
        )

    def flush_metrics(self, pending: list, window_start: float) -> tuple[list[dict], float]:
        """The one host sync of a logging window: all of its per-step values come over at once. Returns the
        window's records and the window's end. The window runs from the previous window's sync to this one's, so
        the rate counts every second of the run: timed before the sync, it would leave out the steps the GPU had
        still queued (the host runs ahead), and overstate the rate."""
        names = list(pending[0][2])
        values = torch.stack([torch.stack([v[n].float() for n in names]) for _, _, v in pending])
        values[:, names.index("loss")] = all_reduce_mean(values[:, names.index("loss")])
        rows = values.tolist()  # waits for the window's steps
        window_end = time.perf_counter()
        samples_per_s = self.cfg.data.batch_size * len(pending) / (window_end - window_start)
        bad_data = self.loader.bad_counts()  # this rank's, cumulative
        records = []
        for (step, lr, _), row in zip(pending, rows):
            record = {METRIC_NAMES[name]: value for name, value in zip(names, row) if name != "rms_max_tensor"}
            record.update({"train/lr": lr, "train/samples_per_s": samples_per_s, "train/epoch": self.loader.epoch})
            record.update({f"data/bad/{reason}": n for reason, n in bad_data.items()})
            streak = self.progress.nonfinite_streak + 1 if record["train/skipped_step"] else 0
            self.progress.nonfinite_streak = streak
            if streak and self.dist.is_main:
                log.warning("step %d: non-finite gradients, update skipped (%d in a row)", step, streak)
            if self.dist.is_main and self.cfg.spikes.enabled:
                largest = None
                if "rms_max_tensor" in names:
                    largest = (record["optim/rms_max"], self.param_name(int(row[names.index("rms_max_tensor")])))
                record.update(self.detect_spikes(step, record, largest))
            self.metrics.log(step, record)
            records.append({"step": step, **record})
        self.metrics.flush(self.progress.step,
                           {"loss": record["train/loss"], "lr": pending[-1][1], "samples/s": samples_per_s})
        return records, window_end

    def param_name(self, index: int) -> str:
        """The name of update_rms's `index`-th parameter in the window's last step. Its order is the optimizer's,
        the same every step unless a parameter gains or loses its gradient within the window."""
        return self.param_names.get(id(self.rms_params[index]), "?")

    def detect_spikes(self, step: int, record: dict, largest_rms: tuple[float, str] | None) -> dict:
        events = self.spikes.update(step, record["train/loss"], record.get("optim/rms/patch_embed"), largest_rms)
        for event in events:
            self.metrics.event("spikes.jsonl", event)
            if event["type"] == "loss" and self.cfg.spikes.alert:
                self.metrics.alert(
                    f"loss spike in {self.cfg.experiment_name}",
                    f"step {step}: loss {event['loss']} vs running mean {event['mean']} "
                    f"(preceded by a patch-embedding RMS spike: {event['preceded_by_rms_spike']})",
                    wait_s=self.cfg.spikes.alert_wait_s,
                )
        counts = self.spikes.counts()
        return {
            "spike/loss": int(any(e["type"] == "loss" for e in events)),
            "spike/rms": int(any(e["type"] == "rms" for e in events)),
            "spike/loss_spikes": counts["loss_spikes"], "spike/rms_spikes": counts["rms_spikes"],
            "spike/loss_spikes_preceded": counts["loss_spikes_preceded"],
        }

    def stopped(self, where: str) -> None:
        received = self.preemption.received
        cause = received.name if received else "a signal to another rank"
        self.metrics.message(f"stopped at step {self.progress.step} on {cause}{where}; continue with "
                             "trainer.resume=latest")

    def run_eval(self) -> bool:
        """The parts' evaluation, logged by rank 0; every rank waits for it. Compiled blocks run eagerly unless
        eval.compile: their inference graphs would be compiled at the first evaluation, which on a GPU with a cold
        cache stalls the run for minutes. In one process a stop signal ends it before the next forward (False): the
        step's checkpoint, written before it, owes it to the resumed run. With several, ranks stop only between
        steps, all at once, and a signal during an evaluation waits for its end."""
        start = time.perf_counter()
        # A line before it too: an evaluation can take minutes, and without a progress bar the log is silent then.
        self.metrics.message(f"step {self.progress.step}: evaluating")
        stop = (lambda: self.preemption.received is not None) if self.dist.world_size == 1 else None
        try:
            with contextlib.nullcontext() if self.cfg.eval.compile else torch.compiler.set_stance("force_eager"):
                results = self.parts.evaluate(self.model, self.autocast, stop)
                if self.ema is not None:
                    # The same evaluation of the averaged weights, swapped into the model on every rank.
                    with self.ema.swapped() as averaged:
                        ema_results = self.parts.evaluate(averaged, self.autocast, stop)
                    if results is not None and ema_results is not None:
                        results.update({"eval_ema/" + k.removeprefix("eval/"): v for k, v in ema_results.items()})
        except EvaluationStopped:
            self.stopped(", in its evaluation, which the resumed run does first")
            return False
        if results is not None:
            self.log_eval(results, time.perf_counter() - start)
        barrier()
        return True

    def log_eval(self, results: dict[str, float], seconds: float) -> None:
        step = self.progress.step
        self.metrics.log(step, results)
        self.metrics.flush(step, {})
        self.metrics.message(
            f"step {step} eval: " + ", ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in results.items())
            + f" ({seconds:.1f} s)"
        )

    def save(self) -> None:
        path = checkpoint.save_train_state(self.checkpoints, self.progress.step, self.state, rank=self.dist.rank,
                                           keep_last_k=self.cfg.trainer.keep_last_k)
        self.metrics.message(f"saved checkpoint {path}")

    def resume(self, resume: str) -> None:
        path = checkpoint.find_resume(self.checkpoints, resume, self.cfg.trainer.resume_required,
                                      rank=self.dist.rank, checksums=True)
        if path is None:
            log.info("trainer.resume=latest: no checkpoint in %s yet, starting from step 0", self.checkpoints)
            return
        missing = checkpoint.load_train_state(path, self.state, rank=self.dist.rank)
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, self.progress.step)
        if EMA_FILE in missing:
            self.ema.reset()
            if self.dist.is_main:
                log.warning("%s has no EMA of the weights (its run had trainer.ema_decay=null): the EMA starts "
                            "from the resumed weights", path)
        changed = resume_summary(self.resumed_optimizer, self.resumed_schedule, self.progress.step)
        if changed and self.dist.is_main:
            log.warning(changed)
