"""relpos: train causal Transformers with any position scheme, evaluate them across lengths."""

import os

# Large CPU tensors in 2 MiB pages: torch's own switch, read at its first allocation, so it is set
# before anything imports torch. Long evaluation builds a (block x L) bias for every query block;
# faulting 16 MiB in 4 KiB pages took 14 ms against 4 ms in 2 MiB ones, and FIRE's evaluation at
# L = 16384 took 18.8 s without and 17.4 s with (README, Speed). A value set by the user wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"


def load_run(run_dir, device="cpu"):
    """A finished run, trained or imported, for a notebook: (model, tokenizer, config).

    model(tokens) maps token ids (B, T) to logits (B, T, V); tokenizer.encode(text) / decode(ids)
    are the run's own; config is the run's config. Imported lazily: `import relpos_cli` stays light.

        from relpos_cli import load_run
        model, tokenizer, config = load_run("outputs/smollm2")
        logits = model(torch.tensor([tokenizer.encode("def main(")]))  # (1, T, V)
    """
    from relpos_cli.checkpoint import load_run as load

    return load(run_dir, device)
