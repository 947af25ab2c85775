"""Guarantee 10: a damaged checkpoint is never loaded. Every checkpoint has a manifest (every file's size and
sha256, written last); `trainer.resume=latest` skips damaged checkpoints, naming each and what is wrong, and resumes
from the newest intact one; an explicit path, or model.init_from, that fails stops with the file and the fault.
Checkpoints written before manifests load as legacy, checked with torch.save's own CRC32s. The faults are real:
files truncated, emptied, overwritten, deleted and one byte flipped on disk, under real training processes."""

import json
import os
import shutil

import pytest
import torch

from src.trainer.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_problem,
    find_resume,
    load_torch_file,
    load_train_state,
    save_checkpoint,
    write_manifest,
)
from src.trainer.pretrained import model_file
from src.trainer.state import Progress, TrainState
from tests.reliability.harness import LEDGER, Training, assert_same_metrics, run_args, train

# What a damaged file must never surface as: raw torch or pickle errors that do not name the file.
RAW_ERRORS = ("EOFError", "UnicodeDecodeError", "could run arbitrary code", "PytorchStreamReader", "fewer ranks",
              "pop from empty list", "Traceback (most recent call last)\nEOFError")


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def truncate(path, fraction: float = 0.5) -> None:
    os.truncate(path, int(os.path.getsize(path) * fraction))


@pytest.mark.slow
def test_latest_skips_damaged_checkpoints_and_the_run_resumes_exactly(shapes, baseline, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    args = run_args(shapes, run_dir, "trainer.keep_last_k=4")
    train([*args, "trainer.stop_at_step=12"], tmp_path / "1.log")
    step = {n: checkpoints / f"step_{n:08d}" for n in (4, 8, 12, 16)}
    assert sorted(os.listdir(checkpoints)) == [step[n].name for n in (4, 8, 12)]
    manifest = json.loads((step[12] / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["model.pt", "rank_0.pt", "train_state.pt"] and manifest["step"] == 12
    assert all(entry["bytes"] == os.path.getsize(step[12] / name) for name, entry in manifest["files"].items())

    # One flipped byte inside a weight: torch.load reads it without complaint, only the checksum sees it.
    model = step[12] / "model.pt"
    before = torch.load(model, weights_only=True)
    flip_byte(model, os.path.getsize(model) // 2)
    after = torch.load(model, weights_only=True)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # live: a weight changed, silently
    truncate(step[8] / "train_state.pt")  # a copy cut short

    training = train(args, tmp_path / "2.log")
    out = training.output()
    assert f"skipping {step[12]}: {model} fails its checksum" in out
    assert f"skipping {step[8]}: {step[8] / 'train_state.pt'} is truncated" in out
    assert f"resumed from {step[4]} at step 4" in out
    assert f"removing {step[12]}: it is newer than step 8" in out  # the damaged one never shadows the new step 8
    assert not any(raw in out for raw in RAW_ERRORS)
    assert_same_metrics(baseline, run_dir)
    assert sorted(os.listdir(checkpoints)) == [step[n].name for n in (4, 8, 12, 16)]
    assert all(checkpoint_problem(str(step[n]), checksums=True) is None for n in (4, 8, 12, 16))

    # Item 10: a checkpoint at trainer.max_steps leaves nothing to do, and says so.
    again = train(args, tmp_path / "3.log")
    assert (f"nothing to train: the checkpoint {step[16]} is at step 16, and trainer.max_steps=16. To train further, "
            "raise trainer.max_steps") in again.output()
    LEDGER.append(("10 damaged checkpoints: latest falls back", 2, 1, 0))


@pytest.mark.slow
def test_an_explicit_damaged_checkpoint_stops_the_run_naming_the_file(shapes, tmp_path):
    run_dir = tmp_path / "run"
    train(run_args(shapes, run_dir, "trainer.stop_at_step=4", "eval.every=0"), tmp_path / "1.log")
    good = run_dir / "checkpoints" / "step_00000004"
    cases = {  # damage -> what the message must say; the size check fails in preflight, the checksum at the resume
        "truncated": (lambda d: truncate(d / "model.pt"), f"{good.parent / 'truncated' / 'model.pt'} is truncated"),
        "flipped": (lambda d: flip_byte(d / "train_state.pt", os.path.getsize(d / "train_state.pt") // 2),
                    f"{good.parent / 'flipped' / 'train_state.pt'} fails its checksum"),
    }
    for name, (damage, message) in cases.items():
        bad = good.parent / name
        shutil.copytree(good, bad)
        damage(bad)
        training = Training(run_args(shapes, tmp_path / name, f"trainer.resume={bad}"), tmp_path / f"{name}.log")
        assert training.wait() == 1, name
        out = training.output()
        assert f"trainer.resume='{bad}' cannot be resumed from: {message}" in out, out[-3000:]
        assert not any(raw in out for raw in RAW_ERRORS), name
        assert not (tmp_path / name / "checkpoints").exists()
    LEDGER.append(("10 explicit damaged checkpoint", len(cases), 0, 0))


# In-process: each kind of damage on a real checkpoint on disk, as find_resume, the loader and init_from see it.


@pytest.fixture
def written(tmp_path):
    """A checkpoint as save_checkpoint writes it: model.pt, train_state.pt, rank_0.pt and the manifest."""
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(str(checkpoints), 3, rank=0, keep_last_k=0, per_rank={"rng": {"x": torch.arange(10)}},
                    shared={"model": {"w": torch.randn(1000)}, "train_state": {"step": 3, "world_size": 1}})
    return checkpoints / "step_00000003"


def damaged(good, name: str, damage) -> str:
    bad = good.parent / name
    shutil.copytree(good, bad)
    damage(bad)
    return str(bad)


def explicit_error(path: str) -> str:
    with pytest.raises(CheckpointError) as err:
        find_resume(os.path.dirname(path), path, False, rank=0, checksums=True)
    message = str(err.value)
    assert message.startswith(f"trainer.resume={path!r} cannot be resumed from: ")
    assert "trainer.resume=latest" in message
    assert not any(raw in message for raw in RAW_ERRORS), message
    return message


def test_every_kind_of_damage_is_named(written):
    size = os.path.getsize(written / "model.pt")
    cases = {
        "zero": (lambda d: open(d / "model.pt", "w").close(), f"model.pt is empty (0 bytes, its manifest says {size})"),
        "truncated": (lambda d: truncate(d / "model.pt"), f"model.pt is truncated: {size // 2} bytes"),
        "garbage": (lambda d: (d / "model.pt").write_bytes(os.urandom(size)), "model.pt fails its checksum"),
        "flipped": (lambda d: flip_byte(d / "model.pt", size - 2000), "model.pt fails its checksum"),
        "longer": (lambda d: open(d / "rank_0.pt", "ab").write(b"x"), "rank_0.pt has"),
        "no_rank_0": (lambda d: os.remove(d / "rank_0.pt"), "rank_0.pt is missing (its manifest lists it)"),
        "torn_manifest": (lambda d: truncate(d / MANIFEST), f"{MANIFEST} is not valid JSON, torn or overwritten"),
        "binary_manifest": (lambda d: (d / MANIFEST).write_bytes(b"\xff\xfe" + os.urandom(50)),
                            f"{MANIFEST} is not text (binary bytes)"),
        "other_json": (lambda d: (d / MANIFEST).write_text("[1, 2]"), f"{MANIFEST} is not a checkpoint manifest"),
        "not_a_checkpoint": (lambda d: [os.remove(d / n) for n in (MANIFEST, "model.pt")],
                             "is not a checkpoint directory: it holds neither manifest.json nor model.pt"),
    }
    for name, (damage, want) in cases.items():
        bad = damaged(written, name, damage)
        assert want in explicit_error(bad), name
    # The quick look of preflight (sizes only) misses a flipped byte; the resume's checksums catch it.
    assert find_resume(str(written.parent), str(written.parent / "flipped"), False, rank=0, checksums=False)
    # A rank the manifest lists, missing: named as missing, not as a checkpoint "saved with fewer ranks".
    two = written.parent / "two_ranks"
    shutil.copytree(written, two)
    shutil.copy(two / "rank_0.pt", two / "rank_1.pt")
    write_manifest(str(two), 3, world_size=2)
    os.remove(two / "rank_1.pt")
    assert "rank_1.pt is missing (its manifest lists it)" in explicit_error(str(two))
    # A rank beyond the saving world size is: the checkpoint is intact, this run has more ranks.
    state = TrainState(model=torch.nn.Linear(1, 1), progress=Progress(world_size=2))
    with pytest.raises(CheckpointError, match=r"no state for rank 1: it was saved with fewer ranks \(1\)"):
        load_train_state(str(written), state, rank=1)


def test_latest_falls_back_and_refuses_when_nothing_is_intact(written, caplog):
    checkpoints = written.parent
    newer = checkpoints / "step_00000007"
    shutil.copytree(written, newer)
    flip_byte(newer / "train_state.pt", 100)
    assert find_resume(str(checkpoints), "latest", True, rank=0, checksums=True) == str(written)
    assert f"skipping {newer}: {newer / 'train_state.pt'} fails its checksum" in caplog.text
    open(written / "rank_0.pt", "w").close()
    with pytest.raises(CheckpointError, match=f"no checkpoint in {checkpoints} is intact .*rank_0.pt is empty"):
        find_resume(str(checkpoints), "latest", False, rank=0, checksums=True)


def test_legacy_checkpoints_are_checked_with_their_crcs(written, caplog):
    legacy = damaged(written, "legacy", lambda d: os.remove(d / MANIFEST))
    assert find_resume(os.path.dirname(legacy), legacy, False, rank=0, checksums=True) == legacy
    assert f"{legacy} has no manifest.json (it was written before checkpoints had one)" in caplog.text
    size = os.path.getsize(written / "model.pt")
    cases = {
        "flipped": (lambda d: flip_byte(d / "model.pt", size - 2000), "model.pt fails the CRC32 of its record"),
        "garbage": (lambda d: (d / "model.pt").write_bytes(os.urandom(size)), "model.pt is not a file torch.save"),
        "truncated": (lambda d: truncate(d / "train_state.pt"), "train_state.pt is not a file torch.save wrote"),
        "zero": (lambda d: open(d / "rank_0.pt", "w").close(), "rank_0.pt is empty (0 bytes)"),
        "no_rank_0": (lambda d: os.remove(d / "rank_0.pt"), "rank_0.pt is missing"),
    }
    for name, (damage, want) in cases.items():
        bad = damaged(written.parent / "legacy", f"legacy_{name}", damage)
        assert want in explicit_error(bad), name
    # Loading itself names the file too, whatever torch.load raises on the bytes.
    for name, want in (("garbage", "is not a file torch.save wrote"), ("zero", "is empty")):
        stem = "model" if name == "garbage" else "rank_0"
        with pytest.raises(CheckpointError, match=want):
            load_torch_file(str(written.parent / f"legacy_{name}" / f"{stem}.pt"))


def test_init_from_verifies_the_model_file(written, caplog):
    run = written.parent.parent
    assert model_file(str(run)) == str(written / "model.pt")
    newer = written.parent / "step_00000009"
    shutil.copytree(written, newer)
    flip_byte(newer / "model.pt", os.path.getsize(newer / "model.pt") - 2000)
    for spec in (newer, newer / "model.pt"):
        with pytest.raises(CheckpointError, match=f"model.init_from='{spec}' cannot be loaded: .*model.pt fails its "
                                                  "checksum"):
            model_file(str(spec))
    assert model_file(str(run)) == str(written / "model.pt")  # the newest intact one
    assert f"model.init_from: skipping {newer}: {newer / 'model.pt'} fails its checksum" in caplog.text
    os.remove(newer / "rank_0.pt")  # init_from reads model.pt only
    flip_byte(newer / "model.pt", os.path.getsize(newer / "model.pt") - 2000)
    assert model_file(str(newer)) == str(newer / "model.pt")
