"""One sample: image bytes and a caption in, a uint8 image tensor and caption tokens out."""

from __future__ import annotations

import io
import math
import random

import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as TF

from src.data.shards import IMAGE_EXTENSIONS


def image_bytes(sample: dict) -> bytes:
    for ext in IMAGE_EXTENSIONS:
        if ext in sample:
            return sample[ext]
    raise KeyError(f"sample {sample.get('__key__')!r} has no image (.jpg/.png/.webp)")


def random_resized_crop_box(
    width: int, height: int, rng: random.Random, scale: tuple[float, float], ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop parameters, drawn from our own RNG so that a resumed run
    reproduces the crops of the uninterrupted one (top, left, height, width)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    side = min(width, height)
    return (height - side) // 2, (width - side) // 2, side, side


class OversizedImage(ValueError):
    """An image with more pixels than data.max_image_pixels: a small file can decode to gigabytes (a decompression
    bomb), so it is refused from its header, before any decoding."""


def check_pixels(width: int, height: int, max_pixels: int | None) -> None:
    """OversizedImage above `max_pixels` (None: no limit of ours)."""
    if max_pixels is not None and width * height > max_pixels:
        raise OversizedImage(f"{width}x{height} = {width * height} pixels, above data.max_image_pixels={max_pixels}")


def load_rgb(data: bytes, size: int, max_pixels: int | None) -> torch.Tensor:
    """Decode image bytes to a (3, H, W) uint8 tensor, for crops of `size` pixels; OversizedImage for an image of
    more than `max_pixels` pixels."""
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as err:  # PIL's own, higher limit: checked when it reads the header
        raise OversizedImage(str(err)) from err
    with img:
        check_pixels(*img.size, max_pixels)
        if img.format == "JPEG" and min(img.size) < 2 * size:
            # draft() cannot shrink it; torchvision decodes straight into a tensor (1.19x faster at 256-384 px).
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        # draft() lets the JPEG decoder skip work when the source is at least twice the target.
        img.draft("RGB", (size, size))
        return TF.pil_to_tensor(img.convert("RGB"))


def crop(image: torch.Tensor, size: int, box: tuple[int, int, int, int] | None) -> torch.Tensor:
    """(..., 3, size, size): the resized crop `box` (top, left, height, width) in training; a resize of the
    short side and a centre crop in evaluation (box None). Leading dimensions (frames of a clip) share it."""
    if box is not None:
        return TF.resized_crop(image, *box, [size, size], antialias=True)
    if image.shape[-2:] != (size, size):
        image = TF.resize(image, size, antialias=True)
    return TF.center_crop(image, [size, size])


def decode_image(
    data: bytes, size: int, rng: random.Random | None, scale_min: float, max_pixels: int | None
) -> torch.Tensor:
    """A (3, size, size) uint8 tensor: random resized crop in training (rng given), centre crop in evaluation."""
    image = load_rgb(data, size, max_pixels)
    height, width = image.shape[-2:]
    box = random_resized_crop_box(width, height, rng, (scale_min, 1.0)) if rng is not None else None
    return crop(image, size, box)


def normalize_images(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((images.float() - mean) / std).to(dtype)


class ImageNormalizer:
    """uint8 images in, normalized floats out, on the training device: the loader ships 4× fewer bytes
    and the host does no float work.

    `dtype` is the output's: in training the autocast dtype, to which the patch embedding's matmul would round
    the images anyway, so the values are the same and the layout copy before that matmul moves half the bytes.
    `compile` makes it one fused kernel instead of one pass over the images per op: on an H200 the eager ops took
    about 2 ms of a 128 ms ViT-B/32 step, and compiling them made the step 1.014× faster (docs/benchmarks-history.md,
    throughput)."""

    def __init__(self, device: torch.device, mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD,
                 dtype: torch.dtype = torch.float32, compile: bool = False):
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255
        self.dtype = dtype
        self.normalize = torch.compile(normalize_images) if compile else normalize_images

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.normalize(images, self.mean, self.std, self.dtype)
