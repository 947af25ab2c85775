"""Guarantee 7: a configuration that cannot run fails before any expensive work (data generation, model weights,
loader workers, checkpoint loading), naming each bad key and its fix, all at once; the first test runs under
torchrun with 2 ranks, since two of the checks concern the world size. 7a-7d: values out of range, unknown keys,
missing inputs and a run too large for the machine, each through train.py."""

import os
import shutil

import torch

from src.trainer.memory import available_memory, estimate_memory
from tests.conftest import ROOT, compose_config, data_overrides
from tests.reliability.harness import LEDGER, Training, run_args
from tests.reliability.test_bad_data import DROP_FILE_CAPABILITIES

BAD = {
    "data.batch_size=15": "data.batch_size=15 is not divisible by the world size 2",
    "trainer.sp_size=3": "trainer.sp_size=3 does not divide the world size 2",
    # On a CPU-only machine this is the nearest real case of "fp8 on a GPU without fp8": the same check, which on
    # a GPU of compute capability below 8.9 says "needs fp8 tensor cores".
    "model.linear=switchback_fp8": "model.linear=switchback_fp8 with the cuda backend needs a CUDA GPU",
    "trainer.resume_required=true": "holds no complete checkpoint, and trainer.resume_required=true",
    "model.vision.heads=5": "model.vision.width=96 is not divisible by model.vision.heads=5",
    "trainer.log_every=0": "trainer.log_every=0 is out of range: set it to at least 1",
}


def test_bad_configuration_fails_before_any_expensive_work(shapes, tmp_path):
    run_dir, generated = tmp_path / "run", tmp_path / "generated"
    args = run_args(shapes, run_dir, *BAD, "data.generate=true",
                    f"data.shards='{generated}/train-{{000000..000007}}.tar'")
    training = Training(args, tmp_path / "log.txt", torchrun=2)
    assert training.wait() != 0
    output = training.output()
    for override, message in BAD.items():
        assert message in output, override
    assert "set data.batch_size to a multiple of 2" in output and "set heads to a divisor of the width" in output
    # Nothing was generated, written or loaded.
    assert not generated.exists() and not (run_dir / "config.yaml").exists() and not (run_dir / "checkpoints").exists()
    LEDGER.append(("7 bad configuration", len(BAD), 0, 0))


def refused(args: list[str], log_path, **kwargs) -> str:
    """The output of a train.py run that must be refused at the start: non-zero exit, one message, no traceback."""
    training = Training(args, log_path, **kwargs)
    assert training.wait() != 0, training.output()[-3000:]
    output = training.output()
    assert "error: " in output and "Traceback" not in output, output[-3000:]
    return output


def test_values_that_make_no_sense_are_refused_at_once_leaving_no_run_directory(shapes, tmp_path):
    """Through train.py with Hydra's default run directory (outputs/<experiment_name>/<time> in the repository):
    every bad value named, and the directory Hydra made for the run removed again."""
    bad = {
        "data.batch_size=0": "data.batch_size=0 is out of range: set it to at least 1",
        "data.samples_per_epoch=0": "data.samples_per_epoch=0 is out of range: set it to at least 1",
        "data.shuffle_buffer=0": "data.shuffle_buffer=0 is out of range: set it to at least 1",
        "data.num_workers=-1": "data.num_workers=-1 is out of range: set it to 0 or more",
        "optim.lr=inf": "optim.lr=inf is out of range: set it to a finite number above 0",
        "data.crop_scale_min=1.5": "data.crop_scale_min=1.5 is out of range: set it to in (0, 1]",
        "trainer.max_steps=0": "trainer.max_steps=0 is out of range: set it to at least 1",
        "trainer.ckpt_every=-1": "trainer.ckpt_every=-1 is out of range: set it to 0 (end only) or more",
        "trainer.keep_last_k=-1": "trainer.keep_last_k=-1 is out of range: set it to at least 1",
    }
    experiment = f"refused_{os.getpid()}"
    outputs = os.path.join(ROOT, "outputs", experiment)
    output = refused(["experiment=quickstart", *data_overrides(shapes), "data.mode=resampled",
                      f"experiment_name={experiment}", *bad], tmp_path / "log.txt")
    for override, message in bad.items():
        assert message in output, override
    assert not os.path.exists(outputs)
    LEDGER.append(("7a values out of range (train.py)", len(bad), 0, 0))


def test_keys_the_schema_lacks_are_refused_with_the_closest_key(tmp_path):
    output = refused(["experiment=quickstart", "+trainer.max_stepz=3", "trainer.log_evry=2",
                      f"trainer.run_dir={tmp_path}/run"], tmp_path / "log.txt")
    assert "trainer.max_stepz is not a config key: did you mean trainer.max_steps?" in output
    assert "trainer.log_evry is not a config key: did you mean trainer.log_every?" in output
    assert "To append to your config use +" not in output  # Hydra's own hint, which would add an ignored key
    assert not (tmp_path / "run").exists()
    LEDGER.append(("7b unknown keys (with and without +)", 2, 0, 0))


def test_missing_and_unreadable_inputs_are_found_before_the_first_step(shapes, tmp_path):
    """Held-out shards that are missing or cannot be opened, no classes.json for zero-shot, training shards that do
    not exist and a missing init_from: all found before the model is built, not at the first evaluation."""
    eval_dir = tmp_path / "eval"
    shutil.copytree(os.path.dirname(shapes["eval_shards"]), eval_dir)
    (eval_dir / "classes.json").unlink()
    (eval_dir / "eval-000001.tar").chmod(0)
    run_dir = tmp_path / "run"
    args = run_args(shapes, run_dir, f"data.shards='{shapes['shards'].replace('000007', '000008')}'",
                    f"model.init_from={tmp_path}/pretrained")
    unreadable = refused([*args, f"data.eval_shards='{eval_dir}/eval-{{000000..000001}}.tar'"], tmp_path / "log.txt",
                         wrapper=DROP_FILE_CAPABILITIES)
    assert "data.shards=" in unreadable and "1 of 9 shards do not exist" in unreadable
    assert f"model.init_from='{tmp_path}/pretrained' names no checkpoint" in unreadable
    assert f"data.eval_shards: 1 of 2 shards cannot be read: '{eval_dir}/eval-000001.tar' (Permission denied)" \
        in unreadable
    assert f"eval.held_out.zeroshot=true needs classes.json beside data.eval_shards, and {eval_dir}/classes.json" \
        in unreadable
    missing = refused([*args, f"data.eval_shards='{tmp_path}/nowhere/eval-{{000000..000001}}.tar'"],
                      tmp_path / "log2.txt")
    assert "data.eval_shards matched no files" in missing
    assert "expected memory per rank" not in missing + unreadable  # refused before the model was even counted
    assert not run_dir.exists()
    LEDGER.append(("7c missing or unreadable inputs", 5, 0, 0))


def test_a_run_far_too_large_for_the_machine_is_refused_with_the_numbers(shapes, tmp_path):
    """ViT-B/32 on the CPU with a batch whose activations alone need twice this machine's memory; the run directory
    of an earlier run is left as it was, and HYDRA_FULL_ERROR=1 shows the traceback."""
    ram, _ = available_memory(torch.device("cpu"))
    per_sample = estimate_memory(compose_config(["model=vit_b32", "data.shards=x"]), 1).activation_bytes_per_sample
    batch = int(2 * ram / per_sample)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    args = ["model=vit_b32", *data_overrides(shapes), "trainer.device=cpu", f"data.batch_size={batch}",
            f"trainer.run_dir={run_dir}", "trainer.progress=false"]
    output = refused(args, tmp_path / "log.txt")
    assert f"per sample x {batch} samples" in output and "GB per rank" in output, output[-3000:]
    assert "more than 1.5x the" in output and "a smaller data.batch_size (about" in output
    assert "model.checkpoint_policy=full" in output
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n' and (run_dir / "checkpoints").is_dir()
    assert not (run_dir / "config.yaml").exists()
    full = Training(args, tmp_path / "full.txt", env={"HYDRA_FULL_ERROR": "1"})
    assert full.wait() != 0
    assert "Traceback" in full.output() and "ConfigurationError: the configuration cannot run" in full.output()
    LEDGER.append(("7d run too large for the machine", 1, 0, 0))
