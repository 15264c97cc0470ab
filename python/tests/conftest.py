"""pytest setup for c2f's Python tests: the PyTorch reference modules (tests/reference) on sys.path, and the
module under test from PYTHONPATH (the build tree's python/ folder: ctest python.pytest sets it)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "reference"))


def pytest_report_header(config):
    import c2f
    return f"c2f module: {c2f.__file__} (version {c2f.__version__})"
