"""A node's incident directory naming a culprit rank, as the taint step reads it."""

import json
from pathlib import Path


def write_incident(timeline: Path, node: str, incident: str, rank: int = 3) -> Path:
    d = timeline / f"20261124-07000{incident[-1]}-hang-{node}"
    d.mkdir(parents=True)
    (d / "verdict.json").write_text(
        json.dumps(
            {
                "format": "diag.verdict/1",
                "incident_id": incident,
                "kind": "hang",
                "node": node,
                "culprit": rank,
                "summary": f"rank {rank} is the likely culprit: behind in all_reduce",
            }
        )
    )
    (d / f"{rank:05d}-00008.stack.json").write_text("{}")
    return d
