"""No name is used that nothing defines: pyflakes over the package, the benchmarks and the tests. A renamed variable
left behind in a rarely taken branch (an error path, a CLI flag) is a NameError only the day that branch runs;
session 39's `tokens` -> `n_tokens` rename left two, found by hand."""
from __future__ import annotations

from pathlib import Path

import pyflakes.api
import pyflakes.messages as found
from pyflakes.reporter import Reporter

import swarmlm

REPO = Path(swarmlm.__file__).parent.parent
BROKEN = (found.UndefinedName, found.UndefinedLocal, found.UndefinedExport, found.DuplicateArgument,
          found.ReturnOutsideFunction)


class Collect(Reporter):
    def __init__(self) -> None:
        self.messages: list = []
        self.errors: list[str] = []

    def flake(self, message) -> None:
        self.messages.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.errors.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:
        self.errors.append(f"{filename}: {msg}")


def test_every_name_used_is_defined():
    report = Collect()
    for folder in ("swarmlm", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            pyflakes.api.checkPath(str(path), report)
    broken = [str(m) for m in report.messages if isinstance(m, BROKEN)]
    assert not report.errors and not broken, "\n".join(report.errors + broken)


def test_the_check_sees_an_undefined_name(tmp_path):
    sample = tmp_path / "renamed.py"
    sample.write_text("def f(n_tokens):\n    return tokens\n")
    report = Collect()
    pyflakes.api.checkPath(str(sample), report)
    assert [type(m) for m in report.messages] == [found.UndefinedName]
