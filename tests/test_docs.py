"""The documentation's examples marked ``<!-- test -->`` run (in the simulator without a GPU)."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
EXAMPLES = [
    pytest.param(code, id=f"{page.name}#{i}")
    for page in sorted(DOCS.glob("*.md"))
    for i, code in enumerate(re.findall(r"<!-- test -->\n```python\n(.*?)```", page.read_text(), re.S))
]


@pytest.mark.sim
@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code):
    exec(compile(code, "<docs example>", "exec"), {"__name__": "__docs__"})


def test_examples_were_found():
    assert len(EXAMPLES) >= 3
