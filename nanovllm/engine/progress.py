"""generate's progress bar, as vLLM's LLM._run_engine draws it: "Processed prompts" advances as
prompts finish, and its postfix shows the input and output tokens/s of the finished prompts (a
prompt's tokens count once for each of its n completions, as vLLM counts them) over the time
since the bar started. It draws only when prompts finish (tqdm keeps that to a few lines a
second), and its last line once: close() draws it."""
import time

from tqdm.auto import tqdm


def check_use_tqdm(use_tqdm):
    if not (use_tqdm is None or isinstance(use_tqdm, bool) or callable(use_tqdm)):   # None: no bar, as vLLM
        raise TypeError(f"use_tqdm must be True, False or a tqdm-like callable, got {use_tqdm!r}")


class Progress:
    def __init__(self, use_tqdm, num_prompts: int):
        """use_tqdm: True / False, or a tqdm-like callable (tqdm's constructor arguments) to draw with."""
        check_use_tqdm(use_tqdm)
        self.start = time.perf_counter()
        self.input_tokens = self.output_tokens = 0
        self.seconds = 0.0   # from the start to the last prompt that finished
        self.bar = None
        if use_tqdm:
            make = use_tqdm if callable(use_tqdm) else tqdm
            self.bar = make(total=num_prompts, desc="Processed prompts", dynamic_ncols=True,
                            postfix=self._speeds())

    def finished(self, prompts: int, prompt_tokens: int, output_tokens: int):
        """Prompts that finished in one step: how many, their prompt tokens (once per completion)
        and their completions' tokens."""
        self.input_tokens += prompt_tokens
        self.output_tokens += output_tokens
        self.seconds = time.perf_counter() - self.start
        if self.bar is None or not prompts:
            return
        self.bar.postfix = self._speeds()
        if self.bar.n + prompts < self.bar.total:
            self.bar.update(prompts)   # tqdm draws it unless it drew a moment ago
        else:
            self.bar.n += prompts      # the last ones: counted, not drawn, so close() draws the full bar once

    def _speeds(self) -> str:
        seconds = max(self.seconds, 1e-9)
        return (f"est. speed input: {self.input_tokens / seconds:.2f} toks/s, "
                f"output: {self.output_tokens / seconds:.2f} toks/s")

    def close(self) -> str:
        """Close the bar (drawing its last line); return its speeds (for the log)."""
        if self.bar is not None:
            self.bar.close()
        return self._speeds()
