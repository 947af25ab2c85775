import csv
import subprocess
import sys

import av
import numpy as np
import pytest

from src.tools.synthetic_videos import DIRECTIONS, make_synthetic_videos
from tests.conftest import ROOT


def decode(path) -> np.ndarray:
    with av.open(str(path)) as container:
        # One scaling thread: a threaded rescaler left in this test process would deadlock what it forks later.
        return np.stack([f.to_ndarray(format="rgb24", threads=1) for f in container.decode(video=0)])


def centroid(frame: np.ndarray, background: np.ndarray) -> np.ndarray:
    """Centre of the pixels that differ from the background colour (the moving shape)."""
    mask = np.abs(frame.astype(int) - background).sum(-1) > 60
    ys, xs = np.nonzero(mask)
    return np.array([xs.mean(), ys.mean()])


def test_clips_move_in_the_captioned_direction(tmp_path):
    table = make_synthetic_videos(str(tmp_path), clips=12, frames=12, size=48, seed=3)
    with open(table) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and len({r["direction"] for r in rows}) > 1
    for row in rows:
        assert row["direction"] in row["caption"]
        frames = decode(tmp_path / row["path"])
        assert frames.shape == (12, 48, 48, 3)
        background = np.median(frames[0].reshape(-1, 3), axis=0)  # the shape covers well under half
        motion = centroid(frames[-1], background) - centroid(frames[0], background)
        expected = np.array(DIRECTIONS[row["direction"]])
        assert motion @ expected > 20 and abs(motion @ expected[::-1]) < 5, (row, motion)


def test_cli_rejects_bad_arguments(tmp_path):
    out = subprocess.run([sys.executable, "scripts/make_synthetic_videos.py", str(tmp_path), "--size", "15"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "even size >= 16" in out.stderr


def test_library_rejects_empty_request(tmp_path):
    with pytest.raises(ValueError, match="clips >= 1"):
        make_synthetic_videos(str(tmp_path), clips=0)
