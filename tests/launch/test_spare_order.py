"""What a warm spare reads from its launcher (diag.launch.spare.Order) and what a replacement
reads from the job's store (diag.trainer.resilient.storekeys): malformed input is refused with
a clear error, never run."""

from __future__ import annotations

import json

import pytest

from diag.launch.spare import ORDER_MAX, BadOrder, Order
from diag.trainer.resilient import storekeys


def test_an_order_round_trips() -> None:
    order = Order({"RANK": "1", "DIAG_RESILIENT_JOIN": "1"}, ["/job/train.py", "--steps", "8"])
    assert Order.decode(order.encode()) == order


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "env is not a map"),
        (json.dumps({"env": {"A": 1}, "argv": ["x"]}).encode(), "env is not a map"),
        (json.dumps({"env": {"A=B": "1"}, "argv": ["x"]}).encode(), "env is not a map"),
        (json.dumps({"env": {"A": "a\0b"}, "argv": ["x"]}).encode(), "env is not a map"),
        (json.dumps({"env": {}, "argv": []}).encode(), "argv is not a non-empty list"),
        (json.dumps({"env": {}, "argv": "train.py"}).encode(), "argv is not a non-empty list"),
        (b"{" + b" " * ORDER_MAX + b"}", "bytes (at most"),
    ],
)
def test_a_malformed_order_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(BadOrder, match=why.replace("(", r"\(")):
        Order.decode(raw)


@pytest.mark.parametrize(
    ("raw", "got"),
    [
        (b"0 3", (0, 3)),
        (b"2 17", (2, 17)),
        (b"3", None),
        (b"1 2 3", None),
        (b"-1 2", None),
        (b"1 x", None),
        ("1 \u0663".encode(), None),  # a digit, but not an ASCII one
        (b"1 " + b"9" * 40, None),
    ],
)
def test_the_generation_being_formed_is_parsed_or_refused(
    raw: bytes, got: tuple[int, int] | None
) -> None:
    assert storekeys.parse_forming(raw) == got


@pytest.mark.parametrize(
    "raw", [b"", b"0", b"65536", b"-1", b"12x", b"\xff\xfe", b"1" * 40, b"\xd9\xa3"]
)
def test_a_workers_store_port_that_is_not_one_is_a_clear_error(raw: bytes) -> None:
    from diag.formats.exitcodes import UsageError
    from diag.launch.agent import port_of

    assert port_of(b"29511", "k") == 29511
    with pytest.raises(UsageError, match=r"not a port.*--rdzv-id"):
        port_of(raw, "diag/launch/store/0")
