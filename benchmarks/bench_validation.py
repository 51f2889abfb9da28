"""Host time of the engine's prompt validation (RequestBuilder.token_ids) on bench.py's prompt shapes
(256 prompts of 100-1024 token ids), which runs inside bench.py's timed generate.

    PYTHONPATH=. python benchmarks/bench_validation.py
"""
import os
import statistics
import sys
import tempfile
import time
from random import randint, seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from conftest import make_model  # noqa: E402

from nanovllm import LLM  # noqa: E402

path = make_model(tempfile.mkdtemp(), "qwen3", tokenizer=False)
llm = LLM(path, device="cpu", kvcache_block_size=256, num_kvcache_blocks=64, max_model_len=1024)
seed(0)
prompts = [[randint(0, 500) for _ in range(randint(100, 1024))] for _ in range(256)]
ts = []
for _ in range(7):
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        llm.requests.token_ids(p, i)
    ts.append(time.perf_counter() - t)
print(f"validate {sum(map(len, prompts))} token ids in 256 prompts: "
      f"median {statistics.median(ts) * 1e3:.1f} ms")
