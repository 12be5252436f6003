"""Small file helpers shared by the stages."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any, indent: int | None = None) -> None:
    """Write JSON through a temporary file and a rename, so a reader (`rollway up` polling status
    files) never sees a half-written file. The temporary file is the writer's own: two writers of one
    path (threads, or processes sharing a run folder) each rename a whole file, the last one wins."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=indent))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def publish_dir(dest: Path, fill: Callable[[Path], Path]) -> Path:
    """`dest`, made once: `fill(scratch)` builds the folder inside a scratch folder beside `dest` and
    returns it, and a rename publishes it whole, so processes racing here all see a complete folder (the
    loser's copy is dropped). An existing `dest` is returned as it is."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".publish-"))
    try:
        built = fill(scratch)
        try:
            os.rename(built, dest)
        except OSError:
            if not dest.is_dir():  # another process won the race; anything else is a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest
