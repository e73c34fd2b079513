"""Finding and running the ```python blocks of README.md and docs/*.md (with Sybil).

Sybil (https://sybil.readthedocs.io) parses the Markdown and gives each block its document,
line and a namespace shared by the page's blocks in order, as a reader runs them one after
another. The evaluator here runs a block as Python source (top-level ``await`` allowed, as in
``python -m asyncio``), under the page's own file name and line numbers, so a traceback points
into the page; a block whose line above is ``<!-- no-run REASON -->`` is not run.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from pathlib import Path

from sybil import Document, Example, Sybil
from sybil.parsers.markdown import CodeBlockParser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
]

#: ``<!-- no-run REASON -->`` on the line right above a block's opening fence
NO_RUN = re.compile(r"<!--\s*no-run\b(?P<reason>.*?)-->\s*$")


def no_run_reason(example: Example) -> str | None:
    """The reason given above ``example``'s fence, or None when the block runs."""
    before = example.document.text[: example.start].rstrip("\n").rpartition("\n")[2]
    m = NO_RUN.search(before.strip())
    if m is None:
        return None
    return m.group("reason").strip(" :-\u2014") or ""


def run_block(example: Example) -> None:
    """Run one block in its page's namespace (Sybil's evaluator)."""
    if no_run_reason(example) is not None:
        return
    source = "\n" * example.line + str(example.parsed)  # the page's own line numbers
    code = compile(
        source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )
    if code.co_flags & inspect.CO_COROUTINE:  # top-level await: run it as `python -m asyncio` does
        asyncio.run(eval(code, example.namespace))
    else:
        exec(code, example.namespace)


_SYBIL = Sybil(parsers=[CodeBlockParser(language="python", evaluator=run_block)])


def parse(page: str | Path) -> Document:
    """The page's document (a path relative to the repository, or absolute): iterate it for
    its python blocks (Sybil examples), in order."""
    return _SYBIL.parse(ROOT / page)


def fences(page: str) -> int:
    """Python blocks counted independently of Sybil: lines opening a ```python fence."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return len(re.findall(r"^[ \t]*```python[ \t]*$", text, flags=re.M))


def blocks(page: str) -> list[tuple[int, str | None]]:
    """(line, no-run reason or None) of each python block of the page."""
    return [(ex.line, no_run_reason(ex)) for ex in parse(page)]
