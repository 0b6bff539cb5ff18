"""Config keys renamed since runs were saved: old names keep working.

A light module (no Hydra, no torch): the CLI rewrites what the user typed before any command runs,
with a one-line note per old key; relpos_cli/config.py reads saved configs' old keys under the new
names and rewrites stored settings replayed from result files.
"""

from __future__ import annotations

from relpos_cli.console import print_note

# keys renamed since runs were saved, old dotted name -> new one: an override naming an old key is
# rewritten (with a one-line note where the user typed it), a saved config's old keys are read under
# the new names. eval.window's W was `size` where Self-Extend's and ReRoPE's is `window`.
RENAMED_KEYS = {"eval.window.size": "eval.sinks.window", "eval.window.sinks": "eval.sinks.count",
                "eval.window.max_distance": "eval.sinks.max_distance"}


def renamed_overrides(overrides: list[str], note: bool = True) -> list[str]:
    """The overrides with every renamed key (RENAMED_KEYS) under its new name, Hydra's +/~ prefixes
    kept; note: say so in one line per key (the command line), not when replaying stored settings."""
    out = []
    for line in overrides:
        prefix = line[: len(line) - len(line.lstrip("+~"))]
        key, sep, value = line[len(prefix):].partition("=")
        new = RENAMED_KEYS.get(key)
        if new is not None:
            if note:
                print_note(f"{key} is now called {new} (the old name still works, for now)")
            line = f"{prefix}{new}{sep}{value}"
        out.append(line)
    return out
