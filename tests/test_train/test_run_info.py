"""train/callbacks/run_info.py: what RUN_DIR/launches.jsonl says of the code and the launch."""

from __future__ import annotations

import subprocess

from train.callbacks.run_info import code_commit, nodes


def git(repo, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_code_commit_and_whether_tracked_files_differ(tmp_path):
    repo = tmp_path / "checkout"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git(repo, "rev-parse", "HEAD")
    (repo / "untracked.py").write_text("")  # not the code that ran: not a change
    assert code_commit(repo) == (head, False)
    (repo / "a.py").write_text("x = 2\n")
    assert code_commit(repo) == (head, True)
    assert not (repo / ".git" / "index.lock").exists()
    assert code_commit(tmp_path) == (None, None)  # an installed copy: no checkout


def test_nodes_come_from_the_launchers_processes_per_node(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert nodes(16) is None  # no launcher said: not guessed
    monkeypatch.setenv("LOCAL_SIZE", "8")  # DeepSpeed's launcher
    assert nodes(16) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's
    assert nodes(16) == 4
