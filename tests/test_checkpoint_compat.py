"""Checkpoints written before the trainer's state became one registry (src/trainer/state.py) still resume.

tests/fixtures/checkpoint_b795652/ is a checkpoint written by commit b795652: `train.py` with `RUN` below and
`trainer.stop_at_step=3`, on the synthetic shapes this test generates again (`DATA`). `continued.json` holds the
losses that code then logged for steps 3-5 when resumed from it with `trainer.max_steps=6`."""

import json
import os

import torch

from src.parallel.distributed import DistInfo
from src.trainer.checkpoint import checkpoint_problem
from src.trainer.run import ensure_synthetic_data
from src.trainer.trainer import Trainer
from tests.conftest import ROOT, compose_config

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "checkpoint_b795652")
CHECKPOINT = os.path.join(FIXTURE, "step_00000003")
# A vit_tiny two units wide: the checkpoint, optimizer state included, stays near 1 MB.
RUN = [
    "experiment=quickstart", "trainer.progress=false", "data.batch_size=8", "data.num_workers=0",
    "model.embed_dim=2", "model.vision.width=2", "model.vision.heads=1", "model.vision.layers=1",
    "model.text.width=2", "model.text.heads=1", "model.text.layers=1", "trainer.max_steps=6", "trainer.ckpt_every=3",
    "eval.every=0", "trainer.log_every=1", "optim.warmup_steps=2", "spikes.ignore_first=0", "spikes.window=2",
    # The quickstart's recipe at b795652: no layer-scale, AdamW.
    "model.ls_init_value=null", "optim=adamw", "optim.layer_scale_lr_scale=1.0",
]
DATA = ["data.generate_train_samples=64", "data.generate_eval_samples=16"]


def load(stem: str) -> dict:
    return torch.load(os.path.join(CHECKPOINT, f"{stem}.pt"), map_location="cpu", weights_only=True)


def assert_equal(want, got, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(want, got), where
    elif isinstance(want, dict):
        assert want.keys() == got.keys(), where
        for key in want:
            assert_equal(want[key], got[key], f"{where}/{key}")
    elif isinstance(want, list | tuple):
        assert len(want) == len(got), where
        for i, (a, b) in enumerate(zip(want, got)):
            assert_equal(a, b, f"{where}/{i}")
    else:
        assert want == got, where


def test_a_checkpoint_written_before_the_registry_resumes_and_trains_on(tmp_path, caplog):
    data = tmp_path / "data"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = compose_config([
        *RUN, *DATA, f"data.shards='{data}/train-{{000000..000001}}.tar'",
        f"data.eval_shards={data}/eval/eval-000000.tar", f"trainer.run_dir={run_dir}", f"trainer.resume={CHECKPOINT}",
    ])
    ensure_synthetic_data(cfg, is_main=True)
    trainer = Trainer(cfg, str(run_dir), DistInfo(0, 1, 0, torch.device("cpu")))
    # It has no manifest (written before checkpoints had one): loaded as legacy, checked with torch.save's CRC32s.
    assert f"{CHECKPOINT} has no manifest.json" in caplog.text

    saved = load("train_state")
    assert trainer.progress.step == saved["step"] == 3
    assert_equal(load("model"), trainer.model.state_dict(), "model")
    assert_equal(saved["optimizer"], trainer.optimizer.state_dict(), "optimizer")
    assert_equal(saved["scheduler"], trainer.scheduler.state_dict(), "scheduler")
    spikes = trainer.spikes.state_dict()
    assert spikes.pop("largest_rms") == []  # the detector's state then had no largest updates to restore
    assert_equal(saved["spikes"], spikes, "spikes")
    assert_equal(load("rank_0")["data"], trainer.loader.state_dict(), "data")

    trainer.fit()
    with open(run_dir / "metrics.jsonl") as f:
        losses = {m["step"]: m["train/loss"] for m in map(json.loads, f) if "train/loss" in m}
    with open(os.path.join(FIXTURE, "continued.json")) as f:
        continued = {int(step): loss for step, loss in json.load(f)["continued_losses"].items()}
    assert sorted(losses) == [3, 4, 5]
    for step, loss in continued.items():
        assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (step, losses[step], loss)
    assert os.listdir(run_dir / "checkpoints") == ["step_00000006"]
    assert torch.load(run_dir / "checkpoints/step_00000006/train_state.pt", weights_only=True)["step"] == 6
    assert checkpoint_problem(str(run_dir / "checkpoints/step_00000006"), checksums=True) is None  # with a manifest
    assert (run_dir / "checkpoints/step_00000006/manifest.json").is_file()
