"""The suite's own layout: pytest imports test modules by basename (no packages under tests/), so two files of the
same name in different folders make a collection error in the full run that a run of either folder alone never
shows (it happened: tests/finetune/test_files.py beside tests/loading/test_files.py)."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if names[p.name] > 1
    )


def _conftest_tuple(name: str) -> tuple:
    """A literal tuple of tests/conftest.py, read from the file: `import conftest` may give another folder's conftest
    (tests/server/conftest.py)."""
    import ast

    tree = ast.parse((TESTS / "conftest.py").read_text())
    (value,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]
    ]
    return value


def test_the_longest_first_files_exist():
    """conftest's LONGEST_FIRST orders the full run: a moved file silently lost its place (it happened with
    tests/core/test_controlnet_parity.py, now in tests/families/); QUICK_FIRST orders `--quick`."""
    root = TESTS.parent
    for name in ("LONGEST_FIRST", "QUICK_FIRST"):
        files = _conftest_tuple(name)
        assert len(files) >= 10 and [p for p in files if not (root / p).is_file()] == [], name
        assert len(set(files)) == len(files), name


def test_the_tests_quick_leaves_out_exist():
    """QUICK_SKIP_TESTS names single tests: a renamed test would silently come back into `--quick`."""
    import re

    root = TESTS.parent
    for node in _conftest_tuple("QUICK_SKIP_TESTS"):
        path, name = node.split("::")
        assert (root / path).is_file(), node
        assert re.search(rf"^def {re.escape(name)}\(", (root / path).read_text(), re.M), node
