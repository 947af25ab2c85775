"""One home for every default: the YAML groups under configs/. The schema dataclasses in src/config.py hold no
values of their own, every schema key has a YAML line with a one-line comment, and an option states only what
differs from the base it pulls in."""

import dataclasses
import os
import re
import typing

import pytest
import yaml

from src.config import TrainConfig
from tests.conftest import CONFIGS

# Group (the schema's key in TrainConfig) -> the file that states every key of it once. The logger's options are
# selected several at once (logger=[wandb,tensorboard]), so their common values sit in the root config's `logger:`.
HOMES = {"model": "model/base.yaml", "data": "data/base.yaml", "optim": None, "precision": None,
         "trainer": "trainer/default.yaml", "logger": "train.yaml", "spikes": "spikes/default.yaml",
         "loss": "loss/clip.yaml", "eval": "eval/default.yaml"}
KEY_LINE = re.compile(r"^(\s*)([A-Za-z_]\w*):(.*)$")


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += schema_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def documented_keys(path: str) -> dict[str, str]:
    """Dotted key -> its comment, for every `key: value  # comment` line (and `key:  # comment` of a section)."""
    keys, stack = {}, []
    with open(path) as fh:
        for line in fh:
            match = KEY_LINE.match(line.rstrip("\n"))
            if not match or line.lstrip().startswith("#"):
                continue
            indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
            stack = [(i, k) for i, k in stack if i < indent]
            dotted = ".".join([k for _, k in stack] + [key])
            stack.append((indent, key))
            keys[dotted] = rest.split("#", 1)[1].strip() if "#" in rest else ""
    return keys


def group_files(group: str) -> list[str]:
    folder = os.path.join(CONFIGS, group)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".yaml"))


def flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if key == "defaults":
            continue
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def all_dataclasses(cls: type) -> list[type]:
    found = [cls]
    for hint in typing.get_type_hints(cls).values():
        for arg in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(arg):
                found += all_dataclasses(arg)
    return found


@pytest.mark.parametrize("cls", sorted(set(all_dataclasses(TrainConfig)), key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_schemas_state_no_default(cls):
    """A default in a dataclass would be a second home, free to disagree with the YAML one."""
    with_default = [f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert not with_default, f"{cls.__name__} states defaults for {with_default}: move them to configs/"


@pytest.mark.parametrize("group", HOMES)
def test_every_schema_key_has_a_documented_yaml_line(group):
    """Each key of the group's schema has a `key: value  # comment` line in its home file, or, in a group whose
    options share no base, in every option."""
    cls = typing.get_type_hints(TrainConfig)[group]
    files = [os.path.join(CONFIGS, HOMES[group])] if HOMES[group] else group_files(group)
    for path in files:
        documented = documented_keys(path)
        if HOMES[group] == "train.yaml":
            documented = {k.removeprefix(f"{group}."): v for k, v in documented.items() if k.startswith(f"{group}.")}
        missing = [k for k in schema_keys(cls) if k not in documented]
        undocumented = [k for k in schema_keys(cls) if documented.get(k) == ""]
        assert not missing, f"{path} has no line for {missing}"
        assert not undocumented, f"{path}: {undocumented} have no trailing `# comment`"


@pytest.mark.parametrize("group", [g for g, home in HOMES.items() if home and home.endswith("base.yaml")])
def test_options_state_only_what_differs_from_their_base(group):
    base_path = os.path.join(CONFIGS, group, "base.yaml")
    with open(base_path) as fh:
        base = flat(yaml.safe_load(fh))
    for path in group_files(group):
        if path == base_path:
            continue
        with open(path) as fh:
            option = yaml.safe_load(fh)
        assert "base" in option.get("defaults", []), f"{path} does not pull in {group}/base"
        unknown = [k for k in flat(option) if k not in base]
        restated = [k for k, v in flat(option).items() if k in base and base[k] == v]
        assert not unknown, f"{path} sets {unknown}, which {base_path} does not list"
        assert not restated, f"{path} restates {restated} with the base's own values: drop those lines"


def test_the_yaml_homes_hold_the_only_values_of_the_video_head():
    """data=video_wds without the experiment trains the documented model (the keys video_finetune once set)."""
    from tests.conftest import compose_config

    plain = compose_config(["data=video_wds", "data.frames=8"]).model.video
    preset = compose_config(["experiment=video_finetune"]).model.video
    assert plain == preset
    assert (plain.text_queries, plain.vision_trainable_blocks, plain.image_text_weight) == ("eot", 0, 1.0)


def test_logger_options_switch_on_only_their_own_sink():
    """Options merge several at once (logger=[wandb,tensorboard]): each sets only keys of the root's `logger:`,
    to values other than the root's, so that no option switches another one's sink back off."""
    with open(os.path.join(CONFIGS, "train.yaml")) as fh:
        root = yaml.safe_load(fh)["logger"]
    for path in group_files("logger"):
        with open(path) as fh:
            option = yaml.safe_load(fh) or {}
        assert all(key in root and root[key] != value for key, value in option.items()), path
