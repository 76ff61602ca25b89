"""What one attempt of the training function leaves in the process, and its removal before the
next: the flash checkpointers (closed, their snapshots kept for the next attempt's `load`), their
engines (destroyed: DeepSpeed's hooks keep an engine alive otherwise), and DeepSpeed's
module-level state (the process groups it cached, ZeRO 3's forward stack)."""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import traceback
from typing import Any

from diag.trainer.flash import live

log = logging.getLogger(__name__)

# deepspeed.utils.groups caches the groups it made, keyed by name or size: a new generation
# must make them again. Dicts are emptied, single groups and the mpu forgotten.
_DEEPSPEED_GROUP_DICTS = (
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    "_ALL_TO_ALL_GROUP",
)
_DEEPSPEED_GROUPS = (
    "_WORLD_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "mpu",
    "mesh_device",
)


def end_attempt(error: BaseException | None = None) -> list[Any]:
    """Releases what the failed attempt held; returns its engines, for `destroy_engines` once
    the next generation is formed (DeepSpeed's `destroy` asks the group for this rank)."""
    if error is not None:  # its frames hold the attempt's engine until the error is gone
        traceback.clear_frames(error.__traceback__)
    engines = live.engines()
    try:
        live.close_all()
    except Exception as e:  # its slots stay on the node; the next attempt adopts them
        log.warning("diag: closing a failed attempt's flash checkpointer: %s", e)
    return engines


def destroy_engines(engines: list[Any]) -> None:
    """DeepSpeed's gradient hooks reach an engine through autograd's C++ nodes, a cycle the
    garbage collector cannot see: without `destroy` every attempt's engine would stay."""
    if not engines:
        return
    for engine in engines:
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):
            try:
                destroy()
            except Exception as e:
                log.warning("diag: destroying a failed attempt's engine: %s", e)
    engines.clear()
    gc.collect()  # the engine, its optimizer and its groups are in reference cycles


def forget_deepspeed_state() -> None:
    """Before each generation forms (and each run of the wrapper): DeepSpeed made its cached
    groups from the world before, and ZeRO 3's stack of the modules in a forward pass still
    holds the modules a fault interrupted (their post-forward hooks never ran): the old engine."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack.clear()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in _DEEPSPEED_GROUP_DICTS:
        d = getattr(groups, name, None)
        if isinstance(d, dict):
            d.clear()
    for name in _DEEPSPEED_GROUPS:
        if hasattr(groups, name):
            with contextlib.suppress(Exception):
                setattr(groups, name, None)
