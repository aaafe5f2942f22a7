"""Ray's files are out of other local users' reach (issue 31, attack 5).

Ray makes its temp dir and what it creates there (session folders, sockets/, logs/) mode 0777
without the sticky bit, so that users may share /tmp/ray: there another local user renamed a
raylet's socket and planted a file in its logs. pdcluster puts Ray's temp dir inside a folder of
the cluster user's alone, /tmp/pdcluster-ray-<uid> (0700): `pdcluster serve`'s head
(`start_ray`), `RayHead` and every `ray start` of the cluster YAMLs.
"""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from stranger import can_be_stranger, needs_stranger, run_as_stranger

from deploy import ray_head
from deploy.ray_head import RayTempDirError, local_cluster_address, private_ray_root

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAMLS = sorted((REPO / "deploy" / "clusters").glob("*.yaml"))

# Started as `pdcluster serve` starts its head, in a process of its own: prints where Ray put its
# session, then holds the head until its stdin closes.
HEAD_SCRIPT = """
import json, sys
import ray
from deploy.ray_head import start_ray
start_ray(None)
node = ray._private.worker.global_worker.node
print(json.dumps({"session_dir": node.get_session_dir_path(), "raylet_socket": node.raylet_socket_name,
                  "plasma_socket": node.plasma_store_socket_name}), flush=True)
sys.stdin.read()
ray.shutdown()
"""

# What the stranger tries on each target: list the session folder, rename the raylet's socket,
# plant a file in the logs. Each result is "done" or the exception's name.
STRANGER_SCRIPT = """
import os

def attempt(action):
    try:
        action()
        return "done"
    except OSError as exc:
        return type(exc).__name__

results = {}
for name, target in ARGS["targets"].items():
    results[name] = {
        "list_session": attempt(lambda: os.listdir(target["session_dir"])),
        "rename_socket": attempt(lambda: os.rename(target["raylet_socket"], target["raylet_socket"] + ".x")),
        "plant_log": attempt(lambda: open(os.path.join(target["logs_dir"], "planted.log"), "x").close()),
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def serve_head():
    """A Ray head started by `start_ray(None)` (`pdcluster serve` without --address)."""
    process = subprocess.Popen([sys.executable, "-c", HEAD_SCRIPT], cwd=REPO, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"the head did not start ({process.wait(60)})")
        yield json.loads(line)
    finally:
        process.stdin.close()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_serves_head_keeps_its_files_in_the_private_folder(serve_head):
    root = private_ray_root()
    session = Path(serve_head["session_dir"])
    assert session.parent == root / ray_head.RAY_TEMP_DIR_NAME
    status = os.lstat(root)
    assert stat.S_IMODE(status.st_mode) == 0o700 and status.st_uid == os.getuid()
    for socket_path in (serve_head["raylet_socket"], serve_head["plasma_socket"]):
        assert Path(socket_path).is_relative_to(session) and len(socket_path.encode()) < 107


@pytest.mark.slow
@needs_stranger
def test_a_stranger_can_neither_list_rename_nor_plant(serve_head):
    # The control: the same tree with Ray's own modes (0777, no sticky bit) outside the private
    # folder, where the stranger's script must succeed, or its refusals would prove nothing.
    control = Path(tempfile.mkdtemp(prefix="pdc-ray-control-", dir="/tmp"))
    try:
        (control / "sockets").mkdir()
        (control / "logs").mkdir()
        (control / "sockets" / "raylet").touch()
        for folder in (control, control / "sockets", control / "logs"):
            folder.chmod(0o777)
        session = Path(serve_head["session_dir"])
        targets = {
            "ray": {"session_dir": str(session), "raylet_socket": serve_head["raylet_socket"],
                    "logs_dir": str(session / "logs")},
            "control": {"session_dir": str(control), "raylet_socket": str(control / "sockets" / "raylet"),
                        "logs_dir": str(control / "logs")},
        }
        seen = run_as_stranger(STRANGER_SCRIPT, {"targets": targets}, timeout_s=60)
    finally:
        subprocess.run(["rm", "-rf", str(control)], check=False)
    assert seen["control"] == {"list_session": "done", "rename_socket": "done", "plant_log": "done"}
    assert seen["ray"] == {"list_session": "PermissionError", "rename_socket": "PermissionError",
                           "plant_log": "PermissionError"}
    assert Path(serve_head["raylet_socket"]).is_socket()
    assert not (session / "logs" / "planted.log").exists()


def test_a_link_another_users_folder_or_an_open_one_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(RayTempDirError, match="not a folder of this user's"):
        private_ray_root(link)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(RayTempDirError, match="open to other users"):
        private_ray_root(open_folder)
    if can_be_stranger:  # root: a folder given to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4242, 4242)
        with pytest.raises(RayTempDirError, match="not a folder of this user's"):
            private_ray_root(theirs)
    fresh = private_ray_root(tmp_path / "fresh")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_a_planted_root_moves_serves_head_to_a_fresh_private_folder(tmp_path, monkeypatch):
    planted = tmp_path / f"pdcluster-ray-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)  # as another user's folder would be open to them
    monkeypatch.setattr(ray_head, "PRIVATE_RAY_ROOT_PREFIX", str(tmp_path / "pdcluster-ray-"))
    temp_dir = ray_head._own_ray_temp_dir()
    try:
        assert temp_dir.parent != planted and temp_dir.name == ray_head.RAY_TEMP_DIR_NAME
        status = os.lstat(temp_dir.parent)
        assert stat.S_IMODE(status.st_mode) == 0o700 and status.st_uid == os.getuid()
    finally:
        temp_dir.parent.rmdir()


def test_launch_finds_the_nodes_address_in_the_private_folder_only(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_head, "PRIVATE_RAY_ROOT_PREFIX", str(tmp_path / "pdcluster-ray-"))
    with pytest.raises(ConnectionError, match="ray_current_cluster"):
        local_cluster_address()
    (ray_head.ray_temp_dir()).mkdir()
    (ray_head.ray_temp_dir() / "ray_current_cluster").write_text("10.0.0.1:6379\n")
    assert local_cluster_address() == "10.0.0.1:6379"


def test_the_fd_limit_ray_inherits_is_raised_as_far_as_allowed():
    # In a process of its own, from a login shell's usual soft limit.
    script = ("import resource\nfrom deploy.ray_head import raise_fd_limit\n"
              "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))\n"
              "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          check=True)
    returned, soft = map(int, done.stdout.split())
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert returned == soft >= min(ray_head.RAY_FD_LIMIT, hard)


def test_ray_heads_temp_dir_is_in_the_private_folder():
    from loadtest.local_cluster import RayHead

    head = RayHead()
    try:
        assert head._temp_dir.parent == private_ray_root()
    finally:
        head.stop()
    assert not head._temp_dir.exists()


# --- the cluster YAMLs' `ray start` commands, run by bash with a `ray` that records its calls ----

FAKE_UID = 4242424
"""`id -u` in these runs: the private folder they make is /tmp/pdcluster-ray-4242424, never ours."""


def _start_commands(path: Path) -> list[tuple[str, list[str]]]:
    config = yaml.safe_load(path.read_text())
    return [(key, config[key]) for key in ("head_start_ray_commands", "worker_start_ray_commands")]


def _run_start_commands(commands: list[str], home: Path) -> tuple[int, str, list[dict]]:
    """Run `commands` as `ray up` would (bash, one shell each), with `ray` and `id -u` faked;
    returns the last exit status and error output, and the fake `ray`'s calls (argv, RAY_TMPDIR,
    its soft descriptor limit)."""
    bin_dir = home / "pdcluster" / ".venv" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls = home / "calls.jsonl"
    (bin_dir / "ray").write_text(f"#!{sys.executable}\nimport json, os, resource, sys\n"
                                 f"open({str(calls)!r}, 'a').write(json.dumps({{'argv': sys.argv[1:], "
                                 "'tmpdir': os.environ.get('RAY_TMPDIR'), "
                                 "'fd_limit': resource.getrlimit(resource.RLIMIT_NOFILE)[0]}) + '\\n')\n")
    shims = home / "shims"
    shims.mkdir(exist_ok=True)
    (shims / "id").write_text(f'#!/bin/sh\n[ "$1" = "-u" ] && echo {FAKE_UID} && exit 0\n'
                              'exec /usr/bin/id "$@"\n')
    for script in (bin_dir / "ray", shims / "id"):
        script.chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{shims}:/usr/bin:/bin", "PDCLUSTER_HOME": str(home / "pdcluster"),
           "SSH_CONNECTION": "10.77.0.9 50000 10.77.0.2 22", "RAY_HEAD_IP": "10.77.0.1"}
    done = None
    for command in commands:
        # A login shell's usual soft limit: the command must raise it for Ray (RAY_FD_LIMIT).
        done = subprocess.run(["bash", "-c", f"ulimit -Sn 1024; {command}"], env=env, capture_output=True,
                              text=True)
        if done.returncode:
            break
    lines = calls.read_text().splitlines() if calls.exists() else []
    return done.returncode, done.stderr, [json.loads(line) for line in lines]


@pytest.fixture
def fake_root():
    """/tmp/pdcluster-ray-<FAKE_UID>, removed before and after."""
    root = Path(f"{ray_head.PRIVATE_RAY_ROOT_PREFIX}{FAKE_UID}")
    subprocess.run(["rm", "-rf", str(root)], check=True)
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=True)


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_the_yamls_start_ray_with_its_files_in_the_private_folder(path, tmp_path, fake_root):
    for key, commands in _start_commands(path):
        status, errors, calls = _run_start_commands(commands, tmp_path / key)
        assert status == 0, errors
        (start,) = [call for call in calls if call["argv"][:1] == ["start"]]
        temp_dirs = [arg.split("=", 1)[1] for arg in start["argv"] if arg.startswith("--temp-dir=")]
        assert len(temp_dirs) == 1 and Path(temp_dirs[0]).parent == fake_root, key
        assert start["tmpdir"] == str(fake_root), key
        hard_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        assert start["fd_limit"] >= min(ray_head.RAY_FD_LIMIT, hard_limit), key
        if key == "head_start_ray_commands":  # where `pdcluster launch` looks for the head's address
            assert Path(temp_dirs[0]).name == ray_head.RAY_TEMP_DIR_NAME
        status = os.lstat(fake_root)
        assert stat.S_ISDIR(status.st_mode) and stat.S_IMODE(status.st_mode) == 0o700
        assert status.st_uid == os.getuid()


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
@pytest.mark.parametrize("planted", ["link", "open"])
def test_the_yamls_refuse_a_planted_or_open_folder(path, planted, tmp_path, fake_root):
    if planted == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        fake_root.symlink_to(tmp_path / "elsewhere")
    else:
        fake_root.mkdir()
        fake_root.chmod(0o777)
    for key, commands in _start_commands(path):
        status, errors, calls = _run_start_commands(commands, tmp_path / key)
        assert status != 0 and "must be a folder of" in errors, key
        assert not [call for call in calls if call["argv"][:1] == ["start"]], key
