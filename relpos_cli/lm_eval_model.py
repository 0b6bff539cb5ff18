"""relpos runs inside lm-evaluation-harness: an lm-eval model named `relpos`.

Importing this module registers the model (lm-eval 0.4 has no entry-point discovery of external
models: its registry knows a model once something imports the class). `relpos-lm-eval` is lm-eval's
own command line with the model registered:

    relpos-lm-eval --model relpos --model_args run=outputs/smollm2,eval.self_extend.group=8,\\
        eval.self_extend.window=64,max_length=8192 --tasks lambada_openai

Requests are handled as lm-eval's `hf` model (HFLM) handles them, so an imported checkpoint scores
the numbers `--model hf` gives on its Hugging Face dir: loglikelihood on (context + continuation)
left-truncated to max_length + 1 tokens, loglikelihood_rolling on lm-eval's disjoint rolling windows
of max_length, generate_until with the context cut to max_length - max_gen_toks; texts encoded with
the BOS an imported model's tokenizer adds, which is also what an empty context conditions on, and
generations decoded without special tokens. The model has no KV cache; generation re-runs the
window (relpos_cli.sample.generate).

Reference: https://github.com/EleutherAI/lm-evaluation-harness/blob/main/docs/model_guide.md and
lm_eval/models/huggingface.py (HFLM) in the same repository.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from relpos_cli.errors import RelposError

try:
    import lm_eval.models  # noqa: F401  the built-in models first: get_model loads them only into an empty registry
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
except ModuleNotFoundError as e:
    if not (e.name or "").startswith("lm_eval"):
        raise
    raise RelposError("the relpos lm-eval model needs lm-evaluation-harness: pip install 'relpos[lm-eval]'") from None

from relpos_cli.checkpoint import load_config, load_run
from relpos_cli.console import print_error, print_note
from relpos_cli.distributed import resolve_device
from relpos_cli.extension import EVAL_METHOD_KEYS
from relpos_cli.importing import read_json_object
from relpos_cli.precision import eval_autocast, eval_precision
from relpos_cli.renamed import renamed_overrides
from relpos_cli.results import IMPORT_FILE
from relpos_cli.sample import generate
from relpos_cli.tokenizers import HfTokenizer

# model_args besides eval.* (device and batch_size also come from lm-eval's --device / --batch_size)
MODEL_ARGS = ("run", "device", "max_length", "batch_size")
# the eval.* sections that change the model; eval.lengths, eval.protocol... say what eval-length scores,
# which lm-eval's tasks say here
METHOD_SECTIONS = EVAL_METHOD_KEYS  # eval.<section>.* as eval-length takes them
# the sampling settings generate_until follows (after lm-eval's normalize_gen_kwargs)
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k")
MAX_GEN_TOKS = 256  # HFLM's default
LM_EVAL_DEVICE = "cuda:0"  # the device lm-eval's command line passes unless --device says otherwise


def override_line(key: str, value: Any) -> str:
    """key=value as a Hydra override; lm-eval has already read the value as a bool, None, number or string.

    Args:
        key: an eval.* key.
        value: the value lm-eval parsed from model_args.
    """
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value}"


def method_overrides(kwargs: dict[str, Any]) -> list[str]:
    """The eval.* model_args as load_run overrides; any other key is one line naming what is taken.

    Args:
        kwargs: model_args other than those in MODEL_ARGS.
    """
    overrides = []
    for line in renamed_overrides([override_line(key, value) for key, value in kwargs.items()]):
        key = line.split("=", 1)[0]
        parts = key.split(".")
        if key != "eval.precision" and (parts[0] != "eval" or len(parts) < 3 or parts[1] not in METHOD_SECTIONS):
            sections = ", ".join(f"eval.{s}.*" for s in METHOD_SECTIONS)
            raise RelposError(f"the relpos lm-eval model takes {', '.join(MODEL_ARGS)}, eval.precision and {sections}, "
                              f"not {line} (lm-eval's tasks say what is scored; max_length=N sets the longest window)")
        overrides.append(line)
    return overrides


def pick_device(name: str | None) -> torch.device:
    """cpu, cuda, cuda:N or auto (None: auto). lm-eval's command line passes cuda:0 unless --device
    says otherwise: without CUDA that is the CPU, as for lm-eval's hf model.

    Args:
        name: model_args' device or lm-eval's --device.
    """
    if name == LM_EVAL_DEVICE and not torch.cuda.is_available():
        print_note(f"device={name} (lm-eval's default) but no CUDA device is available: running on the CPU")
        return torch.device("cpu")
    kind, colon, index = str(name or "auto").partition(":")
    if colon and not (kind == "cuda" and index.isdigit()):
        raise RelposError(f"device={name!r}; choose one of: auto, cpu, cuda, cuda:N")
    device = resolve_device(kind)  # one line where CUDA is asked for and absent
    return torch.device(str(name)) if colon else device


def default_max_length(run: Path, train_len: int) -> int:
    """max_length where model_args give none: for an imported run, lm-eval's hf model's default, the
    context the checkpoint's config declares (max_position_embeddings, GPT-2's n_positions) as
    relpos import records it in import.json; else the run's train.seq_len (a trained run, BLOOM,
    whose config declares none, a run imported before relpos recorded it). The two differ where a
    RoPE scaling names its original length: train.seq_len is that (8192 for Llama 3.1), hf reads
    max_position_embeddings (131072).

    Args:
        run: the run dir.
        train_len: its train.seq_len.
    """
    record = run / IMPORT_FILE
    declared = read_json_object(record).get("max_position_embeddings") if record.is_file() else None
    return train_len if declared is None else positive_int(f"{record}'s max_position_embeddings", declared)


def sampling(settings: dict[str, Any]) -> tuple[float, int]:
    """(temperature, top_k) for relpos_cli.sample.generate from normalized gen kwargs: temperature 0
    (greedy) unless do_sample; what HF's generate refuses (do_sample without a positive temperature,
    a negative top_k) is one line.

    Args:
        settings: gen kwargs after lm-eval's normalize_gen_kwargs (do_sample always set).
    """
    top_k = settings.get("top_k") or 0
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise RelposError(f"top_k must be a non-negative integer (0: every token), got {top_k!r}")
    if not settings["do_sample"]:
        return 0.0, top_k
    temperature = float(settings.get("temperature", 0.0))
    # nan compares False (HF's generate refuses it; the sampler failed on it); inf: `relpos sample` refuses it too
    if not 0 < temperature < math.inf:
        raise RelposError(f"do_sample=true needs a finite temperature > 0, got {settings.get('temperature', 'none')} "
                          f"(lm-eval's hf model refuses it too); for greedy decoding set do_sample=false")
    return temperature, top_k


def stop_sequences(until: list[Any], eos: str) -> list[str]:
    """The stop sequences of a request (its `until` and the end token's text), each a string: a task
    yaml's `until: [5]` or `[null]` is one line (lm-eval's hf model fails with a TypeError on it).

    Args:
        until: the request's `until`, a list after lm-eval's normalize_gen_kwargs.
        eos: the end token's text.
    """
    bad = [stop for stop in until if not isinstance(stop, str)]
    if bad:
        raise RelposError(f"until must hold strings (stop sequences), got {bad[0]!r}")
    return handle_stop_sequences(list(until), eos=eos)


def positive_int(name: str, value: Any) -> int:
    """A model_arg that must be a positive integer (lm-eval passes --batch_size as a string).

    Args:
        name: the model_arg, for the message.
        value: what lm-eval passed.
    """
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number <= 0 or isinstance(value, (bool, float)):
        raise RelposError(f"{name} must be a positive integer, got {value!r}")
    return number


@register_model("relpos")
class RelposLM(TemplateLM):
    """A relpos run (trained or imported) as an lm-eval model.

    Args:
        run: the run dir.
        device: cpu, cuda, cuda:N or auto (default: cuda where there is one).
        max_length: the longest window scored (default: default_max_length, lm-eval's hf model's for
            an imported run); past the training length with an eval-time extension method, e.g.
            eval.self_extend.group=8.
        batch_size: inputs of the same length per forward pass (different lengths are never padded
            together: RoPE scaling that follows the input length would see the padded length).
        **eval_settings: eval.precision (auto: bf16 autocast on CUDA, fp32 on CPU), eval.rope_scaling.*,
            eval.self_extend.*, eval.rerope.*, eval.sinks.* as on the command line of eval-length.
    """

    def __init__(self, run: str | Path | None = None, device: str | None = None, max_length: int | None = None,
                 batch_size: int | str = 1, **eval_settings: Any):
        super().__init__()
        if run is None:
            raise RelposError("the relpos lm-eval model needs run=DIR in --model_args")
        overrides = method_overrides(eval_settings)
        self.batch_size = positive_int("batch_size", batch_size)
        self._device = pick_device(device)
        train_len = int(load_config(Path(run), whole_run=True).train.seq_len)
        self.max_length = (default_max_length(Path(run), train_len) if max_length is None
                           else positive_int("max_length", max_length))
        # eval.rope_scaling.factor=longest is resolved from eval.lengths: the longest window here is max_length
        self.model, self.tokenizer, cfg = load_run(run, self._device, [*overrides, f"eval.lengths=[{self.max_length}]"])
        self.model.scheme.check_length(self.max_length)
        self.bos_id = self.tokenizer.start_ids[0] if self.tokenizer.start_ids else None
        # a text that starts with it gets no second one (HFLM's tok_encode): decoded once, not per request
        self.prefix_text = self.tok_decode([self.prefix_token_id], skip_special_tokens=False)
        self.precision = eval_precision(cfg.eval.precision, self._device)
        self.run, self.overrides = str(run), overrides

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "RelposLM":
        """--model_args "key=value,..." (create_from_arg_obj)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "RelposLM":
        """model_args, and lm-eval's --device, --batch_size, --max_batch_size in additional_config:
        lm-eval passes those always (its defaults too), and its own merge fails with a TypeError on
        a key given in both; here model_args' device and batch_size win."""
        given = {key: value for key, value in (additional_config or {}).items()
                 if value is not None and key not in arg_dict}
        return cls(**arg_dict, **given)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window condition on (HFLM's): the BOS where the
        tokenizer adds one, else the end token (a document starts after it in relpos's training)."""
        return self.eot_token_id if self.bos_id is None else self.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The run's own encoding. An imported model's tokenizer adds its special tokens (its BOS)
        unless add_special_tokens is False or the text starts with the prefix token's text, as
        HFLM's tok_encode; relpos's own tokenizers add none (documents follow the end token)."""
        if not isinstance(self.tokenizer, HfTokenizer):
            return self.tokenizer.encode(string)
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.prefix_text)
        return self.tokenizer.encode(string, special_tokens=add_special_tokens)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        """The text of tokens, an imported model's special tokens left out unless skip_special_tokens
        is False, as HFLM's tok_decode (relpos's own tokenizers' only special token is the end
        token, which generation never returns)."""
        if isinstance(self.tokenizer, HfTokenizer):
            return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(tokens)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval's results record about the model: the run and how it was scored."""
        return {"relpos_run": self.run, "relpos_eval_overrides": self.overrides, "max_length": self.max_length,
                "precision": self.precision}

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per
        request: the input is (context + continuation) left-truncated to max_length + 1 tokens, less the
        last one, as HFLM's; inputs of equal length share a forward pass.

        Args:
            requests: (cache key or None, context ids, continuation ids).
        """
        inputs = []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise RelposError(f"a continuation of {len(continuation)} tokens cannot be scored with "
                                  f"max_length={self.max_length}")
            inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
        by_length = defaultdict(list)
        for i, ids in enumerate(inputs):
            by_length[len(ids)].append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for length, indices in by_length.items():
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                tokens = torch.tensor([inputs[i] for i in batch], device=self.device)  # (B, T)
                counts = [len(requests[i][2]) for i in batch]
                scored = torch.zeros_like(tokens, dtype=torch.bool)  # the continuation's positions
                for row, n in enumerate(counts):
                    scored[row, length - n:] = True
                # (sum of counts, V): only the continuations' logits, never (B, T, V) for a large vocabulary
                with eval_autocast(self.device, self.precision):
                    logits = self.model(tokens, at=scored)
                logprobs = logits.float().log_softmax(-1)
                for i, rows in zip(batch, logprobs.split(counts)):
                    target = torch.tensor(requests[i][2], device=self.device)
                    answer = (float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all()))
                    results[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """log p(text) per request, over lm-eval's disjoint rolling windows of max_length (the first
        token conditioned on the end-of-document token, as a document starts in training)."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Text after each context until a stop sequence (or the end token, or max_gen_toks tokens):
        greedy unless do_sample, the context left-truncated to max_length - max_gen_toks as HFLM's
        (an empty one, which HF's generate refuses, is the prefix token), stop sequences found in
        the text with its special tokens, the answer without them."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        answers = []
        for context, gen_kwargs in (req.args for req in requests):
            settings = dict(normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS))
            unknown = sorted(set(settings) - set(GEN_KWARGS))
            if unknown:
                raise RelposError(f"the relpos lm-eval model samples with {', '.join(GEN_KWARGS)}, "
                                  f"not {', '.join(unknown)}")
            until = stop_sequences(settings["until"], eos)
            max_new = settings["max_gen_toks"]
            if max_new >= self.max_length:
                raise RelposError(f"max_gen_toks={max_new} leaves no room for a context in max_length={self.max_length}")
            prompt = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            temperature, top_k = sampling(settings)
            # each sampled request its own seed, drawn from torch's generator (lm-eval's --seed sets it):
            # the copies lm-eval makes of a request with `repeats` are different samples, as hf's are
            seed = int(torch.randint(2**62, ())) if temperature > 0 else 0
            new: list[int] = []
            with eval_autocast(self.device, self.precision):
                for token in generate(self.model, prompt, max_new, temperature, top_k, seed,
                                      context=self.max_length, stop_id=self.eot_token_id):
                    new.append(token)
                    if any(stop and stop in self.tok_decode(new, skip_special_tokens=False) for stop in until):
                        break  # as HF's stopping criteria: the text is cut at the stop sequence below
            text = postprocess_generated_text(self.tok_decode(new), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            answers.append(text)
        return answers


def main() -> None:
    """lm-eval's command line with the `relpos` model registered; a RelposError as one line, exit 2."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except RelposError as e:
        print_error(str(e))
        raise SystemExit(e.exit_code) from None

