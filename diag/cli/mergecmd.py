"""`diag merge`: merges an incident's per-rank stacks into flame SVGs and a summary."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from diag.formats import exitcodes
from diag.formats.inputcaps import clean
from diag.viewer import ranksets
from diag.viewer.flame import FlameSettings
from diag.viewer.incidents import IncidentError, find_incidents
from diag.viewer.merge import merge_incident
from diag.viewer.summary import to_text

DEFAULT_TIMELINE = "/root/timeline"
TIMELINE_ENV = "DIAG_TIMELINE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Merge the per-rank stack dumps of an incident into flame graphs (py_stack.svg, "
        "cpp_stack.svg), folded stacks (*.folded, readable by flamegraph.pl) and a summary of "
        "the equivalence classes of ranks and the suspects (summary.txt, summary.json), written "
        "into the incident directory. Reads diag dumps (*.stack.json), raw `py-spy dump --json` "
        "files ({rank}-{world}.json) and xpu_timer's *.stacktrace files."
    )
    parser.add_argument(
        "--path",
        type=Path,
        default=None,
        help="an incident directory, or a timeline root holding incident directories (then the "
        f"newest incident is merged); default: ${TIMELINE_ENV} or {DEFAULT_TIMELINE}",
    )
    parser.add_argument(
        "--incident",
        metavar="ID",
        help="under a timeline root: merge this incident (its id or directory name), not the newest",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the incidents under --path, newest first, and exit",
    )
    parser.add_argument(
        "--out", type=Path, help="write the outputs here instead of the incident directory"
    )
    parser.add_argument(
        "--width", type=int, default=1200, help="SVG width in pixels (default 1200)"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes that parse dump files when there are thousands "
        "(default: one per CPU, at most 8)",
    )
    parser.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks per node, to name a node none of whose ranks answered (default: from the "
        "dumps or the journal tails; xpu_timer and py-spy files do not say it)",
    )
    parser.add_argument(
        "--minwidth",
        type=float,
        default=0.1,
        help="frames thinner than this many pixels merge into an 'other' cell (default 0.1)",
    )


def _path(args: argparse.Namespace) -> Path:
    if args.path is not None:
        return args.path
    return Path(os.environ.get(TIMELINE_ENV) or DEFAULT_TIMELINE)


def _list(path: Path) -> int:
    incidents = find_incidents(path)
    if not incidents:
        print(f"no incidents under {path}")
        return exitcodes.OK
    print(f"{'incident':<40} {'kind':<12} {'detected (UTC)':<20} {'dumps':>6}  directories")
    for inc in incidents:
        when = inc.when.strftime("%Y-%m-%d %H:%M:%S")
        dirs = ", ".join(clean(d.path.name) for d in inc.dirs)
        print(f"{inc.incident_id:<40} {inc.kind or '-':<12} {when:<20} {inc.n_dumps:>6}  {dirs}")
    return exitcodes.OK


def run(args: argparse.Namespace) -> int:
    path = _path(args)
    if not path.exists():
        raise exitcodes.UsageError(
            f"{path} does not exist; give --path an incident directory or the timeline root"
        )
    if args.width < 200:
        raise exitcodes.UsageError(f"--width {args.width} is too narrow; use 200 pixels or more")
    if args.minwidth < 0:
        raise exitcodes.UsageError("--minwidth cannot be negative")
    if args.jobs is not None and args.jobs < 1:
        raise exitcodes.UsageError("--jobs must be 1 or more")
    if args.local_world_size is not None and args.local_world_size < 1:
        raise exitcodes.UsageError("--local-world-size must be 1 or more")
    try:
        if args.list:
            return _list(path)
        result = merge_incident(
            path,
            incident=args.incident,
            out_dir=args.out,
            flame=FlameSettings(width=args.width, min_width=args.minwidth),
            workers=args.jobs,
            local_world_size=args.local_world_size,
        )
    except IncidentError as e:
        raise exitcodes.UsageError(str(e)) from e
    except OSError as e:
        raise exitcodes.UsageError(
            f"{e}; check --path, or give --out a directory the outputs can be written to"
        ) from e
    # the text written, not read back: the file is in a directory others may write
    print(to_text(result.report), end="")
    print()
    print(f"wrote into {clean(str(result.out_dir))}:")
    for p in (*result.svgs.values(), *result.folded.values()):
        print(f"  {p.name}")
    print(f"  {result.summary_txt.name}\n  {result.summary_json.name}")
    if result.suspects:
        ranks = ranksets.fold_ranks((s.rank for s in result.suspects), 16)
        print(f"suspect ranks: {ranks}")
    return exitcodes.OK
