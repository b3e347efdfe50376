"""The job spec: one definition shared by the API (validation) and the job runner.

No heavy imports here: the API process imports this module and never loads torch.
Checks that need the optimizer catalogue (names, hyperparameters, ranges) are in
`catalogue_errors`, which works from the catalogue's JSON form.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from jobs.checks.report import CHECK_IDS
from jobs.data_roots import resolve_data_path
from jobs.result import OptimizerSource
from optimizers.hyperparams import MAX_LIST_LENGTH as MAX_LIST_LENGTH  # re-exported for the OpenAPI
from optimizers.hyperparams import MAX_STRING_LENGTH as MAX_STRING_LENGTH
from optimizers.hyperparams import OPTION_TEXT_PATTERN as OPTION_TEXT_PATTERN
from optimizers.hyperparams import Param, switch_note
from optimizers.loop_needs import LoopNeeds, loop_problem, needs_unserved_by, recipe_problem
from optimizers.param_groups import GroupRule, extra_key_problem, matches_nothing, parse_ndim, unmatched_rule
from optimizers.registry import FRAMEWORK_OF_STYLE, PLUGIN_SOURCE, STYLES, unknown_optimizer
from optimizers.schedules import (
    Cosine,
    LinearWarmup,
    PiecewiseConstant,
    Schedule,
    ScheduleParamError,
    build_schedule,
)

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.\-]*$"
Name = Annotated[str, Field(min_length=1, max_length=100, pattern=NAME_PATTERN)]
JsonScalar = bool | int | float | str | None


# Hyperparameters beyond this magnitude are typos or probes (lr=1e308), never a setting.
MAX_PARAM_MAGNITUDE = 1e9
# A nonzero one below float32's smallest normal number is flushed to 0 (or loses its digits) where
# the job computes in float32: Adam's eps=1e-50 became 0, and a zero gradient then gave 0/0 = NaN.
MIN_NONZERO_MAGNITUDE = float.fromhex("0x1p-126")  # 1.1754943508222875e-38
# Experiment (and study) names reach MLflow's UI, log lines and folder names: letters, digits and a
# few separators, so no control or bidirectional characters (U+202E) and no path separators.
SAFE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.,:=+@()-]*$"
SAFE_NAME_ALLOWED = "letters A-Z a-z, digits, spaces and _ . , : = + @ ( ) -, starting with a letter or digit"


def _safe_name(value: str) -> str:
    if not re.fullmatch(SAFE_NAME_PATTERN, value):
        raise PydanticCustomError("safe_name", "may contain only {allowed}", {"allowed": SAFE_NAME_ALLOWED})
    return value


SafeName = Annotated[
    str,
    Field(min_length=1, max_length=200, json_schema_extra={"pattern": SAFE_NAME_PATTERN}),
    AfterValidator(_safe_name),
]


def _finite(value: Any, where: str | int) -> None:
    """Refuse a number that is not finite or is huge, in a list too; the error's ctx `key` is `where`
    (a hyperparameter's name, or a grid value's index), which the API appends to its location."""
    if isinstance(value, float) and value != 0 and abs(value) < MIN_NONZERO_MAGNITUDE:
        raise PydanticCustomError(
            "number_too_small",
            "{key} must be 0 or of magnitude at least 1.2e-38 (float32's smallest normal number, which "
            "jobs compute in: a smaller one becomes 0); received {received}",
            {"key": where, "received": repr(value)},
        )
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        if abs(value) > MAX_PARAM_MAGNITUDE:
            raise PydanticCustomError(
                "number_too_large",
                "{key} must be a number of magnitude at most 1e9; received {received}",
                # Exactly (1.0000001e9 had read "1e+09", which looks allowed); a huge int in short.
                {"key": where, "received": repr(value) if abs(value) < 1e20 else f"{value:.10g}"},
            )
    if isinstance(value, float) and not math.isfinite(value):
        # A custom error type carries the key, so the API can point at params.<key>.
        raise PydanticCustomError(
            "finite_number",
            "{key} must be a finite number; received {received}",
            {"key": where, "received": "NaN" if math.isnan(value) else str(value).replace("inf", "Infinity")},
        )
    if isinstance(value, list):
        for item in value:
            _finite(item, where)


def short_number(value: float) -> str:
    """`0.05` stays `0.05`; small rates read as in papers: `0.0003` -> `3e-4`."""
    text = f"{value:g}"
    if "e" in text or value == 0 or abs(value) >= 1e-3:
        return text.replace("e-0", "e-").replace("e+0", "e+")
    mantissa, exponent = f"{value:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def optimizer_label(optimizer: Mapping[str, Any]) -> str:
    """`ema_momentum lr=0.05` from a spec's optimizer part (a dict, as the API returns it)."""
    rated = optimizer.get("base") or optimizer
    lr = rated.get("params", {}).get("lr")
    name = f"{optimizer['name']}({optimizer['base']['name']})" if optimizer.get("base") else optimizer["name"]
    if isinstance(lr, int | float) and not isinstance(lr, bool):
        return f"{name} lr={short_number(lr)}"
    return str(name)


def styled_optimizer_label(optimizer: Mapping[str, Any], framework: str) -> str:
    """`optimizer_label`, naming a TensorFlow job's style: `lion (tf_legacy) lr=0.0003`. Without it a
    legacy and a Keras 3 job of one optimizer read alike (in MLflow's charts, in `optlab submit --wait`)."""
    label = optimizer_label(optimizer)
    if framework == "torch":
        return label
    name, _, rest = label.partition(" ")
    style = optimizer.get("style") or default_style(framework)
    return f"{name} ({style}) {rest}".rstrip()


def _finite_params(params: dict[str, Any]) -> dict[str, Any]:
    for key, value in params.items():
        if isinstance(value, list):  # betas: [0.9, NaN] is refused at betas.1
            for position, item in enumerate(value):
                _finite_item(key, position, item)
        else:
            _finite(value, key)
    return params


def _finite_item(key: str, position: int, value: Any) -> None:
    """One item of a list (a list-valued hyperparameter, a grid axis) finite and in range, a bad one
    located by its index (`params.betas.1`, `optimizers.1.params.lr.2`, where the catalogue's own
    checks locate a value out of range), not at the whole list."""
    try:
        _finite(value, position)
    except PydanticCustomError as error:
        # A ValidationError raised in a validator is located below the field validated: here, under
        # the params, at `key`. The API appends the error's ctx `key` to its location: the index.
        raise ValidationError.from_exception_data(
            "list item", [{"type": error, "loc": (key,), "input": value}]
        ) from None


# Hyperparameters as JSON gives them: at most 64, finite numbers only.
Params = Annotated[
    dict[Annotated[str, Field(max_length=100)], JsonScalar | list[JsonScalar]],
    Field(max_length=64),
    AfterValidator(_finite_params),
]


class Component(BaseModel):
    """A named catalogue item with its parameters, e.g. an optimizer and its hyperparameters."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Name
    params: Params = Field(default_factory=dict)


class GroupMatch(BaseModel):
    """Which parameters a param group takes: every test given must hold."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ndim: str | None = Field(
        default=None, max_length=10, description='tensor dimensions, a comparison: "<2", ">=2", "==1"'
    )
    name: str | None = Field(
        default=None, min_length=1, max_length=200, description='parameter name glob, e.g. "logits.*"'
    )

    @field_validator("ndim")
    @classmethod
    def _comparison(cls, ndim: str | None) -> str | None:
        if ndim is not None:
            try:
                parse_ndim(ndim)
            except ValueError as exc:
                raise PydanticCustomError("ndim_comparison", "{reason}", {"reason": str(exc)}) from None
        return ndim

    def rule(self) -> GroupRule:
        return GroupRule(ndim=self.ndim, name=self.name)


class ParamGroupRecipe(BaseModel):
    """One param group: the parameters `match` takes get these hyperparameters over the optimizer's.

    `params` may also set keys the optimizer reads from its groups without cataloguing them
    (Muon's `use_muon`): a JSON scalar or a list of numbers, passed as given
    (`optimizers.param_groups.extra_key_problem`).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    match: GroupMatch | Literal["rest"] = Field(
        description='ndim and/or name tests, or "rest" (last only): every parameter no earlier group took'
    )
    params: Params = Field(default_factory=dict)

    @field_validator("match")
    @classmethod
    def _some_test(cls, match: GroupMatch | str) -> GroupMatch | str:
        if isinstance(match, GroupMatch) and match.ndim is None and match.name is None:
            raise PydanticCustomError(
                "empty_match",
                'match needs ndim (e.g. "<2"), name (a glob, e.g. "logits.*") or both, or is "rest"',
                {},
            )
        return match

    def rule(self) -> GroupRule:
        # A rule without tests matches every parameter: as the last one, the rest.
        return self.match.rule() if isinstance(self.match, GroupMatch) else GroupRule()


class OptimizerSetup(BaseModel):
    """What a spec may state of an optimizer beyond its name and hyperparameters, in a job and in a
    study's optimizer alike: the optimizer a wrapper wraps, needs the catalogue could not detect,
    and param groups."""

    model_config = ConfigDict(extra="forbid", strict=True)

    base: OptimizerChoice | None = Field(
        default=None,
        description="wrappers only (needs.base_optimizer, e.g. lookahead, sam): the optimizer they wrap; "
        "the learning rate is the base's",
    )
    needs: dict[Annotated[str, Field(max_length=100)], bool | str | None] | None = Field(
        default=None,
        description="what the loop must do that the catalogue could not detect, merged over its needs: "
        "closure, create_graph, train_eval, backward_in_step (true/false), base_optimizer, model_argument "
        "(an argument name)",
    )

    @field_validator("needs")
    @classmethod
    def _known_needs(cls, needs: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            LoopNeeds().with_overrides(needs or {}, owner="optimizer.needs")
        except ValueError as exc:
            raise PydanticCustomError("unknown_need", "{reason}", {"reason": str(exc)}) from None
        return needs

    param_groups: list[ParamGroupRecipe] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="torch jobs: param groups by tensor ndim and/or name glob, first match wins; "
        "a last \"rest\" group takes the others, else they keep the optimizer's params (a wrapper's "
        "groups are its base's); params may also set group keys the optimizer reads (Muon's use_muon)",
    )

    @field_validator("param_groups")
    @classmethod
    def _rest_last(cls, groups: list[ParamGroupRecipe] | None) -> list[ParamGroupRecipe] | None:
        for index, group in enumerate((groups or [])[:-1]):
            if group.match == "rest":
                raise PydanticCustomError(
                    "rest_not_last",
                    'param_groups[{index}]: "rest" takes every parameter left, so it must be the last group; '
                    "received {count} groups",
                    {"index": index, "count": len(groups or [])},
                )
        return groups

    def setup(self) -> dict[str, Any]:
        """The stated setup as a job spec's optimizer has it (only what is stated)."""
        return self.model_dump(include={"base", "needs", "param_groups"}, exclude_none=True)


class OptimizerChoice(OptimizerSetup, Component):
    """An optimizer by name; for TensorFlow jobs `style` picks Keras 3 or legacy tf.keras."""

    style: Literal["keras", "tf_legacy"] | None = Field(
        default=None,
        description="tensorflow jobs only: keras (default where both exist) or tf_legacy",
    )
    source: OptimizerSource | None = Field(
        default=None,
        description="set by the service when it accepts the job (one sent is replaced): the plugin "
        "class the job was validated against; the job fails at its start if the name now runs another",
    )

    def group_rules(self) -> list[tuple[GroupRule, Mapping[str, Any]]]:
        return [(group.rule(), group.params) for group in self.param_groups or ()]

    def rate_params(self) -> Mapping[str, Any]:
        """Where the learning rate is: a wrapper's base takes it (SAM forwards it, Lookahead has none)."""
        return self.base.params if self.base is not None else self.params


TENSORFLOW_STYLES = ("keras", "tf_legacy")
# The styles each framework runs, the one a spec means when it names none first (Keras 3
# before legacy). A spec may only name a style where there is a choice.
STYLES_OF_FRAMEWORK: dict[str, tuple[str, ...]] = {"torch": ("torch",), "tensorflow": TENSORFLOW_STYLES}


def default_style(framework: str) -> str:
    return STYLES_OF_FRAMEWORK[framework][0]


def framework_of_style(style: str) -> str:
    return FRAMEWORK_OF_STYLE[style]


def style_choice(framework: str) -> bool:
    """Whether a spec of `framework` may name `optimizer.style` (only where it has several)."""
    return len(STYLES_OF_FRAMEWORK[framework]) > 1


# A wall-clock limit the worker enforces (the job ends `failed`); OPTLAB_MAX_JOB_SECONDS caps it.
TIMEOUT_FIELD = Field(
    default=None,
    ge=1,
    le=2**31 - 1,
    allow_inf_nan=False,  # NaN had been told "less than or equal to 2147483647"
    description="wall-clock limit, seconds, at least 1 (OPTLAB_MAX_JOB_SECONDS caps it)",
)


# Which framework runs each data-parallel strategy.
STRATEGY_FRAMEWORK = {"ddp": "torch", "mirrored": "tensorflow"}
MAX_DEVICES = 8


class Distribution(BaseModel):
    """One job trained data-parallel on `devices` devices: torch DDP (one process per device: gloo on
    CPU, NCCL on GPUs) or Keras's `tf.distribute.MirroredStrategy` (logical CPUs, or GPUs). Each
    device takes an equal share of `batch_size`; the job occupies `devices` worker slots."""

    model_config = ConfigDict(extra="forbid", strict=True)

    strategy: Literal["ddp", "mirrored"]
    devices: int = Field(ge=1, le=MAX_DEVICES)


class JobSpec(BaseModel):
    """What to train, with what, for how long. The learning rate is `optimizer.params.lr`."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "framework": "torch",
                    "workload": {"name": "digits_mlp"},
                    "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}},
                    "schedule": {"name": "cosine", "params": {"warmup_steps": 20}},
                    "steps": 300,
                    "batch_size": 64,
                    "seed": 0,
                    "checkpoint_every": 100,
                    "eval_every": 100,
                    "experiment": "demo",
                }
            ]
        },
    )

    framework: Literal["torch", "tensorflow"] = "torch"
    workload: Component
    optimizer: OptimizerChoice
    schedule: Component = Field(default_factory=lambda: Component(name="constant"))
    steps: int = Field(gt=0, le=2**31 - 1, description="optimizer updates to run (OPTLAB_MAX_STEPS caps it)")
    batch_size: int = Field(default=64, gt=0, le=65536)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    checkpoint_every: int = Field(
        default=100, gt=0, le=2**31 - 1, description="steps between verified checkpoints; at most `steps`"
    )
    eval_every: int = Field(
        default=100, gt=0, le=2**31 - 1, description="steps between validation passes; at most `steps`"
    )
    experiment: SafeName = Field(default="default", description=f"MLflow experiment: {SAFE_NAME_ALLOWED}")
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]{1,2})?)$",
        description="auto (a GPU where there is one), cpu or cuda; cuda:N names a GPU by index, for "
        "`python -m jobs.run` run by hand only: a worker picks each job's GPUs, so the API refuses N >= 1",
    )
    jit_compile: bool = Field(default=False, description="tensorflow jobs: compile the step with XLA")
    compile: bool = Field(
        default=False,
        description="torch jobs: torch.compile the model (forward and backward); the result's "
        "compile_seconds says what compiling cost",
    )
    timeout_s: float | None = TIMEOUT_FIELD
    distribution: Distribution | None = Field(
        default=None, description="data-parallel training: ddp (torch) or mirrored (tensorflow) over devices"
    )

    @field_validator("jit_compile")
    @classmethod
    def _jit_compile_is_tensorflows(cls, wanted: bool, info: ValidationInfo) -> bool:
        # Silently ignored, it would let a user believe their torch job ran under XLA.
        framework = info.data.get("framework")
        if wanted and framework is not None and framework != "tensorflow":
            raise PydanticCustomError(
                "jit_compile_framework",
                "jit_compile (XLA) is for tensorflow jobs; a {framework} job compiles its model "
                "with compile (torch.compile)",
                {"framework": framework},
            )
        return wanted

    @field_validator("compile")
    @classmethod
    def _compile_is_torchs(cls, wanted: bool, info: ValidationInfo) -> bool:
        framework = info.data.get("framework")
        if wanted and framework is not None and framework != "torch":
            raise PydanticCustomError(
                "compile_framework",
                "compile (torch.compile) is for torch jobs; a {framework} job compiles its step "
                "with jit_compile (XLA)",
                {"framework": framework},
            )
        return wanted

    @field_validator("distribution")
    @classmethod
    def _strategy_fits(cls, distribution: Distribution | None, info: ValidationInfo) -> Distribution | None:
        if distribution is None:
            return None
        framework, batch_size = info.data.get("framework"), info.data.get("batch_size")
        wanted = STRATEGY_FRAMEWORK[distribution.strategy]
        if framework is not None and framework != wanted:
            raise PydanticCustomError(
                "strategy_framework",
                "strategy '{strategy}' trains {wanted} jobs only (ddp: torch, mirrored: tensorflow); "
                "received framework '{framework}'",
                {"strategy": distribution.strategy, "wanted": wanted, "framework": framework},
            )
        if isinstance(batch_size, int) and batch_size % distribution.devices:
            raise PydanticCustomError(
                "devices_batch",
                "devices must divide batch_size (each device an equal share); received devices "
                "{devices} for batch_size {batch_size}",
                {"devices": distribution.devices, "batch_size": batch_size},
            )
        return distribution

    @field_validator("distribution")
    @classmethod
    def _mirrored_xla_needs_gpus(
        cls, distribution: Distribution | None, info: ValidationInfo
    ) -> Distribution | None:
        # Mirrored over logical CPUs, XLA refuses one replica's variables on another's device: such a
        # job could only fail at its first step (on GPUs it is Keras's own way, and allowed).
        if (
            distribution is not None
            and distribution.strategy == "mirrored"
            and distribution.devices > 1
            and info.data.get("jit_compile")
            and info.data.get("device") == "cpu"
        ):
            raise PydanticCustomError(
                "mirrored_xla_cpu",
                "jit_compile (XLA) cannot compile a step mirrored over logical CPUs (device cpu); set "
                "jit_compile to false, or run on GPUs",
                {},
            )
        return distribution

    @property
    def devices(self) -> int:
        """How many devices (and worker slots) the job takes."""
        return self.distribution.devices if self.distribution is not None else 1

    @property
    def total_steps(self) -> int:
        """What the job's progress counts: optimizer updates."""
        return self.steps

    @property
    def lr(self) -> float | None:
        value = self.optimizer.rate_params().get("lr")
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def run_name(self) -> str:
        """How the run reads in the MLflow UI: `ema_momentum lr=0.05 digits_mlp seed=0`,
        `lookahead(adamw) lr=0.001 digits_mlp seed=0`; a tensorflow job's names its style,
        `ema_momentum (tf_legacy) lr=0.05 digits_mlp seed=0`: its runs and a torch job's of the same
        optimizer had read alike in one experiment's charts."""
        label = styled_optimizer_label(self.optimizer.model_dump(), self.framework)
        return f"{label} {self.workload.name} seed={self.seed}"

    def flat_params(self) -> dict[str, str]:
        """The spec as MLflow params: `optimizer.name`, `optimizer.lr`, `schedule.name`, ..."""
        flat = _flatten(self.model_dump(mode="json", exclude={"distribution"}))
        if self.distribution is not None:
            flat["distribution.strategy"] = self.distribution.strategy
            flat["distribution.devices"] = str(self.distribution.devices)
        return flat


class CheckSpec(BaseModel):
    """Run the conformance checks (`jobs.checks`) on a registered optimizer with these hyperparameters."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {"framework": "torch", "optimizer": {"name": "lion", "params": {"lr": 0.0003}}},
                {
                    "framework": "tensorflow",
                    "optimizer": {"name": "ema_momentum", "params": {"lr": 0.05}, "style": "tf_legacy"},
                    "checks": ["construct", "dense_step", "config_roundtrip"],
                },
            ]
        },
    )

    kind: Literal["check"] = "check"
    framework: Literal["torch", "tensorflow"] = "torch"
    optimizer: OptimizerChoice
    # The schema lists the ids; the validator below says which one is unknown and what is known.
    checks: list[Annotated[str, WithJsonSchema({"type": "string", "enum": list(CHECK_IDS)})]] | None = Field(
        default=None,
        min_length=1,
        max_length=len(CHECK_IDS),
        description=f"check ids to run (default all): {', '.join(CHECK_IDS)}",
    )
    experiment: SafeName = Field(
        default="optimizer-checks", description=f"MLflow experiment: {SAFE_NAME_ALLOWED}"
    )
    timeout_s: float | None = TIMEOUT_FIELD

    @field_validator("checks")
    @classmethod
    def _known_checks(cls, checks: list[str] | None) -> list[str] | None:
        unknown = [check for check in checks or () if check not in CHECK_IDS]
        if unknown:
            raise PydanticCustomError(
                "unknown_check",
                "unknown check id {check}; known: {known}",
                {"check": repr(unknown[0]), "known": ", ".join(CHECK_IDS)},
            )
        return checks

    def check_ids(self) -> list[str]:
        """The checks this job runs, in the stable order of CHECK_IDS."""
        return [check for check in CHECK_IDS if self.checks is None or check in self.checks]

    @property
    def total_steps(self) -> int:
        """What the job's progress counts: checks done."""
        return len(self.check_ids())

    def run_name(self) -> str:
        """How the run reads in the MLflow UI: `check lion (torch)`, `check lion lr=3e-4 (keras)`."""
        label = optimizer_label(self.optimizer.model_dump())
        return f"check {label} ({self.optimizer.style or self.framework})"

    def flat_params(self) -> dict[str, str]:
        """MLflow params: the hyperparameters (`optimizer.lr`, ...), framework, style and checks."""
        return _flatten(self.model_dump(mode="json", exclude={"kind"}))


AnySpec = JobSpec | CheckSpec


def parse_params(text: str) -> dict[str, Any]:
    """`--params` JSON as a dict; ValueError says what is allowed.

    Here rather than in jobs.checks so `optlab check` parses it the same way locally and with
    `--remote`, where the service may import only jobs.spec and jobs.result.
    """
    return _json_object(text, "--params", '{"lr": 0.01}')


def parse_needs(text: str, *, option: str = "--needs") -> dict[str, Any]:
    """`--needs` JSON: the keys and checks of a job spec's `optimizer.needs`; ValueError names the
    bad key and the allowed ones."""
    needs = _json_object(text, option, '{"closure": true}')
    LoopNeeds().with_overrides(needs, owner=option)
    return needs


def parse_param_groups(text: str, *, option: str = "--param-groups") -> list[dict[str, Any]]:
    """`--param-groups` JSON: a recipe in the form of a job spec's `optimizer.param_groups`, checked
    by the same rules; ValueError says where and what is allowed."""
    example = '[{"match": {"ndim": ">=2"}, "params": {"use_muon": true}}, {"match": "rest", "params": {...}}]'
    groups = _json_option(text, option, example, list)
    try:
        choice = OptimizerChoice.model_validate({"name": "recipe", "param_groups": groups})
    except ValidationError as exc:
        raise ValueError(f"{option}{_first_error(exc, skip=1)}") from None
    return [group.model_dump(exclude_defaults=True) for group in choice.param_groups or ()]


def parse_base(text: str, *, option: str = "--base") -> dict[str, Any]:
    """`--base` JSON: the optimizer a wrapper wraps, as a job spec's `optimizer.base` names it
    (`name`, `params`, `needs`); ValueError says what is wrong."""
    base = _json_object(text, option, '{"name": "adamw", "params": {"lr": 0.001}}')
    extra = sorted(set(base) - {"name", "params", "needs"})
    if extra:
        raise ValueError(f"{option} takes name, params and needs; received {extra[0]!r}")
    try:
        choice = OptimizerChoice.model_validate(base)
    except ValidationError as exc:
        raise ValueError(f"{option}{_first_error(exc)}") from None
    return choice.model_dump(include={"name", "params", "needs"}, exclude_none=True)


def _json_object(text: str, option: str, example: str) -> dict[str, Any]:
    value: dict[str, Any] = _json_option(text, option, example, dict)
    return value


def _json_option(text: str, option: str, example: str, kind: type[dict[str, Any]] | type[list[Any]]) -> Any:
    """A command-line option's JSON, of `kind`; ValueError names the option and shows an example."""
    what = "a JSON object" if kind is dict else "a JSON list"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{option} must be {what} such as '{example}'; {exc}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{option} must be {what} such as '{example}'; received {text}")
    return value


def _first_error(error: ValidationError, *, skip: int = 0) -> str:
    """`[1].match: message` from pydantic's first error, its location after `skip` parts."""
    first = error.errors()[0]
    # Left out: the tags pydantic gives each member of a union (`GroupMatch`, `literal['rest']`).
    parts = [p for p in first["loc"][skip:] if not (isinstance(p, str) and (p[:1].isupper() or "[" in p))]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts)
    return f"{where}: {first['msg']}"


def parse_spec(text: str) -> AnySpec:
    """A stored spec of either kind: `"kind": "check"` marks a check job, anything else trains."""
    try:
        kind = json.loads(text).get("kind")
    except (ValueError, AttributeError):
        kind = None
    if kind == "check":
        return CheckSpec.model_validate_json(text)
    return JobSpec.model_validate_json(text)


# MLflow keeps a param's first 6000 characters: a longer value (an 11 kB param-group recipe) became
# a JSON text cut mid-way, which reads as whole.
MAX_MLFLOW_PARAM_CHARS = 6000


def mlflow_param_text(text: str, *, whole: str = "spec.json") -> str:
    """`text` as an MLflow param: whole where it fits, else its start and a note of where the rest is."""
    if len(text) <= MAX_MLFLOW_PARAM_CHARS:
        return text
    note = f"... (cut: {len(text)} characters in all; the whole is in the run's {whole})"
    return text[: MAX_MLFLOW_PARAM_CHARS - len(note)] + note


def _flatten(dump: Mapping[str, Any]) -> dict[str, str]:
    """The spec as MLflow params (each at most `MAX_MLFLOW_PARAM_CHARS`)."""
    return {key: mlflow_param_text(value) for key, value in _flat(dump).items()}


def _flat(dump: Mapping[str, Any]) -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in dump.items():
        if isinstance(value, dict):
            flat[f"{key}.name"] = str(value["name"])
            for param, param_value in value.get("params", {}).items():
                flat[f"{key}.{param}"] = str(param_value)
            if value.get("style"):
                flat[f"{key}.style"] = str(value["style"])
            if value.get("base"):
                flat.update({f"{key}.{k}": v for k, v in _flat({"base": value["base"]}).items()})
            if value.get("param_groups"):
                flat[f"{key}.param_groups"] = json.dumps(value["param_groups"], separators=(",", ":"))
            for need, need_value in (value.get("needs") or {}).items():
                flat[f"{key}.needs.{need}"] = str(need_value)
        elif isinstance(value, list):
            flat[key] = ",".join(map(str, value))
        elif value is not None:
            flat[key] = str(value)
    return flat


class SpecError(BaseModel):
    """One problem, located like FastAPI's own validation errors."""

    loc: list[str | int]
    msg: str
    type: str = "value_error"


class Catalogue(BaseModel):
    """What the job side can run, as published by `python -m jobs.catalogue`."""

    model_config = ConfigDict(extra="ignore")

    optimizers: list[dict[str, Any]]
    schedules: list[dict[str, Any]]
    workloads: list[dict[str, Any]]
    errors: list[dict[str, str]] = Field(default_factory=list)

    def optimizer(
        self, name: str, framework: str | None = None, style: str | None = None
    ) -> dict[str, Any] | None:
        """The implementation of `name` a job would run.

        Within a framework without a `style`, Keras 3 is preferred over legacy tf.keras.
        """
        candidates = [
            o
            for o in self.optimizers
            if o["name"] == name and framework in (None, o["framework"]) and style in (None, o["style"])
        ]
        candidates.sort(key=lambda o: STYLES.index(o["style"]))
        return candidates[0] if candidates else None

    def optimizer_names(self) -> list[str]:
        return sorted({o["name"] for o in self.optimizers})

    def unknown_optimizer(self, name: str) -> str:
        """Why `name` is not an optimizer here: the known ones, and the sources that failed to load,
        which may be where it is (a plugin with a syntax error had been only "unknown")."""
        failed = [(error["source"], error["error"]) for error in self.errors]
        return unknown_optimizer(name, self.optimizer_names(), failed)

    def schedule(self, name: str) -> dict[str, Any] | None:
        return next((s for s in self.schedules if s["name"] == name), None)

    def workload(self, name: str) -> dict[str, Any] | None:
        return next((w for w in self.workloads if w["name"] == name), None)


def catalogue_errors(
    spec: JobSpec, catalogue: Catalogue, *, max_steps: int, data_roots: Sequence[Path] = ()
) -> list[SpecError]:
    """Everything in `spec` that the catalogue or the service's limits reject.

    `data_roots`: where a workload's data file (a `path` param) may lie (OPTLAB_DATA_ROOTS);
    none configured refuses every data file.
    """
    errors: list[SpecError] = []
    if spec.steps > max_steps:
        errors.append(
            SpecError(loc=["body", "steps"], msg=f"steps must be at most {max_steps}; received {spec.steps}")
        )
    # Defaults (100) larger than a short job mean "at its end"; a value given must fit the job.
    for cadence in ("checkpoint_every", "eval_every"):
        value = getattr(spec, cadence)
        if cadence in spec.model_fields_set and value > spec.steps:
            errors.append(
                SpecError(
                    loc=["body", cadence],
                    msg=f"{cadence} must be at most steps ({spec.steps}); received {value}",
                )
            )

    errors += optimizer_errors(spec.optimizer, spec.framework, catalogue)
    errors += _distribution_errors(spec, catalogue)

    schedule = catalogue.schedule(spec.schedule.name)
    if schedule is None:
        errors.append(
            _unknown("schedule", spec.schedule.name, ", ".join(s["name"] for s in catalogue.schedules))
        )
    else:
        schedule_errors = _param_errors("schedule", spec.schedule, schedule["params"])
        if not schedule_errors:
            schedule_errors = _schedule_build_errors(spec) or _rateless_errors(spec, catalogue)
        errors += schedule_errors

    workload = catalogue.workload(spec.workload.name)
    if workload is None:
        errors.append(
            _unknown("workload", spec.workload.name, ", ".join(w["name"] for w in catalogue.workloads))
        )
    else:
        workload_errors = _param_errors("workload", spec.workload, workload["params"])
        errors += workload_errors or [
            *_multiple_errors(spec.workload, workload),
            *_data_path_errors(spec.workload, workload["params"], data_roots),
        ]
        errors += _group_match_errors(spec, workload)
        if spec.framework not in workload["frameworks"]:
            errors.append(
                SpecError(
                    loc=["body", "workload", "name"],
                    msg=f"workload {spec.workload.name!r} runs on {', '.join(workload['frameworks'])}; "
                    f"received framework {spec.framework!r}",
                )
            )
        # None: the size depends on the file the spec names; and it holds at the default data params
        # only (char_lm's context and corpus_chars set its rows): otherwise the job checks it.
        if (
            workload.get("train_size") is not None
            and spec.batch_size > workload["train_size"]
            and not _sets_data_params(spec.workload, workload)
        ):
            errors.append(
                SpecError(
                    loc=["body", "batch_size"],
                    msg=f"batch_size must be at most the training set size {workload['train_size']} "
                    f"of {spec.workload.name!r}; received {spec.batch_size}",
                )
            )
    return errors


def _distribution_errors(spec: JobSpec, catalogue: Catalogue) -> list[SpecError]:
    """DDP averages the ranks' gradients in place, which a gradient that carries its graph refuses:
    an optimizer (or a wrapper's base) that needs backward(create_graph=True) fails at its first step
    (the `distributed` check skips such a class for the same reason)."""
    if spec.distribution is None or spec.distribution.strategy != "ddp":
        return []
    choice = spec.optimizer
    optimizer = catalogue.optimizer(choice.name, spec.framework, choice.style)
    if optimizer is None:
        return []  # reported at optimizer.name
    needs, needer, stated = _stated_needs(choice, optimizer), "it", choice
    base = choice.base
    base_entry = catalogue.optimizer(base.name, spec.framework, base.style) if base is not None else None
    if not needs.create_graph and base is not None and base_entry is not None:
        needs, needer, stated = _stated_needs(base, base_entry), f"its base {base.name!r}", base
    if not needs.create_graph:
        return []
    # A need the catalogue read from the class's docstring or code, which the spec may correct.
    read = (
        ""
        if "create_graph" in (stated.needs or {})
        else "; where it does not (the catalogue reads the need from the class's docstring or code), state "
        '"needs": {"create_graph": false} beside its name'
    )
    return [
        SpecError(
            loc=["body", "distribution"],
            msg=f"distribution 'ddp' cannot train {choice.name!r}: {needer} needs "
            "backward(create_graph=True) "
            "(Hessian-vector products), and DDP averages the ranks' gradients in place, which a gradient "
            "carrying its graph refuses (the job would fail at its first step); train it on one device: "
            f"leave distribution out{read}; received "
            f"{{'strategy': 'ddp', 'devices': {spec.distribution.devices}}}",
        )
    ]


def _group_match_errors(spec: JobSpec, workload: Mapping[str, Any]) -> list[SpecError]:
    """A param group that takes no parameter of the model (a name glob's typo), told at submission
    where the catalogue lists the model's parameters, at the workload's default params (its other
    params may change them: the job tells then, when it starts)."""
    parameters = workload.get("parameters")
    groups = spec.optimizer.param_groups
    if not groups or not parameters or spec.framework != "torch" or _sets_any_param(spec.workload, workload):
        return []
    named = [(str(p["name"]), tuple(p["shape"])) for p in parameters]
    index = unmatched_rule([group.rule() for group in groups], named)
    if index is None:
        return []
    return [
        SpecError(
            loc=["body", "optimizer", "param_groups", index, "match"],
            msg=f"param_groups[{index}] {matches_nothing(named, f'workload {spec.workload.name!r}')}",
        )
    ]


def _sets_any_param(component: Component, workload: Mapping[str, Any]) -> bool:
    """Whether the spec gives any of the workload's params a value other than its default."""
    defaults = {p["name"]: p["default"] for p in workload["params"]}
    return any(value != defaults.get(name) for name, value in component.params.items())


def _sets_data_params(component: Component, workload: Mapping[str, Any]) -> bool:
    """Whether the spec gives a param the workload's data depends on a value other than its default."""
    defaults = {p["name"]: p["default"] for p in workload["params"]}
    return any(
        name in component.params and component.params[name] != defaults.get(name)
        for name in workload.get("data_params", ())
    )


def _multiple_errors(component: Component, workload: Mapping[str, Any]) -> list[SpecError]:
    """A workload's `multiple_of` rules between params (char_lm: width a multiple of heads)."""
    defaults = {p["name"]: p["default"] for p in workload["params"]}
    values = {**defaults, **component.params}
    errors = []
    for rule in workload.get("multiple_of", []):
        value, by = values.get(rule["param"]), values.get(rule["of"])
        if isinstance(value, int) and isinstance(by, int) and (by == 0 or value % by):
            errors.append(
                SpecError(
                    loc=["body", "workload", "params", rule["param"]],
                    msg=f"workload.params.{rule['param']} must be a multiple of {rule['of']} ({by}); "
                    f"received {value}",
                )
            )
    return errors


def _data_path_errors(
    component: Component, declared_json: list[Mapping[str, Any]], data_roots: Sequence[Path]
) -> list[SpecError]:
    """Each data file a workload's `path` params name must be a file under the data roots
    (symlinks and '..' resolved), as far as this process can see them."""
    errors = []
    for param in declared_json:
        value = component.params.get(param["name"])
        if param["type"] == "path" and param.get("required") and value == "":
            errors.append(
                SpecError(
                    loc=["body", "workload", "params", param["name"]],
                    msg=f"workload {component.name!r} needs a data file: {param['name']} must name a file "
                    "under a data root (OPTLAB_DATA_ROOTS); received ''",
                )
            )
            continue
        if param["type"] != "path" or not isinstance(value, str) or not value:
            continue
        try:
            resolve_data_path(
                value,
                data_roots,
                field=f"workload.params.{param['name']}",
                suffixes=tuple(param.get("suffixes", ())),
            )
        except ValueError as exc:
            errors.append(SpecError(loc=["body", "workload", "params", param["name"]], msg=str(exc)))
    return errors


def _rateless_errors(spec: JobSpec, catalogue: Catalogue) -> list[SpecError]:
    """A schedule scales the learning rate: a class that takes none (AliG and A2Grad compute their
    step) trains with the constant schedule only. A wrapper's rate is its base's."""
    holder = spec.optimizer.base or spec.optimizer
    declared = catalogue.optimizer(holder.name, spec.framework, holder.style)
    if spec.schedule.name == "constant" or declared is None:
        return []  # an unknown optimizer is reported at its own field
    if declared.get("needs", {}).get("base_optimizer"):
        return []  # a wrapper's rate is its base's: a missing or a wrapper base is reported at optimizer.base
    if not any(param["name"] == "lr" for param in declared["params"]):
        if holder.param_groups:
            # A class that takes only its groups keeps its rate there (KellerJordan's
            # SingleDeviceMuonWithAuxAdam fills each group's `lr`): its build says whether every group
            # holds one (ScheduleUnreachable), which no constructor signature can.
            return []
        return [
            SpecError(
                loc=["body", "schedule", "name"],
                msg=f"optimizer {holder.name!r} takes no learning rate (its constructor names no lr or "
                f"learning_rate: it computes its own step, or takes its arguments as *args/**kwargs), so "
                f"schedule {spec.schedule.name!r} has nothing to scale; use the constant schedule (a class "
                "that keeps its rate in its param groups takes a schedule with a param_groups recipe)",
            )
        ]
    # A torch class whose groups hold no `lr` (a port keeping `learning_rate`) fails at its job's build
    # (ScheduleUnreachable): only the groups themselves say so. Its source's reads are no proof: a
    # class may read its rate through `**group` or a helper, and a refusal here would be a false one.
    return []


def timeout_errors(spec: AnySpec, *, max_job_seconds: float) -> list[SpecError]:
    """A `timeout_s` over the server's cap is refused, naming the cap."""
    if spec.timeout_s is None or spec.timeout_s <= max_job_seconds:
        return []
    return [
        SpecError(
            loc=["body", "timeout_s"],
            msg=f"timeout_s must be at most {max_job_seconds:g} (OPTLAB_MAX_JOB_SECONDS); "
            f"received {spec.timeout_s:g}",
        )
    ]


def check_errors(spec: CheckSpec, catalogue: Catalogue) -> list[SpecError]:
    """Everything in a check spec that the catalogue rejects (the optimizer, its style and params)."""
    return optimizer_errors(spec.optimizer, spec.framework, catalogue)


def optimizer_errors(choice: OptimizerChoice, framework: str, catalogue: Catalogue) -> list[SpecError]:
    """The optimizer's name, style and hyperparameters against the catalogue, for any kind of job."""
    errors: list[SpecError] = []
    optimizer = catalogue.optimizer(choice.name, framework, choice.style)
    if choice.style is not None and not style_choice(framework):
        errors.append(
            SpecError(
                loc=["body", "optimizer", "style"],
                msg=f"optimizer.style chooses between {' and '.join(TENSORFLOW_STYLES)} for tensorflow "
                f"jobs; this job's framework is {framework!r}: leave style out",
            )
        )
    elif catalogue.optimizer(choice.name) is None:
        errors.append(
            SpecError(loc=["body", "optimizer", "name"], msg=catalogue.unknown_optimizer(choice.name))
        )
    elif optimizer is None and choice.style is not None:
        styles = sorted(o["style"] for o in catalogue.optimizers if o["name"] == choice.name)
        errors.append(
            SpecError(
                loc=["body", "optimizer", "style"],
                msg=f"optimizer {choice.name!r} has no {choice.style} style; "
                f"it exists in: {', '.join(styles)}",
            )
        )
    elif optimizer is None:
        elsewhere = sorted({o["framework"] for o in catalogue.optimizers if o["name"] == choice.name})
        errors.append(
            SpecError(
                loc=["body", "optimizer", "name"],
                msg=f"optimizer {choice.name!r} exists for {', '.join(elsewhere)} only; "
                f"this job's framework is {framework!r}",
            )
        )
    else:
        errors += _param_errors("optimizer", choice, optimizer["params"])
        errors += _needs_errors(choice, framework, optimizer, catalogue)
        errors += _group_errors(choice, framework, optimizer, catalogue)
    return errors


def _group_errors(
    choice: OptimizerChoice, framework: str, optimizer: Mapping[str, Any], catalogue: Catalogue
) -> list[SpecError]:
    """Each param group's params against the hyperparameters of the optimizer that holds the groups:
    a wrapper's base (where the rate and weight decay live), else the optimizer itself."""
    loc: list[str | int] = ["body", "optimizer", "param_groups"]
    if choice.base is not None and choice.base.param_groups:
        # The wrapper builds the groups once and hands them to its base: one recipe, on the wrapper.
        return [
            SpecError(
                loc=["body", "optimizer", "base", "param_groups"],
                msg="a wrapper's param groups go in optimizer.param_groups (they carry the base's params); "
                "leave optimizer.base.param_groups out",
            )
        ]
    if not choice.param_groups:
        return []
    if framework != "torch":
        return [
            SpecError(
                loc=loc,
                msg=f"param groups are served in torch jobs; this job's framework is {framework!r}: "
                "leave optimizer.param_groups out",
            )
        ]
    refused = recipe_problem(choice.name, _stated_needs(choice, optimizer))
    if refused:
        return [SpecError(loc=loc, msg=refused)]
    owner, declared = choice, optimizer
    if choice.base is not None:
        base_entry = catalogue.optimizer(choice.base.name, framework, choice.base.style)
        if base_entry is None:
            return []  # already reported at optimizer.base
        owner, declared = choice.base, base_entry
    reads = declared.get("group_keys")  # absent from an older worker's catalogue: unknown
    return [
        error
        for index, group in enumerate(choice.param_groups)
        for error in _param_errors(
            "optimizer",
            owner,
            declared["params"],
            params=group.params,
            at=[*loc, index, "params"],
            group_keys=None if reads is None else frozenset(reads),
        )
    ]


def _needs_errors(
    choice: OptimizerChoice, framework: str, optimizer: Mapping[str, Any], catalogue: Catalogue
) -> list[SpecError]:
    """The base a wrapper needs (and only a wrapper takes), and needs the framework's loop cannot serve."""
    needs = _stated_needs(choice, optimizer)
    loc: list[str | int] = ["body", "optimizer", "base"]
    base = choice.base
    base_entry = catalogue.optimizer(base.name, framework, base.style) if base is not None else None
    base_needs = (
        _stated_needs(base, base_entry) if base is not None and base_entry is not None else LoopNeeds()
    )
    stated = _stated_need_errors(choice, framework, optimizer)
    if stated:
        return stated
    problem = loop_problem(
        choice.name, needs, (base.name, base_needs) if base is not None else None, framework
    )
    if problem:
        field, why = problem
        return [SpecError(loc=["body", "optimizer", field], msg=why)]
    if base is None:
        return []
    return [
        e.model_copy(update={"loc": [*loc, *e.loc[2:]]}) for e in optimizer_errors(base, framework, catalogue)
    ]


def _stated_need_errors(
    choice: OptimizerChoice, framework: str, optimizer: Mapping[str, Any]
) -> list[SpecError]:
    """A need the spec states that no job could serve, at its own field: the optimizer is not at
    fault for what its spec asked (a closure in a tensorflow job)."""
    stated = {key: value for key, value in (choice.needs or {}).items() if value not in (False, None)}
    detected = optimizer.get("needs", {})
    loc: list[str | int] = ["body", "optimizer", "needs"]
    for need in stated:
        # A stated wrapper is told what a wrapper is told (tensorflow builds none), at its name.
        if need in needs_unserved_by(framework) and need != "base_optimizer" and not detected.get(need):
            return [
                SpecError(
                    loc=[*loc, need],
                    msg=f"optimizer.needs.{need}: {framework} training steps cannot serve it (a torch "
                    f"job's loop does); leave it out; received {stated[need]!r}",
                )
            ]
    return []


def _stated_needs(choice: OptimizerChoice, optimizer: Mapping[str, Any]) -> LoopNeeds:
    """The catalogue's needs with the ones the spec states merged over them."""
    return LoopNeeds(**optimizer.get("needs", {})).with_overrides(choice.needs or {}, owner="optimizer.needs")


SpecT = TypeVar("SpecT", JobSpec, CheckSpec)


def with_resolved_style(spec: SpecT, catalogue: Catalogue) -> SpecT:
    """The spec with `optimizer.style` filled in for tensorflow jobs, as the job will run it.

    Stored that way, a job process knows before importing TensorFlow whether it needs
    the legacy tf.keras set-up.
    """
    if spec.optimizer.style is not None or not style_choice(spec.framework):
        return spec
    chosen = catalogue.optimizer(spec.optimizer.name, spec.framework)
    if chosen is None:
        return spec
    optimizer = spec.optimizer.model_copy(update={"style": chosen["style"]})
    return spec.model_copy(update={"optimizer": optimizer})


def with_sources(spec: SpecT, catalogue: Catalogue) -> SpecT:
    """The spec with `source` set on its optimizer and a wrapper's base: where the catalogue found a
    plugin's class (None for a built-in's or a package's, which no file dropped in can change). The
    job then runs that class or fails at its start (jobs.optimizer_source), never another one that
    took the name meanwhile."""
    optimizer = _with_source(spec.optimizer, spec.framework, catalogue)
    if optimizer.base is not None:
        optimizer = optimizer.model_copy(
            update={"base": _with_source(optimizer.base, spec.framework, catalogue)}
        )
    return spec.model_copy(update={"optimizer": optimizer})


def _with_source(choice: OptimizerChoice, framework: str, catalogue: Catalogue) -> OptimizerChoice:
    found = catalogue.optimizer(choice.name, framework, choice.style)
    return choice.model_copy(update={"source": None if found is None else catalogue_source(found)})


def catalogue_source(optimizer: Mapping[str, Any]) -> OptimizerSource | None:
    """A catalogue entry's plugin class, as a job records it; None for any other entry."""
    source = str(optimizer.get("source") or "")
    if not source.startswith(PLUGIN_SOURCE):
        return None
    # `class` is `<module>.<qualname>`, and a plugin's module name has no dot (`optlab_plugin_<stem>_<hash>`).
    class_name = str(optimizer.get("class") or "").partition(".")[2]
    return OptimizerSource(source=source, class_name=class_name, sha256=optimizer.get("sha256"))


def _schedule_build_errors(spec: JobSpec) -> list[SpecError]:
    """Constraints between a schedule's parameters (pure Python, so the API can run it)."""
    try:
        schedule = build_schedule(spec.schedule.name, spec.schedule.params, total_steps=spec.steps)
    except ValueError as exc:
        at = [exc.param] if isinstance(exc, ScheduleParamError) else []
        return [SpecError(loc=["body", "schedule", "params", *at], msg=str(exc))]
    return _schedule_reach_errors(spec, schedule)


def _schedule_reach_errors(spec: JobSpec, schedule: Schedule) -> list[SpecError]:
    """Settings that cannot take effect within the job's steps (0 to steps - 1): a warm-up that never
    reaches the base rate (linear_warmup's default of 100 in a 50-step job), a cosine that never
    decays, a piecewise boundary never crossed. The job ran, logging a schedule it was not given."""
    steps, given = spec.steps, spec.schedule.params
    loc: list[str | int] = ["body", "schedule", "params"]
    if isinstance(schedule, LinearWarmup | Cosine):
        warmup = schedule.warmup_steps
        # The ramp's last step (warmup - 1) is the full rate; a cosine starts to decay the step after
        # its first at the full rate (step warmup), so it needs warmup + 1 < steps.
        last = steps if isinstance(schedule, LinearWarmup) else max(steps - 2, 0)
        if warmup > last:
            default = "" if "warmup_steps" in given else " (its default)"
            reach = "reach the base rate" if isinstance(schedule, LinearWarmup) else "leave a step to decay"
            return [
                SpecError(
                    loc=[*loc, "warmup_steps"],
                    msg=f"schedule.params.warmup_steps must be at most {last} for the warm-up to {reach} "
                    f"within the job's {steps} steps; received {warmup}{default}",
                )
            ]
    if isinstance(schedule, PiecewiseConstant):
        beyond = [b for b in schedule.boundaries if b >= steps]
        if beyond:
            return [
                SpecError(
                    loc=[*loc, "boundaries"],
                    msg=f"schedule.params.boundaries must be below steps ({steps}): a boundary at or after "
                    f"the last step is never crossed; received {schedule.boundaries}",
                )
            ]
    return []


def _unknown(kind: str, name: str, known: str) -> SpecError:
    return SpecError(loc=["body", kind, "name"], msg=f"unknown {kind} {name!r}; known: {known}")


def _param_errors(
    kind: str,
    component: Component,
    declared_json: list[Mapping[str, Any]],
    *,
    params: Mapping[str, Any] | None = None,
    at: list[str | int] | None = None,
    group_keys: frozenset[str] | None = None,
) -> list[SpecError]:
    """`component.params` (or a param group's `params`, located `at`) against the declared ones.

    Required hyperparameters are asked of the component itself only: a param group adds to them,
    and may set keys the optimizer reads from its groups (`group_keys`, None when unknown) that it
    does not declare.
    """
    declared = {p["name"]: Param.from_json(p) for p in declared_json}
    word = "hyperparameter" if kind == "optimizer" else "parameter"
    given = component.params if params is None else params
    where: list[str | int] = ["body", kind, "params"] if at is None else at
    errors = []
    if params is None:
        errors += [
            SpecError(
                loc=[*where, name],
                msg=f"{kind} {component.name!r} requires {word} {name!r} ({param.allowed()}): it has "
                "no default",
                type="missing",
            )
            for name, param in declared.items()
            if param.required and name not in given
        ]
    for key, value in given.items():
        loc: list[str | int] = [*where, key]
        if key not in declared and params is not None:
            problem = extra_key_problem(
                key, value, owner=f"{kind} {component.name!r}", declared=declared, reads=group_keys
            )
            if problem:
                errors.append(SpecError(loc=loc, msg=problem))
            continue
        if key not in declared:
            accepted = ", ".join(declared) or "none"
            errors.append(
                SpecError(
                    loc=loc,
                    msg=f"{kind} {component.name!r} has no {word} {key!r}; accepted: {accepted}"
                    + (switch_note(key) if kind == "optimizer" else ""),
                )
            )
            continue
        try:
            declared[key].accept(value)  # as the job builds it (check_all): `null` for a None default
        except ValueError as exc:
            errors.append(SpecError(loc=loc, msg=str(exc)))
    return errors


# --- Studies (issue 11): optimizers x grid points x seeds, each an ordinary JobSpec ---

GridItem = JsonScalar | list[JsonScalar]


def _grid_axes(params: dict[str, Any]) -> dict[str, Any]:
    for key, value in params.items():
        if isinstance(value, list):
            _check_grid_axis(key, value)
        else:
            _finite(value, key)
    return params


def _check_grid_axis(key: str, values: list[Any]) -> None:
    """A grid axis: at least one value, each finite and in range, none twice."""
    if not values:
        raise PydanticCustomError(
            "empty_grid", "{key} is a grid (a list): it needs at least one value", {"key": key}
        )
    for position, value in enumerate(values):
        _finite_item(key, position, value)
    repeated = _repeated_pair(values)
    if repeated is not None:
        first, second = (json.dumps(value) for value in repeated)
        raise PydanticCustomError(
            "repeated_grid_value",
            "{key} is a grid (a list) that repeats a value: {first} and {second} are equal, so each "
            "would run the same jobs; received {received}",
            {"key": key, "first": first, "second": second, "received": json.dumps(values)},
        )


def _repeated_pair(values: list[Any]) -> tuple[Any, Any] | None:
    """The first two values of a grid axis that would make the same job, else None."""
    seen: dict[Any, Any] = {}
    for value in values:
        same = _job_equality(value)
        if same in seen:
            return seen[same], value
        seen[same] = value
    return None


def _job_equality(value: Any) -> Any:
    """A grid value as two jobs would compare it, hashable: numbers by value (1 and 1.0 train alike;
    compared as JSON text they were two grid points, then pooled as one with a false n=2), booleans
    apart from them (Python's `True == 1`, but the catalogue takes `true` only for a flag and `1`
    only for a number, or for an "any" hyperparameter each as given)."""
    if isinstance(value, list):
        return ("list", tuple(_job_equality(item) for item in value))
    if isinstance(value, bool):
        return ("bool", value)
    return ("value", value)


# A list is a grid axis; a list-valued hyperparameter (betas) is fixed as a grid of one: [[0.9, 0.999]].
GridParams = Annotated[
    dict[Annotated[str, Field(max_length=100)], GridItem | list[GridItem]],
    Field(max_length=64),
    AfterValidator(_grid_axes),
]


class StudyOptimizer(OptimizerSetup):
    """One optimizer of a study: fixed hyperparameters, and a list (a grid axis) for any of them;
    a wrapper's base, needs and param groups as a job states them, the same for every job of it."""

    name: Name
    label: Name | None = Field(
        default=None, description="how the study names it (runs, tags, ranking); default: its name"
    )
    style: Literal["keras", "tf_legacy"] | None = None
    params: GridParams = Field(
        default_factory=dict,
        description="a list is a grid axis (the grid is the product of the lists); "
        "a list-valued hyperparameter is given as a grid of one: [[0.9, 0.999]]",
    )

    @property
    def key(self) -> str:
        return self.label or self.name

    def axes(self) -> dict[str, list[Any]]:
        return {key: value for key, value in self.params.items() if isinstance(value, list)}

    def point_count(self) -> int:
        return math.prod(len(values) for values in self.axes().values())

    def points(self) -> list[dict[str, Any]]:
        """Every grid point: the grid hyperparameters' values, in the order the params give them."""
        import itertools

        axes = self.axes()
        return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


class StudyTarget(BaseModel):
    """Reached when `metric` is <= `value` (mode min) or >= `value` (mode max)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    metric: str = Field(pattern=r"^[A-Za-z0-9_]+(/[A-Za-z0-9_.-]+)*$", max_length=100, examples=["val/loss"])
    mode: Literal["min", "max"]
    value: float = Field(ge=-MAX_PARAM_MAGNITUDE, le=MAX_PARAM_MAGNITUDE, allow_inf_nan=False)


class StudyMember(BaseModel):
    """One job of a study: which optimizer entry, grid point and seed it is."""

    optimizer: str
    grid: dict[str, Any]
    seed: int

    def run_name(self) -> str:
        """`lion lr=3e-4 seed=1`: how the child run reads in the MLflow UI."""
        return " ".join(
            [self.optimizer, *(f"{k}={grid_text(v)}" for k, v in self.grid.items()), f"seed={self.seed}"]
        )


def grid_text(value: Any) -> str:
    """A grid value as a run name or MLflow tag shows it: 0.0003 -> 3e-4."""
    if isinstance(value, float):
        return short_number(value)
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list) else str(value)


class StudySpec(BaseModel):
    """A study: every optimizer at every point of its grid, once per seed, as ordinary jobs."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [
                {
                    "name": "lion-vs-adamw",
                    "framework": "torch",
                    "workload": {"name": "digits_mlp"},
                    "optimizers": [
                        {"name": "lion", "params": {"lr": [0.0001, 0.0003]}},
                        {"name": "adamw", "params": {"lr": [0.001, 0.003]}},
                    ],
                    "schedule": {"name": "cosine", "params": {"warmup_steps": 20}},
                    "seeds": [0, 1, 2],
                    "steps": 300,
                    "eval_every": 50,
                    "target": {"metric": "val/accuracy", "mode": "max", "value": 0.95},
                    "baseline": "adamw",
                }
            ]
        },
    )

    name: SafeName = Field(description=f"the study's name: {SAFE_NAME_ALLOWED}")
    framework: Literal["torch", "tensorflow"] = "torch"
    workload: Component
    optimizers: list[StudyOptimizer] = Field(min_length=1, max_length=32)
    schedule: Component = Field(default_factory=lambda: Component(name="constant"))
    seeds: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(default=[0], min_length=1, max_length=100)
    steps: int = Field(gt=0, le=2**31 - 1)
    batch_size: int = Field(default=64, gt=0, le=65536)
    checkpoint_every: int = Field(default=100, gt=0, le=2**31 - 1)
    eval_every: int = Field(default=100, gt=0, le=2**31 - 1)
    target: StudyTarget | None = Field(default=None, description="default: the workload's default target")
    baseline: Name | None = Field(
        default=None, description="an optimizer's label (or name) to compare against"
    )
    experiment: SafeName | None = Field(default=None, description="MLflow experiment; default: the name")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]{1,2})?)$")

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) < len(seeds):
            raise PydanticCustomError(
                "repeated_seed", "seeds must differ; received {seeds}", {"seeds": seeds}
            )
        return seeds

    @property
    def experiment_name(self) -> str:
        return self.experiment or self.name

    def job_count(self) -> int:
        return sum(optimizer.point_count() for optimizer in self.optimizers) * len(self.seeds)

    def members(self) -> list[tuple[int, StudyMember]]:
        """(optimizer index, member) for every job, in the order they are queued (and so run): round by
        round, a round being one seed at the k-th grid point of every optimizer that has one, the
        optimizer that goes first turning each round. Queued optimizer by optimizer, a change of the
        machine's load during the study was booked to whichever optimizer ran then (forward+backward,
        the same work for all, took 27 ms a step for one and 13 ms for adam); interleaved, it falls on
        all alike."""
        points = [optimizer.points() for optimizer in self.optimizers]
        count = len(self.optimizers)
        rounds = [(seed, k) for seed in self.seeds for k in range(max(len(p) for p in points))]
        return [
            (index, StudyMember(optimizer=self.optimizers[index].key, grid=points[index][k], seed=seed))
            for number, (seed, k) in enumerate(rounds)
            for index in ((number + offset) % count for offset in range(count))
            if k < len(points[index])
        ]

    def job_spec(self, index: int, member: StudyMember) -> JobSpec:
        """The member's job, as POST /jobs would take it (cadences only where the study sets them)."""
        optimizer = self.optimizers[index]
        data: dict[str, Any] = {
            "framework": self.framework,
            "workload": self.workload.model_dump(),
            "optimizer": {
                "name": optimizer.name,
                "style": optimizer.style,
                "params": {**optimizer.params, **member.grid},
                **optimizer.setup(),
            },
            "schedule": self.schedule.model_dump(),
            "steps": self.steps,
            "batch_size": self.batch_size,
            "seed": member.seed,
            "experiment": self.experiment_name,
            "device": self.device,
        }
        data.update({cadence: getattr(self, cadence) for cadence in self.model_fields_set & CADENCES})
        return JobSpec.model_validate(data)


CADENCES = {"checkpoint_every", "eval_every"}


def study_errors(
    spec: StudySpec, catalogue: Catalogue, *, max_steps: int, max_jobs: int, data_roots: Sequence[Path] = ()
) -> tuple[list[SpecError], list[tuple[StudyMember, JobSpec]]]:
    """What the catalogue or the limits reject in a study, each job judged as POST /jobs judges it
    (located at the study's field: `optimizers.1.params.lr.2`); else its jobs."""
    count = spec.job_count()
    if count > max_jobs:
        sizes = " + ".join(f"{o.key} {o.point_count()}" for o in spec.optimizers)
        return [
            SpecError(
                loc=["body", "optimizers"],
                msg=f"the study expands to {count} jobs (grid points: {sizes}; x {len(spec.seeds)} seeds); "
                f"at most {max_jobs} (OPTLAB_MAX_STUDY_JOBS)",
            )
        ], []
    errors: list[SpecError] = []
    keys = [optimizer.key for optimizer in spec.optimizers]
    for index, key in enumerate(keys):
        if key in keys[:index]:
            errors.append(
                SpecError(
                    loc=["body", "optimizers", index, "label"],
                    msg=f"two optimizers are called {key!r}: give each a distinct label",
                )
            )
    if spec.baseline is not None and spec.baseline not in keys:
        errors.append(
            SpecError(
                loc=["body", "baseline"],
                msg=f"baseline must be one of the study's optimizers ({', '.join(keys)}); "
                f"received {spec.baseline!r}",
            )
        )
    errors += _target_errors(spec, catalogue)
    jobs: list[tuple[StudyMember, JobSpec]] = []
    for index, member in spec.members():
        try:
            job = spec.job_spec(index, member)
        except ValidationError as exc:  # the study's own fields hold JobSpec's rules: a defect if reached
            errors += [SpecError(loc=["body", "optimizers", index], msg=_first_error(exc).lstrip("."))]
            continue
        jobs.append((member, job))
        for error in catalogue_errors(job, catalogue, max_steps=max_steps, data_roots=data_roots):
            located = error.model_copy(update={"loc": _study_loc(error.loc, spec, index, member)})
            # Said once: a grid's other points repeat a problem that is not about their value.
            if not any(e.msg == located.msg and e.loc[:-1] == located.loc[:-1] for e in errors):
                errors.append(located)
    return errors, jobs


def _target_errors(spec: StudySpec, catalogue: Catalogue) -> list[SpecError]:
    """A target on a metric the workload's jobs never log: every job would run, and no optimizer be
    ranked. Judged where the catalogue lists the workload's metrics (a worker's before they were
    published lists none)."""
    workload = catalogue.workload(spec.workload.name)
    listed = workload.get("metrics") if workload is not None else None
    if spec.target is None or not listed:
        return []
    modes = {metric["name"]: metric["mode"] for metric in listed}
    metric, mode = spec.target.metric, spec.target.mode
    if metric not in modes:
        return [
            SpecError(
                loc=["body", "target", "metric"],
                msg=f"workload {spec.workload.name!r} logs {', '.join(modes)}; received {metric!r}",
            )
        ]
    if mode != modes[metric]:  # the study would pick and rank the worst grid points
        return [
            SpecError(
                loc=["body", "target", "mode"],
                msg=f"{metric} improves {'downward' if modes[metric] == 'min' else 'upward'}: mode must be "
                f"{modes[metric]!r}; received {mode!r}",
            )
        ]
    low, high = metric_bounds(metric)
    value = spec.target.value
    if (low is not None and value < low) or (high is not None and value > high):
        allowed = f"from {low:g} to {high:g}" if high is not None else f"at least {low:g}"
        return [
            SpecError(
                loc=["body", "target", "value"],
                msg=f"{metric} lies {allowed}: a target outside is reached by no job or by every one; "
                f"received {value:g}",
            )
        ]
    return []


# The values a metric can take, by the last part of its key (None: no bound): a study's target outside
# them is met by no job (or by every one), and a summary's interval is cut there, so 0.97 +- 0.05
# accuracy over three seeds does not read "up to 1.02".
METRIC_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "accuracy": (0.0, 1.0),
    "auc": (0.0, 1.0),
    "f1": (0.0, 1.0),
    "rmse": (0.0, None),
    "mse": (0.0, None),
    "mae": (0.0, None),
    "bits_per_char": (0.0, None),
    "perplexity": (1.0, None),
}


def metric_bounds(metric: str) -> tuple[float | None, float | None]:
    """The values `metric` (`val/accuracy`) can take, from METRIC_BOUNDS; (None, None) if unknown."""
    return METRIC_BOUNDS.get(metric.rsplit("/", 1)[-1], (None, None))


def _study_loc(loc: list[str | int], spec: StudySpec, index: int, member: StudyMember) -> list[str | int]:
    """Where a job's problem is in the study: optimizer.* -> optimizers.<i>.*, a grid value by its
    index in the list, seed -> seeds.<j>."""
    if loc[1:2] == ["seed"]:
        return ["body", "seeds", spec.seeds.index(member.seed)]
    if loc[1:2] != ["optimizer"]:
        return loc
    located: list[str | int] = ["body", "optimizers", index, *loc[2:]]
    if loc[2:3] == ["params"] and len(loc) == 4 and loc[3] in member.grid:
        axis = spec.optimizers[index].axes()[str(loc[3])]
        located.append(axis.index(member.grid[str(loc[3])]))
    return located
