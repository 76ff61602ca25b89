"""Short fuzz runs of every parser of outside data (the long ones: bench/fuzz.py).

Each target's seeds must parse, and every mutation hypothesis draws must be accepted or refused
with the target's own error, in bounded time.
"""

from __future__ import annotations

import pytest
from fuzzkit import FuzzTarget, all_targets, check_one, mutate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SHORT_RUN = 150  # inputs per parser: seconds in all, the bench runs 100,000+


@pytest.mark.parametrize("target", all_targets(), ids=lambda t: t.name)
def test_parser_refuses_bad_input_cleanly(target: FuzzTarget, tmp_path) -> None:
    seeds = target.seeds(tmp_path)
    assert seeds, f"{target.name}: no seed inputs"
    for data in seeds:
        outcome, _, detail = check_one(target, data, tmp_path)
        assert outcome == "accepted", f"{target.name}: a valid seed was {outcome}: {detail}"

    @settings(
        max_examples=SHORT_RUN,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.randoms(use_true_random=False))
    def one(rng) -> None:
        data = mutate(rng, seeds, target.json)
        outcome, _, detail = check_one(target, data, tmp_path)
        assert outcome in ("accepted", "refused"), (
            f"{target.name}: {outcome} on input {data[:300]!r}\n{detail}"
        )

    one()
