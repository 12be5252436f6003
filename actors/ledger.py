"""A durable, bounded record of the messages a stage has handled, per input partition, so a
restarted worker (or the next owner of a partition on this machine) recognises redelivered and
duplicate messages and re-emits what it emitted the first time instead of redoing side effects.

Layout: one file per input partition in a folder of the run folder, `<topic>-<partition>.jsonl`,
one line per handled message: {"k": key, "o": offset, "r": result (base64) or null}. When a file
holds more than twice `window` entries it is compacted: the newest `window` entries stay, and the
highest offset dropped becomes the partition's watermark (the first line, {"watermark": N}).

Why that is enough: Kafka redelivers only offsets at or after the group's committed offset, and a
worker commits soon after it produces; an entry `window` messages old was produced long ago, so a
redelivered offset at or below the watermark is known handled without its key. A duplicate at a
new offset (an upstream worker that crashed after producing re-produces the same message) follows
its original closely, so it is still in the window.

Writes are flushed (not fsynced): they survive a killed process, not a crashed machine. Only the
partition's current owner appends; another process that takes the partition over reads what was
appended since it last looked (the file grew) or the whole file again (it was compacted).
"""

from __future__ import annotations

import base64
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from rollway.actors.base import MessageMeta


@dataclass(frozen=True)
class Seen:
    """A message already handled: `result` is what was emitted for it (None: not kept)."""

    result: bytes | None


class PartitionLog:
    """The ledger of one input partition: a bounded window of keys (and their results) plus the
    watermark below which every offset is known handled."""

    def __init__(self, path: Path, window: int):
        self.path, self.window = path, window
        self.entries: OrderedDict[str, tuple[int, bytes | None]] = OrderedDict()
        self.watermark = -1
        self.lines = 0
        self._stamp: tuple[int, int] | None = None  # (inode, size) of the file as last read or written
        self._read_bytes = 0

    def refresh(self) -> None:
        """Take in what another process appended (or rewrote) since this one last looked."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if self._stamp == (st.st_ino, st.st_size):
            return
        if self._stamp is None or self._stamp[0] != st.st_ino or st.st_size < self._read_bytes:
            self.entries.clear()
            self.watermark, self.lines, self._read_bytes = -1, 0, 0
        with open(self.path, "rb") as f:
            f.seek(self._read_bytes)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line cut short by a kill is ignored
        for line in complete.splitlines():
            self._take(json.loads(line))
        self._read_bytes += len(complete)
        self._stamp = (st.st_ino, self._read_bytes)

    def _take(self, row: dict) -> None:
        if "watermark" in row:
            self.watermark = max(self.watermark, row["watermark"])
            return
        result = base64.b64decode(row["r"]) if row.get("r") is not None else None
        self.entries[row["k"]] = (row["o"], result)
        self.entries.move_to_end(row["k"])
        self.lines += 1

    def get(self, key: str, offset: int) -> Seen | None:
        if key in self.entries:
            return Seen(self.entries[key][1])
        return Seen(None) if offset <= self.watermark else None

    def add(self, key: str, offset: int, result: bytes | None) -> None:
        row = {"k": key, "o": offset, "r": base64.b64encode(result).decode() if result is not None else None}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write(json.dumps(row).encode() + b"\n")
            f.flush()
            size = f.tell()
        self.entries[key] = (offset, result)
        self.entries.move_to_end(key)
        self.lines += 1
        self._read_bytes = size
        self._stamp = (os.stat(self.path).st_ino, size)
        if self.lines > 2 * self.window:
            self.compact()

    def compact(self) -> None:
        """Keep the newest `window` entries; the highest offset dropped joins the watermark."""
        while len(self.entries) > self.window:
            _, (offset, _) = self.entries.popitem(last=False)
            self.watermark = max(self.watermark, offset)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps({"watermark": self.watermark}).encode() + b"\n")
            for key, (offset, result) in self.entries.items():
                r = base64.b64encode(result).decode() if result is not None else None
                f.write(json.dumps({"k": key, "o": offset, "r": r}).encode() + b"\n")
            f.flush()
        tmp.replace(self.path)
        st = os.stat(self.path)
        self.lines, self._read_bytes, self._stamp = len(self.entries), st.st_size, (st.st_ino, st.st_size)


class Ledger:
    """Per-partition logs under `folder` (see the module docstring); `window` entries per partition."""

    def __init__(self, folder: Path, window: int):
        self.folder, self.window = Path(folder), window
        self.logs: dict[tuple[str, int], PartitionLog] = {}

    def _log(self, meta: MessageMeta) -> PartitionLog:
        key = (meta.topic, meta.partition)
        if key not in self.logs:
            self.logs[key] = PartitionLog(self.folder / f"{meta.topic}-{meta.partition}.jsonl", self.window)
        log = self.logs[key]
        log.refresh()
        return log

    def seen(self, key: str, meta: MessageMeta) -> Seen | None:
        """What this stage recorded for `key` (or knows of `meta`'s offset); None: not handled yet."""
        return self._log(meta).get(key, meta.offset)

    def record(self, key: str, meta: MessageMeta, result: bytes | None = None) -> None:
        """Remember that `key` (at `meta`'s offset) was handled, with what was emitted for it."""
        self._log(meta).add(key, meta.offset, result)

    def size(self) -> int:
        """Keys held in memory over every partition (bounded by partitions x 2 x window)."""
        return sum(len(log.entries) for log in self.logs.values())
