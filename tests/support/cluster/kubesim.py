"""An in-memory Kubernetes API server for the k8s tests: kmock's emulator, run as its own process,
with the parts of the API server's write semantics that node tainting relies on:

- every write bumps `metadata.resourceVersion`; a write that carries an older one gets 409
  Conflict (optimistic concurrency, as the API server does for patches with a resourceVersion);
- a strategic-merge patch of `status.conditions` merges by condition `type` (the list's patch
  merge key), so the kubelet's conditions survive a patch that carries only ours;
- `uid` and `creationTimestamp` are set on create.

Usage: python tests/support/cluster/kubesim.py PORTFILE   (writes the port it listens on, then serves until
SIGTERM). Writes are serialised by one lock, so a check and its write cannot interleave.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import kmock
from kmock._internal import enums
from kmock._internal.k8s import KubernetesObjectConflictError


class StrictEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._write_lock = asyncio.Lock()
        self._version = 1000

    async def _handle(self, request: Any) -> Any:
        if request.resource is None or request.action not in (
            enums.action.CREATE,
            enums.action.UPDATE,
        ):
            return await super()._handle(request)
        async with self._write_lock:
            data = request.data if isinstance(request.data, dict) else {}
            meta = data.setdefault("metadata", {})
            if request.action == enums.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                current = self._objects[key].raw if key in self._objects else None
                if current is not None:
                    have = current.get("metadata", {}).get("resourceVersion")
                    want = meta.get("resourceVersion")
                    if want is not None and want != have:
                        raise KubernetesObjectConflictError(
                            message=f"Operation cannot be fulfilled on {request.resource.plural} "
                            f'"{request.name}": the object has been modified; please apply '
                            "your changes to the latest version and try again",
                            reason="Conflict",
                        )
                    ctype = request.headers.get("Content-Type", "")
                    conds = data.get("status", {}).get("conditions")
                    if "strategic-merge-patch" in ctype and isinstance(conds, list):
                        merged = {
                            c["type"]: c for c in current.get("status", {}).get("conditions", [])
                        }
                        for c in conds:
                            merged[c["type"]] = {**merged.get(c["type"], {}), **c}
                        data["status"]["conditions"] = list(merged.values())
            else:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault(
                    "creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                )
            self._version += 1
            meta["resourceVersion"] = str(self._version)
            return await super()._handle(request)


async def serve(portfile: Path) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    async with StrictEmulator() as emu, kmock.Server(emu) as server:
        for plural in ("nodes", "events", "pods", "namespaces"):
            emu.resources[f"v1/{plural}"] = {}
        tmp = portfile.with_suffix(".tmp")
        tmp.write_text(str(server.port))
        tmp.rename(portfile)
        await stop.wait()


def deep_copy(obj: Any) -> Any:
    return copy.deepcopy(obj)


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1])))
