"""Imported at start-up by every Python process with this folder on PYTHONPATH (tests/tp_faults.py
puts it there): with NANOVLLM_TEST_FAIL_WORKER_START set, a tensor-parallel worker (started as
`python -c ...`) fails while loading its shard, before the group's first collective."""
import os
import sys

if os.environ.get("NANOVLLM_TEST_FAIL_WORKER_START") and sys.argv[:1] == ["-c"]:
    from nanovllm.engine import model_runner

    def _fail(model, path, *names):
        raise RuntimeError("injected start-up failure on a worker")

    model_runner.load_model = _fail
