"""The proofs of the replica token (agent.replica.auth) and the server's bounds on connections
(agent.replica.admission): pure, with plain bytes and plain numbers for time."""

from __future__ import annotations

import pytest

from diag.agent.replica.admission import Limits, Pending, next_deadline, refusal, to_drop
from diag.agent.replica.auth import Context, Role, proof, proves, token_problem

TOKEN = b"a-job-token-of-32-characters-ok!"
CTX = Context("train", "node-a", "node-b", "pull")
CN, HN = b"\x01" * 32, b"\x02" * 32


def test_a_proof_verifies_for_its_own_connection_only():
    mine = proof(TOKEN, Role.CLIENT, CTX, CN, HN)
    assert len(mine) == 32 and TOKEN not in mine
    assert proves(TOKEN, Role.CLIENT, CTX, CN, HN, mine)


@pytest.mark.parametrize(
    ("what", "token", "role", "ctx", "cn", "hn"),
    [
        ("another token", b"another-token-of-32-characters!!", Role.CLIENT, CTX, CN, HN),
        ("reflected to the other role", TOKEN, Role.HOLDER, CTX, CN, HN),
        ("another job", TOKEN, Role.CLIENT, Context("other", "node-a", "node-b", "pull"), CN, HN),
        ("another client", TOKEN, Role.CLIENT, Context("train", "node-c", "node-b", "pull"), CN, HN),
        ("another holder", TOKEN, Role.CLIENT, Context("train", "node-a", "node-c", "pull"), CN, HN),
        ("another operation", TOKEN, Role.CLIENT, Context("train", "node-a", "node-b", "push"), CN,
         HN),
        ("another client nonce", TOKEN, Role.CLIENT, CTX, b"\x03" * 32, HN),
        ("another holder nonce", TOKEN, Role.CLIENT, CTX, CN, b"\x03" * 32),
        # the fields are length-prefixed: moving a character from one to the next changes it
        ("shifted fields", TOKEN, Role.CLIENT, Context("train", "node-an", "ode-b", "pull"), CN,
         HN),
    ],
)  # fmt: skip
def test_a_proof_is_worth_nothing_elsewhere(what, token, role, ctx, cn, hn):
    mine = proof(TOKEN, Role.CLIENT, CTX, CN, HN)
    assert not proves(token, role, ctx, cn, hn, mine), what


@pytest.mark.parametrize(
    ("token", "problem"),
    [("", "is not set"), ("short", "fewer than 16"), ("x" * 15, "fewer than 16"),
     ("x" * 15 + "\x1b", "control characters"), ("x" * 16, None)],
)  # fmt: skip
def test_token_problems(token, problem):
    got = token_problem(token)
    assert (got is None) if problem is None else (problem in (got or ""))


LIMITS = Limits(auth_deadline=10.0, max_pending=2, max_per_peer=2, max_authenticated=3)


@pytest.mark.parametrize(
    ("pending", "now", "dropped"),
    [
        ([], 0.0, []),
        ([Pending(1, 0.0), Pending(2, 1.0)], 5.0, []),
        ([Pending(1, 0.0), Pending(2, 1.0)], 10.0, [1]),  # the first's deadline
        ([Pending(1, 0.0), Pending(2, 1.0), Pending(3, 2.0)], 5.0, [1]),  # the oldest makes room
        ([Pending(3, 2.0), Pending(1, 0.0), Pending(2, 1.0), Pending(4, 3.0)], 5.0, [1, 2]),
        ([Pending(1, 0.0), Pending(2, 1.0), Pending(3, 2.0)], 11.5, [1, 2]),  # both late
    ],
)
def test_who_is_dropped(pending, now, dropped):
    assert to_drop(pending, now, LIMITS) == dropped


def test_the_next_deadline_is_the_oldest_connections():
    assert next_deadline([], LIMITS) is None
    assert next_deadline([Pending(2, 4.0), Pending(1, 3.0)], LIMITS) == 13.0


@pytest.mark.parametrize(
    ("peer", "served", "why"),
    [
        ("a", {}, None),
        ("a", {"a": 1}, None),
        ("a", {"a": 2}, "node a has 2 connections"),
        ("b", {"a": 2, "c": 1}, "3 connections are served"),
        ("b", {"a": 1, "c": 1}, None),
    ],
)
def test_who_is_served(peer, served, why):
    got = refusal(peer, served, LIMITS)
    assert (got is None) if why is None else (why in (got or ""))


def test_limits_out_of_range_are_refused():
    for bad in ({"auth_deadline": 0}, {"max_pending": 0}, {"max_per_peer": 65}):
        with pytest.raises(ValueError, match="out of range"):
            Limits(**bad)
