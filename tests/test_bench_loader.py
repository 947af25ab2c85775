"""The loader benchmark's batched-decode probe runs on CPU, so it cannot rot; its GPU figures come from the device."""

import importlib.util
import io
import os
import random

from conftest import ROOT
from PIL import Image


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_loader", os.path.join(ROOT, "bench", "loader.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_jpegs() -> list[bytes]:
    """Three JPEGs of 300 x 225, 520 x 390 and 640 x 480 pixels."""
    images = []
    for side in (300, 520, 640):
        buffer = io.BytesIO()
        Image.new("RGB", (side, side * 3 // 4), (side % 256, 90, 30)).save(buffer, format="JPEG")
        images.append(buffer.getvalue())
    return images


def test_batched_decode_times_lists_of_jpegs_and_crops_them():
    bench = load_bench()
    images = small_jpegs()
    result = bench.bench_batched_decode(images, batch=2, passes=2, device="cpu")
    assert result["device"] == "cpu" and result["batch"] == 2 and len(result["passes"]) == 2
    assert 0 < result["ms_per_image_min"] <= result["ms_per_image"] and result["cpu_ms_per_image"] > 0


def test_decode_microbenchmark_times_every_strategy_and_a_workers_share_under_device_decoding():
    bench = load_bench()
    images = small_jpegs()
    result = bench.bench_decode(images, passes=2)
    assert set(result) == set(bench.DECODERS) and {bench.SHIPPED, bench.PLACED} <= set(result)
    for row in result.values():
        assert len(row["passes"]) == 2 and 0 < row["ms_per_image_min"] <= row["ms_per_image"]
    # What the worker ships for a 520 x 390 JPEG: a crop box inside the image, and the size read from its header.
    top, left, height, width, image_height, image_width = bench.ship_for_device(images[1], random.Random(0)).tolist()
    assert (image_height, image_width) == (390, 520)
    assert 0 <= top and top + height <= 390 and 0 <= left and left + width <= 520 and height * width > 0.8 * 390 * 520


def test_a_workers_share_under_device_resizing_is_the_crop_on_its_canvas():
    """Under data.resize_on=device a worker decodes and places the crop, unresized, on a 258-px canvas (224 px
    crops), with a one-pixel border; the rest of the canvas stays zero."""
    bench = load_bench()
    buffer = io.BytesIO()
    Image.new("RGB", (200, 150), (200, 90, 30)).save(buffer, format="JPEG", quality=95)
    canvas = bench.place_for_device(buffer.getvalue(), random.Random(0))
    assert bench.CANVAS == 258 and tuple(canvas.shape) == (3, 258, 258)
    filled = canvas.sum(0) > 0
    rows, columns = int(filled.any(1).sum()), int(filled.any(0).sum())
    # The crop covers at least 90% of the image's area, so nearly all of its 200 x 150 pixels, plus the border.
    assert 0.9 * 150 * 200 <= (rows - 1) * (columns - 1) and rows <= 151 and columns <= 201
    assert abs(int(canvas[0, 5, 5]) - 200) <= 3 and not filled[200:].any() and not filled[:, 210:].any()
