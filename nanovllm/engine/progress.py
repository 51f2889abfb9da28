"""generate's progress bar, vLLM's kind: it counts finished prompts and shows input and output
tokens/s averaged over the run; it redraws at most every REDRAW_SECONDS, so a log file gets a
few lines a second, not one per step."""
import time

from tqdm.auto import tqdm

REDRAW_SECONDS = 0.5


def check_use_tqdm(use_tqdm):
    if not (use_tqdm is None or isinstance(use_tqdm, bool) or callable(use_tqdm)):   # None: no bar, as vLLM
        raise TypeError(f"use_tqdm must be True, False or a tqdm-like callable, got {use_tqdm!r}")


class Progress:
    def __init__(self, use_tqdm, num_prompts: int):
        """use_tqdm: True / False, or a tqdm-like callable (tqdm's constructor arguments) to draw with."""
        check_use_tqdm(use_tqdm)
        self.start = self.last_draw = time.perf_counter()
        self.input_tokens = self.output_tokens = 0
        self.bar = None
        if use_tqdm:
            make = use_tqdm if callable(use_tqdm) else tqdm
            self.bar = make(total=num_prompts, desc="Processed prompts", dynamic_ncols=True,
                            mininterval=REDRAW_SECONDS, postfix=self._speeds(1.0))

    def step(self, prompt_tokens: int, output_tokens: int, prompts_done: int):
        """After a step: the prompt tokens it computed, the tokens it sampled, the prompts it finished."""
        self.input_tokens += prompt_tokens
        self.output_tokens += output_tokens
        if self.bar is None:
            return
        now = time.perf_counter()
        if prompts_done:
            self.bar.update(prompts_done)   # tqdm redraws within its mininterval
        if now - self.last_draw >= REDRAW_SECONDS:
            self.last_draw = now
            self.bar.set_postfix_str(self._speeds(now - self.start))

    def _speeds(self, seconds: float) -> str:
        seconds = max(seconds, 1e-9)
        return (f"est. speed input: {self.input_tokens / seconds:.2f} toks/s, "
                f"output: {self.output_tokens / seconds:.2f} toks/s")

    def close(self) -> str:
        """Close the bar; return the run's summary (for the log)."""
        summary = self._speeds(time.perf_counter() - self.start)
        if self.bar is not None:
            self.bar.set_postfix_str(summary, refresh=False)
            self.bar.close()
        return summary
