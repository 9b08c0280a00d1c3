"""What several test modules share: builders, worlds and helpers (fixtures that wrap them live in tests/conftest.py).
No test module imports another; they import from here."""
