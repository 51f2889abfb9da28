"""Engine lifecycle on CUDA: shutdown() and `del` give the GPU memory back (torch's cache
included); a second engine starts in the same process after the first is shut down or deleted
(without gc.collect), though the first filled its share of the GPU; with TP=2 the workers are gone
after shutdown. Each check runs in a subprocess with a deadline (a fresh CUDA context, and no hang
can outlive it). Memory is the process's own (torch.cuda.memory_reserved), since other test
processes may share the GPU. Skipped without CUDA."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GIB = 1 << 30

SCRIPT = r"""
import json, os, sys
import torch
from nanovllm import LLM, SamplingParams

model, tp = sys.argv[1], int(sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = [[5, 6, 7, 8], [9, 10]]

def start():
    # Half the GPU (other test processes may share it): the KV cache fills it up to there.
    return LLM(model, device="cuda", tensor_parallel_size=tp, gpu_memory_utilization=0.5)

def run(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

record = {}
llm = start()
expected = run(llm)
pids = llm.executor.workers.pids if llm.executor.workers else []
record["reserved_running"] = torch.cuda.memory_reserved()
llm.shutdown()
record["reserved_after_shutdown"] = torch.cuda.memory_reserved()
record["workers_left"] = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
llm = start()                                 # a second engine after shutdown
record["same_after_shutdown"] = run(llm) == expected
del llm                                       # no shutdown, no gc.collect: a notebook's `del`
record["reserved_after_del"] = torch.cuda.memory_reserved()
llm = start()                                 # a third engine after del
record["same_after_del"] = run(llm) == expected
llm.shutdown()
print(json.dumps(record))
"""


def lifecycle(model: str, tp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model, str(tp)], env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(r: dict):
    assert r["reserved_running"] > 20 * GIB          # the KV cache took a large part of the GPU
    assert r["reserved_after_shutdown"] < GIB         # ...and shutdown gave it back
    assert r["reserved_after_del"] < GIB              # ...and so did `del`
    assert r["same_after_shutdown"] and r["same_after_del"]
    assert not r["workers_left"]


@pytest.mark.skipif(NUM_GPUS < 1, reason="needs a CUDA GPU")
def test_shutdown_frees_the_gpu_and_engines_start_again(qwen3_dir):
    check(lifecycle(qwen3_dir, 1))


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")
def test_tp2_shutdown_frees_the_gpu_and_engines_start_again(qwen3_dir):
    check(lifecycle(qwen3_dir, 2))
