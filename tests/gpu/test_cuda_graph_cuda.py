"""trainer.cuda_graph=true trains as the ordinary step does (run on the device: `python -m pytest -q -n 0 --noconftest
tests/gpu`): a ViT-B/32 run recorded as a CUDA graph after its warm-up steps gives the losses of the same run
launched kernel by kernel, with two batches taking turns, so a replay that kept reading its first batch would
show. Compiled with torch's fused AdamW, and eager with StableAdamW's Triton step."""

import pytest
import torch

from src.compose import compose_config
from src.parallel.distributed import DistInfo
from src.tools.synthetic_shapes import make_synthetic_shapes
from src.trainer.cuda_graph import WARMUP_STEPS
from src.trainer.trainer import Trainer
from tests.gpu.test_compile_equivalence import learnable_batch, trainer_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = 12


def run(tmp_path, name: str, *overrides: str) -> tuple[torch.Tensor, float, object, list]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg = compose_config([
        "model=vit_b32", "precision=bf16", "logger=none", "data=synthetic_shapes", "data.batch_size=256",
        "data.generate=false", "trainer.device=cuda", "trainer.progress=false", f"trainer.run_dir={run_dir}",
        "optim.warmup_steps=4", "optim.lr=1e-4", "optim.grad_clip_norm=1.0", "model.ls_init_value=0.1", *overrides,
        # The launched run must say so: the default (auto) records on one GPU.
        *([] if any(o.startswith("trainer.cuda_graph=") for o in overrides) else ["trainer.cuda_graph=false"]),
    ])
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    # The learnable batch and its mirror image, in turns; each step gets fresh tensors, as from a loader.
    batch = learnable_batch(cfg, "cuda")
    turns = [batch, {**batch, "images": batch["images"].flip(-1)}]
    trainer = trainer_on(cfg, "cuda", ({name: value.clone() for name, value in b.items()} for b in turns * STEPS))
    values = [trainer.train_step(next(trainer.loader)) for _ in range(STEPS)]
    losses = torch.stack([v["loss"] for v in values]).float().cpu()
    peak = torch.cuda.max_memory_allocated() / 2**30
    graphed = trainer.graphed
    del trainer
    torch.cuda.empty_cache()
    return losses, peak, graphed, turns


@pytest.mark.parametrize("setting", [("trainer.compile=true", "optim=adamw"),
                                     ("trainer.compile=false", "optim=stable_adamw")])
def test_recorded_step_gives_the_losses_of_launched_kernels(tmp_path, setting):
    launched, launched_peak, _, _ = run(tmp_path, "launched", *setting)
    recorded, recorded_peak, graphed, turns = run(tmp_path, "recorded", *setting, "trainer.cuda_graph=true")
    print(f"launched {launched.tolist()} peak {launched_peak:.2f} GiB\n"
          f"recorded {recorded.tolist()} peak {recorded_peak:.2f} GiB\n"
          f"bitwise equal: {torch.equal(launched, recorded)}")
    assert graphed.captured and graphed.calls == STEPS > WARMUP_STEPS + 2
    assert torch.isfinite(recorded).all()
    assert launched[-1] < launched[0] - 0.3  # it learns, so the comparison is between two moving runs
    assert (recorded - launched).abs().max().item() <= 1e-3, (launched, recorded)
    # Each replay read the batch of its own step: the last one is in the graph's input.
    assert not torch.equal(turns[0]["images"], turns[1]["images"])
    assert torch.equal(graphed.static_batch["images"], turns[(STEPS - 1) % 2]["images"])


def test_the_default_records_the_step_beside_the_loaders_pinning_thread(tmp_path):
    """The defaults (compile and cuda_graph auto) with the real webdataset loader: its pin-memory thread pins the
    next batches while the step is recorded. Under the capture's default mode that thread's CUDA calls invalidated
    the recording and killed the thread; the capture now checks only its own thread."""
    train, held_out = tmp_path / "data" / "train", tmp_path / "data" / "eval"
    make_synthetic_shapes(str(train / "train-{000000..000003}.tar"), str(held_out / "eval-000000.tar"), 2048, 64)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = compose_config([
        "experiment=quickstart", "logger=none", "trainer.device=cuda", "trainer.progress=false",
        f"trainer.run_dir={run_dir}", f"data.shards='{train}/train-{{000000..000003}}.tar'", "data.eval_shards=null",
        "data.generate=false", "data.num_workers=2", "trainer.max_steps=16", "trainer.log_every=4",
        "trainer.ckpt_every=0",
    ])
    trainer = Trainer(cfg, str(run_dir), DistInfo(0, 1, 0, torch.device("cuda", 0)))
    assert trainer.fast_path.compile and trainer.fast_path.cuda_graph and trainer.fast_path.cuda_graph_auto
    trainer.fit()
    assert trainer.graphed.captured and not trainer.graphed.eager
    assert trainer.progress.step == 16
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"train/loss"' in line]) == 16
