"""Suite-wide setup."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fasttier
import pytest

TMPDIR = "TMPDIR"
STATE_DIR = "DIAG_STATE_DIR"  # the agents' own directory (their locks, replica stores)
DLROVER_EVENTS = "DLROVER_EVENT_FILE_DIR"  # DLRover's training events, /tmp/dlrover by default


@pytest.fixture(scope="session", autouse=True)
def _private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every process the tests start writes its temp files under pytest's own temp directory
    (torchrun, for one, makes a `torchelastic_*` directory per run and never removes it), so
    they go away with pytest's old runs instead of piling up in /tmp. DLRover's training events
    (`events_sys_<rank>_<pid>.log`) go to /tmp/dlrover whatever TMPDIR says: its own variable
    sends them there too."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    saved = {k: os.environ.get(k) for k in (TMPDIR, DLROVER_EVENTS, STATE_DIR)}
    old_default = tempfile.tempdir
    os.environ[TMPDIR] = str(tmp)
    os.environ[DLROVER_EVENTS] = str(tmp / "dlrover-events")
    # Not /run/diag-agent: the agents the tests start leave their locks with pytest's files.
    state = tmp_path_factory.mktemp("agent-state")
    state.chmod(0o700)
    os.environ[STATE_DIR] = str(state)
    tempfile.tempdir = str(tmp)
    try:
        yield
    finally:
        tempfile.tempdir = old_default
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Seconds each test of 1 s or more took in a parallel run of the suite. The order of the tests
# depends on it, and the fast tier; a test missing from it counts as 20 s if marked slow, else 0.
DURATIONS = Path(__file__).with_name("durations.json")
FAST_SECONDS = 2.0
NOT_FAST = ("slow", "long", "netns", "k8s", "gpu")
_FAST = pytest.StashKey[bool]()  # whether the test is of the fast tier


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Armed before any fixture, a module's shared job included (see tests/support/fasttier.py)."""
    if item.stash.get(_FAST, False):
        fasttier.install()
        fasttier.arm(item.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test of the fast tier that started a job fails, in every run."""
    if item.stash.get(_FAST, False):
        caught = fasttier.disarm()
        if caught:
            pytest.fail(fasttier.advice(item.nodeid, caught), pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first: handed out one at a time to parallel workers (scripts/test.sh),
    the suite then ends with short tests filling the gaps, not one worker running a long test
    alone at the end. The tests of a module that sets up something once for the module (a real
    Prometheus, a DeepSpeed job, a rendered site) go to one worker, which sets it up once."""
    try:
        seconds = json.loads(DURATIONS.read_text())
        if not isinstance(seconds, dict) or not all(
            isinstance(v, int | float) for v in seconds.values()
        ):
            raise ValueError("expected an object of test ids to seconds")
    except (OSError, ValueError) as e:
        # The order of the run and the fast tier depend on it: no silent guess.
        raise pytest.UsageError(
            f"{DURATIONS}: {e}; restore it from git (git checkout -- tests/durations.json)"
        ) from e

    def expected(item: pytest.Item) -> float:
        default = 20.0 if item.get_closest_marker("slow") is not None else 0.0
        return float(seconds.get(item.nodeid, default))

    for item in items:
        item.stash[_FAST] = expected(item) < FAST_SECONDS and not any(
            item.get_closest_marker(m) for m in NOT_FAST
        )
        module = item.nodeid.split("::")[0]
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        shared = any(
            d.scope in ("module", "class", "package") and d.baseid.startswith(module)
            for fixturedefs in defs.values()
            for d in fixturedefs
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(module))
    items.sort(key=expected, reverse=True)
    if config.getoption("--fast"):
        keep = [item for item in items if item.stash[_FAST]]
        kept = {id(item) for item in keep}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the long tier: soaks and the full repetitions of statistical tests",
    )
    parser.addoption(
        "--fast",
        action="store_true",
        help="only the fast tier: no slow, netns, k8s or gpu test, none that took 2 s or more "
        "(tests/durations.json)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--long"):
        # Deselected, not skipped: the default tier's report lists only what it runs.
        markexpr = config.option.markexpr
        config.option.markexpr = f"({markexpr}) and not long" if markexpr else "not long"


@pytest.fixture(scope="session")
def long_tier(pytestconfig: pytest.Config) -> bool:
    """Whether this run is the long tier (`--long`): statistical tests repeat more."""
    return bool(pytestconfig.getoption("--long"))
