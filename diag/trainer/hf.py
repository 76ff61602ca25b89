"""HuggingFace Trainer callbacks, named as ms-swift names them:

    from diag.trainer.hf import deepspeed_elastic, graceful_exit

    args = TrainingArguments(..., deepspeed=ds_config)        # ds_config has an `elasticity` block
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[graceful_exit(), deepspeed_elastic(args)])
    trainer.train(resume_from_checkpoint=last_checkpoint)     # at any valid world size

- `deepspeed_elastic(args)` resolves the DeepSpeed config's `elasticity` block for this world
  size (diag.trainer.elastic.batchsize) into the batch settings of the arguments and of the DeepSpeed
  config, before the Trainer reads them, and makes `resume_from_checkpoint` load a checkpoint saved
  at another data-parallel size through DeepSpeed's universal checkpoint (diag.trainer.elastic.reshard).
- `graceful_exit()` turns SIGTERM, SIGINT, SIGUSR1, SIGUSR2 and the stop file into a stop
  request (diag.trainer.graceful.stopflag); at step ends the ranks agree on it (one small all-reduce over a
  CPU group, as often as diag.trainer.control.period allows), save a checkpoint at that same step, and
  stop training. At the end of `train()` the process then leaves with the drain exit code (143,
  DIAG_DRAIN_EXIT_CODE), so that torchrun, dlrover-run and the deepspeed launcher restart it
  rather than report a job that stopped half-way as a success (ms-swift's `--callbacks
  graceful_exit` leaves the user no line to add that). `graceful_exit(exit=False)` makes
  `train()` return instead; `stopped_at` then says which step was saved.

With ms-swift: `swift.plugin.callbacks_map.update(diag.trainer.hf.callbacks_map)`; it builds them
as `Callback(args, trainer)`, which both accept.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from transformers import TrainerCallback

from diag.formats.rundir import default_run_dir
from diag.trainer.control.commands import Agreement, agree, command_group
from diag.trainer.control.period import AgreementPeriod
from diag.trainer.elastic import reshard
from diag.trainer.elastic.batchsize import ElasticPlan, ElasticSettingsError, apply_elastic
from diag.trainer.graceful.stopflag import (
    DRAIN_SIGNALS,
    StopFlag,
    StopFlagSettings,
    StopRequest,
    consume_stop_file,
    stop_file_present,
    stop_flag,
)
from diag.trainer.graceful.teardown import quiesce_at_exit

log = logging.getLogger(__name__)


class GracefulExitCallback(TrainerCallback):
    def __init__(
        self,
        args: Any = None,
        trainer: Any = None,
        *,
        signals: tuple[Any, ...] = DRAIN_SIGNALS,
        every: int | None = None,
        stop_file: str | None = None,
        max_latency_s: float | None = None,
        flag: StopFlag | None = None,
        exit: bool = True,
        exit_code: int | None = None,
    ) -> None:
        quiesce_at_exit()
        self.flag = flag or stop_flag()
        self.config = StopFlagSettings.resolve(
            stop_file=stop_file, every=every, max_latency_s=max_latency_s,
            exit_code=exit_code, run_dir=default_run_dir(),
        )  # fmt: skip
        self.exit = exit
        self.period = AgreementPeriod(self.config.period)
        self.flag.install(signals)
        self._file_seen = False
        self.stopped_at: int | None = None  # the step saved and stopped at
        self._group: Any = None
        self._world = 1
        self._pending = False

    @property
    def requested(self) -> StopRequest | None:
        """This rank's own stop request (None when the stop came from another rank's)."""
        return self.flag.requested

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self._world = dist.get_world_size()
            self._group = command_group(dist)  # collective: every rank begins training
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self.period.boundary(state.global_step, time.monotonic()):
            return control
        if not self.flag.is_set() and stop_file_present(self.config.stop_file):
            self._file_seen = True
            self.flag.request(f"stop file {self.config.stop_file}")
        local = Agreement(False, self.flag.is_set(), 0, every=self.period.proposal())
        t0 = time.perf_counter()
        agreed = agree(local, self._group, self._world)
        self.period.agreed(state.global_step, agreed.every, time.perf_counter() - t0)
        if agreed.exit and not self._pending:
            why = self.flag.requested.reason if self.flag.requested else "another rank's request"
            log.warning("diag: stopping after step %d (%s): saving first", state.global_step, why)
            self._pending = True
            control.should_save = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._pending:
            self._pending = False
            self.stopped_at = state.global_step
            if self._file_seen:
                consume_stop_file(self.config.stop_file)
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.stopped_at is not None and self.exit:
            # SystemExit rather than os._exit: the Trainer's and the user's clean-up (atexit,
            # finally blocks, loggers) still run; the checkpoint is on storage already.
            log.warning(
                "diag: training stopped at step %d on a stop request; leaving with %d so that "
                "the launcher restarts it", self.stopped_at, self.config.exit_code,
            )  # fmt: skip
            raise SystemExit(self.config.exit_code)
        return control


class DeepspeedElasticCallback(TrainerCallback):
    def __init__(self, args: Any = None, trainer: Any = None) -> None:
        if trainer is not None:
            args = trainer.args
        if args is None:
            raise TypeError(
                "deepspeed_elastic needs the TrainingArguments, before the Trainer is built: "
                "Trainer(..., args=args, callbacks=[deepspeed_elastic(args)])"
            )
        quiesce_at_exit()
        self.plan = apply_to_arguments(args)
        if trainer is not None:  # built after the Trainer (ms-swift): it cached the batch size
            trainer._train_batch_size = args.train_batch_size
        reshard.install_load_hook()


def apply_to_arguments(args: Any) -> ElasticPlan | None:
    """Writes the elastic plan for this world size into the TrainingArguments and the DeepSpeed
    config the Trainer will hand to deepspeed.initialize (the same dict accelerate holds)."""
    if not getattr(args, "deepspeed", None):
        raise ElasticSettingsError(
            "deepspeed_elastic needs a DeepSpeed config: TrainingArguments(deepspeed=...)"
        )
    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is None:
        raise ElasticSettingsError("the TrainingArguments hold no processed DeepSpeed config")
    # Whether the user set batch keys is judged on their config as written ("auto" is unset):
    # the processed one has them all filled in.
    written = args.deepspeed
    if isinstance(written, str):
        with open(written) as f:
            written = json.load(f)
    _, plan = apply_elastic(written, world_size=args.world_size)
    config = hf_config.config
    config.pop("elasticity", None)  # DeepSpeed 0.19.8 rejects the block
    if plan is None:
        return None
    config.update(plan.as_config())
    args.per_device_train_batch_size = plan.micro_batch_size
    args.gradient_accumulation_steps = plan.gradient_accumulation_steps
    log.info(
        "diag: elastic batch at %d ranks: global %d = micro %d x accumulation %d x ranks",
        plan.world_size, plan.train_batch_size, plan.micro_batch_size,
        plan.gradient_accumulation_steps,
    )  # fmt: skip
    return plan


def graceful_exit(args: Any = None, trainer: Any = None, **kwargs: Any) -> GracefulExitCallback:
    return GracefulExitCallback(args, trainer, **kwargs)


def deepspeed_elastic(args: Any = None, trainer: Any = None) -> DeepspeedElasticCallback:
    return DeepspeedElasticCallback(args, trainer)


callbacks_map = {
    "graceful_exit": GracefulExitCallback,
    "deepspeed_elastic": DeepspeedElasticCallback,
}
