"""Threads by role: the training thread is told from helpers by what its stack holds; helpers
are drawn grouped by role and never set a rank apart; counters in thread names fold."""

from __future__ import annotations

import random

from incidentkit import gen
from mergekit import C10D, common, native, py, rank_dump, thread

from diag.formats.stackdump import RankDump, ThreadStack
from diag.viewer.classes import equivalence_classes, suspects
from diag.viewer.journals import JournalThreads, journal_threads
from diag.viewer.roles import Role, RoleCache, dump_roles, thread_label
from diag.viewer.tree import View, build_tree

QUEUES = "/usr/lib/python3.11/multiprocessing/queues.py"
THREADING = "/usr/lib/python3.11/threading.py"
PIN = "/usr/lib/python3/site-packages/torch/utils/data/_utils/pin_memory.py"
HANDLERS = "/usr/lib/python3.11/logging/handlers.py"
GRPC = "/usr/lib/python3/site-packages/grpc/_channel.py"


def helper(name: str, *frames, tid: int) -> ThreadStack:
    return thread(
        [py("_bootstrap", 1002, THREADING), py("run", 982, THREADING), *frames], name, tid
    )


def waiting(n: int) -> list:
    return [py("wait", 320, THREADING), native("futex_wait" if n % 2 else "sched_yield")]


def ordinary(rank: int, world: int, *, counter: int = 5, feeders: int = 2, busy_log: bool = False):
    threads = [thread(common(py("barrier", 4811, C10D), native("futex_wait")), tid=1000 + rank)]
    threads.append(
        helper(
            f"Thread-{counter} (_pin_memory_loop)",
            py("_pin_memory_loop", 59, PIN),
            *waiting(rank),
            tid=2,
        )
    )
    threads += [
        helper("QueueFeederThread", py("_feed", 231, QUEUES), *waiting(rank + i), tid=3 + i)
        for i in range(feeders)
    ]
    log = [py("emit", 1239, HANDLERS)] if busy_log else [py("dequeue", 1517, HANDLERS)]
    threads.append(
        helper(f"Thread-{counter + 1} (_monitor)", py("_monitor", 1573, HANDLERS), *log, tid=9)
    )
    threads.append(
        helper(
            f"Thread-{counter + 2} (channel_spin)",
            py("channel_spin", 1925, GRPC),
            native("epoll_wait"),
            tid=10,
        )
    )
    return rank_dump(rank, world, *threads)


def test_thread_names_differing_by_a_counter_fold() -> None:
    assert thread_label("Thread-9 (_monitor)") == thread_label("Thread-10 (_monitor)")
    assert thread_label("Thread-9 (_monitor)") == "Thread-N (_monitor)"
    assert thread_label("MainThread") == "MainThread"


def test_roles_come_from_stack_content_not_names() -> None:
    d = ordinary(0, 1)
    # a helper named like the main thread elsewhere is still a helper, by its frames
    renamed = RankDump(
        **{
            **d.__dict__,
            "threads": tuple(
                ThreadStack(t.tid, t.os_tid, "Thread-99" if i else t.name, t.frames)
                for i, t in enumerate(d.threads)
            ),
        }
    )
    for dump in (d, renamed):
        py_roles, _ = dump_roles(dump)
        assert py_roles.roles == (
            Role.TRAINING,
            Role.DATA_LOADER,
            Role.QUEUE_FEEDER,
            Role.QUEUE_FEEDER,
            Role.LOGGING,
            Role.RPC,
        )


def test_the_thread_in_a_collective_trains_even_when_it_is_not_the_main_one() -> None:
    main = thread([py("<module>", 9), py("join", 1100, THREADING), native("futex_wait")])
    worker = helper("Thread-1 (train)", py("train", 40), py("all_reduce", 2940, C10D), tid=7)
    roles, _ = dump_roles(rank_dump(0, 1, main, worker))
    assert roles.roles == (Role.OTHER, Role.TRAINING)


def test_native_only_threads_take_roles_from_their_frames() -> None:
    libnccl, libgomp = "/usr/lib/libnccl.so.2", "/usr/lib/libgomp.so.1"
    gdb = [
        thread([native("clone3"), native("ncclProxyProgress(void*)", libnccl)], "python", 11),
        thread([native("clone3"), native("gomp_thread_start", libgomp)], "python", 12),
        thread(
            [
                native("_start"),
                native("Py_BytesMain"),
                native("_PyEval_EvalFrameDefault"),
                native("c10d::ProcessGroupNCCL::WorkNCCL::wait(long)"),
            ],
            "pt_main_thread",
            13,
        ),
        thread(
            [native("clone3"), native("c10d::ProcessGroupNCCL::ncclCommWatchdog()")], "python", 14
        ),
    ]
    d = RankDump(rank=0, world_size=1, pid=13, native_threads=tuple(gdb))
    _, roles = dump_roles(d)
    assert roles.roles == (Role.COMM, Role.RUNTIME, Role.TRAINING, Role.COMM)


def test_helper_differences_make_no_suspect_and_helpers_are_drawn_by_role() -> None:
    world = 40
    dumps = []
    for r in range(world):
        dumps.append(
            ordinary(
                r,
                world,
                counter=9 if r % 7 == 0 else 10 if r == 3 else 4,  # Thread-9/Thread-10/Thread-4
                feeders=3 if r == 5 else 2,  # one more queue feeder on one rank
                busy_log=r == 11,  # a logger caught flushing
            )
        )
    for view in View:
        tree = build_tree(dumps, view, world)
        vc = equivalence_classes(tree)
        assert len(vc.classes) == 1, [c.ranks for c in vc.classes]
        texts = [i.text for i in tree.info]
        # one node per role, helpers folded under counter-free names
        for role in ("training", "data loader", "queue feeder", "logging", "rpc"):
            assert texts.count(f"Role@{role}") == 1
        assert texts.count("Thread@Thread-N (_monitor)") == 1
    views = [equivalence_classes(build_tree(dumps, v, world)) for v in View]
    assert suspects(views, ()) == ()


def test_an_odd_training_thread_stands_out_among_noisy_helpers() -> None:
    world = 40
    dumps = [ordinary(r, world, counter=4 + r % 3, feeders=2 + (r == 9)) for r in range(world)]
    odd = dumps[17]
    dumps[17] = RankDump(
        **{
            **odd.__dict__,
            "threads": (
                thread(common(py("load_checkpoint", 12), native("read")), tid=1017),
                *odd.threads[1:],
            ),
        }
    )
    views = [equivalence_classes(build_tree(dumps, v, world)) for v in View]
    found = suspects(views, ())
    assert [s.rank for s in found] == [17]


def test_generated_rank_threads_get_the_roles_they_were_made_with(tmp_path) -> None:
    truth = gen.plan_incident(
        16, seed=4, odd=0, corrupt=0, timed_out=0, missing_nodes=0, missing_ranks=0
    )
    plan = gen.rank_plan(truth, 3)
    rt = gen.rank_threads(plan, random.Random(plan.seed))
    gen.write_incident(tmp_path, truth)
    d = RankDump.load(tmp_path / "00003-00016.stack.json")
    py_roles, native_roles = dump_roles(d)
    made = [m.role for m, _, _ in rt.threads]
    expect = {
        "training": Role.TRAINING,
        "pin_memory": Role.DATA_LOADER,
        "queue_feeder": Role.QUEUE_FEEDER,
        "logger": Role.LOGGING,
        "rpc": Role.RPC,
        "diag": Role.DIAG,
        "other": Role.OTHER,
        "nccl_proxy": Role.COMM,
        "nccl_watchdog": Role.COMM,
        "cuda": Role.RUNTIME,
        "openmp": Role.RUNTIME,
        "blas": Role.RUNTIME,
        "intraop_pool": Role.RUNTIME,
        "autograd": Role.RUNTIME,
        "grpc_core": Role.RPC,
    }
    py_made = [m.role for m, _, _ in rt.threads if m.py]
    assert list(py_roles.roles) == [expect[r] for r in py_made]
    assert list(native_roles.roles) == [expect[r] for r in made]


def test_journal_tails_name_the_issuer_of_the_last_op_and_diag_threads() -> None:
    doc = {
        "records": [
            {"seq": 7, "kind": "op", "tid": 101},
            {"seq": 9, "kind": "op", "tid": 103},
            {"seq": 8, "kind": "op", "tid": 102},
            {"seq": 10, "kind": "step", "tid": 100},  # steps and marks issue no op
            {"seq": 11, "kind": "op", "tid": None},  # a record of a journal of version 1
        ],
        "meta": {"own_threads": [105, 0]},
    }
    assert journal_threads(doc) == JournalThreads(103, frozenset({105}))
    # an error document, or a tail from before threads were recorded, says nothing
    assert journal_threads({"journal": "/x", "error": "bad magic"}) is None
    assert journal_threads({"records": [{"seq": 1, "kind": "op"}], "meta": {}}) is None
    assert journal_threads([]) is None


def test_the_journal_overrules_what_stacks_alone_would_say() -> None:
    """A training loop in a worker thread, writing a checkpoint (in no collective) while the main
    thread joins it; the gRPC poller of diag's control channel runs grpc's frames only."""
    main = thread([py("<module>", 9), py("join", 1100, THREADING), native("futex_wait")], tid=100)
    worker = helper("Thread-1 (train)", py("train", 40), py("save_checkpoint", 12), tid=101)
    spin = helper("Thread-2 (channel_spin)", py("channel_spin", 1925, GRPC), tid=102)
    d = rank_dump(0, 1, main, worker, spin)
    assert dump_roles(d)[0].roles == (Role.TRAINING, Role.OTHER, Role.RPC)
    cache = RoleCache({0: JournalThreads(issuer=101, own=frozenset({102}))})
    assert dump_roles(d, cache)[0].roles == (Role.OTHER, Role.TRAINING, Role.DIAG)
    # another rank's journal says nothing about this one
    assert dump_roles(d, RoleCache({1: JournalThreads(101, frozenset())}))[0].roles[0] is (
        Role.TRAINING
    )
