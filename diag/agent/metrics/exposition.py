"""The Prometheus text format (0.0.4) of a registry, written lean.

prometheus-client's `generate_latest` validates and escapes every label name of every sample for
UTF-8 metric names; with ~600 series per node that was most of a scrape's time. Our names are
declared once and valid, so this writer only escapes label values and help text. Its output is
byte for byte what `generate_latest` writes for such names (tests compare the two).
"""

from __future__ import annotations

from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary"}


def _escape_value(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return v


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class TextWriter:
    """Keeps the label strings it formatted: the same series come back at every scrape."""

    MAX_CACHED = 20_000  # far above one node's series; a safety net, not a working limit

    def __init__(self) -> None:
        self._labels: dict[tuple[tuple[str, str], ...], str] = {}

    def _label_text(self, labels: dict[str, str]) -> str:
        key = tuple(labels.items())
        text = self._labels.get(key)
        if text is None:
            if len(self._labels) >= self.MAX_CACHED:
                self._labels.clear()
            text = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(key))
            self._labels[key] = text
        return text

    def render(self, registry: Collector) -> bytes:
        out: list[str] = []
        for fam in registry.collect():
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            out.append(f"# HELP {name} {_escape_help(fam.documentation)}\n")
            out.append(f"# TYPE {name} {_TYPES.get(fam.type, 'untyped')}\n")
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                value = floatToGoString(s.value)
                if s.labels:
                    out.append(f"{s.name}{{{self._label_text(s.labels)}}} {value}\n")
                else:
                    out.append(f"{s.name} {value}\n")
        return "".join(out).encode()


def render_text(registry: Collector) -> bytes:
    return TextWriter().render(registry)
