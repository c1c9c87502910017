"""What a network namespace per local sandbox costs, and what an exposed endpoint costs.

Arms, measured in interleaved rounds in one process (so machine noise hits both alike):
  lifecycle  start + one ``true`` + stop of a sandbox, network="auto" (own namespace, a holder
             process) vs network="off" (host network)
  exec       one ``true`` in a started sandbox, isolated vs host network
  request    one HTTP GET (a fresh python process) from inside an isolated sandbox through
             ``expose`` (the relay) vs from a host-network sandbox straight to the server

    python bench/sandbox_network.py [--rounds 5] [--n 20]

Needs a root worker on Linux. The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from engine.sandbox import MANAGED_LABEL, Endpoint, LocalSandboxConfig, LocalSandboxProvider

GET = "import urllib.request,sys; urllib.request.urlopen(sys.argv[1]).read()"


async def lifecycle(provider: LocalSandboxProvider, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        box = provider.create(labels={"bench": "net"})
        await box.start()
        await box.exec(["true"])
        await box.stop()
    return (time.perf_counter() - t0) / n


async def execs(provider: LocalSandboxProvider, n: int) -> float:
    box = provider.create(labels={"bench": "net"})
    await box.start()
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            await box.exec(["true"])
        return (time.perf_counter() - t0) / n
    finally:
        await box.stop()


async def requests(
    provider: LocalSandboxProvider, python: str, port: int, n: int, *, exposed: bool
) -> float:
    box = provider.create(labels={"bench": "net"})
    await box.start()
    try:
        url = f"http://127.0.0.1:{port}/"
        if exposed:
            await box.expose(Endpoint(port=8080, target=f"127.0.0.1:{port}"))
            url = "http://127.0.0.1:8080/"
        t0 = time.perf_counter()
        for _ in range(n):
            done = await box.exec([python, "-S", "-c", GET, url])
            assert done.exit_code == 0, done
        return (time.perf_counter() - t0) / n
    finally:
        await box.stop()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=20)
    args = parser.parse_args()
    python = "/usr/bin/python3"
    root = Path(tempfile.mkdtemp(prefix="rollout-bench-net-", dir="/tmp"))
    root.chmod(0o711)
    isolated = LocalSandboxProvider(LocalSandboxConfig(root=root, network="required"))
    shared = LocalSandboxProvider(LocalSandboxConfig(root=root, network="off"))
    handler = http.server.SimpleHTTPRequestHandler
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = int(server.server_address[1])
    figures: dict[str, list[float]] = {k: [] for k in (
        "lifecycle_isolated_s", "lifecycle_host_s", "exec_isolated_s", "exec_host_s",
        "request_exposed_s", "request_direct_s")}
    try:
        for _ in range(args.rounds):
            figures["lifecycle_isolated_s"].append(await lifecycle(isolated, args.n))
            figures["lifecycle_host_s"].append(await lifecycle(shared, args.n))
            figures["exec_isolated_s"].append(await execs(isolated, args.n))
            figures["exec_host_s"].append(await execs(shared, args.n))
            figures["request_exposed_s"].append(
                await requests(isolated, python, port, args.n, exposed=True)
            )
            figures["request_direct_s"].append(
                await requests(shared, python, port, args.n, exposed=False)
            )
    finally:
        await isolated.reap({MANAGED_LABEL: "1"})
        isolated.close()
        shared.close()
        server.shutdown()
    out: dict[str, float | int] = {k: statistics.median(v) for k, v in figures.items()}
    out["lifecycle_ratio"] = out["lifecycle_isolated_s"] / out["lifecycle_host_s"]
    out["exec_ratio"] = out["exec_isolated_s"] / out["exec_host_s"]
    out["request_ratio"] = out["request_exposed_s"] / out["request_direct_s"]
    out.update(rounds=args.rounds, n=args.n)
    for key, value in out.items():
        print(f"{key:<24} {value:.4f}" if isinstance(value, float) else f"{key:<24} {value}")
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
