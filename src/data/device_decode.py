"""Training JPEGs decoded by the GPU's JPEG engines and cropped there (`data.decode_on`).

A worker spends most of a photograph's time decoding it: 1.5 of about 2.5 ms of one core for a 512-1,024-px JPEG
(PIL's reduced-size `draft` decoding included), so 12 workers feed about 4,400 photos/s where ViT-B/32 on an H200
takes 9,500 (docs/BENCHMARKS.md, end to end). An H100 or H200 has hardware JPEG decoders beside its SMs;
nvImageCodec (`nvidia-nvimgcodec-cu13` and `nvidia-nvjpeg`, wheels from the registry) drives them, and decodes a
batch of those photos at about 14,000 images/s in one process, for 0.09 ms of host CPU an image.

With `data.decode_on=device` a worker reads the JPEG's size from its header, draws the crop box from the same RNG
as the workers' path, and ships the undecoded bytes with the box (`jpeg_for_device`, `collate_for_device`). The
training process decodes the batch (`DeviceDecoder`: nvImageCodec on a side stream) and resizes every crop in two
Triton kernels (src/kernels/resized_crop.py, torchvision's antialiased bilinear filter). Images that are not
plain 8-bit JPEGs by their header (PNG, WebP, CMYK, ...) are decoded and cropped in the worker as before and
travel beside the bytes.

What stays the same: the samples, their order, the resume position and the crop boxes. For a JPEG at least twice
the crop size the workers' path decodes at 1/2, 1/4 or 1/8 scale (PIL's `draft`) and draws the box in those
pixels; here the box is drawn in the same reduced pixels and scaled back to the full image
(`workers_crop_box`), so it covers the same region, and the crop is resized from the full-resolution pixels. What
differs: the pixels, slightly (a different JPEG decoder, the resize from full resolution rather than from the
reduced decode, and one rounding instead of torchvision's two; tests/test_device_decode.py bounds it where both
decode at full size). A JPEG whose header passes but which the GPU cannot decode is decoded on the host instead;
one neither can decode is counted as `corrupt_image` and its place in the batch taken by a copy of the batch's
first sample (image and caption), as the batch's shape is fixed once it left the worker.

On a CPU (`data.decode_on=device` there is for tests) the same batches are decoded by torchvision and cropped by
torchvision's resize: bit for bit the workers' batches for JPEGs under twice the crop size.
"""

from __future__ import annotations

import contextlib
import importlib.util

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from src.config import DataConfig
from src.data.device_crop import AUTO, device_path_blocker
from src.data.image_text import (
    Preprocess,
    check_decodable,
    decode_image,
    image_bytes,
    jpeg_size,
    random_resized_crop_box,
)

NVIMGCODEC_WHEELS = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg (CUDA 13; the -cu12 wheels for CUDA 12)"


def nvimgcodec_missing() -> str | None:
    """Why nvImageCodec cannot decode here, or None."""
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.nvimgcodec") is None:
        return f"nvImageCodec is not installed ({NVIMGCODEC_WHEELS})"
    return None


def resolve_decode_on(cfg: DataConfig, device: torch.device) -> tuple[bool, str]:
    """Whether the training device decodes the training JPEGs, and one log line saying so and why."""
    blocker = device_path_blocker(cfg)
    if str(cfg.decode_on) == "workers" or blocker is not None:
        reason = "" if str(cfg.decode_on) == "workers" else f" ({blocker})"
        return False, f"data: training images decoded in the workers{reason}"
    if str(cfg.decode_on) == AUTO:
        if device.type != "cuda":
            return False, f"data: training images decoded in the workers (auto: no JPEG engines on {device.type})"
        missing = nvimgcodec_missing()
        if missing:
            return False, f"data: training images decoded in the workers (auto: {missing})"
    how = "nvImageCodec" if device.type == "cuda" else "torchvision, the reference path"
    why = " (auto: on a GPU)" if str(cfg.decode_on) == AUTO else ""
    return True, (f"data: training JPEGs decoded and cropped on the {device.type} ({how}){why}, other images in "
                  "the workers")


def draft_scale(width: int, height: int, size: int) -> int:
    """The factor by which the workers' path decodes a JPEG (`load_rgb`): PIL's `draft` to (size, size), which
    takes the largest of 8, 4, 2 that fits in both sides' quotient, for JPEGs at least twice `size`; else 1."""
    if min(width, height) < 2 * size:
        return 1
    quotient = min(width // size, height // size)
    return next(s for s in (8, 4, 2, 1) if quotient >= s)


def workers_crop_box(width: int, height: int, size: int, rng, scale_min: float) -> tuple[int, int, int, int]:
    """The crop box the workers' path draws (top, left, height, width), in the full image's pixels: drawn in the
    pixels of its reduced decode and scaled back, clipped to the image."""
    s = draft_scale(width, height, size)
    top, left, h, w = random_resized_crop_box(-(-width // s), -(-height // s), rng, (scale_min, 1.0))
    top, left = top * s, left * s
    return top, left, min(h * s, height - top), min(w * s, width - left)


def jpeg_for_device(sample: dict, size: int, rng, scale_min: float, max_pixels: int | None,
                    preprocess: Preprocess) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """A training image sample for the device to decode: (its JPEG bytes as uint8, int32 [top, left, height,
    width, image height, image width]); or, for an image that is not a plain JPEG by its header, its (3, size,
    size) crop, decoded here as the workers' path does."""
    data = image_bytes(sample)
    frame = jpeg_size(data)
    if frame is None:
        return decode_image(data, size, rng, scale_min, max_pixels, preprocess=preprocess)
    width, height = frame
    check_decodable(width, height, max_pixels)
    box = workers_crop_box(width, height, size, rng, scale_min)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), torch.tensor([*box, height, width], dtype=torch.int32)


def collate_for_device(items: list, in_worker: bool) -> dict[str, torch.Tensor]:
    """A batch of `jpeg_for_device` results: "jpeg_bytes" (all JPEGs end to end), "jpeg_lengths" (B,), "jpeg_meta"
    (B, 6; a decoded image's row is zeros) and the crops decoded in the worker, "decoded" (K, 3, S, S) at
    "decoded_index" (K,). In a worker the bytes go straight to shared memory, as default_collate's tensors do."""
    jpegs = [item if isinstance(item, tuple) else None for item in items]
    lengths = torch.tensor([0 if j is None else len(j[0]) for j in jpegs], dtype=torch.int64)
    flat = torch.empty(int(lengths.sum()), dtype=torch.uint8)
    if in_worker:
        flat.share_memory_()
    torch.cat([j[0] for j in jpegs if j is not None] or [flat[:0]], out=flat)
    meta = torch.stack([torch.zeros(6, dtype=torch.int32) if j is None else j[1] for j in jpegs])
    index = [i for i, j in enumerate(jpegs) if j is None]
    decoded = torch.stack([items[i] for i in index]) if index else torch.zeros(0, dtype=torch.uint8)
    return {"jpeg_bytes": flat, "jpeg_lengths": lengths, "jpeg_meta": meta, "decoded": decoded,
            "decoded_index": torch.tensor(index, dtype=torch.int64)}


class DeviceDecoder:
    """The training process's half: a `collate_for_device` batch to "images" (B, 3, size, size) uint8 on `device`.
    Returns the batch and the indices of the samples that could not be decoded (replaced by the first sample)."""

    def __init__(self, device: torch.device, size: int):
        # Here rather than at the top: the data package loads no kernel module (and so no Triton) until asked to.
        from src.kernels import resized_crop

        self.device, self.size, self.kernels = device, size, resized_crop
        self.decoder = None
        if device.type == "cuda":
            from nvidia import nvimgcodec

            # The JPEG engines first; nvJPEG on the SMs and host for what they cannot decode (progressive JPEGs).
            backends = [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY),
                        nvimgcodec.Backend(nvimgcodec.BackendKind.HYBRID_CPU_GPU)]
            self.decoder = nvimgcodec.Decoder(device_id=device.index or 0, backends=backends)
            self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB)
            self.stream = torch.cuda.Stream(device)

    def _decode_on_host(self, data: np.ndarray, meta: torch.Tensor) -> torch.Tensor | None:
        """(H, W, 3) uint8 on the device from torchvision's CPU decoder, or None when it cannot decode it either."""
        try:
            image = decode_jpeg(torch.from_numpy(data), mode=ImageReadMode.RGB)
        except RuntimeError:
            return None
        if tuple(image.shape[1:]) != (int(meta[4]), int(meta[5])):
            return None
        return image.permute(1, 2, 0).contiguous().to(self.device)

    def _decode(self, chunks: list[np.ndarray], metas: torch.Tensor) -> list[torch.Tensor | None]:
        if self.decoder is None:
            return [self._decode_on_host(data, meta) for data, meta in zip(chunks, metas)]
        from nvidia import nvimgcodec

        streams = [nvimgcodec.CodeStream(data) for data in chunks]
        images = self.decoder.decode(streams, params=self.params, cuda_stream=self.stream.cuda_stream)
        out = []
        for image, data, meta in zip(images, chunks, metas):
            tensor = None if image is None else torch.as_tensor(image, device=self.device)
            if tensor is None or tuple(tensor.shape) != (int(meta[4]), int(meta[5]), 3):
                tensor = self._decode_on_host(data, meta)
            out.append(tensor)
        return out

    def __call__(self, batch: dict) -> tuple[dict, list[int]]:
        lengths, meta = batch.pop("jpeg_lengths"), batch.pop("jpeg_meta")
        flat, decoded, decoded_index = batch.pop("jpeg_bytes"), batch.pop("decoded"), batch.pop("decoded_index")
        ends = torch.cumsum(lengths, 0).tolist()
        bytes_np = flat.numpy()
        jpeg_index = [i for i in range(len(lengths)) if lengths[i] > 0]
        chunks = [bytes_np[ends[i] - int(lengths[i]) : ends[i]] for i in jpeg_index]
        # Allocated and written on the side stream, so that nothing queued on the training stream can still be
        # using this memory; the training stream then waits for it and owns it from there on (record_stream).
        with torch.cuda.stream(self.stream) if self.decoder is not None else contextlib.nullcontext():
            images = torch.empty(len(lengths), 3, self.size, self.size, dtype=torch.uint8, device=self.device)
            pictures = self._decode(chunks, meta[jpeg_index]) if jpeg_index else []
            failed = [i for i, picture in zip(jpeg_index, pictures) if picture is None]
            good = [(i, picture) for i, picture in zip(jpeg_index, pictures) if picture is not None]
            if good:
                index = torch.tensor([i for i, _ in good])
                boxes = meta[index, :4]
                if self.decoder is None:
                    crops = self.kernels.resize_crops_reference([p for _, p in good], boxes.tolist(), self.size)
                else:
                    widths = meta[index, 5].to(torch.int64)
                    sizes = torch.tensor([p.numel() for _, p in good], dtype=torch.int64)
                    offsets = torch.cumsum(sizes, 0) - sizes
                    pixels = torch.cat([p.view(-1) for _, p in good])
                    crops = self.kernels.resize_crops(pixels, offsets, widths, boxes, self.size)
                images[index.to(self.device)] = crops
            if len(decoded_index):
                images[decoded_index.to(self.device)] = decoded.to(self.device, non_blocking=True)
        if self.decoder is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            images.record_stream(torch.cuda.current_stream(self.device))
        if failed:
            first = next(i for i in range(len(lengths)) if i not in failed)
            images[failed] = images[first].clone()
            batch["tokens"][failed] = batch["tokens"][first].clone()
        batch["images"] = images
        return batch, failed
