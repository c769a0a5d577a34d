"""--engine ray on a real two-node Ray cluster on this machine (tests/ray_cluster.py): ingest and
tokenize write the local engine's bytes, also when a Ray worker is killed mid-job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import many_images

pytest.importorskip("ray")

from ray_cluster import ENV, LocalCluster, free_port  # noqa: E402

from data.engine import EngineConfig  # noqa: E402
from data.ingest import ingest  # noqa: E402
from data.tokenize.run import tokenize  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("r")).start()
    yield c
    c.stop()


def folder_bytes(out: Path, state: str) -> dict[str, bytes]:
    """Every file but the per-shard records and the manifest's list of commands."""
    files = {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and state not in p.parts and p.name != "manifest.json"
    }
    m = json.loads((out / "manifest.json").read_text())
    m.get("created_by", {}).pop("commands", None)
    files["manifest.json"] = json.dumps(m, sort_keys=True).encode()
    return files


def test_ingest_on_ray_survives_a_killed_worker_with_the_local_bytes(
    cluster, planted_corpus, tmp_path
):
    many_images(tmp_path / "many", 40, size=64)
    sources = planted_corpus["sources"] + [f"images:{tmp_path / 'many'}"]
    local, remote = tmp_path / "local", tmp_path / "ray"
    ingest(local, sources, shard_max_samples=1, shard_max_bytes=0)

    cmd = [sys.executable, "-m", "data.cli", "ingest", "--out", str(remote), "--no-progress"]
    cmd += [
        "--engine",
        "ray",
        "--ray-address",
        cluster.address,
        "--shard-samples",
        "1",
        "--shard-size",
        "0",
    ]
    cmd += ["--allow-rejects"] + [a for s in sources for a in ("--source", s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        records = list((remote / ".ingest").glob("shard-*.json"))
        busy = cluster.worker_pids("ray::PrepWorker.run")
        if len(records) >= 3 and busy:
            killed = busy[0]
            os.kill(killed, signal.SIGKILL)  # a Ray worker of this cluster, in the middle of a job
        time.sleep(0.005)
    out, err = proc.communicate(timeout=300)
    assert killed is not None, f"no busy worker seen to kill:\n{err[-2000:]}"
    assert proc.returncode == 0, err[-3000:]
    assert "sent again" in err  # the killed worker's job ran once more, elsewhere
    assert folder_bytes(remote, ".ingest") == folder_bytes(local, ".ingest")
    assert "ray: 2 CPU actor(s)" in err  # --workers not given: one actor per cluster CPU
    m = json.loads((remote / "manifest.json").read_text())
    total = planted_corpus["good_samples"] + 40
    assert m["totals"]["samples"] == total == sum(s["samples"] for s in m["shards"])


def test_tokenize_on_ray_gives_the_local_bytes(cluster, tiny_raw, tiny_tokenizers, tmp_path, capfd):
    """Through the GPU actor pool: the second node declares a logical GPU, so the visual
    tokenizer runs in a GPU actor (on the CPU here) fed by the CPU actors."""
    local, remote = tmp_path / "local", tmp_path / "ray"
    tokenize(tiny_raw, local, *tiny_tokenizers)
    m = tokenize(
        tiny_raw, remote, *tiny_tokenizers, engine=EngineConfig("ray", address=cluster.address)
    )
    assert m["finalized"]
    err = capfd.readouterr().err
    assert "2 CPU actor(s) over 2 node(s), 1 GPU actor(s)" in err
    assert "GPU actor 0: no CUDA device visible" in err  # a logical GPU: the CPU computes
    assert folder_bytes(remote, ".tokenize") == folder_bytes(local, ".tokenize")


def test_tokenize_on_ray_replaces_a_killed_gpu_actor_with_the_local_bytes(
    cluster, tiny_tokenizers, tmp_path
):
    """The GPU actor (on the second node's logical GPU) killed mid-run: the driver replaces it,
    the jobs that were calling it are sent again, and the folder is the local engine's."""
    many_images(tmp_path / "many", 24, size=64)
    raw = tmp_path / "raw"
    assert ingest(raw, [f"images:{tmp_path / 'many'}"], shard_max_samples=1)["finalized"]
    text, visual = tiny_tokenizers
    local, remote = tmp_path / "local", tmp_path / "ray"
    tokenize(raw, local, text, visual)

    cmd = [sys.executable, "-m", "data.cli", "tokenize", "--in", str(raw), "--out", str(remote)]
    cmd += ["--tokenizer", str(text), "--visual-tokenizer", str(visual), "--no-progress"]
    cmd += ["--engine", "ray", "--ray-address", cluster.address]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    killed, busy = None, False
    deadline = time.monotonic() + 240
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        if len(list((remote / ".tokenize").glob("*.json"))) >= 2:  # mid-run: most jobs to come
            encoding = cluster.worker_pids("ray::VisualActor.encode")
            actors = encoding or cluster.worker_pids("ray::VisualActor")
            if actors:
                killed, busy = actors[0], bool(encoding)
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.005)
    out, err = proc.communicate(timeout=300)
    assert killed is not None, f"no GPU actor seen to kill:\n{err[-2000:]}"
    assert proc.returncode == 0, err[-3000:]
    assert "GPU actor 0: no CUDA device visible" in err  # the fallback says so
    assert "1 GPU actor(s) replaced" in err, (busy, err[-3000:])
    assert "a GPU actor it called died" in err and "sent again" in err
    assert folder_bytes(remote, ".tokenize") == folder_bytes(local, ".tokenize")


def test_ingest_on_ray_into_s3_gives_the_actors_the_drivers_settings(
    cluster, planted_corpus, tmp_path
):
    """The cluster's nodes were started without the S3 endpoint and credentials, as an
    engineer's cluster often is: the actors get the driver's, and write the local bytes."""
    pytest.importorskip("moto")
    from s3_server import s3_with_bucket

    local = tmp_path / "local"
    ingest(local, planted_corpus["sources"], shard_max_samples=2)
    with s3_with_bucket() as s3:
        assert not set(s3.env) & set(ENV)  # the nodes' environment has none of them
        s = ingest(
            "s3://bucket/raw",
            planted_corpus["sources"],
            shard_max_samples=2,
            engine=EngineConfig("ray", address=cluster.address),
        )
        assert s["finalized"]
        import fsspec

        fs = fsspec.filesystem("s3")
        remote = tmp_path / "remote"
        fs.get("bucket/raw", str(remote), recursive=True)
    assert folder_bytes(remote, ".ingest") == folder_bytes(local, ".ingest")


def test_a_nodes_own_storage_settings_win_over_the_drivers_unless_asked(
    tmp_path_factory, monkeypatch
):
    """Nodes started with credentials of their own (here AWS_PROFILE) keep them, and take none
    of the driver's (AWS_ACCESS_KEY_ID would win over the profile); settings they lack (a
    region) come from the driver. Before, every actor got all the driver's over its node's.
    --ray-storage-env driver asks for the driver's alone."""
    from data.engine import run_jobs

    monkeypatch.setenv("AWS_PROFILE", "driver-profile")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "driver-key")
    monkeypatch.setenv("AWS_REGION", "driver-region")
    own = LocalCluster(tmp_path_factory.mktemp("r"), env={"AWS_PROFILE": "node-profile"}).start()
    try:
        names = ["AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_REGION"]
        for storage_env, seen in [
            ("node", ["node-profile", None, "driver-region"]),
            ("driver", ["driver-profile", "driver-key", "driver-region"]),
        ]:
            engine = EngineConfig("ray", address=own.address, storage_env=storage_env)
            got = run_jobs(os.getenv, names, engine)  # in the order the jobs finish
            assert sorted(got, key=str) == sorted(seen, key=str)
    finally:
        own.stop()


def test_workers_bounds_the_actors_on_ray_one_included(cluster, tmp_path):
    (tmp_path / "in").mkdir()
    for name in "abc":  # three shard jobs: room for more than one actor
        (tmp_path / "in" / f"{name}.txt").write_text(f"some prose {name}")
    cmd = [sys.executable, "-m", "data.cli", "ingest", "--source", f"text:{tmp_path / 'in'}"]
    cmd += ["--engine", "ray", "--ray-address", cluster.address, "--no-progress"]
    cmd += ["--shard-samples", "1"]
    one = subprocess.run(
        cmd + ["--out", str(tmp_path / "one"), "--workers", "1"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert one.returncode == 0 and "ray: 1 CPU actor(s)" in one.stderr, one.stderr[-2000:]


def test_an_address_where_no_ray_answers_is_refused_before_any_work(tmp_path):
    """ray.init would retry such an address for minutes; the command says so at once."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some prose")
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "data.cli", "ingest", "--out", str(tmp_path / "out")]
    cmd += ["--source", f"text:{tmp_path / 'src'}", "--engine", "ray", "--ray-address", address]
    run = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"--ray-address {address}: no Ray cluster answers there" in run.stderr
    assert not (tmp_path / "out").exists()


def test_an_ipv6_head_address_is_checked_without_its_brackets():
    import socket

    from data.engine.ray import check_address

    try:
        head = socket.socket(socket.AF_INET6)
        head.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with head:
        head.listen()
        check_address(f"[::1]:{head.getsockname()[1]}")  # something answers: accepted


def test_a_lost_node_leaves_its_jobs_to_the_others(cluster, capfd):
    """The second node fails in the middle of a job: the job is sent again and the head's actor
    runs the rest; the replacement actor, waiting for the lost CPU, is given no job (it had been
    given the job sent again, and the run waited until a node joined). Last in this file: the
    cluster keeps one node."""
    from data.engine.ray import run_ray

    def job(i: int) -> int:
        time.sleep(0.3)
        return i * i

    engine = EngineConfig(kind="ray", address=cluster.address)
    got, lost = [], False
    for result in run_ray(job, list(range(16)), engine):
        got.append(result)
        if not lost and cluster.worker_pids("ray::PrepWorker.run", node=1):  # mid-job
            cluster.lose_node(1)
            lost = True
    err = capfd.readouterr().err
    assert lost and sorted(got) == [i * i for i in range(16)], err[-3000:]
    assert "ray: 2 CPU actor(s) over 2 node(s)" in err
    assert "its worker died on node 127.0.0.3" in err and "sent again" in err
