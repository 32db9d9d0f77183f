"""Engine configuration: frozen attrs classes, one per component, composed into EngineConfig.

Values are checked when a config is built (validators), and cross-field gates when the
whole EngineConfig is; every failure raises ConfigError naming the field, value and fix.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError

from ._components import check_component_name, check_method, component_registry
from ._errors import ConfigError

if TYPE_CHECKING:
    from specloop.samplers._tree import DraftTree

    # An attrs validator: (instance, attribute, value) -> None, raising ConfigError.
    Validator = Callable[[object, attrs.Attribute[Any], object], None]

MAX_DRAFT_TOKENS = 16
DTYPES = ("float32", "bfloat16", "float16", "float64")
VERIFICATIONS = ("token", "block")


def _in(section: str, choices: tuple[str, ...]) -> Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise ConfigError(f"{section}.{attribute.name}", value, "not a known value",
                              f"use one of: {', '.join(choices)}")
    return check


def _at_least(section: str, low: int) -> Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{section}.{attribute.name}", value,
                              f"must be an integer >= {low}")
    return check


def _positive_float(section: str) -> Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{section}.{attribute.name}", value,
                              "must be a finite number > 0")
    return check


@attrs.frozen
class ModelConfig:
    """The target model. ``name`` is a registry name (see ``specloop.models``) or a path."""

    name: str = "smollm2-135m-instruct"
    dtype: str = attrs.field(default="float32", validator=_in("model", DTYPES))
    device: str = attrs.field(default="cpu")
    max_seq_len: int = attrs.field(default=2048, validator=_at_least("model", 16))
    # Positions per KV-cache page: a request holds ceil(length / kv_page_size) pages.
    kv_page_size: int = attrs.field(default=16, validator=_at_least("model", 1))
    # Apply the model's chat template to string prompts (instruct models want it).
    chat_template: bool = True

    @device.validator
    def _check_device(self, attribute: attrs.Attribute[Any], value: str) -> None:
        kind = value.split(":", 1)[0]
        if kind not in ("cpu", "cuda", "auto"):
            raise ConfigError("model.device", value, "not a device",
                              "use 'cpu', 'cuda', 'cuda:N' or 'auto'")


@attrs.frozen
class SchedulerConfig:
    max_batch_size: int = attrs.field(default=8, validator=_at_least("scheduler", 1))
    # Prompt tokens prefilled per iteration; a longer prompt is prefilled in chunks.
    max_num_tokens: int = attrs.field(default=2048, validator=_at_least("scheduler", 1))
    # How long an idle rank 0 waits for work before the group exchanges a heartbeat.
    idle_wait_s: float = attrs.field(default=0.05, validator=_positive_float("scheduler"))
    # Base seed for requests that bring none (request i gets derive_seed(seed, i)), so a
    # run is reproducible; None: a fresh random seed per request.
    seed: int | None = attrs.field(default=None)

    @seed.validator
    def _check_seed(self, attribute: attrs.Attribute[Any], value: int | None) -> None:
        if value is not None and not 0 <= value < 2**63:
            raise ConfigError("scheduler.seed", value, "must be in [0, 2**63)",
                              "or leave it unset for random seeds")


@attrs.frozen
class SpeculativeConfig:
    # "none" or a drafter name registered in the component registry (built-in or plugin).
    method: str = attrs.field(default="ngram")
    num_draft_tokens: int = attrs.field(default=4)
    use_rejection_sampling: bool = False
    verification: str = attrs.field(default="token",
                                    validator=_in("speculative", VERIFICATIONS))
    # draft_model: a registry name or path of a model sharing the target's tokenizer.
    draft_model: str | None = None
    # early_exit: how many of the target's first layers the drafter runs.
    early_exit_layers: int | None = None
    # ngram: longest and shortest suffix looked up in the sequence so far.
    ngram_max: int = attrs.field(default=3, validator=_at_least("speculative", 1))
    ngram_min: int = attrs.field(default=1, validator=_at_least("speculative", 1))
    # mtp_eagle / eagle3: safetensors file of the head; None = random init (tests only).
    mtp_weights: str | None = None
    # A trained head: a shipped registry name (e.g. "smollm2-135m-instruct-eagle3") or a
    # .safetensors path; checked against its model card and the target. Wins over
    # mtp_weights.
    draft_weights: str | None = None
    # The dtype a draft head (mtp_eagle, eagle3) computes in: "auto" = the target's, except
    # bfloat16 for a float32 target on a CPU with native bf16 GEMMs (a draft step there
    # is bound by the bytes it reads: half of them). Drafts need no exactness: VERIFY
    # decides what is kept, in the target's dtype.
    draft_dtype: str = attrs.field(default="auto",
                                   validator=_in("speculative", ("auto", *DTYPES)))
    # Choose K per iteration (0 .. num_draft_tokens, which becomes the maximum) by the rule
    # in docs/configuration.md, "Adaptive K": drafting only where it pays.
    adaptive: bool = False
    # The K values adaptive chooses among (each captured as graphs); None: 0 .. K.
    adaptive_k: tuple[int, ...] | None = attrs.field(default=None)
    # How adaptive K charges what admitting requests costs (the prefill, the iteration
    # without a step queued ahead): "per_token" (requests end, so are admitted, in
    # proportion to the tokens made: the same per token at any K, so it does not move
    # the choice) or "per_iteration" (added to every K's time, as before; for comparing).
    adaptive_admissions: str = attrs.field(
        default="per_token",
        validator=_in("speculative", ("per_token", "per_iteration")))
    # Adaptive K: iterations after a switch of K's first that the rule learns as nothing
    # (they still pay for the switch where a step is queued ahead); each explored run is
    # that much longer. 0: none (docs/configuration.md, "Adaptive K").
    adaptive_settling: int = attrs.field(default=0, validator=_at_least("speculative", 0))
    # A static draft tree (docs/configuration.md, "Draft trees"): its nodes' paths of
    # sibling ranks, e.g. [[0], [1], [0, 0]]; batches verified strictly (greedy, or
    # sampled without rejection sampling) draft and verify it, batches on the advanced
    # path the chain of its depth (num_draft_tokens). None: chains only.
    tree: tuple[tuple[int, ...], ...] | None = attrs.field(default=None)
    # The largest (padded) batch that drafts the tree; larger ones draft its chain: a
    # tree's VERIFY rows are nearly free at small batches only (docs/configuration.md).
    tree_max_batch: int = attrs.field(default=8, validator=_at_least("speculative", 1))

    @method.validator
    def _check_method(self, attribute: attrs.Attribute[Any], value: str) -> None:
        check_method(value)

    @num_draft_tokens.validator
    def _check_k(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 1 <= value <= MAX_DRAFT_TOKENS:
            raise ConfigError("speculative.num_draft_tokens", value,
                              f"must be an integer in [1, {MAX_DRAFT_TOKENS}]",
                              "set method = 'none' to turn speculation off")

    @adaptive_k.validator
    def _check_adaptive_k(self, attribute: attrs.Attribute[Any], value: tuple[int, ...] | None
                          ) -> None:
        if value is None:
            return
        if not value or any(isinstance(k, bool) or not isinstance(k, int) or k < 0
                            for k in value) or max(value) > self.num_draft_tokens:
            raise ConfigError("speculative.adaptive_k", list(value),
                              f"must be a non-empty list of integers in [0, "
                              f"num_draft_tokens = {self.num_draft_tokens}]",
                              "or leave it unset for 0 .. num_draft_tokens")

    @tree.validator
    def _check_tree(self, attribute: attrs.Attribute[Any],
                    value: tuple[tuple[int, ...], ...] | None) -> None:
        if value is None:
            return
        from specloop.samplers._tree import DraftTree  # noqa: PLC0415
        try:
            tree = DraftTree(value)
        except ValueError as exc:
            raise ConfigError("speculative.tree", [list(p) for p in value], str(exc),
                              "list each node's path of sibling ranks from the root, "
                              "e.g. [[0], [1], [0, 0]]") from None
        if tree.depth != self.num_draft_tokens:
            raise ConfigError("speculative.tree", [list(p) for p in value],
                              f"is {tree.depth} deep, num_draft_tokens = "
                              f"{self.num_draft_tokens} (batches on the advanced path "
                              "draft the chain of the tree's depth)",
                              f"set num_draft_tokens = {tree.depth}")

    @property
    def verify_drafts(self) -> int:
        """The most draft rows one VERIFY adds to a request, which its cache must have room
        for: the tree's nodes with a tree, else K (0 when disabled)."""
        return len(self.tree) if self.tree is not None and self.enabled else self.k

    @property
    def draft_tree(self) -> DraftTree | None:
        """``tree`` as a DraftTree (None: chains only)."""
        if self.tree is None or not self.enabled:
            return None
        from specloop.samplers._tree import DraftTree  # noqa: PLC0415
        return DraftTree(self.tree)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def k_values(self) -> tuple[int, ...]:
        """The K values an iteration may run: (k,) fixed, several when adaptive."""
        if not self.enabled:
            return (0,)
        if not self.adaptive:
            return (self.num_draft_tokens,)
        chosen = range(self.num_draft_tokens + 1) if self.adaptive_k is None else \
            self.adaptive_k
        return tuple(sorted(set(chosen) | {self.num_draft_tokens}))

    @property
    def k(self) -> int:
        """Draft tokens per iteration: 0 when speculation is off."""
        return self.num_draft_tokens if self.enabled else 0


@attrs.frozen
class ParallelConfig:
    world_size: int = attrs.field(default=1, validator=_at_least("parallel", 1))
    attention_dp: bool = False
    lm_head_tp_in_adp: bool = False
    context_parallel_size: int = attrs.field(default=1, validator=_at_least("parallel", 1))
    # Exchange a signature before each real-backend collective (turns hangs into errors).
    checked_collectives: bool = False
    # The longest any rank waits in one collective for the others (a stalled rank then
    # surfaces as CollectiveTimeoutError on every other rank); covers model-load skew too.
    collective_timeout_s: float = attrs.field(default=60.0,
                                              validator=_positive_float("parallel"))
    # Each rank's event-loop thread on a physical core of its own, the process's other
    # threads off the ranks' loop cores (comm/_affinity.py): "auto" pins CUDA ranks under
    # torchrun when there are enough cores, "on" wherever Linux allows, "off" never.
    pin_host_cores: str = attrs.field(default="auto",
                                      validator=_in("parallel", ("auto", "on", "off")))
    # While an engine runs, the objects alive when it started (torch, the model, the
    # tokenizer, ~200k) are out of the cyclic GC's reach (gc.freeze): each full collection
    # walked them all, a pause of tens of ms every few dozen iterations at large batches.
    # "auto": on CUDA devices (a CPU's step is far longer than the pauses, and the full
    # collection at close, ~0.1 s, would add up over the test suite's engines).
    freeze_gc: str = attrs.field(default="auto",
                                 validator=_in("parallel", ("auto", "on", "off")))


def _buckets(instance: object, attribute: attrs.Attribute[Any], value: tuple[object, ...]) -> None:
    if not value or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in value):
        raise ConfigError("graphs.batch_buckets", list(value),
                          "must be a non-empty list of integers >= 1")


@attrs.frozen
class GraphsConfig:
    """CUDA-graph capture (components.graph_cache = "cuda"): VERIFY is captured at warmup
    for each bucket <= max_batch_size (and max_batch_size itself), per sampling variant."""

    batch_buckets: tuple[int, ...] = attrs.field(default=(1, 2, 4, 8, 16, 32, 64, 128),
                                                 converter=tuple, validator=_buckets)


@attrs.frozen
class ComponentsConfig:
    sampler: str = "default"
    communicator: str = "single"
    graph_cache: str = "eager"
    # None: the drafter registered under speculative.method.
    drafter: str | None = None
    # Iteration observers every rank's engine builds (before those passed to AsyncEngine).
    observers: tuple[str, ...] = ()


@attrs.frozen
class EngineConfig:
    model: ModelConfig = attrs.Factory(ModelConfig)
    scheduler: SchedulerConfig = attrs.Factory(SchedulerConfig)
    speculative: SpeculativeConfig = attrs.Factory(SpeculativeConfig)
    parallel: ParallelConfig = attrs.Factory(ParallelConfig)
    components: ComponentsConfig = attrs.Factory(ComponentsConfig)
    graphs: GraphsConfig = attrs.Factory(GraphsConfig)

    def __attrs_post_init__(self) -> None:
        check_gates(self)

    @property
    def group_sync_greedy_flag(self) -> bool:
        """The config gate of the group-synchronised all-greedy flag (DESIGN: SYNC)."""
        return self.parallel.lm_head_tp_in_adp and self.speculative.use_rejection_sampling

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        return structure_config(data)

    @classmethod
    def from_toml(cls, path: str | Path) -> EngineConfig:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError("config file", str(path), "not found") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config file", str(path), f"invalid TOML: {exc}") from exc
        return structure_config(data)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = _converter().unstructure(self)
        return data


def check_gates(config: EngineConfig) -> None:
    par, spec, comp = config.parallel, config.speculative, config.components
    if par.lm_head_tp_in_adp and not par.attention_dp:
        raise ConfigError("parallel.lm_head_tp_in_adp", True,
                          "the LM-head TP group is the attention-DP group",
                          "set parallel.attention_dp = true or lm_head_tp_in_adp = false")
    if spec.use_rejection_sampling and par.context_parallel_size > 1:
        raise ConfigError(
            "speculative.use_rejection_sampling", True,
            "use_rejection_sampling=True is not supported for this configuration: context "
            "parallelism is active (the draft path resolves only the global argmax, not "
            "full distributions)",
            "set parallel.context_parallel_size = 1 or use_rejection_sampling = false")
    if par.context_parallel_size > 1:
        raise ConfigError("parallel.context_parallel_size", par.context_parallel_size,
                          "context parallelism is not implemented in specloop",
                          "set it to 1")
    if par.world_size > 1 and not par.attention_dp:
        raise ConfigError("parallel.attention_dp", False,
                          f"world_size = {par.world_size} needs a parallel mode; attention "
                          "data parallelism is the one specloop runs",
                          "set parallel.attention_dp = true")
    if par.collective_timeout_s <= config.scheduler.idle_wait_s:
        raise ConfigError("parallel.collective_timeout_s", par.collective_timeout_s,
                          f"an idle rank 0 waits scheduler.idle_wait_s = "
                          f"{config.scheduler.idle_wait_s} s between exchanges, so the other "
                          "ranks would time out", "make it larger than idle_wait_s")
    if spec.method == "draft_model" and not spec.draft_model:
        raise ConfigError("speculative.draft_model", None,
                          "method 'draft_model' needs a draft model",
                          "name a registry model or a path sharing the target's tokenizer")
    if spec.ngram_min > spec.ngram_max:
        raise ConfigError("speculative.ngram_min", spec.ngram_min,
                          f"must not exceed ngram_max = {spec.ngram_max}")
    if spec.early_exit_layers is not None and spec.early_exit_layers < 1:
        raise ConfigError("speculative.early_exit_layers", spec.early_exit_layers,
                          "must be >= 1", "or leave it unset for a quarter of the layers")
    registry = component_registry()
    for kind in ("sampler", "communicator", "graph_cache"):
        check_component_name(kind, getattr(comp, kind), f"components.{kind}",
                             registry=registry)
    for name in comp.observers:
        check_component_name("observer", name, "components.observers", registry=registry)
    if comp.drafter and not spec.enabled:
        raise ConfigError("components.drafter", comp.drafter,
                          "a drafter is named but speculative.method = 'none'",
                          "choose a speculative.method or remove components.drafter")
    if spec.enabled:
        check_component_name("drafter", comp.drafter or spec.method, "components.drafter",
                             registry=registry)


class _WrongType(TypeError):
    def __init__(self, value: Any, expected: str) -> None:
        self.value, self.expected = value, expected
        super().__init__(f"expected {expected}, got {type(value).__name__}")


def _strict(kind: type, expected: str) -> Callable[[Any, Any], Any]:
    # No silent coercion: "false" must not become True, 2.7 must not become 2.
    def structure(value: Any, _type: Any) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise _WrongType(value, expected)
        return float(value) if kind is float else value
    return structure


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    for kind, expected in ((bool, "true or false"), (int, "an integer"),
                           (float, "a number"), (str, "a string")):
        converter.register_structure_hook(kind, _strict(kind, expected))
    # A lone string would otherwise become a tuple of its characters.
    converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _names)
    return converter


def _names(value: Any, _type: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _WrongType(value, "a list of strings")
    return tuple(value)


def _first_error(exc: BaseException, path: str = "") -> tuple[str, BaseException]:
    """Dig the first leaf error and its dotted path out of cattrs' exception groups."""
    if isinstance(exc, ConfigError):
        return path, exc
    if isinstance(exc, ForbiddenExtraKeysError):
        return path, exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            note = next((n for n in getattr(sub, "__notes__", []) if "attribute" in n), "")
            name = note.split("@ attribute ")[-1].split()[0] if "@ attribute" in note else ""
            return _first_error(sub, f"{path}.{name}".strip(".") if name else path)
    return path, exc


def structure_config(data: dict[str, Any]) -> EngineConfig:
    if not isinstance(data, dict):
        raise ConfigError("config", data, "must be a table / dict")
    try:
        return _converter().structure(data, EngineConfig)
    except ConfigError:
        raise
    except (ClassValidationError, ForbiddenExtraKeysError) as exc:
        path, leaf = _first_error(exc)
        if isinstance(leaf, ConfigError):
            raise leaf from None
        if isinstance(leaf, ForbiddenExtraKeysError):
            where = f"{path}." if path else ""
            keys = ", ".join(sorted(leaf.extra_fields))
            cls = leaf.cl
            fields = ", ".join(a.name for a in attrs.fields(cls))
            raise ConfigError(f"{where}{keys}", keys, "unknown key",
                              f"known keys here: {fields}") from None
        if isinstance(leaf, _WrongType):
            raise ConfigError(path or "config", leaf.value,
                              f"wrong type: expected {leaf.expected}") from None
        raise ConfigError(path or "config", None, f"invalid value ({leaf})") from None
