"""README.md's Python snippet, as the README holds it."""

import re
from pathlib import Path


def test_the_readme_snippet_runs_as_written():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - the documented code itself
    q = scope["q"]
    assert tuple(q.rowwise_data.shape) == (4096, 2560) and tuple(q.columnwise_data.shape) == (5120, 2048)
    assert 0.05 < float(scope["err"]) < 0.15  # "about 0.1 for Gaussian data"
