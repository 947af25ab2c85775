"""The cost of exact gradient accumulation (trainer.accum_steps, src/trainer/grad_cache.py): the Trainer's step at a
global batch split into micro-batches against one step at the micro-batch size without accumulation.

    python bench/accum.py --model vit_l14 --batch 1024 --accum-steps 4 [--set "trainer.compile=true"] [--json out.json]

Both configurations run bench/throughput.py's compute-only measurement (the real Trainer, one on-device batch fed to
every step, bf16, the median step time, peak memory from torch.cuda.max_memory_allocated): `--batch` with
`trainer.accum_steps=N`, and `--batch / N` with accumulation off. Each prints one JSON line (throughput.py's row),
then a summary line: the time per sample of the accumulated step over the plain one (N - 1 extra micro-batch
forwards per step: about 1 + (N - 1) / N / 3 if a backward costs two forwards), and the ratio of peak memory.
TFLOP/s count the model's forward and backward only, not the recomputed forwards. `--device cpu --model vit_tiny`
makes it a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.throughput import matmul_ceiling_tflops, measure  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vit_l14", help="a configs/model/ name")
    parser.add_argument("--batch", type=int, default=1024, help="the global batch of the accumulated step")
    parser.add_argument("--accum-steps", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", default="", metavar="OVERRIDES",
                        help="Hydra overrides both configurations share, space-separated (e.g. trainer.compile=true)")
    parser.add_argument("--json", help="write both rows and the summary here")
    args = parser.parse_args()
    if args.accum_steps < 2 or args.batch % args.accum_steps:
        parser.error(f"--accum-steps {args.accum_steps} must be at least 2 and divide --batch {args.batch}")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as bench/throughput.py does
    ceiling = matmul_ceiling_tflops(device)
    shared = args.set.split()
    rows = []
    for batch, accum_steps in ((args.batch, args.accum_steps), (args.batch // args.accum_steps, 1)):
        settings = argparse.Namespace(model=args.model, batch=batch, device=args.device, steps=args.steps,
                                      warmup=args.warmup, profile=0, profile_gpu_only=False)
        row = measure(settings, [*shared, f"trainer.accum_steps={accum_steps}"], False, ceiling)
        row["accum_steps"] = accum_steps
        rows.append(row)
        print(json.dumps(row), flush=True)
    accumulated, plain = rows
    summary = {
        "model": args.model, "batch": args.batch, "accum_steps": args.accum_steps, "micro_batch": plain["batch"],
        "time_per_sample_ratio": plain["samples_per_s"] / accumulated["samples_per_s"],
        "peak_ratio": accumulated["peak_gib"] / plain["peak_gib"] if plain["peak_gib"] else None,
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
