"""Corpora through Hugging Face `datasets`, tokenized once into cached token arrays.

Every source yields a DatasetDict with "train" and "validation" splits of documents (a text
column); the tokenizer concatenates each split into one stream of token ids, saved under
``data.cache_dir/<key>/`` so later runs memory-map it and start at once: as <split>.npy, or with
data.streaming=true as raw <split>.bin files appended chunk by chunk while the documents stream
in, so neither the text nor the tokens of a split are ever whole in RAM. With data.tokenizer=bpe
the cache dir also holds the tokenizer.json learnt from the train split.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping

import numpy as np

from relpos_cli.errors import RelposError
from relpos_cli.atomic import atomic_write_text, atomic_writer
from relpos_cli.console import print_note
from relpos_cli.settings import ADDED_KEYS, DATA_SOURCES, check_data_config
from relpos_cli.tokenizers import BpeTokenizer, ByteTokenizer, HfTokenizer, Tokenizer

CACHE_FORMAT = 1
HASH_CHUNK = 1 << 22
# text handed to the tokenizer at once in a streaming pass: bounds its memory whatever the corpus size
STREAM_CHUNK_CHARS = 1 << 22
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class TokenData:
    train: np.ndarray  # (N_train,) token ids
    validation: np.ndarray  # (N_val,) token ids
    vocab_size: int
    cache_dir: Path
    token_bytes: np.ndarray  # (vocab_size,) UTF-8 bytes of text each token id stands for
    tokenizer: Tokenizer  # the run's own: encodes prompts and decodes samples (relpos sample)


# ---- sources ------------------------------------------------------------------------------------


def held_out(path: str, fraction: float) -> bool:
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


def _datasets():
    """The `datasets` package, without its progress bars: relpos's error lines stay alone on stderr."""
    import datasets

    datasets.disable_progress_bars()
    return datasets


def _stdlib_dataset(cfg: Mapping[str, Any]):
    datasets = _datasets()

    root, files = stdlib_files()
    rows = {"train": {"path": [], "text": []}, "validation": {"path": [], "text": []}}
    for f in files:
        rel = f.relative_to(root).as_posix()
        split = "validation" if held_out(rel, cfg["val_fraction"]) else "train"
        rows[split]["path"].append(rel)
        rows[split]["text"].append(f.read_text(encoding="utf-8", errors="replace"))
    return datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in rows.items()}), "text"


def _hub_address() -> tuple[str, int]:
    """Host and port of the hub huggingface_hub talks to (HF_ENDPOINT, else huggingface.co)."""
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout: float = 3.0) -> bool:
    try:
        socket.create_connection(_hub_address(), timeout=timeout).close()
        return True
    except OSError:
        return False


def go_offline() -> None:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, also for huggingface_hub and datasets if already imported:
    both read the variables once, at import, so setting them later alone changes nothing."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
        if hasattr(datasets.config, "HF_DATASETS_OFFLINE"):
            datasets.config.HF_DATASETS_OFFLINE = True


def _hub_dataset(cfg: Mapping[str, Any]):
    if cfg.get("path") in (None, "???"):
        raise RelposError("data=hub needs data.path=<dataset id>")
    if os.environ.get("HF_HUB_OFFLINE") != "1" and not hub_reachable():
        # fail fast (no half minute of retries and warnings) and still use a copy in the local HF cache
        go_offline()
    datasets = _datasets()  # after the offline switch: it is read at import
    splits = {"train": cfg["train_split"]}
    if cfg.get("validation_split"):
        splits["validation"] = cfg["validation_split"]
    streaming = bool(cfg.get("streaming"))
    try:
        loaded = {k: datasets.load_dataset(cfg["path"], cfg.get("name"), split=s, streaming=streaming)
                  for k, s in splits.items()}
    except Exception as e:  # datasets raises many types for "not there / not reachable"
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        # a streamed dataset is read from the hub as training data is made, not from a local copy
        where = "data.streaming=true reads it from there" if streaming else "it is not in the local cache"
        reason = f"the Hugging Face hub is unreachable and {where}" if offline else str(e).splitlines()[0]
        raise RelposError(
            f"cannot load dataset {cfg['path']!r}: {reason}; offline choices: data=stdlib, data=text_files data.files=[...]"
        ) from None
    return (datasets.IterableDatasetDict if streaming else datasets.DatasetDict)(loaded), cfg.get("text_field", "text")


def file_sha256(path: str | os.PathLike) -> str:
    """A file's sha256, read a chunk at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_list(files: Any) -> list[str]:
    if files in (None, "???"):
        return []
    return [files] if isinstance(files, str) else [str(f) for f in files]


def text_file_lists(cfg: Mapping[str, Any]) -> dict[str, list[str]]:
    """data.files and data.validation_files (null: none) as lists of paths."""
    lists = {"files": _file_list(cfg.get("files"))}
    if cfg.get("validation_files"):
        lists["validation_files"] = _file_list(cfg["validation_files"])
    return lists


def resolve_data_paths(cfg: Any) -> None:
    """data.files / data.validation_files made absolute in a run config (a DictConfig), so the run
    evaluates and resumes from any working directory."""
    if cfg.data.get("source") != "text_files":
        return
    for key, files in text_file_lists(cfg.data).items():
        cfg.data[key] = [str(Path(f).expanduser().resolve()) for f in files]


def _check_text_files(files: list[str], key: str) -> list[str]:
    if not files:
        raise RelposError(f"data=text_files needs {key}=[file, ...]")
    for f in files:
        p = Path(f)
        if p.is_dir():
            raise RelposError(f"{key}: {f} is a directory; list the text files in it (data.files=[{f}/a.txt,...])")
        if not p.is_file():
            raise RelposError(f"{key}: no such file: {f}")
        if p.stat().st_size == 0:
            raise RelposError(f"{key}: file is empty: {f}")
    return [str(Path(f).resolve()) for f in files]


def first_non_utf8(files: Iterable[str]) -> tuple[str, UnicodeDecodeError] | None:
    """The first file that is not UTF-8 text and its decoding error (datasets' own error hides the file)."""
    import codecs

    for f in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        with open(f, "rb") as handle:
            offset = 0
            try:
                while chunk := handle.read(1 << 20):
                    decoder.decode(chunk)
                    offset += len(chunk)
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as e:
                return f, UnicodeDecodeError(e.encoding, e.object, offset + e.start, offset + e.end, e.reason)
    return None


def _text_files_dataset(cfg: Mapping[str, Any]):
    datasets = _datasets()

    lists = text_file_lists(cfg)
    data_files = {"train": _check_text_files(lists["files"], "data.files")}
    if "validation_files" in lists:
        data_files["validation"] = _check_text_files(lists["validation_files"], "data.validation_files")
    # one document per file: a streamed corpus may exceed RAM, each of its files may not
    streaming = bool(cfg.get("streaming"))
    # datasets keeps its own copy of the files (arrow) keyed by their mtime alone: a file edited in the same
    # second, or with its mtime put back, would be read from that stale copy. This runs only to build relpos's
    # token cache, which is the cache: the copy is always made again from the files as they are now
    fresh = {} if streaming else {"download_mode": "force_redownload"}
    return datasets.load_dataset("text", data_files=data_files, sample_by="document", streaming=streaming,
                                 **fresh), "text"


def _not_utf8_error(cfg: Mapping[str, Any]) -> RelposError | None:
    """A text_files corpus that failed to load because a file is not UTF-8 -> the error naming that file."""
    if cfg.get("source") != "text_files":
        return None
    found = first_non_utf8(f for files in text_file_lists(cfg).values() for f in files)
    if found is None:
        return None
    path, e = found
    return RelposError(
        f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); data=text_files reads UTF-8 text files: "
        f"convert it (e.g. iconv -f latin1 -t utf-8) or leave it out"
    )


# one loader per source the schema names (settings.DATA_SOURCES)
SOURCES = dict(zip(DATA_SOURCES, (_stdlib_dataset, _hub_dataset, _text_files_dataset)))


# ---- cache --------------------------------------------------------------------------------------


def cache_key(cfg: Mapping[str, Any]) -> str:
    """The token cache's folder name: the data settings that change the tokens, defaults added since left out
    (an old cache keeps its name)."""
    ident = {k: v for k, v in cfg.items() if k != "cache_dir" and not (k in ADDED_KEYS and v == ADDED_KEYS[k])}
    ident["format"] = CACHE_FORMAT
    if cfg["source"] == "stdlib":
        ident["python"] = sys.version
        ident["stdlib"] = sysconfig.get_paths()["stdlib"]
    if cfg.get("tokenizer_file"):  # the tokenizer's content, not where the run dir holding it lies
        ident["tokenizer_file"] = hashlib.sha256(Path(cfg["tokenizer_file"]).read_bytes()).hexdigest()
    if cfg["source"] == "text_files":
        files = list(cfg.get("files") or []) + list(cfg.get("validation_files") or [])
        ident["stat"] = [(str(Path(f).resolve()), *_stat(f)) for f in files]
    blob = json.dumps(ident, sort_keys=True, default=str)
    return f"{cfg['source']}-{cfg['tokenizer']}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def _source_files(cfg: Mapping[str, Any]) -> list[str]:
    """The local files a text_files cache is made from (none for other sources)."""
    if cfg["source"] != "text_files":
        return []
    return [str(Path(f).resolve()) for files in text_file_lists(cfg).values() for f in files]


def file_state(path: str | os.PathLike) -> dict[str, Any]:
    """A file's path, size and times: size and mtime an edit can keep (the mtime put back with
    touch -r), its ctime it cannot."""
    s = Path(path).stat()
    return {"path": str(path), "bytes": s.st_size, "mtime_ns": s.st_mtime_ns, "ctime_ns": s.st_ctime_ns}


def file_record(path: str | os.PathLike) -> dict[str, Any]:
    """file_state and the content's sha256, the state taken first: a change while the file is read
    shows as a new ctime next time."""
    return {**file_state(path), "sha256": file_sha256(path)}


def untouched(record: Mapping[str, Any], state: Mapping[str, Any]) -> bool:
    """Whether a file (its file_state now) is as its file_record says without reading it: the same size,
    mtime and ctime (a record written before ctime was kept: size and mtime)."""
    return (state["bytes"] == record["bytes"] and state["mtime_ns"] == record["mtime_ns"]
            and state["ctime_ns"] == record.get("ctime_ns", state["ctime_ns"]))


def holds_other_content(record: Mapping[str, Any], state: Mapping[str, Any]) -> bool:
    """Whether a file that is not untouched holds other content than its record: another size, or
    (read now) another sha256."""
    return state["bytes"] != record["bytes"] or file_sha256(record["path"]) != record["sha256"]


def _changed_source(cache: Path) -> str | None:
    """The first source file whose content is not what the cache was built from (None: all the same).
    A file whose ctime alone moved (restored, chmod, cp -p) is hashed; if its content is the one
    recorded, meta.json takes its new state so that it is not hashed again."""
    meta = json.loads((cache / "meta.json").read_text())
    records, refreshed = meta.get("sources") or [], False  # a cache from before the records: not checked
    for record in records:
        try:
            now = file_state(record["path"])
        except OSError:
            return record["path"]
        if untouched(record, now):
            continue
        if holds_other_content(record, now):
            return record["path"]
        record.update(now)
        refreshed = True
    if refreshed:
        try:
            atomic_write_text(cache / "meta.json", json.dumps(meta, indent=2, default=str))
        except OSError:  # a cache dir shared read-only: hashed again next time, still right
            pass
    return None


def _stat(f: str) -> tuple[int, int]:
    try:
        s = Path(f).stat()
        return s.st_size, s.st_mtime_ns
    except OSError:
        return -1, -1


def _documents(split: Iterable[Mapping[str, Any]], text_field: str) -> Iterator[str]:
    """The non-empty texts of a split, one row at a time (a streamed split is read as it arrives)."""
    return (row[text_field] for row in split if row[text_field])


def _chunks(documents: Iterable[str], chars: int) -> Iterator[list[str]]:
    """Documents in lists closed as soon as they reach `chars` characters: over it by at most the last document."""
    chunk, size = [], 0
    for doc in documents:
        chunk.append(doc)
        size += len(doc)
        if size >= chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _tail_cut(n_tokens: int, fraction: float) -> int:
    """Where the held-out validation tail starts when a source has no validation split."""
    return int(n_tokens * (1 - fraction))


def _save_array(path: Path, array: np.ndarray) -> None:
    with atomic_writer(path) as f:  # streamed: a token array is written without a copy of it in memory
        np.save(f, array)


def _check_counts(counts: Mapping[str, int], source: str, val_fraction: float | None) -> None:
    """Each split holds text (more than its end token). val_fraction: validation is the train tokens' tail."""
    for name in ("train", "validation"):
        if counts[name] >= 2:
            continue
        if name == "validation" and val_fraction is not None and counts["train"] >= 2:
            total = counts["train"] + counts["validation"]
            raise RelposError(
                f"the validation split of data={source}, the last data.val_fraction={val_fraction} of its "
                f"{total:,} tokens, holds {counts[name]} token(s): give more text, a larger data.val_fraction, "
                f"or a validation split of its own"
            )
        raise RelposError(f"the {name} split of data={source} has no text")


def _write_in_memory(
    cache: Path, dsets: Mapping[str, Any], text_field: str, tokenizer: Tokenizer, dtype: type, val_fraction: float,
    check: Callable[[dict[str, int]], None],
) -> dict[str, int]:
    """Each split tokenized whole, checked (before anything is written) and saved as <split>.npy;
    returns the token count per split."""
    splits = {name: tokenizer.encode_documents(dsets[name][text_field]) for name in dsets}
    if "validation" not in splits:
        cut = _tail_cut(len(splits["train"]), val_fraction)
        splits["train"], splits["validation"] = splits["train"][:cut], splits["train"][cut:]
    check({name: len(tokens) for name, tokens in splits.items()})
    for name, tokens in splits.items():
        _save_array(cache / f"{name}.npy", tokens.astype(dtype))
    return {name: len(tokens) for name, tokens in splits.items()}


def _stream_tokens(out: BinaryIO, tokenizer: Tokenizer, documents: Iterable[str], dtype: type) -> int:
    """Tokenize chunk by chunk, appending raw tokens to `out`; returns how many were written."""
    written = 0
    for chunk in _chunks(documents, STREAM_CHUNK_CHARS):
        ids = tokenizer.encode_documents(chunk).astype(dtype)
        out.write(ids.tobytes())
        written += len(ids)
    return written


def _write_streamed(
    cache: Path, dsets: Mapping[str, Any], text_field: str, tokenizer: Tokenizer, dtype: type, val_fraction: float,
    check: Callable[[dict[str, int]], None],
) -> dict[str, int]:
    """Each split streamed into <split>.bin, then checked; returns the token count per split."""
    counts = {}
    if "validation" in dsets:
        with atomic_writer(cache / "validation.bin") as out:
            counts["validation"] = _stream_tokens(out, tokenizer, _documents(dsets["validation"], text_field), dtype)
    with atomic_writer(cache / "train.bin") as out:
        counts["train"] = _stream_tokens(out, tokenizer, _documents(dsets["train"], text_field), dtype)
        if "validation" not in dsets:
            # move the tail into validation.bin on disk, before train.bin takes its name
            cut = _tail_cut(counts["train"], val_fraction)
            out.seek(cut * np.dtype(dtype).itemsize)
            with atomic_writer(cache / "validation.bin") as val:
                shutil.copyfileobj(out, val)
            out.truncate(cut * np.dtype(dtype).itemsize)
            counts["train"], counts["validation"] = cut, counts["train"] - cut
        check(counts)  # a split without text: train.bin is not left behind
    return counts


def _open_split(cache: Path, name: str, streaming: bool, dtype: type) -> np.ndarray:
    if streaming:
        return np.memmap(cache / f"{name}.bin", dtype=dtype, mode="r")
    return np.load(cache / f"{name}.npy", mmap_mode="r")


def _byte_count(tokens: np.ndarray, token_bytes: np.ndarray, chunk: int = 1 << 22) -> int:
    """UTF-8 bytes a token stream stands for, read in chunks so a memmap never comes into RAM whole."""
    return sum(int(token_bytes[tokens[i : i + chunk]].sum()) for i in range(0, len(tokens), chunk))


def _open_tokenizer(cfg: Mapping[str, Any], cache: Path) -> Tokenizer:
    if cfg["tokenizer"] == "hf":
        return HfTokenizer.load(Path(cfg["tokenizer_file"]), cfg["eos_token"])
    return BpeTokenizer.load(cache / TOKENIZER_FILE) if cfg["tokenizer"] == "bpe" else ByteTokenizer()


def _build_cache(cfg: Mapping[str, Any], cache: Path) -> None:
    try:
        _write_cache(cfg, cache)
    except Exception as e:  # datasets wraps a decoding error in its own type, or raises it while streaming
        if isinstance(e, (RelposError, OSError)):
            raise
        not_utf8 = _not_utf8_error(cfg)
        if not_utf8 is None:
            raise
        raise not_utf8 from None


def _write_cache(cfg: Mapping[str, Any], cache: Path) -> None:
    """Read the source, (bpe) learn the tokenizer from its train split, write the token files, then meta.json."""
    if cfg["source"] == "text_files":  # each file there and not empty, before it is hashed
        for key, files in text_file_lists(cfg).items():
            _check_text_files(files, f"data.{key}")
    sources = [file_record(f) for f in _source_files(cfg)]  # before the files are read
    dsets, text_field = SOURCES[cfg["source"]](cfg)
    if cfg["tokenizer"] == "bpe" and not (cache / TOKENIZER_FILE).is_file():
        # from the train split only; where validation is its tail (no validation split), that tail is seen too
        BpeTokenizer.train(_documents(dsets["train"], text_field), cfg["vocab_size"]).save(cache / TOKENIZER_FILE)
    tokenizer = _open_tokenizer(cfg, cache)
    if cfg["tokenizer"] == "bpe" and tokenizer.vocab_size < cfg["vocab_size"]:
        print_note(f"the BPE learnt from the train split has {tokenizer.vocab_size:,} tokens, fewer than "
                   f"data.vocab_size={cfg['vocab_size']:,}: its text has no more pairs to merge; the model's "
                   f"vocabulary is {tokenizer.vocab_size:,}")
    dtype, streaming = _dtype_for(tokenizer.vocab_size), bool(cfg.get("streaming"))
    write = _write_streamed if streaming else _write_in_memory
    held_out = "validation" not in dsets
    val_fraction = cfg.get("val_fraction", 0.05)
    counts = write(cache, dsets, text_field, tokenizer, dtype, val_fraction,
                   lambda counts: _check_counts(counts, cfg["source"], val_fraction if held_out else None))
    # documents + one separator byte each: what bits per byte divide by, the same for every tokenizer
    n_bytes = {name: _byte_count(_open_split(cache, name, streaming, dtype), tokenizer.token_bytes) for name in counts}
    meta = {"vocab_size": tokenizer.vocab_size, "tokens": counts, "bytes": n_bytes, "config": dict(cfg)}
    if sources:
        meta["sources"] = sources
    # written last: marks the cache complete
    atomic_write_text(cache / "meta.json", json.dumps(meta, indent=2, default=str))


def load_token_data(cfg: Mapping[str, Any]) -> TokenData:
    """Token streams for the configured source, from the cache or built now and cached. A cache that
    does not open as meta.json describes it (truncated, half deleted) is said so and rebuilt."""
    check_data_config(cfg)
    cache = Path(os.path.expanduser(str(cfg["cache_dir"]))) / cache_key(cfg)
    if not (cache / "meta.json").exists():
        _build_cache(cfg, cache)
        return _open_cache(cfg, cache)
    try:
        data = _open_cache(cfg, cache)
    except CorruptCache as e:
        print_note(f"token cache {cache} is corrupt ({e}); rebuilding it")
        for f in cache.iterdir():  # the tokenizer too if it is the broken part: it is learnt again
            if f.name != TOKENIZER_FILE or TOKENIZER_FILE in str(e):
                f.unlink(missing_ok=True)
        _build_cache(cfg, cache)
        return _open_cache(cfg, cache)
    changed = _changed_source(cache)
    if changed is None:
        return data
    print_note(f"token cache {cache} was built from an earlier version of {changed} (same size and mtime); "
               f"rebuilding it")
    for name in ("meta.json", TOKENIZER_FILE):  # a BPE learnt from the old text is learnt again
        (cache / name).unlink(missing_ok=True)
    _build_cache(cfg, cache)
    return _open_cache(cfg, cache)


class CorruptCache(Exception):
    pass


def _open_cache(cfg: Mapping[str, Any], cache: Path) -> TokenData:
    streaming = bool(cfg.get("streaming"))
    try:
        tokenizer = _open_tokenizer(cfg, cache)
    except Exception as e:  # tokenizers raises a bare Exception for a broken file
        if isinstance(e, OSError) and e.errno not in (None, errno.ENOENT):
            raise
        raise CorruptCache(f"{TOKENIZER_FILE} unreadable") from None
    try:
        meta = json.loads((cache / "meta.json").read_text())
        dtype = _dtype_for(meta["vocab_size"])
        splits = {name: _open_split(cache, name, streaming, dtype) for name in ("train", "validation")}
    except (ValueError, KeyError, TypeError, EOFError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (None, errno.ENOENT):
            raise  # a permission or disk problem: rebuilding would not help
        raise CorruptCache(str(e).splitlines()[0][:100] if str(e) else type(e).__name__) from None
    for name, tokens in splits.items():
        if len(tokens) != meta["tokens"][name]:
            raise CorruptCache(f"{name} has {len(tokens):,} tokens, meta.json says {meta['tokens'][name]:,}")
    return TokenData(splits["train"], splits["validation"], meta["vocab_size"], cache, tokenizer.token_bytes, tokenizer)


def _dtype_for(vocab_size: int):
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32


def corpus_tokenizer(cfg: Mapping[str, Any], data: TokenData) -> Tokenizer:
    """The tokenizer that made `data` (loaded with `cfg`, the same data config): tasks write their text with it."""
    return _open_tokenizer(cfg, data.cache_dir)
