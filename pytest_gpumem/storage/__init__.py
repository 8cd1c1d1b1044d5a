"""Files written so that a reader sees the old file or the new one, never half: the baselines, the
floor and start-up caches. Below every other layer: plain ``os`` and ``filelock``."""
