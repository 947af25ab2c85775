"""Train a CLIP model: `python train.py experiment=quickstart`, or under torchrun for several GPUs."""

import sys

import hydra

from src.config import register_configs
from src.trainer import hydra_overrides_for_rank, run

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg) -> None:
    run(cfg)


if __name__ == "__main__":
    sys.argv += hydra_overrides_for_rank()
    main()
