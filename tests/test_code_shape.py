"""No function in service/ is over 60 lines: past that, a function holds more than one idea."""

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "service"
MAX_LINES = 60


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_in_service_is_over_60_lines() -> None:
    assert long_functions(SERVICE) == []
