"""How a built model runs on the hardware, kept apart from what it computes (as torchtitan splits model and
parallelize): regional compilation of the transformer blocks, and FSDP2 sharding. Both come after
src/kernels/dispatch.py's apply_kernels, which picks the kernels the blocks run."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from src.kernels.blocks import KernelTransformer
from src.models.transformer import Block


def blocks(model: nn.Module) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


# Dynamo keeps every graph of Block.forward under that one function, up to its recompile limit (8 by default),
# past which further kinds of call silently run eager. CLIP has 8 to 12: per tower, the first block (whose input
# may have another dtype), the others and the pooled last block (Transformer.forward's `pooled`), each in
# training and in evaluation; a batch of another size or a setting changed between calls adds more.
RECOMPILE_LIMIT = 32


def apply_compile(model: nn.Module) -> int:
    """Compile each transformer block in place and return how many. Blocks of one tower share code and shapes,
    so TorchInductor compiles each kind once (parameters are graph inputs, not constants) instead of tracing
    the whole model; the fusions that pay (LayerNorm, bias, GELU, layer-scale and residual adds) all live
    inside a block."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    tag_compile_caches()
    compiled = blocks(model)
    for block in compiled:
        block.compile()
    return len(compiled)


def tag_compile_caches() -> None:
    """Add a digest of the model and kernel code to the key of torch.compile's on-disk caches. They key a compiled
    graph on the graph, which names our custom ops but not their fake implementations: after an edit changes the
    shape an op's fake gives an output, a warm cache would replay code asserting the old shape (a failed
    `assert_size_stride`). A user's own `torch.compiler.config.cache_key_tag` is kept."""
    root = Path(__file__).parents[1]
    digest = hashlib.sha256()
    for path in sorted([*(root / "models").rglob("*.py"), *(root / "kernels").rglob("*.py")]):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    tag = f"stableclip-models-{digest.hexdigest()[:16]}"
    tags = [t for t in torch.compiler.config.cache_key_tag.split(",") if t and not t.startswith("stableclip-models-")]
    torch.compiler.config.cache_key_tag = ",".join([*tags, tag])


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard `model` over the 1-D `mesh` in place with FSDP2: each transformer block is one all-gather /
    reduce-scatter group, and the root takes the rest (embeddings, norms, projections). After
    `apply_compile`, as torchtitan orders them: FSDP2's hooks run outside the compiled graphs.

    The default MixedPrecisionPolicy keeps parameters, gradients and their reduction in fp32, as DDP does:
    bf16/fp16 comes from the trainer's autocast, so the optimizer's master weights stay fp32.

    fully_shard cannot shard 0-dim parameters (the logit scale), so they stay whole on every rank and a hook
    averages their gradients over the mesh as DDP would."""
    for tower in model.modules():
        if isinstance(tower, KernelTransformer):
            tower.chain_blocks = False  # the next block's norm is still sharded while a block runs
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    scalars = [p for p in model.parameters() if p.ndim == 0]
    fully_shard(model, mesh=mesh, ignored_params=set(scalars))
    group = mesh.get_group()

    def average_grad(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(group.size())

    for param in scalars:
        param.register_post_accumulate_grad_hook(average_grad)


@contextlib.contextmanager
def unsharded_root(model: nn.Module) -> Iterator[None]:
    """FSDP2 gathers the root's parameters in a hook on `forward` only; evaluation calls `encode_image` and
    `encode_text` instead, so gather them around it (the blocks still gather their own). Collective under FSDP2;
    does nothing to other models."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
