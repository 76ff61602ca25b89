"""The HuggingFace Trainer job of the callback tests: a tiny GPT-2 built from a config (nothing is
downloaded) trained by a real `transformers.Trainer` with DeepSpeed ZeRO-2 on CPU, an elastic
config, and diag's two callbacks added in one line, as a user would.

    torchrun --nproc-per-node 2 tests/support/jobs/hf_job.py --out O [--max-steps N] [--resume CKPT]

Rank 0 appends each step's logged loss to O/loss.jsonl; every rank writes the step it finished
and its pid to O/progress-<rank> (so a test knows when and where to send a signal) and, at the end, O/result-<rank>.json
(the step it stopped at, its own stop request, the batch settings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ELASTIC = {
    "enabled": True,
    "max_train_batch_size": 12,
    "micro_batch_sizes": [2, 3],
    "max_gpus": 8,
    "version": 0.1,
}
SEQ = 16
VOCAB = 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=10_000)
    p.add_argument("--resume", default=None)
    p.add_argument("--zero", type=int, default=2)
    a = p.parse_args(argv)

    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build in tests
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from diag.trainer.hf import deepspeed_elastic, graceful_exit

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))

    class Data(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(5)
            self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            doc = {"step": state.global_step, "pid": os.getpid()}
            (out / f"progress-{rank}").write_text(json.dumps(doc))

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if state.is_world_process_zero and logs and "loss" in logs:
                with open(out / "loss.jsonl", "a") as f:
                    f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")

    ds_config = {
        "elasticity": ELASTIC,
        "zero_optimization": {"stage": a.zero},
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "steps_per_print": 10**9,
    }
    args = TrainingArguments(
        output_dir=str(out / "run"),
        max_steps=a.max_steps,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="no",  # only graceful_exit saves
        logging_steps=1,
        report_to=[],
        deepspeed=ds_config,
        seed=3,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    torch.manual_seed(3)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
    )  # fmt: skip
    stop = graceful_exit()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Data(5000),
        callbacks=[stop, deepspeed_elastic(args), Record()],
    )
    try:
        trainer.train(resume_from_checkpoint=a.resume)
    finally:  # graceful_exit leaves train() with SystemExit(143) after a stop
        engine = trainer.model_wrapped
        request = stop.requested
        (out / f"result-{rank}.json").write_text(
            json.dumps(
                {
                    "global_step": trainer.state.global_step,
                    "stopped_at": stop.stopped_at,
                    "requested": request.reason if request else None,
                    "world_size": args.world_size,
                    "train_batch_size": engine.train_batch_size(),
                    "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                    "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
