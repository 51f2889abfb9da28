"""The Executor runs each step on every tensor-parallel rank: it sends the step to the workers
(ranks 1..N-1), then has rank 0's ModelRunner, in this process, run it and sample. The runner so
knows nothing of the workers, and the engine nothing of the ranks."""
from collections.abc import Callable

from nanovllm.config import Config
from nanovllm.engine.model_runner import BrokenLogitsError, ModelRunner
from nanovllm.engine.sampled_tokens import PendingSample, SampledTokens
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.tp_worker import TPWorkers
from nanovllm.utils.processes import Lifetime


class Executor:
    def __init__(self, config: Config):
        """Start rank 0's runner here and, with tensor_parallel_size > 1, ranks 1..N-1 in worker
        processes that build their shards alongside it. A start-up failure on any rank raises the
        first one's error (a worker's as WorkerError, with its traceback) and leaves nothing
        running."""
        # Shut down or not, and the fork guard: one for the runner and the workers (they mark it
        # when they shut down, also at exit).
        self.lifetime = Lifetime()
        self.workers = TPWorkers(config, self.lifetime) if config.tensor_parallel_size > 1 else None
        try:
            self.runner = ModelRunner(config, self.workers.group if self.workers else None)
        except BaseException as e:
            if self.workers is not None:
                try:
                    if not isinstance(e, (ValueError, TypeError)):   # a user error is the same on every rank
                        self.workers.raise_if_died(e)   # a collective broke: was it a worker that failed?
                finally:
                    self.workers.shutdown(graceful=False)
            raise
        # True from the moment a step is sent to the workers until rank 0 has launched it too. If
        # it stays True (Ctrl-C or an error in between), some ranks may have run collectives that
        # others never will: the ranks are out of step, and no further step can run.
        self.in_step = False

    @property
    def closed(self) -> bool:
        return self.lifetime.closed

    @property
    def out_of_step(self) -> str | None:
        """Why the ranks may be out of step (a step was cut short after the workers got it), or None;
        also None once shut down or a worker failed: then launch raises that instead."""
        if self.in_step and not self.closed and self.workers.error is None:
            return "a step was interrupted while the tensor-parallel ranks ran it, so they are out of step"
        return None

    def check_can_run(self):
        """Raise why no further step can run: shut down, a worker failed (its WorkerError), or the
        ranks out of step. This state is the executor's alone; the engine asks it."""
        if self.closed:
            raise RuntimeError("the engine was shut down: shut this engine down and create a new one")
        if self.workers is not None and self.workers.error is not None:
            raise self.workers.fresh_error()
        if self.out_of_step:
            raise RuntimeError(f"{self.out_of_step}: shut this engine down and create a new one")

    def launch(self, batch: ScheduledBatch,
               before_sampling: Callable[[], None] | None = None) -> PendingSample:
        """Run the batch's step on every rank; return rank 0's PendingSample (see ModelRunner.launch,
        also for before_sampling, which runs on rank 0 only)."""
        self.check_can_run()
        if self.workers is None:
            return self.runner.launch(batch, before_sampling=before_sampling)
        step = self.runner.step_input(batch)
        self.in_step = True
        try:
            with self.workers.stepping():
                self.workers.run_step(step)   # ranks 1..N-1 run the same step (they only skip sampling)
                pending = self.runner.launch(batch, step, before_sampling)
        except BrokenLogitsError:
            self.in_step = False   # every rank finished the step: still in step
            raise
        except Exception as e:
            self.workers.raise_if_died(e)   # a collective failed because a worker died: say so
            raise
        self.in_step = False
        return pending

    def result(self, pending: PendingSample) -> SampledTokens:
        """Wait for a launched step's tokens. Under tensor parallelism the wait polls, checking the
        workers: a step whose peer died or stopped would otherwise never complete."""
        if self.workers is not None:
            with self.workers.stepping():
                self.workers.wait_until(pending.ready)
        return pending.result()

    def shutdown(self):
        """Stop the workers and give the device memory back. Idempotent; a call cut short by
        Ctrl-C is finished by the next one (or, for the workers, at exit). Does nothing in a child
        forked from the engine's process (its exit runs the engine's destructor too): the workers
        and the device are the parent's."""
        if self.lifetime.forked:
            return
        try:
            if self.workers is not None:   # marks the lifetime closed (once closed, it asks no more)
                self.workers.shutdown(graceful=not self.in_step)
        finally:
            self.lifetime.closed = True
            self.runner.release()

