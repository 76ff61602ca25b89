"""The journal's names of a re-formed world's groups (diag.formats.worlds): written by the
trainer, read by the agent's rules, so a name that is not ours reads as the first world."""

from __future__ import annotations

import pytest

from diag.formats.worlds import group_in_world, world_of


@pytest.mark.parametrize("name", ["0", "1", "default_pg", "a@b", ""])
@pytest.mark.parametrize("generation", [0, 1, 7, 123456])
def test_a_group_name_round_trips_its_world(name: str, generation: int) -> None:
    assert world_of(group_in_world(name, generation)) == generation
    assert group_in_world(name, 0) == name  # the first world keeps torch's names


@pytest.mark.parametrize("odd", ["0@", "@", "0@-1", "0@1x", "0@ 2", "0@" + "9" * 40, "0@٣"])
def test_a_name_not_of_a_re_formed_world_reads_as_the_first(odd: str) -> None:
    assert world_of(odd) == 0
