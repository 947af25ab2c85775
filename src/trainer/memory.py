"""A run's expected memory per rank, from its configuration alone, and the memory the machine has: logged at the start
and checked by preflight, so that a run far too large for the machine stops with the numbers and a fix instead of
being killed by the kernel's out-of-memory killer, which leaves no trace in the run's log.

The estimate (per rank, in bytes):
- parameters, counted on the meta device: weights and gradients in float32 (4 + 4 bytes each, + 4 for the weights'
  EMA with trainer.ema_decay set) and the optimizer's two moments (8 bytes for AdamW and StableAdamW, 2 for 8-bit
  AdamW); FSDP2 shards all three over the ranks, except the gradients under trainer.accum_steps > 1, which FSDP2
  accumulates whole until the step's one reduction;
- activations kept for the backward, per sample and per transformer block of width d over n tokens: about
  (10 + 2·mlp_ratio)·d·n values without checkpointing (the norms' inputs and outputs, q, k, v, the attention output,
  the residuals, the MLP's hidden and GELU outputs; fused attention keeps no n×n scores), d·n for a block whose
  whole forward is recomputed (model.checkpoint_policy=full, every model.checkpoint_every-th block) and
  (4 + mlp_ratio)·d·n for selective checkpointing (the matmuls' inputs and outputs); values are 2 bytes under
  bf16/fp16 autocast, 4 in fp32. The image tower sees each sample's frames (data.frames, split over trainer.sp_size
  ranks) with patch dropout's share of tokens dropped, the text tower its context length. The input images add
  4 bytes per pixel and channel;
- with checkpointing, the backward of a checkpointed block holds that block's activations, recomputed, and their
  gradients at once: twice the uncheckpointed values of the tower's largest block, per sample;
- a locked tower (model.vision.lock, model.text.lock) has weights but no gradients, no optimizer state and no
  activations, except in its unlocked blocks and head.
It leaves out what does not grow with the model or the batch (the loader's workers, CUDA's context). Against the
peak measured on a GPU it came within 0.91-1.11x, over ViT-B/32 to ViT-H/14, each checkpointing policy, bf16 and
fp32 (docs/BENCHMARKS.md, "Memory estimate"), so a run is refused only when it exceeds the machine by REFUSE_ABOVE.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from src.config import TextConfig, TrainConfig, VisionConfig
from src.models.clip import build_model, count_parameters

REFUSE_ABOVE = 1.5  # refuse a run whose estimate exceeds the memory it would run in by this factor
GB = 1e9
OPTIMIZER_BYTES = {"adamw": 8, "stable_adamw": 8, "adamw8bit": 2}  # per parameter: the two moments


@dataclass
class MemoryEstimate:
    parameters: int  # the model's parameter count
    weights_bytes: float  # weights and gradients (and the weights' EMA), this rank's share
    optimizer_bytes: float  # the optimizer's moments, this rank's share
    activation_bytes_per_sample: float
    samples: int  # this rank's share of the global batch (of one micro-batch with trainer.accum_steps)

    @property
    def total(self) -> float:
        return self.weights_bytes + self.optimizer_bytes + self.activation_bytes_per_sample * self.samples

    def describe(self) -> str:
        return (f"{self.parameters / 1e6:.1f}M parameters: weights and gradients {self.weights_bytes / GB:.2f} GB, "
                f"optimizer state {self.optimizer_bytes / GB:.2f} GB, activations "
                f"{self.activation_bytes_per_sample / 1e6:.1f} MB per sample x {self.samples} samples = "
                f"{self.activation_bytes_per_sample * self.samples / GB:.1f} GB; total {self.total / GB:.1f} GB")


def block_values_per_token(width: int, mlp_ratio: float, policy: str) -> float:
    """Activation values one transformer block keeps per token for its backward (see the module's formula)."""
    if policy == "full":
        return width
    if policy == "selective":
        return (4 + mlp_ratio) * width
    return (10 + 2 * mlp_ratio) * width


def tower_values(tower: VisionConfig | TextConfig, tokens: float, policy: str, every: int) -> float:
    """Activation values one sample keeps in a tower of `tower.layers` blocks, checkpointed blocks being every
    `every`-th (0, every, 2·every, ...) as the model sets them."""
    checkpointed = 0 if policy == "none" else math.ceil(tower.layers / every)
    plain = tower.layers - checkpointed
    return tokens * (plain * block_values_per_token(tower.width, tower.mlp_ratio, "none")
                     + checkpointed * block_values_per_token(tower.width, tower.mlp_ratio, policy))


def estimate_memory(cfg: TrainConfig, world_size: int) -> MemoryEstimate:
    model = cfg.model
    counts = count_parameters(build_model(model, "meta"))
    parameters, trained = counts["total"], counts["trainable"]
    shards = world_size if cfg.trainer.data_parallel == "fsdp2" else 1
    gradient_shards = shards if cfg.trainer.accum_steps == 1 else 1
    policy = "full" if model.grad_checkpointing and model.checkpoint_policy == "none" else str(model.checkpoint_policy)
    vision = model.vision
    frames = max(1, cfg.data.frames) / (cfg.trainer.sp_size if cfg.data.frames else 1)
    patches = (vision.image_size // vision.patch_size) ** 2
    image_tokens = frames * (1 + patches * (1 - vision.patch_dropout))
    # A locked tower keeps activations in its unlocked blocks alone.
    vision_trained, text_trained = (replace(tower, layers=tower.unlocked_blocks) if tower.lock else tower
                                    for tower in (vision, model.text))
    values = (tower_values(vision_trained, image_tokens, policy, model.checkpoint_every)
              + tower_values(text_trained, model.text.context_length, policy, model.checkpoint_every))
    if policy != "none":
        trained_towers = ((vision_trained, image_tokens), (text_trained, model.text.context_length))
        values += 2 * max((tower_values(tower, tokens, "none", 1) / tower.layers
                           for tower, tokens in trained_towers if tower.layers), default=0)
    value_bytes = 4 if cfg.precision.dtype == "fp32" else 2
    input_bytes = frames * 3 * vision.image_size**2 * 4
    # Accumulation keeps one micro-batch's activations at a time (src/trainer/grad_cache.py).
    samples = cfg.data.batch_size // world_size // cfg.trainer.accum_steps
    samples *= cfg.trainer.sp_size if cfg.data.frames else 1
    return MemoryEstimate(
        parameters=parameters,
        weights_bytes=((4 * parameters + (0 if cfg.trainer.ema_decay is None else 4) * trained) / shards
                       + 4 * trained / gradient_shards),
        optimizer_bytes=OPTIMIZER_BYTES[str(cfg.optim.name)] * trained / shards,
        activation_bytes_per_sample=values * value_bytes + input_bytes,
        samples=samples,
    )


def cgroup_limit() -> float | None:
    """The memory limit of this process's cgroup (a container or a scheduler's job), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # cgroup v1 writes "no limit" as a huge number
            return float(text)
    return None


def available_memory(device: torch.device) -> tuple[float, str]:
    """The memory one rank's state lives in: its GPU's, or on the CPU the machine's RAM (or its cgroup's limit)
    shared by the node's ranks; with a description for messages."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1]), f"GPU memory of {torch.cuda.get_device_name(device)}"
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limit = cgroup_limit()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    what = "RAM" if limit is None or limit >= ram else "cgroup memory limit"
    share = f", shared by {ranks} ranks" if ranks > 1 else ""
    return min(ram, limit or ram) / ranks, f"this machine's {what}{share}"


def check_memory(estimate: MemoryEstimate, available: float, where: str) -> None:
    if estimate.total <= REFUSE_ABOVE * available:
        return
    fitting = (REFUSE_ABOVE * available - estimate.weights_bytes - estimate.optimizer_bytes) / \
        estimate.activation_bytes_per_sample
    batch_hint = (f"a smaller data.batch_size (about {int(fitting)} samples per rank would fit the estimate)"
                  if fitting >= 1 else "a smaller model (the weights and optimizer state alone do not fit)")
    raise ValueError(
        f"the run needs about {estimate.total / GB:.1f} GB per rank ({estimate.describe()}), more than "
        f"{REFUSE_ABOVE}x the {available / GB:.1f} GB of {where}: it would be killed for lack of memory. Use "
        f"{batch_hint}, model.checkpoint_policy=full (recompute blocks in the backward), a larger "
        "trainer.accum_steps (micro-batches, the same gradient), more ranks, or "
        "trainer.data_parallel=fsdp2 to shard the weights and optimizer state"
    )
