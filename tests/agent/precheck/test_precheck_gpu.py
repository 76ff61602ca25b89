"""GPU paths of `diag precheck` (NVML health, CUDA-event matmul, device copies, NCCL pairs).
Skipped on machines without CUDA devices."""

from __future__ import annotations

import pytest
from jobrun import free_port
from netlab import Cluster

from diag.formats import exitcodes

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPU_FLAGS = ["--device", "cuda", "--matmul-size", "4096", "--copy-size", "64MiB"]


@pytest.mark.timeout(300)
def test_single_node_gpu_checks(tmp_path):
    count = _gpus()
    if count < 1:
        pytest.skip("no CUDA device")
    c = Cluster(1, tmp_path, free_port())
    try:
        c.start(0, "--rdzv-timeout", "60", *GPU_FLAGS)
        assert c.wait_all(240) == {0: exitcodes.OK}, c.logs()
    finally:
        c.stop()
    node = c.nodes[0].report()["nodes"][0]
    assert [d["index"] for d in node["devices"]] == list(range(count))
    assert all(d["memory_used_fraction"] is not None for d in node["devices"])
    assert [x["device"] for x in node["compute"]] == [f"cuda:{i}" for i in range(count)]
    assert all(x["flops"] > 1e12 for x in node["compute"])
    if count >= 2:
        assert node["copies"] and all(x["bytes_per_s"] > 0 for x in node["copies"])


@pytest.mark.timeout(300)
def test_two_nodes_nccl_pair(tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 CUDA devices: NCCL refuses two ranks on one GPU")
    c = Cluster(2, tmp_path, free_port())
    try:
        c.start(0, "--rdzv-timeout", "60", "--net-device", "0", *GPU_FLAGS)
        c.start(1, "--rdzv-timeout", "60", "--net-device", "1", *GPU_FLAGS)
        assert c.wait_all(240) == {0: exitcodes.OK, 1: exitcodes.OK}, c.logs()
    finally:
        c.stop()
    r = c.nodes[1].report()
    assert r["nodes"][0]["links"][0]["grade"] == "good"
    assert r["nodes"][0]["busbw_bytes_per_s"] > 1e9
