"""`relpos import SOURCE OUT_DIR [key=value ...]`: a pretrained checkpoint becomes a relpos run.

SOURCE is ``hf:ORG/NAME[@REVISION]`` (through huggingface_hub: the hub, or its local cache when the
hub is unreachable), a local Hugging Face model dir (config.json, safetensors or .bin weights,
tokenizer files) or a ``.gguf`` file (read by transformers, dequantised to fp32). The family's
module (relpos_cli/families/) maps the config to relpos's model options and position scheme and
the weight names to relpos's; the run dir then holds what a finished training run holds:

- config.yaml: the model's shape and family options, the scheme with its settings (rope base,
  rotary fraction, rope scaling; ALiBi; learned positions), train.seq_len = the trained context
  (the scaling's original length where the config names one), the evaluation corpus (data.*:
  the stdlib corpus by default, tokenized with the model's own tokenizer);
- checkpoint.pt (fp32 weights), tokenizer.json, data.json (the corpus's fingerprint);
- import.json: the source, its revision or the sha256 of each weight file, the transformers version,
  the config's max_position_embeddings (GPT-2's n_positions).

Everything is written into a temp dir beside OUT_DIR that takes OUT_DIR's name at the end: an
error, Ctrl-C, SIGTERM or SIGHUP leaves nothing behind (no temp dir, no parent dir the import
made), an OUT_DIR that holds files is refused untouched, and every message names OUT_DIR or the
source's own file, never the temp dir. transformers (and gguf for .gguf files) are imported here
only: `pip install relpos[pretrained]`.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from relpos_cli import __version__
from relpos_cli.atomic import read_umask
from relpos_cli.checkpoint import save_config, save_torch_file
from relpos_cli.config import check_override_keys, conf_dir, parse_overrides, validate_run_config
from relpos_cli.console import as_relpos_error
from relpos_cli.data import TOKENIZER_FILE, file_sha256, go_offline, hub_reachable, load_token_data, resolve_data_paths
from relpos_cli.errors import Interrupted, RelposError
from relpos_cli.families import REGISTRY, family_for
from relpos_cli.families.base import Conversion
from relpos_cli.fingerprint import record_data
from relpos_cli.interrupt import main_thread_handlers, signals_as_ctrl_c
from relpos_cli.model import build_model
from relpos_cli.results import CHECKPOINT_FILE, IMPORT_FILE
from relpos_cli.settings import NAME_MAX_CHARS

# what `relpos import` may set besides what the checkpoint decides (model.*, pos.*, train.seq_len)
IMPORT_KEYS = ("data", "data.*", "eval.*", "inspect.*", "plots.*", "device", "seed", "wandb.*", "name")
# data.* keys the import sets from the model's own tokenizer: an override of one would change nothing
TOKENIZER_KEYS = ("data.tokenizer", "data.vocab_size", "data.tokenizer_file", "data.eos_token")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
PRETRAINED_EXTRA = "pip install 'relpos[pretrained]'"


@dataclass
class Checkpoint:
    """A pretrained model as read from its source, before conversion."""

    config: dict[str, Any]  # the Hugging Face config, as transformers normalises it
    tensors: dict[str, torch.Tensor]
    tokenizer_json: str
    eos_token: str
    provenance: dict[str, Any] = field(default_factory=dict)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise RelposError(f"relpos import reads checkpoints with transformers, which is not installed: {PRETRAINED_EXTRA}") from None
    return transformers


@contextmanager
def quiet(transformers) -> Iterator[None]:
    """transformers and huggingface_hub without their progress bars and warnings inside the block,
    as they were after it: relpos's own lines stay alone on stdout and stderr."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):  # GGUF's dequantising bar is a bare tqdm no setting turns off
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that holds an object (config.json, tokenizer_config.json, a weight index), or a
    one-line error naming the file."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RelposError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): not a JSON file") from None
    except ValueError as e:
        raise RelposError(f"{path} is unreadable ({e})") from None
    if not isinstance(value, dict):
        raise RelposError(f"{path} holds {JSON_TYPES.get(type(value), 'a value')}, not a JSON object of settings")
    return value


def reason(e: Exception, width: int = 160) -> str:
    """An exception's text on one line (a library's multi-line message joined), cut to `width`."""
    return " ".join(str(e).split())[:width] or type(e).__name__


# ---- sources -------------------------------------------------------------------------------------


def read_source(source: str) -> Checkpoint:
    if source.startswith("hf:"):
        path, provenance = resolve_hub(source[3:])
        return read_model_dir(path, {"source": source, **provenance})
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise RelposError(f"no such GGUF file: {source}")
        return read_gguf(path.resolve(), source)
    if path.is_dir():
        return read_model_dir(path.resolve(), {"source": source, "kind": "dir", "path": str(path.resolve())})
    raise RelposError(f"SOURCE {source!r} is neither hf:ORG/NAME[@REVISION], a model dir nor a .gguf file")


def resolve_hub(spec: str) -> tuple[Path, dict[str, Any]]:
    """hf:ORG/NAME[@REVISION] -> the snapshot dir (downloaded, or from the local hub cache when the hub
    is unreachable or HF_HUB_OFFLINE=1) and its commit."""
    repo_id, _, revision = spec.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise RelposError(f"hf:{spec}: name a hub model as hf:ORG/NAME[@REVISION]")
    if os.environ.get("HF_HUB_OFFLINE") != "1" and not hub_reachable():
        go_offline()  # fail fast, and still find a copy in the local cache
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise RelposError(f"hf: sources need huggingface_hub: {PRETRAINED_EXTRA}") from None
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        with quiet(_transformers()):
            path = Path(snapshot_download(repo_id, revision=revision or None, local_files_only=offline))
    except Exception as e:  # huggingface_hub raises many types for "not there / not reachable"
        if offline:
            raise RelposError(f"hf:{spec}: the Hugging Face hub is unreachable and the model is not in the local "
                              f"cache (HF_HUB_CACHE); pass a local model dir or a .gguf file instead") from None
        raise RelposError(f"hf:{spec}: {reason(e)}") from None
    return path, {"kind": "hf", "repo_id": repo_id, "revision": path.name, "requested_revision": revision or "main"}


def _weight_files(path: Path) -> list[Path]:
    for index in WEIGHT_INDEXES:
        if (path / index).is_file():
            weight_map = read_json_object(path / index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
                raise RelposError(f"{path / index} has no weight_map of weight names to file names")
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (path / n).is_file()]
            if missing:
                raise RelposError(f"{path / missing[0]} is missing (listed in {index}); the download is incomplete")
            return [path / n for n in names]
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return [path / name]
    raise RelposError(f"{path} holds no weights ({' or '.join(WEIGHT_FILES)}, or a sharded index)")


def _read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:
        raise RelposError(f"{path} is unreadable (truncated or not a weight file: {reason(e)})") from None


def read_model_dir(path: Path, provenance: dict[str, Any]) -> Checkpoint:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise RelposError(f"{path} has no config.json: not a Hugging Face model dir")
    raw = read_json_object(config_file)
    if not isinstance(raw.get("model_type"), str):
        raise RelposError(f"{config_file} names no model_type: the architecture is unknown")
    family_for(raw)  # an unsupported architecture is said before anything heavy is read
    transformers = _transformers()
    try:
        with quiet(transformers):
            config = transformers.AutoConfig.from_pretrained(str(path)).to_dict()
    except Exception as e:
        raise RelposError(f"{config_file}: transformers cannot read it ({reason(e)})") from None
    files = _weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(_read_weight_file(f))
    tokenizer_json, eos = _dir_tokenizer(path, config)
    provenance["weights"] = {f.name: file_sha256(f) for f in files}
    return Checkpoint(config, tensors, tokenizer_json, eos, provenance)


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _dir_tokenizer(path: Path, config: dict[str, Any]) -> tuple[str, str]:
    """tokenizer.json and the end-of-sequence token, both checked here, so a broken file is named
    where it lies; without a tokenizer.json, transformers converts what the dir holds (a
    SentencePiece model, vocab + merges)."""
    from tokenizers import Tokenizer

    file = path / TOKENIZER_FILE
    if not file.is_file():
        try:
            with quiet(_transformers()):
                tokenizer = _transformers().AutoTokenizer.from_pretrained(str(path))
            return tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token
        except Exception as e:
            raise RelposError(f"{path}: no tokenizer.json and transformers cannot build one ({reason(e)})") from None
    try:
        text = file.read_bytes().decode("utf-8")
        tokenizer = Tokenizer.from_str(text)
    except UnicodeDecodeError as e:
        raise RelposError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start}): not a tokenizer") from None
    except Exception as e:  # tokenizers raises a bare Exception for a broken file
        raise RelposError(f"{file} is unreadable as a tokenizer ({reason(e)})") from None
    settings = path / "tokenizer_config.json"
    eos = _token_text(read_json_object(settings).get("eos_token")) if settings.is_file() else None
    where = settings.name
    if eos is None and config.get("eos_token_id") is not None:
        eos_id, where = config["eos_token_id"], "config.json's eos_token_id"
        eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
        eos = tokenizer.id_to_token(eos_id) if isinstance(eos_id, int) and eos_id >= 0 else None
        if eos is None:
            raise RelposError(f"{path}: {where} {config['eos_token_id']!r} is not a token id of {TOKENIZER_FILE}")
    if eos is None:
        raise RelposError(f"{path}: no end-of-sequence token in tokenizer_config.json or config.json")
    if not isinstance(eos, str) or tokenizer.token_to_id(eos) is None:
        raise RelposError(f"{path}: the end-of-sequence token {eos!r} ({where}) is not a token of {TOKENIZER_FILE}")
    return _as_transformers_encodes(path, text), eos


def _as_transformers_encodes(path: Path, text: str) -> str:
    """The tokenizer transformers builds from the dir (its backend), which is what the model is run
    with there (lm-eval's hf model, a user's pipeline): transformers 5 rebuilds a Llama 2 or Mistral
    tokenizer.json's Prepend("▁") normalizer as Metaspace(prepend_scheme="first"), so a text that
    starts with a space is "▁There" there and was "▁▁There" from the file as it is. The file's own
    text where transformers cannot build one from the dir."""
    try:
        with quiet(_transformers()):
            return _transformers().AutoTokenizer.from_pretrained(str(path)).backend_tokenizer.to_str()
    except Exception:  # a tokenizer class transformers lacks: the file is all there is to go by
        return text


def open_gguf(path: Path) -> tuple[Any, str]:
    """A GGUF file's reader (metadata and tensor index; the tensors stay on disk until read) and its
    general.architecture, refused in one line unless relpos has a family for it and transformers'
    GGUF loader reads it."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise RelposError(f"reading .gguf files needs the gguf package: {PRETRAINED_EXTRA}") from None
    try:
        reader = GGUFReader(str(path))
        architecture = reader.fields["general.architecture"].contents()
    except Exception as e:
        raise RelposError(f"{path} is unreadable as GGUF (truncated or not a GGUF file: {reason(e)})") from None
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # the architectures the loader reads

    readable = sorted(t for cls in REGISTRY.values() for t in cls.model_types if t in GGUF_CONFIG_MAPPING)
    if architecture not in readable:
        raise RelposError(f"{path}: GGUF architecture {architecture!r} is not supported; relpos imports GGUF files "
                          f"of {', '.join(readable)} (other families: a Hugging Face model dir or hf:ORG/NAME)")
    return reader, architecture


# the {arch}.rope.* GGUF metadata relpos takes (llama.cpp's names, gguf.Keys.Rope): transformers' GGUF
# loader reads freq_base (rope_theta) and dimension_count (head_dim) but not the scaling; any other
# key (yarn's attention factors, longrope's, an old rope.scale_linear) is refused, not dropped
GGUF_ROPE_SCALING = {"scaling.original_context_length": "original_max_position_embeddings",
                     "scaling.yarn_beta_fast": "beta_fast", "scaling.yarn_beta_slow": "beta_slow"}
GGUF_ROPE_KEYS = {"freq_base", "dimension_count", "scaling.type", "scaling.factor", "scaling.finetuned",
                  *GGUF_ROPE_SCALING}
ROPE_FREQS = "rope_freqs.weight"
# the llama3 settings llama.cpp's converter computes rope_freqs.weight with, where the HF config
# names none (Meta's, for every Llama 3.x): low and high frequency factors, and the original length
# (it reads a top-level original_max_position_embeddings, which Llama 3 configs lack)
LLAMA3_CONVERTED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_CONVERTED_ORIGINAL = 8192


def llama3_divisors(dim: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original: int) -> torch.Tensor:
    """What llama.cpp's converter stores as rope_freqs.weight for a llama3 rope scaling: the number
    each frequency is divided by (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors), in its
    float32 arithmetic."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelength = 2 * math.pi / freqs
    smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisors = torch.where(wavelength > original / low_freq_factor, factor, 1 / ((1 - smooth) / factor + smooth))
    return torch.where(wavelength < original / high_freq_factor, 1.0, divisors)


def gguf_rope_scaling(reader, architecture: str, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The RoPE scaling a GGUF file holds, as transformers' rope_parameters ({} for none): the
    {arch}.rope.scaling.* metadata (linear, yarn; a factor without a type is linear, as llama.cpp
    reads it), or a rope_freqs.weight tensor of per-frequency divisors, taken only where they are
    exactly (to float32 rounding) Llama 3's scaling from the largest divisor as factor and
    LLAMA3_CONVERTED (the original length: the metadata's, else LLAMA3_CONVERTED_ORIGINAL). Anything
    else is refused in one line: transformers' loader drops all of it without a word."""
    prefix = f"{architecture}.rope."
    meta = {name[len(prefix):]: field.contents() for name, field in reader.fields.items() if name.startswith(prefix)}
    unknown = sorted(set(meta) - GGUF_ROPE_KEYS)
    if unknown:
        raise RelposError(f"{path}: GGUF metadata {prefix}{unknown[0]}={meta[unknown[0]]!r}: relpos does not import "
                          f"this RoPE setting")
    rope_type = meta.get("scaling.type", "linear")  # llama.cpp's default where the file names none
    factor = meta.get("scaling.factor") or 1.0  # none or 0: llama.cpp does not scale
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if "scaling.type" in meta or "scaling.factor" in meta:
            raise RelposError(f"{path}: {ROPE_FREQS} together with {prefix}scaling metadata: relpos does not "
                              f"import this combination")
        from gguf.quants import dequantize

        divisors = torch.from_numpy(dequantize(freqs.data, freqs.tensor_type).astype("float32").reshape(-1))
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        base, factor = config["rope_parameters"]["rope_theta"], float(divisors.max())
        originals = list(dict.fromkeys(o for o in (meta.get("scaling.original_context_length"),
                                                   LLAMA3_CONVERTED_ORIGINAL) if o))
        for original in originals:
            expected = llama3_divisors(dim, base, factor, **LLAMA3_CONVERTED, original=original)
            if expected.shape == divisors.shape and torch.allclose(expected, divisors, rtol=1e-6, atol=0):
                return {"rope_type": "llama3", "factor": factor, **LLAMA3_CONVERTED,
                        "original_max_position_embeddings": original}
        raise RelposError(f"{path}: {ROPE_FREQS} holds per-frequency RoPE divisors that are not Llama 3's scaling "
                          f"(factor {factor:g}, low/high frequency factors {LLAMA3_CONVERTED['low_freq_factor']:g}/"
                          f"{LLAMA3_CONVERTED['high_freq_factor']:g}, original length "
                          f"{' or '.join(map(str, originals))}): relpos does not import them")
    if rope_type not in ("none", "linear", "yarn"):
        raise RelposError(f"{path}: GGUF rope scaling type {rope_type!r}: relpos imports linear and yarn")
    if rope_type == "none" or factor == 1.0:
        return {}
    return {"rope_type": rope_type, "factor": float(factor),
            **{name: meta[key] for key, name in GGUF_ROPE_SCALING.items() if key in meta}}


@contextmanager
def reader_reused(reader: Any, path: Path) -> Iterator[None]:
    """gguf.GGUFReader(path) returns `reader` while the block runs: transformers' loader opens the file
    once for the config, once for the weights and once for the tokenizer, and each opening parses every
    metadata field in Python, the 49,152-entry vocabulary of SmolLM2 too (most of an import's time).
    The reader is read-only (a memory map), so one serves them all; another path gets its own."""
    import gguf

    opened = gguf.GGUFReader

    def reuse(file: Any, *args: Any, **kwargs: Any) -> Any:
        same = not args and not kwargs and Path(file).resolve() == path.resolve()
        return reader if same else opened(file, *args, **kwargs)

    gguf.GGUFReader = reuse
    try:
        yield
    finally:
        gguf.GGUFReader = opened


def read_gguf(path: Path, source: str) -> Checkpoint:
    """A GGUF file through transformers' GGUF loader: config, tokenizer and weights dequantised to
    fp32; the RoPE scaling, which the loader does not read, from the file itself (gguf_rope_scaling)."""
    transformers = _transformers()
    reader, architecture = open_gguf(path)  # before the whole file is dequantised
    try:
        with quiet(transformers), reader_reused(reader, path):
            model, loading = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32, output_loading_info=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        # the loader's size report goes to the log that quiet() silences: its one-line error points at it
        why = ("its tensors' shapes do not fit the model the loader builds from the file's metadata (for gpt2: a "
               "context_length other than 1024 or a feed_forward_length other than 4 x embedding_length)"
               if "ignore_mismatched_sizes" in str(e) else reason(e))
        raise RelposError(f"{path}: transformers cannot load this GGUF file (architecture {architecture!r}; {why})") from None
    config = model.config.to_dict()
    # transformers fills weights a file lacks with random ones: an incomplete file is refused instead
    tied = config.get("tie_word_embeddings")
    missing = sorted(k for k in loading["missing_keys"] if not (tied and k.startswith("lm_head.")))
    if missing:
        raise RelposError(f"{path} lacks weights ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                          f"an incomplete or truncated GGUF file")
    if tokenizer.eos_token is None:
        raise RelposError(f"{path} names no end-of-sequence token (tokenizer.ggml.eos_token_id)")
    scaling = gguf_rope_scaling(reader, architecture, config, path)
    if scaling:
        config["rope_parameters"] = {**(config.get("rope_parameters") or {}), **scaling}
    provenance = {"source": source, "kind": "gguf", "path": str(path), "architecture": architecture,
                  "weights": {path.name: file_sha256(path)}}
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    return Checkpoint(config, tensors, tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token, provenance)


# ---- the run dir ---------------------------------------------------------------------------------


def convert(checkpoint: Checkpoint) -> tuple[Conversion, dict[str, torch.Tensor]]:
    try:
        return family_for(checkpoint.config).convert(checkpoint.tensors, checkpoint.config)
    except RelposError:
        # packed weights under other names (GPTQ's qweight, bitsandbytes' SCB, FP8 scales): said as such,
        # not as a missing or truncated weight file; a config naming a quantisation over plain weights imports
        quantization = checkpoint.config.get("quantization_config")
        if not quantization:
            raise
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise RelposError(f"the checkpoint's weights are quantised (config.json's quantization_config: quant_method "
                          f"{method!r}); relpos imports unquantised weights (fp32, fp16, bf16) or a GGUF file, "
                          f"which it dequantises") from None


def run_config(conversion: Conversion, overrides: list[str]) -> DictConfig:
    """conf/config.yaml with the checkpoint's model, scheme and trained context, and the user's overrides."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=[f"pos={conversion.pos['name']}", *overrides])
    except Exception as e:
        raise RelposError(f"bad override: {str(e).splitlines()[0]}") from None
    with open_dict(cfg):
        cfg.model = OmegaConf.create(conversion.model)
        cfg.pos = OmegaConf.merge(cfg.pos, conversion.pos)
        cfg.train.seq_len = conversion.train_len
    return cfg


def source_name(source: str) -> str:
    """The run's default name: the model's own (hf:HuggingFaceTB/SmolLM2-135M@main -> SmolLM2-135M,
    a dir or a .gguf file -> its name without the extension), cut to what a name may hold."""
    name = source[3:].partition("@")[0].rsplit("/", 1)[-1] if source.startswith("hf:") else Path(source.rstrip("/")).name
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name.strip()[:NAME_MAX_CHARS].strip() or "imported"


def check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RelposError(f"{out_dir} already holds files; import into a new or empty dir")


def check_import_overrides(overrides: list[str]) -> None:
    """The keys `relpos import` uses: data.* but those it sets from the model's tokenizer."""
    check_override_keys(overrides, IMPORT_KEYS, "import")
    for o in parse_overrides(overrides):
        if o.key_or_group.lstrip("+~") in TOKENIZER_KEYS:
            raise RelposError(f"relpos import sets {', '.join(TOKENIZER_KEYS)} from the model's own tokenizer; "
                              f"{o.input_line!r} would change nothing: leave it out")


def named_for_out_dir(e: BaseException, tmp: Path | None, out_dir: Path) -> BaseException:
    """An error of the import as a one-line RelposError that names OUT_DIR where it named the temp
    dir (an OSError's file, a message); other exceptions as they are."""
    e = as_relpos_error(e)
    if tmp is not None and isinstance(e, RelposError) and str(tmp) in str(e):
        return RelposError(str(e).replace(str(tmp), str(out_dir)))
    return e


def import_checkpoint(source: str, out_dir: Path, overrides: list[str], announce=lambda text: None) -> Path:
    """Read, convert, check and write; returns the run dir. Nothing is left at OUT_DIR or beside it
    (the temp dir, the parent dirs made for it) unless all succeeded; SIGTERM and SIGHUP stop it
    as Ctrl-C does."""
    out_dir = Path(out_dir).expanduser().resolve()
    check_import_overrides(overrides)
    check_out_dir(out_dir)
    made = [p for p in out_dir.parents if not p.exists()]  # innermost first: the order to remove them in
    tmp = None
    with signals_as_ctrl_c():
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.importing-"))
            os.chmod(tmp, 0o777 & ~read_umask())  # mkdtemp makes it 0700 whatever the umask
            announce(f"reading {source}")
            checkpoint = read_source(source)
            conversion, state = convert(checkpoint)
            _write_run(tmp, checkpoint, conversion, state, overrides, announce)
            check_out_dir(out_dir)  # still free: nothing took it meanwhile
            if out_dir.exists():
                out_dir.rmdir()
            os.rename(tmp, out_dir)
        except BaseException as e:
            with main_thread_handlers(signal.SIG_IGN):  # a second signal does not cut the cleaning short
                remove_made(tmp, made)
            if isinstance(e, KeyboardInterrupt):
                signum = getattr(e, "signum", signal.SIGINT)
                raise Interrupted(f"{signal.Signals(signum).name}: import interrupted; nothing was written to "
                                  f"{out_dir}", signum) from None
            raise named_for_out_dir(e, tmp, out_dir) from None
    return out_dir


def remove_made(tmp: Path | None, made: list[Path]) -> None:
    """The temp dir and the parent dirs an import made, those still empty (another process may
    have put something in one meanwhile)."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    for d in made:
        try:
            d.rmdir()
        except OSError:
            break


def max_position_embeddings(config: dict[str, Any]) -> int | None:
    """The context length the checkpoint's config declares, where lm-eval's hf model reads it by
    default (GPT-2's n_positions, then max_position_embeddings); None where it names none (BLOOM)."""
    return next((config[k] for k in ("n_positions", "max_position_embeddings") if config.get(k) is not None), None)


def _write_run(run_dir: Path, checkpoint: Checkpoint, conversion: Conversion, state: dict[str, torch.Tensor],
               overrides: list[str], announce) -> None:
    (run_dir / TOKENIZER_FILE).write_text(checkpoint.tokenizer_json)
    cfg = run_config(conversion, overrides)
    with open_dict(cfg):
        if cfg.get("name") is None:
            cfg.name = source_name(checkpoint.provenance["source"])
        cfg.data.tokenizer = "hf"
        cfg.data.vocab_size = None
        cfg.data.tokenizer_file = str(run_dir / TOKENIZER_FILE)
        cfg.data.eos_token = checkpoint.eos_token
        resolve_data_paths(cfg)  # stored absolute, as train stores them: the run evaluates from any directory
    validate_run_config(cfg)
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    announce(f"tokenizing the evaluation corpus (data={cfg.data.source}) with the model's tokenizer")
    data = load_token_data(data_cfg)
    model = build_model(cfg, data.vocab_size)  # refuses a tokenizer larger than the embedding
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:200]
        raise RelposError(f"the checkpoint's weights do not fit its config ({detail})") from None
    record_data(run_dir, data_cfg, data)
    save_torch_file(run_dir / CHECKPOINT_FILE, {"step": 0, "model": model.state_dict(), "vocab_size": data.vocab_size})
    with open_dict(cfg):
        cfg.data.tokenizer_file = TOKENIZER_FILE  # relative: resolved against the run dir it lies in
    save_config(run_dir, cfg)
    transformers = _transformers()
    record = {**checkpoint.provenance, "family": family_for(checkpoint.config).name,
              "model_type": checkpoint.config.get("model_type"), "parameters": model.num_params(),
              "train_seq_len": conversion.train_len, "max_position_embeddings": max_position_embeddings(checkpoint.config),
              "notes": conversion.notes,
              "transformers": transformers.__version__, "relpos": __version__}
    (run_dir / IMPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    for note in conversion.notes:
        announce(f"note: {note}")
