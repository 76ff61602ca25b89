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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from diag.viewer import ranksets
from diag.viewer.labels import (
    ROOT_INFO,
    FrameInfo,
    FrameKind,
    frame_info,
    role_info,
    state_info,
    thread_info,
)
from diag.viewer.roles import Role, RoleCache, dump_roles, thread_label
from diag.viewer.stacks import Frame, RankDump, ThreadStack


class View(enum.StrEnum):
    PY = "py"  # Python frames only
    CPP = "cpp"  # native frames as the unwinder gave them (with py-spy --native: interleaved)


NO_NATIVE = "no native stack"
# Errors of ranks that did not answer at all (no dump file), shown as they are: they name the
# node or rank, which must not be blanked like pids in other errors.
NO_DUMP = "no dump"
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d{3,}")  # pids, addresses: they differ per rank


@dataclass(frozen=True)
class StackTree:
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


def view_stacks(
    dump: RankDump, view: View, cache: RoleCache | None = None
) -> Iterator[tuple[ThreadStack, bool, Role]]:
    """The thread stacks of a dump that a view shows, with whether to keep native frames and
    the thread's role (see roles.py). A thread with nothing left in the view draws nothing."""
    py, nat = dump_roles(dump, cache)
    if view is View.PY:
        threads, native, roles = dump.threads, False, py.roles
    elif dump.native_threads:
        threads, native, roles = dump.native_threads, True, nat.roles
    elif dump.native or any(f.native for t in dump.threads for f in t.frames):
        threads, native, roles = dump.threads, True, py.roles
    else:
        return
    for t, role in zip(threads, roles, strict=True):
        yield t, native, role


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
        self.ranks: list[list[int]] = [[]]
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
        path = tuple(out)
        self.paths[key] = (frames, path)  # holds `frames` so its id stays unique
        return path

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
                self.ranks.append([])
            node = child
        return node


def build_tree(
    dumps: Sequence[RankDump], view: View, world_size: int, cache: RoleCache | None = None
) -> StackTree:
    """The merged tree of a view. Each stack's path starts with its thread's role and its name
    (counters folded), so helpers of one kind sit side by side. Only the training threads (and
    the markers of ranks without stacks) make a rank's signature: helper threads are drawn but
    do not set ranks apart."""
    b = _Builder()
    cache = cache or RoleCache()
    # distinct path -> (length of the stack before its state cap, ranks: one per stack, whether
    # it counts in the signature)
    groups: dict[tuple[int, ...], tuple[int, list[int], bool]] = {}
    caps: dict[str, tuple[int, ...]] = {}
    # (state, thread name, role, id(frames), native) -> (frames, path); `frames` keeps the id
    # unique
    paths: dict[tuple[str, str, Role, int, bool], tuple[tuple[Frame, ...], tuple[int, ...]]] = {}
    heads: dict[tuple[Role, str], tuple[int, int]] = {}

    def add(path: tuple[int, ...], stack_len: int, rank: int, counted: bool = True) -> None:
        found = groups.get(path)
        if found is None:
            found = groups[path] = (stack_len, [], counted)
        found[1].append(rank)

    for d in dumps:
        state = d.process_state
        cap = caps.get(state)
        if cap is None:
            cap = caps[state] = (b.fid(state_info(state)),) if state else ()
        has_stacks = False
        for thread, native, role in view_stacks(d, view, cache):
            key = (state, thread.name, role, id(thread.frames), native)
            found = paths.get(key)
            if found is None:
                frames = b.frame_path(thread.frames, native)
                head = heads.get((role, thread.name))
                if head is None:
                    head = heads[(role, thread.name)] = (
                        b.fid(role_info(role.value)),
                        b.fid(thread_info(thread_label(thread.name))),
                    )
                path = (*head, *frames, *cap) if frames else ()
                found = paths[key] = (thread.frames, path)
            path = found[1]
            if path:
                training = role is Role.TRAINING
                has_stacks = has_stacks or training
                add(path, len(path) - len(cap), d.rank, training)
        mark = marker(d, view, has_stacks)
        if mark is not None:
            add((b.fid(state_info(mark)), *cap), 1, d.rank)
        elif not has_stacks:  # D state: the state is all there is
            add(cap, 1, d.rank)

    sig: dict[int, list[int]] = {d.rank: [] for d in dumps}
    for path, (stack_len, ranks, counted) in groups.items():
        node = b.insert(path)
        b.ranks[node].extend(ranks)
        if not counted:
            continue
        end = node
        for _ in range(len(path) - stack_len):
            end = b.parent[end]
        for r in ranks:
            sig[r].append(end)

    n = len(b.parent)
    own = [len(r) for r in b.ranks]
    count = own[:]
    bits = [ranksets.bits_of(r) if r else 0 for r in b.ranks]
    parent = b.parent
    for i in range(n - 1, 0, -1):  # children always come after their parent
        p = parent[i]
        count[p] += count[i]
        bits[p] |= bits[i]
    signatures = {r: tuple(sorted(nodes)) for r, nodes in sig.items()}
    return StackTree(
        view=view,
        world_size=world_size,
        # stand-ins of ranks without a dump are drawn, but "without" sets leave them out
        present=ranksets.bits_of(d.rank for d in dumps if not d.error.startswith(NO_DUMP)),
        info=b.info,
        parent=parent,
        depth=b.depth,
        children=[list(k.values()) for k in b.kids],
        count=count,
        own=own,
        bits=bits,
        signatures=signatures,
    )
