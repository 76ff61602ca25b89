"""Elastic batch sizes: one global batch that stays the same at every allowed world size.

DeepSpeed computed this from an `elasticity` block of its config until 0.19.8, which removed the
feature (a config that still has the block is rejected). This module answers the same questions
with the same rules, for config versions 0.1 and 0.2, and writes the answer into the config as
the three plain batch keys before `deepspeed.initialize`:

    ds_config, plan = diag.trainer.elastic.batchsize.apply_elastic(ds_config)   # world size from the env
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, ...)
    # plan.train_batch_size == plan.micro_batch_size * plan.gradient_accumulation_steps * ranks

`solve` is the pure core (an `ElasticSettings` and a world size in, an `ElasticPlan` out); the
batch search lives in `diag.trainer.elastic.search`. `python -m diag.trainer.elastic.batchsize CONFIG`
prints the global batch and the valid world sizes (what a scheduler needs to pick node counts).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diag.trainer.elastic.search import SearchError, best_batch_v01, best_batch_v02, micro_batch_for

log = logging.getLogger(__name__)

BLOCK = "elasticity"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# What the resource scheduler saw, as DeepSpeed's launcher and DLRover export it.
SCHEDULER_ENV = "DEEPSPEED_ELASTICITY_CONFIG"
VERSIONS = (0.1, 0.2)


class ElasticError(ValueError):
    """Base of the errors of this module."""


class ElasticSettingsError(ElasticError):
    """The `elasticity` block is malformed or cannot work."""


class IncompatibleWorldSize(ElasticError):
    """The world size is not one the elastic config allows."""

    def __init__(self, world_size: int, valid: tuple[int, ...], batch: int) -> None:
        self.world_size = world_size
        self.valid = valid
        self.train_batch_size = batch
        if valid:
            listed = ", ".join(map(str, valid))
            what = f"the valid world sizes for a global batch of {batch} are: {listed}"
        else:
            what = "this elastic config allows no world size at all (widen min_gpus/max_gpus)"
        super().__init__(
            f"world size {world_size} is incompatible with the elastic config: {what}. "
            "Restart with one of them, or change max_train_batch_size / micro_batch_sizes."
        )


@dataclass(frozen=True)
class ElasticSettings:
    """The `elasticity` block (DeepSpeed's keys and defaults)."""

    max_train_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    min_gpus: int = 1
    max_gpus: int = 10000
    min_time: int = 0  # minutes before a scheduler may rescale; carried, not used here
    prefer_larger_batch: bool = True
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1
    ignore_non_elastic_batch_info: bool = False
    version: float = 0.2

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> ElasticSettings:
        if not isinstance(block, Mapping):
            raise ElasticSettingsError(
                f"'{BLOCK}' must be a JSON object, not {type(block).__name__}"
            )
        known = {f for f in cls.__dataclass_fields__} | {"enabled"}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ElasticSettingsError(
                f"unknown key(s) in '{BLOCK}': {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if key not in block:
                raise ElasticSettingsError(f"'{BLOCK}' needs '{key}'")
        micro = block["micro_batch_sizes"]
        if not isinstance(micro, list | tuple) or not micro:
            raise ElasticSettingsError(
                f"'{BLOCK}.micro_batch_sizes' must be a non-empty list of positive integers, got {micro!r}"
            )
        if not all(_is_int(m) and m > 0 for m in micro):
            raise ElasticSettingsError(
                f"'{BLOCK}.micro_batch_sizes' must hold positive integers only, got {list(micro)!r}"
            )
        cfg = cls(
            max_train_batch_size=_int(block, "max_train_batch_size", 1),
            micro_batch_sizes=tuple(micro),
            min_gpus=_int(block, "min_gpus", 1, cls.min_gpus),
            max_gpus=_int(block, "max_gpus", 1, cls.max_gpus),
            min_time=_int(block, "min_time", 0, cls.min_time),
            prefer_larger_batch=_bool(block, "prefer_larger_batch", cls.prefer_larger_batch),
            num_gpus_per_node=_int(block, "num_gpus_per_node", 1, cls.num_gpus_per_node),
            model_parallel_size=_int(block, "model_parallel_size", 1, cls.model_parallel_size),
            ignore_non_elastic_batch_info=_bool(
                block, "ignore_non_elastic_batch_info", cls.ignore_non_elastic_batch_info
            ),
            version=_version(block.get("version", cls.version)),
        )
        if cfg.max_gpus < cfg.min_gpus:
            raise ElasticSettingsError(
                f"'{BLOCK}.min_gpus' ({cfg.min_gpus}) is larger than max_gpus ({cfg.max_gpus})"
            )
        if cfg.model_parallel_size > 1 and cfg.version != 0.2:
            raise ElasticSettingsError(
                f"elastic config version {cfg.version} does not support model parallelism "
                f"(model_parallel_size {cfg.model_parallel_size}); use version 0.2"
            )
        if cfg.version == 0.2 and cfg.num_gpus_per_node % cfg.model_parallel_size:
            raise ElasticSettingsError(
                f"num_gpus_per_node ({cfg.num_gpus_per_node}) must be divisible by "
                f"model_parallel_size ({cfg.model_parallel_size}) in version 0.2"
            )
        if max(cfg.micro_batch_sizes) > cfg.max_train_batch_size:
            raise ElasticSettingsError(
                f"every micro batch size must be at most max_train_batch_size "
                f"({cfg.max_train_batch_size}); got {list(cfg.micro_batch_sizes)}"
            )
        return cfg


@dataclass(frozen=True)
class ElasticBatch:
    """DeepSpeed's answer: the global batch and the world sizes that keep it."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]


@dataclass(frozen=True)
class ElasticPlan:
    """The batch settings for one world size."""

    world_size: int  # data-parallel ranks, as DeepSpeed counted them
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    valid_world_sizes: tuple[int, ...]
    version: float
    # False only in version 0.2 at a world size outside its list: DeepSpeed then picks a global
    # batch for that size instead of refusing it, so the global batch changes.
    batch_kept: bool = True

    def as_config(self) -> dict[str, int]:
        return {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }


def elastic_batch(cfg: ElasticSettings, world_size: int | None = None) -> ElasticBatch:
    """The global batch and the valid world sizes. Version 0.2 depends on the world size (it
    works at node granularity and adapts to a size outside its list); 0.1 does not."""
    if cfg.version == 0.1:
        try:
            batch, sizes = best_batch_v01(
                cfg.micro_batch_sizes, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus,
                cfg.prefer_larger_batch,
            )  # fmt: skip
        except SearchError as e:
            raise ElasticSettingsError(str(e)) from e
        return ElasticBatch(batch, sizes or ())
    if world_size is None or world_size <= 0:
        raise ElasticSettingsError("elastic config version 0.2 needs the world size")
    batch, sizes, _ = _search_v02(cfg, world_size)
    return ElasticBatch(batch, sizes)


def _search_v02(cfg: ElasticSettings, world_size: int) -> tuple[int, tuple[int, ...], bool]:
    try:
        return best_batch_v02(
            cfg.micro_batch_sizes, cfg.max_train_batch_size, world_size, cfg.min_gpus,
            cfg.max_gpus, cfg.prefer_larger_batch, cfg.num_gpus_per_node,
            cfg.model_parallel_size,
        )  # fmt: skip
    except SearchError as e:
        raise ElasticSettingsError(str(e)) from e


def solve(cfg: ElasticSettings, world_size: int) -> ElasticPlan:
    """The plan for `world_size` data-parallel ranks, or IncompatibleWorldSize."""
    if world_size <= 0:
        raise ElasticError(f"world size must be positive, got {world_size}")
    kept = True
    if cfg.version == 0.1:
        found = elastic_batch(cfg)
    else:
        batch, sizes, kept = _search_v02(cfg, world_size)
        found = ElasticBatch(batch, sizes)
    if world_size not in found.valid_world_sizes:
        raise IncompatibleWorldSize(world_size, found.valid_world_sizes, found.train_batch_size)
    micro = micro_batch_for(found.train_batch_size, world_size, cfg.micro_batch_sizes)
    if micro is None or found.train_batch_size <= 0:
        raise ElasticSettingsError(
            f"no micro batch size in {list(cfg.micro_batch_sizes)} divides the per-rank share of "
            f"the global batch {found.train_batch_size} at world size {world_size}"
        )
    gas = found.train_batch_size // (micro * world_size)
    if gas < 1 or micro * gas * world_size != found.train_batch_size:
        raise ElasticSettingsError(
            f"the global batch {found.train_batch_size} cannot be split into micro batches of "
            f"{micro} over {world_size} ranks"
        )
    return ElasticPlan(
        world_size=world_size,
        train_batch_size=found.train_batch_size,
        micro_batch_size=micro,
        gradient_accumulation_steps=gas,
        valid_world_sizes=found.valid_world_sizes,
        version=cfg.version,
        batch_kept=kept,
    )


def apply_elastic(
    ds_config: Mapping[str, Any], world_size: int | None = None
) -> tuple[dict[str, Any], ElasticPlan | None]:
    """A copy of `ds_config` with the `elasticity` block resolved into `train_batch_size`,
    `train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` (and removed: DeepSpeed
    0.19.8 rejects it), and the plan. Without an enabled block: the copy less the block, None.

    `world_size` is the data-parallel size, as DeepSpeed passed it (with model parallelism, the
    number of ranks over the model-parallel size); by default torch.distributed's world size, else
    WORLD_SIZE from the launcher. The caller's dict is never modified."""
    if not isinstance(ds_config, Mapping):
        raise ElasticSettingsError(
            f"the DeepSpeed config must be a dict, not {type(ds_config).__name__}"
        )
    out = copy.deepcopy(dict(ds_config))
    block = out.pop(BLOCK, None)
    if block is None:
        return out, None
    if not isinstance(block, Mapping):
        raise ElasticSettingsError(f"'{BLOCK}' must be a JSON object, not {type(block).__name__}")
    if not _bool(block, "enabled", False):
        return out, None
    cfg = ElasticSettings.from_dict(block)
    check_scheduler_view(cfg, os.environ)
    if not cfg.ignore_non_elastic_batch_info:
        given = [k for k in BATCH_KEYS if k in out and out[k] != "auto"]
        if given:
            raise ElasticSettingsError(
                f"the config sets {', '.join(given)} next to an enabled '{BLOCK}' block, which "
                "decides them: remove them, or set 'ignore_non_elastic_batch_info': true in the "
                "block to have them overridden"
            )
    plan = solve(cfg, world_size if world_size is not None else default_world_size())
    if not plan.batch_kept:
        log.warning(
            "diag: world size %d is outside the elastic config's list; version 0.2 uses a global "
            "batch of %d for it (the global batch changes)", plan.world_size, plan.train_batch_size,
        )  # fmt: skip
    for key, value in plan.as_config().items():
        if key in out and out[key] not in ("auto", value):
            log.info("diag: elastic config overrides %s: %s -> %s", key, out[key], value)
    out.update(plan.as_config())
    return out, plan


def check_scheduler_view(cfg: ElasticSettings, env: Mapping[str, str]) -> None:
    """The scheduler chose the world size from the config it was given (DEEPSPEED_ELASTICITY_CONFIG):
    the one the trainer runs with must agree on what decides the batch."""
    raw = env.get(SCHEDULER_ENV)
    if not raw:
        return
    try:
        seen = ElasticSettings.from_dict(json.loads(raw))
    except (json.JSONDecodeError, ElasticError) as e:
        raise ElasticSettingsError(
            f"{SCHEDULER_ENV} does not hold a valid elastic config: {e}"
        ) from e
    for name in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(seen, name) != getattr(cfg, name):
            raise ElasticSettingsError(
                f"the scheduler's elastic config ({SCHEDULER_ENV}) has {name}="
                f"{getattr(seen, name)!r}, the trainer's has {getattr(cfg, name)!r}: they must agree"
            )


def default_world_size() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except ImportError:
        pass
    raw = os.environ.get("WORLD_SIZE", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    raise ElasticError(
        "cannot tell the world size: initialize torch.distributed, run under a launcher that sets "
        "WORLD_SIZE, or pass world_size"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(block: Mapping[str, Any], key: str, least: int, default: int | None = None) -> int:
    value = block.get(key, default)
    if not _is_int(value) or value < least:
        raise ElasticSettingsError(f"'{BLOCK}.{key}' must be an integer >= {least}, got {value!r}")
    return value


def _bool(block: Mapping[str, Any], key: str, default: bool) -> bool:
    value = block.get(key, default)
    if not isinstance(value, bool):
        raise ElasticSettingsError(f"'{BLOCK}.{key}' must be true or false, got {value!r}")
    return value


def _version(value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = -1.0
    if v not in VERSIONS or isinstance(value, bool):
        raise ElasticSettingsError(
            f"'{BLOCK}.version' must be one of {', '.join(map(str, VERSIONS))}, got {value!r}"
        )
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m diag.trainer.elastic.batchsize",
        description="Global batch and valid world sizes of a DeepSpeed config's elasticity block.",
    )
    p.add_argument("config", help="DeepSpeed config JSON file")
    p.add_argument("--world-size", type=int, help="also the micro batch and accumulation for it")
    args = p.parse_args(argv)
    try:
        with open(args.config) as f:
            ds_config = json.load(f)
        block = ds_config.get(BLOCK) if isinstance(ds_config, dict) else None
        if not isinstance(block, dict):
            raise ElasticSettingsError(f"{args.config} has no '{BLOCK}' block")
        cfg = ElasticSettings.from_dict(block)
        if args.world_size is None:
            found = elastic_batch(cfg)
            print(json.dumps({"train_batch_size": found.train_batch_size,
                              "valid_world_sizes": list(found.valid_world_sizes)}))  # fmt: skip
            return 0
        plan = solve(cfg, args.world_size)
    except (OSError, json.JSONDecodeError, ElasticError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = {**plan.as_config(), "world_size": plan.world_size,
           "valid_world_sizes": list(plan.valid_world_sizes), "batch_kept": plan.batch_kept}  # fmt: skip
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
