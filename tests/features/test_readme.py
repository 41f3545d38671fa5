"""README.md's API example runs as written, on the tiny target that ships in the package."""

import re

from selfspec.from_config.common import REPO_ROOT


def test_the_readme_api_example_runs_as_written(capsys):
    readme = (REPO_ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    assert "tensor(" in printed  # the verifier's accepted tokens were printed
