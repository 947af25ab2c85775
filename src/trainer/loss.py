"""The symmetric InfoNCE loss of CLIP over the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from src.trainer.distributed import all_gather_with_grad


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Each rank scores its own rows against the gathered features of all ranks.

    The mean of the per-rank losses is the single-process loss of the global batch, and the gather's
    backward sums every rank's contribution into each feature, so after DDP's gradient averaging the
    gradients equal the single-process ones as well. Memory per rank is local × global, not global².
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    all_images = all_gather_with_grad(image_features)
    all_texts = all_gather_with_grad(text_features)
    logits_per_image = logit_scale * image_features @ all_texts.T
    logits_per_text = logit_scale * text_features @ all_images.T
    local = image_features.shape[0]
    labels = torch.arange(local, device=image_features.device) + rank * local
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
