"""One training step of the video model under sequence parallelism: LV-XAttn against the Ring baseline, same call.

    python bench/video_finetune.py [--model vit_b16] [--frames 128] [--batch 2] [--sp 2] [--steps 10]
        [--socket] [--json out.json]
    python bench/video_finetune.py --quick        # CPU smoke test (gloo, vit_tiny, 4 frames), run in CI

Spawns --sp processes (one per GPU, one sequence-parallel group, NCCL) and times the step the trainer runs
(the loss of `video_parts` = `video_text_loss` on the model's output, backward, fused AdamW) for
model.video.head_impl=lv_xattn and =ring on the same random clips: bf16 autocast, the whole image tower
trained, every caption token a query (text_queries=all, 77 per caption), recomputation on. With the defaults,
ViT-B/16 at 224 px, each rank encodes 64 of the 128 frames of a clip: 64 × 196 = 12.5K visual tokens per rank.
Reports the median step time, peak memory and the bytes each rank's cross-attention sent. `--socket` forces
NCCL onto its socket transport over loopback, a cluster-like link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from src.compose import compose_config  # noqa: E402
from src.config import ModelConfig  # noqa: E402
from src.data.image_text import ImageNormalizer  # noqa: E402
from src.kernels.dispatch import apply_kernels  # noqa: E402
from src.models.cross_attention import ENGINES  # noqa: E402
from src.models.video_clip import build_video_model  # noqa: E402
from src.parallel.distributed import free_port  # noqa: E402
from src.parallel.mesh import Mesh  # noqa: E402
from src.trainer.video_trainer import video_text_loss  # noqa: E402

IMPLS = ("lv_xattn", "ring")
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}


def model_config(name: str) -> ModelConfig:
    cfg = compose_config([f"model={name}"]).model
    cfg.video.text_queries = "all"
    cfg.video.vision_trainable_blocks = -1
    cfg.video.image_text_weight = 0.0
    return cfg


def time_impl(args, impl: str, mesh: Mesh, device: torch.device) -> dict:
    cfg = model_config(args.model)
    cfg.video.head_impl = impl
    torch.manual_seed(0)
    model = apply_kernels(build_video_model(cfg, args.frames, device), cfg)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                  fused=device.type == "cuda")
    generator = torch.Generator(device="cpu").manual_seed(1)
    size = cfg.vision.image_size
    share = mesh.frames(args.frames)
    clips = torch.randint(0, 256, (args.batch, args.frames, 3, size, size), dtype=torch.uint8, generator=generator)
    frames = ImageNormalizer(device)(clips[:, share].to(device))
    tokens = torch.randint(1, 49406, (args.batch, cfg.text.context_length), generator=generator)
    tokens[:, 0], tokens[:, -1] = 49406, 49407
    tokens = tokens.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    counter = ENGINES[impl].counter

    def step() -> None:
        with autocast:
            out = ddp(frames, tokens, first_frame=share.start, group=mesh.sp_group)
            loss = video_text_loss(out, cfg.video, mesh.dp_group, mesh.sp_group)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    counter.reset()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    tokens_per_frame = (size // cfg.vision.patch_size) ** 2 if cfg.video.frame_tokens == "patches" else 1
    return {
        "impl": impl, "step_ms": statistics.median(times), "step_ms_all": times,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "head_bytes_sent": (counter.forward + counter.backward) // args.steps,
        "visual_tokens_per_rank": (share.stop - share.start) * tokens_per_frame,
        "queries_per_clip": args.batch * cfg.text.context_length,
    }


def worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.socket:
        os.environ.update(SOCKET_ENV)
    cuda = not args.quick
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.sp,
                            device_id=device if cuda else None)
    mesh = Mesh.build(args.sp, args.sp)
    results = [time_impl(args, impl, mesh, device) for impl in IMPLS]
    peaks = [torch.tensor([r["peak_gib"] or 0.0, r["step_ms"]], device=device) for r in results]
    for peak in peaks:  # the slowest rank's step and the largest peak are the figures that matter
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    for result, peak in zip(results, peaks):
        result["step_ms_max_rank"] = peak[1].item()
        if cuda:
            result["peak_gib"] = peak[0].item()
    if rank == 0:
        report = {"model": args.model, "frames": args.frames, "batch": args.batch, "sp": args.sp,
                  "link": "socket" if args.socket else "default", "device": torch.cuda.get_device_name(0) if cuda
                  else "cpu", "torch": torch.__version__, "results": results}
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vit_b16", help="configs/model preset of the CLIP towers")
    parser.add_argument("--frames", type=int, default=128, help="frames per clip, split over the --sp ranks")
    parser.add_argument("--batch", type=int, default=2, help="clips per step (each scored against every caption)")
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel ranks = processes (one GPU each)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--socket", action="store_true", help="NCCL over loopback sockets (a cluster-like link)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: gloo, vit_tiny, 4 frames, 2 steps")
    parser.add_argument("--json", help="write the report here as well")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.frames, args.batch, args.steps, args.warmup = "vit_tiny", 4, 2, 2, 1
    elif torch.cuda.device_count() < args.sp:
        parser.error(f"--sp {args.sp} needs {args.sp} GPUs, found {torch.cuda.device_count()}: use --quick on a CPU")
    out = args.json or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"video_finetune_{os.getpid()}.json")
    mp.spawn(worker, args=(args, free_port(), out), nprocs=args.sp)
    with open(out) as f:
        report = json.load(f)
    print(f"{report['model']}, {report['frames']} frames ({report['results'][0]['visual_tokens_per_rank']} visual "
          f"tokens per rank), batch {report['batch']}, sp {report['sp']}, link {report['link']}, {report['device']}")
    print(f"{'impl':10} {'step ms (median)':>17} {'slowest rank':>13} {'peak GiB':>9} {'head MB sent/step':>18}")
    for r in report["results"]:
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"{r['impl']:10} {r['step_ms']:17.1f} {r['step_ms_max_rank']:13.1f} {peak:>9} "
              f"{r['head_bytes_sent'] / 1e6:18.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
