"""The push rate cap (--replica-max-rate): a token bucket, checked on a simulated clock and on a
real push between two replica servers."""

from __future__ import annotations

import time

import pytest
from replica_helpers import OWNERS, fill

from diag.agent.replica.pace import Pace, pace_for
from diag.agent.replica.source import local_replica
from diag.agent.replica.transport import push
from diag.agent.replica.wire import CHUNK


def test_a_burst_leaves_at_once_then_the_debt_is_paid_by_waiting():
    pace = Pace(rate=100.0, burst=50.0)
    assert pace.take(50, now=0.0) == 0.0
    assert pace.take(30, now=0.0) == pytest.approx(0.3)  # 30 bytes owed at 100 B/s
    # waiting refills: 0.3 s later the debt is paid and nothing is left over
    assert pace.take(10, now=0.3) == pytest.approx(0.1)


def test_an_idle_bucket_holds_no_more_than_its_burst():
    pace = Pace(rate=100.0, burst=50.0)
    pace.take(50, now=0.0)
    assert pace.take(50, now=1000.0) == 0.0  # refilled, but to 50, not to 100,000
    assert pace.take(1, now=1000.0) == pytest.approx(0.01)


def test_what_leaves_never_outruns_the_rate_plus_one_burst():
    pace = Pace(rate=1000.0, burst=200.0)
    now, sent = 0.0, 0
    for size in [150, 300, 7, 1000, 64, 512, 3] * 20:
        now += pace.take(size, now)  # a sender that sleeps as told, then sends
        sent += size
        assert sent <= 200 + 1000 * now + 1e-6
    assert sent / now == pytest.approx(1000, rel=0.05)  # and keeps up with it


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-5, 1), (10, 0), (float("nan"), 1)])
def test_a_pace_needs_a_positive_rate_and_burst(rate, burst):
    with pytest.raises(ValueError, match="positive rate"):
        Pace(rate, burst)


def test_no_cap_no_pace_and_bursts_of_a_tenth_of_a_second():
    assert pace_for(0, CHUNK) is None
    assert pace_for(10 << 30, CHUNK).burst == pytest.approx((10 << 30) / 10)
    assert pace_for(1 << 20, CHUNK).burst == CHUNK  # never less than one chunk


def test_a_capped_push_takes_at_least_its_bytes_over_the_rate(tmp_path, ring2):
    a, store, _ = ring2
    run_dir = tmp_path / "a-run"
    run_dir.mkdir()
    fill(run_dir, tmp_path / "save", {0: [5], 1: [5]})
    local = local_replica(run_dir, "rj", "a", OWNERS)
    assert local is not None
    nbytes = local.manifest.nbytes
    rate = nbytes / 0.5  # half a second's worth, after a burst of one byte
    t0 = time.monotonic()
    assert push(a, "b", local, OWNERS, pace=Pace(rate, 1.0)).ok
    assert time.monotonic() - t0 >= (nbytes - 1) / rate
    held = store.held("a")
    assert held is not None and held.manifest.step == 5  # paced, and whole
