"""trainer.compile and trainer.cuda_graph default to `auto`: what each resolves to on each kind of run (the
GPU's decisions on a CPU, with a CUDA device object and triton stubbed), the one start-up line, the values
preflight refuses, and the eager fallback when an automatic recording fails."""

import logging

import pytest
import torch

from src.parallel.distributed import DistInfo
from src.trainer import fast_path
from src.trainer.cuda_graph import GraphedForwardBackward
from src.trainer.fast_path import resolve_fast_path
from src.trainer.preflight import preflight
from tests.conftest import compose_config, data_overrides
from tests.reliability.launch import check_no_recorded_step
from tests.test_cuda_graph import build_trainer, rerun_capture

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def triton(monkeypatch):
    monkeypatch.setattr(fast_path, "has_triton", lambda: True)


def test_the_defaults_are_auto_and_off_on_a_cpu():
    cfg = compose_config([])
    assert cfg.trainer.compile == "auto" and cfg.trainer.cuda_graph == "auto"
    path = resolve_fast_path(cfg, CPU, world_size=1)
    assert (path.compile, path.cuda_graph) == (False, False)
    assert path.summary() == ("step: trainer.compile=off (auto: on cpu, compiling costs more than it saves), "
                              "trainer.cuda_graph=off (auto: CUDA graphs record GPU work, this run is on cpu)")


def test_on_one_gpu_auto_compiles_and_records(triton):
    path = resolve_fast_path(compose_config([]), CUDA, world_size=1)
    assert (path.compile, path.cuda_graph, path.cuda_graph_auto) == (True, True, True)
    assert path.summary() == ("step: trainer.compile=on (auto: on a GPU), trainer.cuda_graph=on (auto: one GPU, "
                              "fixed batch shape, a scaler without host state)")


@pytest.mark.parametrize(("overrides", "world_size", "reason"), [
    ([], 2, "2 processes: gradient communication is not recorded"),
    (["precision=fp16", "precision.scaler=dynamic"], 1, "precision.scaler=dynamic keeps its scale on the host"),
    (["trainer.accum_steps=4"], 1, "trainer.accum_steps=4 loops over micro-batches"),
    (["experiment=video_finetune"], 1, "video clips (data.frames > 0): the video step is not recorded"),
])
def test_auto_leaves_the_step_unrecorded_where_a_recording_would_not_replay(triton, overrides, world_size, reason):
    path = resolve_fast_path(compose_config(overrides), CUDA, world_size)
    assert path.compile and not path.cuda_graph
    assert path.summary().endswith(f"trainer.cuda_graph=off (auto: {reason})")


def test_explicit_values_are_kept_and_give_no_reason(monkeypatch):
    monkeypatch.setattr(fast_path, "has_triton", lambda: True)
    cfg = compose_config(["trainer.compile=false", "trainer.cuda_graph=true"])
    path = resolve_fast_path(cfg, CUDA, world_size=1)
    assert (path.compile, path.cuda_graph, path.cuda_graph_auto) == (False, True, False)
    assert path.summary() == "step: trainer.compile=off, trainer.cuda_graph=on"
    # With triton missing, auto does not compile: torch.compile would fail at the first step.
    monkeypatch.setattr(fast_path, "has_triton", lambda: False)
    path = resolve_fast_path(compose_config([]), CUDA, 1)
    assert not path.compile and path.compile_reason.startswith("triton is not installed")


def test_preflight_refuses_other_values_and_lets_auto_through_on_a_cpu(tmp_path):
    cfg = compose_config(["experiment=quickstart", "trainer.compile=yes", "trainer.cuda_graph=sometimes"])
    with pytest.raises(ValueError, match="the configuration cannot run") as err:
        preflight(cfg, DistInfo(0, 1, 0, CPU), str(tmp_path))
    assert "trainer.compile=yes is out of range: set it to true, false or auto" in str(err.value)
    assert "trainer.cuda_graph=sometimes is out of range: set it to true, false or auto" in str(err.value)
    # auto with what `true` would be refused for (a CPU, accumulation): auto simply does not record.
    preflight(compose_config(["experiment=quickstart", "trainer.accum_steps=2"]), DistInfo(0, 1, 0, CPU),
              str(tmp_path))


def test_fault_injection_turns_auto_off():
    cfg = compose_config([])
    check_no_recorded_step(cfg)
    assert cfg.trainer.cuda_graph is False


def test_the_trainer_logs_what_runs_once_at_start(shapes, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="src.trainer.trainer"):
        trainer = build_trainer(shapes, tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step: ")]
    assert lines == [trainer.fast_path.summary()] and "trainer.compile=off (auto: on cpu" in lines[0]
    assert trainer.graphed is None


def test_a_failed_automatic_recording_runs_the_step_eagerly_from_then_on(shapes, tmp_path, caplog):
    """`auto` must not stop a run the user never asked to record: the failed capture's step and every later one
    run eagerly and train exactly as a trainer that never tried."""
    eager = build_trainer(shapes, tmp_path / "eager")
    fallback = build_trainer(shapes, tmp_path / "fallback")
    attempts = []

    def failing_capture(run):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    fallback.graphed = GraphedForwardBackward(fallback.forward_backward, list(fallback.model.parameters()), CPU,
                                              warmup=2, capture=failing_capture, eager_on_failure=True)
    with caplog.at_level(logging.WARNING, logger="src.trainer.cuda_graph"):
        for _ in range(5):
            want, got = eager.train_step(next(eager.loader)), fallback.train_step(next(fallback.loader))
            assert torch.equal(want["loss"], got["loss"])
    assert attempts == [1] and fallback.graphed.eager and not fallback.graphed.captured
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.cuda_graph=auto: the training step could not be recorded as a CUDA graph (operation not permitted "
        "when stream is capturing); it runs eagerly from here on"]
    for (name, a), b in zip(eager.model.named_parameters(), fallback.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_an_automatic_recording_that_works_is_kept(shapes, tmp_path):
    trainer = build_trainer(shapes, tmp_path / "run", *data_overrides(shapes))
    parameters = list(trainer.model.parameters())
    trainer.graphed = GraphedForwardBackward(trainer.forward_backward, parameters, CPU, warmup=1,
                                             capture=rerun_capture(parameters), eager_on_failure=True)
    for _ in range(3):
        trainer.train_step(next(trainer.loader))
    assert trainer.graphed.captured and not trainer.graphed.eager
