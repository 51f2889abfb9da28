"""PoolingParams: vLLM's per-request settings of a pooling model (embeddings, classification,
scores), validated with ValueError; `verify` fixes the task and fills the model's defaults."""
import copy
import numbers
from dataclasses import dataclass

# Each task's settings (vLLM's valid_parameters); a setting given for another task is an error.
TASK_PARAMETERS = {
    "embed": ("dimensions", "normalize"),
    "token_embed": ("dimensions", "normalize"),
    "classify": ("use_activation",),
    "score": ("use_activation",),
    "token_classify": ("use_activation",),
}
POOLING_TASKS = tuple(TASK_PARAMETERS)


@dataclass
class PoolingParams:
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens (-1: as many as fit)
    dimensions: int | None = None               # embeddings: the first k dimensions (Matryoshka models)
    normalize: bool | None = None               # embeddings: unit L2 norm (None: the model's default)
    use_activation: bool | None = None          # classification: softmax / sigmoid (None: True)
    activation: bool | None = None              # vLLM's deprecated names for use_activation
    softmax: bool | None = None
    task: str | None = None                     # set by the LLM method (embed, classify, ...)

    def __post_init__(self):
        self.validate()

    def clone(self) -> "PoolingParams":
        return copy.deepcopy(self)

    def validate(self):
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or t < -1 or t == 0):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, -1 or None, got {t!r}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1 or None, got {self.dimensions!r}")
        for name in ("normalize", "use_activation", "activation", "softmax"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS} or None, got {self.task!r}")

    def resolved(self, task: str, defaults: dict) -> "PoolingParams":
        """A copy for one task with every setting decided: the model's `defaults` (PoolingSpec.defaults)
        where this one leaves None, then the task's. A setting of another task is a ValueError."""
        self.validate()
        if self.task is not None and self.task != task:
            raise ValueError(f"these PoolingParams are for task {self.task!r}; they cannot be used for "
                             f"{task!r} (pass PoolingParams() or task={task!r})")
        p = self.clone()
        p.task = task
        deprecated = [v for v in (p.softmax, p.activation) if v is not None]
        if p.use_activation is None and deprecated:
            p.use_activation = deprecated[0]
        p.softmax = p.activation = None
        wrong = [k for k in ("dimensions", "normalize", "use_activation")
                 if getattr(p, k) is not None and k not in TASK_PARAMETERS[task]]
        if wrong:
            raise ValueError(f"task {task!r} takes only {list(TASK_PARAMETERS[task])} of the pooling "
                             f"settings; {wrong} given")
        for k in TASK_PARAMETERS[task]:
            if getattr(p, k) is None:
                setattr(p, k, defaults.get(k))
        if "normalize" in TASK_PARAMETERS[task] and p.normalize is None:
            p.normalize = True
        if "use_activation" in TASK_PARAMETERS[task] and p.use_activation is None:
            p.use_activation = True
        return p


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
