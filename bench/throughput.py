"""Training throughput of our Trainer's step, and OpenCLIP's step measured in the same call.

    python bench/throughput.py --model vit_b32 --batch 1024 [--set trainer.compile=true ...]
        [--end-to-end] [--train-py STEPS] [--peer .bench-peer/openclip_step.py] [--json out.json]

Each configuration builds the real `Trainer` (the code `train.py` runs) and times `Trainer.train_step`:
- compute-only: one batch of uint8 images and tokens already on the device, fed to every step;
- `--end-to-end`: batches from the real webdataset loader over JPEG shards on local disk, written first
  (`--shards-dir`, `--samples`) or given (`--e2e-shards`), timed over a window of `--e2e-seconds` after
  `--e2e-warmup-seconds`;
- `--train-py STEPS`: `train.py` itself, the card's command (`--train-py-set`, default `optim=stable_adamw`: no
  performance flags) on the same shards, at the rate its training log reports, beside the best configuration.
It reports samples/s (median step time, a sync after each step), the rate of steps run back to back with one sync at
the end as train.py runs them (`pipelined_samples_per_s`: the host may then run ahead of the GPU), the host's time
to queue a step (`host_ms`: well under `step_ms`, the GPU sets the pace; near it, either the CPU does or the host
has filled CUDA's launch queue and waits on it, which a profile's timeline tells apart), the optimizer state's size
(`optimizer_state_gib`), TFLOP/s from `FlopCounterMode` (counted on a meta-device copy of the model, so compilation
does not hide any op) and their share of a bf16 matmul measured in the same run, peak memory (with preflight's
estimate beside it, `estimate_gib`: src/trainer/memory.py), and the caching allocator's flush-and-retry count
(`alloc_retries`, each a wait for the GPU); end to end, the window's rate over each third of it
(`window_parts_samples_per_s`: whether the rate held, or a stall or a start-up stretch moved it), and with
`data.decode_on=device` a decode thread's wall time
per batch (`decode_ms`: near `data.decode_threads` x `step_ms`, the decoding sets the pace) and its phases
(`decode_phase_ms`: `DeviceDecoder`'s docstring names them). With a recorded
step (`trainer.cuda_graph`, on by `auto` on one GPU) only replays of the recorded step are timed (`--warmup` must
reach past the capture), and `host_ms` is then the batch copy, the replay's launch and the optimizer's. `--peer`
runs OpenCLIP's step (`shared/device/openclip_step.py`) as a subprocess with the same model and batch and prints our
rate over its rate; with `--end-to-end`, `--openclip-loop SAMPLES` runs OpenCLIP's whole training loop on the same
shards afterwards (`bench/peers/openclip_train_loop.py`) and gives each end-to-end rate over its rate;
`--peer bench/peers/openclip_siglip_step.py` is OpenCLIP's step with its `SigLipLoss`, the peer of `loss=siglip`.
`--profile ROWS [--trace DIR]` prints the costliest kernels of three steps and writes their timeline
(`bench/kernel_table.py` sums it per kernel; `--gaps` finds where the GPU waited; `--profile-gpu-only` records no
CPU ops, which slow the host). `--device cpu` makes it a smoke test.

A `--set` may also hold `py:MODULE.NAME=VALUE` tokens: module-level settings that are not config keys (kernel
launch settings such as `py:src.kernels.residual_norm.WARPS=4`, `auto`'s thresholds such as
`py:src.kernels.attention.short.AUTO_MAX_LENGTH=64`), set for that configuration only and put back after it. A
change to such a setting can then be timed against the default in one process, without a branch.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from src.compose import compose_config, module_settings  # noqa: E402
from src.data.device_decode import widen_cuda_queues  # noqa: E402
from src.data.loader import default_num_workers  # noqa: E402
from src.models.clip import build_model  # noqa: E402
from src.parallel.distributed import DistInfo  # noqa: E402
from src.tools.synthetic_shapes import make_synthetic_shapes  # noqa: E402
from src.trainer.cuda_graph import WARMUP_STEPS  # noqa: E402
from src.trainer.fast_path import resolve_fast_path  # noqa: E402
from src.trainer.loss import contrastive_loss  # noqa: E402
from src.trainer.memory import estimate_memory  # noqa: E402
from src.trainer.preflight import preflight  # noqa: E402
from src.trainer.trainer import Trainer, image_text_parts  # noqa: E402

OPENCLIP_NAMES = {"vit_b32": "ViT-B-32", "vit_b16": "ViT-B-16", "vit_l14": "ViT-L-14", "vit_huge": "ViT-H-14"}


def on_device_batch(cfg, device: torch.device) -> dict[str, torch.Tensor]:
    """A compute-only run's batch, fed to every step: random uint8 images and tokenized-looking captions, made
    once, on the device."""
    size = cfg.model.vision.image_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    images = torch.randint(0, 256, (cfg.data.batch_size, 3, size, size), dtype=torch.uint8, generator=generator)
    batch, context = cfg.data.batch_size, cfg.model.text.context_length
    tokens = torch.randint(1, 49406, (batch, context), generator=generator)
    # Captions of different lengths: end of text at a random position, zero padding after it, as tokenized.
    ends = torch.randint(2, context, (batch,), generator=generator)
    positions = torch.arange(context)
    tokens[positions > ends[:, None]] = 0
    tokens[positions == ends[:, None]] = 49407
    return {"images": images.to(device), "tokens": tokens.to(device)}


def step_flops(cfg) -> int:
    """FLOPs of one training step (forward + backward) of the model, counted on the meta device. The plain model
    (no apply_kernels) stands for every kernel choice: SwitchBack layers do the same multiply-adds in 8 bits as
    the standard linear layers they replace, and our attention kernels (triton_short, triton_tiled) SDPA's
    matmuls."""
    model = build_model(cfg.model, "meta")
    batch, size = cfg.data.batch_size, cfg.model.vision.image_size
    images = torch.empty(batch, 3, size, size, device="meta")
    tokens = torch.zeros(batch, cfg.model.text.context_length, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        image_features, text_features, logit_scale, *logit_bias = model(images, tokens)  # a bias with loss=siglip
        contrastive_loss(cfg.loss)(image_features, text_features, logit_scale,
                                   logit_bias[0] if logit_bias else None).backward()
    return counter.get_total_flops()


def matmul_ceiling_tflops(device: torch.device) -> float | None:
    """bf16 TFLOP/s of one large matmul: the ceiling a training step's share is measured against."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    seconds = median_seconds(lambda: a @ b, iters=20, warmup=5, device=device)
    return 2 * 8192**3 / seconds / 1e12


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, iters: int, warmup: int, device: torch.device) -> float:
    return median_seconds_and_host(fn, iters, warmup, device)[0]


def median_seconds_and_host(fn, iters: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """Medians of (call + device work, the call alone). The call alone is the host's time to queue the work: where
    it nears the first, the step is bound by the CPU (Python, launches), not the GPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times, host = [], []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], sorted(host)[len(host) // 2]


WINDOW_PARTS = 3  # --end-to-end: the window's rate is also given over this many consecutive parts of it


def time_steps(trainer: Trainer, args, device: torch.device, end_to_end: bool,
               ) -> tuple[float, float, float, list[float]]:
    """Seconds a step: the median, its host part, the pipelined mean; with `end_to_end` the median is raised to
    the window's mean if slower, and the window's parts' seconds a step come last (else an empty list)."""
    def step():
        trainer.train_step(next(trainer.loader))

    seconds, host_seconds = median_seconds_and_host(step, iters=args.steps, warmup=args.warmup, device=device)
    pipelined = pipelined_seconds(step, args.steps, device)
    if end_to_end:
        # A median hides loader stalls: the mean over a window of consecutive steps does not. Each worker builds
        # whole batches, so they arrive in rounds of `num_workers`, and the DataLoader holds up to 4 per worker,
        # filled while the model compiled. Steps first run for e2e_warmup_seconds to use up that head start;
        # the window then spans many rounds, so it measures the rate rather than its phase within one round.
        start = time.perf_counter()
        while time.perf_counter() - start < args.e2e_warmup_seconds:
            step()
        synchronize(device)
        # Each step's end on the host: the next batch is asked for there, so with the loader setting the pace the
        # host keeps near the GPU, and the parts show whether the rate held over the window or moved within it.
        ends = [time.perf_counter()]
        while len(ends) <= args.steps or ends[-1] - ends[0] < args.e2e_seconds:
            step()
            ends.append(time.perf_counter())
        synchronize(device)
        ends[-1] = time.perf_counter()
        steps = len(ends) - 1
        seconds = max(seconds, (ends[-1] - ends[0]) / steps)
        parts = min(WINDOW_PARTS, steps)
        cuts = [round(i * steps / parts) for i in range(parts + 1)]
        return seconds, host_seconds, pipelined, [(ends[b] - ends[a]) / (b - a) for a, b in zip(cuts, cuts[1:])]
    return seconds, host_seconds, pipelined, []


def pipelined_seconds(step, steps: int, device: torch.device) -> float:
    """The mean time of `steps` steps run back to back with one sync at the end, as train.py runs them (it syncs
    once per logging window). The median above syncs after every step, so each step starts on an idle GPU: where
    the host is slower than the GPU in stretches of a step, the GPU waits there, even if the host is faster over the
    whole step and would otherwise have run ahead."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def print_profile(trainer: Trainer, rows: int, device: torch.device, trace: str | None, gpu_only: bool = False,
                  ) -> None:
    """The kernels that take the time of three steps, most expensive first: what to speed up next. `trace`: also
    write the timeline (Chrome trace JSON, for gaps where the device waits for the host). `gpu_only`: record no
    CPU ops, whose recording slows the host enough to open gaps an unprofiled step does not have."""
    activity = torch.profiler.ProfilerActivity
    activities = ([] if gpu_only else [activity.CPU]) + ([activity.CUDA] if device.type == "cuda" else [])
    # Input shapes tell apart the launches of one kernel by layer (bench/kernel_table.py --callers --shapes).
    # Each step waits for the one before, as median_seconds_and_host times them, so the trace shows the idle
    # GPU at a step's start (bench/kernel_table.py --gaps) that the timed steps pay too.
    with torch.profiler.profile(activities=activities, record_shapes=not gpu_only) as profiler:
        for _ in range(3):
            trainer.train_step(next(trainer.loader))
            synchronize(device)
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60), flush=True)
    if trace:
        profiler.export_chrome_trace(trace)


def make_shards(directory: str, samples: int, pixels: int) -> str:
    """JPEG shards of `samples` generated images of `pixels` a side (a folder per set), written once."""
    directory = os.path.join(directory, f"n{samples}-px{pixels}")
    pattern = os.path.join(directory, "train", "train-{000000..000031}.tar")
    if not os.path.isfile(os.path.join(directory, "train", "sizes.json")):
        make_synthetic_shapes(pattern, os.path.join(directory, "eval", "eval-000000.tar"), samples, 32, size=pixels)
    return pattern


def shard_pixels(args, image_size: int) -> int:
    """--e2e-image-px, or by default larger than the model's input (256 for 224) so the loader really crops."""
    return args.e2e_image_px or image_size * 8 // 7


def e2e_shards(args, image_size: int) -> str:
    """The shards --end-to-end and --train-py read: --e2e-shards as given, or generated ones."""
    return args.e2e_shards or make_shards(args.shards_dir, args.samples, shard_pixels(args, image_size))


def preset_shards(args) -> str:
    """`e2e_shards` at the --model preset's image size: what train.py and OpenCLIP's loop read."""
    return e2e_shards(args, compose_config([f"model={args.model}"]).model.vision.image_size)


def check_warmup(cfg, warmup: int, device: torch.device) -> None:
    """With a recorded step (trainer.cuda_graph true, or auto on one GPU) the first WARMUP_STEPS steps run eagerly
    and the next one records the graph: timed steps must all be replays."""
    if resolve_fast_path(cfg, device, world_size=1).cuda_graph and warmup <= WARMUP_STEPS:
        raise ValueError(f"--warmup {warmup} would time ordinary steps and the capture of the recorded step, "
                         f"which records its graph at step {WARMUP_STEPS + 1}: pass --warmup {WARMUP_STEPS + 1} "
                         "or more")


def measure(args, overrides: list[str], end_to_end: bool, ceiling: float | None, trace: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="throughput-") as run_dir:  # the run's files are of no use afterwards
        return measure_in(run_dir, args, overrides, end_to_end, ceiling, trace)


def measure_in(run_dir: str, args, overrides: list[str], end_to_end: bool, ceiling: float | None,
               trace: str | None) -> dict:
    device = torch.device(args.device)
    base = [f"model={args.model}", "precision=bf16", "optim=adamw", "logger=none", f"data.batch_size={args.batch}",
            f"trainer.device={args.device}", "trainer.progress=false", f"trainer.run_dir={run_dir}"]
    # Compute-only steps take their batch from memory: data.generate=true tells preflight that the synthetic
    # shards need not exist (nothing here writes them, and the on-device loader never reads them).
    base += ["data=laion_wds", "data.mode=resampled"] if end_to_end else ["data=synthetic_shapes",
                                                                          "data.generate=true"]
    cfg = compose_config(base + [token for token in overrides if not token.startswith(MODULE_SETTING)])
    check_warmup(cfg, args.warmup, device)
    if end_to_end:
        cfg.data.shards = e2e_shards(args, cfg.model.vision.image_size)
        if args.e2e_shards:  # given shards may have no sizes.json, from which resampled reading takes its epoch
            cfg.data.samples_per_epoch = args.samples
        cfg.data.num_workers = cfg.data.num_workers or default_num_workers()
    dist_info = DistInfo(0, 1, 0, device)
    preflight(cfg, dist_info, run_dir)  # what train.py refuses, before any work
    parts = image_text_parts if end_to_end else functools.partial(
        image_text_parts, loader=itertools.repeat(on_device_batch(cfg, device)))
    trainer = Trainer(cfg, run_dir, dist_info, parts)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    seconds, host_seconds, pipelined, parts = time_steps(trainer, args, device, end_to_end)
    if args.profile:
        print_profile(trainer, args.profile, device, trace, args.profile_gpu_only)
    flops = step_flops(cfg)
    result = {
        "impl": "stableclip", "model": args.model, "batch": args.batch, "overrides": overrides,
        "end_to_end": end_to_end, "samples_per_s": args.batch / seconds, "step_ms": seconds * 1e3,
        "shards": cfg.data.shards if end_to_end else None,
        "shard_px": shard_pixels(args, cfg.model.vision.image_size) if end_to_end and not args.e2e_shards else None,
        "host_ms": host_seconds * 1e3,
        "pipelined_samples_per_s": args.batch / pipelined, "pipelined_step_ms": pipelined * 1e3,
        "tflops": flops / seconds / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        # The optimizer's own tensors (moments; bitsandbytes' 8-bit states and their block scales).
        "optimizer_state_gib": sum(t.numel() * t.element_size() for state in trainer.optimizer.state.values()
                                   for t in state.values() if torch.is_tensor(t)) / 2**30,
        # What preflight expects (src/trainer/memory.py), beside the peak it is a lower bound of.
        "estimate_gib": estimate_memory(cfg, 1).total / 2**30,
        # Times the caching allocator ran out, freed its cache and retried (warm-up and timed steps): each waits
        # for the GPU to finish.
        "alloc_retries": torch.cuda.memory_stats(device)["num_alloc_retries"] if device.type == "cuda" else None,
    }
    if ceiling:
        result["share_of_matmul_ceiling"] = result["tflops"] / ceiling
    if parts:
        result["window_parts_samples_per_s"] = [args.batch / part for part in parts]
    decoder = getattr(trainer.loader, "decoder", None)
    if decoder is not None:  # data.decode_on=device: a decode thread's wall time per batch, and by phase
        batches = max(1, decoder.batches)
        result["decode_ms"] = decoder.host_seconds / batches * 1e3
        result["decode_phase_ms"] = {phase: s / batches * 1e3 for phase, s in decoder.phase_seconds.items()}
    if end_to_end:
        trainer.loader.close()  # its workers and decode threads end before the next configuration runs
    trainer.metrics.close()
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


MODULE_SETTING = "py:"  # the prefix of a --set token that sets a module-level value, not a config key


def run_peer(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="peer-") as directory:
        out = os.path.join(directory, "peer.json")
        command = [sys.executable, args.peer, "--model", OPENCLIP_NAMES[args.model], "--batch", str(args.batch),
                   "--steps", str(args.steps), "--json", out]
        subprocess.run(command, check=True)
        with open(out) as f:
            return json.load(f)


def run_train_py(args) -> dict:
    """`--train-py`: the product's own command, `train.py model=M optim=stable_adamw data=laion_wds ...` with no
    performance flags, on the --end-to-end shards; its rate is what the training log reports (`train/samples_per_s`
    of metrics.jsonl: one figure per logging window, sync to sync), the median over the windows after the first
    half of the run (compilation, the graph's capture and the prefetched batches are in the first)."""
    shards = preset_shards(args)
    with tempfile.TemporaryDirectory(prefix="train-py-") as run_dir:  # its checkpoint is a whole model's
        command = [sys.executable, "train.py", f"model={args.model}", *args.train_py_set.split(),
                   "data=laion_wds", f"data.shards={shards}", f"data.batch_size={args.batch}", "data.mode=resampled",
                   *([f"data.samples_per_epoch={args.samples}"] if args.e2e_shards else []),
                   f"trainer.max_steps={args.train_py}", f"trainer.log_every={TRAIN_PY_LOG_EVERY}",
                   "trainer.ckpt_every=0", "trainer.progress=false", f"trainer.device={args.device}",
                   f"trainer.run_dir={run_dir}"]
        subprocess.run(command, check=True, cwd=ROOT)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    windows = {r["step"] // TRAIN_PY_LOG_EVERY: r["train/samples_per_s"] for r in records
               if "train/samples_per_s" in r and r["step"] >= args.train_py // 2}
    rates = sorted(windows.values())
    return {"impl": "train.py", "model": args.model, "batch": args.batch, "command": " ".join(command[1:]),
            "samples_per_s": rates[len(rates) // 2], "windows": len(rates), "min": rates[0], "max": rates[-1]}


TRAIN_PY_LOG_EVERY = 5
OPENCLIP_LOOP = os.path.join(ROOT, "bench", "peers", "openclip_train_loop.py")


def run_openclip_loop(args) -> dict:
    """`--openclip-loop`: OpenCLIP's `open_clip_train.main` on the --end-to-end shards (bench/peers/
    openclip_train_loop.py, which says how its rate is read)."""
    with tempfile.TemporaryDirectory(prefix="openclip-loop-") as directory:
        out = os.path.join(directory, "loop.json")
        command = [sys.executable, OPENCLIP_LOOP, "--shards", preset_shards(args),
                   "--samples", str(args.openclip_loop), "--batch", str(args.batch),
                   "--model", OPENCLIP_NAMES[args.model], "--device", args.device,
                   "--timeout", str(args.openclip_loop_timeout), "--json", out]
        if args.openclip_loop_pythonpath:
            command += ["--pythonpath", args.openclip_loop_pythonpath]
        subprocess.run(command, check=True, cwd=ROOT)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vit_b32", help="a configs/model/ name")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", action="append", default=[], metavar="OVERRIDES",
                        help="a configuration to measure, as space-separated Hydra overrides ('' = defaults); "
                             "repeat to measure several in one run")
    parser.add_argument("--end-to-end", action="store_true", help="also time each configuration on the real loader")
    parser.add_argument("--shards-dir", default=os.path.join(tempfile.gettempdir(), "throughput-shards"))
    parser.add_argument("--samples", type=int, default=20000,
                        help="images written for --end-to-end (with --e2e-shards: the epoch's length)")
    parser.add_argument("--e2e-image-px", type=int, help="--end-to-end: the written images' side (default: 8/7 of "
                                                          "the model's input, 256 px for 224; 768 for originals)")
    parser.add_argument("--e2e-shards", metavar="PATTERN",
                        help="--end-to-end and --train-py: read these shards (say, photographs at their own sizes) "
                             "instead of writing generated ones")
    parser.add_argument("--e2e-warmup-seconds", type=float, default=30.0,
                        help="--end-to-end: steps run this long before the window, to drain batches prefetched "
                             "while compiling")
    parser.add_argument("--e2e-seconds", type=float, default=30.0,
                        help="--end-to-end: the timed window (at least --steps steps)")
    parser.add_argument("--train-py", type=int, default=0, metavar="STEPS",
                        help="also run train.py itself for STEPS steps on the --end-to-end shards and report the rate "
                             "its log gives, against the best configuration's and the best end-to-end one's")
    parser.add_argument("--train-py-set", default="optim=stable_adamw",
                        help="--train-py's overrides besides model, data and run length (default: the card's "
                             "command, no performance flags)")
    parser.add_argument("--peer", help="path of OpenCLIP's openclip_step.py, run in this call")
    parser.add_argument("--openclip-loop", type=int, default=0, metavar="SAMPLES",
                        help="--end-to-end: also run OpenCLIP's training loop (open_clip_train.main) for one epoch of "
                             "SAMPLES on the same shards, after the rows, and give each end-to-end row's rate over "
                             "its rate")
    parser.add_argument("--openclip-loop-pythonpath", metavar="DIR",
                        help="--openclip-loop: a directory holding webdataset 0.2.86 (OpenCLIP's loader fails with "
                             "webdataset 1.x), put first on the loop's PYTHONPATH")
    parser.add_argument("--openclip-loop-timeout", type=float, default=300.0,
                        help="--openclip-loop: seconds before the loop is stopped; its rate is then read from the "
                             "windows it logged")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after timing, print the ROWS most expensive ops of three profiled steps")
    parser.add_argument("--profile-gpu-only", action="store_true",
                        help="with --profile: record kernels only, not CPU ops (closer to an unprofiled step's gaps)")
    parser.add_argument("--trace", metavar="DIR", help="with --profile: write each configuration's Chrome trace "
                                                        "(timeline) to DIR/N.json")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()
    if args.openclip_loop and not args.end_to_end:
        parser.error("--openclip-loop runs OpenCLIP's loop on the --end-to-end shards: add --end-to-end")
    if (args.peer or args.openclip_loop) and args.model not in OPENCLIP_NAMES:
        parser.error(f"--peer and --openclip-loop run OpenCLIP's {args.model}, which it does not name: use one of "
                     f"{', '.join(OPENCLIP_NAMES)}")
    widen_cuda_queues()  # as train.py does, before CUDA starts
    device = torch.device(args.device)
    if args.profile_gpu_only and device.type != "cuda":
        parser.error(f"--profile-gpu-only records CUDA kernels: it needs --device cuda, got {args.device}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as the peer script does
    ceiling = matmul_ceiling_tflops(device)
    rows = []
    peer = run_peer(args) if args.peer else None
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    for index, setting in enumerate(args.set or [""]):
        overrides = setting.split()
        assignments = [token[len(MODULE_SETTING):] for token in overrides if token.startswith(MODULE_SETTING)]
        for end_to_end in (False, True) if args.end_to_end else (False,):
            name = f"{index}{'-end-to-end' if end_to_end else ''}.json"
            trace = os.path.join(args.trace, name) if args.trace else None
            with module_settings(assignments):
                row = measure(args, overrides, end_to_end, ceiling, trace)
            if peer:
                row["vs_openclip"] = row["samples_per_s"] / peer["samples_per_s"]
                row["peak_vs_openclip"] = row["peak_gib"] / peer["peak_gib"] if row["peak_gib"] else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.train_py:
        row = run_train_py(args)
        # Against the best configuration (compute-only, the ceiling) and the best on the same loader.
        best = max(rows, key=lambda r: r["samples_per_s"])
        row.update(best_overrides=best["overrides"], best_end_to_end=best["end_to_end"],
                   vs_best=row["samples_per_s"] / best["samples_per_s"])
        loaded = [r["samples_per_s"] for r in rows if r["end_to_end"]]
        if loaded:
            row["vs_best_end_to_end"] = row["samples_per_s"] / max(loaded)
        if peer:
            row["vs_openclip"] = row["samples_per_s"] / peer["samples_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    loop = run_openclip_loop(args) if args.openclip_loop else None
    if loop:
        for row in rows:
            if row["impl"] == "train.py" or row["end_to_end"]:
                row["vs_openclip_loop"] = row["samples_per_s"] / loop["samples_per_s"]
        print(json.dumps({"openclip_loop": loop}), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "matmul_ceiling_tflops": ceiling, "peer": peer, "openclip_loop": loop,
              "rows": rows}
    if peer:
        print(json.dumps({"peer": peer}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
