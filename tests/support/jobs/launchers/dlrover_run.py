"""Runs `dlrover-run` on torch 2.13: DLRover 0.6.1 builds torch's SubprocessHandler without the
`numa_options` argument that torch 2.13 added, so default it to None before handing over.

dlrover-run keeps its local sockets under /tmp/ckpt_sock/<job name> whatever TMPDIR says, and
never removes them; the job is named here (as the ElasticJob operator names it in a pod) so
that the directory can be removed when the launcher ends."""

import contextlib
import os
import shutil
import sys

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

_init = subprocess_handler.SubprocessHandler.__init__


def _init_with_default_numa(self, *args, **kwargs):
    if len(args) < 7 and "numa_options" not in kwargs:
        kwargs["numa_options"] = None
    return _init(self, *args, **kwargs)


subprocess_handler.SubprocessHandler.__init__ = _init_with_default_numa

from dlrover.python.common.multi_process import SOCKET_TMP_DIR  # noqa: E402
from dlrover.trainer.torch.main import main  # noqa: E402

if __name__ == "__main__":
    job = os.environ.setdefault("ELASTIC_JOB_NAME", f"diag-test-{os.getpid()}")
    try:
        rc = main()
    finally:
        shutil.rmtree(os.path.join(SOCKET_TMP_DIR, job), ignore_errors=True)
        with contextlib.suppress(OSError):  # only when no other job's sockets are left in it
            os.rmdir(SOCKET_TMP_DIR)
    sys.exit(rc)
