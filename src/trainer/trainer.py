"""The Trainer: composes model, data, optimizer, schedule, precision, logging and checkpoints."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from src.config import TrainConfig
from src.data.image_text import ImageNormalizer
from src.data.loader import TrainLoader
from src.kernels.dispatch import apply_kernels
from src.models.clip import build_model
from src.optim import build_optimizer, build_scheduler
from src.optim.grad_norm import clip_grad_norm
from src.optim.rms import update_rms
from src.optim.scalers import build_scaler
from src.parallel.distributed import DistInfo, all_reduce_mean, barrier
from src.parallel.parallelize import apply_compile, apply_fsdp, unsharded_root
from src.trainer import checkpoint, faults
from src.trainer.cuda_graph import GraphedForwardBackward, check_cuda_graph
from src.trainer.evaluate import evaluate
from src.trainer.loss import clip_loss
from src.trainer.metrics import MetricLogger
from src.trainer.preemption import Preemption
from src.trainer.preflight import check_data_parallel
from src.trainer.pretrained import load_pretrained
from src.trainer.spikes import SpikeDetector

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The patch embedding is where the paper finds RMS spikes 1-8 steps before loss spikes.
PATCH_EMBED = "visual.conv1.weight"
METRIC_NAMES = {
    "loss": "train/loss", "grad_norm": "train/grad_norm", "skipped_step": "train/skipped_step",
    "logit_scale": "train/logit_scale", "skipped_tensors": "scaler/skipped_tensors", "scale": "scaler/scale",
    "rms_patch_embed": "optim/rms/patch_embed", "rms_max": "optim/rms_max", "clipped_frac": "optim/clipped_frac",
}


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        # weights_only loading refuses numpy arrays, so the Mersenne-Twister keys travel as a tensor.
        "numpy": [torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(tuple(v.numpy() if isinstance(v, torch.Tensor) else v for v in state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: str, dist_info: DistInfo):
        self.cfg, self.run_dir, self.dist = cfg, run_dir, dist_info
        self.device = dist_info.device
        if cfg.precision.dtype not in AUTOCAST_DTYPES:
            raise ValueError(
                f"precision.dtype={cfg.precision.dtype!r} is not supported: choose one of "
                + ", ".join(AUTOCAST_DTYPES)
            )
        self.autocast_dtype = AUTOCAST_DTYPES[cfg.precision.dtype]
        self.preemption = Preemption(cfg.trainer.preempt_deadline_s)
        self.check_config()
        check_data_parallel(cfg.trainer.data_parallel, video=bool(cfg.data.frames))
        # One rank has nothing to shard: it runs the plain model, as DDP does.
        self.sharded = cfg.trainer.data_parallel == "fsdp2" and dist_info.world_size > 1
        # Same seed on every rank for identical initial weights; per-rank streams afterwards.
        torch.manual_seed(cfg.trainer.seed)
        self.model = apply_kernels(self.build_model(), cfg.model)
        if cfg.trainer.compile:
            apply_compile(self.model)
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
        self.optimizer = build_optimizer(cfg.optim, self.model, per_tensor_skips=self.scaler.skips_tensors)
        self.graphed = None
        if cfg.trainer.cuda_graph:
            check_cuda_graph(self.device, dist_info.world_size, cfg.precision.scaler)
            self.graphed = GraphedForwardBackward(self.forward_backward, list(self.model.parameters()), self.device)
        self.scheduler = build_scheduler(
            self.optimizer, cfg.optim.warmup_steps, cfg.trainer.max_steps, cfg.optim.min_lr_ratio
        )
        self.loader = self.build_loader()
        self.normalize = ImageNormalizer(self.device, dtype=self.autocast_dtype or torch.float32,
                                         compile=cfg.trainer.compile)
        self.patch_embed = dict(self.model.named_parameters())[self.patch_embed_name]
        self.spikes = SpikeDetector(cfg.spikes)
        self.step = 0
        self.nonfinite_streak = 0  # skipped steps in a row
        self.eval_pending = False  # a stop signal came before this step's evaluation
        self.checkpoints = os.path.join(run_dir, "checkpoints")
        if cfg.trainer.resume:
            self.resume(cfg.trainer.resume)
        self.metrics = MetricLogger(
            run_dir, cfg.logger, enabled=dist_info.is_main, config=OmegaConf.to_container(OmegaConf.structured(cfg)),
            start_step=self.step, max_steps=cfg.trainer.max_steps, progress=cfg.trainer.progress,
            repeat_eval=self.eval_pending,
        )

    # Hooks a specialised trainer (e.g. video fine-tuning) overrides; the loop, precision, logging and
    # checkpoints stay shared.
    patch_embed_name = PATCH_EMBED

    def check_config(self) -> None:
        if self.cfg.data.frames:
            raise ValueError(
                f"data.frames={self.cfg.data.frames} loads video clips, but the CLIP trainer takes images: use "
                "experiment=video_finetune for video, or data.frames=0"
            )

    def new_model(self) -> torch.nn.Module:
        """The architecture, freshly initialised."""
        return build_model(self.cfg.model, self.device)

    def data_ranks(self) -> tuple[int, int]:
        """(this rank, ranks) as the loader splits the data."""
        return self.dist.rank, self.dist.world_size

    def build_model(self) -> torch.nn.Module:
        model = self.new_model()
        if self.cfg.model.init_from:
            log.info("model weights from %s", load_pretrained(model, self.cfg.model.init_from))
        return model

    def build_loader(self) -> TrainLoader:
        cfg = self.cfg
        rank, world_size = self.data_ranks()
        return TrainLoader(
            cfg.data, image_size=cfg.model.vision.image_size, context_length=cfg.model.text.context_length,
            seed=cfg.trainer.seed, rank=rank, world_size=world_size, pin_memory=self.device.type == "cuda",
        )

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of one batch, under autocast."""
        images = self.normalize(batch["images"].to(self.device, non_blocking=True))
        tokens = batch["tokens"].to(self.device, non_blocking=True)
        image_features, text_features, logit_scale = self.forward_model(images, tokens)
        return clip_loss(image_features.float(), text_features.float(), logit_scale.float())

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Everything before the optimizer: loss, backward, unscaling, clipping (what `trainer.cuda_graph` records).
        Device tensors only."""
        with self.autocast():
            loss = faults.corrupt_loss(self.step, self.forward_loss(batch))
        self.scaler.scale(loss).backward()
        faults.corrupt_grad(self.step, self.model)
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
            values["clipped_frac"] = (per_tensor > self.cfg.optim.clip_threshold).float().mean()
        return values

    def fit(self) -> None:
        cfg = self.cfg.trainer
        end = cfg.max_steps if cfg.stop_at_step is None else min(cfg.stop_at_step, cfg.max_steps)
        pending: list[tuple[int, float, dict[str, torch.Tensor]]] = []
        window_start, window_steps = time.perf_counter(), 0
        if self.eval_pending:
            self.run_eval()
            self.eval_pending = False
        while self.step < end:
            batch = next(self.loader)
            lr = self.scheduler.get_last_lr()[0]
            pending.append((self.step, lr, self.train_step(batch)))
            self.step += 1
            window_steps += 1
            faults.pause("step", self.step)
            stop = self.preemption.requested()
            if stop or self.step % cfg.log_every == 0 or self.step == end:
                elapsed = time.perf_counter() - window_start
                self.flush_metrics(pending, self.cfg.data.batch_size * window_steps / elapsed)
                pending, window_start, window_steps = [], time.perf_counter(), 0
                self.check_nonfinite()
            evaluate_now = cfg.eval.every > 0 and self.step % cfg.eval.every == 0
            evaluate_now = bool(self.cfg.data.eval_shards) and (evaluate_now or self.step == cfg.max_steps)
            if stop:
                # The evaluation can take long: the resumed run does it first instead.
                self.eval_pending = evaluate_now
                self.save()
                received = self.preemption.received
                cause = received.name if received else "a signal to another rank"
                self.metrics.message(f"stopped at step {self.step} on {cause}; continue with trainer.resume=latest")
                break
            if evaluate_now:
                self.run_eval()
            if (cfg.ckpt_every > 0 and self.step % cfg.ckpt_every == 0) or self.step == end:
                self.save()
        self.metrics.close()

    def check_nonfinite(self) -> None:
        """Skipped steps change no weight, so the weights now are those of the last good update: save them."""
        limit = self.cfg.trainer.max_nonfinite_steps
        if limit is None or self.nonfinite_streak <= limit:
            return
        self.save()
        raise RuntimeError(
            f"the last {self.nonfinite_streak} steps had non-finite gradients and were skipped, more than "
            f"trainer.max_nonfinite_steps={limit}: stopping. The checkpoint of step {self.step} holds the weights "
            f"as they were after step {self.step - self.nonfinite_streak}. Lower optim.lr, try optim=stable_adamw "
            "or check the data near this step, then continue with trainer.resume=latest"
        )

    def flush_metrics(self, pending: list, samples_per_s: float) -> None:
        """The one host sync of a logging window: all of its per-step values come over at once."""
        names = list(pending[0][2])
        values = torch.stack([torch.stack([v[n].float() for n in names]) for _, _, v in pending])
        values[:, names.index("loss")] = all_reduce_mean(values[:, names.index("loss")])
        bad_data = self.loader.bad_counts()  # this rank's, cumulative
        for (step, lr, _), row in zip(pending, values.tolist()):
            record = {METRIC_NAMES[name]: value for name, value in zip(names, row)}
            record.update({"train/lr": lr, "train/samples_per_s": samples_per_s, "train/epoch": self.loader.epoch})
            record.update({f"data/bad/{reason}": n for reason, n in bad_data.items()})
            self.nonfinite_streak = self.nonfinite_streak + 1 if record["train/skipped_step"] else 0
            if self.nonfinite_streak and self.dist.is_main:
                log.warning("step %d: non-finite gradients, update skipped (%d in a row)", step, self.nonfinite_streak)
            if self.dist.is_main and self.cfg.spikes.enabled:
                record.update(self.detect_spikes(step, record))
            self.metrics.log(step, record)
        self.metrics.flush(self.step, {"loss": record["train/loss"], "lr": pending[-1][1], "samples/s": samples_per_s})

    def detect_spikes(self, step: int, record: dict) -> dict:
        events = self.spikes.update(step, record["train/loss"], record.get("optim/rms/patch_embed"))
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

    def run_eval(self) -> None:
        """On rank 0 only, on the unwrapped model; the other ranks wait. Under FSDP2 every forward needs every
        rank's shards, so all ranks evaluate the same data and rank 0 logs."""
        if self.dist.is_main or self.sharded:
            if self.dist.is_main:
                faults.pause("eval", self.step)
            cfg = self.cfg
            with unsharded_root(self.model):
                results = evaluate(
                    self.model, cfg.data.eval_shards, batch_size=cfg.trainer.eval.batch_size,
                    image_size=cfg.model.vision.image_size, context_length=cfg.model.text.context_length,
                    num_workers=cfg.data.num_workers, device=self.device, prepare_images=self.normalize,
                    autocast=self.autocast, zeroshot=cfg.trainer.eval.zeroshot, retrieval=cfg.trainer.eval.retrieval,
                )
            if self.dist.is_main:
                self.log_eval(results)
        barrier()

    def log_eval(self, results: dict[str, float]) -> None:
        self.metrics.log(self.step, results)
        self.metrics.flush(self.step, {})
        self.metrics.message(
            f"step {self.step} eval: " + ", ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in results.items())
        )

    def save(self) -> None:
        shared = {
            "model": checkpoint.model_state(self.model),
            "train_state": {
                "optimizer": checkpoint.optimizer_state(self.model, self.optimizer),
                "scheduler": self.scheduler.state_dict(),
                "step": self.step, "world_size": self.dist.world_size, "scaler": self.scaler.state_dict(),
                "spikes": self.spikes.state_dict(), "nonfinite_streak": self.nonfinite_streak,
                "eval_pending": self.eval_pending,
            },
        }
        per_rank = {"rng": rng_state(), "data": self.loader.state_dict()}
        path = checkpoint.save_checkpoint(
            self.checkpoints, self.step, rank=self.dist.rank, shared=shared, per_rank=per_rank,
            keep_last_k=self.cfg.trainer.keep_last_k,
        )
        self.metrics.message(f"saved checkpoint {path}")

    def resume(self, resume: str) -> None:
        path = checkpoint.find_resume(self.checkpoints, resume, self.cfg.trainer.resume_required)
        if path is None:
            log.info("trainer.resume=latest: no checkpoint in %s yet, starting from step 0", self.checkpoints)
            return
        rank_file = os.path.join(path, f"rank_{self.dist.rank}.pt")
        if not os.path.isfile(rank_file):
            raise FileNotFoundError(
                f"{path!r} has no state for rank {self.dist.rank}: it was saved with fewer ranks; resume "
                "with the world size it was saved with"
            )
        checkpoint.load_model_state(self.model, checkpoint.load_file(path, "model"))
        state = checkpoint.load_file(path, "train_state")
        checkpoint.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.scaler.load_state_dict(state["scaler"])
        self.spikes.load_state_dict(state["spikes"])
        # Checkpoints written before these keys existed had neither.
        self.nonfinite_streak = state.get("nonfinite_streak", 0)
        self.eval_pending = state.get("eval_pending", False)
        mine = checkpoint.load_file(path, f"rank_{self.dist.rank}")
        self.loader.load_state_dict(mine["data"])
        set_rng_state(mine["rng"])
        log.info("resumed from %s at step %d", path, self.step)

