"""model.prune_last_block on CUDA as the trainer runs it (compiled blocks, the fused residual-norm chain, our
attention kernels, bf16 autocast): the pruned last block's embeddings and gradients are as close to a float32
reference as the whole block's (run on the device: `python -m pytest -q -n 0 --noconftest tests/gpu`)."""

import dataclasses

import pytest
import torch

from src.compose import compose_config
from src.kernels.dispatch import build_model_with_kernels
from src.parallel.parallelize import apply_compile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _captions(count: int, length: int) -> torch.Tensor:
    tokens = torch.randint(1, 40000, (count, length))
    for row, end in enumerate(torch.linspace(2, length - 1, count).long()):
        tokens[row, end], tokens[row, end + 1:] = 49407, 0
    return tokens.cuda()


def _run(model, images, tokens, autocast: bool) -> list[torch.Tensor]:
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        image_features, text_features, logit_scale = model(images, tokens)
        logits = logit_scale * image_features.float() @ text_features.float().T
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(logits), device=logits.device))
    loss.backward()
    return [image_features.float(), text_features.float(), *(p.grad.float() for p in model.parameters())]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("linear", ["standard", "switchback_fp8"])
def test_pruned_last_block_is_as_accurate_as_the_whole_block(linear):
    if linear == "switchback_fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    torch.manual_seed(0)
    cfg = compose_config(["model=vit_b32", "model.ls_init_value=0.1", f"model.linear={linear}"]).model
    reference = build_model_with_kernels(dataclasses.replace(cfg, linear="standard", prune_last_block=False), "cuda")
    runs = {}
    for prune in (True, False):
        cfg.prune_last_block = prune
        model = build_model_with_kernels(cfg, "cuda")
        model.load_state_dict(reference.state_dict())
        apply_compile(model)
        runs[prune] = model
    images, tokens = torch.randn(32, 3, 224, 224, device="cuda"), _captions(32, 77)
    want = _run(reference, images, tokens, autocast=False)  # float32, eager, plain linears
    pruned, whole = (_run(runs[prune], images, tokens, autocast=True) for prune in (True, False))
    names = ["image features", "text features", *(n for n, _ in reference.named_parameters())]
    for name, p, w, r in zip(names, pruned, whole, want, strict=True):
        assert torch.isfinite(p).all() and r.norm() > 0, name
        pruned_error, whole_error = _relative_error(p, r), _relative_error(w, r)
        assert pruned_error <= 2 * whole_error + 1e-3, f"{name}: pruned {pruned_error:.2e}, whole {whole_error:.2e}"
