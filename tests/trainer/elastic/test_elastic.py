"""diag.trainer.elastic.batchsize: DeepSpeed's elastic batch rules, checked against DeepSpeed 0.19.7's own
`compute_elastic_config` (run for real, from the isolated install bootstrap makes), and applied to
a config that DeepSpeed 0.19.8 accepts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from repo import SUPPORT

from diag.trainer.elastic.batchsize import (
    ElasticError,
    ElasticSettings,
    ElasticSettingsError,
    IncompatibleWorldSize,
    apply_elastic,
    elastic_batch,
    solve,
)
from diag.trainer.elastic.search import valid_world_sizes

REFERENCE = Path(sys.prefix) / "ref" / "deepspeed-0.19.7"

# The example of DeepSpeed's documentation, with answers 0.19.7 gave (shared/environment.md).
DOC = {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
       "max_gpus": 10000}  # fmt: skip


def cfg(**kw: object) -> ElasticSettings:
    return ElasticSettings.from_dict({"enabled": True, **kw})


def test_known_answers_of_deepspeed() -> None:
    v01 = cfg(**DOC, version=0.1)
    found = elastic_batch(v01)
    assert found.train_batch_size == 1680
    assert len(found.valid_world_sizes) == 32
    plan = solve(v01, 4)
    assert (plan.train_batch_size, plan.micro_batch_size) == (1680, 6)
    assert plan.gradient_accumulation_steps == 1680 // (6 * 4)
    with pytest.raises(IncompatibleWorldSize) as e:
        solve(v01, 11)
    assert e.value.valid == found.valid_world_sizes
    assert "world size 11 is incompatible" in str(e.value)
    assert "1, 2, 3, 4, 5, 6, 7, 8, 10, 12" in str(e.value)  # the valid ones are listed

    v02 = solve(cfg(**DOC, version=0.2, num_gpus_per_node=8), 16)
    assert (v02.train_batch_size, v02.micro_batch_size) == (1920, 6)
    assert v02.batch_kept


def test_plan_multiplies_out_at_every_valid_size() -> None:
    c = cfg(max_train_batch_size=12, micro_batch_sizes=[2, 3], max_gpus=8, version=0.1)
    assert elastic_batch(c).valid_world_sizes == (1, 2, 3, 4, 6)
    got = {n: solve(c, n) for n in (1, 2, 3, 4, 6)}
    for n, p in got.items():
        assert p.micro_batch_size * p.gradient_accumulation_steps * n == 12
    assert (got[2].micro_batch_size, got[2].gradient_accumulation_steps) == (3, 2)
    assert (got[3].micro_batch_size, got[3].gradient_accumulation_steps) == (2, 2)
    assert (got[4].micro_batch_size, got[4].gradient_accumulation_steps) == (3, 1)
    with pytest.raises(IncompatibleWorldSize):
        solve(c, 5)


def test_version_02_adapts_the_batch_outside_its_list() -> None:
    # Version 0.2 does not refuse a world size outside its list: DeepSpeed picked a batch for it.
    c = cfg(max_train_batch_size=64, micro_batch_sizes=[4], num_gpus_per_node=4, version=0.2)
    inside = solve(c, 8)
    assert inside.batch_kept and inside.valid_world_sizes == (4, 8, 16)
    assert inside.train_batch_size == 64
    outside = solve(c, 6)
    assert not outside.batch_kept
    assert outside.valid_world_sizes == (6,)
    assert outside.train_batch_size == 48  # the largest multiple of 4 x 6 within 64


def test_valid_world_sizes_by_definition() -> None:
    # n is valid for batch B when some micro batch m divides B and n divides B / m.
    for batch in (12, 60, 96, 1680):
        for micro in ([2], [3, 5], [2, 4, 6]):
            got = set(valid_world_sizes(batch, micro, 1, 10**6))
            want = {
                n for m in micro if batch % m == 0
                for n in range(1, batch // m + 1) if (batch // m) % n == 0
            }  # fmt: skip
            assert got == want, (batch, micro)


def test_apply_writes_the_batch_keys_and_drops_the_block() -> None:
    user = {
        "elasticity": {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2, 3],
                       "max_gpus": 8, "version": 0.1},
        "train_micro_batch_size_per_gpu": "auto",  # HuggingFace's placeholder counts as unset
        "zero_optimization": {"stage": 2},
    }  # fmt: skip
    before = json.dumps(user, sort_keys=True)
    config, plan = apply_elastic(user, world_size=3)
    assert json.dumps(user, sort_keys=True) == before, "the caller's dict is not modified"
    assert plan is not None and plan.world_size == 3
    assert "elasticity" not in config
    assert config["train_batch_size"] == 12
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 2
    assert config["zero_optimization"] == {"stage": 2}


def test_apply_without_an_enabled_block() -> None:
    config, plan = apply_elastic({"train_batch_size": 8}, world_size=2)
    assert plan is None and config == {"train_batch_size": 8}
    off = {"elasticity": {"enabled": False, "max_train_batch_size": 8}, "train_batch_size": 8}
    config, plan = apply_elastic(off, world_size=2)
    assert plan is None and config == {"train_batch_size": 8}  # DeepSpeed 0.19.8 rejects the block


def test_apply_refuses_batch_keys_next_to_the_block_unless_told() -> None:
    block = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2, 3],
             "version": 0.1}  # fmt: skip
    with pytest.raises(ElasticSettingsError, match="gradient_accumulation_steps"):
        apply_elastic({"elasticity": block, "gradient_accumulation_steps": 4}, world_size=2)
    config, _ = apply_elastic(
        {"elasticity": {**block, "ignore_non_elastic_batch_info": True},
         "gradient_accumulation_steps": 4},
        world_size=2,
    )  # fmt: skip
    assert config["gradient_accumulation_steps"] == 2


def test_apply_takes_the_world_size_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    block = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2, 3],
             "version": 0.1}  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "4")
    _, plan = apply_elastic({"elasticity": block})
    assert plan is not None and plan.world_size == 4
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(IncompatibleWorldSize, match="1, 2, 3, 4, 6"):
        apply_elastic({"elasticity": block})
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticError, match="cannot tell the world size"):
        apply_elastic({"elasticity": block})


def test_the_scheduler_and_the_trainer_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    block = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2, 3],
             "version": 0.1}  # fmt: skip
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(block))
    apply_elastic({"elasticity": block}, world_size=2)
    monkeypatch.setenv(
        "DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**block, "micro_batch_sizes": [4]})
    )
    with pytest.raises(ElasticSettingsError, match="micro_batch_sizes"):
        apply_elastic({"elasticity": block}, world_size=2)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"micro_batch_sizes": [2]}, "needs 'max_train_batch_size'"),
        ({"max_train_batch_size": 8}, "needs 'micro_batch_sizes'"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": 2}, "non-empty list"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2, 0]}, "positive integers"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2.5]}, "positive integers"),
        ({"max_train_batch_size": "8", "micro_batch_sizes": [2]}, "max_train_batch_size"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [16]}, "at most max_train_batch_size"),
        (
            {"max_train_batch_size": 8, "micro_batch_sizes": [2], "min_gpus": 4, "max_gpus": 2},
            "larger than max_gpus",
        ),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2], "version": 0.3}, "version"),
        (
            {
                "max_train_batch_size": 8,
                "micro_batch_sizes": [2],
                "version": 0.1,
                "model_parallel_size": 2,
            },
            "model parallelism",
        ),
        (
            {
                "max_train_batch_size": 8,
                "micro_batch_sizes": [2],
                "num_gpus_per_node": 3,
                "model_parallel_size": 2,
            },
            "divisible",
        ),
        (
            {"max_train_batch_size": 8, "micro_batch_sizes": [2], "prefer_larger_batch": 1},
            "true or false",
        ),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [2], "max_gpu": 4}, "unknown key"),
    ],
)
def test_bad_configs_are_named(block: dict, message: str) -> None:
    with pytest.raises(ElasticSettingsError, match=message):
        apply_elastic({"elasticity": {"enabled": True, **block}}, world_size=2)


def test_cli(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"elasticity": {"enabled": True, **DOC, "version": 0.1}}))
    run = [sys.executable, "-m", "diag.trainer.elastic.batchsize", str(path)]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(out.stdout)
    assert doc["train_batch_size"] == 1680 and len(doc["valid_world_sizes"]) == 32
    out = subprocess.run([*run, "--world-size", "4"], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["train_micro_batch_size_per_gpu"] == 6
    out = subprocess.run([*run, "--world-size", "11"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "world size 11 is incompatible" in out.stderr


# -- against DeepSpeed 0.19.7 ------------------------------------------------------------------

FIXED = [
    ({**DOC, "version": 0.1}, [0, 1, 4, 11, 840, 841]),
    ({**DOC, "version": 0.1, "prefer_larger_batch": False}, [0, 3, 7]),
    ({**DOC, "version": 0.2, "num_gpus_per_node": 8}, [8, 16, 12, 24]),
    ({**DOC, "version": 0.2, "num_gpus_per_node": 8, "model_parallel_size": 2}, [8, 16, 40]),
    ({"max_train_batch_size": 12, "micro_batch_sizes": [2, 3], "max_gpus": 8, "version": 0.1},
     [0, 1, 2, 3, 4, 5, 6]),
    ({"max_train_batch_size": 64, "micro_batch_sizes": [4], "num_gpus_per_node": 4,
      "version": 0.2}, [4, 6, 8, 9]),
    ({"max_train_batch_size": 10**6, "micro_batch_sizes": [8, 12], "min_gpus": 64,
      "max_gpus": 4096, "version": 0.1}, [0, 64, 128, 1000]),
    ({"max_train_batch_size": 47, "micro_batch_sizes": [15], "min_gpus": 3, "version": 0.1},
     [0, 3, 6]),  # no valid size at all (DeepSpeed fails with a TypeError on a world size)
    ({"max_train_batch_size": 59, "micro_batch_sizes": [11], "version": 0.2,
      "num_gpus_per_node": 2, "prefer_larger_batch": False}, [10]),  # DeepSpeed answers batch 0
    ({"max_train_batch_size": 4, "micro_batch_sizes": [2, 8], "version": 0.1}, [0, 1]),
]  # fmt: skip


def sweep(seed: int, count: int) -> list[tuple[dict, list[int]]]:
    """Random configs of both versions, with world sizes in and out of their lists."""
    rnd = random.Random(seed)
    cases = []
    for _ in range(count):
        version = rnd.choice([0.1, 0.2])
        block = {
            "max_train_batch_size": rnd.choice([rnd.randint(1, 64), rnd.randint(1, 3000)]),
            "micro_batch_sizes": sorted(rnd.sample(range(1, 17), rnd.randint(1, 4))),
            "version": version,
            "prefer_larger_batch": rnd.random() < 0.7,
        }
        if rnd.random() < 0.5:
            block["min_gpus"] = rnd.randint(1, 8)
        if rnd.random() < 0.5:
            block["max_gpus"] = rnd.randint(block.get("min_gpus", 1), 200)
        if version == 0.2:
            block["num_gpus_per_node"] = rnd.choice([1, 2, 4, 8])
            if rnd.random() < 0.3:
                block["model_parallel_size"] = rnd.choice([1, 2, 4])
        sizes = sorted({rnd.randint(1, 64) for _ in range(4)})
        cases.append((block, ([0] if version == 0.1 else []) + sizes))
    return cases


def ours(block: dict, world_size: int) -> dict:
    """Our answer in the reference's terms."""
    try:
        c = ElasticSettings.from_dict({"enabled": True, **block})
        if world_size == 0:
            found = elastic_batch(c)
            return {"batch": found.train_batch_size, "valid": list(found.valid_world_sizes)}
        p = solve(c, world_size)
        return {"batch": p.train_batch_size, "valid": list(p.valid_world_sizes),
                "micro": p.micro_batch_size}  # fmt: skip
    except IncompatibleWorldSize:
        return {"error": "incompatible"}
    except ElasticError:
        return {"error": "config"}


def theirs(answer: dict) -> dict:
    """DeepSpeed's answer, where it has a defined meaning, in the same terms. Where 0.19.7 crashes
    or answers something its runtime cannot use, we refuse with a clear error instead: a world
    size checked against no list at all (TypeError) is an incompatible size; a global batch of 0
    is a config that cannot work."""
    error = answer.get("error")
    if error == "ElasticityIncompatibleWorldSize" or error == "TypeError":
        return {"error": "incompatible"}
    if error is not None or answer["batch"] == 0:
        return {"error": "config"}  # ElasticityConfigError, ElasticityError, ValueError, ...
    return {**answer, "valid": answer["valid"] or []}


def test_same_answers_as_deepspeed_0_19_7() -> None:
    assert (REFERENCE / "deepspeed" / "elasticity").is_dir(), (
        f"DeepSpeed 0.19.7 is missing from {REFERENCE}: run scripts/bootstrap.sh"
    )
    cases = FIXED + sweep(seed=9, count=300)
    request = [{"block": {"enabled": True, **b}, "world_sizes": ws} for b, ws in cases]
    env = dict(os.environ, PYTHONPATH=str(REFERENCE))  # 0.19.7 first, the venv's torch after
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "jobs" / "elastic_reference.py")],
        input=json.dumps(request), capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reply = json.loads(proc.stdout)
    assert reply["version"] == "0.19.7", "the reference must be the real 0.19.7"
    compared = {"ok": 0, "incompatible": 0, "config": 0}
    for (block, sizes), answers in zip(cases, reply["answers"], strict=True):
        for ws, answer in zip(sizes, answers, strict=True):
            want = theirs(answer)
            assert ours(block, ws) == want, (block, ws, answer)
            compared[want.get("error", "ok")] += 1
    # Each kind of answer is well represented: the table is not all errors.
    assert min(compared.values()) > 50, compared
    # The fixed rows: DeepSpeed's documented example answered as environment.md says.
    assert reply["answers"][0][0] == {"batch": 1680, "valid": elastic_list(DOC)}


def elastic_list(block: dict) -> list[int]:
    return list(elastic_batch(cfg(**block, version=0.1)).valid_world_sizes)


@pytest.mark.timeout(120)
def test_applied_config_initializes_deepspeed_0_19_8(tmp_path: Path) -> None:
    """DeepSpeed 0.19.8 rejects a config with an `elasticity` block; the applied one initializes,
    with the planned batch (one process, gloo)."""
    script = tmp_path / "init.py"
    script.write_text(
        "import json, os, sys, torch, deepspeed, deepspeed.ops\n"
        "deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False\n"
        "import torch.distributed as dist\n"
        "from diag.trainer.elastic.batchsize import apply_elastic\n"
        "dist.init_process_group('gloo', init_method='file://' + sys.argv[1], rank=0, world_size=1)\n"
        "user = {'elasticity': {'enabled': True, 'max_train_batch_size': 12,\n"
        "        'micro_batch_sizes': [2, 3], 'version': 0.1},\n"
        "        'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}}\n"
        "m = torch.nn.Linear(4, 4)\n"
        "try:\n"
        "    deepspeed.initialize(model=m, model_parameters=m.parameters(), config=user)\n"
        "    print('UNEXPECTED: accepted')\n"
        "except Exception as e:\n"
        "    print('rejected:', 'elasticity' in str(e).lower())\n"
        "config, plan = apply_elastic(user)\n"
        "engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=config)\n"
        "print(json.dumps([engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),\n"
        "                  engine.gradient_accumulation_steps()]))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")],
        capture_output=True, text=True, timeout=110, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "rejected: True" in lines
    assert json.loads(lines[-1]) == [12, 3, 4]  # one rank: micro batch 3, 4 accumulation steps
