"""What the tensor-parallel ranks share, below the layers that use it: the process group and its
collectives (parallel_state), the command pipe the engine writes each step into (command_pipe) and the
heartbeats by which engine and workers see each other alive (heartbeat). The worker processes run a
ModelRunner, so they live beside it in nanovllm/engine (tp_worker.py, worker_main.py)."""
