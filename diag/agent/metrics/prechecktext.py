"""Precheck results in the agent's scrape: the textfile `diag precheck --metrics-file` writes.

The precheck runs before training, often in another container, and ends; its families
(`diag_precheck_*`, declared in `diag.agent.precheck.promfile`) would vanish with it. The agent
re-exports the file as it is, parsed again only when it changes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from diag.agent.precheck.promfile import read_textfile
from diag.formats.untrusted import UntrustedInput

log = logging.getLogger(__name__)

PREFIX = "diag_precheck_"
DEFAULT_NAME = "precheck.prom"  # in the run directory, shared by the trainer and the agent


class PrecheckFileCollector(Collector):
    def __init__(self, path: Path) -> None:
        self.path = path
        self._key: tuple[int, int] | None = None
        self._families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        try:
            st = self.path.stat()
        except OSError:
            return  # no precheck ran (yet): the families are absent
        key = (st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._key = key
            self._families = self._parse()
        yield from self._families

    def _parse(self) -> list[Metric]:
        try:
            return read_textfile(self.path)
        except UntrustedInput as e:
            log.warning("ignoring the precheck metrics: %s", e)
            return []
