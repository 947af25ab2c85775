"""data.resize_on=device on a GPU (run on the device: `python -m pytest -q -n 0 --noconftest tests/gpu`): the
crops roi_align resizes on CUDA are the CPU's, and the resize records into a CUDA graph, as the training step's
recording (trainer.cuda_graph=auto) needs."""

import random

import pytest
import torch

from src.data.image_text import random_resized_crop_box
from tests.test_device_crop import BILINEAR, photo, place_crop, resize_crops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_crops_resized_on_cuda_are_the_cpus_and_record_into_a_graph():
    image, rng = photo(256, 240), random.Random(1)
    placed = [place_crop(image, random_resized_crop_box(240, 256, rng, (0.5, 1.0)), 224, 256, BILINEAR)
              for _ in range(64)]
    canvases, boxes = torch.stack([c for c, _ in placed]), torch.stack([b for _, b in placed])
    on_cpu = resize_crops(canvases, boxes, 224)
    static_canvases, static_boxes = canvases.cuda(), boxes.cuda()
    on_cuda = resize_crops(static_canvases, static_boxes, 224)
    assert (on_cuda.cpu().int() - on_cpu.int()).abs().max() <= 1
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = resize_crops(static_canvases, static_boxes, 224)
    static_canvases.copy_(canvases.flip(0).cuda())  # a new batch in the same buffers
    static_boxes.copy_(boxes.flip(0).cuda())
    graph.replay()
    assert torch.equal(recorded, resize_crops(canvases.flip(0).cuda(), boxes.flip(0).cuda(), 224))
