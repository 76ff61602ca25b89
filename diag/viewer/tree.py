"""The merged prefix tree of all ranks' stacks, one per view.

Every node is a frame reached along one path from the root; it carries the set of ranks that
reach it (a bitset) and the number of stacks through it (its width). Each stack starts with its
thread's role (`Role@data loader`) and its thread (`Thread@name`), so that threads stay apart, then
its frames, and ends in a cap with the
process state of its rank (`State@S (sleeping)`), when known: ranks in different states still
share every frame, and the caps show who is sleeping and who spins. A rank with no stack in a
view has a marker instead: its state alone (D state: nothing was taken), `State@error: ...` or
`State@no native stack`.

Each stack starts with its thread's role (see roles.py), then the thread. A rank's signature is
the set of nodes where its training threads' stacks end, below the cap: ranks with equal
signatures have identical training stacks, whatever their state and their helper threads.

Building goes by distinct stack, not by rank: the dumps share frame tuples (see FrameInterner),
so 16k ranks stuck in a handful of places cost a handful of tree walks.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from diag.formats.stackdump import Frame, RankDump, ThreadStack
from diag.viewer import ranksets
from diag.viewer.labels import (
    ROOT_INFO,
    UNRESOLVED,
    FrameInfo,
    FrameKind,
    frame_info,
    is_unresolved,
    role_info,
    state_info,
    thread_info,
    unresolved_run,
)
from diag.viewer.roles import Role, RoleCache, dump_roles, thread_label


class View(enum.StrEnum):
    PY = "py"  # Python frames only
    CPP = "cpp"  # native frames as the unwinder gave them (with py-spy --native: interleaved)


NO_NATIVE = "no native stack"
_FRAMES = frozenset({FrameKind.PYTHON, FrameKind.NATIVE, FrameKind.TORCH})
# The C library and the dynamic loader: where a waiting thread sits, below the call that waits.
_C_LIBRARY = re.compile(
    r"@(\S*/)?(libc|libpthread|ld-linux[\w-]*)([.-][\w.]*)?\.so[\d.]*$|@\[vdso\]$"
)


def _settles(info: FrameInfo) -> bool:
    # unresolved frames, one (`??@lib`) or a run of them (`?? x9@lib`)
    unresolved = info.text.startswith(UNRESOLVED)
    return info.native and (unresolved or _C_LIBRARY.search(info.text) is not None)


# Errors of ranks that did not answer at all (no dump file), shown as they are: they name the
# node or rank, which must not be blanked like pids in other errors.
NO_DUMP = "no dump"
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d{3,}")  # pids, addresses: they differ per rank


@dataclass(frozen=True)
class StackTree:
    """The stacks of every rank of one view merged into one tree, with rank sets per node."""

    view: View
    world_size: int
    present: int  # ranks that have a dump in the merge
    info: list[FrameInfo]  # per node; node 0 is the root
    parent: list[int]
    depth: list[int]
    children: list[list[int]]
    count: list[int]  # stacks through the node: its width
    own: list[int]  # stacks that end at the node
    bits: list[int]  # ranks that reach the node
    # rank -> the nodes its stacks end at (below the state cap), sorted
    signatures: dict[int, tuple[int, ...]]

    def __len__(self) -> int:
        return len(self.parent)

    def path(self, node: int) -> list[int]:
        """Nodes from the first level down to `node` (the root left out)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]

    def thread_of(self, node: int) -> int:
        """The thread a node belongs to; for a marker (no thread above it), the marker."""
        start = node
        while node > 0:
            if self.info[node].kind is FrameKind.THREAD:
                return node
            node = self.parent[node]
        return start


def error_text(error: str) -> str:
    """A dump error as a marker: first line, pids and addresses blanked, so that ranks failing
    the same way merge."""
    first = (error.strip().splitlines() or ["?"])[0]
    return "error: " + _VARYING.sub("N", first)[:100]


def view_threads(
    dump: RankDump, view: View, cache: RoleCache | None = None
) -> tuple[tuple[ThreadStack, ...], bool, tuple[Role, ...]]:
    """The threads of a dump that a view shows, whether to keep their native frames, and their
    roles (see roles.py)."""
    py, nat = dump_roles(dump, cache)
    if view is View.PY:
        return dump.threads, False, py.roles
    if dump.native_threads:
        return dump.native_threads, True, nat.roles
    if dump.native or any(f.native for t in dump.threads for f in t.frames):
        return dump.threads, True, py.roles
    return (), False, ()


def only_marked(tree: StackTree, mark: str) -> int:
    """The ranks whose every stack in `tree` is the marker `mark` alone (bits)."""
    text = state_info(mark).text
    return ranksets.bits_of(
        rank for rank, ends in tree.signatures.items()
        if ends and all(tree.info[e].text == text and tree.parent[e] == 0 for e in ends)
    )  # fmt: skip


def marker(dump: RankDump, view: View, has_stacks: bool) -> str | None:
    """What stands for a rank's missing stacks (None: its stacks or its state say it all)."""
    if dump.error.startswith(NO_DUMP):
        return dump.error
    if dump.error:
        return error_text(dump.error)
    if has_stacks:
        return None
    if view is View.CPP and dump.threads:
        return NO_NATIVE
    return None if dump.process_state else "no stack"


class _Builder:
    def __init__(self) -> None:
        self.info: list[FrameInfo] = [ROOT_INFO]
        self.parent = [-1]
        self.depth = [0]
        self.kids: list[dict[int, int]] = [{}]
        self.fid_of_key: dict[tuple[FrameKind, str], int] = {}
        self.fid_info: list[FrameInfo] = []
        self.fid_of_frame: dict[int, int] = {}  # id(Frame) -> fid; frames outlive the build
        self.paths: dict[tuple[int, bool], tuple[tuple[Frame, ...], tuple[int, ...]]] = {}

    def fid(self, info: FrameInfo) -> int:
        key = (info.kind, info.text)
        found = self.fid_of_key.get(key)
        if found is None:
            found = self.fid_of_key[key] = len(self.fid_info)
            self.fid_info.append(info)
        return found

    def frame_path(self, frames: tuple[Frame, ...], native: bool) -> tuple[int, ...]:
        key = (id(frames), native)
        found = self.paths.get(key)
        if found is not None:
            return found[1]
        out = []
        for f in frames:
            if f.native and not native:
                continue
            fid = self.fid_of_frame.get(id(f))
            if fid is None:
                fid = self.fid_of_frame[id(f)] = self.fid(frame_info(f))
            out.append(fid)
        path = self._collapse_unresolved(out) if native else tuple(out)
        self.paths[key] = (frames, path)  # holds `frames` so its id stays unique
        return path

    def _collapse_unresolved(self, fids: list[int]) -> tuple[int, ...]:
        """Runs of unresolved frames (`??`) of one library become one frame, `?? xN`: the
        unwinder's guesswork says nothing frame by frame, and 30 of them would take 30 rows."""
        out: list[int] = []
        i, n = 0, len(fids)
        while i < n:
            info = self.fid_info[fids[i]]
            j = i + 1
            if is_unresolved(info):
                while j < n and fids[j] == fids[i]:
                    j += 1
            out.append(fids[i] if j - i == 1 else self.fid(unresolved_run(info, j - i)))
            i = j
        return tuple(out)

    def settled(self, node: int) -> int:
        """The innermost frame of a native stack above its wait in the C library: the frames
        where a waiting thread happens to be inside libc (a futex, a poll, a spin on sched_yield,
        unresolved frames below its last named one) vary with timing, and would set ranks apart
        that wait in the same place."""
        info, parent = self.info, self.parent
        while node > 0 and _settles(info[node]) and info[parent[node]].kind in _FRAMES:
            node = parent[node]
        return node

    def insert(self, path: Sequence[int]) -> int:
        node = 0
        kids, info, parent, depth = self.kids, self.info, self.parent, self.depth
        for fid in path:
            child = kids[node].get(fid)
            if child is None:
                child = kids[node][fid] = len(parent)
                info.append(self.fid_info[fid])
                parent.append(node)
                depth.append(depth[node] + 1)
                kids.append({})
            node = child
        return node


# A distinct stack of a view: (process state, role, thread label, frames, keep native frames).
# Ranks without stacks have a marker instead: (state, None, marker text or None, None, False).
StackKey = tuple[str, Role | None, str | None, tuple[Frame, ...] | None, bool]


@dataclass
class Collected:
    """A view's stacks of some ranks, aggregated by distinct stack: for each, the number of
    stacks (one per thread) and the bitset of ranks. Built where the dumps are read (in worker
    processes, for thousands of them), so that only distinct stacks travel and get merged."""

    view: View
    stacks: dict[StackKey, tuple[int, int]]


def collect(dumps: Sequence[RankDump], view: View, cache: RoleCache | None = None) -> Collected:
    cache = cache or RoleCache()
    # keyed by id(frames): hashing a tuple of 200 frames per thread would cost more than all
    # the rest; `frames_of` keeps each tuple alive, so its id stays unique
    ranks: dict[tuple[str, Role | None, str | None, int, bool], list[int]] = {}
    frames_of: dict[int, tuple[Frame, ...] | None] = {0: None}
    has_py: dict[int, bool] = {}
    labels: dict[str, str] = {}

    training = Role.TRAINING
    for d in dumps:
        state, rank = d.process_state, d.rank
        has_stacks = False
        threads, native, roles = view_threads(d, view, cache)
        for thread, role in zip(threads, roles, strict=True):
            frames = thread.frames
            if not frames:
                continue
            fid = id(frames)
            py = has_py.get(fid)
            if py is None:
                frames_of[fid] = frames
                py = has_py[fid] = any(not f.native for f in frames)
            if not (native or py):  # nothing left in the view
                continue
            if role is training:
                has_stacks = True
            name = thread.name
            label = labels.get(name)
            if label is None:
                label = labels[name] = thread_label(name)
            key = (state, role, label, fid, native)
            found = ranks.get(key)
            if found is None:
                ranks[key] = [rank]
            else:
                found.append(rank)
        mark = marker(d, view, has_stacks)
        if mark is not None or not has_stacks:
            key = (state, None, mark, 0, False)
            found = ranks.get(key)
            if found is None:
                found = ranks[key] = []
            found.append(d.rank)
    stacks: dict[StackKey, list[int]] = {}
    for (state, role, label, fid, native), rs in ranks.items():
        # equal stacks in distinct tuples (not interned) meet here
        stacks.setdefault((state, role, label, frames_of[fid], native), []).extend(rs)
    return Collected(view, {k: (len(rs), ranksets.bits_of(rs)) for k, rs in stacks.items()})


def build_tree(
    dumps: Sequence[RankDump], view: View, world_size: int, cache: RoleCache | None = None
) -> StackTree:
    """The merged tree of a view. Each stack's path starts with its thread's role and its name
    (counters folded), so helpers of one kind sit side by side. Only the training threads (and
    the markers of ranks without stacks) make a rank's signature: helper threads are drawn but
    do not set ranks apart."""
    present = ranksets.bits_of(d.rank for d in dumps if not d.error.startswith(NO_DUMP))
    return merged_tree([collect(dumps, view, cache)], view, world_size, present)


def merged_tree(parts: Sequence[Collected], view: View, world_size: int, present: int) -> StackTree:
    """The tree of a view from the stacks collected in `parts` (of disjoint sets of ranks).
    `present`: the ranks with a dump (stand-ins of missing ranks are drawn but left out of the
    "without" sets of labels)."""
    b = _Builder()
    caps: dict[str, tuple[int, ...]] = {}
    heads: dict[tuple[Role, str], tuple[int, int]] = {}
    own: dict[int, int] = {}
    node_bits: dict[int, int] = {}
    sig: dict[int, list[int]] = {}
    for part in parts:
        for (state, role, label, frames, native), (count, bits) in part.stacks.items():
            cap = caps.get(state)
            if cap is None:
                cap = caps[state] = (b.fid(state_info(state)),) if state else ()
            if frames is None:  # a marker, or the state alone (D state)
                path = (b.fid(state_info(label)), *cap) if label is not None else cap
                stack_len = 1
                counted = True
            else:
                assert role is not None and label is not None
                head = heads.get((role, label))
                if head is None:
                    head = heads[(role, label)] = (
                        b.fid(role_info(role.value)),
                        b.fid(thread_info(label)),
                    )
                path = (*head, *b.frame_path(frames, native), *cap)
                stack_len = len(path) - len(cap)
                counted = role is Role.TRAINING
            node = b.insert(path)
            own[node] = own.get(node, 0) + count
            node_bits[node] = node_bits.get(node, 0) | bits
            if counted:
                end = node
                for _ in range(len(path) - stack_len):
                    end = b.parent[end]
                if native:
                    end = b.settled(end)
                for r in ranksets.ranks_of(bits):
                    found = sig.get(r)
                    if found is None:
                        found = sig[r] = []
                    found.append(end)

    n = len(b.parent)
    own_list = [0] * n
    bits = [0] * n
    for node, c in own.items():
        own_list[node] = c
    for node, x in node_bits.items():
        bits[node] = x
    count = own_list[:]
    parent = b.parent
    for i in range(n - 1, 0, -1):  # children always come after their parent
        p = parent[i]
        count[p] += count[i]
        bits[p] |= bits[i]
    signatures = {r: tuple(sorted(nodes)) for r, nodes in sorted(sig.items())}
    return StackTree(
        view=view,
        world_size=world_size,
        present=present,
        info=b.info,
        parent=parent,
        depth=b.depth,
        children=[list(k.values()) for k in b.kids],
        count=count,
        own=own_list,
        bits=bits,
        signatures=signatures,
    )
