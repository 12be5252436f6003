"""The extension examples of docs/extending.md are the files in examples/extending/, verbatim, and each one runs."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import ROOT
from jobs import run_with_progress

EXAMPLES = sorted((ROOT / "examples" / "extending").glob("*.py"))
BLOCK = re.compile(r"<!-- file: (\S+) -->\n```python\n(.*?)```\n", re.S)


def page_blocks() -> dict[str, str]:
    return dict(BLOCK.findall((ROOT / "docs" / "extending.md").read_text()))


def test_extending_page_shows_every_example_verbatim():
    blocks = page_blocks()
    assert sorted(blocks) == [f"examples/extending/{p.name}" for p in EXAMPLES]
    assert {"custom_tool.py", "custom_taskset.py", "custom_sandbox.py", "custom_reward.py"} <= {p.name for p in EXAMPLES}
    for name, text in blocks.items():
        assert text == (ROOT / name).read_text(), f"docs/extending.md block for {name} differs from the file"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path):
    out = run_with_progress([sys.executable, str(path.relative_to(ROOT))], cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
