"""Where the suite and the repository are, for tests that read files or start child processes
(the test modules live one folder below this one, grouped by layer)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # the helpers (models/, reference/, *_helpers.py) are here
ROOT = TESTS.parent
