"""Guarantee 5: a non-finite step changes nothing and is logged; too many in a row stop the run with a checkpoint
of the last good weights; with precision.scaler=fixed a single bad tensor is skipped alone. The NaN/Inf are
injected into a real training process through the STABLECLIP_FAULT_LOSS / STABLECLIP_FAULT_GRAD hooks."""

import torch

from tests.reliability.harness import BATCH, LEDGER, STEPS, Training, read_metrics, run_args


def saved(run_dir, step: int, stem: str) -> dict:
    return torch.load(run_dir / f"checkpoints/step_{step:08d}/{stem}.pt", weights_only=True)


def same_tensors(a: dict, b: dict) -> dict[str, bool]:
    return {name: torch.equal(a[name], b[name]) for name in a}


def optimizer_states(run_dir, step: int) -> list[dict]:
    return list(saved(run_dir, step, "train_state")["optimizer"]["state"].values())


def test_nonfinite_steps_are_skipped_and_too_many_in_a_row_stop_the_run(shapes, tmp_path):
    run_dir = tmp_path / "run"
    bad = {2: "nan", 3: "inf", 6: "nan", 7: "nan", 8: "inf", 9: "nan"}  # 2-3 are survived; 6-9 are 4 in a row
    training = Training(
        # Every checkpoint kept (one a step): the states before and after the skipped steps are compared.
        run_args(shapes, run_dir, "trainer.ckpt_every=1", f"trainer.keep_last_k={STEPS}",
                 "trainer.max_nonfinite_steps=3"),
        tmp_path / "log.txt", env={"STABLECLIP_FAULT_LOSS": ",".join(f"{s}:{v}" for s, v in bad.items())},
    )
    assert training.wait() == 1
    assert "the last 4 steps had non-finite gradients and were skipped, more than trainer.max_nonfinite_steps=3" \
        in training.output()

    lines = {m["step"]: m for m in read_metrics(run_dir) if "train/loss" in m}
    assert sorted(lines) == list(range(10))
    assert [s for s, m in lines.items() if m["train/skipped_step"]] == sorted(bad)
    assert (lines[2]["train/loss"], lines[3]["train/loss"]) == ("nan", "inf")  # logged as they were
    assert "update skipped (4 in a row)" in training.output()

    # Nothing of a skipped step is applied: weights and optimizer moments after steps 2-3 are those before them.
    assert all(same_tensors(saved(run_dir, 2, "model"), saved(run_dir, 4, "model")).values())
    for before, after in zip(optimizer_states(run_dir, 2), optimizer_states(run_dir, 4)):
        assert all(torch.equal(before[key], after[key]) for key in before)
    assert not any(same_tensors(saved(run_dir, 4, "model"), saved(run_dir, 5, "model")).values())
    # The stop wrote a checkpoint (step 10) holding the weights of the last good update (step 6).
    assert all(same_tensors(saved(run_dir, 6, "model"), saved(run_dir, 10, "model")).values())
    LEDGER.append(("5 non-finite steps (NaN/Inf loss)", len(bad), 0, len(bad) * BATCH))


def test_fixed_scaler_skips_a_single_bad_tensor_alone(shapes, tmp_path):
    run_dir = tmp_path / "run"
    training = Training(
        run_args(shapes, run_dir, "precision.scaler=fixed", "trainer.ckpt_every=1", f"trainer.keep_last_k={STEPS}",
                 "trainer.stop_at_step=5"),
        tmp_path / "log.txt", env={"STABLECLIP_FAULT_GRAD": "3:visual.conv1.weight"},
    )
    training.finish()
    lines = {m["step"]: m for m in read_metrics(run_dir) if "train/loss" in m}
    assert [m["scaler/skipped_tensors"] for m in lines.values()] == [0, 0, 0, 1, 0]
    assert not any(m["train/skipped_step"] for m in lines.values())

    unchanged = same_tensors(saved(run_dir, 3, "model"), saved(run_dir, 4, "model"))
    assert [name for name, same in unchanged.items() if same] == ["visual.conv1.weight"]
    moments_unchanged = [all(torch.equal(a[k], b[k]) for k in a)
                         for a, b in zip(optimizer_states(run_dir, 3), optimizer_states(run_dir, 4))]
    assert sum(moments_unchanged) == 1
    LEDGER.append(("5 one non-finite tensor (fixed scaler)", 1, 1, 0))
