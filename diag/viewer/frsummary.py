"""What torch's flight recorder says, in the merge summary's words: the same group names and the
same sequence numbers as the journal and the verdict beside it.

torch numbers a group's collectives from the group's creation; the journal from when
`diag.trainer.attach` hooked the rank (after `deepspeed.initialize`, whose broadcasts torch
counts). Where every rank's recorder and journal tail agree on the gap (the same op at both
numbers), the summary shows the journal's numbers and says the gap once; otherwise torch's,
named as torch's. torch's description "undefined" (a group made without one) is left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diag.viewer.frdumps import LAST_SHOWN, FlightEntry, FlightRecord, FlightReport

# The journal's numbers per rank and group: (last group_seq, its op), from its tail.
JournalLast = Mapping[int, Mapping[str, tuple[int, str]]]


@dataclass(frozen=True)
class Numbering:
    """Per (recorder, group): what to subtract from torch's number to get the journal's."""

    offsets: tuple[tuple[str, str, int], ...] = ()  # (backend, group, offset)

    def offset(self, backend: str, group: str) -> int | None:
        return next((o for b, g, o in self.offsets if (b, g) == (backend, group)), None)

    def seq(self, backend: str, group: str, torch_seq: int) -> int:
        off = self.offset(backend, group)
        return torch_seq if off is None else torch_seq - off


def _op_key(name: str) -> str:
    """One spelling of a collective for torch's profiling name (`gloo:all_gather`,
    `nccl:_allgather_base`) and the journal's (`all_gather_base`)."""
    key = name.rpartition(":")[2].lower().replace("_", "")
    for suffix in ("coalesced", "intotensor", "tensor", "base"):
        key = key.removesuffix(suffix)
    return key


def _rank_offset(record: FlightRecord, group: str, last: tuple[int, str]) -> int | None:
    journal_seq, journal_op = last
    off = record.last_enqueued(group) - journal_seq
    at = [e for e in record.entries if e.group == group and not e.is_p2p and e.seq == last[0] + off]
    if off < 0 or not at or _op_key(at[0].op) != _op_key(journal_op):
        return None
    return off


def numbering(rep: FlightReport, journal: JournalLast) -> Numbering:
    """The journal's numbering for each (recorder, group) on which every rank with both a
    recorder dump and a journal tail gives the same gap, checked on the op at both numbers."""
    found: dict[tuple[str, str], set[int | None]] = {}
    for r in rep.records:
        for group, last in journal.get(r.rank, {}).items():
            if any(e.group == group for e in r.entries):
                found.setdefault((r.backend, group), set()).add(_rank_offset(r, group, last))
    offsets = []
    for (backend, group), offs in sorted(found.items()):
        agreed = next(iter(offs)) if len(offs) == 1 else None
        if agreed is not None:
            offsets.append((backend, group, agreed))
    return Numbering(tuple(offsets))


def group_label(group: str, desc: str) -> str:
    return f"group {group}" + (f" ({desc})" if desc and desc not in ("undefined", group) else "")


def _entry_text(e: FlightEntry, backend: str, n: Numbering) -> str:
    kind = "p2p " if e.is_p2p else ""
    seq = e.seq if e.is_p2p else n.seq(backend, e.group, e.seq)
    return f"{e.op or '?'} {kind}#{seq} {e.state}, {group_label(e.group, e.group_desc)}"


def to_lines(
    rep: FlightReport, n: Numbering = Numbering(), per_rank: int = LAST_SHOWN, max_ranks: int = 64
) -> list[str]:
    if rep.empty:
        return []
    out = ["FLIGHT RECORDER (torch), last entries per rank, oldest first:"]
    for backend, group, off in n.offsets:
        if off:
            out.append(
                f"  numbered as the journal and the verdict: torch's numbers on {group_label(group, '')}"
                f" [{backend}] are {off} higher (it also counts the collectives before diag attached)"
            )
    for r in rep.records[:max_ranks]:
        last = r.entries[-per_rank:]
        shown = "; ".join(_entry_text(e, r.backend, n) for e in last) or "no entries"
        out.append(f"  rank {r.rank:<5} [{r.backend}] {len(r.entries)} entries: {shown}")
    if len(rep.records) > max_ranks:
        out.append(f"  ... {len(rep.records) - max_ranks} more in summary.json")
    for rank, why in rep.errors[:max_ranks]:
        out.append(f"  rank {rank}: {why}" if rank >= 0 else f"  note: {why}")
    for lag in rep.lags:
        off = n.offset(lag.backend, lag.group) or 0
        who = ", ".join(f"rank {k} at #{v - off}" for k, v in lag.behind[:16])
        more = f" and {len(lag.behind) - 16} more" if len(lag.behind) > 16 else ""
        out.append(
            f"  behind on {group_label(lag.group, lag.group_desc)} [{lag.backend}]: {who}{more};"
            f" others enqueued #{lag.ahead - off}"
        )
    return out


def to_json(rep: FlightReport, n: Numbering = Numbering(), limit: int = 1000) -> dict:
    """Sequence numbers as in the text: the journal's where `n` has the group's gap (its
    `torch_offset` gives torch's own), torch's otherwise."""
    return {
        "numbering": [{"backend": b, "group": g, "torch_offset": off} for b, g, off in n.offsets],
        "ranks": [
            {
                "rank": r.rank,
                "backend": r.backend,
                "file": r.file,
                "version": r.version,
                "entries": len(r.entries),
                "last": [
                    {
                        "op": e.op,
                        "seq": e.seq if e.is_p2p else n.seq(r.backend, e.group, e.seq),
                        "p2p": e.is_p2p,
                        "state": e.state,
                        "group": e.group,
                        "group_desc": _desc(e.group_desc),
                    }
                    for e in r.entries[-LAST_SHOWN:]
                ],
            }
            for r in rep.records[:limit]
        ],
        "errors": [{"rank": k, "error": v} for k, v in rep.errors[:limit]],
        "behind": [
            {
                "backend": lag.backend,
                "group": lag.group,
                "group_desc": _desc(lag.group_desc),
                "ahead": n.seq(lag.backend, lag.group, lag.ahead),
                "ranks": [
                    {"rank": k, "last_enqueued": n.seq(lag.backend, lag.group, v)}
                    for k, v in lag.behind
                ],
            }
            for lag in rep.lags
        ],
    }


def _desc(desc: str) -> str:
    return "" if desc == "undefined" else desc
