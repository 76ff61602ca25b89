"""A control-channel server that is not the node's agent: it serves a socket as another user
(`--uid`) and sends every rank that subscribes FLUSH, EXIT and DUMP at once. It prints `ready`
when it listens and one line per call it gets (`register`, `subscribe`, `report <id> <ok>`).

    python tests/support/peers/fake_control_agent.py SOCKET --uid 65534 --dump-dir DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from concurrent import futures
from concurrent.futures import thread as _thread  # noqa: F401  (imported before dropping root)

import grpc

from diag.proto import control_pb2 as pb
from diag.proto import control_pb2_grpc as pb_grpc


def say(line: str) -> None:
    print(line, flush=True)


class Impostor(pb_grpc.ControlServicer):
    def __init__(self, dump_dir: str) -> None:
        self.dump_dir = dump_dir

    def Register(self, request, context):
        say("register")
        return pb.RegisterReply(agent_pid=os.getpid(), agent_version="impostor")

    def Subscribe(self, request, context):
        say("subscribe")
        kinds = (pb.COMMAND_KIND_FLUSH, pb.COMMAND_KIND_EXIT, pb.COMMAND_KIND_DUMP)
        for n, kind in enumerate(kinds):
            yield pb.AgentMessage(
                command=pb.Command(id=f"x{n}", kind=kind, dump_dir=self.dump_dir, exit_code=0)
            )
        threading.Event().wait(60)

    def Persist(self, request, context):
        return pb.PersistReply(accepted=True)

    def Report(self, request, context):
        say(f"report {request.command_id} {request.ok}")
        return pb.ReportReply()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("--uid", type=int, required=True)
    ap.add_argument("--dump-dir", default="/tmp")
    args = ap.parse_args()
    os.setgroups([])
    os.setgid(args.uid)
    os.setuid(args.uid)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ControlServicer_to_server(Impostor(args.dump_dir), server)
    if server.add_insecure_port(f"unix:{args.socket}") == 0:
        sys.exit(f"cannot serve {args.socket}")
    server.start()
    say("ready")
    sys.stdin.read()  # until the test closes our stdin
    server.stop(0)


if __name__ == "__main__":
    main()
