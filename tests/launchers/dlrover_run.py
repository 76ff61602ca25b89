"""Runs `dlrover-run` on torch 2.13: DLRover 0.6.1 builds torch's SubprocessHandler without the
`numa_options` argument that torch 2.13 added, so default it to None before handing over."""

import sys

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

_init = subprocess_handler.SubprocessHandler.__init__


def _init_with_default_numa(self, *args, **kwargs):
    if len(args) < 7 and "numa_options" not in kwargs:
        kwargs["numa_options"] = None
    return _init(self, *args, **kwargs)


subprocess_handler.SubprocessHandler.__init__ = _init_with_default_numa

from dlrover.trainer.torch.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
