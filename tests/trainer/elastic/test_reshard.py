"""diag.trainer.elastic.reshard: what tells the data-parallel size of a saved step, and how a conversion is
built, reused and cleaned up (a real conversion and load at another size run in
test_elastic_resume.py and test_hf_callbacks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.trainer.elastic.reshard import (
    LATEST_UNIVERSAL,
    ReshardError,
    convert,
    needs_reshard,
    saved_dp_size,
    universal_dir,
)


@pytest.mark.parametrize(
    ("names", "size"),
    [
        # ZeRO 1/2 in fp32: one optimizer partition per data-parallel rank, one model file.
        (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
          "zero_pp_rank_1_mp_rank_00_optim_states.pt"], 2),
        # bf16 (ZeRO or the bf16 optimizer alone) prefixes the partitions.
        ([f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)], 4),
        # ZeRO 3: model states per rank too; only the optimizer partitions count.
        ([f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in range(3)
          for k in ("model", "optim")], 3),
        # Model parallel: partitions per (dp, mp); the dp ranks count.
        ([f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(2) for m in range(4)],
         2),
        # No ZeRO: nothing depends on the size.
        (["mp_rank_00_model_states.pt"], None),
        ([], None),
        (["zero_pp_rank_x_mp_rank_00_optim_states.pt", "notes.txt"], None),
    ],
)  # fmt: skip
def test_saved_size_from_file_names(names: list[str], size: int | None) -> None:
    assert saved_dp_size(names) == size


def test_reshard_only_when_the_partitions_differ() -> None:
    assert needs_reshard(4, 2) and needs_reshard(2, 3)
    assert not needs_reshard(2, 2)
    assert not needs_reshard(None, 3)


def test_a_complete_conversion_is_reused(tmp_path: Path) -> None:
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "global_step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    done = universal_dir(tmp_path, "global_step5")
    done.mkdir(parents=True)
    (done / LATEST_UNIVERSAL).write_text("global_step5")
    path, seconds, size, reused = convert(tmp_path, "global_step5")
    assert (path, seconds, size, reused) == (done, 0.0, 1, True)


@pytest.mark.timeout(180)
def test_a_failed_conversion_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    step = tmp_path / "global_step7"
    step.mkdir()
    for r in range(2):  # not a checkpoint DeepSpeed can read
        (step / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"not a torch file")
    stale = universal_dir(tmp_path, "global_step7").parent / ".global_step7.tmp-1"
    stale.mkdir(parents=True)  # left by a rank 0 that died converting
    with pytest.raises(ReshardError) as e:
        convert(tmp_path, "global_step7", workers=1)
    assert "converter failed" in str(e.value)
    assert "ds_to_universal" in str(e.value)  # the command, and the converter's last lines
    assert len(str(e.value).splitlines()) > 2
    assert not universal_dir(tmp_path, "global_step7").exists()
    assert list(universal_dir(tmp_path, "global_step7").parent.iterdir()) == []
    assert sorted(p.name for p in step.iterdir()) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ], "the checkpoint itself is untouched"
