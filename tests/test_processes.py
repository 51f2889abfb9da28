"""utils/processes.py and config.uses_cuda: the one place each piece of the tensor-parallel lifecycle
lives (shut down or not and the fork guard, the PYTHONPATH a worker needs, whether a process is
stopped, whether the ranks use CUDA). TP=2 uses of them: test_tp.py, test_tp_faults.py."""
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import nanovllm
from nanovllm import LLM, SamplingParams
from nanovllm.config import uses_cuda
from nanovllm.utils.processes import Lifetime, child_pythonpath, is_stopped


def test_child_pythonpath_puts_this_nanovllm_first(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    path = child_pythonpath().split(os.pathsep)
    assert path[1:] == ["/elsewhere"]
    assert os.path.join(path[0], "nanovllm") == os.path.dirname(os.path.abspath(nanovllm.__file__))
    # a fresh interpreter in another folder imports this checkout's nanovllm with it, not another install
    script = "import importlib.util; print(importlib.util.find_spec('nanovllm').origin)"
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == os.path.abspath(nanovllm.__file__)
    monkeypatch.delenv("PYTHONPATH")
    assert child_pythonpath() == path[0]


def test_lifetime_is_forked_only_in_a_child():
    life = Lifetime()
    assert not life.forked and not life.closed
    pid = os.fork()
    if pid == 0:
        os._exit(0 if life.forked else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert not life.forked


def test_is_stopped_reads_the_process_state():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not is_stopped(proc.pid)   # gone: no /proc entry


def test_uses_cuda_follows_the_device_option():
    assert uses_cuda(SimpleNamespace(device="cuda"))
    assert not uses_cuda(SimpleNamespace(device="cpu"))
    assert uses_cuda(SimpleNamespace(device="auto")) == torch.cuda.is_available()


def test_a_forked_child_leaves_a_one_rank_engine_alone(qwen3_dir):
    # The executor's fork guard without workers: the child's shutdown must not release the parent's
    # runner (the parent's engine keeps its model and keeps generating).
    llm = LLM(qwen3_dir, device="cpu", num_kvcache_blocks=8)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expect = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            llm.shutdown()
            code = 0 if not llm.executor.closed and llm.model_runner.model is not None else 1
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids == expect
    llm.shutdown()
    assert llm.executor.closed
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
