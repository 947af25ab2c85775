import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from src.kernels.dispatch import build_model_with_kernels
from src.parallel.distributed import all_reduce_mean
from src.trainer.loss import clip_loss
from tests.conftest import data_overrides, fork_ranks, free_port, run_train
from tests.test_model import tiny_config

BATCH = 8


def batch_and_model():
    torch.manual_seed(0)
    model = build_model_with_kernels(tiny_config(ls_init_value=0.5))  # as the trainer runs it
    images = torch.randn(BATCH, 3, 32, 32)
    tokens = torch.randint(1, 1000, (BATCH, 16))
    return model, images, tokens


def loss_and_grads(model, images, tokens):
    loss = clip_loss(*model(images, tokens))
    loss.backward()
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, images, tokens = batch_and_model()
    local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    loss, grads = loss_and_grads(DistributedDataParallel(model), images[local], tokens[local])
    if rank == 0:
        torch.save({"loss": all_reduce_mean(loss), "grads": grads}, out)
    else:
        all_reduce_mean(loss)
    dist.destroy_process_group()


def test_two_ranks_with_half_batch_match_one_rank(tmp_path):
    out = str(tmp_path / "rank0.pt")
    fork_ranks(worker, 2, free_port(), out, world=2)
    distributed = torch.load(out, weights_only=True)
    expected_loss, expected_grads = loss_and_grads(*batch_and_model())
    torch.testing.assert_close(distributed["loss"], expected_loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected_grads.items():
        # Float32 rounding of sums taken in another order: relative to the tensor's largest gradient (the token
        # embedding's reach about 5 and differ by up to 2e-6).
        atol = 1e-6 * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(distributed["grads"][name], grad, rtol=1e-4, atol=atol, msg=name)


def test_torchrun_two_ranks_share_one_run_directory(shapes, tmp_path):
    outputs = tmp_path / "outputs"
    run_train([
        "experiment=quickstart", *data_overrides(shapes), "trainer.max_steps=20", "trainer.progress=false",
        "data.batch_size=32", "data.num_workers=1", "trainer.log_every=5", "eval.every=0",
        f"trainer.run_dir={outputs}/{{now:%H-%M-%S-%f}}".replace("{now", "${now"),
    ], torchrun=2)
    runs = os.listdir(outputs)
    assert len(runs) == 1, runs  # rank 1's own timestamp must not create a second directory
    run_dir = outputs / runs[0]
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if "train/loss" in line]
    assert steps == list(range(20))
    assert sorted(os.listdir(run_dir / "checkpoints/step_00000020")) == [
        "manifest.json", "model.pt", "rank_0.pt", "rank_1.pt", "train_state.pt"]
    assert not (run_dir.parent.parent / ".hydra").exists()


def backward_in_rank(rank: int, out: str) -> None:
    x = torch.ones(3, requires_grad=True)
    (x * (rank + 2)).sum().backward()
    torch.save(x.grad, os.path.join(out, f"grad{rank}.pt"))


def test_ranks_forked_after_a_compile_run_backward(tmp_path):
    # torch.compile, then a backward in this process: what a worker has done before most fork_ranks tests
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    x = torch.ones(2, requires_grad=True)
    x.sum().backward()
    fork_ranks(backward_in_rank, str(tmp_path), world=2)
    grads = [torch.load(tmp_path / f"grad{rank}.pt", weights_only=True) for rank in range(2)]
    assert [g.tolist() for g in grads] == [[2.0] * 3, [3.0] * 3]
