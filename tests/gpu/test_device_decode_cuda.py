"""data.decode_on=device on CUDA: nvImageCodec's decode and the resized-crop kernels against the CPU reference
path (run on the device: `python -m pytest -q -n 0 --noconftest tests/gpu`; needs the nvImageCodec wheels)."""

import io
import random

import pytest
import torch
from PIL import Image
from skimage import data as photos

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")
pytest.importorskip("nvidia.nvimgcodec")


def photo_jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(photos.astronaut()).resize((width, height), Image.BILINEAR).save(out, "JPEG", quality=90)
    return out.getvalue()


def decode(decoder, items: list) -> tuple[torch.Tensor, list[int]]:
    """`jpeg_for_device` items as one loader batch through `decoder`: its images on the CPU, and the failures."""
    from src.data.device_decode import collate_for_device

    batch = {**collate_for_device(items, in_worker=False), "tokens": torch.arange(len(items) * 4).view(-1, 4)}
    out, failed = decoder.result(decoder.submit(batch))
    return out["images"].cpu(), failed


def test_resize_crops_on_cuda_match_torchvision_within_one_level():
    from src.data.device_decode import resize_crops_reference
    from src.data.image_text import random_resized_crop_box
    from src.kernels.resized_crop import resize_crops

    rng = random.Random(0)
    torch.manual_seed(0)
    sizes = [(rng.randint(100, 1100), rng.randint(100, 1100)) for _ in range(64)]
    images = [(torch.rand(h, w, 3, device="cuda") * 255).to(torch.uint8) for h, w in sizes]
    boxes = [random_resized_crop_box(w, h, rng, (0.3, 1.0)) for h, w in sizes]
    got = resize_crops(torch.tensor([i.data_ptr() for i in images]), torch.tensor([w for _, w in sizes]),
                       torch.tensor(boxes, dtype=torch.int32), 224, torch.device("cuda"))
    want = resize_crops_reference([i.cpu() for i in images], boxes, 224)
    assert (got.cpu().int() - want.int()).abs().max() <= 1


def test_the_gpu_decodes_a_loader_batch_as_the_cpu_reference_does():
    from src.compose import compose_config
    from src.data.device_decode import DeviceDecoder, jpeg_for_device
    from src.data.image_text import Preprocess
    from src.kernels.resized_crop import resize_crops

    preprocess = Preprocess.from_config(compose_config([]).data)
    rng = random.Random(1)
    samples = [{"jpg": photo_jpeg(rng.randint(300, 1024), rng.randint(300, 1024)), "__key__": str(i)}
               for i in range(32)]
    items = [jpeg_for_device(s, 224, random.Random(i), 0.9, None, preprocess) for i, s in enumerate(samples)]

    on_gpu = DeviceDecoder(torch.device("cuda"), 224, threads=1, resize_crops=resize_crops)
    (gpu, failed), (again, _) = decode(on_gpu, items), decode(on_gpu, items)  # the second into the first one's buffers
    cpu, _ = decode(DeviceDecoder(torch.device("cpu"), 224), items)
    assert failed == [] and gpu.shape == cpu.shape == (32, 3, 224, 224) and torch.equal(gpu, again)
    # Every phase of the GPU path was timed.
    assert set(on_gpu.phase_seconds) == {"split", "codestreams", "wait", "decode", "check", "crop", "place"}
    assert on_gpu.batches == 2 and on_gpu.host_seconds == pytest.approx(sum(on_gpu.phase_seconds.values()))
    on_gpu.close()
    # Two JPEG decoders (the chip's engines and libjpeg-turbo) differ by a grey level or two here and there.
    diff = (gpu.int() - cpu.int()).abs()
    assert diff.float().mean() < 1.0 and diff.max() <= 24, (diff.float().mean(), diff.max())


def test_a_split_batch_resizes_the_workers_canvases_on_the_gpu_as_on_the_cpu():
    """data.decode_on=auto: the JPEGs that fit the canvas come decoded from the workers as canvases, resized on the
    decode thread's stream by the roi_align of data.resize_on=device; the rest are decoded by the GPU."""
    from src.compose import compose_config
    from src.data.device_decode import DeviceDecoder, jpeg_for_device
    from src.data.image_text import Preprocess
    from src.kernels.resized_crop import resize_crops

    preprocess = Preprocess.from_config(compose_config([]).data)
    rng = random.Random(2)
    sizes = [(rng.randint(120, 256), rng.randint(120, 256)) if i % 2 else (rng.randint(300, 900), rng.randint(300, 900))
             for i in range(32)]
    items = [jpeg_for_device({"jpg": photo_jpeg(w, h)}, 224, random.Random(i), 0.3, None, preprocess, canvas=258)
             for i, (w, h) in enumerate(sizes)]
    assert sum(isinstance(item, tuple) and item[0].shape == (3, 258, 258) for item in items) == 16

    on_gpu = DeviceDecoder(torch.device("cuda"), 224, threads=1, resize_crops=resize_crops)
    gpu, failed = decode(on_gpu, items)
    cpu, _ = decode(DeviceDecoder(torch.device("cpu"), 224), items)
    assert failed == [] and "canvases" in on_gpu.phase_seconds
    on_gpu.close()
    small = (gpu[1::2].int() - cpu[1::2].int()).abs()  # the same canvases, roi_align on two devices
    assert small.max() <= 1, small.max()
    large = (gpu[::2].int() - cpu[::2].int()).abs()
    assert large.float().mean() < 1.0 and large.max() <= 24, (large.float().mean(), large.max())
