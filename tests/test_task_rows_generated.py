"""A hostile rows file's fields, generated: SWE-bench, SWE-smith and R2E-Gym rows (the R2E commit in its
structured form) with fields at any depth replaced by values of other types, deleted or repeated
(tests/generated.py). Every row either loads, its fields checked, or is refused with RowError or
TaskDataError naming the row: never a TypeError, KeyError or a bare JSON error that names nothing. Real rows
and the real loader; nothing is faked."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import generated
import pytest
from test_swebench_tasks import R2E_COMMIT

from rollway.envs.swe_rows import RowError, normalise_row
from rollway.envs.task_data import TaskDataError

BUG = "diff --git a/w.py b/w.py\n--- a/w.py\n+++ b/w.py\n@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n"
ROWS: dict[str, dict[str, Any]] = {
    "swebench": {"instance_id": "owner__name-1", "repo": "owner/name", "base_commit": "a" * 40,
                 "environment_setup_commit": "b" * 40, "problem_statement": "p", "patch": BUG, "test_patch": "",
                 "FAIL_TO_PASS": '["t.py::a"]', "PASS_TO_PASS": ["t.py::b"], "version": "1.0", "hints_text": "h",
                 "repo_dir": "/testbed", "log_parser": "pytest", "test_command": "pytest", "install": "pip install ."},
    "swe-smith": {"instance_id": "acme__widgets.1234abcd.func_pm__x", "repo": "swesmith/acme__widgets.1234abcd",
                  "patch": BUG, "FAIL_TO_PASS": ["t::a"], "PASS_TO_PASS": ["t::b"],
                  "image_name": "swesmith.x86_64.acme", "problem_statement": "y is wrong"},
    "r2e-gym": {"repo_name": "widgets", "docker_image": "namanjain12/widgets_final:c0ffee", "commit_hash": "c" * 40,
                "problem_statement": "p", "parsed_commit_content": R2E_COMMIT,
                "expected_output_json": json.dumps({"t::a": "PASSED", "t::b": "FAILED"})},
}
KEYS = ["instance_id", "repo", "base_commit", "FAIL_TO_PASS", "patch", "path", "header", "file", "hunks", "type",
        "content", "descriptor", "old_range", "start", "length", "old_commit_hash", "file_diffs", "line_group"]


@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_generated_rows_load_or_are_refused_by_name(fmt):
    for form in ("auto", fmt):
        assert normalise_row(ROWS[fmt], form).source_format == fmt  # the seed row itself is valid
    rng = random.Random(2026)
    loaded = refused = 0
    crashes: list[str] = []
    for n in range(600):
        row = generated.mutated(ROWS[fmt], rng, keys=KEYS)
        try:
            normalise_row(row, rng.choice(("auto", fmt)))
            loaded += 1
        except (RowError, TaskDataError) as err:
            refused += 1
            assert "row" in str(err) or "task" in str(err), str(err)  # names the row
        except Exception as err:  # noqa: BLE001 - any other exception is the finding
            crashes.append(f"row {n}: {type(err).__name__}: {err} for {json.dumps(row, default=repr)[:300]}")
    assert not crashes, "\n".join(crashes[:10])
    assert loaded >= 60 and refused >= 60, (loaded, refused)


@pytest.mark.parametrize(("name", "content", "says"), [
    ("rows.jsonl", b'{"instance_id": "a"}\n{bad\n', "rows.jsonl line 2 is not valid JSON"),
    ("rows.jsonl", b'{"instance_id": "a"}\n\xff\xfe\n', "rows.jsonl is not UTF-8 text"),
    ("rows.json", b'{"instance_id": "a"}', "rows.json must hold a JSON list of rows"),
])  # fmt: skip
def test_a_rows_file_that_is_not_json_lines_is_refused_naming_file_and_line(tmp_path, name, content, says):
    """A bare JSONDecodeError or UnicodeDecodeError named neither the file nor the line."""
    from rollway.envs.swe import load_instances
    from rollway.envs.swe_rows import read_rows

    path = tmp_path / name
    path.write_bytes(content)
    readers = (read_rows, load_instances) if name.endswith(".jsonl") else (read_rows,)
    for read in readers:
        with pytest.raises((RowError, TaskDataError), match=re.escape(says)):
            read(path)
