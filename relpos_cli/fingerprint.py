"""What data a run was trained on, recorded in its run dir (data.json), so that evaluating or resuming
it on other data is refused rather than silently scored.

data.json holds the source (text_files: each file's path, size and sha256; stdlib: the interpreter's
version, stdlib path and a hash of its file list; hub: the dataset id, config and splits), the
tokenizer (bpe: the sha256 of its tokenizer.json) and the token streams (count and sha256 of each
split). The source is checked before any data is loaded (an edited text file is never re-tokenised
behind the user's back); the tokens after, which also covers sources with nothing local to hash.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from relpos_cli.atomic import atomic_write_text
from relpos_cli.console import print_note
from relpos_cli.data import (
    HASH_CHUNK, TOKENIZER_FILE, TokenData, file_record, file_sha256, file_state, holds_other_content, stdlib_files,
    text_file_lists, untouched,
)
from relpos_cli.errors import RelposError

DATA_FILE = "data.json"


def tokens_sha256(tokens: np.ndarray) -> str:
    """Hash of a token stream (a memmap is read a chunk at a time, never whole)."""
    h = hashlib.sha256()
    for i in range(0, len(tokens), HASH_CHUNK):
        h.update(np.ascontiguousarray(tokens[i : i + HASH_CHUNK]).tobytes())
    return h.hexdigest()


def _stdlib_identity() -> dict[str, Any]:
    root, files = stdlib_files()
    listing = hashlib.sha256()
    for f in files:
        listing.update(f"{f.relative_to(root).as_posix()}\t{f.stat().st_size}\n".encode())
    return {"python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"], "files": len(files),
            "sha256_of_paths_and_sizes": listing.hexdigest()}


def source_fingerprint(data_cfg: Mapping[str, Any]) -> dict[str, Any]:
    source = data_cfg["source"]
    if source == "text_files":
        return {key: [file_record(f) for f in files] for key, files in text_file_lists(data_cfg).items()}
    if source == "stdlib":
        return _stdlib_identity()
    return {k: data_cfg.get(k) for k in ("path", "name", "train_split", "validation_split", "revision") if data_cfg.get(k)}


def tokenizer_fingerprint(data_cfg: Mapping[str, Any], data: TokenData) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": data_cfg["tokenizer"], "vocab_size": data.vocab_size}
    if data_cfg["tokenizer"] in ("bpe", "hf"):
        entry["sha256"] = file_sha256(tokenizer_path(data))
    return entry


def tokenizer_path(data: TokenData) -> Path:
    """The tokenizer.json that made `data`: a pretrained model's own (hf), else the one learnt in the cache (bpe)."""
    return getattr(data.tokenizer, "path", None) or data.cache_dir / TOKENIZER_FILE


def record_data(run_dir: Path, data_cfg: Mapping[str, Any], data: TokenData) -> None:
    """Write data.json for a run about to train on `data`."""
    record = {
        "source": data_cfg["source"],
        "files" if data_cfg["source"] == "text_files" else data_cfg["source"]: source_fingerprint(data_cfg),
        "tokenizer": tokenizer_fingerprint(data_cfg, data),
        "tokens": {name: {"count": len(tokens), "sha256": tokens_sha256(tokens)}
                   for name, tokens in (("train", data.train), ("validation", data.validation))},
    }
    atomic_write_text(Path(run_dir) / DATA_FILE, json.dumps(record, indent=2) + "\n")


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / DATA_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise RelposError(f"{path} is unreadable (not JSON): the run's data cannot be checked") from None


def _file_changes(recorded: list[dict[str, Any]], now: list[str]) -> list[str]:
    changes = []
    if [e["path"] for e in recorded] != list(now):
        return [f"the file list is now {list(now)}, it was {[e['path'] for e in recorded]}"]
    for entry in recorded:
        p = Path(entry["path"])
        if not p.is_file():
            changes.append(f"{p} is gone")
            continue
        now = file_state(p)
        if untouched(entry, now):  # no need to read it again
            continue
        if holds_other_content(entry, now):
            size = (f"{entry['bytes']:,} -> {now['bytes']:,} bytes" if now["bytes"] != entry["bytes"]
                    else f"other content, the same {now['bytes']:,} bytes")
            changes.append(f"{p} changed ({size})")
    return changes


def _source_changes(recorded: dict[str, Any], data_cfg: Mapping[str, Any]) -> list[str]:
    source = data_cfg["source"]
    if recorded.get("source") != source:
        return [f"data source {recorded.get('source')} -> {source}"]
    if source == "text_files":
        lists = text_file_lists(data_cfg)
        return [c for key, files in lists.items() for c in _file_changes(recorded["files"].get(key, []), files)]
    if source == "stdlib":
        before, now = recorded["stdlib"], _stdlib_identity()
        if before != now:
            return [f"the standard library of Python {before['python'].split()[0]} at {before['stdlib']} is now "
                    f"that of Python {now['python'].split()[0]} at {now['stdlib']} ({now['files']} files)"]
    return []


def _handle(run_dir: Path, changes: list[str], allow: bool, how: str) -> list[str]:
    if not changes:
        return []
    what = f"the data of {run_dir} changed since it was trained: {'; '.join(changes)}"
    if allow:
        print_note(f"{what}; {how} anyway, as asked (recorded in the results)")
        return changes
    if how == "resume":
        raise RelposError(f"{what}; restore it to resume the run (a resumed run must train on the same data)")
    raise RelposError(f"{what}; restore it, or {how} anyway with {how}.allow_changed_data=true "
                      f"(recorded in the results)")


def check_data_unchanged(run_dir: Path, data_cfg: Any, allow: bool, how: str) -> list[str]:
    """Before loading: the run's source files / interpreter are those it was trained on. Returns the
    changes when `allow` (else raises on any). how: 'resume', 'eval' or 'inspect' (names the override)."""
    from omegaconf import OmegaConf

    recorded = _recorded(run_dir)
    if recorded is None:
        print_note(f"{run_dir} has no {DATA_FILE} (trained before relpos recorded its data): its data is not checked")
        return []
    cfg = OmegaConf.to_container(data_cfg, resolve=True) if OmegaConf.is_config(data_cfg) else dict(data_cfg)
    return _handle(run_dir, _source_changes(recorded, cfg), allow, how)


def check_parent_tokenizer(parent_dir: Path, data_cfg: Mapping[str, Any], data: TokenData) -> None:
    """A fine-tune (init_from) reads token ids as its parent's weights do: with the parent's tokenizer.
    A BPE learnt on another corpus (or on the parent's with another vocabulary) gives the same ids to
    other strings, which the vocabulary size alone does not show."""
    recorded = _recorded(parent_dir)
    if recorded is None:
        print_note(f"{parent_dir} has no {DATA_FILE}: whether this run's tokenizer is its parent's is not checked")
        return
    before, now = recorded["tokenizer"], tokenizer_fingerprint(data_cfg, data)
    if (before.get("name"), before.get("sha256")) != (now["name"], now.get("sha256")):
        learnt = "; a BPE is learnt from the run's own data: fine-tune on the parent's data source" if now["name"] == "bpe" else ""
        raise RelposError(f"init_from={parent_dir}: this run's tokenizer ({_tokenizer_text(now)}) is not its parent's "
                          f"({_tokenizer_text(before)}), whose token ids its weights were trained on{learnt}")


def _tokenizer_text(entry: Mapping[str, Any]) -> str:
    return f"{entry.get('name')}" + (f", tokenizer.json sha256 {entry['sha256'][:12]}" if entry.get("sha256") else "")


def check_tokens_unchanged(run_dir: Path, data: TokenData, allow: bool, how: str,
                           splits: Iterable[str] = ("validation",)) -> list[str]:
    """After loading: the tokenizer and the token streams are those the run was trained on."""
    recorded = _recorded(run_dir)
    if recorded is None:
        return []
    changes = []
    tokenizer = recorded["tokenizer"]
    if tokenizer.get("sha256") and tokenizer_path(data).is_file():
        if file_sha256(tokenizer_path(data)) != tokenizer["sha256"]:
            changes.append(f"the tokenizer {tokenizer_path(data)} is not the one it was trained with")
    for name in splits:
        tokens, before = getattr(data, name), recorded["tokens"][name]
        if len(tokens) != before["count"] or tokens_sha256(tokens) != before["sha256"]:
            count = (f"{before['count']:,} -> {len(tokens):,} tokens" if len(tokens) != before["count"]
                     else f"other ids, the same {len(tokens):,} tokens")
            changes.append(f"its {name} tokens differ ({count})")
    return _handle(run_dir, changes, allow, how)
