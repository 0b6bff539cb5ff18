"""Corpora through Hugging Face `datasets`, tokenized once into cached token arrays.

Every source yields a DatasetDict with "train" and "validation" splits of documents (a text
column); the tokenizer concatenates each split into one stream of token ids, saved as .npy under
``data.cache_dir/<key>/`` so later runs memory-map it and start at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.atomic import atomic_write_bytes, atomic_write_text
from relpos_cli.tokenizers import build_tokenizer

CACHE_FORMAT = 1
HUB_HOST = ("huggingface.co", 443)


@dataclass
class TokenData:
    train: np.ndarray  # (N_train,) token ids
    validation: np.ndarray  # (N_val,) token ids
    vocab_size: int
    cache_dir: Path


# ---- sources ------------------------------------------------------------------------------------


def _held_out(path: str, fraction: float) -> bool:
    """Deterministic split by path: the same files are validation on every machine and run."""
    h = int(hashlib.sha1(path.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [
        p
        for p in sorted(root.rglob("*.py"))
        if not skip_dirs.intersection(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")
    ]
    return root, files


def _stdlib_dataset(cfg: Mapping[str, Any]):
    import datasets

    root, files = stdlib_files()
    rows = {"train": {"path": [], "text": []}, "validation": {"path": [], "text": []}}
    for f in files:
        rel = f.relative_to(root).as_posix()
        split = "validation" if _held_out(rel, cfg["val_fraction"]) else "train"
        rows[split]["path"].append(rel)
        rows[split]["text"].append(f.read_text(encoding="utf-8", errors="replace"))
    return datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in rows.items()}), "text"


def _hub_reachable(timeout: float = 3.0) -> bool:
    try:
        socket.create_connection(HUB_HOST, timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_dataset(cfg: Mapping[str, Any]):
    import datasets

    if cfg.get("path") in (None, "???"):
        raise RelposError("data=hub needs data.path=<dataset id>")
    if os.environ.get("HF_HUB_OFFLINE") != "1" and not _hub_reachable():
        # fail fast (no minute of retries) and still use a copy in the local HF cache if there is one
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    splits = {"train": cfg["train_split"]}
    if cfg.get("validation_split"):
        splits["validation"] = cfg["validation_split"]
    try:
        loaded = {k: datasets.load_dataset(cfg["path"], cfg.get("name"), split=s) for k, s in splits.items()}
    except Exception as e:  # datasets raises many types for "not there / not reachable"
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        reason = "the Hugging Face hub is unreachable and it is not in the local cache" if offline else str(e).splitlines()[0]
        raise RelposError(
            f"cannot load dataset {cfg['path']!r}: {reason}; offline choices: data=stdlib, data=text_files data.files=[...]"
        ) from None
    return datasets.DatasetDict(loaded), cfg.get("text_field", "text")


def _text_files_dataset(cfg: Mapping[str, Any]):
    import datasets

    def check(files: Any, key: str) -> list[str]:
        if files in (None, "???") or isinstance(files, str):
            files = [files] if isinstance(files, str) and files != "???" else None
        if not files:
            raise RelposError(f"data=text_files needs {key}=[file, ...]")
        for f in files:
            p = Path(f)
            if not p.is_file():
                raise RelposError(f"{key}: no such file: {f}")
            if p.stat().st_size == 0:
                raise RelposError(f"{key}: file is empty: {f}")
        return [str(Path(f).resolve()) for f in files]

    data_files = {"train": check(cfg.get("files"), "data.files")}
    if cfg.get("validation_files"):
        data_files["validation"] = check(cfg["validation_files"], "data.validation_files")
    return datasets.load_dataset("text", data_files=data_files, sample_by="document"), "text"


SOURCES = {"stdlib": _stdlib_dataset, "hub": _hub_dataset, "text_files": _text_files_dataset}


# ---- cache --------------------------------------------------------------------------------------


def _cache_key(cfg: Mapping[str, Any]) -> str:
    ident = {k: v for k, v in cfg.items() if k != "cache_dir"}
    ident["format"] = CACHE_FORMAT
    if cfg["source"] == "stdlib":
        ident["python"] = sys.version
        ident["stdlib"] = sysconfig.get_paths()["stdlib"]
    if cfg["source"] == "text_files":
        files = list(cfg.get("files") or []) + list(cfg.get("validation_files") or [])
        ident["stat"] = [(str(Path(f).resolve()), *_stat(f)) for f in files]
    blob = json.dumps(ident, sort_keys=True, default=str)
    return f"{cfg['source']}-{cfg['tokenizer']}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def _stat(f: str) -> tuple[int, int]:
    try:
        s = Path(f).stat()
        return s.st_size, s.st_mtime_ns
    except OSError:
        return -1, -1


def _save_array(path: Path, array: np.ndarray) -> None:
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    atomic_write_bytes(path, buf.getvalue())


def load_token_data(cfg: Mapping[str, Any]) -> TokenData:
    """Token streams for the configured source, from the cache or built now and cached."""
    source = cfg.get("source")
    if source not in SOURCES:
        raise RelposError(f"unknown data source {source!r}; choose one of: {', '.join(SOURCES)}")
    tokenizer = build_tokenizer(cfg["tokenizer"])
    cache = Path(os.path.expanduser(str(cfg["cache_dir"]))) / _cache_key(cfg)
    meta_path = cache / "meta.json"
    if not meta_path.exists():
        dsets, text_field = SOURCES[source](cfg)
        splits = {name: tokenizer.encode_documents(dsets[name][text_field]) for name in dsets}
        if "validation" not in splits:
            splits["train"], splits["validation"] = _split_tail(splits["train"], cfg.get("val_fraction", 0.05))
        for name, tokens in splits.items():
            if len(tokens) < 2:
                raise RelposError(f"the {name} split of data={source} has no text")
            _save_array(cache / f"{name}.npy", tokens.astype(_dtype_for(tokenizer.vocab_size)))
        meta = {"vocab_size": tokenizer.vocab_size, "tokens": {k: int(len(v)) for k, v in splits.items()}, "config": dict(cfg)}
        atomic_write_text(meta_path, json.dumps(meta, indent=2, default=str))  # written last: marks the cache complete
    meta = json.loads(meta_path.read_text())
    load = lambda name: np.load(cache / f"{name}.npy", mmap_mode="r")  # noqa: E731
    return TokenData(load("train"), load("validation"), meta["vocab_size"], cache)


def _split_tail(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(tokens) * (1 - fraction))
    return tokens[:cut], tokens[cut:]


def _dtype_for(vocab_size: int):
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32
