"""One rank's journal as the agent follows it: the records decoded since the last poll, the ops
still pending (their slots change in place), and a short history (step durations, completed ops)
for adaptive limits, straggler scores and the pace of a rank without steps.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from diag.agent.detect.cadence import Cadence
from diag.agent.detect.observation import OpView, Paced
from diag.formats.journalmeta import JournalMeta, read_meta
from diag.formats.journalreader import JournalReader
from diag.formats.records import OpFlag, OpState, Record, RecordKind
from diag.formats.untrusted import Owners
from diag.formats.worlds import world_of

_NS = 1e-9
_HISTORY_STEPS = 16
_HISTORY_OPS = 256
_HISTORY_P2P = 8  # recent ops per (group, peer): enough to see a send/recv order repeat
_UNSETTLED_TRIES = 20
_SETTLED_STEP = 2  # polls before giving up on a slot left half-written by a dead writer
_LAUNCH_ENDS = 8  # end times kept of a launch's first steps (the warm-up is at most this long)


@dataclass
class RankTracker:
    path: Path
    reader: JournalReader
    meta: JournalMeta
    owners: Owners | None = None
    proven: bool = False  # its PID was shown to be the journal's writer (rankproof.py)
    next_seq: int = 0
    pending: dict[int, Record] = field(default_factory=dict)
    unsettled: dict[int, int] = field(default_factory=dict)
    last_ops: dict[str, OpView] = field(default_factory=dict)
    p2p: dict[tuple[str, int], deque] = field(default_factory=dict)
    step_ends: deque = field(default_factory=lambda: deque(maxlen=_HISTORY_STEPS + 1))
    # Steps done before this launch: a resumed rank counts on from its checkpoint's step. None
    # until its first step is read; 0 when the ring lost the launch's first records.
    launch_base: int | None = None
    launch_ends: list[float] = field(default_factory=list)
    world: int = 0  # the newest world (formed again in place) its ops were seen in
    # Recent steps and completed ops, kept apart so that many ops per step do not crowd the
    # steps out of the history.
    step_pace: deque = field(default_factory=lambda: deque(maxlen=_HISTORY_STEPS))
    op_pace: deque = field(default_factory=lambda: deque(maxlen=_HISTORY_OPS))
    # Time in phases (eval, checkpoint): judged by their own limits, so not part of the pace.
    phase_depth: int = 0
    phase_from: float = 0.0
    in_phases: float = 0.0  # seconds in phases since the last step ended
    phase_spans: deque = field(default_factory=lambda: deque(maxlen=_HISTORY_P2P))
    done_ops: deque = field(default_factory=lambda: deque(maxlen=_HISTORY_OPS))
    op_seconds: deque = field(default_factory=lambda: deque(maxlen=_HISTORY_OPS))
    last_activity: float = 0.0
    lost: int = 0  # records the ring overwrote before we read them
    cadence: Cadence = field(default_factory=Cadence)
    new_done: list[tuple[float, float]] = field(default_factory=list)  # not yet in `cadence`

    @property
    def rank(self) -> int:
        return self.meta.rank

    def group_name(self, index: int) -> str:
        g = self.meta.group(index)
        if g is None:
            with contextlib.suppress(OSError, ValueError):  # a group made after our last read
                # Only the groups: who the writer is was proven on the meta first read.
                self.meta = replace(self.meta, groups=read_meta(self.path, self.owners).groups)
            g = self.meta.group(index)
        return g.name if g is not None else f"#{index}"

    def view(self, rec: Record) -> OpView:
        return OpView(
            group=self.group_name(rec.group),
            group_seq=rec.group_seq,
            op=rec.op,
            state=rec.state,
            nbytes=rec.nbytes,
            t_enqueue=rec.t_enqueue_ns * _NS,
            t_end=rec.t_end_ns * _NS if rec.t_end_ns else None,
            peer=rec.peer,
            on_device=bool(rec.flags & OpFlag.CUDA),
        )

    def poll(self) -> None:
        head = self.reader.head()
        cap = self.reader.header.capacity
        if head - self.next_seq > cap:
            self.lost += head - self.next_seq - cap
            self.next_seq = head - cap
        seqs = [*self.unsettled, *self.pending, *range(self.next_seq, head)]
        self.next_seq = max(self.next_seq, head)
        for seq in seqs:
            rec = self.reader.read(seq)
            if rec is None:
                if head - seq >= cap:  # overwritten: that op is long gone
                    self.pending.pop(seq, None)
                    self.unsettled.pop(seq, None)
                elif seq not in self.pending:
                    tries = self.unsettled.get(seq, 0) + 1
                    if tries > _UNSETTLED_TRIES:
                        self.unsettled.pop(seq, None)
                    else:
                        self.unsettled[seq] = tries
                continue
            self.unsettled.pop(seq, None)
            self._apply(rec)

    def _apply(self, rec: Record) -> None:
        t = max(rec.t_enqueue_ns, rec.t_start_ns, rec.t_end_ns) * _NS
        # An op that failed (its group aborted under it, a recovery in place) ended without
        # progress: its end does not show the rank moving again after an incident.
        moved = max(rec.t_enqueue_ns, rec.t_start_ns) * _NS if rec.state == OpState.FAILED else t
        self.last_activity = max(self.last_activity, moved)
        if rec.kind == RecordKind.STEP:
            self._note_step(rec.step, rec.t_end_ns * _NS)
            return
        if rec.kind in (RecordKind.PHASE_BEGIN, RecordKind.PHASE_END):
            self._note_phase(rec.kind == RecordKind.PHASE_BEGIN, t)
            return
        if rec.kind != RecordKind.OP:
            return
        v = self.view(rec)
        if world_of(v.group) > self.world:
            self._new_world(world_of(v.group))
        if rec.op.is_p2p:
            self._note_p2p(v)
        else:
            prev = self.last_ops.get(v.group)
            if prev is None or v.group_seq >= prev.group_seq:
                self.last_ops[v.group] = v
        if rec.state.pending:
            self.pending[rec.seq] = rec
            return
        self.pending.pop(rec.seq, None)
        if v.t_end is not None and rec.state == OpState.COMPLETED and rec.step == 0:
            self.new_done.append((v.t_enqueue, v.t_end))  # the pace of a rank without steps
        if (
            v.t_end is not None
            and rec.state == OpState.COMPLETED
            and rec.step
            and not self._in_phase(v.t_enqueue)
        ):
            self.op_pace.append(Paced(v.describe(), v.t_enqueue, v.t_end - v.t_enqueue))
        if (
            v.t_end is not None
            and rec.state == OpState.COMPLETED
            and rec.step - (self.launch_base or 0) >= _SETTLED_STEP
        ):
            # Ops of a launch's first steps are dominated by start-up skew: not a basis for
            # straggler scores.
            self.done_ops.append(v)
            self.op_seconds.append(v.t_end - v.t_enqueue)

    def _new_world(self, world: int) -> None:
        """The rank's first op in a world formed again in place (diag.trainer.resilient): its
        steps there are a new launch's. The first ones rebuild the engine and restore, and the
        first step's time since the last world's last step spans the whole recovery: counted as
        the pace, they would lift the limit for the rest of the run (to 5 x the recovery on a
        node where no spare reset the warm-up)."""
        self.world = world
        self.launch_base = None
        self.launch_ends.clear()
        self.step_ends.clear()
        self.step_pace.clear()
        self.op_pace.clear()
        self.in_phases = 0.0

    def _note_phase(self, begins: bool, t: float) -> None:
        if begins:
            if self.phase_depth == 0:
                self.phase_from = t
            self.phase_depth += 1
            return
        if self.phase_depth == 0:
            return  # its beginning was before what we read
        self.phase_depth -= 1
        if self.phase_depth == 0:
            self.in_phases += max(0.0, t - self.phase_from)
            self.phase_spans.append((self.phase_from, t))

    def _in_phase(self, t: float) -> bool:
        if self.phase_depth and t >= self.phase_from:
            return True
        return any(a <= t <= b for a, b in self.phase_spans)

    def _note_step(self, step: int, t_end: float) -> None:
        if self.launch_base is None:
            self.launch_base = max(0, step - 1) if self.lost == 0 else 0
        if self.phase_depth:  # a step that ends inside a phase: the rest counts for the next
            self.in_phases += max(0.0, t_end - self.phase_from)
            self.phase_from = t_end
        if self.step_ends:
            start = self.step_ends[-1]
            seconds = max(0.0, t_end - start - self.in_phases)
            what = f"step {step}" + (
                f" less {self.in_phases:.3g} s in phases" if self.in_phases >= 0.0005 else ""
            )
            self.step_pace.append(Paced(what, start, seconds))
        self.in_phases = 0.0
        self.step_ends.append(t_end)
        if len(self.launch_ends) < _LAUNCH_ENDS:
            self.launch_ends.append(t_end)

    def pace(self) -> tuple[Paced, ...]:
        return (*self.step_pace, *self.op_pace)

    def launch_steps(self, step: int) -> int:
        """Steps this launch completed, of the `step` count its journal shows."""
        if self.launch_base is None:
            return step if self.lost else 0
        return step - self.launch_base

    def _note_p2p(self, v: OpView) -> None:
        hist = self.p2p.get((v.group, v.peer))
        if hist is None:
            hist = self.p2p[(v.group, v.peer)] = deque(maxlen=_HISTORY_P2P)
        if not hist or v.group_seq > hist[-1].group_seq:
            hist.append(v)
            return
        for i in range(len(hist) - 1, -1, -1):  # a pending op read again: its state changed
            if hist[i].group_seq == v.group_seq:
                hist[i] = v
                return

    def step_durations(self) -> tuple[float, ...]:
        ends = list(self.step_ends)
        return tuple(b - a for a, b in itertools.pairwise(ends))
