"""docs/python.md's examples run: every ```python block, in order, in one namespace."""
import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"


def python_blocks():
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def test_docs_have_examples():
    assert len(python_blocks()) >= 3


def test_docs_examples_run(capsys):
    namespace = {"__name__": "docs_python_md"}
    for number, block in enumerate(python_blocks(), 1):
        exec(compile(block, f"{DOC.name} block {number}", "exec"), namespace)
