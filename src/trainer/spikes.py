"""Online loss-spike and RMS-spike detection.

Implements the spike heuristics of Wortsman et al. 2023, "Stable and low-precision training for
large-scale vision-language models" (arXiv 2304.13013), appendix: an RMS spike is a patch-embedding
RMS_t >= 2.3; a loss spike is a loss more than 3.2 running standard deviations above the running
mean; the first 1000 iterations are ignored; events less than 10 iterations apart are merged; each
loss spike is then checked for an RMS spike 1-8 iterations earlier (28 of 30 in the paper).

Choices the paper leaves open:

- The running mean/std cover the last ``window`` finite losses *before* the current step, and
  losses flagged as spikes never enter the window, so a spike cannot raise the threshold for a
  second spike right after it. The flip side: a lasting jump in the loss level keeps being flagged
  and, because of merging, stays one open event.
- Loss detection starts only once the window is full, so the statistics are never computed from a
  handful of samples.
- A non-finite loss never enters the window and counts as a loss spike (reported with
  ``"loss": None, "nonfinite": True`` so events stay valid JSON).
- A non-finite RMS is ignored: it means the gradient itself overflowed (an fp16 skip, which the
  loss scaler reports), not that Adam's second moment under-estimates g^2.
- An event is emitted at its first step; later spike steps within ``merge_within`` steps of the
  event's most recent spike step extend it silently, so a run of spiky steps is one event.
- Attribution uses RMS events' first steps; with several candidates the closest one wins.
- Each loss event also names the tensor with the largest update RMS over the attribution window
  (``largest_rms``), whichever tensor it is: a spike the patch embedding did not lead still shows
  which update outran its second moment.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from src.config import SpikesConfig


class SpikeDetector:
    """Feed one (step, loss, patch-embedding RMS) triple per logged step, with the step's largest update RMS
    over all tensors and that tensor's name where known; get back new events."""

    def __init__(self, config: SpikesConfig) -> None:
        self.config = config
        if self.config.window < 2:
            raise ValueError(f"window must be >= 2 to have a standard deviation, got {self.config.window}")
        self._losses: deque[float] = deque(maxlen=self.config.window)
        self._last_loss_spike: int | None = None
        self._last_rms_spike: int | None = None
        self._rms_event_starts: list[int] = []
        self._largest_rms: list[tuple[int, float, str]] = []  # (step, RMS, tensor) within the attribution window
        self._counts = {"loss_spikes": 0, "rms_spikes": 0, "loss_spikes_preceded": 0}

    def update(self, step: int, loss: float, patch_embed_rms: float | None,
               largest_rms: tuple[float, str] | None = None) -> list[dict[str, Any]]:
        """Consume one step (steps must increase, gaps allowed); return the events that start here.
        `largest_rms`: the step's largest update RMS over all tensors and that tensor's name."""
        cfg = self.config
        detect = step >= cfg.ignore_first
        events: list[dict[str, Any]] = []
        if largest_rms is not None and math.isfinite(largest_rms[0]):
            self._largest_rms.append((step, float(largest_rms[0]), largest_rms[1]))
        self._largest_rms = [e for e in self._largest_rms if step - e[0] <= cfg.attribution_max]

        # RMS first so that, with attribution_min = 0, a same-step RMS spike can be attributed.
        if detect and patch_embed_rms is not None and math.isfinite(patch_embed_rms):
            if patch_embed_rms >= cfg.rms_threshold:
                if not self._extends(self._last_rms_spike, step):
                    self._rms_event_starts.append(step)
                    self._counts["rms_spikes"] += 1
                    events.append({"type": "rms", "step": step, "rms": float(patch_embed_rms)})
                self._last_rms_spike = step
        # Only starts that can still be attributed to a future loss spike are worth keeping.
        self._rms_event_starts = [s for s in self._rms_event_starts if step - s <= cfg.attribution_max]

        finite = math.isfinite(loss)
        mean, std = self._stats()
        is_spike = detect and (
            not finite or (mean is not None and std is not None and loss > mean + cfg.loss_std_factor * std)
        )

        if finite and not is_spike:
            self._losses.append(float(loss))
        if not is_spike:
            return events

        extends = self._extends(self._last_loss_spike, step)
        self._last_loss_spike = step
        if extends:
            return events
        lags = (step - s for s in self._rms_event_starts)
        lag = min((x for x in lags if cfg.attribution_min <= x <= cfg.attribution_max), default=None)
        window = [e for e in self._largest_rms if cfg.attribution_min <= step - e[0]]
        largest = max(window, key=lambda e: e[1], default=None)
        self._counts["loss_spikes"] += 1
        self._counts["loss_spikes_preceded"] += int(lag is not None)
        events.append(
            {
                "type": "loss",
                "step": step,
                "loss": float(loss) if finite else None,
                "nonfinite": not finite,
                "mean": mean,
                "std": std,
                "preceded_by_rms_spike": lag is not None,
                "rms_spike_step": None if lag is None else step - lag,
                "lag": lag,
                "largest_rms": None if largest is None else {"step": largest[0], "rms": largest[1],
                                                             "tensor": largest[2]},
            }
        )
        return events

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self._losses),
            "last_loss_spike": self._last_loss_spike,
            "last_rms_spike": self._last_rms_spike,
            "rms_event_starts": list(self._rms_event_starts),
            "largest_rms": [list(e) for e in self._largest_rms],
            "counts": dict(self._counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._losses = deque(state["losses"], maxlen=self.config.window)
        self._last_loss_spike = state["last_loss_spike"]
        self._last_rms_spike = state["last_rms_spike"]
        self._rms_event_starts = list(state["rms_event_starts"])
        # Checkpoints written before loss events named the largest update have none to restore.
        self._largest_rms = [(int(s), float(r), str(t)) for s, r, t in state.get("largest_rms", [])]
        self._counts = dict(state["counts"])

    def _extends(self, last_spike: int | None, step: int) -> bool:
        return last_spike is not None and step - last_spike < self.config.merge_within

    def _stats(self) -> tuple[float | None, float | None]:
        if len(self._losses) < self.config.window:
            return None, None
        mean = math.fsum(self._losses) / len(self._losses)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in self._losses) / len(self._losses))
        return mean, std
