"""Production-shaped stack dumps of a hung training job, for `diag merge` tests and benches.

What a real incident of a large GPU job looks like, rank by rank:
- ~15 Python threads: the training thread (the main thread, waiting in a collective), the data
  loader's pin-memory thread and one queue feeder per worker, a logging queue listener, a
  TensorBoard writer, the gRPC client's channel-spin thread, diag's own threads, a user's
  watchdog, a metrics uploader, a debug HTTP server, a compile-worker reader. Threads named by
  Python's counter (`Thread-7 (_pin_memory_loop)`) carry other numbers on some ranks (they
  started one more helper earlier), some ranks have one queue feeder more or less, and helper
  threads sit in different places with timing alone (waiting on a queue, or pinning a batch).
- ~60 native threads (gdb's view): the Python threads with the interpreter's frames, plus CUDA,
  NCCL proxy and watchdog, OpenMP, intra-op pool, autograd and gRPC core threads. The training
  thread is ~200 frames deep; many frames are unresolved (`??` in gdb, a hex address in py-spy).
  The innermost native frame of a waiting thread varies with timing (spinning, yielding, futex).
- What goes wrong: odd ranks whose training thread is stuck elsewhere (in a checkpoint write, or
  waiting for data), ranks without a dump (scattered, and whole nodes), corrupt files, dumps
  that timed out.

Three formats, as `diag merge` reads them: `diag` (`{rank}-{world}.stack.json`: the Python
threads with native frames interleaved, as `py-spy dump --native` gives them, plus every
thread's gdb stack in `native_threads`), `xpu` (xpu_timer's `.stacktrace` protobuf: py-spy
threads without native frames, and pstack threads), `pyspy` (raw `py-spy dump --json --native`
output, which lists only threads that run Python), or `mixed` (rank by rank in turn).

Next to the dumps, `truth.json` says what was injected (odd, missing, corrupt and timed-out ranks,
missing nodes); it is no dump file, so `diag merge` leaves it alone.

    .venv/bin/python bench/incident_gen.py OUT --ranks 1344 [--format xpu] [--scenario odd]

The package splits by concept: model.py (frames and threads), threads.py (the Python threads of
a rank), native.py (threads that run no Python), formats.py (the three file formats), scenario.py
(what goes wrong, and the files of an incident).

A scenario is `odd` (answering ranks disagree: the odd ranks lead) or `agree` (every answering
rank waits in the same place: the ranks that did not answer lead).
"""

from .formats import (
    Addresses,
    RankThreads,
    diag_dump,
    gdb_frames,
    pyspy_dump,
    rank_threads,
    xpu_dump,
)
from .model import F, RankPlan, ThreadModel
from .scenario import (
    FORMATS,
    SCENARIOS,
    SUFFIX,
    TRUTH_FILE,
    Truth,
    file_format,
    iter_sizes,
    plan_incident,
    rank_file,
    rank_plan,
    write_incident,
)

__all__ = [
    "FORMATS",
    "SCENARIOS",
    "SUFFIX",
    "TRUTH_FILE",
    "Addresses",
    "F",
    "RankPlan",
    "RankThreads",
    "ThreadModel",
    "Truth",
    "diag_dump",
    "file_format",
    "gdb_frames",
    "iter_sizes",
    "plan_incident",
    "pyspy_dump",
    "rank_file",
    "rank_plan",
    "rank_threads",
    "write_incident",
    "xpu_dump",
]
