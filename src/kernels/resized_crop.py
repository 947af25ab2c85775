"""Random resized crops of a batch of decoded images of any sizes, in two Triton kernels.

Images decoded on the GPU (`data.decode_on=device`, src/data/device_decode.py) arrive as (H, W, 3) uint8 images,
each of its own size in a buffer of its own (the decoder's), and a crop box (top, left, height, width) each. The
kernels take a table of the images' addresses, so the decoder's buffers are read where they are: no copy of the
batch's pixels into one buffer, and no tensor made for each image on the host. torchvision resizes one
image per call: a thousand calls a batch cost the host about 0.1 ms each. Here every crop of the batch is resized
in two launches, with the filter of torchvision's antialiased bilinear resize (`TF.resized_crop(...,
antialias=True)`, the workers' path): a triangle as wide as the scale factor, its taps clamped to the crop, the
weights of each output pixel normalised. The filter is separable: the first kernel resizes the crop's columns to
`size` rows (float16 between the passes: at most 1/16 of a grey level off), the second its rows to `size`
columns, rounding once at the end. torchvision's CPU path rounds to uint8 between its two passes and uses
fixed-point weights, so the two differ by at most one grey level (tests/test_resized_crop.py under Triton's
interpreter; tests/gpu/test_device_decode_cuda.py on an H200, 64 images of 100-1,100 px to 224).

Work a pixel: up to 2·⌈scale⌉ + 1 taps per pass, so a 1,024-px crop to 224 px is a dozen loads a pass.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the loader resizes with torchvision (src/data/device_decode.py)
    triton = None

COLUMNS = 256  # the first kernel's block of (column, channel) values of one output row
PIXELS = 64  # the second kernel's block of output pixels of one row


if triton is not None:
    @triton.jit
    def _taps(center, scale, length):
        """The first tap, the tap after the last and the inverse filter width of an output position, as torchvision
        computes them (upsample_bilinear2d_aa): support = scale when shrinking, 1 when enlarging."""
        support = tl.maximum(scale, 1.0)
        first = tl.maximum((center - support + 0.5).to(tl.int32), 0)
        last = tl.minimum((center + support + 0.5).to(tl.int32), length)
        return first, last, 1.0 / support

    @triton.jit
    def _columns_kernel(addresses, widths, boxes, mid, mid_offsets, size, COLUMNS: tl.constexpr):
        """mid[b] (size, crop width, 3) float16: image b's crop, its columns resized to `size` rows."""
        b, row, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        top, left = tl.load(boxes + 4 * b), tl.load(boxes + 4 * b + 1)
        height, width = tl.load(boxes + 4 * b + 2), tl.load(boxes + 4 * b + 3)
        values = block * COLUMNS + tl.arange(0, COLUMNS)  # (column, channel) pairs of the crop's row
        inside = values < width * 3
        if block * COLUMNS < width * 3:
            scale = height.to(tl.float32) / size
            center = scale * (row + 0.5)
            first, last, inverse = _taps(center, scale, height)
            image = tl.load(addresses + b).to(tl.pointer_type(tl.uint8)) + (top * tl.load(widths + b) + left) * 3
            acc = tl.zeros([COLUMNS], dtype=tl.float32)
            total = scale * 0.0
            for y in range(first, last):
                weight = tl.maximum(1.0 - tl.abs((y - center + 0.5) * inverse), 0.0)
                acc += weight * tl.load(image + y * tl.load(widths + b) * 3 + values, mask=inside).to(tl.float32)
                total += weight
            out = mid + tl.load(mid_offsets + b) + row * width * 3 + values
            tl.store(out, (acc / total).to(tl.float16), mask=inside)

    @triton.jit
    def _rows_kernel(mid, mid_offsets, boxes, out, size, max_taps, PIXELS: tl.constexpr):
        """out[b] (3, size, size) uint8: mid[b]'s rows resized to `size` columns, rounded."""
        b, row, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        width = tl.load(boxes + 4 * b + 3)
        columns = block * PIXELS + tl.arange(0, PIXELS)
        inside = columns < size
        scale = width.to(tl.float32) / size
        center = scale * (columns + 0.5)
        first, last, inverse = _taps(center, scale, width)
        line = mid + tl.load(mid_offsets + b) + row * width * 3
        r = tl.zeros([PIXELS], dtype=tl.float32)
        g = tl.zeros([PIXELS], dtype=tl.float32)
        bl = tl.zeros([PIXELS], dtype=tl.float32)
        total = tl.zeros([PIXELS], dtype=tl.float32)
        for k in range(0, max_taps):
            x = first + k
            use = inside & (x < last)
            weight = tl.where(use, tl.maximum(1.0 - tl.abs((x - center + 0.5) * inverse), 0.0), 0.0)
            r += weight * tl.load(line + x * 3, mask=use, other=0.0).to(tl.float32)
            g += weight * tl.load(line + x * 3 + 1, mask=use, other=0.0).to(tl.float32)
            bl += weight * tl.load(line + x * 3 + 2, mask=use, other=0.0).to(tl.float32)
            total += weight
        total = tl.where(inside, total, 1.0)
        plane = out + b * 3 * size * size + row * size + columns
        tl.store(plane, tl.minimum(tl.maximum(r / total + 0.5, 0.0), 255.0).to(tl.uint8), mask=inside)
        tl.store(plane + size * size, tl.minimum(tl.maximum(g / total + 0.5, 0.0), 255.0).to(tl.uint8), mask=inside)
        tl.store(plane + 2 * size * size, tl.minimum(tl.maximum(bl / total + 0.5, 0.0), 255.0).to(tl.uint8),
                 mask=inside)


def resize_crops(addresses: torch.Tensor, widths: torch.Tensor, boxes: torch.Tensor, size: int,
                 device: torch.device) -> torch.Tensor:
    """(B, 3, size, size) uint8 crops, on `device`, of B images there: image b is a C-contiguous (H_b, W_b, 3) uint8
    array at address addresses[b] (its first byte, as `Tensor.data_ptr()` or `__cuda_array_interface__` give it),
    with widths[b] = W_b; boxes (B, 4) (top, left, height, width) inside each image. addresses, widths and boxes
    are host tensors (the loader's). The caller keeps the images alive until the kernels have read them (queued
    work on the current stream). A Triton kernel's job: on the CPU, src/data/device_decode.py's
    `resize_crops_reference` does it with torchvision."""
    count = len(boxes)
    out = torch.empty(count, 3, size, size, dtype=torch.uint8, device=device)
    if count == 0:
        return out
    boxes = boxes.to(torch.int64)
    crop_widths = boxes[:, 3]
    mid_offsets = torch.zeros(count, dtype=torch.int64)
    mid_offsets[1:] = torch.cumsum(crop_widths * 3 * size, 0)[:-1]
    mid = torch.empty(int(crop_widths.sum()) * 3 * size, dtype=torch.float16, device=device)
    # One copy to the device for the four small tables.
    tables = torch.cat([addresses.to(torch.int64), widths.to(torch.int64), mid_offsets, boxes.flatten()])
    tables = tables.to(device, non_blocking=True)
    addresses_d, widths_d, mid_offsets_d = tables[:count], tables[count : 2 * count], tables[2 * count : 3 * count]
    boxes_d = tables[3 * count :]
    widest = int(crop_widths.max())
    max_taps = int(2 * max(widest / size, 1.0)) + 3  # covers last - first at any position (see _taps)
    _columns_kernel[(count, size, triton.cdiv(widest * 3, COLUMNS))](
        addresses_d, widths_d, boxes_d, mid, mid_offsets_d, size, COLUMNS=COLUMNS)
    _rows_kernel[(count, size, triton.cdiv(size, PIXELS))](
        mid, mid_offsets_d, boxes_d, out, size, max_taps, PIXELS=PIXELS)
    return out
