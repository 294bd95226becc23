"""The fakes, builders and helpers that several test modules share (no test module
imports another). On ``sys.path`` through pytest's ``pythonpath`` (pyproject.toml)."""
