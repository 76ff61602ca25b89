"""The device paths of the agent on a real GPU, with the device's published figures beside them.

    python bench/gpu_device.py [--json results.json] [--matmul-size 8192] [--seconds 3]

- NVML: every `diag_gpu_*` metric family the exporter serves, read from the real device;
- precheck device health (NvmlWatch) and the taint probe's ECC/XID reading (gpuhealth.probe);
- the precheck's matmul throughput (bf16, CUDA events) against the published dense peak of the
  device named by torch.cuda.get_device_name;
- pinned device-to-host and host-to-device copy bandwidth (the bound for flash checkpoints).

Prints a table; with --json writes the numbers. Exits 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

# Dense bf16 tensor-core peak in TFLOP/s (no sparsity), from NVIDIA's data sheets. Matched by
# substring of the device name, the first match wins (more specific names first).
PUBLISHED_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM5 (H100 80GB HBM3)
    ("H200", 989.0),  # SXM
    ("GH200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
)


def published_peak(name: str) -> float | None:
    for key, tflops in PUBLISHED_BF16_TFLOPS:
        if key in name:
            return tflops
    return None


def nvml_families() -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from diag.agent.metrics.gpu import GpuCollector, open_nvml

    nvml = open_nvml()
    if nvml is None:
        return {"error": "NVML did not open"}
    try:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(GpuCollector("bench", nvml))
        families: dict[str, Any] = {}
        for metric in reg.collect():
            families[metric.name] = {
                "type": metric.type,
                "samples": [
                    {"name": s.name, "labels": s.labels, "value": s.value} for s in metric.samples
                ],
            }
        readings = [r.__dict__ for r in nvml.read()] if hasattr(nvml, "read") else []
        return {"families": families, "readings": readings}
    finally:
        nvml.close()


def precheck_health() -> dict[str, Any]:
    from diag.agent.precheck.devicehealth import NvmlWatch
    from diag.agent.taint.gpuhealth import probe

    watch = NvmlWatch()
    watch.start()
    devices = watch.finish()
    evidence, note = probe(1.0)
    return {
        "watch_note": watch.note,
        "devices": [d.__dict__ for d in devices],
        "taint_probe_note": note,
        "taint_probe_evidence": [str(e) for e in evidence],
    }


def matmul(size: int, seconds: float) -> dict[str, Any]:
    import torch

    from diag.agent.precheck.measure import matmul_throughput

    name = torch.cuda.get_device_name(0)
    r = matmul_throughput("cuda:0", size, seconds)
    peak = published_peak(name)
    tflops = r.flops / 1e12 if r.flops else None
    return {
        "device": name,
        "size": size,
        "dtype": r.dtype,
        "tflops": tflops,
        "published_peak_tflops": peak,
        "fraction_of_peak": tflops / peak if tflops and peak else None,
        "error": r.error,
    }


def pinned_bandwidth(nbytes: int, iters: int = 5) -> dict[str, float]:
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(0)
    out: dict[str, float] = {"bytes": float(nbytes)}
    for what, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[f"{what}_gb_per_s"] = nbytes / best / 1e9
    return out


def _step(results: dict[str, Any], name: str, fn: Any, *args: Any) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as e:  # one broken path must not hide the others' numbers
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    results[name + "_seconds"] = round(time.perf_counter() - t0, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--copy-mib", type=int, default=1024)
    a = p.parse_args(argv)
    import torch

    results: dict[str, Any] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    _step(results, "nvml", nvml_families)
    _step(results, "precheck_health", precheck_health)
    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name(0)
        _step(results, "matmul", matmul, a.matmul_size, a.seconds)
        _step(results, "pinned_copy", pinned_bandwidth, a.copy_mib << 20)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    fams = results["nvml"].get("families", {})
    print(f"NVML metric families ({len(fams)}): {', '.join(sorted(fams)) or results['nvml']}")
    print(f"precheck device health: {results['precheck_health']}")
    if not torch.cuda.is_available():
        print("no CUDA device: matmul and copies not measured", file=sys.stderr)
        return 2
    m, c = results["matmul"], results["pinned_copy"]
    print("\n| what | measured | published | ratio |")
    print("|---|---|---|---|")
    if m.get("tflops"):
        peak, frac = m["published_peak_tflops"], m["fraction_of_peak"]
        print(
            f"| {m['device']}: matmul {m['size']}^3 {m['dtype']} (TFLOP/s) | {m['tflops']:.0f} | "
            f"{peak or 'unknown'} | {f'{frac:.2f}' if frac else '-'} |"
        )
    else:
        print(f"matmul failed: {m}")
    if "d2h_gb_per_s" in c:
        print(f"| pinned device-to-host copy (GB/s) | {c['d2h_gb_per_s']:.1f} | - | - |")
        print(f"| pinned host-to-device copy (GB/s) | {c['h2d_gb_per_s']:.1f} | - | - |")
    else:
        print(f"pinned copies failed: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
