"""SigLIP's sigmoid loss (Zhai et al. 2023, arXiv 2303.15343), in the chunked form of its distributed
implementation: each rank scores its images against its own captions, then against every other rank's
captions as they pass round the ring (src/parallel/neighbour_exchange.py). No rank holds more than a
(local x local) block of logits, or more than two other ranks' text features.

Every image-caption pair (i, j) is a binary decision, z_ij = t·<x_i, y_j> + b, labelled +1 for i = j and -1
otherwise: ℓ_ij = -log σ(±z_ij). The single-process loss of a batch of B pairs is Σ_ij ℓ_ij / B, as in
OpenCLIP's `SigLipLoss` and big_vision. Each rank returns the sum over its b = B / W images and all B captions,
divided by b: the mean over the ranks is the single-process loss, so DDP's gradient averaging gives its
gradients, and the ring's backward brings each caption the gradients of every rank's images."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from src.parallel.neighbour_exchange import ring_pass


def pair_logits(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None) -> torch.Tensor:
    logits = logit_scale * image_features @ text_features.T
    return logits if logit_bias is None else logits + logit_bias


def siglip_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's share of the sigmoid loss of the global batch over the ranks of `group` (default: all): its
    images against every caption, divided by its number of images. `logit_scale` is the scale itself (the
    exponential of the parameter), as CLIP's forward returns it; `logit_bias` may be None (no bias)."""
    logits = pair_logits(image_features, text_features, logit_scale, logit_bias)
    # -log σ(-z) = softplus(z) for every pair, and -log σ(z) = softplus(z) - z on the diagonal: no label matrix.
    total = F.softplus(logits).sum() - logits.diagonal().sum()
    for other_texts in ring_pass(text_features, group):
        total = total + F.softplus(pair_logits(image_features, other_texts, logit_scale, logit_bias)).sum()
    return total / image_features.shape[0]
