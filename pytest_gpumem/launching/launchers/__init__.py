"""The launchers, one module each; each registers itself (``launching.launcher.register``)."""
