"""The server's tau policy on synthetic load traces: bounds, direction, hysteresis, smoothing, recovery."""

import math

import pytest

from mars.serving.policy import AdaptiveSettings, AdaptiveThreshold, FixedThreshold, LoadSample, build_policy


def run_trace(policy, trace, dt=0.1, **sample_kw):
    """Feed (waiting, running) pairs every ``dt`` seconds; the tau after each update."""
    out = []
    for i, (waiting, running) in enumerate(trace):
        out.append(policy.update(LoadSample(i * dt, waiting=waiting, running=running, **sample_kw)))
    return out


def direction_changes(values, eps=1e-9):
    signs = [math.copysign(1, b - a) for a, b in zip(values, values[1:]) if abs(b - a) > eps]
    return sum(1 for a, b in zip(signs, signs[1:]) if a != b)


def adaptive(**kw):
    base = dict(signal="queue", target_queue=8, high=1.0, low=0.5, relax_rate=0.5, recover_rate=0.25, smoothing_s=1.0)
    base.update(kw)
    return AdaptiveThreshold(0.6, 1.0, AdaptiveSettings(**base))


def test_fixed_policy_serves_its_tau_and_clamps_requests_to_the_bounds():
    p = FixedThreshold(0.9, 0.7, 1.0)
    assert run_trace(p, [(50, 8)] * 20) == [0.9] * 20
    assert p.for_request(None) == 0.9
    assert p.for_request(0.8) == 0.8
    assert p.for_request(0.2) == 0.7 and p.for_request(1.0) == 1.0
    assert p.for_request(None, verify=True) == 1.0  # verification without a threshold: lossless, at the reference
    assert p.for_request(0.8, verify=True) == 0.8 and p.for_request(0.2, verify=True) == 0.7  # its own, bounded


def test_rising_load_lowers_tau_to_the_lower_bound_and_falling_load_raises_it_back():
    p = adaptive()
    idle, busy = [(0, 2)] * 30, [(24, 8)] * 80
    taus = run_trace(p, idle + busy + idle * 5)
    assert taus[29] == 1.0  # light load: strict end
    during = taus[30:110]
    assert all(b <= a + 1e-12 for a, b in zip(during, during[1:]))  # only goes down while overloaded
    assert during[-1] == pytest.approx(0.6)  # reaches the relaxed bound
    after = taus[110:]
    assert all(b >= a - 1e-12 for a, b in zip(after, after[1:]))  # only goes up once the load fell
    assert after[-1] == pytest.approx(1.0)
    assert all(0.6 - 1e-12 <= t <= 1.0 + 1e-12 for t in taus)


def test_recovery_is_slower_than_relaxation_as_configured():
    p = adaptive(relax_rate=1.0, recover_rate=0.1, smoothing_s=0.0)
    down = run_trace(p, [(30, 8)] * 11, dt=0.1)  # 1 s overloaded: the whole span
    assert down[-1] == pytest.approx(0.6)
    p2_start = 1.1
    ups = [p.update(LoadSample(p2_start + i * 0.1, 0, 1)) for i in range(10)]  # 1 s underloaded: a tenth
    assert ups[-1] == pytest.approx(0.6 + 0.1 * 0.4, abs=1e-6)


def test_load_inside_the_band_holds_tau_steady():
    p = adaptive(smoothing_s=0.0)
    run_trace(p, [(30, 8)] * 5)  # relax a little first
    held = p.threshold
    # 6..7 requests in the system with target 8: ratio 0.75..0.875, inside (low, high)
    taus = run_trace(p, [(0, 6), (0, 7)] * 50)
    assert taus == [held] * 100 or all(t == pytest.approx(held) for t in taus)
    assert held < 1.0


def test_noisy_load_around_the_target_does_not_make_tau_flap():
    # a load that alternates between just above and just below the target every update
    trace = [(1, 8), (0, 7)] * 200  # ratios 1.125 and 0.875
    smooth = adaptive(smoothing_s=2.0)
    taus = run_trace(smooth, trace)
    assert direction_changes(taus) == 0  # the band and the average absorb it
    # without hysteresis (low == high) and without smoothing it would flap at every update
    raw = AdaptiveThreshold(
        0.6,
        1.0,
        AdaptiveSettings(target_queue=8, high=1.0, low=0.999, relax_rate=0.5, recover_rate=0.5, smoothing_s=0.0),
    )
    run_trace(raw, [(30, 8)] * 5)
    assert direction_changes(run_trace(raw, trace)) > 100


def test_a_short_spike_is_damped_by_the_average():
    p = adaptive(smoothing_s=2.0)
    trace = [(0, 4)] * 20 + [(40, 8)] * 2 + [(0, 4)] * 20  # 0.2 s at 6x the target
    taus = run_trace(p, trace)
    assert min(taus) > 0.97  # barely moves
    sustained = adaptive(smoothing_s=2.0)
    assert min(run_trace(sustained, [(0, 4)] * 20 + [(40, 8)] * 40)) < 0.8


def test_update_frequency_does_not_change_the_trajectory_much():
    coarse, fine = adaptive(), adaptive()
    load = lambda t: (24, 8) if t < 2.0 else (0, 1)  # noqa: E731
    for i in range(41):
        coarse.update(LoadSample(i * 0.1, *load(i * 0.1)))
    for i in range(401):
        fine.update(LoadSample(i * 0.01, *load(i * 0.01)))
    assert coarse.threshold == pytest.approx(fine.threshold, abs=0.03)


def test_latency_signal_relaxes_on_slow_requests_and_recovers_when_idle():
    p = AdaptiveThreshold(
        0.7,
        1.0,
        AdaptiveSettings(signal="latency", target_latency_s=4.0, relax_rate=1.0, recover_rate=1.0, smoothing_s=0.0),
    )
    for i in range(10):
        p.update(LoadSample(i * 0.1, waiting=2, running=4, recent_latency_s=9.0, oldest_age_s=3.0))
    assert p.threshold < 1.0
    low = p.threshold
    # an old request still in the system counts even before any request finished
    q = AdaptiveThreshold(
        0.7, 1.0, AdaptiveSettings(signal="latency", target_latency_s=4.0, relax_rate=1.0, smoothing_s=0.0)
    )
    for i in range(5):
        q.update(LoadSample(i * 0.1, waiting=1, running=1, recent_latency_s=None, oldest_age_s=12.0))
    assert q.threshold < 1.0
    # the system empties: the stale latency average does not hold tau down
    for i in range(10, 40):
        p.update(LoadSample(i * 0.1, waiting=0, running=0, recent_latency_s=9.0, oldest_age_s=None))
    assert p.threshold > low and p.threshold == pytest.approx(1.0)


def test_entropy_metric_relaxes_upwards():
    p = AdaptiveThreshold(0.0, 1.5, AdaptiveSettings(relax_rate=1.0, smoothing_s=0.0), metric="entropy")
    assert p.threshold == 0.0 and p.is_exact(p.threshold)
    run_trace(p, [(40, 8)] * 20)
    assert p.threshold == pytest.approx(1.5)
    assert p.for_request(None, verify=True) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="fixed", threshold=0.4, tau_min=0.5, tau_max=1.0), "outside"),
        (dict(name="fixed", threshold=0.9, tau_min=0.95, tau_max=0.9), "above tau_max"),
        (dict(name="fixed", threshold=0.9, tau_min=0.0, tau_max=1.0), "invalid"),
        (
            dict(name="adaptive", threshold=1.0, tau_min=0.5, tau_max=1.0, adaptive={"targte_queue": 3}),
            "unknown adaptive",
        ),
        (dict(name="adaptive", threshold=1.0, tau_min=0.5, tau_max=1.0, adaptive={"low": 2.0}), "adaptive.low"),
        (
            dict(name="adaptive", threshold=1.0, tau_min=0.5, tau_max=1.0, adaptive={"signal": "vibes"}),
            "adaptive.signal",
        ),
        (dict(name="sometimes", threshold=1.0, tau_min=0.5, tau_max=1.0), "tau_policy"),
    ],
)
def test_bad_policy_settings_are_refused(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        build_policy(name, **kwargs)
