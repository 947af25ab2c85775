"""What `trainer.compile: auto` and `trainer.cuda_graph: auto` run on this machine, and why.

The fast step is the default: compiled blocks on a GPU (on a CPU, compilation costs more than it saves), and the
step recorded as a CUDA graph wherever a recording replays correctly. A graph replays fixed kernels on fixed
buffers, so `auto` records only where nothing in the step needs the host or a changing shape:

- one process (DDP's and FSDP2's gradient communication is not recorded);
- a scaler without host state (torch's GradScaler, `precision.scaler=dynamic`, keeps its scale on the host);
- one micro-batch (`trainer.accum_steps` > 1 runs a loop whose length the recording would fix);
- images, not video clips (the video step's sequence-parallel head is not recorded).

Every training batch has data.batch_size samples (the loader drops an epoch's partial last batch), so the
recorded shapes hold. If recording still fails, `auto` runs the step eagerly from then on, with one log line
(src/trainer/cuda_graph.py); an explicit `true` stops with the error instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.config import TrainConfig

AUTO = "auto"


@dataclass(frozen=True)
class FastPath:
    """The resolved `trainer.compile` and `trainer.cuda_graph`, each with the reason when `auto` chose it."""

    compile: bool
    cuda_graph: bool
    compile_reason: str | None  # None: set explicitly
    cuda_graph_reason: str | None

    @property
    def cuda_graph_auto(self) -> bool:
        return self.cuda_graph_reason is not None

    def summary(self) -> str:
        """One line: what runs, and why where `auto` decided."""
        def part(key: str, value: bool, reason: str | None) -> str:
            return f"{key}={'on' if value else 'off'}" + (f" (auto: {reason})" if reason else "")
        return ("step: " + part("trainer.compile", self.compile, self.compile_reason) + ", "
                + part("trainer.cuda_graph", self.cuda_graph, self.cuda_graph_reason))


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def auto_compile(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"on {device.type}, compiling costs more than it saves"
    if not has_triton():
        return False, "triton is not installed (pip install 'stableclip[gpu]')"
    return True, "on a GPU"


def auto_cuda_graph(cfg: TrainConfig, device: torch.device, world_size: int) -> tuple[bool, str]:
    """Record the step unless something in it cannot be recorded; the reason names the first such thing."""
    if device.type != "cuda":
        return False, f"CUDA graphs record GPU work, this run is on {device.type}"
    if world_size > 1:
        return False, f"{world_size} processes: gradient communication is not recorded"
    if cfg.precision.scaler == "dynamic":
        return False, "precision.scaler=dynamic keeps its scale on the host"
    if cfg.trainer.accum_steps > 1:
        return False, f"trainer.accum_steps={cfg.trainer.accum_steps} loops over micro-batches"
    if cfg.data.frames:
        return False, "video clips (data.frames > 0): the video step is not recorded"
    return True, "one GPU, fixed batch shape, a scaler without host state"


def resolve_compile(cfg: TrainConfig, device: torch.device) -> tuple[bool, str | None]:
    """`trainer.compile` for this run, and the reason when `auto` decided (None when set explicitly)."""
    return auto_compile(device) if cfg.trainer.compile == AUTO else (cfg.trainer.compile is True, None)


def resolve_fast_path(cfg: TrainConfig, device: torch.device, world_size: int) -> FastPath:
    """The step's compile and CUDA-graph settings for this run: explicit booleans as given, `auto` decided here.
    (Any other value is preflight's to report; it counts as off.)"""
    compile_, compile_reason = resolve_compile(cfg, device)
    graph, graph_reason = (auto_cuda_graph(cfg, device, world_size) if cfg.trainer.cuda_graph == AUTO
                           else (cfg.trainer.cuda_graph is True, None))
    return FastPath(compile_, graph, compile_reason, graph_reason)
