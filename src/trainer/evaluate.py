"""Zero-shot classification and image-text retrieval on held-out shards."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from open_clip.tokenizer import tokenize
from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

from src.data.image_text import Preprocess
from src.data.loader import eval_batches
from src.data.shards import expand_shards
from src.models.clip import CLIP


def load_classes(eval_pattern: str) -> tuple[list[str], list[str]] | None:
    """`classes.json` beside the eval shards: {"classes": [...], "templates": ["a photo of a {}.", ...]}.
    Without templates, OpenAI's 80 ImageNet prompts are used."""
    first = expand_shards(eval_pattern, key="data.eval_shards")[0]
    path = os.path.join(os.path.dirname(first), "classes.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        spec = json.load(f)
    templates = spec.get("templates") or [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]
    return spec["classes"], templates


def recall_at(similarity: torch.Tensor, ks: tuple[int, ...]) -> dict[int, float]:
    """Row i's correct column is i."""
    ranking = similarity.argsort(dim=1, descending=True)
    hit_rank = (ranking == torch.arange(len(similarity)).unsqueeze(1)).float().argmax(dim=1)
    return {k: (hit_rank < k).float().mean().item() for k in ks}


@torch.no_grad()
def evaluate(
    model: CLIP, eval_pattern: str, *, batch_size: int, image_size: int, context_length: int, num_workers: int,
    device: torch.device, prepare_images: Callable[[torch.Tensor], torch.Tensor], autocast,
    zeroshot: bool = True, retrieval: bool = True, preprocess: Preprocess,
) -> dict[str, float]:
    was_training = model.training
    model.eval()
    images, texts, labels = [], [], []
    for batch in eval_batches(
        eval_pattern, batch_size=batch_size, image_size=image_size, context_length=context_length,
        num_workers=num_workers, preprocess=preprocess,
    ):
        with autocast():
            images.append(model.encode_image(prepare_images(batch["images"].to(device))).float())
            texts.append(model.encode_text(batch["tokens"].to(device)).float())
        labels.append(batch["labels"])
    image_features, text_features = torch.cat(images).cpu(), torch.cat(texts).cpu()
    label_tensor = torch.cat(labels)
    results: dict[str, float] = {}
    classes = load_classes(eval_pattern) if zeroshot else None
    if classes is not None and (label_tensor >= 0).any():
        names, templates = classes
        weights = []
        for name in names:
            tokens = tokenize([t.format(name) for t in templates], context_length).to(device)
            with autocast():
                class_embedding = model.encode_text(tokens).float().mean(dim=0)
            weights.append(F.normalize(class_embedding, dim=-1).cpu())
        logits = image_features @ torch.stack(weights).T
        known = label_tensor >= 0
        ranked = logits[known].topk(min(5, len(names)), dim=1).indices
        truth = label_tensor[known].unsqueeze(1)
        results["eval/zeroshot_top1"] = (ranked[:, :1] == truth).any(dim=1).float().mean().item()
        results["eval/zeroshot_top5"] = (ranked == truth).any(dim=1).float().mean().item()
    if retrieval:
        similarity = image_features @ text_features.T
        for name, sim in (("i2t", similarity), ("t2i", similarity.T)):
            for k, value in recall_at(sim, (1, 5)).items():
                results[f"eval/{name}_r{k}"] = value
    model.train(was_training)
    return results
