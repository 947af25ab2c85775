"""make_shards / inspect_shards on a real image folder: good images of several modes and sizes, and bad ones."""

import csv
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from src.data.loader import TrainLoader
from src.data.shards import expand_shards
from src.tools.shard_inspect import inspect_shards
from src.tools.shard_writer import InputError, encode_image, make_shards, read_captions
from tests.conftest import compose_config
from tests.test_data import png_bomb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = {"corrupt.jpg": "failed_to_decode", "truncated.jpg": "failed_to_decode", "missing.jpg": "failed_to_read"}


def gradient(width: int, height: int, channels: int, seed: int) -> np.ndarray:
    """A smooth image with some noise: distinct per seed, and small as JPEG even when large."""
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.linspace(0, 150, height), np.linspace(0, 100, width))
    pixels = ramp[..., None] + rng.integers(0, 6, (height, width, channels)) + rng.integers(0, 100, channels)
    return pixels.clip(0, 255).astype(np.uint8)


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, os.path.join("scripts", name), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[str, list[dict]]:
    """An image folder and its caption rows, ordered so that every 3-row shard keeps at least 2 images."""
    root = tmp_path_factory.mktemp("images")
    (root / "sub").mkdir()
    Image.fromarray(gradient(64, 48, 3, 0)).save(root / "rgb.jpg", quality=90)
    rgba = gradient(40, 40, 4, 1)
    rgba[:20, :, 3] = 0  # top half fully transparent
    Image.fromarray(rgba).save(root / "rgba.png")
    Image.fromarray(gradient(30, 50, 1, 2)[..., 0]).save(root / "gray.png")
    Image.fromarray(gradient(1500, 1000, 3, 3)).save(root / "big.jpg", quality=90)
    Image.fromarray(gradient(33, 21, 3, 4)).convert("P").save(root / "sub" / "palette.gif")
    Image.fromarray(gradient(80, 20, 3, 5)).save(root / "sub" / "wide.webp")
    Image.fromarray(gradient(24, 36, 1, 6)[..., 0].astype(np.uint16) * 250).save(root / "gray16.png")
    Image.fromarray(gradient(45, 27, 3, 7)).convert("CMYK").save(root / "cmyk.jpg")
    (root / "corrupt.jpg").write_bytes(np.random.default_rng(8).bytes(3000))
    noisy = io.BytesIO()
    Image.fromarray(np.random.default_rng(9).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(noisy, "JPEG")
    (root / "truncated.jpg").write_bytes(noisy.getvalue()[: len(noisy.getvalue()) * 6 // 10])
    paths = ["rgb.jpg", "rgba.png", "corrupt.jpg", "gray.png", "big.jpg", "missing.jpg", "sub/palette.gif",
             "truncated.jpg", str(root / "sub" / "wide.webp"), "rgb.jpg", "gray16.png", "cmyk.jpg"]
    if importlib.util.find_spec("skimage"):
        from skimage import data

        for name, ext in (("astronaut", "png"), ("coffee", "jpg"), ("chelsea", "webp")):
            Image.fromarray(getattr(data, name)()).save(root / f"{name}.{ext}")
            paths.append(f"{name}.{ext}")
    rows = [{"path": p, "caption": f"photo {i}: {os.path.basename(p)}, \"quoted\" café ☕", "license": f"cc-{i}"}
            for i, p in enumerate(paths)]
    rows[9]["caption"] = ""  # an empty caption: the row fails, the image is not packed with another caption
    return str(root), rows


def write_table(rows: list[dict], path) -> str:
    if str(path).endswith(".jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if str(path).endswith(".tsv") else ",")
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def read_shard(path: str) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


def pattern_of(out: str) -> str:
    with open(os.path.join(out, "sizes.json")) as f:
        return f"{out}/{{00000..{len(json.load(f)) - 1:05d}}}.tar"


def check_packed(out: str, root: str, rows: list[dict], shard_size: int) -> dict[str, dict[str, bytes]]:
    """Every packed sample is its own row's image and caption; failures are listed and not packed."""
    row_index = lambda key: int(key[:5]) * shard_size + int(key[5:])
    failures = [json.loads(line) for line in open(os.path.join(out, "failures.jsonl"))]
    expected = {i: BAD.get(r["path"], "failed_no_caption") for i, r in enumerate(rows)
                if r["path"] in BAD or not r["caption"]}
    assert {row_index(f["key"]): f["kind"] for f in failures} == expected
    assert all(f["source_path"] == rows[row_index(f["key"])]["path"] for f in failures)
    with open(os.path.join(out, "sizes.json")) as f:
        sizes = json.load(f)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".tar"))
    assert list(sizes) == shards == [f"{i:05d}.tar" for i in range(-(-len(rows) // shard_size))]
    packed = {}
    for shard, name in enumerate(shards):
        samples = read_shard(os.path.join(out, name))
        with open(os.path.join(out, f"{shard:05d}_stats.json")) as f:
            stats = json.load(f)
        first = shard * shard_size
        count = len(rows[first : first + shard_size])
        assert stats["count"] == count and stats["successes"] == sizes[name] == len(samples)
        assert stats["failed_to_decode"] == sum(first <= i < first + count for i, k in expected.items()
                                                if k == "failed_to_decode")
        for key, sample in samples.items():
            assert len(key) == 9 and key.isdigit() and key.startswith(f"{shard:05d}")
            row = rows[row_index(key)]
            meta = json.loads(sample["json"])
            assert meta["source_path"] == row["path"] and meta["key"] == key and meta["license"] == row["license"]
            assert sample["txt"].decode() == meta["caption"] == row["caption"]
            image_ext = next(e for e in ("jpg", "png", "webp") if e in sample)
            with Image.open(io.BytesIO(sample[image_ext])) as img:
                assert img.size == (meta["width"], meta["height"])
            with Image.open(os.path.join(root, row["path"])) as source:
                assert source.size == (meta["original_width"], meta["original_height"])
            packed[row["path"]] = sample
    assert len(packed) == len(rows) - len(expected)  # distinct paths: the failed rgb.jpg row is the duplicate
    return packed


@pytest.mark.parametrize("ext", ["csv", "tsv", "jsonl"])
def test_make_shards_keeps_each_caption_with_its_image(images, tmp_path, ext):
    root, rows = images
    table = write_table(rows, tmp_path / f"captions.{ext}")
    summary = make_shards(read_captions(table), root, str(tmp_path / "out"), shard_size=3, workers=2)
    packed = check_packed(str(tmp_path / "out"), root, rows, shard_size=3)
    assert summary.samples == len(packed) and summary.shards > 3
    assert summary.pattern == str(tmp_path / "out" / f"{{00000..{summary.shards - 1:05d}}}.tar")
    # Without --max-size, JPEG/PNG/WEBP keep their bytes; GIF is re-encoded as JPEG.
    assert packed["rgba.png"]["png"] == open(os.path.join(root, "rgba.png"), "rb").read()
    assert "jpg" in packed["sub/palette.gif"]


def test_same_input_gives_identical_shards(images, tmp_path):
    root, rows = images
    rows = read_captions(write_table(rows, tmp_path / "captions.csv"))
    for out in ("a", "b"):
        make_shards(rows, root, str(tmp_path / out), shard_size=4, workers=1)
    for name in sorted(os.listdir(tmp_path / "a")):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.fixture(scope="module")
def cli_packed(images, tmp_path_factory) -> tuple[str, subprocess.CompletedProcess]:
    root, rows = images
    tmp = tmp_path_factory.mktemp("cli")
    table = write_table(rows, tmp / "captions.csv")
    out = str(tmp / "shards")
    result = run_script("make_shards.py", "--images", root, "--captions", table, "--out", out, "--shard-size", "3",
                        "--workers", "2", "--max-size", "256")
    assert result.returncode == 0, result.stderr
    return out, result


def test_make_shards_cli_downscales_and_reports(images, cli_packed):
    root, rows = images
    out, result = cli_packed
    packed = check_packed(out, root, rows, shard_size=3)
    big = json.loads(packed["big.jpg"]["json"])
    assert (big["width"], big["height"], big["original_width"]) == (256, 171, 1500)
    assert packed["gray.png"]["png"] == open(os.path.join(root, "gray.png"), "rb").read()  # small: kept
    for path in BAD:
        assert path in result.stderr
    shards = -(-len(rows) // 3)
    assert f"wrote {len(packed)} samples in {shards} shards; 4 failures" in result.stdout
    pattern = f"{out}/{{00000..{shards - 1:05d}}}.tar"
    assert f"train with: python train.py data=laion_wds data.shards='{pattern}'" in result.stdout


def test_trainer_loader_reads_the_shards(cli_packed):
    cfg = replace(compose_config(["data=laion_wds"]).data, name="t", shards=pattern_of(cli_packed[0]), batch_size=4,
                  num_workers=0, shuffle_buffer=1)
    batch = next(iter(TrainLoader(cfg, image_size=32, context_length=16, seed=0)))
    assert batch["images"].shape == (4, 3, 32, 32) and batch["tokens"].shape == (4, 16)


def test_jpeg_reencoding_converts_modes():
    def reencode(image: Image.Image) -> Image.Image:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        data, ext, _ = encode_image(buffer.getvalue(), max_size=image.width - 1)
        assert ext == "jpg"
        return Image.open(io.BytesIO(data))

    rgba = np.zeros((20, 20, 4), np.uint8)  # fully transparent black
    assert reencode(Image.fromarray(rgba)).getpixel((10, 10)) == (255, 255, 255)
    gray16 = reencode(Image.fromarray(np.full((20, 20), 60000, np.uint16)))
    assert gray16.mode == "L" and abs(gray16.getpixel((10, 10)) - 60000 // 256) <= 2


@pytest.mark.parametrize("name, text, message", [
    ("c.csv", "path,text\na.jpg,hi\n", r"line 1 \(header\) has no column 'caption'"),
    ("c.tsv", "path\tcaption\n", "no captions"),
    ("c.jsonl", '{"path": "a.jpg", "caption": "x"}\n{"path": "b.jpg"}\n', "line 2 has no column 'caption'"),
    ("c.jsonl", '{"path": "a.jpg", "caption": "x"}\n{"path": \n', "c.jsonl:2: malformed JSON line"),
    ("c.txt", "a.jpg hi\n", "unknown captions format"),
    ("c.csv", None, "cannot read captions"),
])
def test_bad_caption_tables_name_file_line_and_column(tmp_path, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(InputError, match=message) as error:
        read_captions(str(tmp_path / name))
    assert str(tmp_path / name) in str(error.value)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    with pytest.raises(InputError, match="pip install pyarrow"):
        read_captions(str(tmp_path / "captions.parquet"))


def test_make_shards_refuses_bad_sizes_and_stale_shards(images, tmp_path):
    root, rows = images
    rows = read_captions(write_table(rows[:2], tmp_path / "captions.csv"))
    with pytest.raises(InputError, match="--shard-size"):
        make_shards(rows, root, str(tmp_path / "out"), shard_size=10_001)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "00007.tar").write_bytes(b"")
    with pytest.raises(InputError, match="00007.tar"):
        make_shards(rows, root, str(tmp_path / "out"), workers=1)


def test_make_shards_cli_missing_column_exits_2(images, tmp_path):
    root, rows = images
    table = write_table([{"path": r["path"], "text": r["caption"]} for r in rows], tmp_path / "captions.csv")
    result = run_script("make_shards.py", "--images", root, "--captions", table, "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert "'caption'" in result.stderr and table in result.stderr and "line 1" in result.stderr


def test_inspect_clean_shards(cli_packed):
    out = cli_packed[0]
    sizes = json.load(open(os.path.join(out, "sizes.json")))
    result = run_script("inspect_shards.py", pattern_of(out), "--json", "--workers", "1")
    assert result.returncode == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["clean"] and report["shards"] == len(sizes) and report["samples"] == sum(sizes.values())
    assert [s["samples"] for s in report["per_shard"]] == list(sizes.values())
    assert report["extensions"]["txt"] == report["extensions"]["json"] == report["samples"]
    assert report["caption_words"]["min"] >= 3 and report["caption_chars"]["max"] > report["caption_chars"]["min"]


def test_inspect_finds_truncated_shards_and_corrupt_images(cli_packed, tmp_path):
    out = str(tmp_path / "broken")
    shutil.copytree(cli_packed[0], out)
    pattern = pattern_of(out)
    shard = lambda i: os.path.join(out, f"{i:05d}.tar")
    data = open(shard(1), "rb").read()
    open(shard(1), "wb").write(data[: len(data) // 2])  # cut inside a member
    with tarfile.open(shard(3)) as tar:
        last = tar.getmembers()[-1].offset
    open(shard(3), "r+b").truncate(last)  # cut exactly before a member: tarfile alone sees a complete tar
    with tarfile.open(shard(2)) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    first = members[0][0]  # the first sample's image (members are written jpg, json, txt)
    assert first.name.endswith(".jpg")
    garbled, members[0] = first.name.split(".")[0], (first, b"\xff\xd8 not an image")
    first.size = len(members[0][1])
    with tarfile.open(shard(2), "w") as tar:
        for member, content in members:
            tar.addfile(member, io.BytesIO(content))

    report = inspect_shards(expand_shards(pattern), max_image_pixels=2**26)
    kinds = {(os.path.basename(p["shard"]), p["kind"]) for p in report["problems"]}
    assert {("00001.tar", "unreadable_shard"), ("00003.tar", "unreadable_shard"), ("00001.tar", "count_mismatch"),
            ("00002.tar", "corrupt_image")} <= kinds
    assert {p["key"] for p in report["problems"] if p["kind"] == "corrupt_image"} == {garbled}
    assert not any(name == "00000.tar" for name, _ in kinds)

    result = run_script("inspect_shards.py", pattern, "--workers", "1")
    assert result.returncode == 1
    assert "00001.tar: unreadable_shard" in result.stdout and f"00002.tar key {garbled}: corrupt_image" in result.stdout


def test_inspect_flags_a_decompression_bomb_without_decoding_it(cli_packed, tmp_path):
    """The 12000 x 12000 PNG training skips as oversized_image is reported as such, from its header: the script
    stays fast and small. A lower --max-image-pixels flags ordinary images too."""
    out = str(tmp_path / "bomb")
    shutil.copytree(cli_packed[0], out)
    shard = os.path.join(out, "00000.tar")
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    first, bomb = members[0][0], png_bomb(12000, 12000)
    members[0], first.size = (first, bomb), len(bomb)
    with tarfile.open(shard, "w") as tar:
        for member, content in members:
            tar.addfile(member, io.BytesIO(content))

    result = run_script("inspect_shards.py", pattern_of(out), "--json", "--workers", "1")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["problem_counts"] == {"oversized_image": 1}
    [problem] = report["problems"]
    assert problem["key"] == first.name.split(".")[0] and "12000x12000 = 144000000 pixels" in problem["detail"]
    assert "data.max_image_pixels=67108864" in problem["detail"]
    small = run_script("inspect_shards.py", pattern_of(out), "--json", "--workers", "1", "--max-image-pixels", "100")
    assert json.loads(small.stdout)["problem_counts"]["oversized_image"] == report["samples"]


def test_inspect_counts_an_empty_tar_against_the_count_recorded_for_it(cli_packed, tmp_path):
    """An empty tar (valid, or 0 bytes) whose sizes.json entry promises samples is a count mismatch, also when
    sizes.json names only some of the inspected shards."""
    out = str(tmp_path / "empty")
    shutil.copytree(cli_packed[0], out)
    sizes = json.load(open(os.path.join(out, "sizes.json")))
    tarfile.open(os.path.join(out, "00000.tar"), "w").close()
    open(os.path.join(out, "00001.tar"), "wb").close()
    json.dump({name: sizes[name] for name in ("00000.tar", "00001.tar")}, open(os.path.join(out, "sizes.json"), "w"))
    for name in sizes:  # so that sizes.json alone, naming 2 of the shards, gives the counts
        os.remove(os.path.join(out, name.replace(".tar", "_stats.json")))
    report = inspect_shards(expand_shards(pattern_of(cli_packed[0]).replace(cli_packed[0], out)), 2**26)
    mismatches = {os.path.basename(p["shard"]): p["detail"] for p in report["problems"]
                  if p["kind"] == "count_mismatch"}
    assert mismatches == {name: f"0 samples, sizes.json says {sizes[name]}" for name in ("00000.tar", "00001.tar")}
    assert not report["clean"]


def test_inspect_pattern_matching_nothing_exits_2(tmp_path):
    result = run_script("inspect_shards.py", f"{tmp_path}/{{00000..00003}}.tar")
    assert result.returncode == 2 and "matched no files" in result.stderr


def test_photo_shards_every_sample_once_per_epoch_across_2_ranks_x_2_workers(cli_packed):
    """Shards of real photographs made by make_shards.py, uneven (3 rows each, some rows failed): readers get
    different sample counts, and each still reads every sample of its shards exactly once per epoch."""
    pattern = pattern_of(cli_packed[0])
    expected = {k for url in expand_shards(pattern) for k in shard_sample_keys(url)}
    seen: dict[int, list[str]] = {}
    for rank in range(2):
        cfg = replace(compose_config(["data=laion_wds"]).data, name="t", shards=pattern, batch_size=2, num_workers=2,
                      shuffle_buffer=2)
        loader = TrainLoader(cfg, image_size=32, context_length=16, seed=0, rank=rank, world_size=2)
        for _ in range(3 * len(expected)):  # batch 1 per rank: the batch's position is its sample's epoch
            batch = next(loader)
            seen.setdefault(batch["position"]["epoch"], []).extend(batch["keys"])
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == sorted(expected), epoch


def shard_sample_keys(url: str) -> set[str]:
    with tarfile.open(url) as tar:
        return {m.name.split(".")[0] for m in tar.getmembers() if m.name.endswith(".txt")}
