"""The launchers, one module each, registered as entry points of ``pytest_gpumem.launchers`` (pyproject.toml)."""
