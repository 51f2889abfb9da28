"""Which runner a model gets (generate or pooling), how a decoder is converted for pooling (embed,
classify, reward), and its pooler: vLLM's rules, decided once when the engine's Config is made.

Priority of the pooler's settings, as in vLLM: LLM(pooler_config=...) over the sentence-transformers
files (modules.json, its Pooling module's config.json, a Normalize module) over the defaults (the last
token; embeddings normalized; classifier outputs through their activation)."""
import json
import os
from dataclasses import dataclass, field

from nanovllm.utils.hf_files import read_json

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# Architecture-name suffixes that mean a pooling model (vLLM's), and the conversion each implies.
_CLASSIFY_SUFFIXES = ("ForSequenceClassification", "ClassificationModel")
_EMBED_SUFFIXES = ("ForTextEncoding", "EmbeddingModel", "ForRewardModeling", "RewardModel", "Model")
POOLING_SUFFIXES = _CLASSIFY_SUFFIXES + _EMBED_SUFFIXES
# Every convert's tasks (a classifier of one label also scores pairs: a cross-encoder).
_TASKS = {"embed": ("embed", "token_embed", "score"), "classify": ("classify", "token_classify"),
          "reward": ("token_classify",)}
# sentence-transformers' Pooling module: its config.json flag -> our pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's pooler_config: overrides of the model's pooler (None: the model's own setting)."""
    pooling_type: str | None = None    # "LAST", "MEAN" or "CLS" (sequence-wise tasks)
    normalize: bool | None = None      # embeddings' default
    dimensions: int | None = None      # embeddings' default Matryoshka dimensions
    use_activation: bool | None = None   # classifiers' default

    def __post_init__(self):
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of {POOLING_TYPES}, "
                             f"got {self.pooling_type!r}")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"pooler_config {name} must be True, False or None, "
                                 f"got {getattr(self, name)!r}")
        d = self.dimensions
        if d is not None and (type(d) is not int or d < 1):
            raise ValueError(f"pooler_config dimensions must be an integer >= 1 or None, got {d!r}")


@dataclass(frozen=True)
class PoolingSpec:
    """What the pooling runner builds and serves (None in Config for the generate runner)."""
    architecture: str                   # the config's (models.decoder_of finds the decoder that runs it)
    convert: str                        # "embed", "classify" or "reward"
    pooling_type: str                   # sequence-wise tasks: LAST, MEAN or CLS
    tasks: tuple[str, ...]              # the pooling tasks it serves
    num_labels: int = 0                 # classify / reward: rows of the score head
    # The score head from the LM head's rows of these tokens (a causal LM used as a reranker):
    # "from_2_way_softmax": row[1] - row[0] (sigmoid of it = softmax's second probability);
    # "no_post_processing": the rows themselves.
    from_token_ids: tuple[int, ...] = ()
    from_token_method: str | None = None
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    defaults: dict = field(default_factory=dict)   # PoolingParams defaults (normalize, dimensions, ...)

    def check_task(self, task: str):
        if task not in self.tasks:
            hint = {"embed": "convert='embed'", "token_embed": "convert='embed'",
                    "classify": "convert='classify' (a *ForSequenceClassification checkpoint)",
                    "token_classify": "convert='classify' or 'reward'",
                    "score": "an embedding model or a classifier with num_labels=1"}.get(task, "")
            raise ValueError(f"this model (convert={self.convert!r}) serves the pooling tasks "
                             f"{list(self.tasks)}, not {task!r}" + (f": that needs {hint}" if hint else ""))


def runner_of(arch: str, runner: str) -> str:
    """vLLM's --runner auto: pooling for a pooling architecture's name, else generate."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if runner != "auto":
        return runner
    return "pooling" if arch.endswith(_CLASSIFY_SUFFIXES + _EMBED_SUFFIXES) else "generate"


def convert_of(arch: str, convert: str) -> str:
    """vLLM's --convert auto: classify for a classifier's name, else embed."""
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    if convert == "none":
        raise ValueError("convert='none': nanovllm's models are decoders, which pool only once converted; "
                         "pass convert='embed', 'classify', 'reward' or 'auto'")
    if convert != "auto":
        return convert
    return "classify" if arch.endswith(_CLASSIFY_SUFFIXES) else "embed"


def resolve_pooling(folder: str, hf_config, runner: str, convert: str, pooler_config,
                    tokenizer_folder: str | None) -> PoolingSpec | None:
    """The PoolingSpec of the model in `folder` (None: the generate runner); user errors are ValueErrors."""
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else ""
    if runner_of(arch, runner) == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(f"convert={convert!r} makes a pooling model: also pass runner='pooling' "
                             "(or 'auto')")
        if pooler_config is not None:
            raise ValueError("pooler_config is for pooling models: pass runner='pooling' too")
        return None
    how = convert_of(arch, convert)
    user = as_pooler_config(pooler_config)
    st_type, st_normalize = sentence_transformers_pooling(folder)
    pooling_type = user.pooling_type or st_type or "LAST"
    defaults = {"normalize": user.normalize if user.normalize is not None else st_normalize,
                "dimensions": user.dimensions,
                "use_activation": user.use_activation if user.use_activation is not None
                else (False if how == "reward" else None)}
    num_labels, token_ids, method = (0, (), None) if how == "embed" else \
        score_head(hf_config, how, tokenizer_folder or folder)
    tasks = _TASKS[how] + (("score",) if how == "classify" and num_labels == 1 else ())
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    spec = PoolingSpec(arch, how, pooling_type, tasks, num_labels, token_ids, method,
                       bool(getattr(hf_config, "is_matryoshka", False) or dims),
                       tuple(dims) if dims else None, defaults)
    if user.dimensions is not None:
        check_dimensions(spec, user.dimensions)
    return spec


def score_head(hf_config, how: str, tokenizer_folder: str) -> tuple[int, tuple[int, ...], str | None]:
    """(num_labels, classifier_from_token ids, their method) of a classifier's score head."""
    token_ids, method = classifier_tokens(hf_config, tokenizer_folder)
    if token_ids:
        return (1 if method == "from_2_way_softmax" else len(token_ids)), token_ids, method
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
    if num_labels < 1:
        raise ValueError(f"convert={how!r} needs a score head: the config's num_labels is {num_labels}")
    return num_labels, (), None


def as_pooler_config(value) -> PoolerConfig:
    if value is None:
        return PoolerConfig()
    if isinstance(value, PoolerConfig):
        return value
    if isinstance(value, dict):
        try:
            return PoolerConfig(**value)
        except TypeError:
            raise TypeError(f"pooler_config keys must be among {list(PoolerConfig.__dataclass_fields__)}, "
                            f"got {sorted(value)}") from None
    raise TypeError(f"pooler_config must be a PoolerConfig, a dict or None, got {type(value).__name__}")


def check_dimensions(spec: PoolingSpec, dimensions: int):
    """vLLM's rule: dimensions only for a Matryoshka model, and one of its dimensions when it lists them."""
    if not spec.matryoshka:
        raise ValueError(f"dimensions={dimensions}: this model does not support Matryoshka embeddings (its "
                         "config has no is_matryoshka / matryoshka_dimensions), and cutting its embeddings "
                         "would give poor results; leave dimensions unset, or pass hf_overrides="
                         "{'is_matryoshka': True} for a model trained for it")
    if spec.matryoshka_dimensions is not None and dimensions not in spec.matryoshka_dimensions:
        raise ValueError(f"dimensions={dimensions}: this model supports only the Matryoshka dimensions "
                         f"{list(spec.matryoshka_dimensions)}")


def sentence_transformers_pooling(folder: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers folder's modules.json; (None, None)
    without one."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None, None
    with open(path, encoding="utf-8") as f:
        try:
            modules = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(modules, list):
        raise ValueError(f"{path} must hold a list of modules")
    kinds = {m.get("type", ""): m.get("path", "") for m in modules if isinstance(m, dict)}
    if any(k.endswith(".Dense") for k in kinds):
        raise ValueError(f"{path} has a Dense module after the pooling: nanovllm does not run it; pass "
                         "a model without one")
    pooling = next((p for k, p in kinds.items() if k.endswith(".Pooling")), None)
    normalize = any(k.endswith(".Normalize") for k in kinds)
    if pooling is None:
        return None, normalize
    config = read_json(os.path.join(folder, pooling, "config.json"))
    unsupported = [k for k in _ST_UNSUPPORTED if config.get(k)]
    if unsupported:
        raise ValueError(f"{folder}: sentence-transformers pooling {unsupported} is not supported "
                         f"(only {list(_ST_MODES)}); pass pooler_config={{'pooling_type': ...}}")
    modes = [t for k, t in _ST_MODES.items() if config.get(k)]
    if len(modes) != 1:
        raise ValueError(f"{folder}/{pooling}/config.json must turn on exactly one of {list(_ST_MODES)}")
    return modes[0], normalize


def classifier_tokens(hf_config, tokenizer_folder: str) -> tuple[tuple[int, ...], str | None]:
    """The config's classifier_from_token (vLLM's hf_overrides for a causal LM used as a classifier,
    e.g. Qwen3-Reranker's ["no", "yes"]) as token ids, and the conversion method; ((), None) without it."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if not tokens:
        return (), None
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    method = getattr(hf_config, "method", None) or ("from_2_way_softmax" if len(tokens) == 2
                                                    else "no_post_processing")
    if method not in ("from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"method must be 'from_2_way_softmax' or 'no_post_processing', got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"method 'from_2_way_softmax' needs two classifier_from_token, got {tokens!r}")
    from nanovllm.utils.hf_files import load_tokenizer
    tokenizer = load_tokenizer(tokenizer_folder)
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the model's tokenizer to find the tokens' ids; "
                         f"{tokenizer_folder!r} has none")
    ids = []
    for t in tokens:
        i = tokenizer.convert_tokens_to_ids(t)
        if i is None or (i == tokenizer.unk_token_id and t != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token {t!r} is not a token of the model's tokenizer")
        ids.append(int(i))
    return tuple(ids), method
