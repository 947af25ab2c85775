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
    from src.data.device_decode import DeviceDecoder, collate_for_device, jpeg_for_device
    from src.data.image_text import Preprocess
    from src.kernels.resized_crop import resize_crops

    preprocess = Preprocess.from_config(compose_config([]).data)
    rng = random.Random(1)
    samples = [{"jpg": photo_jpeg(rng.randint(300, 1024), rng.randint(300, 1024)), "__key__": str(i)}
               for i in range(32)]
    items = [jpeg_for_device(s, 224, random.Random(i), 0.9, None, preprocess) for i, s in enumerate(samples)]
    tokens = torch.arange(32 * 4).view(32, 4)

    def decode(decoder):
        batch = {**collate_for_device(items, in_worker=False), "tokens": tokens.clone()}
        out, failed = decoder.result(decoder.submit(batch))
        return out["images"].cpu(), failed

    on_gpu = DeviceDecoder(torch.device("cuda"), 224, threads=1, resize_crops=resize_crops)
    (gpu, failed), (again, _) = decode(on_gpu), decode(on_gpu)  # the second into the first one's buffers
    cpu, _ = decode(DeviceDecoder(torch.device("cpu"), 224))
    assert failed == [] and gpu.shape == cpu.shape == (32, 3, 224, 224) and torch.equal(gpu, again)
    # Every phase of the GPU path was timed.
    assert set(on_gpu.phase_seconds) == {"split", "codestreams", "wait", "decode", "check", "crop", "place"}
    assert on_gpu.batches == 2 and on_gpu.host_seconds == pytest.approx(sum(on_gpu.phase_seconds.values()))
    on_gpu.close()
    # Two JPEG decoders (the chip's engines and libjpeg-turbo) differ by a grey level or two here and there.
    diff = (gpu.int() - cpu.int()).abs()
    assert diff.float().mean() < 1.0 and diff.max() <= 24, (diff.float().mean(), diff.max())
