"""Evaluation sets (eval.zeroshot, eval.retrieval, eval.val_loss and data.eval_shards): an image folder and labelled
shards with OpenCLIP's templates through train.py, the validation loss against the training loss, the sets' checks
in preflight, and evaluation shared out over two ranks giving the single-process results."""

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from src.data.image_text import Preprocess
from src.data.loader import eval_batches, sample_label
from src.data.shards import expand_shards
from src.parallel.distributed import DistInfo
from src.parallel.parallelize import apply_fsdp
from src.tools.synthetic_shapes import CLASSES
from src.trainer.evaluate import recall_at, score_chunks
from src.trainer.preflight import preflight
from src.trainer.trainer import image_text_parts
from tests.conftest import ROOT, compose_config, data_overrides, fork_ranks, free_port, run_train
from tests.test_data import png_bomb
from tests.test_trainer import read_metrics, tiny_run

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
WORLD = 2


@pytest.fixture(scope="module")
def image_folder(shapes, tmp_path_factory) -> dict[str, str]:
    """The held-out shards' images as a torchvision ImageFolder tree, root/c<label>/<key>.jpg, with a class-name
    file in sorted directory order: the same set as the shards, in the other layout."""
    root = tmp_path_factory.mktemp("folder")
    eval_dir = os.path.dirname(shapes["eval_shards"])
    for shard in sorted(os.listdir(eval_dir)):
        if not shard.endswith(".tar"):
            continue
        with tarfile.open(os.path.join(eval_dir, shard)) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        for name, data in members.items():
            key, ext = name.rsplit(".", 1)
            if ext == "jpg":
                label = json.loads(members[f"{key}.json"])["label"]
                os.makedirs(root / "images" / f"c{label:02d}", exist_ok=True)
                (root / "images" / f"c{label:02d}" / f"{key}.jpg").write_bytes(data)
    assert len(os.listdir(root / "images")) == len(CLASSES)  # every class has held-out images
    (root / "names.txt").write_text("\n".join(CLASSES) + "\n")
    return {"root": str(root / "images"), "names": str(root / "names.txt")}


def sets_overrides(shapes: dict[str, str], folder: dict[str, str], pairs: str) -> list[str]:
    """A zero-shot set of each layout (the same images) and a retrieval and validation-loss set on `pairs`."""
    pattern = shapes["eval_shards"]
    return [
        f"eval.zeroshot=[{{name: folder, path: '{folder['root']}', classnames: '{folder['names']}', "
        f"templates: openai_imagenet}}, {{name: shards, path: '{pattern}', classnames: null, "
        "templates: openai_imagenet}]",
        f"eval.retrieval=[{{name: pairs, shards: '{pairs}'}}]",
        f"eval.val_loss=[{{name: pairs, shards: '{pairs}'}}]",
    ]


def bad_held_out_shards(shapes: dict[str, str], root) -> str:
    """Two more held-out shards: training samples among a truncated JPEG, a caption that is not UTF-8 and a
    decompression bomb (9000 x 9000, above data.max_image_pixels), then a shard of garbage bytes."""
    with tarfile.open(expand_shards(shapes["shards"])[0]) as tar:
        members = [[m.name, tar.extractfile(m).read()] for m in tar.getmembers()[:15] if m.isfile()]
    keys = sorted({name.split(".")[0] for name, _ in members})
    for member in members:  # in place: a sample's members stay together
        if member[0] == f"{keys[1]}.jpg":
            member[1] = member[1][: len(member[1]) // 2]
        elif member[0] == f"{keys[2]}.txt":
            member[1] = b"\xff\xfe" + member[1]
        elif member[0] == f"{keys[3]}.jpg":
            member[:] = [f"{keys[3]}.png", png_bomb(9000, 9000)]
    with tarfile.open(root / "bad-000000.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (root / "bad-000001.tar").write_bytes(os.urandom(4096))
    return f"{shapes['eval_shards']}::{root}/bad-{{000000..000001}}.tar"


def test_an_image_folder_and_labelled_shards_with_openclip_templates_evaluate_end_to_end(shapes, image_folder,
                                                                                       tmp_path):
    """Through train.py: the folder tree and the shards it was made from give the same zero-shot accuracy with
    OpenCLIP's 80 ImageNet templates; a retrieval and validation-loss set on the held-out shards gives the
    held-out set's own numbers. Bad held-out samples (issue: one stopped every resume) are skipped and counted
    with the metrics of each evaluation, and the checkpoint of each evaluated step is there."""
    run_dir, held_out = tmp_path / "run", bad_held_out_shards(shapes, tmp_path)
    sets = sets_overrides(shapes, image_folder, held_out)
    run_train(tiny_run(shapes, run_dir, f"data.eval_shards='{held_out}'", "trainer.max_steps=4", "eval.every=2",
                       "trainer.ckpt_every=2", "eval.batch_size=32", *sets))
    evals = [m for m in read_metrics(run_dir) if "eval/folder/zeroshot_top1" in m]
    assert [m["step"] for m in evals] == [2, 4]
    bad = {"corrupt_image": 1, "bad_caption": 1, "oversized_image": 1, "truncated_shard": 1}
    for m in evals:
        for top in ("zeroshot_top1", "zeroshot_top5"):
            assert 0 <= m[f"eval/folder/{top}"] <= 1
            assert m[f"eval/folder/{top}"] == m[f"eval/shards/{top}"], top
        assert m["eval/folder/zeroshot_top1"] <= m["eval/folder/zeroshot_top5"]
        for way in ("i2t", "t2i"):
            recalls = [m[f"eval/pairs/{way}_r{k}"] for k in (1, 5, 10)]
            assert recalls == sorted(recalls) and recalls == [m[f"eval/{way}_r{k}"] for k in (1, 5, 10)]
        assert m["eval/pairs/val_loss"] == m["eval/val_loss"] > 0
        assert "eval/zeroshot_top1" in m  # the held-out set, with its classes.json templates
        assert {k.removeprefix("eval/bad/"): v for k, v in m.items() if k.startswith("eval/bad/")} == bad
        assert {k.removeprefix("eval/pairs/bad/"): v for k, v in m.items() if k.startswith("eval/pairs/bad/")} == bad
        assert not [k for k in m if k.startswith(("eval/folder/bad/", "eval/shards/bad/"))]
        assert os.path.isfile(run_dir / f"checkpoints/step_{m['step']:08d}/manifest.json")


def test_the_validation_loss_is_the_training_loss_of_the_held_out_batches(shapes):
    """eval/val_loss, in batches of eval.batch_size (100 held-out samples: 32, 32, 32, 4), equals the parts'
    training loss function on the same batches, weighted by their sizes."""
    cfg = compose_config(["experiment=quickstart", *data_overrides(shapes), "data.num_workers=0",
                          "eval.batch_size=32"])
    parts = image_text_parts(cfg, CPU)
    parts.model.eval()  # no patch dropout: the evaluation's forward
    (batch,) = list(eval_batches(shapes["eval_shards"], batch_size=1000, image_size=32, context_length=16,
                                 num_workers=0, preprocess=Preprocess.from_config(cfg.data)))
    with torch.no_grad():
        chunks = [{name: batch[name][i : i + 32] for name in ("images", "tokens")} for i in range(0, 100, 32)]
        losses = [(parts.loss(parts.model, chunk), len(chunk["images"])) for chunk in chunks]
    want = sum(loss.item() * n for loss, n in losses) / 100
    results = parts.evaluate(parts.model, contextlib.nullcontext, None)
    assert results["eval/val_loss"] == pytest.approx(want, rel=1e-6)
    assert 0 <= results["eval/zeroshot_top1"] <= results["eval/zeroshot_top5"] <= 1


def test_recall_at_k_counts_the_columns_scored_above_the_correct_one_and_ties_against_it(monkeypatch):
    """Recall@k is the share of rows whose correct column is among the k best: without ties it equals ranking by
    a sort, whether the scores come whole in chunks or are scored from features chunk by chunk; a tie with the
    correct column counts against it."""
    monkeypatch.setattr("src.trainer.evaluate.RECALL_ROWS_PER_CHUNK", 7)  # several chunks, the last one short
    torch.manual_seed(0)
    queries, keys = torch.randn(50, 8), torch.randn(50, 8)
    keys = keys + 2 * queries  # paired: most rows' correct column ranks high, not all first
    similarity = queries @ keys.T
    ranking = similarity.argsort(dim=1, descending=True)
    sorted_rank = (ranking == torch.arange(50).unsqueeze(1)).float().argmax(dim=1)
    want = {k: (sorted_rank < k).float().mean().item() for k in (1, 5, 10)}
    assert recall_at(similarity.split(7), (1, 5, 10)) == want
    assert recall_at(score_chunks(queries, keys), (1, 5, 10)) == want
    assert 0 < want[1] < want[5] <= want[10] < 1
    alike = torch.ones(12, 12)  # every caption scored the same: no credit at any k below 12
    assert recall_at(alike.split(5), (1, 5, 10)) == {1: 0.0, 5: 0.0, 10: 0.0}
    one_tie = torch.eye(3) + torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert recall_at([one_tie], (1, 2)) == {1: pytest.approx(2 / 3), 2: 1.0}


def test_retrieval_bench_matches_openclips_recalls_and_times_both(tmp_path):
    out = tmp_path / "recall.json"
    result = subprocess.run([sys.executable, "bench/retrieval_metrics.py", "--samples", "300", "--width", "32",
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["samples"] == 300 and row["ours_s"] > 0 and row["openclip_s"] > 0
    assert 0 < row["image_to_text_R@1"] < 1


def test_preflight_opens_every_listed_set(shapes, image_folder, tmp_path):
    base = ["experiment=quickstart", *data_overrides(shapes)]
    short = tmp_path / "short.txt"
    short.write_text("one\ntwo\n")
    folder_set = f"{{name: b, path: '{image_folder['root']}', classnames: '{short}', templates: simple_imagenet}}"
    cfg = compose_config([*base, f"eval.zeroshot=[{{name: a, path: '{tmp_path}/nowhere', classnames: null, "
                                 f"templates: null}}, {folder_set}]",
                          f"eval.retrieval=[{{name: b, shards: '{shapes['eval_shards']}'}}]"])
    with pytest.raises(ValueError, match="the configuration cannot run") as err:
        preflight(cfg, CPU, str(tmp_path))
    message = str(err.value)
    assert f"eval.zeroshot[0].path matched no files: '{tmp_path}/nowhere'" in message
    assert f"eval.retrieval[0].name='b' is also the name of eval.zeroshot[1], which reads '{image_folder['root']}'" \
        in message
    assert (f"eval.zeroshot[1].classnames='{short}' gives 2 class names, but '{image_folder['root']}' has "
            f"{len(CLASSES)} classes") in str(err.value)


def test_zero_shot_labels_class_names_and_templates_come_from_the_set_or_open_clip(shapes, image_folder, tmp_path):
    """A label is a `.json` member's "label" or a `.cls` member (webdataset's ImageNet shards), a bad one counted;
    `imagenet1k` and `openai_imagenet` are open_clip's own lists; a templates file needs {} in every line."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    from src.data.reader import BadData
    from src.trainer.evaluate import class_prompts, eval_sets

    bad = BadData()
    samples = [{"json": b'{"label": 3}'}, {"cls": b"7"}, {"txt": b"no label"}, {"cls": b"seven"}]
    assert [sample_label({**sample, "__url__": "x.tar"}, bad) for sample in samples] == [3, 7, -1, None]
    assert dict(bad.counts) == {"bad_label": 1}
    templates = tmp_path / "templates.txt"
    templates.write_text("a photo of a {}.\nitap of a {}.\n")
    folder = image_folder["root"]
    cfg = compose_config(["experiment=quickstart", *data_overrides(shapes),
                          f"eval.zeroshot=[{{name: a, path: '{folder}', classnames: null, templates: '{templates}'}}]"])
    (_, listed) = eval_sets(cfg)
    names, prompts = class_prompts(listed)
    assert names == [f"c{i:02d}" for i in range(len(CLASSES))] and prompts == ["a photo of a {}.", "itap of a {}."]
    listed.classnames, listed.templates = "imagenet1k", "openai_imagenet"
    with pytest.raises(ValueError, match=f"gives 1000 class names, but '{folder}' has {len(CLASSES)} classes"):
        class_prompts(listed)
    listed.path, listed.folder = shapes["eval_shards"], False
    listed.classnames = None
    names, prompts = class_prompts(listed)
    assert names == CLASSES and prompts == [t("{}") for t in OPENAI_IMAGENET_TEMPLATES] and len(prompts) == 80
    templates.write_text("a photo of a thing.\n")
    listed.templates = str(templates)
    with pytest.raises(ValueError, match="every template a {} for the class name"):
        class_prompts(listed)
    listed.templates = str(tmp_path / "nowhere.txt")
    with pytest.raises(FileNotFoundError, match="or the name of what open_clip ships \\(openai_imagenet, "):
        class_prompts(listed)


def rank_split_overrides(shapes: dict[str, str], folder: dict[str, str], bad: str, *extra: str) -> list[str]:
    """Held-out shards of 50, 50 and 100 samples, then `bad`'s two: rank 0 reads the first, the third and the
    garbage shard, rank 1 the second and the one with bad samples."""
    train = expand_shards(shapes["shards"])[0]
    uneven = bad.replace("::", f"::{train}::", 1)
    return ["experiment=quickstart", *data_overrides(shapes), f"data.eval_shards='{uneven}'", "data.num_workers=0",
            "eval.batch_size=16", f"eval.zeroshot=[{{name: folder, path: '{folder['root']}', classnames: null, "
            "templates: simple_imagenet}]", *extra]


def rank_split_worker(rank: int, port: int, runs: list[tuple[list[str], str]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    for overrides, out in runs:
        cfg = compose_config(overrides)
        parts = image_text_parts(cfg, DistInfo(rank, WORLD, rank, torch.device("cpu")))
        if cfg.trainer.data_parallel == "fsdp2":
            apply_fsdp(parts.model, init_device_mesh("cpu", (WORLD,)))
        results = parts.evaluate(parts.model, contextlib.nullcontext, None)
        assert (results is None) == (rank != 0)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    dist.destroy_process_group()


def test_evaluation_shared_out_over_two_ranks_gives_the_single_process_results(shapes, image_folder, tmp_path):
    """Each rank encodes its share (uneven: 150 and 52 samples of the shards, half the folder's files, half the
    classes' prompts), with DDP's plain model and under FSDP2 (where the rank done first runs idle forwards
    until the other is done); the gathered metrics, and the bad-data counts summed over the ranks, are a single
    process's, to 1e-6."""
    torch.set_num_threads(1)
    bad = bad_held_out_shards(shapes, tmp_path)
    overrides = rank_split_overrides(shapes, image_folder, bad)
    parts = image_text_parts(compose_config(overrides), CPU)
    want = parts.evaluate(parts.model, contextlib.nullcontext, None)
    assert {"eval/zeroshot_top1", "eval/i2t_r10", "eval/val_loss", "eval/folder/zeroshot_top5"} <= want.keys()
    assert want["eval/bad/corrupt_image"] == want["eval/bad/truncated_shard"] == 1  # one from each rank's share
    runs = [(overrides, str(tmp_path / "ddp.json")),
            (rank_split_overrides(shapes, image_folder, bad, "trainer.data_parallel=fsdp2"),
             str(tmp_path / "fsdp2.json"))]
    fork_ranks(rank_split_worker, free_port(), runs, world=WORLD)
    for _, out in runs:
        with open(out) as f:
            got = json.load(f)
        assert got.keys() == want.keys(), out
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-6), (out, key)


def test_a_run_shows_the_evaluations_progress_and_logs_its_duration(shapes, tmp_path, capsys):
    """Under trainer.progress the evaluation counts its batches and the zero-shot prompts on bars of its own (the
    training bar stands still meanwhile), and its log line ends with how long it took."""
    from tests.conftest import small_trainer

    trainer = small_trainer(shapes, tmp_path / "run", "trainer.progress=true", "eval.batch_size=32", evaluate=True)
    with pytest.MonkeyPatch.context() as patch:
        messages = []
        patch.setattr(trainer.metrics, "message", messages.append)
        trainer.run_eval()
    trainer.metrics.close()
    err = capsys.readouterr().err
    assert "evaluating data.eval_shards:" in err
    assert "zero-shot prompts:   0%" in err  # a bar with a total: the prompt batches are known in advance
    started, line = messages
    assert started == "step 0: evaluating"
    assert line.startswith("step 0 eval: ") and "zeroshot_top1=" in line
    assert float(line.rsplit("(", 1)[1].removesuffix(" s)")) > 0
