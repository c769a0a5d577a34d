"""A run controlled from outside, as a cluster would, with real training processes: a second run
on a live folder is refused; SIGTERM (or SIGUSR1, on any one rank) checkpoints at the next step
and exits 0; the resume lists the config changes and refuses those that break an exact resume
unless told; in epoch mode a run ends cleanly where the data ends; a signal to
earlyfuse-torchrun itself ends the launcher with exit code 0 once the checkpoint is written."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_cluster import free_port
from trainrun import metrics, train

SOURCES = {"scenes": 0.3, "clips": 0.3, "text": 0.3, "code": 0.1}


def base(tokens, run_dir, steps, *extra, sources=None):
    srcs = ",".join(
        f"{{name: {s}, shards: [{tokens / s}], weight: {w}}}"
        for s, w in (sources or SOURCES).items()
    )
    return [
        "experiment=debug",
        f"data.sources=[{srcs}]",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.micro_batch=2",
        *extra,
    ]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """A training process in the background, its output in ``log`` (no pipe to fill up)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        return subprocess.Popen(
            [*cmd, "train.progress=false"], stdout=out, stderr=subprocess.STDOUT, env=env
        )


def launched(tokens, tmp_path: Path, nproc: int) -> tuple[Path, Path, subprocess.Popen]:
    """A 1000-step run under ``earlyfuse-torchrun`` with ``nproc`` workers, in the background:
    its folder, the launcher's log and its process."""
    run, log = tmp_path / "run", tmp_path / "launcher.log"
    launcher = [sys.executable, "-m", "train.launch", "--nproc_per_node", str(nproc)]
    port = ["--master_port", str(free_port())]
    args = base(tokens, run, 1000, sources={"scenes": 1.0})
    return run, log, start([*launcher, *port, "-m", "train.app", *args], log)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, log: Path) -> None:
    """Until the run has logged ``step`` (a deadline only against a hang, not a speed check)."""
    deadline = time.monotonic() + 900
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        if path.is_file() and any(
            json.loads(ln)["step"] >= step for ln in path.read_text().splitlines() if ln.strip()
        ):
            return
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"no step {step} in time:\n{log.read_text()[-4000:]}")


def test_live_folder_refused_sigterm_checkpoints_and_the_resume_checks_config(
    tiny_tokens, tmp_path
):
    run, log = tmp_path / "run", tmp_path / "first.log"
    args = base(tiny_tokens, run, 1000, "train.ckpt_every=3")
    first = start([sys.executable, "-m", "train.app", *args], log)
    try:
        wait_for_step(run, 4, first, log)
        second = train(args, check=False)  # a real second process on the live folder
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by a live run: pid {first.pid} on host" in second.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if first.poll() is None:
            first.kill()
    out = log.read_text()
    found = re.findall(r"stopped by SIGTERM at step (\d+) of 1000 with checkpoint (step_\d+)", out)
    assert len(found) == 1, out[-3000:]  # one clear line
    stopped, tag = int(found[0][0]), found[0][1]
    assert stopped >= 4 and tag == f"step_{stopped:08d}"
    assert (run / "checkpoints" / "latest").read_text().strip() == tag  # newer than step 3's
    assert max(metrics(run)) == stopped and not (run / "final.json").exists()

    # Fewer steps on resume changes the schedule, another loader worker count the data order:
    # listed, refused, then (the steps) accepted when meant.
    more = base(tiny_tokens, run, stopped + 2, "train.ckpt_every=3")
    p = train([*more, "data.num_workers=2"], check=False)
    assert p.returncode == 2
    assert "break an exact resume: data.num_workers, train.steps" in p.stderr
    assert "data.num_workers: 0 -> 2 (breaks an exact resume)" in p.stdout
    assert f"train.steps: 1000 -> {stopped + 2} (breaks an exact resume)" in p.stdout
    finish = [*more, "data.num_workers=2", "train.allow_config_change=true"]
    p = train(finish)
    said = "the loader's state was redistributed from 1 to 2 consumers"  # same world, new split
    assert f"resuming {tag}: {said}" in p.stdout + p.stderr
    m = metrics(run)
    assert sorted(m) == list(range(1, stopped + 3))
    assert (run / "final.json").is_file()
    # A model of another shape cannot resume these weights, even when changes are allowed: one
    # line, exit 2 (torch's "size mismatch" traceback, a line per tensor, before); a width
    # is refused as such before anything is loaded
    kv = "model.attention.n_kv_heads=1"
    narrower = base(tiny_tokens, run, stopped + 4, kv, "train.allow_config_change=true")
    p = train(narrower, check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "its weights do not fit this run's model (size mismatch for" in p.stderr
    p = train(base(tiny_tokens, run, stopped + 4, "model.dim=96"), check=False)
    assert p.returncode == 2 and "changes no resume can carry: model.dim" in p.stderr
    # Fewer steps than the run has taken: nothing to train (the report read 200 %)
    fewer = base(tiny_tokens, run, stopped, "train.allow_config_change=true")
    p = train(fewer, check=False)
    assert p.returncode == 2 and f"is at step {stopped + 2} already, past train.steps" in p.stderr
    # The command again once the run is complete: said, not "steps N->N" alone, exit 0; with a
    # setting changed (a loop over settings that forgot run_dir) it is refused: it would train
    # nothing and exit 0 for every setting after the first. The run's config.yaml stays
    trained = (run / "config.yaml").read_text()
    p = train(finish)
    assert f"the run is complete (train.steps={stopped + 2}): nothing to train" in p.stdout
    p = train([*finish, "train.log_every=3"], check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    said = f"the run is complete (train.steps={stopped + 2}) and this command's config differs"
    assert f"{said} from its (train.log_every): it would train nothing" in p.stderr
    assert (run / "config.yaml").read_text() == trained


@pytest.mark.parametrize(
    "start, signals",
    [("fork", (signal.SIGTERM, signal.SIGINT)), ("forkserver", (signal.SIGTERM,))],
)
def test_signals_to_the_whole_process_group_stop_a_run_with_loader_workers_at_a_checkpoint(
    tiny_tokens, tmp_path, start, signals
):
    """torchrun, Slurm and a terminal's Ctrl-C signal a run's whole process group, its loader
    workers too (and the fork server they start from): SIGTERM and then, on the resumed run,
    SIGINT each stop it at the next step with a checkpoint, exit 0, no traceback (a worker killed
    by the signal failed the step instead)."""
    run = tmp_path / "run"
    args = base(tiny_tokens, run, 1000, "data.num_workers=1", f"data.worker_start={start}")
    stopped = [0]
    for sig in signals:
        log = tmp_path / f"{sig.name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with log.open("w") as out:
            cmd = [sys.executable, "-m", "train.app", *args, "train.progress=false"]
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            wait_for_step(run, stopped[0] + 3, proc, log)  # the resumed run: past its start
            os.killpg(proc.pid, sig)
            assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        said = log.read_text()
        stopped = [
            int(at)
            for at in re.findall(
                rf"stopped by {sig.name} at step (\d+) of 1000 with checkpoint", said
            )
        ]
        assert stopped and "Traceback" not in said, said[-4000:]
        tag = f"step_{stopped[0]:08d}"
        assert (run / "checkpoints" / "latest").read_text().strip() == tag


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tiny_tokens, tmp_path):
    run, log = tmp_path / "run", tmp_path / "torchrun.log"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    port = ["--master_port", str(free_port())]
    args = base(tiny_tokens, run, 1000, "deepspeed.zero_stage=2")
    proc = start([*launcher, *port, "-m", "train.app", *args], log)
    try:
        wait_for_step(run, 3, proc, log)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        rank1 = [
            int(c)
            for c in children
            if "RANK=1" in Path(f"/proc/{c}/environ").read_text().split("\0")
        ]
        assert len(rank1) == 1, children
        os.kill(rank1[0], signal.SIGUSR1)  # rank 1 only: rank 0 must learn it and stop with it
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    found = re.findall(r"stopped by a signal to another rank at step (\d+)", out)
    assert len(found) == 1, out[-3000:]
    tag = f"step_{int(found[0]):08d}"
    ckpt = run / "checkpoints" / tag
    assert (run / "checkpoints" / "latest").read_text().strip() == tag
    assert (ckpt / "rank_00000.pt").is_file() and (ckpt / "rank_00001.pt").is_file()


def test_epoch_mode_ends_with_the_data_and_steps_minus_one_counts_them(tiny_tokens, tmp_path):
    # The scenes source holds 5 batches of 2 rows of 256 tokens per epoch (one rank).
    scenes = {"scenes": 1.0}
    run = tmp_path / "over"
    p = train(base(tiny_tokens, run, 10, "data.mode=epoch", "train.grad_accum=2", sources=scenes))
    assert "the data ended after step 2 of 10 (data.mode=epoch)" in p.stdout
    assert "its last 1 micro-batch(es) could not fill a step of train.grad_accum=2" in p.stdout
    assert sorted(metrics(run)) == [1, 2]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    final = json.loads((run / "final.json").read_text())
    # every document read, but those of the pass's last, incomplete batch (a scene never split
    # leaves room at row ends: the 5 full batches do not hold them all)
    assert final["data/skipped"] == 0 and final["data/held_back"] == 2
    assert final["data/untrained_batches"] == 1  # the fifth batch: read, never applied

    run = tmp_path / "until_end"
    p = train(base(tiny_tokens, run, -1, "data.mode=epoch", "train.grad_accum=2", sources=scenes))
    assert "steps 0->2" in p.stdout  # 5 batches: 2 whole steps of 2 micro-batches
    assert sorted(metrics(run)) == [1, 2] and (run / "final.json").is_file()
    # The fifth batch's documents were never trained on: said, and counted in final.json
    held = json.loads((run / "final.json").read_text())["data/held_back"]
    assert held > 0 and f"data: {held:.0f} document(s) of the epoch were not delivered" in p.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    p = train(base(tiny_tokens, tmp_path / "inf", -1, sources=scenes), check=False)
    assert (
        p.returncode == 2
        and "train.steps=-1 (until the data ends) needs data.mode=epoch" in p.stderr
    )


def test_a_run_until_the_data_ends_resumed_on_another_split_trains_the_rest_of_the_epoch(
    tiny_tokens, tmp_path
):
    """train.steps=-1 resumed with another micro batch (as on another world size): the run's
    length is the steps done plus what the redistributed position holds, the lr schedule
    stretched to it; counted afresh on the new split it stopped a third of the epoch early."""
    scenes = {"scenes": 1.0}  # 11 rows of 256 tokens per epoch (one rank)
    args = ["data.mode=epoch", "train.ckpt_every=2", "train.keep_last=9", "train.micro_batch=1"]
    args.append("optim.warmup_steps=1")  # step 2 past the warmup, where the length matters
    first = tmp_path / "first"
    train(base(tiny_tokens, first, -1, *args, sources=scenes))
    whole = metrics(first)
    run = tmp_path / "resumed"
    shutil.copytree(first, run)
    (run / "metrics.jsonl").unlink()  # this run's steps only
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    for later in (run / "checkpoints").glob("step_*"):
        if later.name != "step_00000002":
            shutil.rmtree(later)
    again = base(
        tiny_tokens,
        run,
        -1,
        *args,
        "train.micro_batch=2",
        "train.allow_config_change=true",
        sources=scenes,
    )
    p = train(again)
    out = p.stdout + p.stderr
    assert "the loader's state was redistributed (micro_batch 1 -> 2)" in out
    left = len(whole) - 2  # rows left after step 2, two a step now
    assert f"the data holds {left // 2} more step(s) from here" in out
    assert f"steps 2->{2 + left // 2}" in out
    assert "; the lr goes on at " in out  # the schedule, stretched, is at another point
    resumed = metrics(run)
    last = max(resumed)
    assert last == 2 + left // 2
    assert resumed[last]["optim/lr"] == pytest.approx(whole[max(whole)]["optim/lr"])  # annealed

    # Its checkpoints keep that length: resumed again, mid-way, it ends as it did; at its end,
    # it is complete
    later = tmp_path / "resumed_again"
    shutil.copytree(run, later)
    (later / "checkpoints" / "latest").write_text("step_00000004\n")
    shutil.rmtree(later / "checkpoints" / f"step_{last:08d}")
    p = train([f"run_dir={later}" if a.startswith("run_dir=") else a for a in again])
    assert f"steps 4->{last}" in p.stdout + p.stderr
    for step in range(5, last + 1):
        assert metrics(later)[step]["train/loss"] == resumed[step]["train/loss"], step
        assert metrics(later)[step]["optim/lr"] == resumed[step]["optim/lr"], step
    p = train(again)
    assert "the run is complete" in p.stdout + p.stderr

    # train.resume=false beside that run's checkpoints would mix two runs' checkpoints
    p = train(base(tiny_tokens, run, 4, "train.resume=false"), check=False)
    assert p.returncode == 2 and "train.resume=false, but" in p.stderr, p.stderr[-2000:]
    assert "give another run_dir" in p.stderr and max(metrics(run)) == last
    # (the debug preset's warmup outlasts those 4 steps: said at start)
    assert "optim.warmup_steps=5 is not below the run's 4 steps" in p.stdout + p.stderr


def test_earlyfuse_torchrun_exits_0_when_its_signal_stopped_the_run_after_a_checkpoint(
    tiny_tokens, tmp_path
):
    """A signal to the launcher itself, as a scheduler sends it. Before, with plain torchrun:
    'SignalException: Process ... got signal: 15' and exit code 1 although every worker had saved
    and exited 0 (and a SIGUSR1, which torchrun does not handle by default, killed torchrun)."""
    run, log, proc = launched(tiny_tokens, tmp_path, nproc=1)
    try:
        wait_for_step(run, 2, proc, log)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    found = re.findall(r"stopped by SIGUSR1 at step (\d+) of 1000 with checkpoint (step_\d+)", out)
    assert len(found) == 1, out[-3000:]
    assert (
        "earlyfuse-torchrun: SIGUSR1: every worker stopped after its checkpoint; exit code 0" in out
    )
    assert (run / "checkpoints" / "latest").read_text().strip() == found[0][1]


def test_a_worker_whose_launcher_was_killed_with_minus_9_stops_with_a_checkpoint(
    tiny_tokens, tmp_path
):
    """``kill -9`` of earlyfuse-torchrun. Before: its worker (in a session of its own) trained on
    to the last step, holding the run folder: the same command again was refused ('in use by a
    live run: pid ...')."""
    run, log, proc = launched(tiny_tokens, tmp_path, nproc=1)
    wait_for_step(run, 2, proc, log)
    worker = json.loads((run / "run.lock").read_text())["pid"]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 600  # against a hang only: the worker finishes its step
    try:
        while time.monotonic() < deadline and Path(f"/proc/{worker}").exists():
            time.sleep(0.5)
        assert not Path(f"/proc/{worker}").exists(), log.read_text()[-3000:]
    finally:
        if Path(f"/proc/{worker}").exists():
            os.kill(worker, signal.SIGKILL)
    found = re.findall(
        r"stopped by SIGTERM at step (\d+) of 1000 with checkpoint (step_\d+)", log.read_text()
    )
    assert len(found) == 1, log.read_text()[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == found[0][1]


def test_a_rank_killed_by_a_signal_is_named_in_one_line_and_its_peer_says_why_it_stopped(
    tiny_tokens, tmp_path
):
    """Rank 1 killed by SIGKILL (the out-of-memory killer). Before: rank 0's 'Error executing
    job with overrides' with its cause cut off, then torchrun's ChildFailedError traceback and
    exit code 1, the rank and the signal in its table."""
    run, log, proc = launched(tiny_tokens, tmp_path, nproc=2)
    try:
        wait_for_step(run, 2, proc, log)
        rank0 = json.loads((run / "run.lock").read_text())["pid"]
        workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        (rank1,) = [int(pid) for pid in workers if int(pid) != rank0]
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(timeout=600) == 128 + signal.SIGKILL, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert f"earlyfuse-torchrun: rank 1 (pid {rank1}) was killed by SIGKILL" in out, out[-3000:]
    assert "earlyfuse-train: rank 0 lost the other ranks in a collective" in out, out[-3000:]
    assert "The same command again resumes the run" in out and "Traceback" not in out


def test_a_node_whose_peer_launcher_was_killed_exits_0_without_torchruns_300_s_wait(
    tiny_tokens, tmp_path
):
    """Two nodes on this host (one worker each, one SP group of 2); ``kill -9`` of the second
    node's launcher. Every rank stops after one checkpoint; the first node's launcher then
    waited 300 s at torchrun's exit barrier for the dead one and logged a traceback, exit code
    0 with no word of why."""
    run, logs = tmp_path / "run", [tmp_path / "node0.log", tmp_path / "node1.log"]
    rdzv = ["--rdzv_id", "two", "--rdzv_backend", "c10d"]
    rdzv += ["--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    launcher = [sys.executable, "-m", "train.launch", "--nnodes", "2", "--nproc_per_node", "1"]
    args = base(tiny_tokens, run, 1000, "train.sequence_parallel=2", sources={"scenes": 1.0})
    # The first node holds the rendezvous store (as a cluster's head node would): torchrun's
    # rendezvous goes down with the node that holds it, whatever this launcher does
    hosts = [["--rdzv_conf", f"is_host={host}"] for host in ("true", "false")]
    nodes = [
        start([*launcher, *rdzv, *host, "-m", "train.app", *args], log)
        for host, log in zip(hosts, logs)
    ]
    try:
        wait_for_step(run, 2, nodes[0], logs[0])
        nodes[1].kill()
        # torchrun's own 300 s wait ends past this deadline; the bounded one, 30 s, well before
        assert nodes[0].wait(timeout=200) == 0, logs[0].read_text()[-3000:]
        out = logs[0].read_text()
        assert "earlyfuse-torchrun: every worker stopped after its checkpoint" in out
        assert "Error waiting on exit barrier" not in out and "Traceback" not in out
        tag = (run / "checkpoints" / "latest").read_text().strip()
        both = out + logs[1].read_text()  # rank 0, which says it, runs on either node
        assert re.search(rf"stopped by a signal to another rank at step \d+ .*{tag}", both), both
        # one process a node under SP 2: the group spans the nodes, said before it runs
        assert "train.sequence_parallel=2 with 1 process(es) a node: some SP groups span" in both
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()


def test_earlyfuse_torchrun_passes_on_a_workers_refusal_as_exit_code_2(tmp_path):
    """Before: torchrun's ChildFailedError traceback and exit code 1 (a scheduler requeues that)
    under the worker's one line."""
    # Two workers refusing alike (the SP degree against the world size): one line, not two
    two = [sys.executable, "-m", "train.launch", "--nproc_per_node", "2"]
    args = ["experiment=debug", f"run_dir={tmp_path / 'sp'}", "train.sequence_parallel=4"]
    port = ["--master_port", str(free_port())]
    p = subprocess.run(
        [*two, *port, "-m", "train.app", *args], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count("train.sequence_parallel=4 does not divide the number of processes") == 1
    assert re.search(r"earlyfuse-torchrun: rank [01] exited with code 2", p.stderr), p.stderr
    assert "Traceback" not in p.stderr
    # and so does a key refused before the ranks can talk
    p = subprocess.run(
        [*two, "--master_port", str(free_port()), "-m", "train.app", *args[:2], "train.stepz=3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count("earlyfuse-train: unknown config key(s): train.stepz") == 1, p.stderr
    # A run folder each rank resolves for itself (Hydra's ${now:}): before, each rank wrote its
    # own, the run exited 0 and its checkpoints could not be resumed
    per_rank = f"run_dir={tmp_path}/ts_${{now:%H%M%S%f}}"
    p = subprocess.run(
        [*two, "--master_port", str(free_port()), "-m", "train.app", args[0], per_rank],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.count("earlyfuse-train: run_dir differs between ranks (rank 0: ") == 1
    assert not list(tmp_path.glob("ts_*"))


def test_a_sigterm_while_the_run_starts_stops_it_after_step_1_with_a_checkpoint(
    tiny_tokens, tmp_path
):
    """The signal comes before the trainer exists (the fault sends it while train.app builds
    the run). Before: the default action, the process died of it (exit code -15) with nothing
    saved and the message of a crash."""
    run = tmp_path / "run"
    p = train(base(tiny_tokens, run, 1000), check=False, faults={"sigterm_at_start": 1})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "stopped by SIGTERM at step 1 of 1000 with checkpoint step_00000001" in p.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert max(metrics(run)) == 1 and not (run / "final.json").exists()


def test_a_signal_kept_while_one_run_started_is_not_the_next_runs():
    """listen_from_start keeps a SIGUSR1 that arrives before the trainer's handler; a second run
    in the same process (a Hydra multirun, a test) starts with none kept."""
    import os
    import signal

    from train.callbacks import preemption

    before = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    try:
        preemption.listen_from_start()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption._early == ["SIGUSR1"]
        preemption.listen_from_start()
        assert preemption._early == []
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        preemption._original.clear()


def test_a_launchers_death_after_it_passed_a_sigterm_on_does_not_end_the_run_unsaved():
    """torchrun passes a SIGTERM on and then dies (signalled again, or killed with -9 while it
    waits): the worker's own SIGTERM for the launcher's death would be the second one, which ends
    the run at once, without the checkpoint the first one asked for."""
    script = """
import os, signal, torch
from train.callbacks import preemption as p
for stage in ("while starting", "while training"):
    p._orphaned.clear()
    p.listen_from_start()
    p.stop_with_launcher()
    if stage == "while training":
        trainer_handler = p.Preemption(device=torch.device("cpu"))
        trainer_handler.pre_train(None, 0)
    os.kill(os.getpid(), signal.SIGTERM)  # passed on by the launcher
    p._launcher_died(int(signal.SIGUSR2), None)  # then it dies, announced by two threads
    p._launcher_died(int(signal.SIGUSR2), None)
    print(stage, p._early, flush=True)
p.listen_from_start()  # no stop pending: its death alone is one SIGTERM, which stops the run
p._orphaned.clear()
p._launcher_died(int(signal.SIGUSR2), None)
p._launcher_died(int(signal.SIGUSR2), None)
print("alone", p._early, flush=True)
"""
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert p.stdout.splitlines() == [
        "while starting ['SIGTERM']",
        "while training ['SIGTERM']",
        "alone ['SIGTERM']",
    ]
