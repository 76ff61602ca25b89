"""What `diag merge` computes from the gathered stacks of an incident, and each view's picture.

No I/O here: merge.py reads the files and writes the results; this takes the stacks collected by
gather.py and returns the merged trees of both views, the classes of ranks, the suspects and the
ranks that did not answer, then draws a view with the header that says all of it. Tests use it
on stacks built in memory to check the very pictures a merge of that many files would draw.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from diag.viewer import ranksets
from diag.viewer.absent import Absent, find_absent, stand_in_stacks
from diag.viewer.classes import Suspect, ViewClasses, equivalence_classes, suspects
from diag.viewer.flame import FlameHeader, FlameSettings, render_svg
from diag.viewer.gather import Gathered
from diag.viewer.summary import VIEW_TITLES
from diag.viewer.tree import NO_NATIVE, StackTree, View, merged_tree, only_marked

HIGHLIGHT_SUSPECTS = 8  # suspects whose frames are kept visible at any rank count


@dataclass(frozen=True)
class About:
    """What the header of a picture says about the incident."""

    incident_id: str
    kind: str = ""
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Analysis:
    """What the merge concluded: classes, suspects, absent ranks and nodes."""

    world: int
    dumped: int  # bitset: ranks with a dump file
    culprits: tuple[int, ...]
    trees: dict[View, StackTree]
    classes: dict[View, ViewClasses]
    suspects: tuple[Suspect, ...]  # best first
    absent: Absent

    @property
    def suspect_bits(self) -> int:
        return ranksets.bits_of(s.rank for s in self.suspects)

    @property
    def highlight(self) -> int:
        # Only the best few are widened to stay visible: dozens of widened frames would crowd
        # out the picture of everybody else; the rest stay red at their true (maybe merged)
        # width.
        return ranksets.bits_of(s.rank for s in self.suspects[:HIGHLIGHT_SUSPECTS])


def analyse(
    got: Gathered, world: int, culprits: Iterable[int] = (), local: int | None = None
) -> Analysis:
    """Trees, classes, suspects and silent ranks of the stacks in `got`, of a job of `world`
    ranks with `local` ranks per node (None: unknown)."""
    dumped = ranksets.bits_of(d.rank for d in got.dumps)
    culprits = tuple(c for c in culprits if 0 <= c < world)
    absent = find_absent(world, got.dumps, local, got.with_stacks)
    # the ranks without a file get stand-ins, so the pictures show them as a tower
    trees = {
        v: merged_tree([*got.collected[v], stand_in_stacks(absent, v)], v, world, dumped)
        for v in View
    }
    # A rank whose native stacks were not taken (the dump skipped them: memory, time) has no
    # evidence in that view, not a stack of its own: it forms no class there.
    unseen = {v: only_marked(t, NO_NATIVE) if v is View.CPP else 0 for v, t in trees.items()}
    classes = {v: equivalence_classes(t, absent.bits | unseen[v]) for v, t in trees.items()}
    return Analysis(
        world=world,
        dumped=dumped,
        culprits=culprits,
        trees=trees,
        classes=classes,
        suspects=suspects(list(classes.values()), culprits, absent),
        absent=absent,
    )


def header(view: View, about: About, a: Analysis) -> FlameHeader:
    n = a.dumped.bit_count()
    world, vc, sus = a.world, a.classes[view], a.suspects
    title = f"{VIEW_TITLES[view].capitalize()} of {n} rank{'s' if n != 1 else ''}, merged"
    missing = ranksets.fold(((1 << world) - 1) & ~a.dumped)
    lines = [
        " · ".join(
            x
            for x in (
                f"incident {about.incident_id}",
                about.kind,
                ", ".join(about.nodes),
                f"world size {world}",
                f"missing ranks {missing}" if n < world else "",
                "silent " + ", ".join(x.label for x in a.absent.nodes) if a.absent.nodes else "",
            )
            if x
        )
    ]
    shown = []
    for c in vc.classes[:4]:
        tag = " (suspect)" if c.suspect else ""
        size = f"{c.size} rank{'s' if c.size != 1 else ''}"
        shown.append(f"#{c.index}: {size} [{ranksets.fold(c.bits, 6)}]{tag}")
    more = f" · +{len(vc.classes) - 4} more" if len(vc.classes) > 4 else ""
    n_classes = f"{len(vc.classes)} class{'es' if len(vc.classes) != 1 else ''}"
    lines.append(f"{n_classes} of identical stacks: " + " · ".join(shown) + more)
    warnings = []
    if sus:
        top = ", ".join(f"{s.rank} ({s.score:.2f})" for s in sus[:8])
        extra = f" and {len(sus) - 8} more" if len(sus) > 8 else ""
        warnings.append(
            f"suspect ranks (score): {top}{extra} — red frames: only suspects reach them"
        )
    return FlameHeader(title=title, lines=tuple(lines), warnings=tuple(warnings))


def draw(view: View, about: About, a: Analysis, flame: FlameSettings | None = None) -> str:
    """The flame SVG of a view, as `diag merge` writes it."""
    return render_svg(a.trees[view], a.suspect_bits, header(view, about, a), flame, a.highlight)
