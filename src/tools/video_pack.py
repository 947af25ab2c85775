"""Pack video clips into webdataset shards of pre-decoded frames, so video training is not decode-bound.

Each sample is one clip: K frames sampled uniformly over the clip (the middle of K equal segments), resized so
the short side is at most `short_side`, JPEG-encoded as `{key}.f000.jpg ... {key}.f{K-1}.jpg`, plus
`{key}.txt` (the caption) and `{key}.json` (source, clip times, fps, original size, the frames' timestamps).
The loader later samples T ≤ K of these frames per epoch, so training sees different frames each epoch
instead of the ones frozen at pack time.

Decoding uses PyAV with one thread per video: the pool parallelises over videos. An unreadable video, or a
clip with fewer than K distinct frames, fails only its own row (failures.jsonl): no caption moves to another
clip.
"""

from __future__ import annotations

import functools
import io
import json
import os

from PIL import Image

from src.tools.shard_writer import PackSummary, Row, SampleError, write_shards

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".avi", ".mov")


def clip_bounds(row: Row) -> tuple[float, float | None]:
    """Optional `start` / `end` columns, in seconds."""
    try:
        start = float(row.extra.get("start") or 0.0)
        end = float(row.extra["end"]) if row.extra.get("end") not in (None, "") else None
    except (TypeError, ValueError) as err:
        raise SampleError("failed_bad_times", f"start/end are not numbers: {err}") from err
    if start < 0 or (end is not None and end <= start):
        raise SampleError("failed_bad_times", f"bad clip bounds start={start} end={end}")
    return start, end


def decode_frames(path: str, start: float, end: float | None, frames: int):
    """The `frames` frames nearest to the segment centres of [start, end], decoded in one sequential pass.
    Returns (PIL images, their timestamps, fps, (width, height), clip end)."""
    import av  # the `video` extra; image-only installs never call this

    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type, stream.codec_context.thread_count = "SLICE", 1  # one video per process
        duration = float(stream.duration * stream.time_base) if stream.duration else container.duration / 1e6
        end = min(end, duration) if end is not None else duration
        targets = [start + (i + 0.5) * (end - start) / frames for i in range(frames)]
        if start > 0:
            container.seek(int(start / stream.time_base), stream=stream, backward=True)
        picked: list[tuple[float, av.VideoFrame]] = []
        previous = None
        for frame in container.decode(stream):
            t = frame.time
            if t is None:  # a frame without a timestamp cannot be placed in the clip
                continue
            while len(picked) < frames and t >= targets[len(picked)]:
                target = targets[len(picked)]
                closer = previous is not None and target - previous[0] < t - target
                picked.append(previous if closer else (t, frame))
            if len(picked) == frames or t > end:
                break
            previous = (t, frame) if t >= start else None
        fps = float(stream.average_rate or 0)
        size = (stream.codec_context.width, stream.codec_context.height)
    times = [t for t, _ in picked]
    if len(picked) < frames or len(set(times)) < frames:
        raise SampleError("failed_too_short", f"{len(set(times))} distinct frames in [{start:.2f}, {end:.2f}] s, "
                                              f"need {frames}")
    # One scaling thread: PyAV's threaded rescaler (17+) left in a parent deadlocks the children it forks.
    return [frame.to_image(threads=1) for _, frame in picked], times, fps, size, end


def encode_frame(image: Image.Image, short_side: int, quality: int) -> bytes:
    scale = short_side / min(image.size)
    if scale < 1:
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def pack_clip(key: str, row: Row, *, videos_dir: str, frames: int, short_side: int, quality: int) -> dict:
    """One clip's sample, or SampleError naming why the row was not packed."""
    if not row.caption.strip():
        raise SampleError("failed_no_caption", "empty caption")
    path = os.path.join(videos_dir, row.path)
    if not os.path.isfile(path):
        raise SampleError("failed_to_read", f"no such file: {path}")
    start, end = clip_bounds(row)
    try:
        images, times, fps, size, end = decode_frames(path, start, end, frames)
    except SampleError:
        raise
    except Exception as err:  # FFmpeg reports broken files through several exception types
        raise SampleError("failed_to_decode", f"{type(err).__name__}: {err}") from err
    sample = {"__key__": key, "txt": row.caption}
    for i, image in enumerate(images):
        sample[f"f{i:03d}.jpg"] = encode_frame(image, short_side, quality)
    meta = {"key": key, "caption": row.caption, "source_path": row.path, "clip_start": start, "clip_end": end,
            "fps": fps, "original_width": size[0], "original_height": size[1], "frames": frames,
            "frame_times": times, **{k: v for k, v in row.extra.items() if k not in ("start", "end")}}
    sample["json"] = json.dumps(meta, ensure_ascii=False).encode("utf-8")
    return sample


def pack_videos(
    rows: list[Row], videos_dir: str, out_dir: str, *, frames: int = 16, short_side: int = 256, quality: int = 90,
    shard_size: int = 1000, workers: int | None = None, prefix: str = "",
) -> PackSummary:
    if frames < 1 or short_side < 8 or not 1 <= quality <= 100:
        raise ValueError(f"need frames >= 1, short_side >= 8, quality in 1..100; got {frames}, {short_side}, {quality}")
    packer = functools.partial(pack_clip, videos_dir=videos_dir, frames=frames, short_side=short_side, quality=quality)
    return write_shards(rows, out_dir, packer, shard_size=shard_size, workers=workers, prefix=prefix)
