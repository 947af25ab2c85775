"""`trainer.cuda_graph`: the forward and backward of the training step recorded once as a CUDA graph, then replayed.

A compiled ViT-B/32 step launches about 1,400 kernels. Where the host queues them more slowly than the GPU runs
them, the GPU waits: on one H200 machine the step took 115 ms, on another, whose host queued it twice as fast,
108 ms (docs/BENCHMARKS.md, host speed and CUDA graphs). A replayed graph is one launch, so the host no longer sets
the pace.

What is recorded: image normalization, both towers, the loss, backward, and the gradient norm with its clipping.
The optimizer, the metrics and the lr schedule stay outside and run as before, so every optimizer and schedule
works unchanged (an lr baked into a graph would stop following the schedule).

- The first `WARMUP_STEPS` steps run eagerly: they compile the blocks and settle the kernels' lazy set-up, none
  of which may happen during capture.
- The graph reads the batch from device tensors of fixed shape; each new batch is copied into them.
- Gradients are set to None before capture, so the recorded backward writes them rather than adding to them. The
  parameters keep those gradient tensors from then on (`zero_grad` must not drop them): every replay overwrites
  them in place.
- The step's outputs (loss, gradient norm, non-finite flag) are the graph's own tensors, overwritten by the next
  replay, so each call hands out copies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # eager steps before capture: compilation and lazy kernel set-up happen in the first one or two

StepOutputs = dict[str, torch.Tensor]


def capture_cuda_graph(run: Callable[[], StepOutputs]) -> tuple[Callable[[], None], StepOutputs]:
    """Record `run` as a CUDA graph without running it: (replay, the outputs that each replay overwrites)."""
    graph = torch.cuda.CUDAGraph()
    # Memory the eager warm-up steps freed into the cache would otherwise sit beside the graph's own pool.
    torch.cuda.empty_cache()
    # thread_local: only this thread's calls are checked. The DataLoader's pin-memory thread keeps pinning the next
    # batches meanwhile; under the default ("global") its CUDA calls invalidate the capture and kill that thread.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = run()
    return graph.replay, outputs


def check_cuda_graph(device: torch.device, world_size: int, scaler: str) -> None:
    """Refuse, with the fix, what a recorded step cannot do."""
    if device.type != "cuda":
        raise ValueError(f"trainer.cuda_graph=true records CUDA kernels, but the trainer runs on {device}: "
                         "set trainer.cuda_graph=false")
    if world_size > 1:
        raise ValueError(f"trainer.cuda_graph=true runs in one process, not {world_size}: DDP's and FSDP2's "
                         "gradient communication is not recorded. Set trainer.cuda_graph=false")
    if scaler == "dynamic":
        raise ValueError("trainer.cuda_graph=true cannot record precision.scaler=dynamic: torch's GradScaler keeps "
                         "per-step state on the host. Use precision.scaler=fixed, or precision=bf16")


class GraphedForwardBackward:
    """Calls `forward_backward(batch)` eagerly for `warmup` calls, then captures it once and replays it.

    `capture` records a callable and returns (replay, outputs): `capture_cuda_graph` on a GPU; tests pass a
    stand-in that re-runs the callable. `eager_on_failure` (`trainer.cuda_graph=auto`): a step that cannot be
    recorded runs eagerly from then on, with one log line, instead of stopping the run."""

    def __init__(self, forward_backward: Callable[[dict[str, torch.Tensor]], StepOutputs],
                 parameters: list[torch.nn.Parameter], device: torch.device, warmup: int = WARMUP_STEPS,
                 capture: Callable = capture_cuda_graph, eager_on_failure: bool = False):
        self.forward_backward, self.parameters, self.device = forward_backward, parameters, device
        self.warmup, self.capture, self.eager_on_failure = warmup, capture, eager_on_failure
        self.eager = False  # recording failed under eager_on_failure: every step runs eagerly
        self.calls = 0
        self.replay: Callable[[], None] | None = None
        self.static_batch: dict[str, torch.Tensor] = {}
        self.static_outputs: StepOutputs = {}

    @property
    def captured(self) -> bool:
        return self.replay is not None

    def __call__(self, batch: dict) -> StepOutputs:
        self.calls += 1
        if self.calls <= self.warmup or self.eager:
            return self.forward_backward(batch)
        if self.replay is None:
            # The step reads tensors only; the rest (sample keys, loader positions) is bookkeeping for the host.
            self.static_batch = {name: torch.empty_like(value, device=self.device) for name, value in batch.items()
                                 if isinstance(value, torch.Tensor)}
            self.copy_batch(batch)
            for p in self.parameters:
                p.grad = None
            try:
                self.replay, self.static_outputs = self.capture(lambda: self.forward_backward(self.static_batch))
            except RuntimeError as error:
                if self.eager_on_failure:
                    log.warning("trainer.cuda_graph=auto: the training step could not be recorded as a CUDA graph "
                                "(%s); it runs eagerly from here on", error)
                    self.eager, self.static_batch = True, {}
                    for p in self.parameters:  # whatever the failed recording left behind
                        p.grad = None
                    return self.forward_backward(batch)
                raise RuntimeError(
                    "trainer.cuda_graph=true: the training step could not be recorded as a CUDA graph; something "
                    f"in it waits for the host or changes shape ({error}). Set trainer.cuda_graph=false"
                ) from error
        else:
            self.copy_batch(batch)
        self.replay()
        return {name: value.clone() for name, value in self.static_outputs.items()}

    def copy_batch(self, batch: dict) -> None:
        tensors = {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}
        if tensors.keys() != self.static_batch.keys():
            raise ValueError(f"trainer.cuda_graph=true: the batch holds tensors {sorted(tensors)}, the recorded "
                             f"step read {sorted(self.static_batch)}")
        for name, value in tensors.items():
            static = self.static_batch[name]
            if value.shape != static.shape or value.dtype != static.dtype:
                raise ValueError(
                    f"trainer.cuda_graph=true replays a step recorded for {name} of shape {tuple(static.shape)} "
                    f"({static.dtype}), but this batch's is {tuple(value.shape)} ({value.dtype}): every batch "
                    "must have the same shape (data.batch_size samples). Set trainer.cuda_graph=false"
                )
            static.copy_(value, non_blocking=True)
