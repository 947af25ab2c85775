"""The batched resized-crop kernels (src/kernels/resized_crop.py) against torchvision's antialiased resize of each
crop, the loader workers' own, on the CPU through Triton's interpreter (tests/interpreter_harness.py says how)."""

import random

import pytest
import torch
from interpreter_harness import INTERPRETED, interpreted, run_under_interpreter
from torchvision.transforms.v2 import functional as TF

from src.data.device_decode import resize_crops_reference
from src.data.image_text import random_resized_crop_box
from src.kernels.resized_crop import resize_crops

pytest.importorskip("triton")


@pytest.mark.skipif(INTERPRETED, reason="this is the subprocess")
def test_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def batch(sizes: list[tuple[int, int]], scale_min: float, seed: int = 0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    images = [(torch.rand(h, w, 3) * 255).to(torch.uint8) for h, w in sizes]
    boxes = [random_resized_crop_box(w, h, rng, (scale_min, 1.0)) for h, w in sizes]
    addresses = torch.tensor([image.data_ptr() for image in images], dtype=torch.int64)
    widths = torch.tensor([w for _, w in sizes])
    return images, boxes, addresses, widths


@interpreted
@pytest.mark.parametrize(("sizes", "scale_min", "size"), [
    ([(40, 57), (23, 90), (64, 64), (12, 30)], 0.3, 24),  # shrinking 1-4x and enlarging, several images a batch
    ([(200, 150)], 0.9, 16),  # a dozen taps a pass
    ([(9, 11), (16, 16)], 0.5, 20),  # enlarging only (the filter's support is then 1)
])
def test_crops_match_torchvisions_within_one_level(sizes, scale_min, size):
    images, boxes, addresses, widths = batch(sizes, scale_min)
    got = resize_crops(addresses, widths, torch.tensor(boxes, dtype=torch.int32), size, torch.device("cpu"))
    want = resize_crops_reference(images, boxes, size)
    assert got.shape == want.shape == (len(sizes), 3, size, size) and got.dtype == torch.uint8
    # torchvision's uint8 path rounds between its passes; against its float resize the kernels round once.
    assert (got.int() - want.int()).abs().max() <= 1
    exact = torch.stack([TF.resized_crop(image.permute(2, 0, 1).float(), *box, [size, size], antialias=True)
                         for image, box in zip(images, boxes)])
    assert (got.float() - exact).abs().max() <= 0.5 + 1 / 16


@interpreted
def test_an_empty_batch():
    out = resize_crops(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                       torch.zeros(0, 4, dtype=torch.int32), 8, torch.device("cpu"))
    assert out.shape == (0, 3, 8, 8)
