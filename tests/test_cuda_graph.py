"""trainer.cuda_graph on the CPU: the trainer's side of a recorded step (warm-up, static batch, gradients kept
between replays, outputs copied, optimizer and schedule outside), with a stand-in that replays by re-running the
step; and the refusals. The real capture is checked on the GPU: tests/gpu/test_cuda_graph_cuda.py."""

import pytest
import torch

from src.parallel.distributed import DistInfo
from src.trainer.cuda_graph import GraphedForwardBackward, capture_cuda_graph, check_cuda_graph
from src.trainer.preflight import preflight
from src.trainer.trainer import Trainer
from tests.conftest import compose_config, data_overrides, run_train
from tests.reliability.launch import check_no_recorded_step

STEPS = 7


def rerun_capture(parameters):
    """A stand-in for capture_cuda_graph: each replay runs the step again and writes its gradients and outputs
    into the tensors of the first run, where a CUDA graph's replay writes them."""
    def capture(run):
        outputs = run()
        bound = [p.grad for p in parameters]

        def replay():
            for p in parameters:
                p.grad = None
            new = run()
            for p, grad in zip(parameters, bound, strict=True):
                grad.copy_(p.grad)
                p.grad = grad
            for name, value in new.items():
                outputs[name].copy_(value)

        return replay, outputs
    return capture


def build_trainer(shapes, run_dir, *extra):
    cfg = compose_config([
        "experiment=quickstart", *data_overrides(shapes), f"trainer.run_dir={run_dir}", "trainer.progress=false",
        "data.batch_size=16", "data.num_workers=0", "optim.warmup_steps=2", "optim.grad_clip_norm=0.5",
        f"trainer.max_steps={STEPS}", "logger=none", *extra,
    ])
    run_dir.mkdir(parents=True, exist_ok=True)  # train.py makes it
    return Trainer(cfg, str(run_dir), DistInfo(0, 1, 0, torch.device("cpu")))


@pytest.mark.parametrize("optim", ["adamw", "stable_adamw"])
def test_recorded_steps_train_exactly_as_eager_ones(shapes, tmp_path, optim):
    eager = build_trainer(shapes, tmp_path / "eager", f"optim={optim}")
    graphed = build_trainer(shapes, tmp_path / "graphed", f"optim={optim}")
    parameters = list(graphed.model.parameters())
    graphed.graphed = GraphedForwardBackward(graphed.forward_backward, parameters, torch.device("cpu"), warmup=2,
                                             capture=rerun_capture(parameters))
    eager_values = [eager.train_step(next(eager.loader)) for _ in range(STEPS)]
    graphed_values, grads = [], []
    for _ in range(STEPS):
        graphed_values.append(graphed.train_step(next(graphed.loader)))
        grads.append([p.grad for p in parameters])
    assert graphed.graphed.captured and graphed.graphed.calls == STEPS
    # Warm-up steps drop their gradients as usual; from the capture on, the recorded tensors stay bound.
    assert all(g is None for g in grads[0]) and all(g is None for g in grads[1])
    assert all(a is b for later in grads[3:] for a, b in zip(grads[2], later, strict=True))
    # Each step's values are its own (copies), not the graph's outputs that the next replay overwrites.
    for step, (want, got) in enumerate(zip(eager_values, graphed_values, strict=True)):
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
    assert len({v["loss"].item() for v in graphed_values}) == STEPS  # the batches and weights did change
    for (name, a), b in zip(eager.model.named_parameters(), parameters, strict=True):
        assert torch.equal(a, b), name
    assert eager.scheduler.get_last_lr() == graphed.scheduler.get_last_lr()  # the schedule ran outside


def test_a_batch_of_another_shape_names_both_shapes():
    parameter = torch.nn.Parameter(torch.ones(3))

    def forward_backward(batch):
        loss = (parameter * batch["x"].float().sum()).sum()
        loss.backward()
        return {"loss": loss.detach()}

    cpu = torch.device("cpu")
    step = GraphedForwardBackward(forward_backward, [parameter], cpu, warmup=1, capture=rerun_capture([parameter]))
    step({"x": torch.ones(4, 2), "keys": ["a", "b", "c", "d"]})
    step({"x": torch.ones(4, 2), "keys": ["e", "f", "g", "h"]})  # captured: the keys are not the step's
    with pytest.raises(ValueError, match=r"x of shape \(4, 2\) \(torch.float32\), but this batch's is \(3, 2\)"):
        step({"x": torch.ones(3, 2)})
    with pytest.raises(ValueError, match=r"the batch holds tensors \['y'\], the recorded step read \['x'\]"):
        step({"y": torch.ones(4, 2)})


def test_a_step_that_cannot_be_recorded_says_how_to_turn_it_off():
    def refuse(run):
        raise RuntimeError("operation not permitted when stream is capturing")

    step = GraphedForwardBackward(lambda batch: {}, [], torch.device("cpu"), warmup=0, capture=refuse)
    with pytest.raises(RuntimeError, match="could not be recorded as a CUDA graph.*Set trainer.cuda_graph=false"):
        step({"x": torch.ones(1)})


def test_what_a_recorded_step_cannot_do_is_refused_with_the_fix(shapes, tmp_path):
    # train.py refuses it before any work (its preflight), with the fix.
    with pytest.raises(AssertionError, match="records CUDA kernels, but the trainer runs on cpu"):
        run_train(["experiment=quickstart", *data_overrides(shapes), f"trainer.run_dir={tmp_path / 'run'}",
                   "trainer.cuda_graph=true"])
    cfg = compose_config(["experiment=quickstart", "trainer.cuda_graph=true"])
    with pytest.raises(ValueError, match="(?s)cannot run:.*trainer.cuda_graph=true records CUDA kernels"):
        preflight(cfg, DistInfo(0, 1, 0, torch.device("cpu")), str(tmp_path))
    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="runs in one process, not 2"):
        check_cuda_graph(cuda, 2, "none")
    with pytest.raises(ValueError, match="cannot record precision.scaler=dynamic"):
        check_cuda_graph(cuda, 1, "dynamic")
    check_cuda_graph(cuda, 1, "fixed")
    # The reliability suite's fault injection (tests/reliability/launch.py) refuses to be recorded, too.
    with pytest.raises(ValueError, match="unset STABLECLIP_FAULT_LOSS"):
        check_no_recorded_step(cfg)


def test_the_capture_lets_the_pin_memory_thread_go_on(monkeypatch):
    """With the real loader a pin-memory thread pins the next batches during the capture; the capture must check
    only its own thread's calls (a GPU run with the default mode lost that thread to
    cudaErrorStreamCaptureUnsupported)."""
    modes = []

    class Graph:
        replay = None

    class Recording:
        def __init__(self, graph, capture_error_mode="global"):
            modes.append(capture_error_mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Recording)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    _, outputs = capture_cuda_graph(lambda: {"loss": torch.ones(())})
    assert modes == ["thread_local"] and outputs["loss"].item() == 1.0
