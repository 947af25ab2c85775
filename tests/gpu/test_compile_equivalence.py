"""Compiled blocks train like eager ones (run on the device: `python -m pytest -q -n 0 --noconftest tests/gpu`): the
loss over the first 50 steps of a fixed-seed ViT-B/32 run matches the eager path within bf16 tolerance, compiled
as configured by default and compiled with every fusion and fit forced on (`model.residual_norm=fused`,
`model.gelu=rational`).

What "within bf16 tolerance" means is measured in the same test: a third, eager run starts from weights moved by
one bf16 rounding step (a relative 2⁻⁸ up or down), and the compiled run may differ from the eager one by at most
twice what that run does. A fixed 3% per step failed on 2026-11-30 (4.4% at step 17 of 50, both runs ending
within 0.2%): on the steep part of the curve, rounding differences grow for a while before the runs meet
again, by an amount no fixed tolerance captures."""

import functools
import itertools

import pytest
import torch

from src.compose import compose_config
from src.parallel.distributed import DistInfo
from src.trainer.trainer import Trainer, image_text_parts

CLASSES = 16


def learnable_batch(cfg, device) -> dict[str, torch.Tensor]:
    """One fixed batch that a CLIP learns within a few dozen steps: each image is a noisy flat colour of one of
    16 classes, each caption names its class. (On noise images with random captions the loss did not move
    from ln(batch) in 50 steps, so the comparison said nothing.)"""
    batch, size, context = cfg.data.batch_size, cfg.model.vision.image_size, cfg.model.text.context_length
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(batch) % CLASSES
    palette = torch.randint(0, 256, (CLASSES, 3, 1, 1), generator=generator).float()
    noise = torch.randn(batch, 3, size, size, generator=generator) * 20
    images = (palette[labels] + noise).clamp(0, 255).to(torch.uint8)
    tokens = torch.zeros(batch, context, dtype=torch.long)
    tokens[:, 0], tokens[:, 1], tokens[:, 2] = 49406, 1000 + labels, 49407
    return {"images": images.to(device), "tokens": tokens.to(device)}


def trainer_on(cfg, device: str, loader) -> Trainer:
    """The Trainer of `cfg`, its batches from `loader` instead of the webdataset loader."""
    return Trainer(cfg, cfg.trainer.run_dir, DistInfo(0, 1, 0, torch.device(device)),
                   functools.partial(image_text_parts, loader=loader))


def losses(tmp_path, model: str, device: str, compile_: bool, steps: int = 50, nudge_weights: bool = False,
           overrides: tuple[str, ...] = ()) -> torch.Tensor:
    run_dir = tmp_path / f"compile_{compile_}_nudged_{nudge_weights}_{len(overrides)}"
    run_dir.mkdir()
    cfg = compose_config([
        f"model={model}", "precision=bf16", "optim=adamw", "logger=none", "data=synthetic_shapes",
        "data.batch_size=256", "data.generate=false", f"trainer.device={device}", "trainer.progress=false",
        f"trainer.run_dir={run_dir}", f"trainer.compile={str(compile_).lower()}", "trainer.cuda_graph=false",
        "optim.warmup_steps=10",
        # A stable run: at lr 5e-4 without clipping both paths spiked in the first ten steps, after which
        # rounding differences grow chaotically and the comparison says nothing about the compiler.
        "optim.lr=1e-4", "optim.grad_clip_norm=1.0", "model.ls_init_value=0.1", *overrides,
    ])
    torch.manual_seed(0)
    trainer = trainer_on(cfg, device, itertools.repeat(learnable_batch(cfg, device)))
    if nudge_weights:
        with torch.no_grad():
            generator = torch.Generator(device).manual_seed(1)
            for param in trainer.model.parameters():
                signs = torch.randint(0, 2, param.shape, generator=generator, device=device) * 2 - 1
                param.mul_(1 + signs * 2 ** -8)
    batch = next(trainer.loader)
    values = [trainer.train_step(batch)["loss"] for _ in range(steps)]
    return torch.stack(values).float().cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_loss_matches_eager_over_50_steps(tmp_path):
    eager, compiled = losses(tmp_path, "vit_b32", "cuda", False), losses(tmp_path, "vit_b32", "cuda", True)
    fused = losses(tmp_path, "vit_b32", "cuda", True, overrides=("model.residual_norm=fused", "model.gelu=rational"))
    nudged = losses(tmp_path, "vit_b32", "cuda", False, nudge_weights=True)
    runs = {"eager": eager, "compiled": compiled, "compiled, fused": fused, "eager, nudged": nudged}
    curves = "\n".join(f"{name} {[round(x, 3) for x in run.tolist()]}" for name, run in runs.items())
    print(curves)
    assert torch.isfinite(compiled).all() and torch.isfinite(fused).all(), curves
    # It learns: the check below compares two training runs, not two constants.
    assert eager[-1] < eager[0] - 0.5, curves
    # A wrong fusion changes the curve by far more than rounding does: the loss falls by about 2.7 in 50 steps.
    noise = (nudged - eager).abs().max().item()
    assert noise < 0.5, f"the bf16 noise floor itself is too large to compare against ({noise:.3f})\n{curves}"
    for name, run in (("compiled", compiled), ("compiled, fused", fused)):
        deviation = (run - eager).abs().max().item()
        assert deviation <= 2 * noise + 0.01, f"{name} deviates by {deviation:.3f}, noise floor {noise:.3f}\n{curves}"
