import json
import math
from dataclasses import replace

import numpy as np
import pytest

from src.config import SpikesConfig as SpikeConfig
from src.trainer.spikes import SpikeDetector
from tests.conftest import compose_config

N_STEPS = 3000
SPIKE = 1.0  # ~30 running std above the mean: unmistakable


def clean_series(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A decaying loss with bounded noise, and a quiet RMS series.

    Uniform noise in [-a, a] has std a/sqrt(3), so no clean loss can sit 3.2 std above the mean of its
    window: a false positive on this series is a bug, not bad luck.
    """
    rng = np.random.default_rng(seed)
    steps = np.arange(N_STEPS)
    loss = 2.0 + 3.0 * np.exp(-steps / 800) + rng.uniform(-0.02, 0.02, N_STEPS)
    rms = rng.uniform(0.3, 1.5, N_STEPS)
    return loss, rms


def run(detector: SpikeDetector, loss, rms, steps=None, largest=None) -> list[dict]:
    steps = range(len(loss)) if steps is None else steps
    events = []
    for step in steps:
        events += detector.update(int(step), float(loss[step]), float(rms[step]),
                                  None if largest is None else largest[step])
    return events


# Loss spikes: step -> (preceded, rms_spike_step, lag)
LOSS_SPIKES = {
    1200: (True, 1195, 5),
    1500: (False, None, None),
    1800: (False, None, None),  # continues at 1801, 1802, 1807: one event
    1817: (False, None, None),  # exactly merge_within after 1807: a new event
    2100: (False, None, None),  # RMS spike 9 steps before: outside 1..8
    2300: (False, None, None),  # RMS spike at the same step: lag 0 does not count
    2400: (True, 2392, 8),
    2500: (True, 2499, 1),
    2612: (False, None, None),  # RMS event began at 2600 (lasted to 2604): 12 steps before
}
LOSS_SPIKE_CONTINUATIONS = [1801, 1802, 1807]
RMS_SPIKES = [1195, 2091, 2300, 2392, 2499, 2600, 2700, 2800]
RMS_SPIKE_CONTINUATIONS = [2601, 2602, 2604]


def spiky_series() -> tuple[np.ndarray, np.ndarray]:
    loss, rms = clean_series()
    for step in [*LOSS_SPIKES, *LOSS_SPIKE_CONTINUATIONS]:
        loss[step] += SPIKE
    for step in [*RMS_SPIKES, *RMS_SPIKE_CONTINUATIONS]:
        rms[step] = 4.0
    rms[2800] = 2.3  # the threshold itself is a spike (RMS_t >= 2.3)
    rms[2850] = 2.29
    # Spikes inside the ignore window must not be reported.
    loss[500] += SPIKE
    loss[600] = math.nan
    rms[500] = 10.0
    return loss, rms


def cfg(**overrides) -> SpikeConfig:
    return replace(compose_config([]).spikes, **overrides)


def test_no_false_positives_on_clean_series():
    loss, rms = clean_series()
    detector = SpikeDetector(cfg())
    assert run(detector, loss, rms) == []
    assert detector.counts() == {"loss_spikes": 0, "rms_spikes": 0, "loss_spikes_preceded": 0}


def test_injected_spikes_found_merged_and_attributed():
    loss, rms = spiky_series()
    detector = SpikeDetector(cfg())
    events = run(detector, loss, rms)

    loss_events = [e for e in events if e["type"] == "loss"]
    rms_events = [e for e in events if e["type"] == "rms"]
    assert [e["step"] for e in loss_events] == list(LOSS_SPIKES)
    assert [e["step"] for e in rms_events] == RMS_SPIKES
    for event in loss_events:
        preceded, rms_step, lag = LOSS_SPIKES[event["step"]]
        assert event["preceded_by_rms_spike"] is preceded, event
        assert event["rms_spike_step"] == rms_step, event
        assert event["lag"] == lag, event
        assert event["loss"] == pytest.approx(loss[event["step"]])
        assert event["nonfinite"] is False
        assert event["largest_rms"] is None  # no step named its largest update
    assert rms_events[RMS_SPIKES.index(2800)]["rms"] == 2.3
    assert detector.counts() == {"loss_spikes": 9, "rms_spikes": 8, "loss_spikes_preceded": 3}
    for event in events:
        json.dumps(event, allow_nan=False)


def test_running_stats_cover_the_window_before_the_spike():
    loss, rms = spiky_series()
    detector = SpikeDetector(cfg())
    first = next(e for e in run(detector, loss, rms) if e["type"] == "loss")
    before = loss[first["step"] - 100 : first["step"]]
    assert first["mean"] == pytest.approx(before.mean(), rel=1e-12)
    assert first["std"] == pytest.approx(before.std(), rel=1e-12)


def test_ignore_window_still_fills_statistics():
    loss, rms = clean_series()
    loss[1000] += SPIKE
    rms[999] = 5.0  # last ignored step: not an RMS event, so it cannot be attributed either
    events = run(SpikeDetector(cfg()), loss, rms)
    assert [(e["type"], e["step"], e["preceded_by_rms_spike"]) for e in events] == [("loss", 1000, False)]


def test_nothing_detected_before_window_is_full():
    loss, rms = clean_series()
    loss[50] += SPIKE
    events = run(SpikeDetector(cfg(ignore_first=0)), loss, rms)
    assert [e["step"] for e in events if e["type"] == "loss"] == []


def test_spike_losses_do_not_mask_a_following_spike():
    loss, rms = clean_series()
    loss[1200] += 5.0
    loss[1215] += 0.5  # would be hidden if the first spike had inflated the running std
    events = run(SpikeDetector(cfg()), loss, rms)
    assert [e["step"] for e in events] == [1200, 1215]


def test_nan_loss_is_a_spike_and_does_not_poison_statistics():
    loss, rms = clean_series()
    loss[1300] = math.nan
    loss[1301] = math.inf
    loss[1400] += SPIKE
    detector = SpikeDetector(cfg())
    events = run(detector, loss, rms)
    assert [e["step"] for e in events] == [1300, 1400]
    assert events[0]["nonfinite"] is True and events[0]["loss"] is None
    assert events[1]["nonfinite"] is False
    assert math.isfinite(events[1]["mean"]) and math.isfinite(events[1]["std"])
    assert all(math.isfinite(x) for x in detector.state_dict()["losses"])
    json.dumps(events, allow_nan=False)


def test_nonfinite_rms_is_ignored_and_missing_rms_allowed():
    loss, rms = clean_series()
    rms[1300] = math.nan
    rms[1400] = math.inf
    detector = SpikeDetector(cfg())
    assert run(detector, loss, rms) == []
    assert detector.update(N_STEPS, 1.0, None) == []


def test_step_gaps_merge_by_step_distance():
    loss, rms = clean_series()
    for step in (1200, 1209, 1230):
        loss[step] += SPIKE
    events = run(SpikeDetector(cfg()), loss, rms, steps=range(0, N_STEPS, 3))
    assert [e["step"] for e in events] == [1200, 1230]


def test_config_values_are_honoured():
    loss, rms = spiky_series()
    custom = cfg(rms_threshold=5.0, merge_within=20, attribution_min=0, attribution_max=9, ignore_first=1250)
    events = run(SpikeDetector(custom), loss, rms)
    assert [e["step"] for e in events if e["type"] == "rms"] == []  # all injected RMS values are < 5
    # 1200 is ignored, 1817 merges into 1800 (10 < 20 steps after 1807).
    assert [e["step"] for e in events if e["type"] == "loss"] == [1500, 1800, 2100, 2300, 2400, 2500, 2612]

    events = run(SpikeDetector(cfg(attribution_min=0, attribution_max=9)), loss, rms)
    lags = {e["step"]: e["lag"] for e in events if e["type"] == "loss"}
    assert lags == {1200: 5, 2100: 9, 2300: 0, 2400: 8, 2500: 1} | dict.fromkeys([1500, 1800, 1817, 2612])


def test_closest_rms_event_wins_attribution():
    loss, rms = clean_series()
    loss[1200] += SPIKE
    rms[1193] = rms[1197] = 4.0  # two RMS events once merge_within is short enough
    events = run(SpikeDetector(cfg(merge_within=3)), loss, rms)
    assert [(e["type"], e["step"]) for e in events] == [("rms", 1193), ("rms", 1197), ("loss", 1200)]
    assert (events[2]["rms_spike_step"], events[2]["lag"]) == (1197, 3)


def test_loss_events_name_the_largest_update_rms_in_the_attribution_window():
    """The largest update over all tensors 1-8 steps before a loss spike, whichever tensor: the 1500 spike has no
    patch-embedding RMS spike before it, and the tensor whose update outran its second moment is named."""
    loss, rms = spiky_series()
    largest = [(1.0, "quiet") for _ in range(N_STEPS)]
    largest[1497] = (6.0, "visual.transformer.resblocks.3.mlp.c_fc.weight")
    largest[1491] = (9.0, "nine steps before: outside 1-8")
    largest[1500] = (12.0, "the spike's own step: lag 0 does not count")
    largest[1495] = (math.nan, "non-finite: ignored")
    events = run(SpikeDetector(cfg()), loss, rms, largest=largest)
    by_step = {e["step"]: e for e in events if e["type"] == "loss"}
    assert by_step[1500]["largest_rms"] == {"step": 1497, "rms": 6.0,
                                            "tensor": "visual.transformer.resblocks.3.mlp.c_fc.weight"}
    assert by_step[1500]["preceded_by_rms_spike"] is False
    # Ties go to the earliest step of the window.
    assert by_step[1200]["largest_rms"] == {"step": 1192, "rms": 1.0, "tensor": "quiet"}
    for event in events:
        json.dumps(event, allow_nan=False)


def test_a_state_without_largest_updates_still_loads():
    """Checkpoints written before loss events named the largest update."""
    loss, rms = spiky_series()
    reference = SpikeDetector(cfg())
    run(reference, loss, rms, steps=range(1400))
    state = reference.state_dict()
    del state["largest_rms"]
    resumed = SpikeDetector(cfg())
    resumed.load_state_dict(state)
    assert run(resumed, loss, rms, steps=range(1400, N_STEPS)) == run(reference, loss, rms,
                                                                       steps=range(1400, N_STEPS))


@pytest.mark.parametrize("split", [1197, 1801, 1810, 2395, 2601])
def test_state_dict_round_trip_gives_identical_future_events(split):
    loss, rms = spiky_series()
    largest = [(float(r) * 2, f"tensor{step % 7}") for step, r in enumerate(rms)]
    reference = SpikeDetector(cfg())
    run(reference, loss, rms, steps=range(split), largest=largest)
    state = json.loads(json.dumps(reference.state_dict()))  # must survive plain serialisation

    resumed = SpikeDetector(cfg())
    resumed.load_state_dict(state)
    rest = range(split, N_STEPS)
    assert run(resumed, loss, rms, steps=rest, largest=largest) == run(reference, loss, rms, steps=rest,
                                                                       largest=largest)
    assert resumed.counts() == reference.counts()
    assert resumed.state_dict() == reference.state_dict()


def test_window_must_allow_a_standard_deviation():
    with pytest.raises(ValueError, match="window"):
        SpikeDetector(cfg(window=1))
