"""Video-language CLIP: the CLIP image tower encodes every frame, a cross-attention head lets each caption look
at the whole clip, and a clip-caption score comes out (docs/video.md, "The model").

- Visual sequence. Every frame goes through the image tower; its tokens (`model.video.frame_tokens`: the
  patch tokens, the class token, or the mean patch token) plus a learned temporal position embedding, over
  all T frames in order, are the keys/values of the head. Under sequence parallelism each rank encodes only
  its contiguous share of the frames and keeps only their tokens.
- Video embedding. The frame-averaged CLIP image embedding `v̄` (normalized per frame, averaged over all
  T frames, normalized). Scoring `v̄` against the caption embeddings is the mean-pooling baseline
  (`model.video.head=mean`): it sees which frames occur, not in which order.
- Head (`model.video.head=xattn`). A caption's token states (the text tower's last hidden states) are the
  queries of `head_layers` cross-attention blocks (LV-XAttn) over the visual sequence, each followed by an
  MLP block; every residual branch has a zero-initialized layer-scale. The head's total residual update,
  mean-pooled over the caption's tokens and projected to the embedding space, is added to `v̄`:
  u_ij = normalize(v̄_i) + proj(pool(head(caption_j, clip_i) - caption_j)). The pooled video-text
  embedding u_ij is scored against the caption embedding: s_ij = cos(u_ij, t_j). At initialization the
  update is zero and the model is exactly the mean-pooling baseline (so fine-tuning starts from what the
  pre-trained CLIP knows); training teaches the head what mean-pooling cannot see, such as the order of
  frames.

A score needs the clip and the caption together, so a (clips × captions) score matrix runs the head on every
pair. The queries of all captions are concatenated into one query sequence per clip, so each clip's keys and
values are projected once, whatever the number of captions. The head has no self-attention: query rows never
mix, and one caption's scores do not depend on the other captions in the sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from src.config import FrameTokens, ModelConfig, TextQueries, VideoConfig, VideoHead
from src.models.clip import CLIP, build_model, end_of_text
from src.models.cross_attention import CrossAttentionBlock
from src.models.locking import image_tower, lock_tower
from src.models.transformer import LayerScale
from src.parallel.distributed import all_reduce_with_grad
from src.parallel.mesh import group_size, share, share_sizes
from src.parallel.xattn import ShardLengths


class VideoTextOutput(NamedTuple):
    video: torch.Tensor  # (B, D) normalized frame-averaged CLIP embeddings, the same on every SP rank
    text: torch.Tensor  # (B, D) normalized caption embeddings
    # (B, captions of this SP rank) cosine scores of this rank's clips against its share of the gathered
    # captions; None for the mean-pooling baseline, whose score is video @ text.T
    scores: torch.Tensor | None
    logit_scale: torch.Tensor


def temporal_init(frames: int, width: int) -> torch.Tensor:
    """(frames, width): the cosines of the DCT-II over the frames (frequencies 1 .. frames-1, cycled over the
    channels). Any weighting of the frames over time, such as late minus early, is then a linear function of the
    embedding from the start. Unit scale per channel, like the normalized frame tokens it is added to: at the
    image tower's position-embedding scale (width^-0.5) the order of the frames stayed too faint in the keys for
    the head to learn it (docs/video.md)."""
    times = torch.arange(frames) + 0.5
    frequencies = 1 + torch.arange(width) % max(1, frames - 1)
    return 2 ** 0.5 * torch.cos(torch.pi * times[:, None] * frequencies[None] / frames)


class MLPBlock(nn.Module):
    """x + ls(mlp(ln(x))): the MLP that follows each cross-attention block."""

    def __init__(self, width: int, mlp_ratio: float, ls_init_value: float):
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(width, hidden)), ("gelu", nn.GELU()), ("c_proj", nn.Linear(hidden, width)),
        ]))
        self.ls = LayerScale(width, ls_init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ls(self.mlp(self.ln(x)))


class VideoTextHead(nn.Module):
    """Caption queries attend to the visual sequence; returns the pooled, projected residual update."""

    def __init__(self, text_width: int, vision_width: int, embed_dim: int, cfg: VideoConfig):
        super().__init__()
        self.xattn = nn.ModuleList(
            CrossAttentionBlock(text_width, cfg.head_heads, kv_width=vision_width, ls_init_value=cfg.head_ls_init,
                                recompute=cfg.head_recompute, impl=cfg.head_impl)
            for _ in range(cfg.head_layers)
        )
        self.mlp = nn.ModuleList(
            MLPBlock(text_width, cfg.head_mlp_ratio, cfg.head_ls_init) for _ in range(cfg.head_layers)
        )
        self.proj = nn.Parameter(torch.randn(text_width, embed_dim) * text_width ** -0.5)

    def forward(
        self, queries: torch.Tensor, weights: torch.Tensor, visual: torch.Tensor, group: ProcessGroup | None,
        lengths: ShardLengths | None = None,
    ) -> torch.Tensor:
        """queries (C, Lq, width) of C captions and their pooling weights (C, Lq); visual (B, S_local, kv width);
        `lengths`: every rank's query and visual lengths, as in `lv_xattn` (None: each layer exchanges them).
        Returns (B, C, embed_dim): the update of every (clip, caption) pair."""
        captions, length, width = queries.shape
        start = queries.reshape(1, captions * length, width).expand(visual.shape[0], -1, -1)
        x = start
        for xattn, mlp in zip(self.xattn, self.mlp):
            # Each rank holds different captions, so the query sequence is sharded (LV-XAttn's ring).
            x = mlp(xattn(x, visual, group, q_sharded=True, lengths=lengths))
        update = (x - start).view(-1, captions, length, width)
        return torch.einsum("bclw,cl->bcw", update, weights) @ self.proj


class VideoCLIP(nn.Module):
    def __init__(self, clip: CLIP, cfg: ModelConfig, frames: int):
        super().__init__()
        video = cfg.video
        for key, value, allowed in (("head", video.head, VideoHead), ("frame_tokens", video.frame_tokens, FrameTokens),
                                    ("text_queries", video.text_queries, TextQueries)):
            if value not in allowed.values():
                raise ValueError(f"model.video.{key}={value!r} is not one of {', '.join(allowed.values())}")
        self.clip, self.frames = clip, frames
        self.frame_tokens, self.text_queries = video.frame_tokens, video.text_queries
        self.head: VideoTextHead | None = None
        if video.head == "xattn":
            device = clip.logit_scale.device
            width = cfg.vision.width
            self.temporal_embedding = nn.Parameter(temporal_init(frames, width).to(device))
            with torch.device(device):
                self.head = VideoTextHead(cfg.text.width, width, cfg.embed_dim, video)

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    def clamp_logit_scale(self) -> None:
        self.clip.clamp_logit_scale()

    def encode_video(
        self, frames: torch.Tensor, first_frame: int = 0, group: ProcessGroup | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """frames (B, T_local, 3, H, W): this rank's frames, starting at frame `first_frame` of the clip.
        Returns this rank's visual sequence (B, T_local · tokens per frame, width) (None without a head) and the
        clip's normalized frame-averaged embedding (B, D) over the frames of every rank of `group`."""
        batch, local = frames.shape[:2]
        ranks = group_size(group)
        if local * ranks != self.frames:
            raise ValueError(f"this rank has {local} frames of a {self.frames}-frame clip, but each of the {ranks} "
                             f"ranks of the group must hold {self.frames}/{ranks}: split the frames evenly "
                             "(the trainer's Mesh.frames does)")
        class_only = self.head is None or self.frame_tokens == "cls"
        tokens = self.clip.visual.tokens(frames.flatten(0, 1), class_only=class_only)
        cls_state = tokens if class_only else tokens[:, 0]
        per_frame = F.normalize(cls_state @ self.clip.visual.proj, dim=-1).view(batch, local, -1)
        frame_sum = all_reduce_with_grad(per_frame.float().sum(dim=1), group)
        video = F.normalize(frame_sum / self.frames, dim=-1)
        if self.head is None:
            return None, video
        if self.frame_tokens == "patches":
            tokens = tokens[:, 1:]
        elif self.frame_tokens == "cls":
            tokens = cls_state[:, None]
        else:
            tokens = tokens[:, 1:].mean(dim=1, keepdim=True)
        tokens = tokens.view(batch, local, *tokens.shape[1:])
        position = self.temporal_embedding[first_frame : first_frame + local].to(tokens.dtype)
        return (tokens + position[None, :, None]).flatten(1, 2), video

    def encode_text(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Caption token ids (B, L) -> (the head's queries (B, Lq, width), their pooling weights (B, Lq), the
        normalized caption embedding (B, D)). The queries are every token up to end-of-text
        (`text_queries=all`, mean-pooled), or the end-of-text token alone (`eot`)."""
        if self.text_queries == "eot":
            eot = self.clip.text_tokens(tokens, pooled=end_of_text(tokens))
            return eot[:, None], torch.ones(len(tokens), 1, device=tokens.device), self.clip.project_text(eot)
        states = self.clip.text_tokens(tokens)
        text = self.clip.pool_text(states, tokens)
        valid = (tokens != 0).float()  # 0 pads the caption after end-of-text
        return states, valid / valid.sum(dim=1, keepdim=True), text

    def score(
        self, visual: torch.Tensor, video: torch.Tensor, queries: torch.Tensor, weights: torch.Tensor,
        text: torch.Tensor, group: ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Cosine scores (B clips, this rank's share of the C captions): every rank of `group` holds the same
        clips (its own frames) and all captions, and scores its contiguous share of the captions."""
        mine = share(len(text), group)
        # Known on every rank without asking the others (no host synchronisation): the captions are shared out
        # by `share`, and the frames, hence the visual tokens, evenly (encode_video checks it).
        lengths = None if group is None else ShardLengths(
            tuple(n * queries.shape[1] for n in share_sizes(len(text), group)),
            (visual.shape[1],) * group_size(group))
        update = self.head(queries[mine], weights[mine], visual, group, lengths)
        joint = F.normalize(video[:, None] + update.float(), dim=-1)
        return (joint * text[mine].float()).sum(dim=-1)

    def forward(
        self, frames: torch.Tensor, tokens: torch.Tensor, *, first_frame: int = 0,
        group: ProcessGroup | None = None, gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> VideoTextOutput:
        """frames (B, T_local, 3, H, W) from `first_frame` on, tokens (B, L); `group`: the sequence-parallel
        ranks, which hold the same clips; `gather`: concatenates the captions of the data-parallel ranks
        (with gradient), so that each rank scores its clips against the captions of the global batch."""
        visual, video = self.encode_video(frames, first_frame, group)
        queries, weights, text = self.encode_text(tokens)
        scores = None
        if self.head is not None:
            if gather is not None:
                queries, weights, all_text = gather(queries), gather(weights), gather(text)
            else:
                all_text = text
            scores = self.score(visual, video, queries, weights, all_text, group)
        return VideoTextOutput(video, text, scores, self.clip.logit_scale.exp())


def freeze_vision(clip: CLIP, trainable_blocks: int) -> None:
    """Train only the last `trainable_blocks` blocks of the image tower (with its final norm and projection):
    src/models/locking.py's lock_tower with that many unlocked blocks; -1 trains the whole tower. Frozen layers
    record no autograd graph, so they cost no activation memory."""
    if trainable_blocks == -1:
        return
    layers = len(clip.visual.transformer.resblocks)
    if not 0 <= trainable_blocks <= layers:
        raise ValueError(f"model.video.vision_trainable_blocks={trainable_blocks} must be -1 (all) or 0..{layers} "
                         "(the image tower has that many blocks)")
    clip.visual.locked = lock_tower(image_tower(clip), trainable_blocks)


def build_video_model(cfg: ModelConfig, frames: int, device: torch.device | str = "cpu") -> VideoCLIP:
    """The CLIP towers (built as `build_model` does) plus the temporal embedding and the head; the image tower
    frozen as `model.video.vision_trainable_blocks` says. Pre-trained weights are loaded afterwards, into
    `.clip`."""
    if frames < 1:
        raise ValueError(f"the video model needs data.frames >= 1 frames per clip, got {frames}")
    model = VideoCLIP(build_model(cfg, device), cfg, frames)
    freeze_vision(model.clip, cfg.video.vision_trainable_blocks)
    return model
