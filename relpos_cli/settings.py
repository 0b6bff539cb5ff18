"""The schema of a run config: types and allowed ranges, checked in one place for every command.

Dataclasses rather than Hydra structured configs in the ConfigStore: the same check has to run on
configs Hydra composes (train, inspect) and on configs saved in run dirs (resume, eval-length,
inspect RUN, compare), which never pass through Hydra's composition, and ranges need code either
way. So the yaml files under conf/ keep the defaults, these classes declare the types (OmegaConf
checks and converts them when the config is merged into the schema) and `__post_init__` checks
the ranges (OmegaConf.to_object runs it, section by section). `pos.*` is checked by the scheme's
constructor (against the types of its yaml here), `task.*` by the task modules.
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, Iterable, List, Mapping, Optional, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from relpos_cli.errors import RelposError
from relpos_cli.results import FORMATS
from relpos_cli.rope_options import check_rope_scaling

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")  # train.precision, eval.precision (relpos_cli/precision.py)
ON_NAN = ("stop", "skip")
# train.compile's torch.compile modes besides true (torch's default mode); reduce-overhead and max-autotune
# replay each step as CUDA graphs (relpos_cli/compile_cache.py)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LENGTH_SCHEDULES = ("fixed", "uniform", "curriculum")
PROTOCOLS = ("nonoverlapping", "sliding")
FRESH_INITS = ("normal", "as_built")
WANDB_MODES = ("offline", "online", "disabled")
WANDB_PROJECT_FORBIDDEN, WANDB_PROJECT_MAX = "/\\#?%:", 128


def positive(key: str, value: float) -> None:
    if not value > 0:  # NaN too
        raise RelposError(f"{key} must be positive, got {value}")
    finite(key, value)


def at_least(key: str, value: float, low: float, meaning: str = "") -> None:
    if not value >= low:
        raise RelposError(f"{key} must be >= {low}{meaning}, got {value}")
    finite(key, value)


def finite(key: str, value: float) -> None:
    if value == math.inf:
        raise RelposError(f"{key} must be a finite number, got {value}")


def within(key: str, value: float, low: float, high: float, closed: str = "[]") -> None:
    """value in the interval low..high, each end open or closed as `closed` says ("[]", "[)", "()")."""
    above = value >= low if closed[0] == "[" else value > low
    below = value <= high if closed[1] == "]" else value < high
    if not (above and below and math.isfinite(value)):
        raise RelposError(f"{key} must be in {closed[0]}{low}, {high}{closed[1]}, got {value}")


def one_of(key: str, value: Any, choices: Iterable[str]) -> None:
    if value not in choices:
        raise RelposError(f"{key}={value!r}; choose one of: {', '.join(choices)}")


# ---- data: sources and tokenizers, checked before any data is read (relpos_cli/data.py reads them) --------

DATA_SOURCES = ("stdlib", "hub", "text_files")
STREAMING_SOURCES = ("hub", "text_files")
# data keys added after cache format 1: left out of the cache key at these values, so caches built
# before the keys existed keep their key; filled in for run configs saved before then
ADDED_KEYS = {"vocab_size": None, "streaming": False, "tokenizer_file": None, "eos_token": None}
TOKENIZERS = ("bytes", "bpe", "hf")
# byte-level BPE starts from the 256 bytes and the end token; below one more there is nothing to merge
MIN_BPE_VOCAB = 258
# the BPE trainer reserves memory per requested entry (~70 bytes) up front and aborts the process when it
# cannot: 2**31 asks for 141 GB. 2**20 is four times the largest vocabularies in use (256k)
MAX_BPE_VOCAB = 1 << 20


def check_tokenizer(name: Any, vocab_size: Any, tokenizer_file: Any = None, eos_token: Any = None) -> None:
    """data.tokenizer, data.vocab_size (bpe), data.tokenizer_file and data.eos_token (hf), checked
    before any data is read."""
    if name not in TOKENIZERS:
        raise RelposError(f"unknown data.tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")
    if (name == "hf") != (tokenizer_file is not None):
        raise RelposError("data.tokenizer_file goes with data.tokenizer=hf (a pretrained model's tokenizer.json, "
                          "set by relpos import)" if name != "hf" else "data.tokenizer=hf needs data.tokenizer_file=<tokenizer.json>")
    if name == "hf":
        if not Path(str(tokenizer_file)).is_file():
            raise RelposError(f"data.tokenizer_file={tokenizer_file}: no such file")
        if not eos_token:
            raise RelposError("data.tokenizer=hf needs data.eos_token=<the token that ends a document>")
        if vocab_size is not None:
            raise RelposError(f"data.vocab_size={vocab_size} applies to data.tokenizer=bpe; hf has its own vocabulary")
        return
    if name == "bytes":
        if vocab_size is not None:
            raise RelposError(f"data.vocab_size={vocab_size} applies to data.tokenizer=bpe; bytes has a fixed 256")
        return
    if vocab_size is None:
        raise RelposError(f"data.tokenizer=bpe needs data.vocab_size=<N>, N >= {MIN_BPE_VOCAB}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise RelposError(f"data.vocab_size must be an integer, got {vocab_size!r}")
    if vocab_size > MAX_BPE_VOCAB:
        raise RelposError(f"data.vocab_size={vocab_size} is too large: bpe takes {MIN_BPE_VOCAB} to {MAX_BPE_VOCAB:,}")
    if vocab_size < MIN_BPE_VOCAB:
        raise RelposError(
            f"data.vocab_size={vocab_size} is too small for bpe: the 256 bytes and the end token take 257; "
            f"use N >= {MIN_BPE_VOCAB} or data.tokenizer=bytes"
        )


def check_data_config(cfg: Mapping[str, Any]) -> None:
    """Source, tokenizer and streaming choices, checked before any data is read."""
    source = cfg.get("source")
    if source not in DATA_SOURCES:
        raise RelposError(f"unknown data source {source!r}; choose one of: {', '.join(DATA_SOURCES)}")
    check_tokenizer(cfg.get("tokenizer"), cfg.get("vocab_size"), cfg.get("tokenizer_file"), cfg.get("eos_token"))
    if cfg.get("streaming") and source not in STREAMING_SOURCES:
        raise RelposError(
            f"data.streaming=true reads data={' or data='.join(STREAMING_SOURCES)}; data={source} is small and built "
            f"in memory: drop data.streaming"
        )


NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "gelu_tanh", "swiglu")


@dataclass
class ModelSettings:
    """The defaults of the keys after attn_backend are relpos's own model; pretrained families
    (relpos_cli/families/) set them at import. A run saved before they existed gets these values."""

    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int
    dropout: float
    attn_backend: str  # its choices belong to relpos_cli.attention: checked where the model is built
    vocab_size: Optional[int] = None  # embedding rows; null = the tokenizer's vocabulary
    n_kv_heads: Optional[int] = None  # grouped-query attention: key/value heads; null = n_heads
    mlp_hidden: Optional[int] = None  # MLP width; null = mlp_ratio x d_model
    mlp: str = "gelu"  # gelu | gelu_tanh | swiglu
    norm: str = "layernorm"  # layernorm (with bias) | rmsnorm
    norm_eps: float = 1e-5
    attn_bias: bool = False  # biases on q, k, v
    proj_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    parallel_residual: bool = False  # x + attn(norm1 x) + mlp(norm2 x) (GPT-NeoX)
    embed_norm: bool = False  # a norm on the token embeddings (BLOOM)
    tie_embeddings: bool = True  # the output head is the token embedding
    sliding_window: Optional[int] = None  # a query sees the keys at distance < this (Mistral, Qwen2); null = all
    sliding_layers: Optional[List[int]] = None  # the layers with the window (Qwen2); null = every layer

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "mlp_ratio"):
            positive(f"model.{name}", getattr(self, name))
        within("model.dropout", self.dropout, 0, 1, "[)")
        for name in ("vocab_size", "n_kv_heads", "mlp_hidden"):
            if getattr(self, name) is not None:
                positive(f"model.{name}", getattr(self, name))
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise RelposError(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.sliding_window is not None:
            positive("model.sliding_window", self.sliding_window)
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise RelposError("model.sliding_layers names the layers of model.sliding_window, which is null: set both")
            bad = [i for i in self.sliding_layers if not (isinstance(i, int) and 0 <= i < self.n_layers)]
            if bad or len(set(self.sliding_layers)) != len(self.sliding_layers):
                raise RelposError(f"model.sliding_layers must list distinct layers in [0, {self.n_layers - 1}] "
                                  f"(model.n_layers={self.n_layers}), got {list(self.sliding_layers)}")
        one_of("model.mlp", self.mlp, MLPS)
        one_of("model.norm", self.norm, NORMS)
        within("model.norm_eps", self.norm_eps, 0, 1, "()")


def model_option_defaults() -> dict[str, Any]:
    """The model keys that have a default (relpos's own model): what a saved run without them meant."""
    return {f.name: f.default for f in fields(ModelSettings) if f.default is not MISSING}


@dataclass
class TrainSettings:
    seq_len: int
    length_schedule: str
    min_seq_len: int
    randomized_positions: Optional[int]
    position_skip: Optional[int]
    batch_size: int
    grad_accum: int
    steps: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    betas: List[float]
    grad_clip: float
    log_every: int
    eval_every: int
    val_batches: int
    ckpt_every: int
    keep_checkpoints: int
    on_nan: str
    compile: Any  # false, true or one of COMPILE_MODES
    precision: str

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "val_batches", "keep_checkpoints"):
            positive(f"train.{name}", getattr(self, name))
        positive("train.lr", self.lr)
        within("train.min_lr_ratio", self.min_lr_ratio, 0, 1)
        at_least("train.warmup_steps", self.warmup_steps, 0)
        at_least("train.weight_decay", self.weight_decay, 0)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise RelposError(f"train.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not (self.grad_clip > 0 and not math.isnan(self.grad_clip)):
            raise RelposError(f"train.grad_clip must be positive (the largest gradient norm kept), got {self.grad_clip}")
        at_least("train.eval_every", self.eval_every, 0, " (0 = only at the end)")
        at_least("train.ckpt_every", self.ckpt_every, 0, " (0 = only at the end)")
        one_of("train.on_nan", self.on_nan, ON_NAN)
        if not isinstance(self.compile, bool) and self.compile not in COMPILE_MODES:
            raise RelposError(f"train.compile={self.compile!r}; choose false, true or a torch.compile mode: "
                              f"{', '.join(COMPILE_MODES)}")
        one_of("train.precision", self.precision, PRECISIONS)
        one_of("train.length_schedule", self.length_schedule, LENGTH_SCHEDULES)
        if self.length_schedule != "fixed":
            within("train.min_seq_len", self.min_seq_len, 1, self.seq_len)
        if self.randomized_positions is not None and self.randomized_positions < self.seq_len:
            raise RelposError(f"train.randomized_positions={self.randomized_positions} is below train.seq_len={self.seq_len}: "
                              f"each batch draws seq_len distinct positions from [0, N)")
        if self.position_skip is not None:
            if self.randomized_positions is not None:
                raise RelposError("train.position_skip (PoSE) and train.randomized_positions both choose each batch's "
                                  "positions; set one of them")
            if self.position_skip < self.seq_len:
                raise RelposError(f"train.position_skip={self.position_skip} is below train.seq_len={self.seq_len}: "
                                  f"PoSE's skipped positions must fit in a target length of at least the training length")


def check_settings_take_effect(cfg: Any) -> None:
    """Settings that training would accept and then ignore, refused in one line: config.yaml would
    record a run that never happened. Checked when a fresh run starts (relpos_cli/train.py), not in
    validate(): a run saved with one of them trained as if it were unset, and still evaluates.

    Args:
        cfg: a validated run config (its model.* and train.* are read).
    """
    m, t = cfg.model, cfg.train
    if m.get("sliding_window") is not None and m.get("sliding_layers") is not None and len(m.sliding_layers) == 0:
        raise RelposError(f"model.sliding_layers=[] puts model.sliding_window={m.sliding_window} on no layer, so it would "
                          f"change nothing: list its layers, or leave model.sliding_layers null (every layer)")
    if t.length_schedule != "fixed" and t.min_seq_len == t.seq_len:
        raise RelposError(f"train.length_schedule={t.length_schedule} with train.min_seq_len=train.seq_len={t.seq_len} "
                          f"gives every batch {t.seq_len} tokens, as fixed does: lower train.min_seq_len")
    for key in ("randomized_positions", "position_skip"):
        if t.length_schedule == "fixed" and t.get(key) == t.seq_len:  # every batch is seq_len long
            raise RelposError(f"train.{key}={t.seq_len} equals train.seq_len: every batch would still get positions "
                              f"0..{t.seq_len - 1}, so it would change nothing; set it above train.seq_len")


@dataclass
class RopeScalingSettings:  # used by relpos_cli.positions.rope; every option checked here, whatever the type
    type: str
    factor: Any
    beta_fast: float
    beta_slow: float
    attention_factor: Optional[float]

    def __post_init__(self) -> None:
        check_rope_scaling(vars(self), "eval.rope_scaling")


@dataclass
class SelfExtendSettings:  # which schemes and combinations it applies to: relpos_cli.extension
    group: Optional[int]
    window: Optional[int]

    def __post_init__(self) -> None:
        if (self.group is None) != (self.window is None):
            raise RelposError("eval.self_extend needs both group and window (or neither): "
                              f"got group={self.group}, window={self.window}")
        if self.group is not None:
            at_least("eval.self_extend.group", self.group, 1)
            at_least("eval.self_extend.window", self.window, 1)


@dataclass
class ReropeSettings:
    window: Optional[int]
    slope: Optional[float]

    def __post_init__(self) -> None:
        if self.window is None:
            if self.slope is not None:
                raise RelposError(f"eval.rerope.slope={self.slope} needs eval.rerope.window")
            return
        at_least("eval.rerope.window", self.window, 1)
        if self.slope is not None:
            within("eval.rerope.slope", self.slope, 0, 1)


@dataclass
class SinksSettings:  # eval.sinks: StreamingLLM / LM-Infinite (relpos_cli.extension.SinkWindow)
    count: Optional[int]
    window: Optional[int]
    max_distance: Optional[int]

    def __post_init__(self) -> None:
        if self.window is None:
            if self.count is not None or self.max_distance is not None:
                raise RelposError("eval.sinks.count and eval.sinks.max_distance need eval.sinks.window")
            return
        at_least("eval.sinks.window", self.window, 1)
        if self.count is not None and not 0 <= self.count <= self.window:
            raise RelposError(f"eval.sinks.count must be in [0, {self.window}] (at most eval.sinks.window), got {self.count}")
        if self.max_distance is not None:
            at_least("eval.sinks.max_distance", self.max_distance, 1)


@dataclass
class EvalSettings:
    lengths: List[int]
    tokens: int
    max_tokens_per_batch: int
    protocol: str
    precision: str
    stride: Optional[int]
    rope_scaling: RopeScalingSettings
    self_extend: SelfExtendSettings
    rerope: ReropeSettings
    sinks: SinksSettings
    allow_changed_data: bool
    context_use: bool

    def __post_init__(self) -> None:
        if not self.lengths or not all(length > 0 for length in self.lengths):
            raise RelposError(f"eval.lengths must be positive, got {list(self.lengths)}")
        positive("eval.tokens", self.tokens)
        positive("eval.max_tokens_per_batch", self.max_tokens_per_batch)
        one_of("eval.protocol", self.protocol, PROTOCOLS)
        one_of("eval.precision", self.precision, PRECISIONS)
        if self.protocol == "nonoverlapping" and self.stride is not None:
            raise RelposError("eval.stride applies only to eval.protocol=sliding")
        if self.protocol == "sliding" and (self.stride is None or self.stride <= 0):
            raise RelposError(f"eval.protocol=sliding needs a positive eval.stride (got {self.stride})")
        if self.context_use and self.protocol != "sliding":
            raise RelposError("eval.context_use=true compares sliding windows: add eval.protocol=sliding eval.stride=S")


@dataclass
class InspectSettings:
    length: int
    layers: Optional[List[int]]
    heads: Optional[List[int]]
    rotary_samples: int
    fresh_init: str
    sample_offset: int
    allow_changed_data: bool

    def __post_init__(self) -> None:
        at_least("inspect.length", self.length, 2)
        positive("inspect.rotary_samples", self.rotary_samples)
        one_of("inspect.fresh_init", self.fresh_init, FRESH_INITS)
        at_least("inspect.sample_offset", self.sample_offset, 0)


@dataclass
class DataSettings:
    """Every source's keys; a source leaves out those it does not read (None here)."""

    source: str
    tokenizer: str
    vocab_size: Optional[int]
    streaming: bool
    cache_dir: str
    val_fraction: Optional[float] = None
    path: Optional[str] = None  # hub
    name: Optional[str] = None
    text_field: Optional[str] = None
    train_split: Optional[str] = None
    validation_split: Optional[str] = None
    files: Any = None  # text_files: a list of paths (or one path)
    validation_files: Any = None
    tokenizer_file: Optional[str] = None  # tokenizer=hf: a pretrained model's tokenizer.json (relpos import)
    eos_token: Optional[str] = None  # tokenizer=hf: the token that ends a document

    def __post_init__(self) -> None:
        check_data_config(self.__dict__)
        if self.val_fraction is not None:
            within("data.val_fraction", self.val_fraction, 0, 1, "()")
        elif self.source == "stdlib" or not (self.validation_split if self.source == "hub" else self.validation_files):
            raise RelposError(f"data.val_fraction=null, but data={self.source} holds that fraction of its text out for "
                              f"validation here: give a number in (0, 1)")


@dataclass
class WandbSettings:
    mode: str
    project: str
    entity: Optional[str]
    group: Optional[str]
    tags: List[str]
    init_timeout: float

    def __post_init__(self) -> None:
        one_of("wandb.mode", self.mode, WANDB_MODES)
        positive("wandb.init_timeout", self.init_timeout)
        # W&B's own rule for project names, checked before the run dir is set up rather than at wandb.init
        bad = sorted(set(WANDB_PROJECT_FORBIDDEN) & set(self.project))
        if not self.project or bad or len(self.project) > WANDB_PROJECT_MAX:
            raise RelposError(f"wandb.project={self.project!r}: a W&B project name is 1 to {WANDB_PROJECT_MAX} characters "
                              f"without {' '.join(WANDB_PROJECT_FORBIDDEN)}")


@dataclass
class PlotsSettings:
    format: str

    def __post_init__(self) -> None:
        one_of("plots.format", self.format, FORMATS)


@dataclass
class RunSettings:
    seed: int
    device: str
    resume: Optional[str]
    wandb: WandbSettings
    pos: Any  # checked by the scheme's constructor (build_scheme) and check_scheme_types
    model: ModelSettings
    data: DataSettings
    train: TrainSettings
    eval: EvalSettings
    inspect: InspectSettings
    plots: PlotsSettings
    task: Any = None  # checked by the task modules
    init_from: Optional[str] = None  # checked by relpos_cli.lineage when the run starts
    name: Optional[str] = None  # compare rows, legends and the W&B run name (relpos_cli.tables)

    def __post_init__(self) -> None:
        if not 0 <= self.seed < SEED_LIMIT:
            raise RelposError(f"seed={self.seed}: give an integer in [0, 2^32 - 1]; torch's generator keeps a seed's low "
                              f"32 bits, so seed and seed + 2^32 would train the same run")
        if not str(self.device).startswith("cuda:"):  # one GPU of several: relpos_cli.distributed.resolve_device checks it
            one_of("device", self.device, DEVICES)
        check_run_name(self.name)
        for key in ("init_from", "resume"):  # an empty shell variable ($PARENT unset) must not mean "none"
            if getattr(self, key) is not None and not str(getattr(self, key)).strip():
                raise RelposError(f"{key} is empty: give a run dir, or leave {key} out")


# keys that choose where and how a run is watched and stored, never what it trains: a resume may change
# them (train.RESUME_MAY_CHANGE) and a comparison does not group runs by them (runs.IGNORED_PREFIXES)
HOUSEKEEPING_KEYS = ("device", "wandb", "data.cache_dir", "data.streaming", "eval", "inspect", "plots",
                     "train.log_every", "train.eval_every", "train.ckpt_every", "train.keep_checkpoints")
SEED_LIMIT = 2**32  # torch.manual_seed on CPU keeps the low 32 bits (and refuses past 64)
NAME_MAX_CHARS = 32  # a compare row's label column is 24 wide; a name is meant to fit it


def check_run_name(name: Optional[str]) -> None:
    if name is None:
        return
    if not name.strip() or len(name) > NAME_MAX_CHARS or not name.isprintable() or name != name.strip():
        raise RelposError(f"name={name!r}: a run's name is 1 to {NAME_MAX_CHARS} printable characters on one line, "
                          "without leading or trailing spaces (or leave name out)")


def check_booleans(cfg: Any, section: type, prefix: str = "") -> None:
    """A boolean key must hold true or false: OmegaConf would turn 3, 0 or "yes" into a bool, while the
    raw value still names the result file's variant (eval_length.allow_changed_data=3.csv)."""
    for name, hint in get_type_hints(section).items():
        value = cfg.get(name) if isinstance(cfg, (DictConfig, Mapping)) else None
        if is_dataclass(hint):
            check_booleans(value, hint, f"{prefix}{name}.")
        elif hint is bool and value is not None and not isinstance(value, bool):
            raise RelposError(f"{prefix}{name} must be a boolean (true or false), got {value!r}")


def validate(cfg: DictConfig) -> RunSettings:
    """The whole run config against the schema: a wrong type, an unknown or deleted key, a value out
    of range -> RelposError, one line that names the key and what is allowed."""
    check_booleans(cfg, RunSettings)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunSettings), cfg))
    except RelposError:
        raise
    except OmegaConfBaseException as e:
        raise RelposError(explain(e, cfg)) from None


@dataclass
class EvalOnly:
    eval: EvalSettings


def validate_eval(cfg: DictConfig) -> EvalSettings:
    """The eval section alone, as validate() checks it: for commands that read a run's eval settings
    but not the rest (eval-task scores fabricated or task-only configs too)."""
    check_booleans(cfg, EvalOnly)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalOnly), {"eval": cfg.eval})).eval
    except RelposError:
        raise
    except OmegaConfBaseException as e:
        raise RelposError(explain(e, cfg)) from None


def explain(e: OmegaConfBaseException, cfg: DictConfig) -> str:
    key = str(getattr(e, "full_key", "") or "")
    if isinstance(e, ConfigKeyError) and "not in" in str(e):
        return f"unknown config key {key!r} (check its spelling: `relpos train --cfg job` lists the keys)"
    if isinstance(e, MissingMandatoryValue):
        if OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is None:
            return f"config key {key} is missing (deleted with ~?); it is needed"
        return f"{key} needs a value: {key}=..."
    if isinstance(e, ValidationError) and key:
        whole_key = key.split("[")[0]  # train.betas[0] -> train.betas
        value = OmegaConf.select(cfg, whole_key, default=getattr(e, "value", None), throw_on_missing=False)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        return f"{whole_key} must be {kind_of(whole_key)}, got {value!r}"
    return str(e).splitlines()[0]


def _field_type(key: str) -> Any:
    node: Any = RunSettings
    for part in key.split("."):
        if not is_dataclass(node):
            return Any
        node = get_type_hints(node).get(part, Any)
    return node


_KINDS = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
_PLURALS = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}


def kind_of(key: str) -> str:
    """'an integer', 'a list of numbers', ... for the schema type of a dotted key."""
    t = _field_type(key)
    args = [a for a in get_args(t) if a is not type(None)]
    optional = get_origin(t) is not None and type(None) in get_args(t)
    if optional and len(args) == 1:
        t = args[0]
    if get_origin(t) in (list, List):
        text = f"a list of {_PLURALS.get(get_args(t)[0], 'values')}"
    else:
        text = _KINDS.get(t, "a value of another type")
    return f"{text} or null" if optional else text


def schema_keys(section: type = RunSettings, prefix: str = "") -> list[str]:
    """Every dotted key the schema declares (for tests and for `check_override_keys`)."""
    keys = []
    for f in fields(section):
        key = f"{prefix}{f.name}"
        t = get_type_hints(section)[f.name]
        keys += schema_keys(t, f"{key}.") if is_dataclass(t) else [key]
    return keys
