# The repository root: pytest's rootdir for the examples and the plugin's own tests.
pytest_plugins = ["pytester"]
