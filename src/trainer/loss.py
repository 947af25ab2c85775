"""The symmetric InfoNCE loss of CLIP over the global batch, and `contrastive_loss`: the loss `loss.name` picks
(this one, or SigLIP's sigmoid loss in src/trainer/siglip_loss.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from src.config import LossConfig
from src.parallel.distributed import all_gather_with_grad
from src.trainer.siglip_loss import siglip_loss

# (image features, text features, logit scale, logit bias or None) -> this rank's loss. The mean over the ranks
# is the single-process loss of the global batch, and DDP's averaged gradients are its gradients.
# (image features, text features, logit scale, logit bias or None, process group or None) -> loss
ContrastiveLoss = Callable[..., torch.Tensor]


def _local_labels(rows: int, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """Global batch positions of this rank's rows: ranks hold equal, consecutive slices of the batch."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return torch.arange(rows, device=device) + rank * rows


def clip_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Each rank scores its own rows against the gathered features of all ranks of `group` (default: all).

    The mean of the per-rank losses is the single-process loss of the global batch, and the gather's
    backward sums every rank's contribution into each feature, so after DDP's gradient averaging the
    gradients equal the single-process ones as well. Memory per rank is local × global, not global².
    """
    all_images = all_gather_with_grad(image_features, group)
    all_texts = all_gather_with_grad(text_features, group)
    logits_per_image = logit_scale * image_features @ all_texts.T
    logits_per_text = logit_scale * text_features @ all_images.T
    labels = _local_labels(image_features.shape[0], group, image_features.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def pair_loss(logits: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The same symmetric InfoNCE when a pair's score is not a dot product of two embeddings (a head that
    looks at the video and the caption together): `logits` holds this rank's rows of the global
    (clip × caption) matrix, this rank's clips against every caption of the global batch.

    Scoring a caption against every clip needs the other ranks' rows, so the row blocks are gathered (with
    gradient) and each rank takes its own captions' columns; as in `clip_loss`, the mean over ranks is the
    single-process loss.
    """
    labels = _local_labels(logits.shape[0], group, logits.device)
    per_text = all_gather_with_grad(logits, group)[:, labels].T
    return (F.cross_entropy(logits, labels) + F.cross_entropy(per_text, labels)) / 2


def _clip_loss_without_bias(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                            logit_bias: torch.Tensor | None, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    if logit_bias is not None:  # preflight refuses the combination; a model built by hand may still have one
        raise ValueError("loss=clip's softmax ignores a bias added to every logit, so the model's logit_bias would "
                         "get no gradient: build the model with model.init_logit_bias=null, or use loss=siglip")
    return clip_loss(image_features, text_features, logit_scale, group)


def contrastive_loss(cfg: LossConfig) -> ContrastiveLoss:
    """The loss `loss.name` names, called as loss(image_features, text_features, logit_scale, logit_bias, group),
    over the ranks of `group` (default: all)."""
    return {"clip": _clip_loss_without_bias, "siglip": siglip_loss}[cfg.name]
