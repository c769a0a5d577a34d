"""The Ray engine (``--engine ray``, the optional extra ``ray``): shard jobs on a Ray cluster.

Design choices:
- The CPU work (reading inputs, decoding and checking media, BPE, writing shards) runs in a
  pool of long-lived CPU actors, one CPU each, one per CPU of the cluster by default
  (``--workers N`` for fewer). Actors rather than stateless Ray tasks, because a worker must
  keep what it built (tokenizers, the visual tokenizer: loaded once per worker) and must be
  replaced after ``recycle_after`` failed video decodes (decord leaks ~40 KB per failure), a
  condition known only after a job ran; a task's ``max_calls`` is fixed in advance.
- Tokenize adds, when the cluster has GPUs, a pool of GPU actors (one GPU each) holding the
  visual tokenizer (``GpuPool``, made by ``gpu_setup``); the CPU actors send them batches of
  decoded images and frames. An actor that CUDA cannot serve computes on the CPU and says so
  (the driver prints each GPU actor's line).
- Failures: an actor that dies (its process killed, its node lost) is replaced and its job
  sent again, up to ``retries`` times; an actor is given jobs only once it has started (a
  replacement for a lost node's may wait for a CPU the cluster no longer has: the jobs go to
  the actors running meanwhile, and a line says so if none is left); a job that failed goes to
  an actor on another node when one is free, and the lines name the node it failed on; a GPU
  actor that dies is replaced too, and the jobs that were calling it (they fail with Ray's
  ``RayActorError``) are sent again; a job that raised ``OSError`` (a storage hiccup) is sent
  again too; any other exception stops the run with the job's own error. A job rerun writes
  the same bytes (outputs go to temporary names first), so a kill never leaves a shard
  missing, half-written or twice.
- Tested (tests/test_data/test_engine_ray.py, a real two-node Ray cluster on one machine whose
  second node declares one *logical* GPU): ingest and tokenize byte-identical to the local
  engine (ingest also into S3 from a cluster started without its settings), a CPU actor
  killed mid-job, a node lost mid-job, the GPU actor pool (the actor on that logical GPU runs
  the visual tokenizer on the CPU) and a GPU actor killed mid-run. Not tested: CUDA itself (no
  GPU here), several GPUs, a lost GPU node (a replacement GPU actor then waits for a GPU).
- Every node must see the same inputs and the same output folder (a shared file system, or
  object storage through fsspec URLs) and have the same earlyfuse installed.
- The driver joins the cluster at ``address`` (default: ``RAY_ADDRESS``, else one that
  ``ray start`` made on this machine, else a local Ray started for this command and stopped
  after it: Ray's own order). A ``HOST:PORT`` where nothing answers is
  refused at once (``check_address``): ``ray.init`` would retry it for minutes.
- Ray starts an actor with its node's environment, not the driver's. A node's own object-storage
  settings (``AWS_*`` and the like: ``STORAGE_ENV_PREFIXES``) win; the driver's (``storage_env``)
  fill in those it lacks, without which a job would find no credentials, or write to another
  endpoint. Credentials (``CREDENTIAL_PREFIXES``) are taken as a set: a node that has any keeps
  its own and takes none of the driver's (never the node's profile beside the driver's keys,
  which would win over it). ``EngineConfig.storage_env = "driver"`` (``--ray-storage-env
  driver``) gives every actor the driver's settings instead.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from data.media import decode_failures

if TYPE_CHECKING:
    from data.engine import EngineConfig

JobT = TypeVar("JobT")
# Seconds without a result, no job running and jobs left, after which the driver says why
STALL_SECONDS = 60.0
ResultT = TypeVar("ResultT")


# Environment variables that configure object storage (endpoint, credentials, region, profile).
STORAGE_ENV_PREFIXES = ("AWS_", "FSSPEC_", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_")
# Those of them that say who the actor is: a node's own are never mixed with the driver's.
CREDENTIAL_PREFIXES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_",
)


def storage_env() -> dict[str, str]:
    """This process's object-storage settings (see the module's docstring)."""
    return {
        name: value for name, value in os.environ.items() if name.startswith(STORAGE_ENV_PREFIXES)
    }


def take_storage_env(driver: dict[str, str], driver_wins: bool) -> None:
    """In an actor: the driver's settings where its node has none (all of them, ``driver_wins``);
    a node with credentials of its own keeps them and takes none of the driver's."""
    if driver_wins:
        for name in storage_env():
            del os.environ[name]
    own_credentials = any(name.startswith(CREDENTIAL_PREFIXES) for name in storage_env())
    for name, value in driver.items():
        if not (own_credentials and name.startswith(CREDENTIAL_PREFIXES)):
            os.environ.setdefault(name, value)


def check_address(address: str | None) -> None:
    """Refuse a ``HOST:PORT`` (``--ray-address`` or ``RAY_ADDRESS``) where nothing answers;
    other forms (``auto``, ``ray://...``) are left to Ray."""
    where = "--ray-address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS")
    if not address or "://" in address or address in ("auto", "local"):
        return
    host, _, port = address.rpartition(":")
    host = host.strip("[]")  # [::1]:6379, an IPv6 host
    if not host or not port.isdigit():
        raise ValueError(
            f"{where} {address!r}: give the head node as HOST:PORT (e.g. 10.0.0.1:6379)"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=10):
            pass
    except OSError as e:
        raise ValueError(
            f"{where} {address}: no Ray cluster answers there ({e.strerror or e}); start one "
            f"with `ray start --head --port {port}` on {host}, or check the address"
        ) from None


class PrepWorker:
    """A CPU actor: runs jobs with ``fn`` and says when it has seen enough failed decodes."""

    def __init__(self, fn: Callable, recycle_after: int, env: dict, driver_wins: bool) -> None:
        take_storage_env(env, driver_wins)
        self.fn, self.recycle_after = fn, recycle_after
        self.start = decode_failures()

    def run(self, job) -> tuple[Any, bool]:
        result = self.fn(job)
        failed = decode_failures() - self.start
        return result, self.recycle_after > 0 and failed >= self.recycle_after

    def where(self) -> tuple[str, int]:
        """The node and process it runs in, for the driver's lines (returned once it started)."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()


class GpuPool:
    """Actors that jobs call into (tokenize: the visual tokenizer), one per GPU of the cluster.
    ``start()`` starts one; ``point(job, actors)`` is the job made to call them. Actors have a
    ``describe()`` method (a line saying where they compute), which is also how a dead one is
    found: ``replace_dead`` starts a new actor for each one whose call fails."""

    def __init__(
        self, ray, *, start: Callable[[], Any], point: Callable[[Any, list], Any], size: int
    ) -> None:
        self.ray, self.start, self.point = ray, start, point
        self.actors = [start() for _ in range(size)]

    def adapt(self, job):
        return self.point(job, list(self.actors))

    def describe(self) -> list[str]:
        return self.ray.get([actor.describe.remote() for actor in self.actors])

    def replace_dead(self) -> int:
        from ray.exceptions import RayActorError

        replaced = 0
        for i, actor in enumerate(self.actors):
            try:
                self.ray.get(actor.describe.remote())
            except RayActorError:
                self.ray.kill(actor)
                self.actors[i] = self.start()
                replaced += 1
        return replaced


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--engine ray needs Ray: pip install 'earlyfuse[ray]' (on every node)"
        ) from None
    return ray


def run_ray(
    fn: Callable[[JobT], ResultT],
    jobs: list[JobT],
    engine: EngineConfig,
    *,
    gpu_setup: Callable | None = None,
) -> Iterator[ResultT]:
    if not jobs:
        return
    ray = import_ray()
    from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

    started_here = not ray.is_initialized()
    if started_here:
        check_address(engine.address)
        on_term = signal.getsignal(signal.SIGTERM)
        ray.init(
            address=engine.address or os.environ.get("RAY_ADDRESS"),
            log_to_driver=False,
            include_dashboard=False,
            configure_logging=False,
        )
        if on_term is not None and threading.current_thread() is threading.main_thread():
            # ray.init sets its own handler (sys.exit): the command's stops its work cleanly
            signal.signal(signal.SIGTERM, on_term)
    resources = ray.cluster_resources()
    cpus = max(1, int(resources.get("CPU", 1)))
    # Never more actors than CPUs: an actor waiting for a CPU would hold its job forever.
    size = min(engine.workers or cpus, cpus, len(jobs))
    if engine.workers > cpus:
        print(
            f"ray: --workers {engine.workers} is more than the cluster's {cpus} CPU(s): "
            f"one actor per CPU",
            file=sys.stderr,
            flush=True,
        )
    actor_cls = ray.remote(num_cpus=1)(PrepWorker)
    # The driver's object-storage settings go with each actor (the module's docstring)
    actor_args = (fn, engine.recycle_after, storage_env(), engine.storage_env == "driver")
    adapt: Callable[[JobT], JobT] = lambda job: job  # noqa: E731
    pool: GpuPool | None = None
    if gpu_setup is not None and int(resources.get("GPU", 0)) > 0:
        pool = gpu_setup(ray, int(resources["GPU"]))
        adapt = pool.adapt
    nodes = sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))
    print(
        f"ray: {size} CPU actor(s) over {nodes} node(s)"
        + (f", {len(pool.actors)} GPU actor(s)" if pool else ""),
        file=sys.stderr,
        flush=True,
    )
    queue: deque[tuple[int, JobT]] = deque(enumerate(jobs))
    tries = dict.fromkeys(range(len(jobs)), 0)
    failed_on: dict[int, str] = {}  # job -> the node it last failed on (sent elsewhere if any)
    # An actor is given jobs once it has started (``where`` answered): a replacement for one on a
    # lost node may wait for a CPU the cluster no longer has, and a job sent to it would wait too.
    starting: dict = {}  # ``where`` ref -> actor
    idle: list = []
    place: dict = {}  # actor -> (node, pid) where it runs
    inflight: dict = {}  # object ref -> (actor, position, job)

    def start() -> None:
        actor = actor_cls.remote(*actor_args)
        starting[actor.where.remote()] = actor

    def again(pos: int, job: JobT, why: str, give_up: type[Exception] = RuntimeError) -> None:
        tries[pos] += 1
        if tries[pos] > engine.retries:
            raise give_up(f"job {pos} failed {tries[pos]} times on ray; the last: {why}")
        print(
            f"ray: job {pos} failed: {why}; sent again (try {tries[pos] + 1} of "
            f"{engine.retries + 1})",
            file=sys.stderr,
            flush=True,
        )
        queue.appendleft((pos, job))

    for _ in range(size):
        start()
    waited = False
    try:
        if pool is not None:  # waits for the GPU actors to have loaded their model
            for i, line in enumerate(pool.describe()):
                print(f"ray: GPU actor {i}: {line}", file=sys.stderr, flush=True)
        while queue or inflight:
            while idle and queue:
                pos, job = queue.popleft()
                other = [i for i, a in enumerate(idle) if place[a][0] != failed_on.get(pos)]
                actor = idle.pop(other[-1] if other else -1)
                inflight[actor.run.remote(adapt(job))] = (actor, pos, job)
            if not (inflight or starting):
                raise RuntimeError(
                    f"no Ray actor left to run {len(queue)} job(s): each failed to start (the "
                    "`ray: an actor failed to start` lines say why)"
                )
            ready, _ = ray.wait([*inflight, *starting], num_returns=1, timeout=STALL_SECONDS)
            if not ready:
                if not inflight and not waited:
                    waited = True
                    print(
                        f"ray: {len(queue)} job(s) wait for an actor; the {len(starting)} "
                        "starting have no free CPU (a node lost?): they start when a node joins, "
                        "or stop this (Ctrl-C) and run the same command again to resume",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            if ready[0] in starting:
                actor = starting.pop(ready[0])
                try:
                    place[actor] = ray.get(ready[0])
                    idle.append(actor)
                except (RayActorError, WorkerCrashedError) as e:  # its node went meanwhile
                    ray.kill(actor)
                    said = [line for line in str(e).splitlines() if line.strip()] or [repr(e)]
                    print(f"ray: an actor failed to start: {said[-1]}", file=sys.stderr, flush=True)
                continue
            actor, pos, job = inflight.pop(ready[0])
            at = " on node {} pid {}".format(*place[actor])
            try:
                result, retire = ray.get(ready[0])
            except RayTaskError as e:
                # The job raised (caught first: a job that called a dead GPU actor raises an
                # error that is both a RayTaskError and a RayActorError, its worker alive).
                idle.append(actor)
                failed_on[pos] = place[actor][0]
                if isinstance(e.cause, RayActorError) and pool is not None:
                    replaced = pool.replace_dead()
                    if replaced:
                        print(f"ray: {replaced} GPU actor(s) replaced", file=sys.stderr, flush=True)
                    again(pos, job, f"a GPU actor it called died ({type(e.cause).__name__})")
                    continue
                if isinstance(e.cause, OSError):  # given up on: an OSError, one line in the CLI
                    again(pos, job, f"{e.cause}{at}", OSError)
                    continue
                raise e.as_instanceof_cause() from None
            except (RayActorError, WorkerCrashedError) as e:
                ray.kill(actor)
                place.pop(actor, None)
                start()
                again(pos, job, f"its worker died{at} ({type(e).__name__})")
                continue
            if retire:
                ray.kill(actor)
                place.pop(actor, None)
                start()
            else:
                idle.append(actor)
            yield result
    finally:
        busy = [busy_actor for busy_actor, _, _ in inflight.values()]
        for actor in idle + busy + list(starting.values()) + (pool.actors if pool else []):
            ray.kill(actor)
        if started_here:
            ray.shutdown()
