"""Write the weights' EMA of a checkpoint (a run with trainer.ema_decay set) as a model.pt of its own.

    python scripts/export_ema.py RUN/checkpoints/step_N OUT/model.pt

The checkpoint's ema.pt is verified against its manifest first. The file written holds the model's state dict
(our layout, layer-scale included), which `model.init_from=OUT/model.pt` takes; for an OpenCLIP model file, use
`scripts/export_openclip.py CHECKPOINT -o model.safetensors --ema`. Exit code 0 on success, 1 when the
checkpoint has no EMA or fails verification.
"""

from __future__ import annotations

import argparse
import logging
import sys

from src.trainer.checkpoint import CheckpointError
from src.trainer.ema import export_ema


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoints/step_N directory of a run with trainer.ema_decay set")
    parser.add_argument("out", help="the model.pt to write")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export_ema(args.checkpoint, args.out)
    except (FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
