"""data.decode_on=device: the workers ship JPEG bytes and crop boxes, the training device decodes and crops them.
On a CPU the reference path (torchvision) gives the workers' batches bit for bit where both decode at full size;
for larger JPEGs the crops cover the same regions; other images, undecodable JPEGs, what `auto` picks and
preflight's refusals."""

import io
import os
import random
import tarfile
import threading
from dataclasses import replace

import pytest
import torch
from PIL import Image
from skimage import data as photos

from src.data import device_decode
from src.data.device_decode import DeviceDecoder, draft_scale, resolve_decode_on, workers_crop_box
from src.data.image_text import random_resized_crop_box
from src.data.loader import TrainLoader
from src.parallel.distributed import DistInfo
from src.trainer.preflight import preflight
from tests.conftest import compose_config, compose_unresolved, small_trainer
from tests.test_data import data_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
SIZE = 32


def jpeg(width: int, height: int, fmt: str = "JPEG") -> bytes:
    image = Image.fromarray(photos.astronaut()).resize((width, height), Image.BILINEAR)
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def undecodable_jpeg(width: int, height: int) -> bytes:
    """A JPEG whose header gives its size, but with no Huffman or quantisation tables: no decoder can decode it."""
    frame = b"\xff\xc0\x00\x11\x08" + height.to_bytes(2, "big") + width.to_bytes(2, "big") + (
        b"\x03\x01\x22\x00\x02\x11\x01\x03\x11\x01")
    scan = b"\xff\xda\x00\x0c\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00"
    return b"\xff\xd8" + frame + scan + bytes(range(256)) * 4 + b"\xff\xd9"


def write_shards(directory, images: list[tuple[str, bytes]], shards: int = 2) -> str:
    """`images` ((extension, bytes) each) with a caption each, round-robin over `shards` tar files."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        with tarfile.open(directory / f"s-{shard}.tar", "w") as tar:
            for i in range(shard, len(images), shards):
                ext, data = images[i]
                for name, payload in ((f"{i:05d}.{ext}", data), (f"{i:05d}.txt", f"picture {i}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return str(directory / f"s-{{0..{shards - 1}}}.tar")


def batches(pattern: str, decoder: DeviceDecoder | None, workers: int, count: int = 2, batch: int = 8) -> list:
    cfg = data_config(pattern, batch, workers, shuffle_buffer=10)
    loader = TrainLoader(cfg, image_size=SIZE, context_length=8, seed=3, decoder=decoder)
    out = [next(loader) for _ in range(count)]
    return out, loader


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_equal_the_workers_bit_for_bit_where_both_decode_at_full_size(tmp_path, workers):
    rng = random.Random(0)
    pattern = write_shards(tmp_path / "small", [("jpg", jpeg(rng.randint(33, 63), rng.randint(33, 63)))
                                                for _ in range(32)])
    want, _ = batches(pattern, None, workers)
    got, _ = batches(pattern, DeviceDecoder(CPU, SIZE), workers)
    for a, b in zip(want, got):
        assert a["keys"] == b["keys"] and torch.equal(a["tokens"], b["tokens"])
        assert b["images"].dtype == torch.uint8 and b["images"].shape == (8, 3, SIZE, SIZE)
        assert torch.equal(a["images"], b["images"])
        assert a["position"] == b["position"]


def test_large_jpegs_keep_the_workers_crop_regions(tmp_path, monkeypatch):
    """At least twice the crop size the workers decode at reduced scale (PIL's draft) and draw the box there; the
    device draws it in the same reduced pixels and scales it back, so the crops show the same regions. The pixels
    differ by the decodes (at 32 px from a 1/8-scale decode against a full one resized 8 times down); a box drawn
    in the full image's pixels instead would show other regions."""
    rng = random.Random(1)
    sizes = [(rng.randint(64, 300), rng.randint(64, 300)) for _ in range(32)]
    pattern = write_shards(tmp_path / "large", [("jpg", jpeg(w, h)) for w, h in sizes])
    want, _ = batches(pattern, None, 0, count=4)
    got, _ = batches(pattern, DeviceDecoder(CPU, SIZE), 0, count=4)
    monkeypatch.setattr(device_decode, "workers_crop_box", lambda width, height, size, rng, scale_min:
                        random_resized_crop_box(width, height, rng, (scale_min, 1.0)))
    naive, _ = batches(pattern, DeviceDecoder(CPU, SIZE), 0, count=4)
    assert [a["keys"] for a in want] == [b["keys"] for b in got] == [c["keys"] for c in naive]
    # Compared at 8 x 8 px, where the decodes' detail has averaged out and the regions' placement remains.
    coarse = [torch.cat([torch.nn.functional.avg_pool2d(x["images"].float(), 4) for x in run])
              for run in (want, got, naive)]
    aligned, other = (coarse[0] - coarse[1]).abs().mean(), (coarse[0] - coarse[2]).abs().mean()
    assert aligned < 3.0 and other > 2 * aligned, (aligned, other)


@pytest.mark.parametrize(("width", "height"), [(63, 200), (64, 64), (130, 97), (257, 511), (300, 70), (1000, 600)])
def test_the_draft_scale_is_pils(width, height):
    image = Image.open(io.BytesIO(jpeg(width, height)))
    scale = draft_scale(width, height, SIZE)
    if min(width, height) >= 2 * SIZE:
        image.draft("RGB", (SIZE, SIZE))
    assert image.size == (-(-width // scale), -(-height // scale))
    top, left, h, w = workers_crop_box(width, height, SIZE, random.Random(5), 0.9)
    assert 0 <= top and 0 <= left and 0 < h and 0 < w and top + h <= height and left + w <= width


def test_other_images_decode_in_the_workers_and_undecodable_jpegs_take_the_first_sample(tmp_path):
    images = [("jpg", jpeg(40, 50)), ("png", jpeg(45, 41, "PNG")), ("jpg", undecodable_jpeg(48, 48))]
    images += [("jpg", jpeg(50, 40)) for _ in range(5)]
    pattern = write_shards(tmp_path / "mixed", images, shards=1)
    (batch,), loader = batches(pattern, DeviceDecoder(CPU, SIZE), 0, count=1)
    (reference,), workers_loader = batches(pattern, None, 0, count=1)
    keys = batch["keys"]
    bad = keys.index("00002")
    assert torch.equal(batch["images"][bad], batch["images"][0]) and torch.equal(batch["tokens"][bad],
                                                                                 batch["tokens"][0])
    assert loader.bad_counts() == {"corrupt_image": 1} == workers_loader.bad_counts()
    assert loader.state_dict()["undecodable"] == 1
    png = keys.index("00001")  # decoded and cropped in the worker, exactly as the workers' path does
    assert torch.equal(batch["images"][png], reference["images"][reference["keys"].index("00001")])


def test_a_batch_of_nothing_decodable_is_refused_with_the_fix(tmp_path):
    pattern = write_shards(tmp_path / "broken", [("jpg", undecodable_jpeg(48, 48)) for _ in range(8)], shards=1)
    with pytest.raises(RuntimeError, match="none of a batch's 8 JPEGs could be decoded.*data.decode_on=workers"):
        batches(pattern, DeviceDecoder(CPU, SIZE), 0, count=1)


def test_auto_decodes_on_a_gpu_with_nvimgcodec_and_says_why_not(monkeypatch):
    data = compose_config([]).data
    monkeypatch.setattr(device_decode, "nvimgcodec_missing", lambda: None)
    assert resolve_decode_on(data, CUDA) == (True, "data: training JPEGs decoded and cropped on the cuda "
                                                    "(nvImageCodec) (auto: on a GPU), other images in the workers")
    assert resolve_decode_on(data, CPU) == (False, "data: training images decoded in the workers (auto: no JPEG "
                                                   "engines on cpu)")
    assert resolve_decode_on(replace(data, decode_on="device"), CPU)[0]
    assert not resolve_decode_on(replace(data, decode_on="workers"), CUDA)[0]
    on, line = resolve_decode_on(replace(data, grayscale_prob=0.1), CUDA)
    assert not on and "grayscale run in the workers" in line
    monkeypatch.setattr(device_decode, "nvimgcodec_missing", lambda: "nvImageCodec is not installed (pip ...)")
    assert resolve_decode_on(data, CUDA) == (False, "data: training images decoded in the workers (auto: "
                                                    "nvImageCodec is not installed (pip ...))")


def test_preflight_refuses_device_decoding_it_cannot_do(tmp_path):
    cfg = compose_config(["experiment=quickstart", "data.decode_on=device", "data.interpolation=bicubic"])
    with pytest.raises(ValueError, match="the configuration cannot run") as err:
        preflight(cfg, DistInfo(0, 1, 0, CPU), str(tmp_path))
    assert "data.decode_on=device cannot apply here: data.interpolation=bicubic" in str(err.value)


def test_a_cpu_run_with_device_decoding_trains(shapes, tmp_path):
    trainer = small_trainer(shapes, tmp_path / "run", "data.decode_on=device")
    assert trainer.loader.decoder is not None
    batch = next(trainer.loader)
    assert batch["images"].shape[-1] == 32 and "jpeg_bytes" not in batch
    losses = [trainer.train_step(next(trainer.loader))["loss"].item() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))


def new_decode_threads(before: set) -> set:
    """The live decode threads that were not in `before` (other tests' decoders may still be open)."""
    return {t for t in threading.enumerate() if t.name.startswith("decode")} - before


def test_close_ends_the_decode_threads_and_the_next_batch_continues_exactly(shapes):
    want, reference = batches(shapes["shards"], DeviceDecoder(CPU, SIZE), 1, count=5)
    reference.close()
    before = new_decode_threads(set())
    got, loader = batches(shapes["shards"], DeviceDecoder(CPU, SIZE), 1, count=2)
    assert new_decode_threads(before)
    loader.close()  # two batches were decoding ahead: they are read again
    assert not new_decode_threads(before)
    got += [next(loader) for _ in range(3)]
    assert [b["keys"] for b in got] == [b["keys"] for b in want]
    assert all(torch.equal(a["images"], b["images"]) for a, b in zip(got, want))
    loader.close()


class CountingDecoder(DeviceDecoder):
    """A CPU DeviceDecoder that counts the batches submitted to it."""

    submitted = 0

    def submit(self, batch: dict):
        self.submitted += 1
        return super().submit(batch)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_loader_keeps_one_batch_more_than_the_threads_submitted(shapes, threads):
    decoder = CountingDecoder(CPU, SIZE, threads=threads)
    got, loader = batches(shapes["shards"], decoder, 0, count=1)
    assert decoder.submitted == 1 + threads  # the batch returned, and a thread's worth ahead of it with one waiting
    next(loader)
    assert decoder.submitted == 2 + threads
    loader.close()


def test_fit_ends_the_decode_threads_however_it_ends(shapes, tmp_path):
    before = new_decode_threads(set())
    trainer = small_trainer(shapes, tmp_path / "run", "data.decode_on=device", "trainer.max_steps=2")
    trainer.fit()
    assert trainer.progress.step == 2 and not new_decode_threads(before)
    trainer = small_trainer(shapes, tmp_path / "failing", "data.decode_on=device", "trainer.max_steps=2")
    trainer.train_step = None  # fails at the first step, after the first batches were submitted
    with pytest.raises(TypeError):
        trainer.fit()
    assert not new_decode_threads(before)


class FakeNvimgcodec:
    """nvImageCodec's decoder constructor, refusing the backends named in `refused`."""

    def __init__(self, refused: set[str]):
        self.refused, self.opened = refused, []
        self.BackendKind = type("BackendKind", (), {k: k for k in ("HW_GPU_ONLY", "HYBRID_CPU_GPU")})

    def Backend(self, kind):  # noqa: N802 (nvImageCodec's name)
        return kind

    def Decoder(self, device_id, backends, options="", max_num_cpu_threads=0):  # noqa: N802
        if self.refused & set(backends):
            raise RuntimeError("Internal error - Could not create decoder. Code: 7")
        self.opened.append(backends)
        self.settings = {"options": options, "max_num_cpu_threads": max_num_cpu_threads}
        return "decoder"


def test_the_decoder_falls_back_from_the_jpeg_engines_and_says_so(caplog):
    fake = FakeNvimgcodec(set())
    assert device_decode.open_decoder(fake, 0) == "decoder" and fake.opened == [["HW_GPU_ONLY", "HYBRID_CPU_GPU"]]
    # one CUDA stream and two host threads, not one of each per core (whose streams would crowd the hardware queues)
    assert fake.settings == {"options": ":num_cuda_streams=1", "max_num_cpu_threads": 2}
    fake = FakeNvimgcodec({"HW_GPU_ONLY"})
    assert device_decode.open_decoder(fake, 0) == "decoder" and fake.opened == [["HYBRID_CPU_GPU"]]
    assert "could not open HW_GPU_ONLY+HYBRID_CPU_GPU: Internal error" in caplog.text
    with pytest.raises(RuntimeError, match="could not open a JPEG decoder on cuda:1 .*set data.decode_on=workers"):
        device_decode.open_decoder(FakeNvimgcodec({"HYBRID_CPU_GPU"}), 1)


class ArrayInterface:
    """A decoded image as nvImageCodec hands it over: only `__cuda_array_interface__`."""

    def __init__(self, shape, typestr="|u1", strides=None, address=4096):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": strides,
                                         "data": (address, False), "version": 3}


def test_a_decoded_images_address_is_read_only_where_the_crop_kernels_can_read_it():
    image = torch.zeros(5, 7, 3, dtype=torch.uint8)
    assert device_decode.decoded_address(image, 5, 7) == image.data_ptr()
    assert device_decode.decoded_address(image, 7, 5) is None  # not the size its header gave
    assert device_decode.decoded_address(image.transpose(0, 1).contiguous().transpose(0, 1), 5, 7) is None
    assert device_decode.decoded_address(image.float(), 5, 7) is None
    assert device_decode.decoded_address(ArrayInterface((5, 7, 3)), 5, 7) == 4096
    assert device_decode.decoded_address(ArrayInterface((5, 7, 3), strides=(21, 3, 1)), 5, 7) == 4096
    assert device_decode.decoded_address(ArrayInterface((5, 7, 3), strides=(32, 3, 1)), 5, 7) is None  # padded rows
    assert device_decode.decoded_address(ArrayInterface((5, 7, 1)), 5, 7) is None  # greyscale
    assert device_decode.decoded_address(ArrayInterface((5, 7, 3), typestr="<u2"), 5, 7) is None  # 16 bits


def test_auto_needs_triton_for_the_crop_kernels(monkeypatch):
    monkeypatch.setattr(device_decode, "find_spec", lambda name: None if name == "triton" else object())
    assert "Triton, which runs the crop kernels, is not installed" in device_decode.nvimgcodec_missing()


def unset_cuda_queues(monkeypatch) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS unset, and put back as it was after the test even where the code sets it (a
    bare delenv of an unset variable records nothing to undo)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")


def test_cuda_queues_are_widened_unless_the_environment_says_otherwise(monkeypatch):
    unset_cuda_queues(monkeypatch)
    device_decode.widen_cuda_queues()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    device_decode.widen_cuda_queues()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_train_widens_the_cuda_queues_before_cuda_starts(monkeypatch, tmp_path):
    import importlib

    run_module = importlib.import_module("src.trainer.run")  # the module: src.trainer's `run` is its function

    class Started(Exception):
        pass

    seen = []

    def init_distributed(device_name):  # where CUDA starts: what the driver would read then
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        raise Started

    unset_cuda_queues(monkeypatch)
    monkeypatch.setattr(run_module, "init_distributed", init_distributed)
    with pytest.raises(Started):
        run_module.run(compose_unresolved(["experiment=quickstart", f"trainer.run_dir={tmp_path}",
                                           "data.num_workers=0"]))
    assert seen == ["32"]


@pytest.mark.parametrize(("queues", "warns"), [("32", False), ("8", True), (None, True)])
def test_the_gpu_decoder_warns_when_the_cuda_queues_are_few(monkeypatch, caplog, queues, warns):
    if queues is None:
        unset_cuda_queues(monkeypatch)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", queues)
    decoder = DeviceDecoder(torch.device("cuda", 0), SIZE)  # nothing touches the GPU until a batch comes
    decoder.close()
    assert ("decode several times slower" in caplog.text) == warns
    if warns:
        assert f"CUDA_DEVICE_MAX_CONNECTIONS={queues or 'unset'}" in caplog.text and "set it to 32" in caplog.text
