"""A tensor-parallel worker process (ranks 1..N-1), started by TPWorkers as
`python -c "from nanovllm.engine.worker_main import main; main()" COMMANDS REPORTS BEATS RANK`:
a fresh interpreter, so the user's script is never imported here. It reads its setup and then
commands from the COMMANDS pipe, bumps its heartbeat counter from a thread of its own, and on a
failure writes its traceback to the REPORTS pipe and exits."""
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback

import torch

from nanovllm.config import Config, uses_cuda
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.tp_worker import HEARTBEAT_S, TRACEBACK_BYTES
from nanovllm.logger import quiet_worker_logger
from nanovllm.parallel import command_pipe
from nanovllm.parallel.parallel_state import (abort_tp_group, close_peer_all_reduce, init_tp_group,
                                              reset_captured_graphs, worker_store)
from nanovllm.parallel.heartbeat import Heartbeats


def main():
    """A worker's whole life: heartbeat, read the setup, join the group, build the shard, run
    commands until "exit" (or until rank 0 is gone), then end at once."""
    commands, reports, beats_fd, rank = map(int, sys.argv[1:5])
    quiet_worker_logger()
    # Ctrl-C in a terminal reaches every process of the foreground group: rank 0 alone decides
    # what happens (it stops the workers through the pipe, or kills them).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: where is it stuck?
    parent = os.getppid()

    def check_parent():
        if os.getppid() != parent:
            raise SystemExit(0)   # rank 0 is gone: nobody to serve

    try:
        beats = Heartbeats(os.fstat(beats_fd).st_size // 8, beats_fd)
        threading.Thread(target=_heartbeat, args=(beats, rank, parent), daemon=True).start()
        config, port = command_pipe.receive(commands, check_parent)
        _serve(config, rank, port, commands, check_parent)
    except (EOFError, SystemExit):
        pass   # rank 0 closed the pipe or exited
    except BaseException:
        # Report first, then leave at once: cleaning up after a failed step (a communicator with
        # work in flight) could block, and rank 0 learns of the failure from this exit.
        os.write(reports, traceback.format_exc()[-TRACEBACK_BYTES:].encode())
        os._exit(1)
    # No collective teardown of the group (nor the interpreter's): NCCL's would wait for rank 0,
    # which waits for this process to end before it aborts its side. The end frees everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _heartbeat(beats: Heartbeats, rank: int, parent: int):
    """Beat; and end the process when rank 0 is gone, wherever the main thread is blocked (in
    the rendezvous, a collective, a device wait): an orphan worker would hold its GPU."""
    while os.getppid() == parent:
        beats.beat(rank)
        time.sleep(HEARTBEAT_S)
    os._exit(0)


def _serve(config: Config, rank: int, port: int, commands: int, check_parent):
    torch.set_num_threads(1)   # ranks share the host's cores; one thread each avoids oversubscription
    cuda = uses_cuda(config)
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    size = config.tensor_parallel_size
    store = worker_store(port, size)
    store.set(f"joined{rank}", "1")
    group = init_tp_group(store, rank, size, device, watch=check_parent)
    runner = ModelRunner(config, group)
    while True:
        command, step = command_pipe.receive(commands, check_parent)
        if command == "exit":
            # Let go of this rank's side first, as rank 0 does (nothing runs between steps): a
            # process that ends holding a communicator and the graphs that captured it can take
            # seconds in the driver's teardown.
            reset_captured_graphs(group)
            abort_tp_group(group)
            close_peer_all_reduce(group)
            return
        if runner.forward_step(step) is not None:
            runner.share_sampled(sum(step.samples))   # rank 0's sampled tokens, for later steps
