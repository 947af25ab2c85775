import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from open_clip.tokenizer import decode
from torch.nn.parallel import DistributedDataParallel

from src.config import ModelConfig, VideoConfig
from src.data.loader import TrainLoader
from src.models.video_clip import VideoCLIP, build_video_model
from src.parallel.distributed import all_gather_with_grad
from src.parallel.mesh import Mesh
from src.tools.synthetic_videos import DIRECTIONS, make_synthetic_video_shards
from src.trainer.checkpoint import save_checkpoint
from src.trainer.pretrained import load_pretrained
from src.trainer.video_trainer import video_text_loss
from tests.conftest import ROOT, compose_config, fork_ranks, free_port, run_train
from tests.test_model import tiny_config, tiny_openclip

FRAMES, BATCH = 4, 4
# The head these tests were written against: smaller than model.video's defaults, every token a query, all trained.
VIDEO_AS_TESTED = dict(head_heads=2, head_layers=1, text_queries="all", vision_trainable_blocks=-1,
                       image_text_weight=0.0)


def video_config(**video) -> ModelConfig:
    cfg = tiny_config()
    cfg.video = dataclasses.replace(cfg.video, **{**VIDEO_AS_TESTED, **video})
    return cfg


def tiny_video_model(**video) -> VideoCLIP:
    torch.manual_seed(0)
    return build_video_model(video_config(**video), FRAMES)


def clips_and_captions(batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    frames = torch.randn(batch, FRAMES, 3, 32, 32, generator=generator)
    tokens = torch.randint(1, 1000, (batch, 16), generator=generator)
    tokens[:, 0], tokens[:, 9], tokens[:, 10:] = 49406, 49407, 0  # start, end of text, padding
    return frames, tokens


@pytest.fixture(scope="session")
def video_shards(tmp_path_factory) -> dict[str, str]:
    """Generated moving-shape clips, packed: 4 train shards of 16 clips, 2 held-out shards of 12."""
    root = tmp_path_factory.mktemp("moving_shapes")
    train, held_out = str(root / "train" / "{00000..00003}.tar"), str(root / "eval" / "{00000..00001}.tar")
    make_synthetic_video_shards(train, held_out, 64, 24, size=32, frames=16, stored=8)
    return {"shards": train, "eval_shards": held_out}


def test_head_starts_as_the_mean_pooling_baseline():
    frames, tokens = clips_and_captions()
    out = tiny_video_model()(frames, tokens)
    # Zero-init layer-scale: the head adds nothing yet, so every pair scores as mean-pooled frames do.
    torch.testing.assert_close(out.scores, out.video @ out.text.T)
    baseline = tiny_video_model(head="mean")
    assert baseline(frames, tokens).scores is None and baseline.head is None
    assert not hasattr(baseline, "temporal_embedding")


def test_head_sees_the_order_of_frames_and_mean_pooling_does_not():
    model = tiny_video_model(head_ls_init=1.0)
    frames, tokens = clips_and_captions()
    forward, backward = model(frames, tokens), model(frames.flip(1), tokens)
    torch.testing.assert_close(forward.video, backward.video)
    assert (forward.scores - backward.scores).abs().max() > 1e-3


@pytest.mark.parametrize("text_queries", ["all", "eot"])
def test_scores_do_not_depend_on_the_other_captions(text_queries):
    """All captions share one query sequence per clip; the head has no self-attention, so they must not mix."""
    model = tiny_video_model(head_ls_init=1.0, text_queries=text_queries)
    frames, tokens = clips_and_captions()
    together = model(frames, tokens).scores
    alone = torch.cat([model(frames, tokens[i : i + 1]).scores for i in range(BATCH)], dim=1)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_vision_tower_freezing():
    def trained(blocks: int) -> set[str]:
        model = tiny_video_model(vision_trainable_blocks=blocks)
        return {n for n, p in model.clip.visual.named_parameters() if p.requires_grad}

    assert trained(0) == set()
    assert trained(1) == {n for n in trained(-1) if n.startswith(("transformer.resblocks.1.", "ln_post.", "proj"))}
    assert "conv1.weight" in trained(-1)
    with pytest.raises(ValueError, match="vision_trainable_blocks=3 must be -1 .* or 0..2"):
        tiny_video_model(vision_trainable_blocks=3)
    with pytest.raises(ValueError, match="model.video.head='perceiver' is not one of xattn, mean"):
        tiny_video_model(head="perceiver")


def test_mesh_layout_and_errors():
    mesh = Mesh(dp_rank=1, dp_size=2, sp_rank=1, sp_size=2, dp_group=None, sp_group=None)
    assert mesh.frames(8) == slice(4, 8)
    with pytest.raises(ValueError, match="data.frames=6 is not divisible by trainer.sp_size=4"):
        Mesh(0, 1, 0, 4, None, None).frames(6)
    with pytest.raises(ValueError, match="trainer.sp_size=3 does not divide the world size 2"):
        Mesh.build(3, 2)


def test_a_clip_with_missing_frames_is_an_error():
    """The head's shard lengths are derived from an even split of the frames, so an uneven one must fail."""
    frames, _ = clips_and_captions()
    with pytest.raises(ValueError, match=f"this rank has {FRAMES - 1} frames of a {FRAMES}-frame clip"):
        tiny_video_model().encode_video(frames[:, 1:].float())


# ----------------------------------------------------------------------------------- distributed = single process


def loss_and_grads(model, frames, tokens, mesh: Mesh, weights: VideoConfig):
    module = model.module if isinstance(model, DistributedDataParallel) else model
    gather = None if mesh.dp_group is None else functools.partial(all_gather_with_grad, group=mesh.dp_group)
    share = mesh.frames(FRAMES)
    out = model(frames[:, share], tokens, first_frame=share.start, group=mesh.sp_group, gather=gather)
    loss = video_text_loss(out, weights, mesh.dp_group, mesh.sp_group)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def parallel_worker(rank: int, world: int, sp: int, port: int, video: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = Mesh.build(sp, world)
    model = DistributedDataParallel(tiny_video_model(**video))
    frames, tokens = clips_and_captions()
    rows = slice(mesh.dp_rank * BATCH // mesh.dp_size, (mesh.dp_rank + 1) * BATCH // mesh.dp_size)
    loss, grads = loss_and_grads(model, frames[rows], tokens[rows], mesh, video_config(**video).video)
    dist.all_reduce(loss)  # the mean over ranks is what the trainer logs
    if rank == 0:
        torch.save({"loss": loss / world, "grads": grads}, out)
    dist.destroy_process_group()


# Layer-scale 0.5 (not 0) and a trained image tower, so that every parameter gets a gradient to compare.
CHECKED = dict(head_ls_init=0.5, vision_trainable_blocks=-1, image_text_weight=0.5)


@pytest.mark.parametrize("world,sp,video", [
    (2, 2, {**CHECKED, "head_impl": "lv_xattn"}),
    (2, 2, {**CHECKED, "head_impl": "ring", "head_recompute": False, "text_queries": "eot"}),
    (2, 1, CHECKED),
    pytest.param(4, 2, CHECKED, marks=pytest.mark.slow),
])
def test_data_and_sequence_parallel_step_equals_single_process(tmp_path, world, sp, video):
    out = str(tmp_path / "rank0.pt")
    fork_ranks(parallel_worker, world, sp, free_port(), video, out, world=world)
    got = torch.load(out, weights_only=True)
    want_loss, want_grads = loss_and_grads(tiny_video_model(**video), *clips_and_captions(),
                                           Mesh(0, 1, 0, 1, None, None), video_config(**video).video)
    torch.testing.assert_close(got["loss"], want_loss, rtol=1e-5, atol=1e-6)
    assert got["grads"].keys() == want_grads.keys()
    for name, grad in want_grads.items():
        # fp32 sums in another order: differences of about 1e-5 on gradients of about 0.4
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=2e-5, msg=name)


# ------------------------------------------------------------------------------------------------ weights


def test_init_from_our_checkpoints_and_openclip(tmp_path):
    clip_state = tiny_video_model().clip.state_dict()
    clip_state = {k: torch.randn_like(v) for k, v in clip_state.items()}
    checkpoints = tmp_path / "run" / "checkpoints"
    save_checkpoint(str(checkpoints), 7, rank=0, shared={"model": clip_state}, per_rank={}, keep_last_k=0)
    for spec in (checkpoints / "step_00000007", checkpoints / "step_00000007" / "model.pt", tmp_path / "run",
                 checkpoints):
        model = tiny_video_model()
        load_pretrained(model, str(spec))
        torch.testing.assert_close(model.clip.state_dict(), clip_state, msg=str(spec))

    theirs = tiny_openclip()
    torch.save({"state_dict": theirs.state_dict()}, tmp_path / "openclip.pt")
    model = tiny_video_model()
    load_pretrained(model, f"openclip:{tmp_path / 'openclip.pt'}")
    torch.testing.assert_close(model.clip.visual.proj, theirs.visual.proj)

    video = tiny_video_model(head_ls_init=1.0)  # a video model's own checkpoint loads whole
    torch.save(video.state_dict(), tmp_path / "video.pt")
    model = tiny_video_model()
    load_pretrained(model, str(tmp_path / "video.pt"))
    torch.testing.assert_close(model.state_dict(), video.state_dict())

    with pytest.raises(FileNotFoundError, match="names no checkpoint: give a checkpoints/step_N directory"):
        load_pretrained(tiny_video_model(), str(tmp_path / "missing"))
    bigger = video_config()
    bigger.text = dataclasses.replace(bigger.text, width=64)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="does not fit this model: use the model= preset"):
        load_pretrained(build_video_model(bigger, FRAMES), str(tmp_path / "video.pt"))


# --------------------------------------------------------------------------------------------------- data


def centroid_x_y(frame: np.ndarray) -> np.ndarray:
    background = np.median(frame.reshape(-1, 3), axis=0)
    ys, xs = np.nonzero(np.abs(frame.astype(int) - background).sum(-1) > 60)
    return np.array([xs.mean(), ys.mean()])


def test_training_clips_move_as_their_captions_say_anywhere_in_the_frame(video_shards):
    """data.hflip=false: no clip is mirrored (that would turn "moving left" into a clip moving right); and the
    generated shapes cross the frame at random rows and columns, so averaged frames do not give the axis away."""
    cfg = dataclasses.replace(compose_config(["data=laion_wds"]).data, name="v", shards=video_shards["shards"],
                              batch_size=32, num_workers=0, shuffle_buffer=1000, frames=FRAMES, hflip=False,
                              crop_scale_min=0.9)
    batch = next(TrainLoader(cfg, image_size=32, context_length=16, seed=0))
    across = []
    for clip, tokens in zip(batch["images"].numpy(), batch["tokens"]):
        caption = decode(tokens)
        direction = re.search(r"\b(left|right|up|down)\b", caption).group(1)
        first, last = (centroid_x_y(clip[i].transpose(1, 2, 0)) for i in (0, -1))
        motion = np.array(DIRECTIONS[direction])
        assert (last - first) @ motion > 8, (caption, first, last)
        across.append(first @ np.abs(motion[::-1]))
    assert np.std(across) > 2


# ------------------------------------------------------------------------------------------- end to end


def test_torchrun_sequence_parallel_run_trains_and_evaluates(video_shards, tmp_path):
    run_dir = tmp_path / "run"
    run_train([
        "experiment=video_finetune", f"data.shards='{video_shards['shards']}'",
        f"data.eval_shards='{video_shards['eval_shards']}'", "data.generate=false", f"data.frames={FRAMES}",
        "data.batch_size=8", "data.num_workers=1", "trainer.sp_size=2", "trainer.max_steps=5", "trainer.log_every=5",
        "trainer.progress=false", f"trainer.run_dir={run_dir}", "model.video.text_queries=all",
    ], torchrun=2)
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(5))
    (evaluation,) = [r for r in records if "eval/t2v_r1" in r]
    for key in ("t2v", "v2t", "meanpool_t2v", "meanpool_v2t"):
        assert [0 <= evaluation[f"eval/{key}_r{k}"] <= 1 for k in (1, 5, 10)] == [True] * 3, key
    assert evaluation["eval/t2v_r10"] >= evaluation["eval/t2v_r1"]
    assert sorted(os.listdir(run_dir / "checkpoints" / "step_00000005")) == [
        "manifest.json", "model.pt", "rank_0.pt", "rank_1.pt", "train_state.pt"]


def test_bench_quick_mode_compares_both_implementations(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "bench/video_finetune.py", "--quick", "--json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["impl"] for r in report["results"]] == ["lv_xattn", "ring"]
    assert all(r["step_ms"] > 0 and r["head_bytes_sent"] > 0 for r in report["results"])
