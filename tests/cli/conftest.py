"""CLI tests share the server tests' fake pipeline (tests/server/fake_pipeline.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
