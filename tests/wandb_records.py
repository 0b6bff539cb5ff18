"""Read an offline W&B run's records (run-<id>.wandb: W&B's LevelDB-log format of protobuf records),
so tests can check what `wandb sync` would upload without a network."""

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7  # ":W&B" + magic (2 bytes) + version (1 byte); records: crc (4) + length (2) + type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        else:
            pending = (pending if kind == MIDDLE else b"") + chunk


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


class OfflineRun:
    """The history rows, summary, config, metric definitions and tags of one offline run dir."""

    def __init__(self, run_dir: Path):
        (self.file,) = Path(run_dir).glob("run-*.wandb")
        self.history, self.summary, self.config, self.metrics, self.run = [], {}, {}, {}, None
        for r in records(self.file):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                self.history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
            elif kind == "summary":
                self.summary.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
            elif kind == "config":
                self.config.update({_key(i): json.loads(i.value_json) for i in r.config.update})
            elif kind == "metric":
                self.metrics[r.metric.name or r.metric.glob_name] = r.metric
            elif kind == "run":
                self.run = r.run
                self.config.update({_key(i): json.loads(i.value_json) for i in r.run.config.update})

    def column(self, key: str) -> list:
        return [row[key] for row in self.history if key in row]

    def scalars(self) -> tuple[dict[str, list], dict[str, float]]:
        """(every numeric history key: its values in logging order; every numeric summary key: its value),
        W&B's own keys (_step, _runtime) and the fields of logged tables and images left out."""
        history = {}
        for row in self.history:
            for key, value in numeric(row).items():
                history.setdefault(key, []).append(value)
        return history, numeric(self.summary)


def numeric(items: dict) -> dict:
    """The numbers among flattened `items`, without W&B's own keys (`_step`, `_wandb/runtime`) and without
    the fields of a logged table or image (`eval_length/nrows` beside `eval_length/_type`)."""
    media = {key.rsplit("/", 1)[0] for key in items if key.endswith("/_type")}
    return {key: value for key, value in items.items() if not key.startswith("_") and key.rsplit("/", 1)[0] not in media
            and isinstance(value, (int, float)) and not isinstance(value, bool)}
