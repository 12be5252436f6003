"""A durable, bounded record of the messages a stage has handled, per input partition, so a
restarted worker (or the next owner of a partition on this machine) recognises redelivered and
duplicate messages and re-emits what it emitted the first time instead of redoing side effects.

Layout: one file per input partition in a folder of the run folder, `<topic>-<partition>.jsonl`,
one line per handled message: {"k": key, "o": offset, "r": result (base64) or null}, or {"o": offset}
for a message handled without a key to remember (skipped, failed, a duplicate). When a file holds
more than twice `window` entries it is compacted: the newest `window` entries stay, and the offsets
of the dropped ones join the partition's handled ranges (the first line, {"handled": [[lo, hi], ...]}).

Why that is enough: Kafka redelivers only offsets at or after the group's committed offset, and a
worker commits soon after it produces; an entry `window` messages old was produced long ago, so a
redelivered offset inside a handled range is known handled without its key. A duplicate at a new
offset (an upstream worker that crashed after producing re-produces the same message) follows its
original closely, so it is still in the window.

Ranges, not one watermark: a slow message at offset k (a long grading, or one queued by prefetch)
may still be unhandled while thousands after it finish. A watermark past k (the highest offset
dropped) made a redelivered k look handled, and it vanished until its deadline. A range covers only
offsets that were handled, so k stays outside every range until it is. Ranges split only at offsets
not yet handled here, so there are few; past `window` of them the lowest go (forgetting an offset is
safe: at worst a message long since committed is handled again; remembering one never handled is not).

Writes are flushed (not fsynced): they survive a killed process, not a crashed machine. Only the
partition's current owner appends; another process that takes the partition over reads what was
appended since it last looked (the file grew) or the whole file again (it was compacted).
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rollway.runtime.actor import MessageMeta


@dataclass(frozen=True)
class Seen:
    """A message already handled: `result` is what was emitted for it (None: not kept)."""

    result: bytes | None


class HandledRanges:
    """Disjoint, sorted, inclusive [lo, hi] offset ranges; at most `limit` (the lowest go first)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.ranges: list[list[int]] = []

    def __contains__(self, offset: int) -> bool:
        i = bisect.bisect_right(self.ranges, [offset, float("inf")]) - 1
        return i >= 0 and self.ranges[i][0] <= offset <= self.ranges[i][1]

    def add(self, lo: int, hi: int | None = None) -> None:
        hi = lo if hi is None else hi
        i = bisect.bisect_left(self.ranges, [lo, lo])
        if i > 0 and self.ranges[i - 1][1] >= lo - 1:  # touches the range before
            i -= 1
        j = i
        while j < len(self.ranges) and self.ranges[j][0] <= hi + 1:  # every range it touches merges
            lo, hi = min(lo, self.ranges[j][0]), max(hi, self.ranges[j][1])
            j += 1
        self.ranges[i:j] = [[lo, hi]]
        del self.ranges[: max(0, len(self.ranges) - self.limit)]


class PartitionLog:
    """The ledger of one input partition: a bounded window of keys (and their results) plus the
    ranges of offsets known handled (see the module docstring)."""

    def __init__(self, path: Path, window: int):
        self.path, self.window = path, window
        self.entries: OrderedDict[str, tuple[int, bytes | None]] = OrderedDict()
        self.key_at: dict[int, str] = {}
        """The key recorded at each offset of the window: a different key at a handled offset is a
        different message (a topic deleted and made again restarts its offsets), not a redelivery."""
        self.handled = HandledRanges(window)
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
            self.key_at.clear()
            self.handled = HandledRanges(self.window)
            self.lines, self._read_bytes = 0, 0
        with open(self.path, "rb") as f:
            f.seek(self._read_bytes)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line cut short by a kill is ignored
        for line in complete.splitlines():
            self._take(json.loads(line))
        self._read_bytes += len(complete)
        self._stamp = (st.st_ino, self._read_bytes)

    def _take(self, row: dict) -> None:
        if "watermark" in row:  # a file from before handled ranges: everything up to it
            if row["watermark"] >= 0:
                self.handled.add(0, row["watermark"])
            return
        if "handled" in row:
            for lo, hi in row["handled"]:
                self.handled.add(lo, hi)
            return
        self.handled.add(row["o"])
        self.lines += 1
        if row.get("k") is None:
            return
        result = base64.b64decode(row["r"]) if row.get("r") is not None else None
        self.entries[row["k"]] = (row["o"], result)
        self.entries.move_to_end(row["k"])
        self.key_at[row["o"]] = row["k"]

    def get(self, key: str, offset: int) -> Seen | None:
        if key in self.entries:
            return Seen(self.entries[key][1])
        return Seen(None) if offset in self.handled and self.key_at.get(offset, key) == key else None

    def add(self, key: str | None, offset: int, result: bytes | None) -> None:
        """Append one handled message (`key` None: only its offset is remembered)."""
        if key is None:
            row: dict = {"o": offset}
        else:
            row = {"k": key, "o": offset, "r": base64.b64encode(result).decode() if result is not None else None}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write(json.dumps(row).encode() + b"\n")
            f.flush()
            size = f.tell()
        self._read_bytes = size
        self._stamp = (os.stat(self.path).st_ino, size)
        self._take(row)
        if self.lines > 2 * self.window:
            self.compact()

    def compact(self) -> None:
        """Keep the newest `window` entries; every handled offset stays known through the ranges."""
        while len(self.entries) > self.window:
            self.entries.popitem(last=False)  # its offset is in `handled` already
        self.key_at = {offset: key for key, (offset, _) in self.entries.items()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps({"handled": self.handled.ranges}).encode() + b"\n")
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

    @contextlib.contextmanager
    def handling(self, meta: MessageMeta) -> Iterator[None]:
        """Around a whole `handle`: when it returns, `meta`'s offset counts as handled even where
        nothing was recorded (a skip, a replay), so the handled ranges stay few. One that raised
        stays unhandled: a redelivery (its failure output may never have reached the broker)
        handles it again rather than vanish; so does a cancelled one."""
        log = self._log(meta)
        yield
        self._mark(log, meta.offset)

    @staticmethod
    def _mark(log: PartitionLog, offset: int) -> None:
        log.refresh()
        if offset not in log.handled:
            log.add(None, offset, None)

    def size(self) -> int:
        """Keys held in memory over every partition (bounded by partitions x 2 x window)."""
        return sum(len(log.entries) for log in self.logs.values())
