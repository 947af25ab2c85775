"""Train a CLIP model: `python train.py experiment=quickstart`, or under torchrun for several GPUs."""

import os
import sys

import hydra

from src.config import quote_brace_patterns, register_configs, unknown_override_keys

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
GROUPS = [name for name in os.listdir(CONFIGS) if os.path.isdir(os.path.join(CONFIGS, name))]

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg) -> None:
    from src.trainer import run  # imported once the command line is known to be sound: torch takes seconds

    run(cfg)


def refuse_unknown_keys(argv: list[str]) -> None:
    """Before Hydra: its error for a misspelled key suggests adding it with `+`, which the run would ignore."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    problems = [] if args.help or args.hydra_help else unknown_override_keys(args.overrides, GROUPS)
    if problems:
        raise SystemExit("error: " + "; ".join(dict.fromkeys(problems)))


if __name__ == "__main__":
    sys.argv[1:] = quote_brace_patterns(sys.argv[1:])
    refuse_unknown_keys(sys.argv[1:])
    from src.trainer import hydra_overrides_for_rank

    sys.argv += hydra_overrides_for_rank()
    main()
