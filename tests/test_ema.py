"""trainer.ema_decay: the weights' EMA after each step, in checkpoints (exact resume), evaluated, exported."""

import json
import logging

import pytest
import torch

from src.trainer.ema import export_ema
from src.trainer.pretrained import load_pretrained
from tests.conftest import small_trainer


def metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_the_ema_after_each_step_is_the_hand_computed_lerp(shapes, tmp_path):
    decay = 0.75
    trainer = small_trainer(shapes, tmp_path / "run", f"trainer.ema_decay={decay}", "trainer.max_steps=4")
    params = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(params) == len(list(trainer.model.parameters()))  # nothing frozen here
    want = {name: p.detach().double().clone() for name, p in params.items()}
    for _ in range(4):
        trainer.train_step(next(trainer.loader))
        for name, p in params.items():
            want[name] = decay * want[name] + (1 - decay) * p.detach().double()
    got = dict(zip(params, trainer.ema.average))
    moved = 0.0
    for name, p in params.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name].double(), want[name], rtol=0, atol=1e-6, msg=name)
        moved = max(moved, (got[name] - p).abs().max().item())
    assert moved > 1e-4  # the average lags the weights: it is not just a copy of them
    # Swapped in and out, the model gets the average and then its own weights back bit for bit.
    before = {name: p.detach().clone() for name, p in params.items()}
    average = {name: a.clone() for name, a in got.items()}
    with trainer.ema.swapped() as averaged:
        assert all(torch.equal(p, average[name]) for name, p in averaged.named_parameters())
    assert all(torch.equal(p, before[name]) and torch.equal(got[name], average[name]) for name, p in params.items())


def test_a_resumed_run_with_an_ema_matches_the_uninterrupted_one_and_exports_it(shapes, tmp_path, caplog):
    common = ["trainer.ema_decay=0.5", "trainer.max_steps=6", "trainer.ckpt_every=3", "eval.every=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    small_trainer(shapes, straight, *common, evaluate=True).fit()
    small_trainer(shapes, resumed, *common, "trainer.stop_at_step=3").fit()
    small_trainer(shapes, resumed, *common, "trainer.resume=latest").fit()
    want = [m for m in metrics(straight) if "train/loss" in m]
    got = [m for m in metrics(resumed) if "train/loss" in m]
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(6))
    for a, b in zip(want, got):
        assert {k: v for k, v in a.items() if k != "train/samples_per_s"} == \
            {k: v for k, v in b.items() if k != "train/samples_per_s"}
    final = [m for m in metrics(straight) if "eval/i2t_r1" in m]
    assert [m["step"] for m in final] == [6]
    # The same evaluation of the averaged weights, beside the model's: the keys match, the numbers may not.
    model_keys = {k.removeprefix("eval/") for k in final[0] if k.startswith("eval/")}
    assert model_keys and model_keys == {k.removeprefix("eval_ema/") for k in final[0] if k.startswith("eval_ema/")}
    step6 = resumed / "checkpoints/step_00000006"
    ema = torch.load(step6 / "ema.pt", weights_only=True)
    for name, tensor in torch.load(straight / "checkpoints/step_00000006/ema.pt", weights_only=True).items():
        assert torch.equal(ema[name], tensor), name
    manifest = json.loads((step6 / "manifest.json").read_text())
    assert "ema.pt" in manifest["files"]  # verified on resume like every other file
    model = torch.load(step6 / "model.pt", weights_only=True)
    assert ema.keys() == model.keys()
    assert any(not torch.equal(ema[k], model[k]) for k in ema)

    # Exported, it is a model.pt that model.init_from takes, as is the checkpoint's ema.pt itself.
    out = export_ema(str(step6), str(tmp_path / "export" / "model.pt"))
    fresh = small_trainer(shapes, tmp_path / "fresh", "trainer.max_steps=1", f"model.init_from={out}").model
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, ema[name]), name
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_pretrained(fresh, str(step6 / "ema.pt"))
    assert all(torch.equal(t, ema[name]) for name, t in fresh.state_dict().items())
    with pytest.raises(FileNotFoundError, match="holds no ema.pt: its run had trainer.ema_decay=null"):
        small_trainer(shapes, tmp_path / "plain", "trainer.max_steps=1").fit()
        export_ema(str(tmp_path / "plain/checkpoints/step_00000001"), str(tmp_path / "x.pt"))

    # A checkpoint without an EMA resumes with one: it starts from the resumed weights.
    with caplog.at_level(logging.WARNING, logger="src.trainer.trainer"):
        late = small_trainer(shapes, tmp_path / "plain", "trainer.max_steps=2", "trainer.resume=latest",
                     "trainer.ema_decay=0.5")
    assert "has no EMA of the weights" in caplog.text
    assert all(torch.equal(a, p) for a, p in zip(late.ema.average, late.model.parameters()))


def test_frozen_parameters_get_no_average_and_keep_their_weights_through_a_resume():
    from src.trainer.ema import ModelEMA

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    ema = ModelEMA(model, 0.5)
    assert len(ema.average) == 2  # the second layer's weight and bias
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    saved, weights = ema.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert torch.equal(saved["0.weight"], weights["0.weight"])  # frozen: its own average
    assert torch.allclose(saved["1.bias"], weights["1.bias"] - 0.5)  # halfway from the old weights to the new
    # A resume loads ema.pt, then model.pt (TrainState's order): the average and the weights come back as saved.
    restored = ModelEMA(model, 0.5)
    with torch.no_grad():
        model[0].weight.zero_()
    restored.load_state_dict(saved)
    model.load_state_dict(weights)
    assert all(torch.equal(a, b) for a, b in zip(restored.average, ema.average))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
