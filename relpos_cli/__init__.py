"""relpos: train causal Transformers with any position scheme, evaluate them across lengths.

Importing the package (or any of its modules) changes nothing in the host process: settings relpos
wants for its own commands (huge pages, torch.compile's recompile limit, the compile cache) are set
by the `relpos` entry point or around the work that needs them (tests/test_huge_pages.py)."""

__version__ = "0.1.0"


def load_run(run_dir, device="cpu", overrides=()):
    """A finished run, trained or imported, for a notebook: (model, tokenizer, config).

    model(tokens) maps token ids (B, T) to logits (B, T, V); tokenizer.encode(text) / decode(ids)
    are the run's own; config is the run's config. overrides: eval.* settings as on the command line,
    for the model eval-length scores with them. Imported lazily: `import relpos_cli` stays light.

        from relpos_cli import load_run
        model, tokenizer, config = load_run("outputs/smollm2")
        logits = model(torch.tensor([tokenizer.encode("def main(")]))  # (1, T, V)
        model, _, _ = load_run("outputs/smollm2", overrides=["eval.self_extend.group=8", "eval.self_extend.window=64"])
    """
    from relpos_cli.checkpoint import load_run as load

    return load(run_dir, device, overrides)
