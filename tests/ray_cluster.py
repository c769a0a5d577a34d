"""A real two-node Ray cluster on this machine for the engine tests: ``ray start --head`` plus a
second ``ray start --address``, one CPU each (the second also declares one logical GPU), on
loopback, every port chosen free, temp dirs in the test's tmp folder. Each node is a ``ray start --block`` in its own process group; stopping
kills exactly those groups (never ``ray stop``, which would stop every Ray on the machine)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
# Ray replaces "127.0.0.1" and "localhost" by the machine's outward address; other loopback
# addresses it keeps. So the head is 127.0.0.2, the second node 127.0.0.3: every node, worker
# and driver binds and talks on loopback only.
HEAD_IP, NODE2_IP = "127.0.0.2", "127.0.0.3"
# No traffic off this machine: usage stats off, and the head's usage module (started even with
# the dashboard off) pointed at a closed loopback port instead of Ray's server. It also asks
# cloud metadata servers which cloud it runs on unless ~/ray_bootstrap_config.yaml names a
# provider, so each node gets a HOME in the tmp folder holding one.
ENV = {
    **os.environ,
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
}


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out (bind to
    0) is one it may give any process's next outgoing connection (gloo's, another test's) before
    the launch that was to listen on it binds, which then fails with EADDRINUSE."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(200):
        port = random.randrange(10000, max(10001, ephemeral))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port found below the ephemeral range")


def _ports() -> list[str]:
    return [
        "--node-manager-port", str(free_port()),
        "--object-manager-port", str(free_port()),
        "--metrics-export-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()),
        "--dashboard-agent-grpc-port", str(free_port()),
        "--runtime-env-agent-port", str(free_port()),
        "--min-worker-port", "0",
        "--max-worker-port", "0",
    ]  # fmt: skip


class LocalCluster:
    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        # Ray's temp dirs hold its sockets, whose paths may have 107 bytes at most: under /tmp
        # itself, not under the test's tmp folder (pytest-of-USER/pytest-NNN/popen-gwN/...)
        self.temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.env = env or {}  # the nodes' own variables, besides ENV
        self.gcs_port = free_port()
        self.address = f"{HEAD_IP}:{self.gcs_port}"
        self.nodes: list[subprocess.Popen] = []

    def _start(self, args: list[str], log: str) -> None:
        home = self.root / "home"
        home.mkdir(exist_ok=True)
        (home / "ray_bootstrap_config.yaml").write_text("provider:\n  type: local\n")
        with open(self.root / log, "w") as out:
            self.nodes.append(
                subprocess.Popen(
                    [RAY, "start", "--block", "--num-cpus=1"]
                    + ["--disable-usage-stats"]
                    + ["--object-store-memory=80000000"]
                    + args
                    + _ports(),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stopped as one
                    env={**ENV, **self.env, "HOME": str(home)},
                )
            )

    def start(self, timeout: float = 180) -> LocalCluster:
        self._start(
            [
                "--head",
                f"--port={self.gcs_port}",
                f"--temp-dir={self.temp / 'h'}",
                "--num-gpus=0",
                f"--node-ip-address={HEAD_IP}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
            ],
            "head.log",
        )
        self._wait_for("head.log", timeout)
        self._start(
            [
                f"--address={self.address}",
                f"--node-ip-address={NODE2_IP}",
                f"--temp-dir={self.temp / 'n2'}",
                # A logical GPU (the machine has none): Ray schedules tokenize's GPU actor here,
                # which then runs the visual tokenizer on the CPU.
                "--num-gpus=1",
            ],
            "node2.log",
        )
        self._wait_for("node2.log", timeout)
        import ray

        deadline = time.monotonic() + timeout
        ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        try:
            while len([n for n in ray.nodes() if n["Alive"]]) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the second Ray node did not join")
                time.sleep(0.5)
        finally:
            ray.shutdown()
        return self

    def _wait_for(self, log: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in (self.root / log).read_text():
            if self.nodes[-1].poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start failed:\n{(self.root / log).read_text()[-3000:]}")
            time.sleep(0.5)

    def processes(self, node: int | None = None) -> dict[int, str]:
        """pid -> title of every process this cluster (``node``: that node) started: the ``ray
        start`` commands and all their descendants (Ray's workers get process groups of their
        own)."""
        parent: dict[int, int] = {}
        title: dict[int, str] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
                title[int(d.name)] = (
                    (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                )
            except (OSError, ValueError, IndexError):
                continue
        ours = {p.pid for j, p in enumerate(self.nodes) if node in (None, j)}
        grew = True
        while grew:
            more = {pid for pid, ppid in parent.items() if ppid in ours} - ours
            ours |= more
            grew = bool(more)
        return {pid: title.get(pid, "") for pid in ours}

    def lose_node(self, i: int) -> None:
        """Node ``i`` (1: the second) gone at once, as a machine that fails: every process of it
        killed, without telling the head."""
        for pid in self.processes(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes[i].wait()

    def worker_pids(self, title: str, node: int | None = None) -> list[int]:
        """Processes of this cluster (``node``: of that node) whose title starts with ``title``."""
        return sorted(pid for pid, t in self.processes(node).items() if t.startswith(title))

    def stop(self) -> None:
        # SIGKILL at once: SIGTERM makes a node drain for up to 30 s. Only this cluster's own
        # processes are touched; then its temp dirs go.
        for pid in self.processes():
            if pid not in {p.pid for p in self.nodes}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.nodes:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever is left of this node's group
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(self.temp, ignore_errors=True)
