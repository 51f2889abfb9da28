"""StructuredOutputsParams: vLLM's constraint on a request's output (a JSON schema, a regex, a choice,
an EBNF grammar or any JSON), checked for shape here; the grammar itself is checked when it is
compiled (nanovllm/structured/grammars.py). Pure Python: xgrammar is needed only to generate."""
import json as json_module
from dataclasses import dataclass

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None       # a JSON schema: dict, JSON text, or a pydantic model class
    regex: str | None = None             # the whole output matches it
    choice: list[str] | None = None      # the output is exactly one of these strings
    grammar: str | None = None           # an EBNF grammar (GBNF style, start rule `root`)
    json_object: bool | None = None      # any JSON object/value
    structural_tag: str | None = None    # xgrammar's structural tag, as JSON text
    disable_any_whitespace: bool = False   # JSON without whitespace between tokens
    disable_additional_properties: bool = False   # xgrammar already forbids unlisted properties
    whitespace_pattern: str | None = None  # not supported by xgrammar: a ValueError if set
    disable_fallback: bool = False       # accepted for vLLM compatibility (one back end: no fallback)

    def __post_init__(self):
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()   # a pydantic model class
        if isinstance(self.json, str):
            try:
                self.json = json_module.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON text: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema: a dict, JSON text or a "
                             f"pydantic model class; got {type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            self.choice = list(self.choice) if isinstance(self.choice, (list, tuple)) else self.choice
            if not isinstance(self.choice, list) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings, "
                                 f"got {self.choice!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be True (or left None), "
                             f"got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (xgrammar has no such "
                             "option); use disable_any_whitespace=True for JSON without whitespace")
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {given or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)

    def key(self) -> tuple:
        """Identifies the compiled grammar: equal keys compile to the same grammar (the cache key)."""
        kind = self.kind
        if kind == "json":
            spec = json_module.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            spec = tuple(self.choice)
        else:
            spec = getattr(self, kind)
        whitespace = self.disable_any_whitespace if kind in ("json", "json_object") else False
        return kind, spec, whitespace


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name for StructuredOutputsParams, with its `backend` field (xgrammar only)."""
    backend: str | None = None

    def __post_init__(self):
        if self.backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"guided decoding backend {self.backend!r} is not available; only 'xgrammar' is")
        super().__post_init__()

    @staticmethod
    def from_optional(json=None, regex=None, choice=None, grammar=None, json_object=None,
                      backend=None, whitespace_pattern=None, structural_tag=None,
                      **flags) -> "GuidedDecodingParams | None":
        """vLLM's helper: None when no constraint is given."""
        if all(v is None for v in (json, regex, choice, grammar, json_object, structural_tag)):
            return None
        return GuidedDecodingParams(json=json, regex=regex, choice=choice, grammar=grammar,
                                    json_object=json_object, backend=backend, structural_tag=structural_tag,
                                    whitespace_pattern=whitespace_pattern, **flags)
