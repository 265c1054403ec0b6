"""The public API's ``Example:`` blocks run as written, and docstrings cite only this repo."""

import doctest
import pathlib
import re
import tempfile
import tokenize

import pytest

import gmjax
from gmjax.mail import pace

PACKAGE = pathlib.Path(gmjax.__file__).parent

# Each of these carries an ``Example:`` block in its own docstring.
EXAMPLES = {
    "gmjax.DiLoCo": gmjax.DiLoCo,
    "gmjax.diloco": gmjax.diloco,
    "gmjax.encode": gmjax.encode,
    "gmjax.decode": gmjax.decode,
    "gmjax.mail.create": gmjax.mail.create,
    "gmjax.mail.Run.join": gmjax.mail.Run.join,
    "gmjax.mail.Learner.restore": gmjax.mail.Learner.restore,
    "gmjax.mail.pace.fastest": pace.fastest,
}
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Phrases that point at documents this repository does not hold.
OUTSIDE_REFERENCES = (
    re.compile(r"section\s+\d+\s+of\s+the\s+spec", re.I),
    re.compile(r"\bspecification\b", re.I),
    re.compile(r"\bSPEC\b"),
    re.compile(r"\bspec\.md\b", re.I),
    re.compile(r"\bseed's\b", re.I),
    re.compile(r"\bthe\s+seed\b(?!\s+(?:of|for|value)\b)", re.I),
    re.compile(r"gradient\s*mail", re.I),
)


def run_examples(name: str, obj) -> tuple[doctest.TestResults, str]:
  """Runs every example in ``obj``'s docstrings (its methods' too); the runner's report."""
  tests = doctest.DocTestFinder().find(obj, name, globs={})
  own = [t for t in tests if t.name == name]
  assert own and own[0].examples, f"{name} has no Example: block in its docstring"
  runner = doctest.DocTestRunner(optionflags=OPTIONS)
  report = []
  for test in tests:
    runner.run(test, out=report.append)
  return runner.summarize(verbose=False), "".join(report)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, tmp_path, monkeypatch):
  # The mail examples make their runs with tempfile.mkdtemp(): keep them in tmp_path.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  assert "Example:" in EXAMPLES[name].__doc__, name
  results, report = run_examples(name, EXAMPLES[name])
  assert results.attempted > 0, name
  assert results.failed == 0, f"{name}'s example failed:\n{report}"


def test_a_wrong_expected_output_fails():
  def example():
    """Adds.

    Example:
      >>> 1 + 1
      3
    """

  results, report = run_examples("example", example)
  assert results.failed == 1, report
  assert "Expected:\n    3\nGot:\n    2" in report


def docs_and_comments(path: pathlib.Path):
  """``(line, text)`` of every comment and string literal (docstrings included) in ``path``."""
  with tokenize.open(path) as source:
    for token in tokenize.generate_tokens(source.readline):
      if token.type in (tokenize.COMMENT, tokenize.STRING):
        yield token.start[0], token.string


def outside_references(path: pathlib.Path) -> list[str]:
  found = []
  for line, text in docs_and_comments(path):
    for pattern in OUTSIDE_REFERENCES:
      for match in pattern.finditer(text):
        at = line + text.count("\n", 0, match.start())
        found.append(f"{path}:{at}: {match.group(0)!r}")
  return found


def test_docstrings_cite_only_this_repository():
  found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in outside_references(path)]
  assert not found, ("docstrings and comments must say the thing itself or point into this"
                     " repository (README.md sections, modules):\n" + "\n".join(found))


@pytest.mark.parametrize("text", [
    "# Its JSON is the wire format of section 6 of the specification.",
    '"""These keep the semantics of the gradientmail algorithms module."""',
    "# The seed's Algorithm protocol.",
    "# As SPEC says.",
])
def test_outside_reference_is_found(tmp_path, text):
  probe = tmp_path / "probe.py"
  probe.write_text(f"seed = 0\n{text}\nspec = seed\n")
  assert {hit.split(": ")[0] for hit in outside_references(probe)} == {f"{probe}:2"}
