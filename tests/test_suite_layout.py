"""The suite's own rule: test modules share code through tests/helpers.py (or a helper module such as
tests/monolith/fixtures.py), never by importing a test module or a conftest.py."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return name.startswith("tests.") and (last == "conftest" or last.startswith("test_"))


def test_no_module_of_the_suite_imports_a_test_module_or_a_conftest() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            where = f"{path.relative_to(TESTS.parent)}:{node.lineno}"
            offenders += [f"{where} {name}" for name in names if _is_test_module(name)]
    assert offenders == []
