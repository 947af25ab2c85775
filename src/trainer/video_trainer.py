"""Video-language fine-tuning: the Trainer's loop, precision, logging and checkpoints, with the video model,
a data-parallel × sequence-parallel mesh, the video-text losses and retrieval evaluation (docs/video.md).

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

import torch
from torch.distributed import ProcessGroup

from src.config import TrainConfig, VideoConfig
from src.models.video_clip import VideoCLIP, VideoTextOutput, build_video_model
from src.parallel.distributed import DistInfo, all_gather_with_grad, barrier
from src.parallel.mesh import Mesh
from src.trainer.loss import clip_loss, pair_loss
from src.trainer.trainer import Trainer
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


class VideoTrainer(Trainer):
    model: VideoCLIP

    def __init__(self, cfg: TrainConfig, run_dir: str, dist_info: DistInfo):
        # Which clips (the loader) and which frames (the model) this rank gets: needed before either is built.
        self.mesh = Mesh.build(cfg.trainer.sp_size, dist_info.world_size)
        super().__init__(cfg, run_dir, dist_info)

    @property
    def patch_embed_name(self) -> str:
        """Spike tracking follows the first trained layer of the visual path: the patch embedding, or, with the
        image tower's stem frozen, the first trained block or the temporal embedding."""
        trained = [name for name, p in self.model.named_parameters() if p.requires_grad]
        visual = [name for name in trained if name.startswith("clip.visual.") or name == "temporal_embedding"]
        return (visual or trained)[0]

    def check_config(self) -> None:
        cfg = self.cfg
        if not cfg.data.frames:
            raise ValueError("data.frames=0 loads images, but video fine-tuning needs clips: set data.frames to the "
                             "frames per clip (T), e.g. data=video_wds data.frames=8")
        self.frame_slice = self.mesh.frames(cfg.data.frames)
        if cfg.model.video.head == "xattn" and cfg.data.batch_size % self.mesh.sp_size:
            raise ValueError(f"data.batch_size={cfg.data.batch_size} is not divisible by trainer.sp_size="
                             f"{self.mesh.sp_size}: the ranks of a sequence-parallel group score equal shares of the "
                             f"batch's captions; pick a multiple of {self.mesh.sp_size}")

    def new_model(self) -> VideoCLIP:
        return build_video_model(self.cfg.model, self.cfg.data.frames, self.device)

    def data_ranks(self) -> tuple[int, int]:
        # The ranks of a sequence-parallel group read the same clips: the loader sees only data-parallel ranks.
        return self.mesh.dp_rank, self.mesh.dp_size

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        frames = self.normalize(batch["images"][:, self.frame_slice].to(self.device, non_blocking=True))
        tokens = batch["tokens"].to(self.device, non_blocking=True)
        gather = None
        if self.mesh.dp_group is not None:
            gather = functools.partial(all_gather_with_grad, group=self.mesh.dp_group)
        out = self.forward_model(frames, tokens, first_frame=self.frame_slice.start, group=self.mesh.sp_group,
                                 gather=gather)
        return video_text_loss(out, self.cfg.model.video, self.mesh.dp_group, self.mesh.sp_group)

    def run_eval(self) -> None:
        """On the ranks of rank 0's sequence-parallel group (each encodes its frames); the others wait."""
        if self.mesh.dp_rank == 0:
            cfg = self.cfg
            results = evaluate_video(
                self.model, cfg.data.eval_shards, frames=self.frame_slice, total_frames=cfg.data.frames,
                batch_size=cfg.trainer.eval.batch_size, image_size=cfg.model.vision.image_size,
                context_length=cfg.model.text.context_length, num_workers=cfg.data.num_workers, device=self.device,
                prepare_images=self.normalize, autocast=self.autocast, group=self.mesh.sp_group,
            )
            if self.dist.is_main:
                self.log_eval(results)
        barrier()
