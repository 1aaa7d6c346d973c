"""Server tests import their helpers (`server_helpers`, `fake_pipeline`) from this folder by unique names: a
`from conftest import ...` would be ambiguous between the suite's several conftest.py files."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ray_model: Ray Serve replicas of the embedded model (a minute of compiling on two CPU cores)"
    )
    config.addinivalue_line("markers", "soak: the locust soak run against the embedded model (1-2 minutes)")
