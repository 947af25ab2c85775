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
plain 8-bit JPEGs by their header (PNG, WebP, 12-bit JPEGs, ...) are decoded and cropped in the worker as before and
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

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from importlib.util import find_spec

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as TF

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

log = logging.getLogger(__name__)

NVIMGCODEC_WHEELS = "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg (CUDA 13; the -cu12 wheels for CUDA 12)"


def nvimgcodec_missing() -> str | None:
    """Why the GPU cannot decode and crop here, or None: nvImageCodec decodes, Triton runs the crop kernels."""
    if find_spec("nvidia") is None or find_spec("nvidia.nvimgcodec") is None:
        return f"nvImageCodec is not installed ({NVIMGCODEC_WHEELS})"
    if find_spec("triton") is None:
        return "Triton, which runs the crop kernels, is not installed (pip install triton, or the gpu extra)"
    return None


# The JPEG engines first, then nvJPEG on the SMs with the host's help for what they cannot decode (progressive
# JPEGs); where the engines cannot be opened (a GPU without them, or all taken), nvJPEG alone.
BACKEND_CHOICES = (("HW_GPU_ONLY", "HYBRID_CPU_GPU"), ("HYBRID_CPU_GPU",))
# The hardware work queues the driver gives the process per GPU (its maximum; the default is 8). Streams beyond them
# share a queue, and work waits for everything queued before it on its queue, whatever its stream: a decoder stream
# sharing a queue with the training step has each of its short kernels wait for one of the step's. Beside a matmul
# load on an H100, one decode of 1,024 photographs took 2.7 s with the default and 0.12 s with 32 (docs/data.md).
CUDA_QUEUES = 32

# The decode threads' CUDA stream priority (lower is higher; torch clamps it to the range it supports). nvJPEG's
# hardware path waits on the host for each image's colour-conversion kernel before it sends the next image, and on a
# stream of the default priority that kernel's blocks may wait for SMs behind the training step's. A negative value
# lets them go first; whether that shortens a decode call beside training is for `bench/throughput.py --end-to-end
# --set "py:src.data.device_decode.DECODE_STREAM_PRIORITY=-1"` to show.
DECODE_STREAM_PRIORITY = 0


def widen_cuda_queues() -> None:
    """Ask the driver for CUDA_QUEUES hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`) unless the environment already
    says how many. The driver reads it when CUDA starts: call this before the process's first CUDA call."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(CUDA_QUEUES))


# By default a decoder runs a host thread per core, each with a CUDA stream of its own. The engines need the host only
# to parse headers, and those streams would take the hardware queues that keep the decoder's short kernels from
# waiting behind the training step's (`widen_cuda_queues`): with one stream and two threads a decoder keeps up with
# ViT-B/32 on an H100 (0.90x its compute-only rate end to end, against 0.58x with the defaults; docs/data.md).
DECODER_OPTIONS = ":num_cuda_streams=1"
DECODER_HOST_THREADS = 2


def open_decoder(nvimgcodec, device_index: int):
    """An nvImageCodec decoder on the first backends of BACKEND_CHOICES that open; a fallback is logged."""
    failures = []
    for kinds in BACKEND_CHOICES:
        backends = [nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind)) for kind in kinds]
        try:
            decoder = nvimgcodec.Decoder(device_id=device_index, backends=backends, options=DECODER_OPTIONS,
                                         max_num_cpu_threads=DECODER_HOST_THREADS)
        except RuntimeError as err:
            failures.append(f"{'+'.join(kinds)}: {err}")
            continue
        if failures:
            log.warning("data: nvImageCodec could not open %s; decoding with %s", "; ".join(failures), "+".join(kinds))
        return decoder
    raise RuntimeError(f"nvImageCodec could not open a JPEG decoder on cuda:{device_index} ({'; '.join(failures)}): "
                       "set data.decode_on=workers")


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
    "decoded_index" (K,). In a worker the bytes and the crops go straight to shared memory, as default_collate's
    tensors do."""
    jpegs = [item if isinstance(item, tuple) else None for item in items]
    lengths = torch.tensor([0 if j is None else len(j[0]) for j in jpegs], dtype=torch.int64)
    flat = torch.empty(int(lengths.sum()), dtype=torch.uint8)
    if in_worker:
        flat.share_memory_()
    torch.cat([j[0] for j in jpegs if j is not None] or [flat[:0]], out=flat)
    meta = torch.stack([torch.zeros(6, dtype=torch.int32) if j is None else j[1] for j in jpegs])
    index = [i for i, j in enumerate(jpegs) if j is None]
    decoded = torch.zeros(0, dtype=torch.uint8)
    if index:
        decoded = torch.empty(len(index), *items[index[0]].shape, dtype=torch.uint8)
        if in_worker:
            decoded.share_memory_()
        torch.stack([items[i] for i in index], out=decoded)
    return {"jpeg_bytes": flat, "jpeg_lengths": lengths, "jpeg_meta": meta, "decoded": decoded,
            "decoded_index": torch.tensor(index, dtype=torch.int64)}


# (the images' device addresses, their widths, (B, 4) boxes, size, device) -> (B, 3, size, size), as in
# src/kernels/resized_crop.py
ResizeCrops = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.device], torch.Tensor]
# A decoded image: its address and what owns the memory there (an nvImageCodec image, or a tensor decoded on the host)
Decoded = tuple[int, object]


def decoded_address(image, height: int, width: int) -> int | None:
    """The address of a decoded image that is a C-contiguous (height, width, 3) uint8 array, else None. `image`: a
    tensor, or anything with `__cuda_array_interface__` (nvImageCodec's images), read without making a tensor of
    it: a thousand tensors a batch cost a decode thread tens of milliseconds of the GIL."""
    if isinstance(image, torch.Tensor):
        ok = image.dtype == torch.uint8 and tuple(image.shape) == (height, width, 3) and image.is_contiguous()
        return image.data_ptr() if ok else None
    face = image.__cuda_array_interface__
    strides = face.get("strides")
    if (face["typestr"] != "|u1" or tuple(face["shape"]) != (height, width, 3)
            or (strides is not None and tuple(strides) != (width * 3, 3, 1))):
        return None
    return face["data"][0]


def resize_crops_reference(images: list[torch.Tensor], boxes: list[tuple[int, int, int, int]],
                           size: int) -> torch.Tensor:
    """(B, 3, size, size) uint8: each (H, W, 3) uint8 image's box (top, left, height, width) resized by torchvision,
    as the loader's workers resize crops."""
    return torch.stack([TF.resized_crop(image.permute(2, 0, 1), *box, [size, size], antialias=True)
                        for image, box in zip(images, boxes)])


class PhaseClock:
    """Wall seconds a decode thread spends in each phase of a batch: `lap(name)` charges the time since the last lap
    to `name`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


class DeviceDecoder:
    """The training process's half: `collate_for_device` batches to "images" (B, 3, size, size) uint8 on `device`,
    in `threads` threads of their own, so that the next batches decode while the training step runs (nvImageCodec
    and the CUDA calls release the GIL). Each thread has its decoder, its CUDA stream and the decoded images of its
    last batch, whose buffers the next batch reuses rather than allocating a thousand new ones. `submit` starts a
    batch, `result` (on the training thread) makes the training stream wait for it, and returns it with the
    indices of the samples that could not be decoded (replaced by the first sample). `phase_seconds`: the decode
    threads' wall time by phase (PhaseClock), summed over the batches, so a benchmark can say where a batch's time
    goes when the decoding sets the pace: "split" (the batch's bytes into JPEGs), "codestreams" (nvImageCodec
    parses the headers), "wait" (for the GPU to finish this thread's last batch, whose buffers this one reuses),
    "decode", "check" (each decoded image's shape checked and its address read), "crop" (the crops resized),
    "place" (the batch assembled)."""

    def __init__(self, device: torch.device, size: int, threads: int = 2, resize_crops: ResizeCrops | None = None):
        # `resize_crops`: the batched kernels (src/kernels/resized_crop.py), which the caller passes in, as the data
        # package imports no kernel module; without it, on a CPU, torchvision resizes one crop at a time.
        self.device, self.size, self.resize_crops = device, size, resize_crops
        self.threads = threads
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # started by the first batch
        self.local = threading.local()
        self.phase_seconds: dict[str, float] = {}
        self.batches = 0
        self.on_gpu = device.type == "cuda"
        queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        if self.on_gpu and queues != str(CUDA_QUEUES):
            log.warning("data: CUDA_DEVICE_MAX_CONNECTIONS=%s: the decode threads' CUDA streams share hardware queues "
                        "with the training step and decode several times slower beside it. Unset it (train.py asks "
                        "for %d before CUDA starts) or set it to %d", queues or "unset (the driver's 8)", CUDA_QUEUES,
                        CUDA_QUEUES)

    def _state(self):
        """This thread's decoder, stream and last batch's images, made on first use."""
        if not hasattr(self.local, "decoder"):
            from nvidia import nvimgcodec

            self.local.decoder = open_decoder(nvimgcodec, self.device.index or 0)
            self.local.params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                                        color_spec=nvimgcodec.ColorSpec.SRGB)
            self.local.stream = torch.cuda.Stream(self.device, priority=DECODE_STREAM_PRIORITY)
            self.local.images = []
            self.local.held = []  # the last batch's decoded images, which its crops read
            self.local.codestream = nvimgcodec.CodeStream
        return self.local

    def _decode_on_host(self, data: np.ndarray, height: int, width: int) -> torch.Tensor | None:
        """(H, W, 3) uint8 on the device from torchvision's CPU decoder, or None when it cannot decode it either."""
        try:
            image = decode_jpeg(torch.from_numpy(data), mode=ImageReadMode.RGB)
        except RuntimeError:
            return None
        if tuple(image.shape[1:]) != (height, width):
            return None
        return image.permute(1, 2, 0).contiguous().to(self.device)

    @property
    def host_seconds(self) -> float:
        """The decode threads' wall time, summed over the batches."""
        return sum(self.phase_seconds.values())

    def _decode(self, chunks: list[np.ndarray], shapes: list[tuple[int, int]],
                clock: PhaseClock) -> list[Decoded | None]:
        """Each JPEG decoded on the device: its address and owner, or None where neither the GPU nor the host
        could decode it."""
        if not self.on_gpu:
            images = [self._decode_on_host(data, *shape) for data, shape in zip(chunks, shapes)]
            clock.lap("decode")
            return [None if image is None else (image.data_ptr(), image) for image in images]
        state = self._state()
        streams = [state.codestream(data) for data in chunks]
        clock.lap("codestreams")
        # The last batch's crops read its images on this stream: done before their buffers are written again or
        # freed (a millisecond's wait of this thread, not of the training step).
        state.stream.synchronize()
        state.held = []
        clock.lap("wait")
        reuse = state.images[: len(streams)] if len(state.images) >= len(streams) else None
        decoded = state.decoder.decode(streams, images=reuse, params=state.params,
                                       cuda_stream=state.stream.cuda_stream)
        if reuse is None and None not in decoded:
            state.images = decoded
        clock.lap("decode")
        out = []
        for image, data, (height, width) in zip(decoded, chunks, shapes):
            address = None if image is None else decoded_address(image, height, width)
            if address is None:
                image = self._decode_on_host(data, height, width)
                address = None if image is None else image.data_ptr()
            out.append(None if address is None else (address, image))
        clock.lap("check")
        return out

    def _run(self, batch: dict) -> tuple[dict, list[int], torch.cuda.Event | None, dict[str, float]]:
        clock = PhaseClock()
        lengths, meta = batch.pop("jpeg_lengths").tolist(), batch.pop("jpeg_meta")
        flat, decoded, decoded_index = batch.pop("jpeg_bytes"), batch.pop("decoded"), batch.pop("decoded_index")
        bytes_np, rows = flat.numpy(), meta.tolist()
        jpeg_index, chunks, end = [], [], 0
        for i, length in enumerate(lengths):
            if length:
                jpeg_index.append(i)
                chunks.append(bytes_np[end : end + length])
                end += length
        clock.lap("split")
        # Allocated and written on this thread's stream, so that nothing queued on the training stream can still
        # be using this memory; the training stream waits for it in `result` and owns it from there on.
        stream = self._state().stream if self.on_gpu else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            images = torch.empty(len(lengths), 3, self.size, self.size, dtype=torch.uint8, device=self.device)
            shapes = [(rows[i][4], rows[i][5]) for i in jpeg_index]
            pictures = self._decode(chunks, shapes, clock) if jpeg_index else []
            failed = [i for i, picture in zip(jpeg_index, pictures) if picture is None]
            good = [(i, picture) for i, picture in zip(jpeg_index, pictures) if picture is not None]
            if good:
                index = [i for i, _ in good]
                boxes = [rows[i][:4] for i in index]
                if self.resize_crops is None:
                    images_hwc = [o if isinstance(o, torch.Tensor) else torch.as_tensor(o, device=self.device)
                                  for _, (_, o) in good]
                    crops = resize_crops_reference(images_hwc, boxes, self.size)
                else:
                    self.local.held = [owner for _, (_, owner) in good]  # alive until the kernels have read them
                    crops = self.resize_crops(torch.tensor([address for _, (address, _) in good], dtype=torch.int64),
                                              torch.tensor([rows[i][5] for i in index]),
                                              torch.tensor(boxes, dtype=torch.int32), self.size, self.device)
                clock.lap("crop")
                if len(index) == len(lengths):
                    images = crops
                else:
                    images[torch.tensor(index, device=self.device)] = crops
            if len(decoded_index):
                images[decoded_index.to(self.device)] = decoded.to(self.device, non_blocking=True)
            if len(failed) == len(lengths):
                raise RuntimeError(f"none of a batch's {len(lengths)} JPEGs could be decoded, on the device or the "
                                   "host: check the shards with scripts/inspect_shards.py, or set "
                                   "data.decode_on=workers, which skips corrupt images")
            if failed:
                first = next(i for i in range(len(lengths)) if i not in failed)
                images[failed] = images[first].clone()
                batch["tokens"][failed] = batch["tokens"][first].clone()
            event = stream.record_event() if stream is not None else None
        batch["images"] = images
        clock.lap("place")
        return batch, failed, event, clock.seconds

    @property
    def depth(self) -> int:
        """Batches a loader keeps submitted: one more than the threads, so that a thread that finishes a batch
        starts the next at once. With only as many as the threads, the next batch is submitted when the training
        loop asks for one, after its wait for the oldest, and each pair of batches costs the loop's time between
        two asks on top of a thread's decoding."""
        return self.threads + 1

    def submit(self, batch: dict) -> concurrent.futures.Future:
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="decode")
        return self.pool.submit(self._run, batch)

    def result(self, future: concurrent.futures.Future) -> tuple[dict, list[int]]:
        batch, failed, event, seconds = future.result()
        for phase, value in seconds.items():  # summed here, on the one training thread
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + value
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            batch["images"].record_stream(current)
        self.batches += 1
        return batch, failed

    def close(self) -> None:
        """Ends the decode threads (a batch being decoded finishes first; queued ones are dropped), and with them
        their decoders and buffers. The next `submit` starts new ones."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
