"""loss=siglip: the sigmoid loss against a dense reference and OpenCLIP's SigLipLoss, its ring form on 2 and 3
gloo ranks against the single-process and all-gather forms, OpenCLIP SigLIP checkpoints, and a train.py run that
trains, checkpoints logit_bias and resumes exactly."""

import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from src.parallel.distributed import all_gather_with_grad
from src.trainer.siglip_loss import pair_logits, siglip_loss
from tests.conftest import fork_ranks, free_port

BATCH, DIM = 30, 16  # divisible by 2, 3 and 5 ranks


def features(bias: bool = True) -> dict[str, torch.Tensor]:
    """Unit-norm float64 features of a global batch, a scale near the paper's and a bias near its start."""
    generator = torch.Generator().manual_seed(0)
    images, texts = (F.normalize(torch.randn(BATCH, DIM, generator=generator, dtype=torch.float64), dim=-1)
                     for _ in range(2))
    texts = F.normalize(texts + 0.5 * images, dim=-1)  # matching pairs are closer, as after some training
    values = {"images": images, "texts": texts, "scale": torch.tensor(2.5, dtype=torch.float64)}
    if bias:
        values["bias"] = torch.tensor(-3.0, dtype=torch.float64)
    return values


def leaves(values: dict[str, torch.Tensor], rows: slice = slice(None)) -> dict[str, torch.Tensor]:
    """Gradient-taking copies; the features limited to `rows` (a rank's share). The scale is the parameter,
    log t, exponentiated in the loss call as the model's forward does."""
    return {name: (v[rows] if v.ndim else v).clone().requires_grad_() for name, v in values.items()}


def call(loss_fn, x: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    return loss_fn(x["images"], x["texts"], x["scale"].exp(), x.get("bias"), **kwargs)


def dense_reference(images, texts, logit_scale, logit_bias, offset: int = 0) -> torch.Tensor:
    """The paper's definition: (local images x given captions), labels +1 where image i's caption is column
    offset + i, -1 elsewhere; the sum over the pairs divided by the number of images."""
    logits = pair_logits(images, texts, logit_scale, logit_bias)
    labels = -torch.ones_like(logits)
    labels[torch.arange(len(images)), offset + torch.arange(len(images))] = 1
    return -F.logsigmoid(labels * logits).sum() / len(images)


def grads(loss: torch.Tensor, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(zip(x, torch.autograd.grad(loss, list(x.values()))))


@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_match_a_dense_reference_and_openclip(bias):
    from open_clip.loss import SigLipLoss

    values = features(bias)
    ours = leaves(values)
    loss = call(siglip_loss, ours)
    got = grads(loss, ours)
    for name, reference in (("dense", dense_reference), ("openclip", SigLipLoss())):
        theirs = leaves(values)
        want_loss = call(reference, theirs)
        torch.testing.assert_close(loss, want_loss, rtol=1e-13, atol=0, msg=name)
        for key, grad in grads(want_loss, theirs).items():
            torch.testing.assert_close(got[key], grad, rtol=1e-12, atol=1e-14, msg=f"{name}: {key}")
    if bias:
        assert got["bias"].abs() > 1e-3


def ring_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ring = leaves(features(), rows)
    ring_loss = call(siglip_loss, ring)
    ring_grads = grads(ring_loss, ring)
    # The all-gather form: every caption of the global batch gathered, one (local x global) block.
    gathered = leaves(features(), rows)
    gather_loss = dense_reference(gathered["images"], all_gather_with_grad(gathered["texts"]),
                                  gathered["scale"].exp(), gathered["bias"], offset=rows.start)
    gather_grads = grads(gather_loss, gathered)
    results = {}
    for form, loss, g in (("ring", ring_loss, ring_grads), ("gather", gather_loss, gather_grads)):
        # What DDP does with them: the scalars' gradients averaged, each rank's features' gradients its own.
        scalars = torch.stack([loss.detach(), g["scale"], g["bias"]])
        dist.all_reduce(scalars)
        shares = {k: [torch.empty_like(g[k]) for _ in range(world)] for k in ("images", "texts")}
        for key, out_list in shares.items():
            dist.all_gather(out_list, g[key].contiguous())
        results[form] = {"loss": scalars[0] / world, "scale": scalars[1] / world, "bias": scalars[2] / world,
                         **{k: torch.cat(v) / world for k, v in shares.items()}}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 5])
def test_ring_gradients_equal_the_single_process_and_all_gather_forms(world, tmp_path):
    """2 ranks take the one-way shift to the rank opposite, 3 one two-way round; 5 a second round, which passes on
    the tensors of the first (and their gradients back)."""
    out = str(tmp_path / "rank0.pt")
    fork_ranks(ring_worker, world, free_port(), out, world=world)
    results = torch.load(out, weights_only=True)
    single = leaves(features())
    loss = call(siglip_loss, single)  # one process: no ring
    want = {"loss": loss.detach(), **grads(loss, single)}
    torch.testing.assert_close(want["loss"], call(dense_reference, leaves(features())), rtol=1e-14, atol=0)
    for form in ("ring", "gather"):
        for key, value in want.items():
            torch.testing.assert_close(results[form][key], value, rtol=1e-12, atol=1e-15, msg=f"{form}: {key}")


def siglip_model_and_batch():
    """A tiny float64 CLIP with a bias and a batch; the bias away from -10 so that its gradient is not tiny."""
    from src.models import build_model
    from tests.test_model import tiny_config

    cfg = tiny_config(ls_init_value=0.5)
    cfg.init_logit_bias, cfg.init_logit_scale = -2.0, math.log(10)
    torch.manual_seed(0)
    model = build_model(cfg).double()
    images = torch.randn(BATCH, 3, 32, 32, dtype=torch.float64)
    tokens = torch.randint(1, 1000, (BATCH, 16))
    return model, images, tokens


def model_grads(model, images, tokens) -> dict[str, torch.Tensor]:
    siglip_loss(*model(images, tokens)).backward()
    module = getattr(model, "module", model)
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in module.named_parameters()}


def data_parallel_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from src.parallel.parallelize import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    model, images, tokens = siglip_model_and_batch()
    ddp = model_grads(DistributedDataParallel(model), images[rows], tokens[rows])
    model, images, tokens = siglip_model_and_batch()
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    fsdp = model_grads(model, images[rows], tokens[rows])
    if rank == 0:
        torch.save({"ddp": ddp, "fsdp2": fsdp}, out)
    dist.destroy_process_group()


def test_ddp_and_fsdp2_gradients_are_those_of_the_single_process_loss_on_the_global_batch(tmp_path):
    """The whole model on 2 ranks: each rank's loss divided by its own images, DDP's and FSDP2's averaging (the
    scale and the bias by apply_fsdp's hook) give every parameter the single-process gradient."""
    out = str(tmp_path / "rank0.pt")
    fork_ranks(data_parallel_worker, 2, free_port(), out, world=2)
    results = torch.load(out, weights_only=True)
    want = model_grads(*siglip_model_and_batch())
    assert want["logit_bias"].abs() > 1e-3 and want["logit_scale"].abs() > 1e-3
    for form, got in results.items():
        assert got.keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-10, atol=1e-13, msg=f"{form}: {name}")


def test_the_bias_is_initialised_counted_with_neither_tower_and_never_decayed():
    from src.models import build_model, count_parameters
    from src.optim import param_groups
    from tests.test_model import tiny_config

    cfg = tiny_config()
    plain = count_parameters(build_model(cfg))
    cfg.init_logit_bias = -10.0
    model = build_model(cfg)
    assert model.logit_bias.item() == -10.0 and "logit_bias" in model.state_dict()
    counts = count_parameters(model)
    assert counts["total"] == plain["total"] + 1 and counts["text"] == plain["text"]
    decayed, not_decayed = param_groups(model, 0.2, lr=1e-3)
    assert any(p is model.logit_bias for p in not_decayed["params"])
    assert not any(p is model.logit_bias for p in decayed["params"])


def tiny_openclip_siglip(tmp_path):
    """A small OpenCLIP CLIP of our architecture, with SigLIP's bias, from a model config registered here."""
    import open_clip

    config = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 48, "layers": 2,
                                              "head_width": 16},
              "text_cfg": {"context_length": 16, "width": 32, "heads": 2, "layers": 2}}
    (tmp_path / "tiny-siglip.json").write_text(json.dumps(config))
    open_clip.add_model_config(str(tmp_path / "tiny-siglip.json"))
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-siglip", init_logit_scale=math.log(10), init_logit_bias=-10.0)
    with torch.no_grad():  # away from the initial values, so that loading them is seen
        model.logit_bias.fill_(-7.25)
        model.logit_scale.fill_(3.0)
    return model.eval()


def test_openclip_siglip_checkpoint_loads_through_init_from(tmp_path):
    import open_clip
    from open_clip.loss import SigLipLoss

    from src.models import build_model
    from src.trainer.pretrained import load_pretrained
    from tests.test_model import tiny_config

    theirs = tiny_openclip_siglip(tmp_path)
    path = tmp_path / "siglip.pt"
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in theirs.state_dict().items()}}, path)
    cfg = tiny_config()
    cfg.init_logit_bias, cfg.init_logit_scale = -10.0, math.log(10)
    ours = build_model(cfg).eval()
    load_pretrained(ours, f"openclip:{path}")
    assert ours.logit_bias.item() == -7.25 and ours.logit_scale.item() == 3.0
    images = torch.randn(4, 3, 32, 32)
    tokens = open_clip.tokenize(["a red cat", "hello", "x y z", "a dog on a mat"], context_length=16)
    with torch.no_grad():
        got, want = ours(images, tokens), theirs(images, tokens)
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(siglip_loss(*got), SigLipLoss()(*want))

    plain = build_model(tiny_config())  # no bias: the SigLIP checkpoint names the fix
    with pytest.raises(ValueError, match="loss=siglip"):
        load_pretrained(plain, f"openclip:{path}")


def test_clip_checkpoint_into_a_siglip_model_keeps_the_initial_bias():
    from src.models import build_model, load_openclip_state_dict
    from tests.test_model import tiny_config, tiny_openclip

    cfg = tiny_config()
    cfg.init_logit_bias = -10.0
    ours = build_model(cfg)
    load_openclip_state_dict(ours, tiny_openclip().state_dict())
    assert ours.logit_bias.item() == -10.0


def test_preflight_refuses_a_bias_with_the_softmax_loss_and_siglip_for_video():
    from src.trainer.preflight import range_problems
    from tests.conftest import compose_config

    problems = range_problems(compose_config(["model.init_logit_bias=-10"]))
    assert any("model.init_logit_bias=-10.0" in p and "loss=siglip" in p for p in problems), problems
    problems = range_problems(compose_config(["loss=siglip", "experiment=video_finetune"]))
    assert any("loss.name=siglip, data.frames=" in p and "use loss=clip" in p for p in problems), problems
    assert not range_problems(compose_config(["loss=siglip"]))


def test_train_py_with_siglip_trains_checkpoints_the_bias_and_resumes_exactly(shapes, tmp_path):
    from tests.conftest import data_overrides, run_train
    from tests.test_trainer import read_metrics

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["experiment=quickstart", "loss=siglip", *data_overrides(shapes), "data.eval_shards=null",
            "trainer.progress=false", "data.batch_size=32", "data.num_workers=0", "trainer.log_every=4",
            "optim.warmup_steps=2", "trainer.max_steps=8", "trainer.ckpt_every=4"]
    run_train([*args, f"trainer.run_dir={straight}"])
    want = read_metrics(straight)
    final = torch.load(straight / "checkpoints/step_00000008/model.pt", weights_only=True)
    first = torch.load(straight / "checkpoints/step_00000004/model.pt", weights_only=True)
    # It trains: the loss falls and the bias moves from -10, and the last logged bias is the checkpoint's.
    losses = [m["train/loss"] for m in want if "train/loss" in m]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert final["logit_bias"].shape == () and final["logit_bias"] != first["logit_bias"] != -10.0
    assert want[-1]["train/logit_bias"] == final["logit_bias"].item()
    assert want[0]["train/logit_scale"] == pytest.approx(10.0, rel=0.05)
    assert "spike/loss_spikes" in want[-1] and "optim/rms/patch_embed" in want[-1]  # the detector ran, and resumes
    # Resume from step 4 in a copy of the run, as after a crash before the step-8 checkpoint.
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints/step_00000008")
    run_train([*args, f"trainer.run_dir={resumed}", "trainer.resume=latest"])
    got = read_metrics(resumed)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(want, got):
        assert {k: v for k, v in a.items() if k != "train/samples_per_s"} == \
               {k: v for k, v in b.items() if k != "train/samples_per_s"}
    again = torch.load(resumed / "checkpoints/step_00000008/model.pt", weights_only=True)
    assert all(torch.equal(again[k], v) for k, v in final.items())
    # model.init_from of the run: into a model with a bias it loads; into one without, the error names loss=.
    from src.models import build_model
    from src.trainer.pretrained import load_pretrained
    from tests.conftest import compose_config

    model = build_model(compose_config(["experiment=quickstart", "loss=siglip"]).model)
    load_pretrained(model, str(straight))
    assert model.logit_bias.item() == final["logit_bias"].item()
    with pytest.raises(ValueError, match="loss= for a logit_bias"):
        load_pretrained(build_model(compose_config(["experiment=quickstart"]).model), str(straight))
