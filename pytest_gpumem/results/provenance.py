"""What a measurement stood on, as ``key: value`` text: a test's declared settings under ``config.``,
beside the frameworks, versions and environment knobs the launch records."""

from __future__ import annotations

from typing import Mapping

CONFIG_PREFIX = "config."


def config_provenance(config: Mapping[str, object]) -> dict[str, str]:
    """A test's declared settings, flattened for the baseline's provenance."""
    return {f"{CONFIG_PREFIX}{key}": str(value) for key, value in sorted(config.items())}
