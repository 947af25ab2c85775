"""Text->video and video->text retrieval on held-out clips (recall@1/5/10)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from src.data.image_text import Preprocess
from src.data.loader import eval_batches
from src.models.video_clip import VideoCLIP
from src.parallel.distributed import all_gather_columns
from src.trainer.evaluate import RECALL_ROWS_PER_CHUNK, in_eval_mode, progress_bar, recall_at, until_stopped

KS = (1, 5, 10)
# Elements of the head's widest activation (the MLP's hidden layer) per chunk of clips scored at once.
CHUNK_ELEMENTS = 1 << 24


def retrieval_metrics(similarity: torch.Tensor, prefix: str) -> dict[str, float]:
    """similarity (clips, captions), where clip i belongs with caption i."""
    results = {}
    for name, sim in (("v2t", similarity), ("t2v", similarity.T)):
        for k, value in recall_at(sim.split(RECALL_ROWS_PER_CHUNK), KS).items():
            results[f"eval/{prefix}{name}_r{k}"] = value
    return results


@torch.no_grad()
@in_eval_mode
def evaluate_video(
    model: VideoCLIP, eval_pattern: str, *, frames: slice, total_frames: int, batch_size: int, image_size: int,
    context_length: int, num_workers: int, device: torch.device, prepare_images: Callable[[torch.Tensor], torch.Tensor],
    autocast, max_image_pixels: int | None, retries: int, group: dist.ProcessGroup | None = None,
    preprocess: Preprocess, progress: bool, stop: Callable[[], bool] | None,
) -> dict[str, float]:
    """Every rank of `group` (a sequence-parallel group) calls this with its share `frames` of each clip's
    frames; all get the results. Clips are scored against every held-out caption: by the model's head
    (eval/t2v_r1, ...) and by the frame-averaged CLIP embedding, the mean-pooling baseline
    (eval/meanpool_t2v_r1, ...; for a model without a head this is its only score, eval/t2v_r1, ...). Clips that
    cannot be read are skipped and counted as eval/bad/<reason>. `progress`: show a progress bar; `stop`: as for
    src.trainer.evaluate.evaluate."""
    visual, videos, queries, weights, texts = [], [], [], [], []
    batches = eval_batches(eval_pattern, batch_size=batch_size, image_size=image_size, context_length=context_length,
                           num_workers=num_workers, frames=total_frames, max_image_pixels=max_image_pixels,
                           retries=retries, preprocess=preprocess)
    for batch in progress_bar(until_stopped(batches, stop), "evaluating data.eval_shards", progress):
        with autocast():
            clip_tokens, video = model.encode_video(
                prepare_images(batch["images"][:, frames].to(device)), frames.start, group)
            query, weight, text = model.encode_text(batch["tokens"].to(device))
        visual.append(clip_tokens)
        videos.append(video.float())
        queries.append(query)
        weights.append(weight)
        texts.append(text.float())
    video, text = torch.cat(videos), torch.cat(texts)
    mean_pool = retrieval_metrics((video @ text.T).cpu(), "meanpool_" if model.head is not None else "")
    mean_pool.update({f"eval/bad/{reason}": n for reason, n in sorted(batches.bad_counts().items())})
    if model.head is None:
        return mean_pool
    all_visual, all_queries, all_weights = torch.cat(visual), torch.cat(queries), torch.cat(weights)
    per_clip = len(text) * all_queries.shape[1] * all_queries.shape[2] * 4  # captions × queries × MLP width
    chunk = max(1, CHUNK_ELEMENTS // per_clip)
    rows = []
    for start in range(0, len(video), chunk):
        with autocast():
            rows.append(model.score(all_visual[start : start + chunk], video[start : start + chunk], all_queries,
                                    all_weights, text, group).float().cpu())
    scores = torch.cat(rows)
    scores = all_gather_columns(scores, group)  # each rank scored its own share of the captions
    return {**retrieval_metrics(scores, ""), **mean_pool}
