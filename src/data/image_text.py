"""One sample: image bytes and a caption in, a uint8 image tensor and caption tokens out.

What a sample goes through follows `data.interpolation`, `data.resize_mode`, `data.color_jitter`,
`data.color_jitter_prob` and `data.grayscale_prob` (`Preprocess`), in the loader's workers on uint8 pixels; the
mean and std (`data.image_mean`, `data.image_std`) are applied on the training device (`ImageNormalizer`).
Training takes the random resized crop, then, when they are on, OpenCLIP's colour jitter and grayscale in its
order; evaluation takes the deterministic transform of the same interpolation and resize mode, with no
augmentation. Every random draw comes from the sample's own RNG, so a resumed run draws the same ones."""

from __future__ import annotations

import io
import math
import random
import warnings
from dataclasses import dataclass

import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from src.config import DataConfig
from src.data.shards import IMAGE_EXTENSIONS

INTERPOLATION = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC}
# ColorJitter's adjustments, applied in a random order as torchvision's ColorJitter (which OpenCLIP uses) does.
JITTERS = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation)


@dataclass(frozen=True)
class Preprocess:
    """How the loader resizes and augments pixels (see the module's docstring); plain data, for the workers."""

    interpolation: InterpolationMode
    squash: bool  # data.resize_mode=squash: evaluation resizes the whole image to size x size, without a crop
    color_jitter: float
    color_jitter_prob: float
    grayscale_prob: float

    @classmethod
    def from_config(cls, cfg: DataConfig) -> Preprocess:
        return cls(INTERPOLATION[str(cfg.interpolation)], cfg.resize_mode == "squash", cfg.color_jitter,
                   cfg.color_jitter_prob, cfg.grayscale_prob)

    def augment(self, images: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """OpenCLIP's training augmentations after the crop, on uint8 (..., 3, H, W) (a clip's frames alike):
        with probability color_jitter_prob, brightness, contrast and saturation each scaled by a factor drawn from
        [max(0, 1 - s), 1 + s] (s = color_jitter; no hue jitter, as timm and OpenCLIP read one strength), in a
        random order; then grayscale with probability grayscale_prob. Draws nothing when both are off."""
        if self.color_jitter > 0 and rng.random() < self.color_jitter_prob:
            order = list(range(len(JITTERS)))
            rng.shuffle(order)
            for i in order:
                images = JITTERS[i](images, rng.uniform(max(0.0, 1 - self.color_jitter), 1 + self.color_jitter))
        if self.grayscale_prob > 0 and rng.random() < self.grayscale_prob:
            images = TF.rgb_to_grayscale(images, num_output_channels=3)
        return images


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


def check_decodable(width: int, height: int, max_pixels: int | None) -> None:
    """OversizedImage for a JPEG, sized from its header, that a decoder other than PIL's would decode: above
    `max_pixels`, or above the limit at which PIL refuses an image as a decompression bomb."""
    check_pixels(width, height, max_pixels)
    if Image.MAX_IMAGE_PIXELS is not None and width * height > 2 * Image.MAX_IMAGE_PIXELS:
        raise OversizedImage(f"{width}x{height} pixels, above PIL's limit of {2 * Image.MAX_IMAGE_PIXELS}")


# The markers after which a JPEG header gives the frame's size (SOF0-15 but DHT, JPG and DAC; and DHP), as PIL's
# JpegImagePlugin reads them: the last one before the start of scan wins.
FRAME_MARKERS = frozenset((*range(0xC0, 0xC4), *range(0xC5, 0xC8), *range(0xC9, 0xCC), *range(0xCD, 0xD0), 0xDE))
START_OF_SCAN = 0xDA


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of an 8-bit JPEG, read from its markers as PIL reads them, or None whenever PIL might read
    it otherwise: not a JPEG, not 8 bits, not 1, 3 or 4 channels, padding or junk between markers, or a
    multi-picture (MPO) header, for which PIL returns another format. PIL's Image.open for the header alone
    takes 17 us a 256-px JPEG, this 1 us (docs/benchmarks-history.md, loader)."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    size, i, end = None, 2, len(data) - 4
    while i < end:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == START_OF_SCAN:
            return size
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return None
        if marker in FRAME_MARKERS:
            if length < 8 or i + 2 + length > len(data) or data[i + 4] != 8 or data[i + 9] not in (1, 3, 4):
                return None  # cut short, not 8 bits, or channels PIL has no mode for
            size = int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
        elif marker == 0xE2 and data[i + 4 : i + 8] == b"MPF\x00":
            return None
        elif not 0xC0 <= marker <= 0xFE or 0xD0 <= marker <= 0xD9:  # markers without a length: PIL's business
            return None
        i += 2 + length
    return None


def load_rgb(data: bytes, size: int, max_pixels: int | None) -> torch.Tensor:
    """Decode image bytes to a (3, H, W) uint8 tensor, for crops of `size` pixels; OversizedImage for an image of
    more than `max_pixels` pixels."""
    frame = jpeg_size(data)
    if frame is not None and min(frame) < 2 * size:
        # draft() cannot shrink it; torchvision decodes straight into a tensor (1.19x faster at 256-384 px).
        check_decodable(*frame, max_pixels)
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    try:
        with warnings.catch_warnings():
            # data.max_image_pixels decides below; PIL would also warn of every image past its own 89 Mpx
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as err:  # PIL's own, higher limit: checked when it reads the header
        raise OversizedImage(str(err)) from err
    with img:
        check_pixels(*img.size, max_pixels)
        if img.format == "JPEG" and min(img.size) < 2 * size:  # a JPEG whose header jpeg_size left to PIL
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        # draft() lets the JPEG decoder skip work when the source is at least twice the target.
        img.draft("RGB", (size, size))
        # convert() of an image already in RGB is a full copy: 0.2-0.5 ms of a 512-1024 px JPEG's 2-4 ms.
        return TF.pil_to_tensor(img if img.mode == "RGB" else img.convert("RGB"))


def crop(image: torch.Tensor, size: int, box: tuple[int, int, int, int] | None, preprocess: Preprocess) -> torch.Tensor:
    """(..., 3, size, size): the resized crop `box` (top, left, height, width) in training; in evaluation (box
    None) a resize of the short side and a centre crop, or with `preprocess.squash` a resize of the whole image.
    Leading dimensions (frames of a clip) share it."""
    mode = preprocess.interpolation
    if box is not None:
        return TF.resized_crop(image, *box, [size, size], interpolation=mode, antialias=True)
    if image.shape[-2:] == (size, size):
        return image
    if preprocess.squash:
        return TF.resize(image, [size, size], interpolation=mode, antialias=True)
    return TF.center_crop(TF.resize(image, size, interpolation=mode, antialias=True), [size, size])


def decode_image(
    data: bytes, size: int, rng: random.Random | None, scale_min: float, max_pixels: int | None, *,
    preprocess: Preprocess,
) -> torch.Tensor:
    """A (3, size, size) uint8 tensor: random resized crop and augmentation in training (rng given), the
    deterministic transform in evaluation."""
    image = load_rgb(data, size, max_pixels)
    if rng is None:
        return crop(image, size, None, preprocess)
    height, width = image.shape[-2:]
    image = crop(image, size, random_resized_crop_box(width, height, rng, (scale_min, 1.0)), preprocess)
    return preprocess.augment(image, rng)


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
