"""Runs tests/tp_faults.py in a subprocess with a deadline and hands its per-scenario records to
the tests (test_tp_faults.py on CPU, test_tp_gpu.py on CUDA)."""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from conftest import REPO

HERE = os.path.dirname(os.path.abspath(__file__))


def run_scenarios(model: str, device: str, scenarios: list[str], timeout_s: float, scenario_s: float = 90):
    """Return results(name) -> that scenario's record. Each scenario must finish within scenario_s
    and all within timeout_s: one that does not (a hang), or that crashes the process, fails the
    test that asks for it with the process's output; its process (with its workers) is killed and
    the scenarios after it run in a fresh one."""
    records, failures, left = {}, {}, list(scenarios)
    deadline = time.monotonic() + timeout_s
    while left:
        stdout, stderr, how = _run(model, device, left, scenario_s, deadline)
        for line in stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                records[record["scenario"]] = record
        left = [name for name in left if name not in records]
        if left:   # the first one left hung or ended its process
            failures[left.pop(0)] = f"{how}; output:\n{stdout[-3000:]}\n{stderr[-8000:]}"
        if left and time.monotonic() >= deadline:
            failures.update({name: f"not run: the {timeout_s} s deadline passed" for name in left})
            break

    def results(name: str) -> dict:
        if name in failures:
            raise AssertionError(f"scenario {name} did not finish: {failures[name]}")
        assert "crashed" not in records[name], records[name]["crashed"]
        return records[name]
    return results


def _run(model: str, device: str, scenarios: list[str], scenario_s: float, deadline: float):
    """Run tests/tp_faults.py on the scenarios until it exits, or until one scenario has taken
    scenario_s (or the deadline passed): then kill its process group (the scenario process and
    its workers, stopped ones too). Returns (stdout, stderr, how it ended)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.path.join(HERE, "worker_faults"), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile() as err:   # a file: a pipe nobody reads could fill and block it
        script = os.path.join(HERE, "tp_faults.py")
        proc = subprocess.Popen([sys.executable, script, model, device, *scenarios], env=env,
                                stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        out = b""
        until = min(deadline, time.monotonic() + scenario_s)
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, until - time.monotonic()))
            if not ready:   # where is it stuck? every process of the group prints its stacks, then dies
                states = _thread_states(proc.pid)
                os.killpg(proc.pid, signal.SIGUSR1)
                time.sleep(2)
                os.killpg(proc.pid, signal.SIGKILL)
                how = (f"killed after {scenario_s} s on it (or at the deadline); its threads' states "
                       f"(D: in the kernel, where no signal is handled):\n{states}\nits stacks are below")
                break
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                how = f"the process ended with exit code {proc.wait()}"
                break
            if b"\n" in chunk:   # a scenario finished: the next one's time starts
                until = min(deadline, time.monotonic() + scenario_s)
            out += chunk
        proc.wait()
        proc.stdout.close()
        err.seek(0)
        return out.decode(errors="replace"), err.read().decode(errors="replace"), how


def _thread_states(sid: int) -> str:
    """ps's view of every thread of the session (the scenario process and its workers): each one's
    state and the kernel function it waits in."""
    try:
        return subprocess.run(["ps", "-L", "--sid", str(sid), "-o", "pid,tid,stat,wchan:32,comm"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"(ps failed: {e})"


def assert_no_leftovers(record: dict, exited: bool = False):
    """Shut down (twice) without error and within seconds, no worker process, nothing of the engine's
    in /dev/shm (the machine's /dev/shm is shared with other processes, so the check looks at what the
    engine's processes had mapped, and at names with the scenario process's pid). exited: the
    scenario's process is gone; its workers must be too (stopped by the atexit hook)."""
    if not exited:
        assert record["shutdown"]["error"] is None, record["shutdown"]
        assert record["shutdown"]["seconds"] < 5, record["shutdown"]   # was 11 s under NCCL
        assert record["second_shutdown"]["error"] is None and record["second_shutdown"]["seconds"] < 1
        assert not record["workers_left"]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in record["pids"])
    assert not record["shm_mapped"] and not record["shm_left"]
