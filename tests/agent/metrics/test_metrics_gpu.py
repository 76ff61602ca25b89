"""GPU metrics through NVML: the real path on a GPU host, a clean absence elsewhere."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from diag.agent.metrics.gpu import GpuCollector, open_nvml


def test_without_nvml_the_gpu_families_are_skipped_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="diag.agent.metrics.gpu"):
        nvml = open_nvml()
    if nvml is not None:
        nvml.close()
        pytest.skip("this host has NVML; the GPU test covers it")
    (record,) = [r for r in caplog.records if r.name == "diag.agent.metrics.gpu"]
    assert record.levelno == logging.DEBUG and "no GPU metrics" in record.getMessage()


@pytest.mark.gpu
def test_nvml_readings_of_a_real_gpu() -> None:
    nvml = open_nvml()
    if nvml is None:
        pytest.skip("no NVML here (no NVIDIA driver)")
    try:
        readings = nvml.read()
        assert readings, "NVML initialised but listed no GPU"
        for g in readings:
            assert g.memory_total and g.memory_used is not None
            assert 0 <= g.memory_used <= g.memory_total
            assert g.utilization is None or 0.0 <= g.utilization <= 1.0
            assert g.temperature is None or 0 < g.temperature < 130
            assert g.power is None or 0 < g.power < 2000
            assert g.xid_errors == 0 or g.last_xid > 0
        reg = CollectorRegistry(auto_describe=False)
        reg.register(GpuCollector("n1", nvml))
        labels = {"node": "n1", "gpu": "0"}
        assert (
            reg.get_sample_value("diag_gpu_memory_total_bytes", labels) == readings[0].memory_total
        )
        assert reg.get_sample_value("diag_gpu_xid_errors_total", labels) is not None
    finally:
        nvml.close()
