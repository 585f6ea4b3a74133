"""No name is used that nothing defines: pyflakes over the package, the benchmarks and the tests. A renamed variable
left behind in a rarely taken branch (an error path, a CLI flag) is a NameError only the day that branch runs;
session 39's `tokens` -> `n_tokens` rename left two, found by hand. And no `asyncio.wait_for` in the package: on
Python 3.11 it swallows a cancellation that comes as its awaitable completes (the gateway's request that ran on to
its last token after its client went away, session 54)."""
from __future__ import annotations

import ast
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


def wait_for_calls(source: str) -> list[int]:
    """Lines that use asyncio.wait_for (as `asyncio.wait_for` or imported from asyncio)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "wait_for" and \
                isinstance(node.value, ast.Name) and node.value.id == "asyncio":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio" and \
                any(alias.name == "wait_for" for alias in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_asyncio_wait_for_in_the_package():
    used = [f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "swarmlm").rglob("*.py"))
            for line in wait_for_calls(path.read_text())]
    assert not used, ("asyncio.wait_for on Python 3.11 swallows a cancellation that comes as its awaitable completes "
                      "(the cancelled task runs on as if never cancelled): use `async with asyncio.timeout(t):` "
                      "instead, at " + ", ".join(used))


def test_the_check_sees_a_wait_for():
    sample = ("import asyncio\nfrom asyncio import wait_for\n\n"
              "async def f(cond, q):\n"
              "    await cond.wait_for(lambda: True)\n"  # a Condition's wait_for is not asyncio's
              "    return await asyncio.wait_for(q.get(), 1.0)\n")
    assert wait_for_calls(sample) == [2, 6]
