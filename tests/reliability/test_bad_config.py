"""Guarantee 7: a configuration that cannot run fails before any expensive work (data generation, model weights,
loader workers, checkpoint loading), naming each bad key and its fix, all at once. Under torchrun with 2 ranks,
since two of the checks concern the world size."""

from tests.reliability.harness import LEDGER, Training, run_args

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
