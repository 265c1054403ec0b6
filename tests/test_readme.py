"""The README's Python examples run as written."""

import pathlib
import re
import subprocess
import sys

import pytest

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_examples():
  assert len(BLOCKS) >= 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
  script = tmp_path / f"example_{index}.py"
  script.write_text(BLOCKS[index])
  result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=280, check=False)
  assert result.returncode == 0, f"README example {index} failed:\n{BLOCKS[index]}\n{result.stderr[-3000:]}"
