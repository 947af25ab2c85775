import io
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import struct
import tarfile
import threading
import time
import warnings
import zlib
from dataclasses import replace

import pytest
import torch
from PIL import Image

from src.config import DataConfig, SourceConfig
from src.data import reader as reader_module
from src.data.image_text import OversizedImage, Preprocess
from src.data.loader import TrainLoader, default_num_workers, eval_batches
from src.data.processes import CommandStream, worker_start_method
from src.data.shards import expand_shards, read_sizes, shards_for_reader
from src.data.video_text import decode_clip
from src.parallel.distributed import DistInfo
from src.tools.synthetic_shapes import draw_sample, where
from src.trainer.preflight import ConfigurationError, preflight
from src.trainer.run import ensure_synthetic_data
from tests.conftest import compose_config, proc_stat


def data_config(shards: str | None, batch_size: int, num_workers: int, shuffle_buffer: int = 50, **kw) -> DataConfig:
    return replace(compose_config(["data=laion_wds"]).data, name="test", shards=shards, batch_size=batch_size,
                   num_workers=num_workers, shuffle_buffer=shuffle_buffer, **kw)


def loader(shapes, batch_size=100, num_workers=2, rank=0, world_size=2, seed=0) -> TrainLoader:
    cfg = data_config(shapes["shards"], batch_size, num_workers)
    return TrainLoader(cfg, image_size=32, context_length=16, seed=seed, rank=rank, world_size=world_size)


def test_every_sample_once_per_epoch_across_ranks_and_workers(shapes):
    # 800 samples in 8 shards; 2 ranks x 2 workers = 4 readers of 200 samples; 50 per rank-batch.
    per_epoch = []
    ranks = [iter(loader(shapes, rank=r)) for r in range(2)]
    for _ in range(2):
        keys = [k for it in ranks for _ in range(8) for k in next(it)["keys"]]
        assert len(keys) == 800 and len(set(keys)) == 800
        per_epoch.append(keys)
    assert set(per_epoch[0]) == set(per_epoch[1]) and per_epoch[0] != per_epoch[1]


def test_a_batchs_reader_state_crosses_the_dataloader_unwalked(shapes):
    """The worker's bookkeeping rides in one ReaderState, which the DataLoader's hooks (as_built, then pinning)
    hand on as the same object instead of rebuilding the position's buffer of tags; TrainLoader then gives the
    batch its role, position and bad counts as entries again, and its state_dict holds that position."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from src.data.loader import ReaderState, TrainStream, as_built

    it = loader(shapes, world_size=1, num_workers=0, batch_size=16)
    stream = TrainStream(it.sources, it.weights, it.cfg, positions=[None], role_offset=0, bad_counts=[{}],
                         **it.kwargs)
    item = next(iter(stream))
    assert isinstance(item["reader"], ReaderState) and len(item["reader"].position["buffer"]) == 50
    bookkeeping = {k: v for k, v in item.items() if not isinstance(v, torch.Tensor)}  # no pinning without CUDA
    assert as_built(item) is item and pin_memory(bookkeeping)["reader"] is item["reader"]
    batch = next(it)
    assert "reader" not in batch and batch["role"] == 0 and batch["keys"] == item["keys"]
    assert batch["position"] == item["reader"].position == it.state_dict()["positions"][0]


def test_shard_order_is_deterministic_and_changes_with_epoch():
    shards = [f"s{i}" for i in range(12)]
    a = [shards_for_reader(shards, seed=1, epoch=0, reader=r, num_readers=3) for r in range(3)]
    b = [shards_for_reader(shards, seed=1, epoch=0, reader=r, num_readers=3) for r in range(3)]
    c = [shards_for_reader(shards, seed=1, epoch=1, reader=r, num_readers=3) for r in range(3)]
    assert a == b and a != c and sorted(sum(a, [])) == sorted(shards)


def test_batches_are_uint8_images_and_tokens(shapes):
    batch = next(iter(loader(shapes, world_size=1, num_workers=0, batch_size=16)))
    assert batch["images"].dtype == torch.uint8 and batch["images"].shape == (16, 3, 32, 32)
    assert batch["tokens"].shape == (16, 16) and batch["tokens"].dtype == torch.long


def test_close_ends_the_workers_and_the_next_batch_continues_exactly(shapes):
    reference = loader(shapes, num_workers=2)
    expected = [next(reference) for _ in range(7)]
    paused = loader(shapes, num_workers=2)
    before = set(multiprocessing.active_children())
    for _ in range(3):
        next(paused)
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2
    state_after_3 = paused.state_dict()
    paused.close()
    assert not workers & set(multiprocessing.active_children()) and paused.state_dict() == state_after_3
    for want in expected[3:]:  # started again from the last batch returned: the read-ahead batches come again
        got = next(paused)
        assert got["keys"] == want["keys"] and torch.equal(got["images"], want["images"])
    paused.close()
    reference.close()


@pytest.mark.parametrize("consumed", [3, 8, 13])
def test_resume_continues_exactly(shapes, consumed):
    """Odd counts rotate the worker roles; 13 batches cross an epoch boundary (8 per epoch)."""
    reference = loader(shapes)
    expected = [next(reference) for _ in range(consumed + 4)][consumed:]
    first = loader(shapes)
    for _ in range(consumed):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # only plain types in the state
    resumed = loader(shapes)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert got["keys"] == want["keys"]
        assert torch.equal(got["images"], want["images"]) and torch.equal(got["tokens"], want["tokens"])


def test_resume_with_other_worker_count_is_refused(shapes):
    first = loader(shapes)
    next(first)
    other = loader(shapes, num_workers=1)
    with pytest.raises(ValueError, match="data.num_workers"):
        other.load_state_dict(first.state_dict())


def test_pattern_matching_nothing_fails_clearly(tmp_path):
    pattern = str(tmp_path / "x-{000..009}.tar")
    with pytest.raises(FileNotFoundError, match=r"data.shards matched no files: '.*x-\{000\.\.009\}\.tar'"):
        expand_shards(pattern)
    with pytest.raises(FileNotFoundError, match="matched no files"):
        TrainLoader(data_config(pattern, 8, 0), image_size=32, context_length=16, seed=0)


def test_partly_missing_shards_fail_clearly(shapes):
    pattern = shapes["shards"].replace("000007}", "000009}")
    with pytest.raises(FileNotFoundError, match="2 of 10 shards do not exist"):
        expand_shards(pattern)


def test_too_few_shards_for_readers_fails_clearly(shapes):
    with pytest.raises(ValueError, match="8 shards cannot feed 10 readers"):
        loader(shapes, num_workers=5)


def test_batch_not_divisible_by_world_size_fails_clearly(shapes):
    with pytest.raises(ValueError, match="data.batch_size=101 is not divisible by the world size 2"):
        loader(shapes, batch_size=101)


def test_sizes_json_is_read(shapes):
    sizes = read_sizes(expand_shards(shapes["shards"]))
    assert sizes is not None and sum(sizes.values()) == 800


def test_corrupt_image_is_skipped(tmp_path, shapes):
    good = expand_shards(shapes["shards"])[0]
    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as src, tarfile.open(bad, "w") as dst:
        for i, member in enumerate(src.getmembers()):
            data = src.extractfile(member).read()
            if i == 0:  # the first sample's image: truncated JPEG
                data = data[:20]
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    cfg = data_config(str(bad), 33, 0, shuffle_buffer=1)
    batches = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    batch = next(batches)
    assert len(batch["keys"]) == 33 and batches.bad_counts() == {"corrupt_image": 1}


def png_bomb(width: int, height: int) -> bytes:
    """A real, valid 1-bit PNG of width x height black pixels: a few kB that PIL decodes to width x height bytes
    (and our RGB conversion to three times that). Written row by row, so making it takes no such memory."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, row = zlib.compressobj(9), b"\0" * (1 + (width + 7) // 8)  # filter byte, then packed bits
    pixels = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def first_sample_edited(shapes, tmp_path, ext: str, content: bytes) -> str:
    """A copy of the first training shard whose first sample's `.ext` member is `content`."""
    url, first = expand_shards(shapes["shards"])[0], None

    def edit(name: str, data: bytes) -> bytes:
        nonlocal first
        first = first or name.split(".")[0]
        return content if name == f"{first}.{ext}" else data

    rewrite_shard(url, tmp_path / "edited.tar", edit)
    return str(tmp_path / "edited.tar")


def test_a_decompression_bomb_is_skipped_from_its_header(tmp_path, shapes):
    """A 12000 x 12000 PNG of a few kB (below PIL's own limit, 179 Mpx) would decode to 432 MB of RGB in a worker:
    it is refused from its header, counted as oversized_image, and never decoded."""
    bomb = png_bomb(12000, 12000)
    assert len(bomb) < 100_000
    # live: PIL opens it, with a warning only (its error starts at twice its 89 Mpx limit)
    with pytest.warns(Image.DecompressionBombWarning), Image.open(io.BytesIO(bomb)) as img:
        assert img.size == (12000, 12000)
    cfg = data_config(first_sample_edited(shapes, tmp_path, "jpg", bomb), 20, 0, shuffle_buffer=1)
    assert cfg.max_image_pixels == 2**26  # the default: 8192 x 8192
    batches = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    start = time.process_time()
    with warnings.catch_warnings():  # data.max_image_pixels refuses it: PIL's warning would be noise
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        batch = next(batches)
    assert len(batch["keys"]) == 20 and batches.bad_counts() == {"oversized_image": 1}
    assert time.process_time() - start < 5  # decoding it alone takes seconds and 432 MB
    frames = {"__key__": "clip", **{f"f{i:03d}.jpg": bomb for i in range(4)}}
    with pytest.raises(OversizedImage, match="12000x12000 = 144000000 pixels, above data.max_image_pixels=67108864"):
        decode_clip(frames, 4, 32, None, 1.0, cfg.max_image_pixels, preprocess=Preprocess.from_config(cfg))


def test_a_caption_that_is_not_utf8_is_a_bad_caption(tmp_path, shapes):
    cfg = data_config(first_sample_edited(shapes, tmp_path, "txt", b"caf\xe9 \xff"), 20, 0, shuffle_buffer=1)
    batches = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    assert len(next(batches)["keys"]) == 20 and batches.bad_counts() == {"bad_caption": 1}


def test_shards_cut_at_a_member_boundary_or_empty_are_counted(tmp_path, shapes):
    """tarfile alone reads a tar cut just before a header, or garbled after its first member, as complete; the
    reader counts both as truncated_shard. A complete tar without a sample is counted as empty_shard."""
    url = expand_shards(shapes["shards"])[0]
    with tarfile.open(url) as tar:
        cut = tar.getmembers()[30].offset
    data = open(url, "rb").read()
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    (tmp_path / "garbled.tar").write_bytes(data[:cut] + os.urandom(len(data) - cut))
    tarfile.open(tmp_path / "empty.tar", "w").close()
    for name, reason in (("cut", "truncated_shard"), ("garbled", "truncated_shard"), ("empty", "empty_shard")):
        bad = reader_module.BadData()
        keys = [s["__key__"] for s in reader_module.read_shard(str(tmp_path / f"{name}.tar"), bad, retries=0)]
        assert len(keys) < 30 and dict(bad.counts) == {reason: 1}, name


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_small_jpegs_decode_as_pil_does_and_large_ones_at_a_reduced_scale(mode):
    """Under twice the crop size a JPEG goes to torchvision's decoder, which gives PIL's pixels exactly; from twice
    the crop size up, PIL's draft() decodes it at a reduced DCT scale that still covers the crop."""
    import numpy as np
    from PIL import Image
    from torchvision.transforms.v2 import functional as TF

    from src.data.image_text import load_rgb

    pixels = (np.random.default_rng(0).random((300, 1000, 3)) * 255).astype(np.uint8)
    for width, shape in ((420, (300, 420)), (1000, (150, 500))):  # 300 < 2 · 224; 1000 x 300 ≥ 2 · 128
        size = 224 if width == 420 else 128
        buffer = io.BytesIO()
        Image.fromarray(pixels[:, :width]).convert(mode).save(buffer, format="JPEG", quality=90)
        with Image.open(io.BytesIO(buffer.getvalue())) as img:
            img.draft("RGB", (size, size))
            want = TF.pil_to_tensor(img.convert("RGB"))
        got = load_rgb(buffer.getvalue(), size, None)
        assert got.shape == (3, *shape) and torch.equal(got, want), (mode, width)


def test_jpeg_size_reads_the_header_as_pil_does_or_leaves_it_to_pil(monkeypatch):
    """jpeg_size gives PIL's (width, height) for the JPEGs PIL opens as format JPEG (baseline, progressive, grayscale,
    CMYK, with EXIF and ICC segments), and None where PIL reads another format or the header is unusual: a PNG, a
    multi-picture MPO, fill bytes between markers, a header cut short. load_rgb gives the same pixels either way,
    and refuses a small-sided JPEG above PIL's own pixel limit as PIL's open would."""
    import numpy as np
    from PIL import ImageCms
    from torchvision.transforms.v2 import functional as TF

    from src.data.image_text import jpeg_size, load_rgb

    pixels = (np.random.default_rng(1).random((120, 200, 3)) * 255).astype(np.uint8)
    image = Image.fromarray(pixels)

    def encode(img: Image.Image, fmt: str = "JPEG", **kwargs) -> bytes:
        buffer = io.BytesIO()
        img.save(buffer, format=fmt, **kwargs)
        return buffer.getvalue()

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: neither PIL's size nor ours applies it
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    jpegs = [encode(image), encode(image, progressive=True), encode(image.convert("L")), encode(image.convert("CMYK")),
             encode(image, exif=exif.tobytes(), icc_profile=icc, optimize=True), encode(image.resize((333, 77)))]
    for data in jpegs:
        with Image.open(io.BytesIO(data)) as img:
            assert img.format == "JPEG" and jpeg_size(data) == img.size
            want = TF.pil_to_tensor(img.convert("RGB"))
        assert torch.equal(load_rgb(data, 224, None), want)
    baseline = jpegs[0]
    others = [encode(image, "PNG"), encode(image, "MPO", save_all=True, append_images=[image]),
              baseline[:2] + b"\xff" + baseline[2:], baseline[:40]]
    assert [jpeg_size(data) for data in others] == [None] * len(others)
    with Image.open(io.BytesIO(others[1])) as img:
        assert img.format == "MPO"
        want = TF.pil_to_tensor(img.convert("RGB"))
    assert torch.equal(load_rgb(others[1], 224, None), want)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200 * 120 // 2 - 1)
    for data in (baseline, others[2]):  # through jpeg_size, and through PIL's open
        with pytest.raises(OversizedImage):
            load_rgb(data, 224, None)


def test_eval_batches_carry_labels(shapes):
    batches = list(eval_batches(shapes["eval_shards"], batch_size=32, image_size=32, context_length=16,
                                num_workers=2, preprocess=Preprocess.from_config(compose_config([]).data)))
    labels = torch.cat([b["labels"] for b in batches])
    assert len(labels) == 100 and labels.min() >= 0
    assert os.path.isfile(os.path.join(os.path.dirname(expand_shards(shapes["eval_shards"])[0]), "classes.json"))


def test_eval_workers_are_spawned_once_cuda_has_started_and_read_the_same_batches(shapes, monkeypatch):
    # Forked beside a CUDA run, workers inherit the driver's and the GPU decoder's threads half-copied.
    def read():  # one worker: a spawned one imports torch afresh, seconds on two cores
        return list(eval_batches(shapes["eval_shards"], batch_size=32, image_size=32, context_length=16,
                                 num_workers=1, preprocess=Preprocess.from_config(compose_config([]).data)))

    assert worker_start_method() is None
    forked = read()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert worker_start_method() == "spawn"
    loader = eval_batches(shapes["eval_shards"], batch_size=32, image_size=32, context_length=16, num_workers=1,
                          preprocess=Preprocess.from_config(compose_config([]).data)).loader
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    spawned = read()
    assert len(spawned) == len(forked) > 1
    for a, b in zip(forked, spawned):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]


def generate_together(cfg, start) -> None:
    start.wait()  # both processes write at the same moment, as two runs started side by side do
    ensure_synthetic_data(cfg, is_main=True)


def test_two_runs_generating_the_same_data_at_once_both_get_it_whole(tmp_path):
    cfg = compose_config(["experiment=quickstart", f"data.shards='{tmp_path}/train/train-{{000000..000003}}.tar'",
                          f"data.eval_shards='{tmp_path}/eval/eval-{{000000..000001}}.tar'",
                          "data.generate_train_samples=400", "data.generate_eval_samples=40"])
    context = multiprocessing.get_context("fork")
    start = context.Barrier(2)
    runs = [context.Process(target=generate_together, args=(cfg, start)) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(120)
    assert [run.exitcode for run in runs] == [0, 0]  # without the lock, one replaced the other's shard under it
    assert json.loads((tmp_path / "train" / "sizes.json").read_text()) == {f"train-{i:06d}.tar": 100 for i in range(4)}
    assert (tmp_path / "eval" / "classes.json").is_file()
    keys = []
    for i in range(4):
        with tarfile.open(tmp_path / "train" / f"train-{i:06d}.tar") as tar:
            keys += [name for name in tar.getnames() if name.endswith(".jpg")]
    assert len(keys) == len(set(keys)) == 400
    # Complete data is only read, no lock taken: it may sit in a directory the run cannot write to.
    (tmp_path / "eval" / ".generating.lock").unlink()
    ensure_synthetic_data(cfg, is_main=True)
    assert not (tmp_path / "eval" / ".generating.lock").exists()


def test_preflight_refuses_generated_data_written_with_other_counts(tmp_path):
    """Generated data on disk is used as it is: asking for other counts than it holds is refused with the fix,
    rather than training on the old data silently."""
    paths = [f"data.shards='{tmp_path}/data/train/train-{{000000..000003}}.tar'",
             f"data.eval_shards='{tmp_path}/data/eval/eval-{{000000..000001}}.tar'"]

    def configured(train: int, held_out: int):
        return compose_config(["experiment=quickstart", *paths, f"data.generate_train_samples={train}",
                               f"data.generate_eval_samples={held_out}"])

    cpu = DistInfo(0, 1, 0, torch.device("cpu"))
    preflight(configured(400, 40), cpu, str(tmp_path / "run"))  # nothing written yet: nothing to compare
    ensure_synthetic_data(configured(400, 40), is_main=True)
    preflight(configured(400, 40), cpu, str(tmp_path / "run"))
    with pytest.raises(ConfigurationError) as err:
        preflight(configured(800, 20), cpu, str(tmp_path / "run"))
    train, held_out = tmp_path / "data" / "train", tmp_path / "data" / "eval"
    assert (f"data.generate_train_samples=800, but {train} already holds generated data of 400 samples, written "
            f"with another count: delete {train} to write it again, or set data.generate_train_samples=400"
            in str(err.value))
    assert f"data.generate_eval_samples=20, but {held_out} already holds generated data of 40 samples" in str(err.value)


def test_make_synthetic_shards_script(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, "scripts/make_synthetic_shards.py", str(tmp_path / "s"), "--train", "30", "--eval", "10",
         "--train-shards", "3", "--eval-shards", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    shards = expand_shards(str(tmp_path / "s/train/train-{000000..000002}.tar"))
    assert read_sizes(shards) == {s: 10 for s in shards}
    assert (tmp_path / "s/eval/classes.json").is_file()
    bad = subprocess.run([sys.executable, "scripts/make_synthetic_shards.py", str(tmp_path / "t"), "--train", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--train must be at least 1" in bad.stderr


def test_resampled_mode_gives_the_configured_count(shapes):
    # 2 ranks x 2 workers, 300 samples per virtual epoch: 75 per reader, so 3 batches of 50 per rank-epoch.
    cfg = data_config(shapes["shards"], 100, 2, mode="resampled", samples_per_epoch=300)
    ranks = [TrainLoader(cfg, image_size=32, context_length=16, seed=0, rank=r, world_size=2) for r in range(2)]
    keys = [k for loader in ranks for _ in range(3) for k in next(loader)["keys"]]
    assert len(keys) == 300 and all(loader.epoch == 0 for loader in ranks)
    assert len(set(keys)) < 300  # drawn with replacement: some samples repeat


def test_resampled_mode_mixes_sources_by_weight(shapes):
    first = shapes["shards"].replace("{000000..000007}", "{000000..000003}")
    second = shapes["shards"].replace("{000000..000007}", "{000004..000007}")
    cfg = data_config(None, 100, 0, shuffle_buffer=200, mode="resampled", samples_per_epoch=2000,
                      sources=[SourceConfig(first, 3.0), SourceConfig(second, 1.0)])
    loader = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    first_keys = {k for url in expand_shards(first) for k in shard_keys(url)}
    keys = [k for _ in range(20) for k in next(loader)["keys"]]
    share = sum(k in first_keys for k in keys) / len(keys)
    assert 0.6 < share < 0.9  # 0.75 expected; shard-level draws make it noisy


def shard_keys(url: str) -> list[str]:
    with tarfile.open(url) as tar:
        return sorted({m.name.split(".")[0] for m in tar.getmembers()})


def test_weights_need_resampled_mode(shapes):
    cfg = data_config(None, 10, 0, sources=[SourceConfig(shapes["shards"], 2.0), SourceConfig(shapes["shards"], 1.0)])
    with pytest.raises(ValueError, match="use data.mode=resampled to mix sources by weight"):
        TrainLoader(cfg, image_size=32, context_length=16, seed=0)


def test_resume_rereads_only_the_buffered_shards(shapes, monkeypatch):
    cfg = data_config(shapes["shards"], 30, 0, shuffle_buffer=40)
    first = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    for _ in range(12):  # 360 samples: deep into the epoch (800 samples in 8 shards of 100)
        next(first)
    state = first.state_dict()
    expected = next(first)["keys"]
    opened = []
    real_gopen = reader_module.gopen
    monkeypatch.setattr(reader_module, "gopen", lambda url: opened.append(url) or real_gopen(url))
    resumed = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    resumed.load_state_dict(state)
    assert next(resumed)["keys"] == expected
    position = state["positions"][0]
    order = shards_for_reader(expand_shards(shapes["shards"]), seed=0, epoch=0, reader=0, num_readers=1)
    allowed = {order[i] for i in {tag[0] for tag in position["buffer"]} | {position["shard"], position["shard"] + 1}}
    # Only the shards holding the 40 buffered samples, the one being read and the next: never the whole epoch.
    assert position["shard"] >= 3 and set(opened) <= allowed, (opened, position["shard"])


def rewrite_shard(src: str, dst, edit) -> None:
    """Copy a tar, passing each member's (name, bytes) through `edit`, which may return None to drop it."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin.getmembers():
            kept = edit(member.name, tin.extractfile(member).read())
            if kept is not None:
                member.size = len(kept)
                tout.addfile(member, io.BytesIO(kept))


def test_bad_data_is_skipped_and_counted_by_reason(tmp_path, shapes):
    urls = expand_shards(shapes["shards"])
    # shard 0: two captions missing; shard 1: truncated in the middle; shard 2: deleted after start-up.
    no_caption = ("000000000.txt", "000000001.txt")
    rewrite_shard(urls[0], tmp_path / "a.tar", lambda n, d: None if n.endswith(no_caption) else d)
    (tmp_path / "b.tar").write_bytes(open(urls[1], "rb").read()[:30_000])
    shutil.copy(urls[2], tmp_path / "c.tar")
    cfg = data_config(f"{tmp_path}/{{a,b,c}}.tar", 20, 0, shuffle_buffer=1, shard_retries=1)
    loader = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    os.remove(tmp_path / "c.tar")
    for _ in range(5):  # < 200 good samples in the two readable shards
        next(loader)
    counts = loader.bad_counts()
    assert counts["missing_caption"] == 2 and counts["truncated_shard"] == 1 and counts["unreadable_shard"] == 1


def test_bad_fraction_limit_fails_naming_the_shard(tmp_path, shapes):
    url = expand_shards(shapes["shards"])[0]
    every_fourth_image = lambda n, d: d[:10] if n.endswith(".jpg") and int(n[:9]) % 4 == 0 else d  # noqa: E731
    rewrite_shard(url, tmp_path / "rotten.tar", every_fourth_image)
    cfg = data_config(str(tmp_path / "rotten.tar"), 10, 0, shuffle_buffer=1)
    loader = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    with pytest.raises(RuntimeError, match=r"above data.max_bad_fraction=0.01.*rotten.tar"):
        for _ in range(20):
            next(loader)


def test_pipe_sources_are_read(shapes):
    url = expand_shards(shapes["shards"])[0]
    cfg = data_config(f"pipe:cat {url}", 10, 0, allow_pipe=True)
    batch = next(TrainLoader(cfg, image_size=32, context_length=16, seed=0))
    assert len(batch["keys"]) == 10


@pytest.mark.parametrize("key", ["shards", "eval_shards", "sources"])
def test_pipe_urls_need_allow_pipe(shapes, key):
    """A pipe: URL runs a shell command: without data.allow_pipe=true neither the loader nor preflight starts one."""
    from src.parallel.distributed import DistInfo
    from src.trainer.preflight import preflight

    command = f"pipe:cat {expand_shards(shapes['shards'])[0]}"
    values = {"shards": shapes["shards"], key: command} if key != "sources" else {
        "shards": None, "sources": [SourceConfig(shards=f"{shapes['shards']}::{command}", weight=1.0)]}
    name = {"shards": "data.shards", "eval_shards": "data.eval_shards", "sources": r"data.sources\[0\].shards"}[key]
    message = rf"{name} holds '{re.escape(command)}', a pipe: URL.*data.allow_pipe=false: set data.allow_pipe=true"
    if key != "eval_shards":  # the loader reads no eval shards
        with pytest.raises(ValueError, match=message):
            TrainLoader(data_config(**{"batch_size": 10, "num_workers": 0, **values}), image_size=32, context_length=16,
                        seed=0)
    cfg = compose_config(["experiment=quickstart", "data.generate=false"])
    cfg.data = data_config(**{"batch_size": 10, "num_workers": 0, **values})
    with pytest.raises(ValueError, match=message):
        preflight(cfg, DistInfo(0, 1, 0, torch.device("cpu")), "/nonexistent-run-dir")
    cfg.data.allow_pipe = True
    preflight(cfg, DistInfo(0, 1, 0, torch.device("cpu")), "/nonexistent-run-dir")


def read_pipe(command: str, retries: int) -> tuple[list[str], dict[str, int], float]:
    """Keys read from a real pipe: command, the bad counts, and the seconds it took."""
    bad, start = reader_module.BadData(), time.monotonic()
    keys = [s["__key__"] for s in reader_module.read_shard(f"pipe:{command}", bad, retries, retry_wait_s=0.2)]
    return keys, dict(bad.counts), time.monotonic() - start


def test_a_failing_pipe_command_is_retried_then_skipped(tmp_path, shapes):
    """A command that fails before giving a sample is retried data.shard_retries times, then counted as
    unreadable_shard; nothing raises (before, closing the pipe raised outside any handler)."""
    attempts = tmp_path / "attempts"
    keys, counts, seconds = read_pipe(f"echo x >> {attempts}; cat {tmp_path}/missing.tar", retries=2)
    assert keys == [] and counts == {"unreadable_shard": 1}
    assert attempts.read_text() == "x\nx\nx\n" and seconds >= 0.4  # three attempts, two waits
    # A command that fails at first and then works (a network blip): its samples come once, nothing is counted.
    url = expand_shards(shapes["shards"])[0]
    flaky = f"if [ -e {tmp_path}/once ]; then cat {url}; else touch {tmp_path}/once; exit 1; fi"
    keys, counts, _ = read_pipe(flaky, retries=1)
    assert len(keys) == len(set(keys)) == 100 and counts == {}


@pytest.mark.parametrize("tail", ["; exit 1", ""])
def test_a_pipe_command_failing_midway_keeps_what_it_gave_and_is_not_reread(shapes, tail):
    """`head -c` cuts the tar after a few samples; with or without a failing exit status, the shard counts as
    truncated_shard, and is not read again from its start (its first samples would come twice)."""
    url = expand_shards(shapes["shards"])[0]
    keys, counts, _ = read_pipe(f"head -c {os.path.getsize(url) // 2} {url}{tail}", retries=2)
    with tarfile.open(url) as tar:
        first = sorted({m.name.split(".")[0] for m in tar.getmembers()})
    assert 0 < len(keys) < 100 and keys == first[: len(keys)]  # once each, in order
    assert counts == {"truncated_shard": 1}


def test_a_pipe_command_that_succeeds_but_fails_in_the_end_is_counted(shapes):
    url = expand_shards(shapes["shards"])[0]
    keys, counts, _ = read_pipe(f"cat {url}; exit 3", retries=2)
    assert len(keys) == 100 and counts == {"truncated_shard": 1}


def test_a_pipe_command_is_stopped_with_its_children_when_reading_stops(tmp_path, shapes):
    """The reader stops early (its quota, the end of training), mid-shard: the command and what it started are
    killed, not left running. (The sleeper starts first, with its output elsewhere: the samples read before the
    stop need not wait for it.)"""
    url = expand_shards(shapes["shards"])[0]
    pid_file = tmp_path / "sleeper"
    command = f"pipe:sleep 300 > /dev/null & echo $! > {pid_file}; cat {url}; wait"
    samples = reader_module.read_shard(command, reader_module.BadData(), 0)
    for _ in range(50):
        next(samples)
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sleeper = int(pid_file.read_text())
    samples.close()
    # SIGKILL is sent before close returns; the kernel ends the sleeper when it next runs, which under load can be a
    # moment later, so wait for that, but far less than the sleep it would otherwise finish.
    deadline = time.monotonic() + 10
    while (stat := proc_stat(sleeper)) is not None and stat[1][0] != "Z":
        assert time.monotonic() < deadline, f"the pipe command's child {sleeper} still runs after the reader stopped"
        time.sleep(0.05)


def test_a_pipe_command_dies_with_its_reading_thread_when_sighup_was_ignored(tmp_path):
    """A trainer under nohup ignores SIGHUP, and so would the shell supervising a pipe: command, which could then
    not trap the SIGHUP sent when its reader dies: the command outlived a SIGKILLed trainer."""
    pid_file = tmp_path / "sleeper"
    started, running = [], threading.Event()

    def read() -> None:
        started.append(CommandStream(f"sleep 300 & echo $! > {pid_file}; wait"))
        running.wait(10)  # until the command runs; then the thread ends, and the kernel sends its shell SIGHUP

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        running.set()
        reader.join()
    finally:
        signal.signal(signal.SIGHUP, previous)
    sleeper = int(pid_file.read_text())
    while (stat := proc_stat(sleeper)) is not None and stat[1][0] != "Z":
        assert time.monotonic() < deadline, f"the command's child {sleeper} outlived its reading thread"
        time.sleep(0.05)
    started[0].proc.wait()


def test_sizes_fall_back_to_img2dataset_stats(tmp_path, shapes):
    urls = expand_shards(shapes["shards"])[:2]
    for url in urls:
        shutil.copy(url, tmp_path / os.path.basename(url))
        (tmp_path / os.path.basename(url).replace(".tar", "_stats.json")).write_text('{"successes": 100}')
    copies = [str(tmp_path / os.path.basename(u)) for u in urls]
    assert read_sizes(copies) == {c: 100 for c in copies}
    os.remove(tmp_path / os.path.basename(urls[1]).replace(".tar", "_stats.json"))
    assert read_sizes(copies) is None


def test_resampled_mode_resumes_with_another_worker_count(shapes):
    cfg = data_config(shapes["shards"], 20, 2, mode="resampled", samples_per_epoch=400)
    first = TrainLoader(cfg, image_size=32, context_length=16, seed=0)
    next(first)
    other = TrainLoader(data_config(shapes["shards"], 20, 1, mode="resampled", samples_per_epoch=400),
                        image_size=32, context_length=16, seed=0)
    other.load_state_dict(first.state_dict())  # new draws, no error
    assert other.batches == 1 and len(next(other)["keys"]) == 20


def test_captions_say_where_an_off_centre_shape_sits():
    assert where(0.2, 0.5) == ", on the left"
    assert where(0.5, 0.8) == ", down low"
    assert where(0.7, 0.1) == ", on the right, up high"
    assert where(0.5, 0.5) == ""
    caption = draw_sample(random.Random(0), 32)[2]
    assert caption.endswith(", on the right, down low")  # the first sample sits bottom right


@pytest.mark.parametrize(("cpus", "ranks", "workers"), [(2, 1, 1), (16, 1, 12), (128, 1, 16), (128, 8, 12), (4, 8, 1)])
def test_default_num_workers_leaves_a_quarter_of_each_ranks_cpus(monkeypatch, cpus, ranks, workers):
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert default_num_workers() == workers


@pytest.mark.parametrize("compile", [False, True])
def test_image_normalizer_gives_the_float32_values_rounded_to_its_dtype(compile):
    """In training the normalizer writes the autocast dtype: the values the patch embedding's matmul would
    round the float32 images to, compiled into one kernel or not."""
    from src.data.image_text import ImageNormalizer

    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    exact = ImageNormalizer(torch.device("cpu"))(images)
    assert exact.dtype == torch.float32
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    torch.testing.assert_close(exact, (images / 255 - mean) / std)
    rounded = ImageNormalizer(torch.device("cpu"), dtype=torch.bfloat16, compile=compile)(images)
    assert rounded.dtype == torch.bfloat16
    torch.testing.assert_close(rounded, exact.to(torch.bfloat16), atol=0, rtol=2 ** -8)
