"""trainer.accum_steps: the exact gradient of a contrastive batch computed in micro-batches (GradCache, Gao et al.
2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup").

A contrastive loss couples every sample with every other, so the sum of per-micro-batch losses is another loss.
Instead, with N micro-batches of this rank's share:
1. each micro-batch's features (the model's outputs: per-sample embeddings and the model's 0-dim scalars, such as
   the logit scale) are computed and cached; the first keeps its autograd graph, the others run without one;
2. the loss is computed once, over the concatenated features as leaves (so a distributed loss gathers them once),
   and its backward gives each feature's gradient and the scalars' gradient, once;
3. each micro-batch is backpropagated with its cached feature gradients (`torch.autograd.backward` with
   `grad_tensors`): the first through its kept graph, the others through a second forward with the random state
   their first forward saw (patch dropout draws the same tokens). The scalars' gradient goes with the last one.
The parameters' gradients are then the whole batch's (the chain rule, split by micro-batch), activation memory is
one micro-batch's (plus the small cached features), and the cost is N - 1 extra micro-batch forwards per step.
A loss scaler scales the loss of step 2, so the cached gradients carry the scale into step 3; it unscales once.

Gradients are reduced across ranks once per step: every backward but the last runs with the data-parallel
wrapper's gradient sync off (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`), and the last, synced one also
carries the scalars' gradients, so DDP's reducer sees every parameter in it and FSDP2's hook on the unsharded
scalars averages them once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

Features = tuple[torch.Tensor | None, ...]  # None: an output this model does not have (a loss's optional bias)
FeaturesFn = Callable[[nn.Module, dict], Features]
FeaturesLoss = Callable[[Features], torch.Tensor]


def check_accum_steps(accum_steps: int, batch_size: int, world_size: int, video: bool, cuda_graph: bool) -> None:
    """Refuse, with the fix, what accumulation cannot do."""
    if accum_steps <= 1:
        return
    if video:
        raise ValueError(f"trainer.accum_steps={accum_steps} does not apply to video fine-tuning (data.frames > 0): "
                         "its head scores each clip and caption together, so the loss is not a function of cached "
                         "per-sample features. Set trainer.accum_steps=1 and a smaller data.batch_size, or "
                         "model.checkpoint_policy=full")
    if cuda_graph:
        raise ValueError(f"trainer.cuda_graph=true cannot record trainer.accum_steps={accum_steps}: the replayed "
                         "forward of each micro-batch must restore the random state its first forward saw, which a "
                         "recorded graph cannot. Set trainer.cuda_graph=false or trainer.accum_steps=1")
    per_rank = batch_size // world_size  # check_batch_size reports a batch the ranks cannot split evenly
    if batch_size % world_size == 0 and per_rank % accum_steps:
        raise ValueError(f"data.batch_size={batch_size} over {world_size} rank(s) gives {per_rank} samples per rank, "
                         f"which trainer.accum_steps={accum_steps} does not divide into equal micro-batches: set "
                         f"data.batch_size to a multiple of {world_size * accum_steps} or trainer.accum_steps to a "
                         f"divisor of {per_rank}")


def split_batch(batch: dict, parts: int) -> list[dict]:
    """`parts` micro-batches of consecutive rows: every tensor split along dim 0, other values (the loader's
    positions and keys) kept as they are."""
    rows = {value.shape[0] for value in batch.values() if isinstance(value, torch.Tensor)}
    if len(rows) != 1 or next(iter(rows)) % parts:
        raise ValueError(f"a batch of {sorted(rows)} rows cannot be split into {parts} equal micro-batches")
    pieces = {key: value.chunk(parts) for key, value in batch.items() if isinstance(value, torch.Tensor)}
    return [{key: pieces[key][i] if key in pieces else value for key, value in batch.items()} for i in range(parts)]


@contextlib.contextmanager
def gradient_sync_off(forward_model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate gradients on this rank only. DDP reads the setting in the forward pass
    (its reducer is armed there), FSDP2 in the backward pass: a micro-batch's forward and backward both run in it."""
    if isinstance(forward_model, DistributedDataParallel):
        with forward_model.no_sync():
            yield
    elif isinstance(forward_model, FSDPModule):
        forward_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            forward_model.set_requires_gradient_sync(True)
    else:
        yield


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a forward pass draws from: the CPU generator's and the device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def leaf(parts: list[torch.Tensor | None], requires_grad: bool) -> torch.Tensor | None:
    """The micro-batches' features as one leaf tensor: per-sample rows concatenated, a 0-dim scalar (the same
    parameter's value in every micro-batch) taken once."""
    if parts[0] is None:
        return None
    return (parts[0] if parts[0].ndim == 0 else torch.cat(parts)).requires_grad_(requires_grad)


def accumulate_gradients(
    features: FeaturesFn, features_loss: FeaturesLoss, forward_model: nn.Module, batch: dict, accum_steps: int, *,
    scale: Callable[[torch.Tensor], torch.Tensor], autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> torch.Tensor:
    """Accumulate the gradient of `features_loss(features(forward_model, batch))` into the parameters' `.grad` in
    `accum_steps` micro-batches (the module's docstring says how), with `scale` (the loss scaler's) applied to the
    loss. Returns the loss, detached."""
    micro = split_batch(batch, accum_steps)
    # The first micro-batch keeps its graph and is backpropagated first, before the others' forwards run again:
    # it needs no second forward, and activation memory still holds one micro-batch's at a time.
    with gradient_sync_off(forward_model), autocast():
        first = features(forward_model, micro[0])
    cached, states = [tuple(None if f is None else f.detach() for f in first)], []
    with torch.no_grad(), autocast():
        for part in micro[1:]:
            states.append(rng_state(device))
            cached.append(features(forward_model, part))
    after = rng_state(device)
    # Features no parameter produced (a frozen tower's) need no gradient.
    leaves = tuple(leaf(list(parts), f is not None and f.requires_grad) for parts, f in zip(zip(*cached), first))
    with autocast():
        loss = features_loss(leaves)
    scale(loss).backward()
    grads = [None if t is None else t.grad for t in leaves]
    per_sample = [g.chunk(accum_steps) if g is not None and g.ndim else None for g in grads]
    for i in range(accum_steps):
        last = i == accum_steps - 1
        with contextlib.nullcontext() if last else gradient_sync_off(forward_model):
            if i == 0:
                outputs = first
            else:
                set_rng_state(states[i - 1], device)
                with autocast():
                    outputs = features(forward_model, micro[i])
            pairs = [(out, chunks[i] if chunks is not None else grad)
                     for out, grad, chunks in zip(outputs, grads, per_sample)
                     if grad is not None and (chunks is not None or last)]
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    set_rng_state(after, device)
    return loss.detach()
