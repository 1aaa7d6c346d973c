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


def test_the_longest_first_files_exist():
    """conftest's LONGEST_FIRST orders the full run: a moved file silently lost its place (it happened with
    tests/core/test_controlnet_parity.py, now in tests/families/)."""
    import ast

    # read from the file: `import conftest` may give another folder's conftest (tests/server/conftest.py)
    tree = ast.parse((TESTS / "conftest.py").read_text())
    (longest,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["LONGEST_FIRST"]
    ]
    root = TESTS.parent
    assert len(longest) > 10 and [p for p in longest if not (root / p).is_file()] == []
    assert len(set(longest)) == len(longest)
