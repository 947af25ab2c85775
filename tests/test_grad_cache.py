"""trainer.accum_steps: GradCache's micro-batches give the whole batch's gradient and step (float64, 1e-10), on one
process and on two gloo ranks (DDP and FSDP2, one gradient reduction per step), and a Trainer run with them resumes
exactly."""

import contextlib
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from src.kernels.dispatch import build_model_with_kernels
from src.parallel.distributed import DistInfo
from src.parallel.parallelize import apply_fsdp
from src.trainer.grad_cache import accumulate_gradients, check_accum_steps, split_batch
from src.trainer.loss import clip_loss
from src.trainer.memory import estimate_memory
from src.trainer.preflight import ConfigurationError, preflight
from src.trainer.trainer import Trainer
from tests.conftest import ROOT, compose_config, fork_ranks, free_port
from tests.test_model import tiny_config

CPU = torch.device("cpu")
WORLD = 2
TINY = "embed_dim=32 vision.width=48 vision.layers=2 vision.heads=3 text.width=32 text.layers=2 text.heads=2"


def float64_model_and_batch(rows: int, patch_dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = tiny_config(ls_init_value=0.5)
    cfg.vision.patch_dropout = patch_dropout
    model = build_model_with_kernels(cfg).double()
    batch = {"images": torch.randn(rows, 3, 32, 32, dtype=torch.float64),
             "tokens": torch.randint(1, 1000, (rows, 16)), "keys": [f"{i}" for i in range(rows)]}
    return model, batch


def features(model, batch):
    return model(batch["images"], batch["tokens"])


def features_loss(outputs):
    return clip_loss(*outputs)


def accumulate(model, batch, steps: int, scale=lambda loss: loss) -> torch.Tensor:
    return accumulate_gradients(features, features_loss, model, batch, steps, scale=scale,
                                autocast=contextlib.nullcontext, device=CPU)


def grads(model) -> dict[str, torch.Tensor]:
    return {name: whole(p.grad) for name, p in model.named_parameters()}


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close(got: dict, want: dict, tol: float = 1e-10) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=name)


def test_four_micro_batches_give_the_whole_batch_gradient_and_step():
    model, batch = float64_model_and_batch(8)
    reference = copy.deepcopy(model)
    want_loss = features_loss(features(reference, batch))
    want_loss.backward()
    # A loss scaler's scale reaches the parameters through the cached gradients, once. An output the model lacks
    # (None, as a loss's optional bias) passes through.
    loss = accumulate_gradients(lambda m, b: (*features(m, b), None), lambda f: features_loss(f[:3]), model, batch, 4,
                                scale=lambda loss: loss * 1024, autocast=contextlib.nullcontext, device=CPU)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    got = {name: g / 1024 for name, g in grads(model).items()}
    assert_close(got, grads(reference))
    assert grads(reference)["logit_scale"].abs() > 1e-3  # the scalar's gradient counted once, not 4 times
    for m in (model, reference):
        for p in m.parameters():
            p.grad /= 1024 if m is model else 1
        torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6).step()  # eps: the key biases' noise, see `stepped`
    assert_close(dict(model.named_parameters()), dict(reference.named_parameters()))


def test_siglip_accumulates_the_whole_batch_gradient_with_its_bias_counted_once():
    from src.trainer.siglip_loss import siglip_loss

    torch.manual_seed(0)
    cfg = tiny_config(ls_init_value=0.5)
    cfg.init_logit_bias, cfg.init_logit_scale = -10.0, 2.302585
    model = build_model_with_kernels(cfg).double()
    batch = {"images": torch.randn(8, 3, 32, 32, dtype=torch.float64), "tokens": torch.randint(1, 1000, (8, 16))}
    reference = copy.deepcopy(model)
    want_loss = siglip_loss(*features(reference, batch))
    want_loss.backward()
    loss = accumulate_gradients(features, lambda f: siglip_loss(*f), model, batch, 4, scale=lambda loss: loss,
                                autocast=contextlib.nullcontext, device=CPU)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    assert_close(grads(model), grads(reference))
    assert grads(reference)["logit_bias"].abs() > 1e-3


def test_switchback_layers_accumulate_the_whole_batch_gradient():
    """SwitchBack quantizes activations and output gradients row by row (per sample) and weights per tensor, so
    splitting the batch changes no scale. The cached feature gradients differ from the whole batch's in float32's
    last bits, which can move a value across an int8 rounding boundary: the gradients agree to 2e-3 of each
    tensor's norm (4.8e-4 at worst here; the standard layers' to 1e-6)."""
    torch.manual_seed(0)
    cfg = tiny_config(ls_init_value=0.5)
    cfg.linear, cfg.linear_backend = "switchback_int8", "reference"
    model = build_model_with_kernels(cfg)
    batch = {"images": torch.randn(8, 3, 32, 32), "tokens": torch.randint(1, 1000, (8, 16))}
    reference = copy.deepcopy(model)
    features_loss(features(reference, batch)).backward()
    accumulate(model, batch, 4)
    got, want = grads(model), grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).norm() <= 2e-3 * want[name].norm() + 1e-12, name


def test_patch_dropout_draws_the_same_tokens_in_the_second_forward():
    """The gradient equals the one of the loss over the features the first pass computed, whatever tokens patch
    dropout kept: each micro-batch's second forward replays its random state."""
    model, batch = float64_model_and_batch(6, patch_dropout=0.5)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    outputs = [features(reference, part) for part in split_batch(batch, 3)]  # the draws, in the same order
    want_loss = features_loss((torch.cat([o[0] for o in outputs]), torch.cat([o[1] for o in outputs]),
                               outputs[0][2]))
    want_loss.backward()
    after = torch.rand(1)
    torch.manual_seed(1)
    loss = accumulate(model, batch, 3)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-12)
    assert_close(grads(model), grads(reference))
    assert torch.rand(1) == after  # the random stream goes on from where the first pass left it


def test_preflight_refusals_name_the_keys(tmp_path):
    cfg = compose_config(["experiment=quickstart", "data.generate=true", "data.batch_size=32", "trainer.accum_steps=3",
                          f"trainer.run_dir={tmp_path}"])
    with pytest.raises(ConfigurationError, match=r"data.batch_size=32 over 2 rank\(s\) gives 16 samples per rank, "
                                                 r"which trainer.accum_steps=3 does not divide"):
        preflight(cfg, DistInfo(0, 2, 0, CPU), str(tmp_path))
    cfg.trainer.accum_steps = 0
    with pytest.raises(ConfigurationError, match="trainer.accum_steps=0 is out of range: set it to at least 1"):
        preflight(cfg, DistInfo(0, 2, 0, CPU), str(tmp_path))
    # The memory preflight checks is one micro-batch's activations.
    cfg.trainer.accum_steps = 4
    estimate = estimate_memory(cfg, 2)
    assert estimate.samples == 4
    # Under FSDP2 the gradients stay whole between micro-batches (set_requires_gradient_sync(False)).
    cfg.trainer.data_parallel = "fsdp2"
    assert estimate_memory(cfg, 2).weights_bytes == 6 * estimate.parameters == 0.75 * estimate.weights_bytes
    with pytest.raises(ValueError, match="trainer.accum_steps=2 does not apply to video"):
        check_accum_steps(2, 32, 1, video=True, cuda_graph=False)
    with pytest.raises(ValueError, match="trainer.cuda_graph=true cannot record trainer.accum_steps=2"):
        check_accum_steps(2, 32, 1, video=False, cuda_graph=True)
    check_accum_steps(4, 32, 2, video=False, cuda_graph=False)


def stepped(model) -> dict[str, torch.Tensor]:
    """The parameters after one AdamW step on the gradients they hold, whole. The key biases' true gradient is 0
    (softmax ignores a shift shared by a query's scores): what they hold is rounding noise of about 1e-17, which a
    first Adam step with a tiny eps would turn into steps of ±lr that follow the summation order; eps=1e-6 keeps
    those steps below 1e-12 and every real gradient's step near lr."""
    torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6).step()
    return {name: whole(p.detach()) for name, p in model.named_parameters()}


def counted_allreduce(calls: list, bucket):
    """DDP's own all-reduce of a gradient bucket, counted."""
    calls.append(1)
    return allreduce_hook(None, bucket)


def counted_reduce_scatter(calls: list):
    original = dist.reduce_scatter_single

    def reduce_scatter(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return reduce_scatter


def distributed_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model, batch = float64_model_and_batch(16)
    local = split_batch(batch, WORLD)[rank]
    results = {}
    # DDP's gradient of the whole per-rank batch is the reference; count its bucket all-reduces per backward.
    for name, steps in (("whole", 1), ("accumulated", 4)):
        ddp = DistributedDataParallel(copy.deepcopy(model))
        calls = []
        ddp.register_comm_hook(calls, counted_allreduce)
        if steps == 1:
            features_loss(features(ddp, local)).backward()
        else:
            accumulate(ddp, local, steps)
        results[name] = (grads(ddp.module), len(calls), stepped(ddp.module))
    fsdp = copy.deepcopy(model)
    apply_fsdp(fsdp, init_device_mesh("cpu", (WORLD,)))
    calls = []
    dist.reduce_scatter_single, original = counted_reduce_scatter(calls), dist.reduce_scatter_single
    try:
        accumulate(fsdp, local, 4)
    finally:
        dist.reduce_scatter_single = original
    results["fsdp2"] = (grads(fsdp), len(calls), stepped(fsdp))
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def test_two_ranks_accumulate_the_whole_batch_gradient_with_one_reduction(tmp_path):
    """DDP and FSDP2 on two gloo ranks: four micro-batches per rank give DDP's whole-batch gradient (the logit
    scale's too), DDP reduces each bucket once per step and FSDP2 reduce-scatters each group once."""
    out = str(tmp_path / "rank0.pt")
    fork_ranks(distributed_worker, free_port(), out, world=WORLD)
    results = torch.load(out, weights_only=True)
    (want, buckets, want_params), (got, calls, params) = results["whole"], results["accumulated"]
    assert_close(got, want)
    assert_close(params, want_params)
    assert calls == buckets >= 1
    fsdp_grads, reduce_scatters, fsdp_params = results["fsdp2"]
    assert_close(fsdp_grads, want)
    assert_close(fsdp_params, want_params)
    model, _ = float64_model_and_batch(16)
    groups = 1 + sum(1 for m in model.modules() if type(m).__name__.endswith("Block"))  # blocks and the root
    assert reduce_scatters == groups


def run_overrides(shapes, run_dir, *extra: str) -> list[str]:
    return [
        "experiment=quickstart", f"data.shards='{shapes['shards']}'", "data.eval_shards=null", "data.generate=false",
        f"trainer.run_dir={run_dir}", "trainer.progress=false", "data.batch_size=16", "data.num_workers=0",
        "trainer.log_every=2", "trainer.max_steps=4", "trainer.ckpt_every=2", "optim.warmup_steps=1",
        *(f"model.{size}" for size in TINY.split()),
        "model.vision.patch_dropout=0.25", "optim.grad_clip_norm=1.0", "trainer.accum_steps=2", *extra,
    ]


def train(overrides: list[str]) -> None:
    cfg = compose_config(overrides)
    os.makedirs(cfg.trainer.run_dir, exist_ok=True)  # train.py's run directory
    Trainer(cfg, cfg.trainer.run_dir, DistInfo(0, 1, 0, CPU)).fit()


def metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if k != "train/samples_per_s"} for line in f]


def test_accumulated_run_resumes_exactly(shapes, tmp_path):
    """With patch dropout (whose draws each micro-batch replays) and clipping: a run stopped after step 3 and
    resumed from its step-2 checkpoint logs what the uninterrupted run logs."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(run_overrides(shapes, straight))
    train(run_overrides(shapes, resumed, "trainer.stop_at_step=3"))
    (resumed / "checkpoints/step_00000003").rename(tmp_path / "dropped")  # as if it had crashed before saving
    train(run_overrides(shapes, resumed, "trainer.resume=latest"))
    want, got = metrics(straight), metrics(resumed)
    assert [m["step"] for m in want] == list(range(4)) and want == got
    assert all(0 < m["train/grad_norm"] < float("inf") and not m["train/skipped_step"] for m in want)
    assert len({m["train/loss"] for m in want}) == 4  # the weights moved


def test_accum_bench_smoke_run(tmp_path):
    """bench/accum.py on the CPU (its figures come from the GPU): both configurations and the summary."""
    out = tmp_path / "accum.json"
    command = [sys.executable, "bench/accum.py", "--device", "cpu", "--model", "vit_tiny", "--batch", "8",
               "--accum-steps", "2", "--steps", "1", "--warmup", "1", "--json", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(out.read_text())
    assert [(row["batch"], row["accum_steps"]) for row in written["rows"]] == [(8, 2), (4, 1)]
    assert [json.loads(line) for line in result.stdout.splitlines()[-3:]] == [*written["rows"], written["summary"]]
    assert written["summary"]["time_per_sample_ratio"] > 0 and written["summary"]["micro_batch"] == 4
