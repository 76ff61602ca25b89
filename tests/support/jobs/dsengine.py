"""The small DeepSpeed engine every CPU job script of the tests trains: an MLP (hidden ->
`widen` x hidden -> hidden) under ZeRO with torch's Adam, written once.

Call `no_jit_ops()` before the process group is made: DeepSpeed would otherwise build its shared
memory communication op with a compiler at start-up. Seed torch before `tiny_engine` (the model's
initial weights come from it)."""

from __future__ import annotations

from typing import Any

import deepspeed
import torch


def no_jit_ops() -> None:
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build in tests


def tiny_config(
    zero: int = 2, *, lr: float = 1e-2, micro_batch: int = 4, **extra: Any
) -> dict[str, Any]:
    """The jobs' DeepSpeed config; `extra` keys (bf16, fp16, elasticity) are added as given."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**9,
        **extra,
    }


def tiny_model(hidden: int, widen: int = 2) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, widen * hidden),
        torch.nn.GELU(),
        torch.nn.Linear(widen * hidden, hidden),
    )


def tiny_engine(hidden: int, config: dict[str, Any], *, widen: int = 2) -> Any:
    """A DeepSpeed engine of `tiny_model` on the process group already made."""
    model = tiny_model(hidden, widen)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    return engine
