"""Equivalence classes of ranks (STAT's idea) and the suspects they point at.

Ranks whose training threads' stacks are identical form a class (helper threads, see roles.py,
never set a rank apart; ranks that did not answer, see absent.py, form no class). Classes are listed largest first; each says
where it parts from the largest one (the largest from the second). A class at most half the
size of the largest is a minority, and its ranks are suspects, scored 1 - size/largest: one odd
rank among 1,000 scores ~1; a split 9 vs 7 flags nobody, and neither do equal classes, as with
pipeline stages that legitimately wait in different places. The verdict's culprit is always a
suspect.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from diag.viewer import ranksets
from diag.viewer.absent import Absent
from diag.viewer.tree import StackTree, View

MAIN_THREAD = "Thread@MainThread"
TAIL_FRAMES = 12  # frames of a class's own stack the summary shows


@dataclass(frozen=True)
class Divergence:
    """Where a class of ranks parts from another: the thread and the last frame they share."""

    reference: int  # the class compared with
    thread: str  # the thread (or state marker) in which they part
    after: str  # the last frame both share ("" when they part at the root)
    here: str  # this class's next frame ("(stack ends)" / "(no such thread)" when there is none)
    there: str  # the reference class's next frame
    node: int  # tree node where they part


@dataclass(frozen=True)
class RankClass:
    """Ranks whose training threads are in the same place."""

    index: int  # 1-based, largest first
    bits: int
    size: int
    ranks: str  # folded, complete
    thread: str  # the thread shown for it: where it parts from the reference, or the main one
    leaf: str  # the innermost frame of that thread
    tail: tuple[str, ...]  # that thread's frames from the divergence (or the last few) inward
    divergence: Divergence | None
    suspect: bool = False
    score: float = 0.0


@dataclass(frozen=True)
class ViewClasses:
    """The classes of ranks of one view, largest first."""

    view: View
    classes: tuple[RankClass, ...]

    @property
    def minority_bits(self) -> int:
        bits = 0
        for c in self.classes:
            if c.suspect:
                bits |= c.bits
        return bits


@dataclass(frozen=True)
class Suspect:
    """A rank the merge points at, with its score and why."""

    rank: int
    score: float
    reasons: tuple[str, ...] = field(default_factory=tuple)


def _threads(tree: StackTree, ends: Iterable[int]) -> dict[str, list[int]]:
    """Stack ends by thread name (markers by their own text), to match up across classes."""
    out: dict[str, list[int]] = {}
    for e in ends:
        out.setdefault(tree.info[tree.thread_of(e)].text, []).append(e)
    return out


def _thread_order(name: str) -> tuple[int, str]:
    # The main thread first, other threads next, state markers last.
    return (0 if name == MAIN_THREAD else 1 if name.startswith("Thread@") else 2, name)


def _child_towards(tree: StackTree, ancestor: int, node: int) -> int | None:
    if node == ancestor:
        return None
    while tree.parent[node] != ancestor:
        node = tree.parent[node]
    return node


def _lca(tree: StackTree, a: int, b: int) -> int:
    depth, parent = tree.depth, tree.parent
    while depth[a] > depth[b]:
        a = parent[a]
    while depth[b] > depth[a]:
        b = parent[b]
    while a != b:
        a, b = parent[a], parent[b]
    return a


def divergence(
    tree: StackTree, mine: Sequence[int], theirs: Sequence[int], reference: int
) -> Divergence | None:
    """Where stacks ending in `mine` part from those ending in `theirs`; None if they do not."""
    a, b = _threads(tree, mine), _threads(tree, theirs)
    for name in sorted(set(a) | set(b), key=_thread_order):
        xs, ys = sorted(a.get(name, [])), sorted(b.get(name, []))
        if xs == ys:
            continue
        if not xs or not ys:
            here = name if xs else "(no such thread)"
            there = name if ys else "(no such thread)"
            return Divergence(reference, name, "", here, there, 0)
        x = next((e for e in xs if e not in ys), xs[0])
        y = next((e for e in ys if e not in xs), ys[0])
        lca = _lca(tree, x, y)
        cx, cy = _child_towards(tree, lca, x), _child_towards(tree, lca, y)
        return Divergence(
            reference=reference,
            thread=name,
            after=tree.info[lca].text,
            here=tree.info[cx].text if cx is not None else "(stack ends)",
            there=tree.info[cy].text if cy is not None else "(stack ends)",
            node=lca,
        )
    return None


def _shown_thread(tree: StackTree, ends: Sequence[int], div: Divergence | None) -> tuple[str, int]:
    """(thread name, end node) of the stack to show for a class."""
    threads = _threads(tree, ends)
    name = (
        div.thread if div is not None and div.thread in threads else min(threads, key=_thread_order)
    )
    return name, max(threads[name], key=lambda e: tree.depth[e])


def equivalence_classes(tree: StackTree, exclude: int = 0) -> ViewClasses:
    """Classes of the ranks of `tree` by their training threads' stacks; ranks in `exclude`
    (those that did not answer, see absent.py) form none."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, sig in tree.signatures.items():
        if not exclude >> rank & 1:
            groups.setdefault(sig, []).append(rank)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    largest = len(ordered[0][1]) if ordered else 0
    classes = []
    for i, (sig, ranks) in enumerate(ordered):
        ref = 1 if i > 0 else 2
        div = None
        if ref <= len(ordered):
            div = divergence(tree, sig, ordered[ref - 1][0], ref)
        thread, end = _shown_thread(tree, sig, div) if sig else ("", 0)
        path = tree.path(end)
        if div is not None and div.node in path:
            tail = path[path.index(div.node) + 1 :]
        else:  # from the thread on
            tail = [n for n in path if tree.depth[n] > tree.depth[tree.thread_of(end)]]
        if len(tail) > TAIL_FRAMES:  # where it parts and where it ends matter most
            tail = [*tail[: TAIL_FRAMES // 2], -1, *tail[-(TAIL_FRAMES // 2 - 1) :]]
        size = len(ranks)
        minority = size < largest and 2 * size <= largest
        bits = ranksets.bits_of(ranks)
        classes.append(
            RankClass(
                index=i + 1,
                bits=bits,
                size=size,
                ranks=ranksets.fold(bits),
                thread=thread,
                leaf=tree.info[end].text,
                tail=tuple(tree.info[n].text if n >= 0 else "..." for n in tail),
                divergence=div,
                suspect=minority,
                score=round(1 - size / largest, 4) if minority else 0.0,
            )
        )
    return ViewClasses(view=tree.view, classes=tuple(classes))


# How much an odd stack in a view counts. Waiting ranks' native leaves differ with timing alone
# (spinning, yielding, sleeping), their Python stacks hardly: a rank odd only in its native
# stack is half as suspect.
VIEW_WEIGHT = {View.PY: 1.0, View.CPP: 0.5}


def agree(views: Sequence[ViewClasses]) -> bool:
    """Whether the ranks that answered agree: no minority class in their Python stacks (or in
    the native ones, when there are no Python stacks). Waiting ranks' native leaves differ with
    timing alone, so they do not decide it."""
    py = [v for v in views if v.view is View.PY and v.classes]
    return not any(c.suspect for v in (py or views) for c in v.classes)


# How much a silent rank counts: when the answering ranks agree it is the lead; when some of
# them stand out, those come first and the silent ranks follow.
SILENT_SCORE = {True: 1.0, False: 0.5}


def suspects(
    views: Sequence[ViewClasses], culprits: Iterable[int], absent: Absent | None = None
) -> tuple[Suspect, ...]:
    """Minority-class ranks of every view, the ranks that did not answer and the verdict's
    culprits, best first. Evidence from several views adds up as independent: score = 1 -
    prod(1 - weight * s), so a rank odd in both its Python and its native stacks ranks above one
    whose native leaf alone differs."""
    found: dict[int, tuple[float, list[str]]] = {}

    def add(rank: int, score: float, reason: str) -> None:
        doubt, reasons = found.get(rank, (1.0, []))
        reasons.append(reason)
        found[rank] = (doubt * (1 - score), reasons)

    culprits = tuple(culprits)
    for culprit in culprits:
        add(culprit, 1.0, "named culprit by the verdict")
    if absent is not None:
        silent = SILENT_SCORE[agree(views)]
        for r in ranksets.ranks_of(absent.bits):
            add(r, silent, absent.reason(r))
    for v in views:
        if not v.classes:
            continue
        largest = v.classes[0].size
        for c in v.classes:
            if not c.suspect:
                continue
            reason = (
                f"{v.view.value} stacks: minority class {c.index} "
                f"({c.size} rank{'s' if c.size > 1 else ''} vs {largest} in class 1)"
            )
            for r in ranksets.ranks_of(c.bits):
                add(r, VIEW_WEIGHT[v.view] * c.score, reason)
    named = set(culprits)
    # the verdict's culprits first among equals: the journals named them
    ordered = sorted(found.items(), key=lambda kv: (kv[1][0], kv[0] not in named, kv[0]))
    return tuple(
        Suspect(rank=r, score=round(1 - doubt, 6), reasons=tuple(rs)) for r, (doubt, rs) in ordered
    )
