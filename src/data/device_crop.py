"""Training crops resized on the training device instead of in the loader's workers (`data.resize_on`).

A worker spends about a third of a 256-px image's time on the antialiased resize of its random crop (0.46 of 1.4 ms
on one core, docs/BENCHMARKS.md, end to end), and at ViT-B/32's rate an H200's 16 CPUs cannot keep up. With
`data.resize_on=device` a worker draws the same crop box from the same RNG, copies the box's pixels and a one-pixel
border into a fixed canvas (`data.device_resize_max_side`, by default 8/7 of the image size and the two border
pixels: 258 px at 224, so that every crop of a 256-px image fits) and ships the canvas with the box; the training
device resizes every crop of the batch in one `torchvision.ops.roi_align` call. A crop too large for the canvas is
resized in the worker as before and placed at the canvas's corner with an identity box, which the device copies
exactly.

The samples, the boxes and the resume position are the workers' exactly; the pixels differ slightly. `roi_align`
samples bilinearly at each output pixel's centre (one sample a bin), torchvision's resize filters with a triangle as
wide as the scale factor. Up to the canvas's 8/7 the two differ by a quarter to two-thirds of a grey level on
average (most for crops near 8/7 of a sharp photograph; tests/test_device_crop.py bounds it), and inside the image
the border pixels interpolate with the real neighbours rather than repeating the crop's edge. Colour jitter,
grayscale and bicubic resizing have no device path: `auto` keeps those runs in the workers, and `device` is refused
for them at preflight.
"""

from __future__ import annotations

import torch
from torchvision.ops import roi_align
from torchvision.transforms.v2 import functional as TF

from src.config import DataConfig
from src.data.image_text import Preprocess, image_bytes, load_rgb, random_resized_crop_box

AUTO = "auto"


def canvas_side(cfg: DataConfig, image_size: int) -> int:
    """The canvas's side in pixels: data.device_resize_max_side, or room for a crop of 8/7 of the image size and
    its one-pixel border (258 at 224: any crop of img2dataset's 256-px images)."""
    return cfg.device_resize_max_side or image_size * 8 // 7 + 2


def device_path_blocker(cfg: DataConfig) -> str | None:
    """What keeps this data configuration's crops in the workers, or None when the device can resize them."""
    if cfg.frames:
        return "video clips (data.frames > 0) are resized in the workers"
    if str(cfg.interpolation) != "bilinear":
        return f"data.interpolation={cfg.interpolation}: the device resizes bilinearly only"
    if cfg.color_jitter > 0 or cfg.grayscale_prob > 0:
        return "colour jitter and grayscale run in the workers, after the resize"
    return None


def resolve_resize_on(cfg: DataConfig, image_size: int, device: torch.device) -> tuple[int, str]:
    """The canvas side the workers ship crops in (0: they resize them), and one log line saying so and why."""
    blocker = device_path_blocker(cfg)
    if str(cfg.resize_on) == "workers" or blocker is not None:
        reason = "" if str(cfg.resize_on) == "workers" else f" ({blocker})"
        return 0, f"data: crops resized in the workers{reason}"
    if str(cfg.resize_on) == AUTO and device.type != "cuda":
        return 0, f"data: crops resized in the workers (auto: on {device.type} the workers' resize is the faster)"
    side = canvas_side(cfg, image_size)
    why = " (auto: on a GPU)" if str(cfg.resize_on) == AUTO else ""
    return side, f"data: crops up to {side - 2} px a side resized on the {device.type}{why}, larger ones in the workers"


def place_crop(image: torch.Tensor, box: tuple[int, int, int, int], size: int, canvas: int,
               interpolation: TF.InterpolationMode) -> tuple[torch.Tensor, torch.Tensor]:
    """A worker's half: uint8 (3, H, W) and the crop box (top, left, height, width) to a (3, canvas, canvas)
    uint8 canvas and the box in it as float32 (x1, y1, x2, y2). The box's pixels go to the canvas with a
    one-pixel border (the image's own pixels, or its edge repeated at the image's edge), so that bilinear samples
    near the crop's edge read what a resize of the whole image would; a crop larger than the canvas allows is
    resized here to (size, size) and gets the identity box."""
    top, left, h, w = box
    out = torch.zeros(3, canvas, canvas, dtype=torch.uint8)
    if h + 2 > canvas or w + 2 > canvas:
        out[:, :size, :size] = TF.resized_crop(image, top, left, h, w, [size, size], interpolation=interpolation,
                                               antialias=True)
        return out, torch.tensor([0.0, 0.0, size, size])
    height, width = image.shape[-2:]
    y0, x0 = max(top - 1, 0), max(left - 1, 0)
    y1, x1 = min(top + h + 1, height), min(left + w + 1, width)
    rows, cols = y1 - y0, x1 - x0
    out[:, :rows, :cols] = image[:, y0:y1, x0:x1]
    # At the image's edge the border is the edge repeated, as torchvision's resize clamps its samples there.
    out[:, :rows, cols:cols + 1] = out[:, :rows, cols - 1:cols]
    out[:, rows:rows + 1, :cols + 1] = out[:, rows - 1:rows, :cols + 1]
    return out, torch.tensor([left - x0, top - y0, left - x0 + w, top - y0 + h], dtype=torch.float32)


def decode_for_device(sample: dict, size: int, rng, scale_min: float, max_pixels: int | None, canvas: int,
                      preprocess: Preprocess) -> tuple[torch.Tensor, torch.Tensor]:
    """A training image sample to its canvas and box (`place_crop`), with the crop box `decode_image` draws from
    the same RNG."""
    image = load_rgb(image_bytes(sample), size, max_pixels)
    height, width = image.shape[-2:]
    box = random_resized_crop_box(width, height, rng, (scale_min, 1.0))
    return place_crop(image, box, size, canvas, preprocess.interpolation)


def resize_crops(canvases: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """The device's half: uint8 (B, 3, C, C) canvases and their (B, 4) boxes to the uint8 (B, 3, size, size)
    crops, in one roi_align call (float32, rounded back to grey levels as the workers' crops are)."""
    rois = torch.cat([torch.arange(len(boxes), device=boxes.device, dtype=boxes.dtype)[:, None], boxes], dim=1)
    crops = roi_align(canvases.float(), rois, (size, size), spatial_scale=1.0, sampling_ratio=1, aligned=True)
    return crops.round_().clamp_(0, 255).to(torch.uint8)
