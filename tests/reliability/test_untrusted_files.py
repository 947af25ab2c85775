"""Guarantee 9: files are data, never code. A checkpoint whose pickle would run a command when unpickled is refused
(checkpoints load with weights_only=True), and pickles inside a shard are never unpickled by the reader. Each
malicious file is first shown to be live: unpickled the unsafe way, it does create its marker file."""

import io
import os
import pickle
import subprocess
import sys
import tarfile

import torch
from webdataset.autodecode import basichandlers

from src.data.loader import TrainLoader
from src.data.shards import expand_shards
from src.tools.synthetic_shapes import make_synthetic_shapes
from tests.conftest import compose_config
from tests.reliability.harness import LEDGER, Training, run_args


class Bomb:
    """Unpickling this runs `touch marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused(shapes, tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    step = run_dir / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    for stem in ("model", "train_state", "rank_0"):
        torch.save(Bomb(marker), step / f"{stem}.pt")
    unsafe = f"import torch; torch.load({str(step / 'model.pt')!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", unsafe], check=True)
    assert marker.exists()  # live
    marker.unlink()

    training = Training(run_args(shapes, run_dir), tmp_path / "log.txt")
    assert training.wait() == 1
    assert f"refusing to load {step / 'model.pt'}: it holds objects other than tensors" in training.output()
    assert not marker.exists()
    LEDGER.append(("9 malicious checkpoint", 1, 0, 0))


def test_pickles_in_a_shard_are_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    make_synthetic_shapes(str(tmp_path / "clean" / "train-{000000..000000}.tar"),
                          str(tmp_path / "eval" / "eval-{000000..000000}.tar"), train_samples=8, eval_samples=4)
    bomb = pickle.dumps(Bomb(marker))
    shard = tmp_path / "train-000000.tar"
    with tarfile.open(tmp_path / "clean" / "train-000000.tar") as clean, tarfile.open(shard, "w") as out:
        for member in clean.getmembers():
            out.addfile(member, clean.extractfile(member))
            if member.name.endswith(".txt"):  # each sample also gets members webdataset would unpickle
                for ext in ("pyd", "pickle"):
                    info = tarfile.TarInfo(member.name.removesuffix("txt") + ext)
                    info.size = len(bomb)
                    out.addfile(info, io.BytesIO(bomb))
    basichandlers("pyd", bomb)
    assert marker.exists()  # live: webdataset's decoder runs it
    marker.unlink()

    cfg = compose_config(["experiment=quickstart", f"data.shards={shard}", "data.num_workers=0", "data.batch_size=4"])
    loader = TrainLoader(cfg.data, image_size=32, context_length=16, seed=0)
    batches = [next(loader) for _ in range(2)]
    assert all(len(b["keys"]) == 4 for b in batches) and not loader.bad_counts()
    assert not marker.exists()
    LEDGER.append(("9 shard members holding pickles", 16, 1, 0))


def test_a_pipe_url_runs_nothing_without_allow_pipe(shapes, tmp_path):
    """A shared configuration whose shards are `pipe:` commands runs none of them unless data.allow_pipe=true:
    the run stops in preflight, naming the key, before any loader worker starts."""
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    command = f"pipe:touch {marker}; cat {expand_shards(shapes['shards'])[0]}"
    training = Training(run_args({**shapes, "shards": command}, run_dir), tmp_path / "log.txt")
    assert training.wait() == 1
    assert f"data.shards holds {command!r}, a pipe: URL, which runs a shell command" in training.output()
    assert "set data.allow_pipe=true if you trust" in training.output()
    assert not marker.exists() and not (run_dir / "checkpoints").exists()
    LEDGER.append(("9 pipe: URL without data.allow_pipe", 1, 0, 0))
