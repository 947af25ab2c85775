"""Preflight refuses a loader whose prefetched batches would not fit in /dev/shm (the workers would die of SIGBUS
mid-run, as in a container with Docker's 64 MB default), and says how much it needs and what to change; and
workers whose batches could not reach the training process (a temporary directory too long for the socket that
passes their shared memory), where the run would otherwise wait for ever."""

import os
import tempfile
from collections import namedtuple

import pytest
import torch

from src.data.loader import PREFETCH_FACTOR, TrainLoader, loader_shared_memory
from src.data.processes import check_worker_temp_dir
from src.parallel.distributed import DistInfo
from src.trainer import preflight as preflight_module
from src.trainer.preflight import check_loader_shared_memory
from tests.conftest import compose_config
from tests.test_config import preflight_problems
from tests.test_data import data_config

Usage = namedtuple("Usage", "total used free")
CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def config(*overrides: str):
    return compose_config(["model=vit_b32", "data=laion_wds", "data.batch_size=1024", "data.num_workers=12",
                           *overrides])


def test_the_estimate_counts_every_workers_prefetched_batches():
    cfg = config()
    per_sample = 3 * 224 * 224 + 77 * 8
    assert loader_shared_memory(cfg.data, 224, 77, 0, 1) == 12 * (PREFETCH_FACTOR + 1) * 1024 * per_sample
    # Canvases are larger than the crops; each of two ranks holds half the batch.
    assert loader_shared_memory(cfg.data, 224, 77, 256, 2) == 12 * (PREFETCH_FACTOR + 1) * 512 * (3 * 256 * 256 + 616)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_too_little_shared_memory_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(preflight_module.shutil, "disk_usage", lambda path: Usage(64e6, 0, 64e6))
    with pytest.raises(ValueError, match=r"may hold 9\.29 GB of shared memory \(1 rank\(s\) x data.num_workers=12 x "
                                         r"5 batches of 1024 samples\), but /dev/shm has 0\.06 GB free: lower "
                                         r"data.num_workers or data.batch_size.*--shm-size"):
        check_loader_shared_memory(config(), CPU)
    check_loader_shared_memory(config("data.num_workers=0"), CPU)  # no workers, nothing shared
    monkeypatch.setattr(preflight_module.shutil, "disk_usage", lambda path: Usage(64e9, 0, 64e9))
    check_loader_shared_memory(config(), CPU)


@pytest.fixture
def long_temp_dir(monkeypatch, tmp_path):
    """A temporary directory of 76 bytes: one too many for a worker's socket under it."""
    path = "/tmp/" + "t" * 71
    monkeypatch.setattr(tempfile, "tempdir", path)
    return path


def test_workers_under_a_too_long_temporary_directory_are_refused_with_the_fix(long_temp_dir):
    with pytest.raises(ValueError, match=r"the temporary directory '/tmp/t+' is 76 bytes long: .* may be at most 75: "
                                         r"set TMPDIR to a shorter one \(say /tmp\), or data.num_workers=0"):
        check_worker_temp_dir(2)
    check_worker_temp_dir(0)  # no workers, no socket


def test_a_75_byte_temporary_directory_is_long_enough(monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/tmp/" + "t" * 70)
    check_worker_temp_dir(2)


def test_the_file_system_strategy_needs_no_socket(long_temp_dir, monkeypatch):
    monkeypatch.setattr(torch.multiprocessing, "get_sharing_strategy", lambda: "file_system")
    check_worker_temp_dir(2)


def test_the_loader_and_preflight_refuse_it_before_any_worker_starts(long_temp_dir, shapes, tmp_path):
    loader = TrainLoader(data_config(shapes["shards"], 8, 1), image_size=32, context_length=8, seed=0)
    with pytest.raises(ValueError, match="is 76 bytes long"):
        next(loader)  # a worker's first batch would otherwise never arrive
    assert "is 76 bytes long" in preflight_problems(tmp_path, ["data.num_workers=1"])
