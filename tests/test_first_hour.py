"""What a new user meets first: shard patterns as the README writes them, a folder of image and caption files,
the summary a finished run prints, dry runs and sweeps that leave nothing stray behind."""

import os
import shlex
import subprocess
import sys

from hydra.core.override_parser.overrides_parser import OverridesParser
from PIL import Image

from src.config import quote_brace_patterns
from tests.conftest import ROOT, run_train
from tests.test_shard_tools import gradient, run_script

TRAIN = os.path.join(ROOT, "train.py")


def test_brace_patterns_are_quoted_for_hydra_and_nothing_else_is():
    given = ["data.shards=/data/laion/{00000..41407}.tar", "data.eval_shards=pipe:curl -s http://h/{a,b}.tar",
             "data.shards='/x/{0..1}.tar'", "data.shards=/it's/{0..1}.tar", "model=vit_b32", "x=${y}",
             "data.sources=[{shards: a, weight: 1}]"]
    quoted = quote_brace_patterns(given)
    assert quoted[2:] == ["data.shards='/x/{0..1}.tar'", "data.shards='/it\\'s/{0..1}.tar'", *given[4:]]
    values = [o.value() for o in OverridesParser.create().parse_overrides(quoted[:5])]
    assert values == ["/data/laion/{00000..41407}.tar", "pipe:curl -s http://h/{a,b}.tar", "/x/{0..1}.tar",
                      "/it's/{0..1}.tar", "vit_b32"]


def test_the_readme_form_trains_and_the_summary_it_prints_resumes(shapes, tmp_path):
    """`data.shards='dir/{000..007}.tar'` as bash passes it (quotes removed) reaches the loader; the run ends with
    its directory, final evaluation, newest checkpoint and a resume command that runs as printed."""
    run_dir = tmp_path / "run"
    args = ["experiment=quickstart", f"data.shards={shapes['shards']}", f"data.eval_shards={shapes['eval_shards']}",
            "data.generate=false", "trainer.progress=false", "data.batch_size=8", "data.num_workers=0",
            "trainer.max_steps=2", "trainer.log_every=1", f"trainer.run_dir={run_dir}"]
    out = run_train(args).stdout
    assert f"run directory: {run_dir}" in out and "final evaluation: eval/zeroshot_top1=" in out
    assert f"newest checkpoint: {run_dir}/checkpoints/step_00000002" in out
    resume = next(line for line in out.splitlines() if line.startswith("resume it")).partition(": ")[2]
    assert f"data.shards='{shapes['shards']}'" in resume and resume.endswith("trainer.resume=latest")
    assert f"plot it: python scripts/plot_run.py {run_dir}" in out
    assert f"export it to OpenCLIP: python scripts/export_openclip.py {run_dir}/checkpoints/step_00000002" in out
    words = shlex.split(resume)  # as bash splits the printed line
    assert words[:2] == ["python", "train.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    again = subprocess.run([sys.executable, TRAIN, *words[2:], "trainer.max_steps=3"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_00000002 at step 2" in again.stdout + again.stderr
    assert f"newest checkpoint: {run_dir}/checkpoints/step_00000003" in again.stdout


def test_make_shards_packs_a_folder_of_image_and_caption_files(tmp_path):
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    Image.fromarray(gradient(40, 30, 3, 0)).save(folder / "cat.jpg")
    (folder / "cat.txt").write_text("a cat on a mat\n")
    Image.fromarray(gradient(30, 40, 3, 1)).save(folder / "sub" / "dog.png")
    (folder / "sub" / "dog.txt").write_text("a dog")
    Image.fromarray(gradient(30, 30, 3, 2)).save(folder / "nocaption.jpg")
    (folder / "notes.md").write_text("not an image")
    out = tmp_path / "shards"
    result = run_script("make_shards.py", "--images", str(folder), "--out", str(out), "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "wrote 2 samples in 1 shards; 1 failures" in result.stdout and "nocaption.jpg" in result.stderr
    assert f"data.shards='{out}/{{00000..00000}}.tar'" in result.stdout
    import webdataset as wds

    samples = list(wds.WebDataset(str(out / "00000.tar"), shardshuffle=False))
    captions = {s["txt"].decode(): json_path(s) for s in samples}
    assert captions == {"a cat on a mat": "cat.jpg", "a dog": os.path.join("sub", "dog.png")}
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = run_script("make_shards.py", "--images", str(empty), "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "no images" in refused.stderr and "--captions" in refused.stderr


def json_path(sample: dict) -> str:
    import json

    return json.loads(sample["json"])["source_path"]


def test_a_dry_run_leaves_no_directory_and_a_sweep_writes_under_outputs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dry = subprocess.run([sys.executable, TRAIN, "model=vit_tiny", "trainer.dry_run=true"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "model=vit_tiny" in dry.stdout, dry.stderr
    assert os.listdir(tmp_path) == []  # not even outputs/
    sweep = subprocess.run([sys.executable, TRAIN, "-m", "model=vit_tiny,vit_b32", "trainer.dry_run=true"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert sweep.returncode == 0, sweep.stderr
    assert "model=vit_tiny" in sweep.stdout and "model=vit_b32" in sweep.stdout
    assert os.listdir(tmp_path) == ["outputs"] and os.listdir(tmp_path / "outputs") == ["multirun"]
