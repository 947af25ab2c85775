"""Zero-shot classification, image<->text retrieval and the validation loss on held-out sets: the held-out split of
the training data (data.eval_shards, metrics eval/...) and the sets that eval.zeroshot, eval.retrieval and
eval.val_loss list (metrics eval/<name>/...).

Every rank encodes its share of each set (every world-size-th shard or image file). The features come together on
every rank in the set's own order (each sample carries its place), so every metric is the one a single process
computes; zero-shot class embeddings are shared out by class the same way. Under FSDP2 a forward needs every rank,
so a rank whose share ran out runs idle forwards until all are done."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.tokenizer import tokenize
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES
from tqdm import tqdm

from src.config import TrainConfig
from src.data.image_text import Preprocess
from src.data.loader import EvalBatches, eval_batches, eval_folder_batches, image_folder
from src.data.shards import expand_shards
from src.models.clip import CLIP
from src.parallel.distributed import all_gather_rows, any_rank

log = logging.getLogger(__name__)

KS = (1, 5, 10)
# What open_clip ships, by the names a set's `classnames` and `templates` may give.
CLASSNAME_SETS = {"imagenet1k": IMAGENET_CLASSNAMES}
TEMPLATE_SETS = {"openai_imagenet": OPENAI_IMAGENET_TEMPLATES, "simple_imagenet": SIMPLE_IMAGENET_TEMPLATES}
# The loss of a batch's image and text features as training computes it; `group` is the ranks it spans.
FeatureLoss = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup | None], torch.Tensor]


@dataclass
class EvalSet:
    """One held-out set and what is measured on it. `key` names it in errors (data.eval_shards, eval.zeroshot[0])."""

    prefix: str
    path: str
    key: str
    folder: bool
    zeroshot: bool
    classnames: str | None
    templates: str | None
    retrieval: bool
    val_loss: bool

    @property
    def captions(self) -> bool:
        return self.retrieval or self.val_loss


def listed_sets(cfg: TrainConfig) -> list[EvalSet]:
    """Each entry of eval.zeroshot, eval.retrieval and eval.val_loss as a set of its own."""
    sets = [EvalSet(f"eval/{s.name}/", s.path, f"eval.zeroshot[{i}]", os.path.isdir(s.path), True, s.classnames,
                    s.templates, False, False) for i, s in enumerate(cfg.eval.zeroshot)]
    for task in ("retrieval", "val_loss"):
        sets += [EvalSet(f"eval/{s.name}/", s.shards, f"eval.{task}[{i}]", os.path.isdir(s.shards), False, None, None,
                         task == "retrieval", task == "val_loss") for i, s in enumerate(getattr(cfg.eval, task))]
    return sets


def eval_sets(cfg: TrainConfig) -> list[EvalSet]:
    """The sets a run evaluates: data.eval_shards (as eval.held_out says), then the listed ones. Entries that share
    a name and a path are one set, read once (a retrieval set whose validation loss is also wanted); a name given
    to two paths is an error."""
    held_out, sets = cfg.eval.held_out, []
    if cfg.data.eval_shards:
        sets.append(EvalSet("eval/", cfg.data.eval_shards, "data.eval_shards", False, held_out.zeroshot, None, None,
                            held_out.retrieval, held_out.val_loss))
    named: dict[str, EvalSet] = {}
    for entry in listed_sets(cfg):
        name = entry.prefix.removeprefix("eval/").removesuffix("/")
        if not name or "/" in name:
            raise ValueError(f"{entry.key}.name={name!r}: give the set a name without '/' (its metrics are "
                             "eval/<name>/...)")
        found = named.setdefault(name, entry)
        if found is entry:
            sets.append(entry)
        elif found.path != entry.path:
            raise ValueError(f"{entry.key}.name={name!r} is also the name of {found.key}, which reads "
                             f"{found.path!r}: give each set its own name")
        elif entry.zeroshot:
            found.zeroshot, found.classnames, found.templates = True, entry.classnames, entry.templates
        else:
            found.retrieval, found.val_loss = found.retrieval or entry.retrieval, found.val_loss or entry.val_loss
    return sets


def _lines(path: str, key: str, shipped: dict) -> list[str]:
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError as err:
        raise FileNotFoundError(f"{key}={path!r} cannot be read ({err.strerror or err}): give a file with one "
                                f"entry per line, or the name of what open_clip ships ({', '.join(shipped)})") from None


def classes_json(eval_set: EvalSet) -> dict | None:
    """`classes.json` beside a shard set: {"classes": [...], "templates": ["a photo of a {}.", ...]}; None if
    there is none."""
    first = expand_shards(eval_set.path, key=eval_set.key)[0]
    path = os.path.join(os.path.dirname(first), "classes.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def class_prompts(eval_set: EvalSet) -> tuple[list[str], list[str]]:
    """The class names (in label order) and prompt templates ("a photo of a {}.") of a zero-shot set. An image
    folder's labels are its sorted class directories (torchvision's ImageFolder); labelled shards take theirs
    from classes.json. `classnames` and `templates` replace either: the name of what open_clip ships
    (CLASSNAME_SETS, TEMPLATE_SETS) or a file of one entry per line."""
    spec = None if eval_set.folder else classes_json(eval_set)
    if eval_set.folder:
        names = [name.replace("_", " ") for name in image_folder(eval_set.path)[0]]
    elif spec is None:
        raise FileNotFoundError(f"{eval_set.key}: zero-shot classification needs classes.json beside the shards "
                                f"{eval_set.path!r} (or an image folder)")
    else:
        names = list(spec["classes"])
    if eval_set.classnames is not None:
        given = CLASSNAME_SETS.get(eval_set.classnames) or _lines(eval_set.classnames, f"{eval_set.key}.classnames",
                                                                      CLASSNAME_SETS)
        if len(given) != len(names):
            raise ValueError(f"{eval_set.key}.classnames={eval_set.classnames!r} gives {len(given)} class names, but "
                             f"{eval_set.path!r} has {len(names)} classes: give one name per class, in sorted order "
                             "of the class directories")
        names = list(given)
    if eval_set.templates in TEMPLATE_SETS:
        templates = [t("{}") for t in TEMPLATE_SETS[eval_set.templates]]
    elif eval_set.templates is not None:
        templates = _lines(eval_set.templates, f"{eval_set.key}.templates", TEMPLATE_SETS)
    else:
        templates = (spec or {}).get("templates") or [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]
    if not names or not all("{}" in t for t in templates):
        raise ValueError(f"{eval_set.key}: {len(names)} classes and templates {templates[:3]}...: a set needs "
                         "classes, and every template a {} for the class name")
    return names, templates


RECALL_ROWS_PER_CHUNK = 1024  # rows of a score matrix scored and compared at once: bounds the memory


def score_chunks(queries: torch.Tensor, keys: torch.Tensor) -> Iterator[torch.Tensor]:
    """The rows of queries @ keys.T, RECALL_ROWS_PER_CHUNK at a time: the N × N scores never exist at once
    (40 GB of float32 at N = 100,000)."""
    return (queries[i : i + RECALL_ROWS_PER_CHUNK] @ keys.T for i in range(0, len(queries), RECALL_ROWS_PER_CHUNK))


def recall_at(score_rows: Iterable[torch.Tensor], ks: tuple[int, ...]) -> dict[int, float]:
    """Recall@k for each k: the share of rows whose correct column (row i's is column i) ranks among the first k.
    `score_rows`: the score matrix's rows in order, in chunks. A row's rank is the number of other columns scored
    at least as high as its correct one, so a tie counts against the correct column: a model that scores
    everything alike gets no credit. Counted, not sorted: at 20,000 pairs on 2 CPU cores, sorting each row took
    97 s and scoring and counting in chunks 6 s (docs/BENCHMARKS.md)."""
    ranks, first = [], 0
    for scores in score_rows:
        rows = torch.arange(len(scores))
        correct = scores[rows, first + rows].unsqueeze(1)
        ranks.append((scores >= correct).sum(dim=1) - 1)
        first += len(scores)
    rank = torch.cat(ranks) if ranks else torch.zeros(0)
    return {k: (rank < k).float().mean().item() for k in ks}


def in_lockstep(items: Iterable, lockstep: bool) -> Iterator:
    """`items`, then, with `lockstep`, None until every rank has run out of its own (a rank given None runs an
    idle forward): under FSDP2 every rank takes part in every forward."""
    iterator = iter(items)
    while True:
        item = next(iterator, None)
        if not lockstep:
            if item is None:
                return
        elif not any_rank(item is not None):
            return
        yield item


def gather_counts(counts: dict[str, int]) -> dict[str, int]:
    if not dist.is_initialized():
        return counts
    shares: list[dict[str, int]] = [{}] * dist.get_world_size()
    dist.all_gather_object(shares, counts)
    total: Counter[str] = Counter()
    for share in shares:
        total.update(share)
    return dict(total)


@dataclass
class Encoder:
    """The model, how a forward runs in the evaluation, and whether it is to stop (`until_stopped`)."""

    model: CLIP
    device: torch.device
    prepare_images: Callable[[torch.Tensor], torch.Tensor]
    autocast: Callable
    image_size: int
    context_length: int
    lockstep: bool
    stop: Callable[[], bool] | None

    def images(self, images: torch.Tensor | None) -> torch.Tensor | None:
        idle = images is None
        if idle:
            images = torch.zeros(1, 3, self.image_size, self.image_size, dtype=torch.uint8)
        with self.autocast():
            features = self.model.encode_image(self.prepare_images(images.to(self.device))).float()
        return None if idle else features

    def texts(self, tokens: torch.Tensor | None) -> torch.Tensor | None:
        idle = tokens is None
        if idle:
            tokens = torch.zeros(1, self.context_length, dtype=torch.long)
        with self.autocast():
            features = self.model.encode_text(tokens.to(self.device)).float()
        return None if idle else features


class EvaluationStopped(Exception):
    """A stop signal came during an evaluation: the evaluation is left to the resumed run."""


def until_stopped(items: Iterable, stop: Callable[[], bool] | None) -> Iterator:
    """`items`, raising EvaluationStopped before the next one once `stop()` says so (None: never). A local check,
    for one process only: with several, a rank that left on its own would leave the others waiting in the next
    collective."""
    for item in items:
        if stop is not None and stop():
            raise EvaluationStopped
        yield item


def in_eval_mode(function: Callable) -> Callable:
    """`function(model, ...)` run with `model` in eval mode, and in its own mode again after it, however it ends (a
    stopped evaluation raises)."""
    @functools.wraps(function)
    def wrapped(model: torch.nn.Module, *args, **kwargs):
        was_training = model.training
        model.eval()
        try:
            return function(model, *args, **kwargs)
        finally:
            model.train(was_training)
    return wrapped


def progress_bar(items: Iterable, desc: str, shown: bool, total: int | None = None) -> Iterable:
    """`items`, counted on a transient progress bar where `shown` (rank 0 under trainer.progress): an evaluation
    of a large set takes minutes, and the training bar stands still meanwhile."""
    return tqdm(items, desc=desc, total=total, unit="batch", leave=False, dynamic_ncols=True, disable=not shown)


def set_features(encoder: Encoder, batches: EvalBatches, captions: bool, key: str,
                 progress: bool) -> dict[str, torch.Tensor]:
    """Image (and text) features, labels and bad-data counts of the whole set, in its order, on every rank."""
    parts: dict[str, list[torch.Tensor]] = {"images": [], "texts": [], "labels": [], "order": []}
    batches_in_step = until_stopped(in_lockstep(batches, encoder.lockstep), encoder.stop)
    for batch in progress_bar(batches_in_step, f"evaluating {key}", progress):
        images = encoder.images(None if batch is None else batch["images"])
        texts = encoder.texts(None if batch is None else batch["tokens"]) if captions else None
        if batch is None:
            continue
        parts["images"].append(images)
        parts["texts"].append(texts if captions else images[:, :0])
        parts["labels"].append(batch["labels"].to(encoder.device))
        parts["order"].append(batch["order"].to(encoder.device))
    width = encoder.model.text_projection.shape[1]
    empty = {"images": torch.zeros(0, width), "texts": torch.zeros(0, width if captions else 0),
             "labels": torch.zeros(0, dtype=torch.long), "order": torch.zeros(0, dtype=torch.long)}
    local = {name: torch.cat(values) if values else empty[name].to(encoder.device) for name, values in parts.items()}
    gathered = {name: all_gather_rows(value.contiguous()).cpu() for name, value in local.items()}
    place = gathered.pop("order").argsort()
    return {name: value[place] for name, value in gathered.items()}


def class_embeddings(encoder: Encoder, names: list[str], templates: list[str], batch_size: int,
                     progress: bool) -> torch.Tensor:
    """(classes, D): each class's normalized mean embedding over its prompts. Rank r encodes every world-th class."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = list(range(rank, len(names), world))
    per_forward = max(1, batch_size // len(templates))
    chunks = [mine[i : i + per_forward] for i in range(0, len(mine), per_forward)]
    embeddings, indices = [], []
    chunks_in_step = until_stopped(in_lockstep(chunks, encoder.lockstep), encoder.stop)
    for chunk in progress_bar(chunks_in_step, "zero-shot prompts", progress, len(chunks)):
        tokens = None if chunk is None else tokenize([t.format(names[c]) for c in chunk for t in templates],
                                                     encoder.context_length)
        features = encoder.texts(tokens)
        if chunk is None:
            continue
        mean = features.view(len(chunk), len(templates), -1).mean(dim=1)
        embeddings.append(F.normalize(mean, dim=-1))
        indices.append(torch.tensor(chunk, device=encoder.device))
    width = encoder.model.text_projection.shape[1]
    local = torch.cat(embeddings) if embeddings else torch.zeros(0, width, device=encoder.device)
    index = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long, device=encoder.device)
    gathered, order = all_gather_rows(local).cpu(), all_gather_rows(index).cpu()
    return gathered[order.argsort()]


def validation_loss(features: dict[str, torch.Tensor], loss: FeatureLoss, batch_size: int,
                    group: dist.ProcessGroup | None) -> float:
    """The training loss of the set in consecutive batches of `batch_size` (the last may be smaller), weighted
    by their sizes, computed by this one process (`group`: a group of this rank alone when several run)."""
    images, texts = features["images"], features["texts"]
    total = sum(loss(images[i : i + batch_size], texts[i : i + batch_size], group).item()
                * len(images[i : i + batch_size]) for i in range(0, len(images), batch_size))
    return total / len(images)


def set_metrics(eval_set: EvalSet, features: dict[str, torch.Tensor], classes: torch.Tensor | None,
                loss: FeatureLoss, batch_size: int, group: dist.ProcessGroup | None) -> dict[str, float]:
    prefix, results = eval_set.prefix, {}
    image_features, labels = features["images"], features["labels"]
    known = labels >= 0
    if classes is not None and known.any():
        ranked = (image_features[known] @ classes.T).topk(min(5, len(classes)), dim=1).indices
        truth = labels[known].unsqueeze(1)
        results[f"{prefix}zeroshot_top1"] = (ranked[:, :1] == truth).any(dim=1).float().mean().item()
        results[f"{prefix}zeroshot_top5"] = (ranked == truth).any(dim=1).float().mean().item()
    if eval_set.retrieval and len(image_features):
        texts = features["texts"]
        for name, (queries, keys) in (("i2t", (image_features, texts)), ("t2i", (texts, image_features))):
            for k, value in recall_at(score_chunks(queries, keys), KS).items():
                results[f"{prefix}{name}_r{k}"] = value
    if eval_set.val_loss and len(image_features):
        results[f"{prefix}val_loss"] = validation_loss(features, loss, batch_size, group)
    return results


@torch.no_grad()
@in_eval_mode
def evaluate(
    model: CLIP, sets: list[EvalSet], *, loss: FeatureLoss, batch_size: int, image_size: int, context_length: int,
    num_workers: int, max_image_pixels: int | None, retries: int, device: torch.device,
    prepare_images: Callable[[torch.Tensor], torch.Tensor], autocast, lockstep: bool,
    solo_group: dist.ProcessGroup | None, is_main: bool, preprocess: Preprocess, progress: bool,
    stop: Callable[[], bool] | None,
) -> dict[str, float] | None:
    """Every rank calls this (collective when several run); rank 0 gets the results, the others None. `loss`
    gives the validation loss, run by rank 0 alone over `solo_group` (a group of rank 0 only, None in one
    process). Skipped samples are counted by reason as <prefix>bad/<reason>. `preprocess`: the run's, of which
    evaluation takes the deterministic transform. `progress`: show progress bars (on the rank that logs). `stop`:
    asked before each forward; EvaluationStopped is raised once it says so (None: never; see `until_stopped`)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    encoder = Encoder(model, device, prepare_images, autocast, image_size, context_length, lockstep, stop)
    results: dict[str, float] = {}
    for eval_set in sets:
        common = dict(batch_size=batch_size, image_size=image_size, num_workers=num_workers,
                      max_image_pixels=max_image_pixels, rank=rank, world_size=world, preprocess=preprocess)
        if eval_set.folder:
            batches = eval_folder_batches(image_folder(eval_set.path)[1], **common)
        else:
            batches = eval_batches(eval_set.path, context_length=context_length, retries=retries,
                                   captions=eval_set.captions, key=eval_set.key, **common)
        features = set_features(encoder, batches, eval_set.captions, eval_set.key, progress)
        bad = gather_counts(batches.bad_counts())
        classes = None
        if eval_set.zeroshot:
            names, templates = class_prompts(eval_set)
            classes = class_embeddings(encoder, names, templates, batch_size, progress)
        if is_main and not len(features["images"]):
            log.warning("%s (%s): no sample could be read (skipped: %s)", eval_set.key, eval_set.path, bad)
        if is_main:
            results.update(set_metrics(eval_set, features, classes, loss, batch_size, solo_group))
            results.update({f"{eval_set.prefix}bad/{reason}": n for reason, n in sorted(bad.items())})
    return results if is_main else None
