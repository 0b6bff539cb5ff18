"""relpos: train causal Transformers with any position scheme, evaluate them across lengths."""

__version__ = "0.1.0"
