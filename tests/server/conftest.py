"""Server tests import their helpers (`server_helpers`, `fake_pipeline`) from this folder by unique names: a
`from conftest import ...` would be ambiguous between the suite's several conftest.py files."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
