"""Files many processes share in a run folder: a status written by several writers at once, and the
per-process names of the status, telemetry and metrics files."""

from __future__ import annotations

import json
import threading

from rollway.base.files import write_json_atomic


def test_writers_of_one_json_file_at_once_each_publish_a_whole_file(tmp_path):
    """Seen in a compose job: every stage container is pid 1, so three agent workers wrote one status file,
    and through one shared temporary name a writer's rename found its file gone (FileNotFoundError ended
    the worker, and compose ended the job). Eight threads writing one path 300 times each: no error, and
    the file read at any moment holds one writer's whole document."""
    path = tmp_path / "agent-1.json"
    errors: list[BaseException] = []
    seen: list[dict] = []

    def write(k: int) -> None:
        try:
            for i in range(300):
                write_json_atomic(path, {"writer": k, "i": i, "pad": "x" * 2000})
        except BaseException as exc:  # noqa: BLE001 - the finding
            errors.append(exc)

    def read() -> None:
        while any(t.is_alive() for t in writers):
            if path.exists():
                seen.append(json.loads(path.read_text()))

    writers = [threading.Thread(target=write, args=(k,)) for k in range(8)]
    for t in writers:
        t.start()
    reader = threading.Thread(target=read)
    reader.start()
    for t in writers:
        t.join()
    reader.join()
    assert not errors, errors[:3]
    assert all(set(d) == {"writer", "i", "pad"} for d in seen)
    assert [p.name for p in path.parent.iterdir()] == ["agent-1.json"]  # no temporary file left behind
