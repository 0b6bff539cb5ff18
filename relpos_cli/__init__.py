"""relpos: train causal Transformers with any position scheme, evaluate them across lengths.

Importing the package (or any of its modules) changes nothing in the host process: settings relpos
wants for its own commands (huge pages, torch.compile's recompile limit, the compile cache) are set
by the `relpos` entry point or around the work that needs them (tests/test_huge_pages.py)."""

__version__ = "0.1.0"
