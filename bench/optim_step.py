"""Time one optimizer step on the exact parameter shapes of OpenCLIP models.

    python bench/optim_step.py --device cpu --models vit_b32 --iters 5 --json out.json
    python bench/optim_step.py --device cuda --models vit_b32 vit_h14 --json h200.json

Shapes come from building the model on the meta device, so nothing is downloaded or allocated for it;
fp32 parameters and random gradients are then allocated on the target device. Each optimizer is timed
on its own (median over --iters steps after --warmup) and compared with torch's AdamW measured in the
same run: fused where the device supports it, else foreach.
"""

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import open_clip
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from src.optim import rms  # noqa: E402
from src.optim.stable_adamw import StableAdamW  # noqa: E402

MODELS = {"vit_b32": "ViT-B-32", "vit_h14": "ViT-H-14"}
HP = dict(lr=2e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.2)
BYTES_PER_PARAM = 28  # AdamW's minimum traffic in fp32: read p, g, m, v and write p, m, v


def parameter_shapes(model: str) -> list[torch.Size]:
    with torch.device("meta"):
        m = open_clip.create_model(MODELS[model], device="meta")
    return [p.shape for p in m.parameters()]


def optimizers(device: torch.device, model: str) -> dict[str, tuple[Callable, dict]]:
    """name -> (factory taking the params, keyword arguments for each step() call)."""
    # What an fp16 run with the fixed loss scaler passes: unscale, per-tensor skips, whole-step skip.
    fp16 = dict(
        grad_scale=torch.ones((), device=device),
        skip_nonfinite=True,
        found_inf=torch.zeros((), device=device),
    )
    candidates = {
        "StableAdamW foreach": (lambda ps: StableAdamW(ps, **HP, foreach=True), {}),
        "StableAdamW foreach fp16 skips": (lambda ps: StableAdamW(ps, **HP, foreach=True), fp16),
        "AdamW foreach": (lambda ps: torch.optim.AdamW(ps, **HP, foreach=True), {}),
        "AdamW fused": (lambda ps: torch.optim.AdamW(ps, **HP, fused=True), {}),
    }
    candidates["AdamW fused + RMS, multi-tensor"] = (lambda ps: AdamWWithRMS(ps, fused_rms=False), {})
    if device.type == "cuda":  # the Triton kernels run on CUDA only
        candidates["AdamW fused + RMS, fused"] = (lambda ps: AdamWWithRMS(ps, fused_rms=True), {})
        candidates["StableAdamW fused"] = (lambda ps: StableAdamW(ps, **HP, fused=True), {})
        candidates["StableAdamW fused fp16 skips"] = (lambda ps: StableAdamW(ps, **HP, fused=True), fp16)
    if device.type == "cpu" and model == "vit_b32":  # the per-tensor loop is slow: only where it is cheap
        candidates["StableAdamW loop"] = (lambda ps: StableAdamW(ps, **HP, foreach=False), {})
    try:
        import optimi

        # Same hyperparameter values; any difference in how optimi applies them does not change the cost.
        candidates["optimi StableAdamW foreach"] = (lambda ps: optimi.StableAdamW(ps, **HP, foreach=True), {})
        if device.type == "cuda":
            candidates["optimi StableAdamW triton"] = (
                lambda ps: optimi.StableAdamW(ps, **HP, triton=True),
                {},
            )
    except ImportError:
        print("optimi (torch-optimi) is not installed: no peer StableAdamW timed")
    return candidates


class AdamWWithRMS:
    """torch's fused AdamW step, then the spike tracker's per-tensor RMS of it (`src/optim/rms.py`), as the
    trainer runs them with optim=adamw: what StableAdamW's step, which computes the RMS itself, compares with."""

    def __init__(self, params: list[torch.nn.Parameter], fused_rms: bool):
        self.optimizer = torch.optim.AdamW(params, **HP, fused=True)
        self.fused_rms = fused_rms

    def step(self) -> None:
        self.optimizer.step()
        group = self.optimizer.param_groups[0]
        members = [p for p in group["params"] if p.grad is not None]
        if not self.fused_rms:
            rms._multi_tensor_rms(self.optimizer, group, members)
        elif rms._fused_rms(self.optimizer, group, members) is None:
            raise ValueError("the fused RMS does not apply to these tensors")


def time_steps(step: Callable[[], None], device: torch.device, iters: int) -> list[float]:
    """Milliseconds per call: CUDA events on the GPU, the wall clock on the CPU."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_model(model: str, device: torch.device, warmup: int, iters: int) -> list[dict]:
    shapes = parameter_shapes(model)
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    print(f"\n{model} ({MODELS[model]}): {n / 1e6:.1f}M parameters in {len(params)} tensors on {device}")

    rows = []
    for name, (make, step_kwargs) in optimizers(device, model).items():
        try:
            opt = make(params)
            for _ in range(warmup):  # the first step also allocates the state
                opt.step(**step_kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            times = time_steps(functools.partial(opt.step, **step_kwargs), device, iters)
        except (RuntimeError, TypeError, ValueError) as e:
            print(f"  {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        row = dict(
            model=model,
            optimizer=name,
            params=n,
            tensors=len(params),
            median_ms=statistics.median(times),
            min_ms=min(times),
            iters=iters,
            warmup=warmup,
        )
        row["GB_per_s_at_28B_per_param"] = BYTES_PER_PARAM * n / (row["median_ms"] * 1e-3) / 1e9
        if device.type == "cuda":  # scratch memory of one step, beyond params, grads and state
            row["step_temp_GiB"] = (torch.cuda.max_memory_allocated(device) - resident) / 2**30
        rows.append(row)
        del opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    baseline = next((r for r in rows if r["optimizer"] == "AdamW fused"), None)
    baseline = baseline or next(r for r in rows if r["optimizer"] == "AdamW foreach")
    for r in rows:
        r["baseline"] = baseline["optimizer"]
        r["ratio_to_baseline"] = r["median_ms"] / baseline["median_ms"]
    ratio = "x " + baseline["optimizer"]
    print(f"  {'optimizer':<32} {'median ms':>10} {'min ms':>10} {ratio:>16} {'GB/s@28B':>9}")
    for r in rows:
        print(
            f"  {r['optimizer']:<32} {r['median_ms']:>10.2f} {r['min_ms']:>10.2f} "
            f"{r['ratio_to_baseline']:>16.2f} {r['GB_per_s_at_28B_per_param']:>9.1f}"
            + (f"   step scratch {r['step_temp_GiB']:.1f} GiB" if "step_temp_GiB" in r else "")
        )
    del params
    gc.collect()
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["vit_b32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    results = [row for model in args.models for row in bench_model(model, device, args.warmup, args.iters)]
    report = dict(
        device=device_name(device),
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        hyperparameters=HP,
        load_average_1m=os.getloadavg()[0],  # CPU timings mean little on a busy machine
        results=results,
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
