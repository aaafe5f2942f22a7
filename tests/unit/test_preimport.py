"""engine/preimport.py: a server process that imports first and serves only when told (its
spawned and forked children included: they never wait for a start of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.environment import ENGINE_CHILDREN_FORK_ENV
from engine.preimport import (
    CPU_WORKER_MODULES,
    CUDA_WORKER_MODULES,
    ENGINE_CORE_MODULES,
    PREIMPORTED_MARK,
    forked_children_modules,
)

ROOT = Path(__file__).resolve().parents[2]
SERVER = '''
import json, multiprocessing, sys
print("imported", flush=True)

def child(path):
    open(path, "w").write(sys.modules["__main__"].__name__)

def serve(args):
    out, child_out, method = args
    process = multiprocessing.get_context(method).Process(target=child, args=(child_out,))
    process.start()
    process.join(60)
    open(out, "w").write(json.dumps({"args": args, "child_exit": process.exitcode}))
'''


def _gated(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    (tmp_path / "probe_server.py").write_text(SERVER)
    env = {**os.environ, **(env or {}), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    return subprocess.Popen([sys.executable, "-m", "engine.preimport", "probe_server", *args], env=env, cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("method", ["spawn", pytest.param("fork", marks=pytest.mark.slow)])  # fork: vLLM's core imported
def test_the_server_runs_only_when_told_and_its_children_run(tmp_path, method):
    """Spawned (vLLM's workers on the CPU build) or forked (its engine core) children both run."""
    out, child_out = tmp_path / "out.json", tmp_path / "child.txt"
    process = _gated(tmp_path, str(out), str(child_out), method,
                     env={"VLLM_WORKER_MULTIPROC_METHOD": method})
    assert process.stdout.readline().strip() == "imported"  # the module itself, imported first
    assert process.stdout.readline().strip() == PREIMPORTED_MARK
    assert not out.exists()  # imported, not run
    process.stdin.write("start\n")
    process.stdin.flush()
    assert process.wait(60) == 0
    result = json.loads(out.read_text())
    assert result["args"] == [str(out), str(child_out), method]
    # A spawned child imports the gate again as its main module, under another name: it does not
    # wait for a start of its own.
    assert result["child_exit"] == 0
    assert child_out.read_text() == ("__mp_main__" if method == "spawn" else "__main__")


def test_end_of_input_ends_the_process_without_running_the_server(tmp_path):
    out = tmp_path / "out.json"
    process = _gated(tmp_path, str(out), str(tmp_path / "child.txt"), "spawn")
    assert process.stdout.readline().strip() == "imported"
    process.stdin.close()  # its owner is gone
    assert process.wait(60) == 0
    assert not out.exists()


def test_the_engine_host_imports_neither_vllm_nor_torch():
    """The host (a Ray actor) only launches the server process, which imports them; imported in the
    actor too they would add ~10 s on two cores to every start before the server's own imports."""
    code = "import sys, engine.host; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(("env", "modules"), [
    ({}, ()),
    ({ENGINE_CHILDREN_FORK_ENV: "1"}, ENGINE_CORE_MODULES + CPU_WORKER_MODULES),  # the CPU build
    ({"VLLM_WORKER_MULTIPROC_METHOD": "fork"}, ENGINE_CORE_MODULES + CUDA_WORKER_MODULES),  # CUDA
])
def test_a_server_imports_ahead_what_its_forked_children_run(monkeypatch, env, modules):
    for name in (ENGINE_CHILDREN_FORK_ENV, "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert forked_children_modules() == modules


@pytest.mark.parametrize(("env", "cores"), [
    ({"OMP_PLACES": "{2,3}", "OMP_NUM_THREADS": "2"}, {2, 3}),  # no runtime preloaded
    ({"LD_PRELOAD": "/torch/lib/libgomp.so.1", "GOMP_CPU_AFFINITY": "1", "OMP_PLACES": "{0}"}, {1}),
    ({"LD_PRELOAD": "libiomp5.so", "KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5]"}, {4, 5}),
    ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, set()),
])
def test_a_forked_cpu_worker_finds_its_cores_where_vllm_set_them_for_its_openmp_runtime(env, cores):
    from engine.serving import omp_cores

    assert omp_cores(env) == cores
