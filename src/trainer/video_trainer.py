"""Video-language fine-tuning: the parts the Trainer runs for it (`video_parts`: the video model, a data-parallel ×
sequence-parallel mesh, the video-text losses and retrieval evaluation; docs/video.md).

Gradients under sequence parallelism. Every rank computes the full loss of its data-parallel rank's batch
from the same gathered scores, and every collective in the forward pass (the frame-sum all-reduce, the
LV-XAttn ring, the caption and score gathers) has the exact adjoint as its backward: it sums what the ranks'
copies of the loss send back. The gradients of all ranks then add up to sp_size × dp_size times the gradient
of the mean data-parallel loss, whichever rank computed which part, so DDP's average over all ranks is the
single-process gradient (tests/test_video_finetune.py checks it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from src.config import TrainConfig, VideoConfig
from src.data.image_text import Preprocess
from src.data.loader import TrainLoader
from src.models.locking import forward_order, image_tower
from src.models.video_clip import VideoCLIP, VideoTextOutput, build_video_model
from src.parallel.distributed import DistInfo, all_gather_with_grad
from src.parallel.mesh import Mesh
from src.trainer.loss import clip_loss, pair_loss
from src.trainer.trainer import TrainParts, build_model, image_normalizer, spike_parameter
from src.trainer.video_eval import evaluate_video

log = logging.getLogger(__name__)


def video_text_loss(
    out: VideoTextOutput, weights: VideoConfig, dp_group: ProcessGroup | None, sp_group: ProcessGroup | None,
) -> torch.Tensor:
    """`weights` = model.video: the video-text contrastive loss (on the head's scores, or, for the mean-pooling
    baseline, on the frame-averaged embeddings) plus the optional image-text loss on frame-averaged features."""
    video, text, scale = out.video.float(), out.text.float(), out.logit_scale.float()
    if out.scores is None:
        loss = clip_loss(video, text, scale, dp_group)
    else:
        # This rank's clips against every caption: the sequence-parallel ranks each scored a share of them.
        rows = all_gather_with_grad(out.scores.float().T.contiguous(), sp_group).T
        loss = pair_loss(scale * rows, dp_group)
    loss = weights.video_text_weight * loss
    if weights.image_text_weight:
        loss = loss + weights.image_text_weight * clip_loss(video, text, scale, dp_group)
    return loss


def video_parts(cfg: TrainConfig, dist_info: DistInfo) -> TrainParts:
    """The parts of a video fine-tuning run, on a data-parallel × sequence-parallel mesh: which clips (the loader)
    and which frames (the model, the loss) this rank gets follow from it."""
    if not cfg.data.frames:
        raise ValueError("data.frames=0 loads images, but video fine-tuning needs clips: set data.frames to the "
                         "frames per clip (T), e.g. data=video_wds data.frames=8")
    mesh = Mesh.build(cfg.trainer.sp_size, dist_info.world_size)
    frame_slice = mesh.frames(cfg.data.frames)
    if cfg.model.video.head == "xattn" and cfg.data.batch_size % mesh.sp_size:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} is not divisible by trainer.sp_size="
                         f"{mesh.sp_size}: the ranks of a sequence-parallel group score equal shares of the "
                         f"batch's captions; pick a multiple of {mesh.sp_size}")
    device = dist_info.device
    model = build_model(cfg, lambda: build_video_model(cfg.model, cfg.data.frames, device))
    # The ranks of a sequence-parallel group read the same clips: the loader sees only data-parallel ranks.
    loader = TrainLoader(
        cfg.data, image_size=cfg.model.vision.image_size, context_length=cfg.model.text.context_length,
        seed=cfg.trainer.seed, rank=mesh.dp_rank, world_size=mesh.dp_size, pin_memory=device.type == "cuda",
    )
    normalize = image_normalizer(cfg, device)
    gather = None
    if mesh.dp_group is not None:
        gather = functools.partial(all_gather_with_grad, group=mesh.dp_group)

    def loss(forward_model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        frames = normalize(batch["images"][:, frame_slice].to(device, non_blocking=True))
        tokens = batch["tokens"].to(device, non_blocking=True)
        out = forward_model(frames, tokens, first_frame=frame_slice.start, group=mesh.sp_group, gather=gather)
        return video_text_loss(out, cfg.model.video, mesh.dp_group, mesh.sp_group)

    def evaluate(model: VideoCLIP, autocast: Callable, stop: Callable[[], bool] | None) -> dict[str, float] | None:
        """On the ranks of rank 0's sequence-parallel group (each encodes its frames); the others wait."""
        if mesh.dp_rank != 0:
            return None
        results = evaluate_video(
            model, cfg.data.eval_shards, frames=frame_slice, total_frames=cfg.data.frames,
            batch_size=cfg.eval.batch_size, image_size=cfg.model.vision.image_size,
            context_length=cfg.model.text.context_length, num_workers=cfg.data.num_workers, device=device,
            prepare_images=normalize, autocast=autocast, max_image_pixels=cfg.data.max_image_pixels,
            retries=cfg.data.shard_retries, group=mesh.sp_group, preprocess=Preprocess.from_config(cfg.data),
            progress=cfg.trainer.progress and dist_info.is_main, stop=stop,
        )
        return results if dist_info.is_main else None

    visual_path = forward_order(image_tower(model.clip))
    if model.head is not None:
        visual_path.append(model.temporal_embedding)
    return TrainParts(model, loader, loss, evaluate, spike_parameter(model, visual_path))
