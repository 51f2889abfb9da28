"""Engine lifecycle on CUDA: shutdown() gives the GPU memory back; a second engine starts in the
same process after the first is shut down or deleted (without gc.collect), even when the first
filled the GPU; with TP=2 the worker's GPU is freed too. Each check runs in a subprocess with a
deadline (a fresh CUDA context, and no hang can outlive it). Skipped without CUDA."""
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
import json, sys
import torch
from nanovllm import LLM, SamplingParams

model, tp = sys.argv[1], int(sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = [[5, 6, 7, 8], [9, 10]]

def start(util):
    return LLM(model, device="cuda", tensor_parallel_size=tp, gpu_memory_utilization=util)

def run(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

def used(device=0):
    free, total = torch.cuda.mem_get_info(device)
    return total - free

record = {"baseline": [used(d) for d in range(tp)]}
llm = start(0.9)                              # the KV cache fills the GPU up to 90%
expected = run(llm)
record["running"] = [used(d) for d in range(tp)]
llm.shutdown()
record["after_shutdown"] = [used(d) for d in range(tp)]
record["reserved_after_shutdown"] = torch.cuda.memory_reserved()
llm = start(0.9)                              # a second engine after shutdown
record["same_after_shutdown"] = run(llm) == expected
del llm                                       # no shutdown, no gc.collect: a notebook's `del`
llm = start(0.9)                              # a third engine after del
record["same_after_del"] = run(llm) == expected
llm.shutdown()
print(json.dumps(record))
"""


def lifecycle(model: str, tp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model, str(tp)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(NUM_GPUS < 1, reason="needs a CUDA GPU")
def test_shutdown_frees_the_gpu_and_engines_start_again(qwen3_dir):
    r = lifecycle(qwen3_dir, 1)
    assert r["running"][0] - r["baseline"][0] > 50 * GIB       # the KV cache took most of the GPU
    assert r["after_shutdown"][0] - r["baseline"][0] < 2 * GIB  # ...and shutdown gave it back
    assert r["reserved_after_shutdown"] < GIB
    assert r["same_after_shutdown"] and r["same_after_del"]


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")
def test_tp2_shutdown_frees_both_gpus_and_engines_start_again(qwen3_dir):
    r = lifecycle(qwen3_dir, 2)
    for d in range(2):
        assert r["running"][d] - r["baseline"][d] > 50 * GIB
        assert r["after_shutdown"][d] - r["baseline"][d] < 2 * GIB
    assert r["same_after_shutdown"] and r["same_after_del"]
