"""Runs tests/tp_faults.py in a subprocess with a deadline and hands its per-scenario records to
the tests (test_tp_faults.py on CPU, test_tp_gpu.py on CUDA)."""
import json
import os
import subprocess
import sys

from conftest import REPO

HERE = os.path.dirname(os.path.abspath(__file__))


def run_scenarios(model: str, device: str, scenarios: list[str], timeout_s: float):
    """Return results(name) -> that scenario's record; a scenario that did not finish before the
    deadline (a hang) or crashed fails the test that asks for it, with the subprocess's output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.path.join(HERE, "worker_faults"), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_faults.py"), model, device, *scenarios],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, rc = _text(e.stdout), _text(e.stderr), f"killed at the {timeout_s} s deadline"
    records = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["scenario"]] = record

    def results(name: str) -> dict:
        if name not in records:
            raise AssertionError(f"scenario {name} did not finish (exit: {rc}); output:\n"
                                 f"{stdout[-3000:]}\n{stderr[-5000:]}")
        assert "crashed" not in records[name], records[name]["crashed"]
        return records[name]
    return results


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def assert_no_leftovers(record: dict, exited: bool = False):
    """Shut down (twice) without error and within seconds, no worker process, nothing of the engine's in /dev/shm
    (the machine's /dev/shm is shared with other processes, so the check looks at what the
    engine's processes had mapped, and at names with the scenario process's pid). exited: the
    scenario's process is gone; its workers must be too (stopped by the atexit hook)."""
    if not exited:
        assert record["shutdown"]["error"] is None, record["shutdown"]
        assert record["shutdown"]["seconds"] < 5, record["shutdown"]   # was 11 s under NCCL
        assert record["second_shutdown"]["error"] is None and record["second_shutdown"]["seconds"] < 1
        assert not record["workers_left"]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in record["pids"])
    assert not record["shm_mapped"] and not record["shm_left"]
