"""Slurm's per-task environment -> the launch environment contract every rank expects.

Under ``srun`` each task learns who it is from Slurm (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_STEP_NODELIST``, ...); the frameworks expect ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. Plain functions of a mapping, shared by the task shim
(``srun_task``) and the parent (``slurm``), so both read Slurm's notation the same way.
"""

from __future__ import annotations

import re
from typing import Mapping

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class SlurmEnvError(ValueError):
    """A Slurm variable this module cannot read; the message names it and its value."""


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1-2,4],b`` -> ``['a[1-2,4]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (part.strip() for part in parts) if p]


def _expand_one(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise SlurmEnvError(f"hostlist item {item!r}: '[' without ']'")
    prefix, ranges, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    names: list[str] = []
    for part in ranges.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise SlurmEnvError(f"hostlist item {item!r}: range {part!r} is not N or N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        width = len(low) if low.startswith("0") else 0  # n[01-10] keeps its zero padding
        for number in range(int(low), int(high) + 1):
            names.extend(prefix + str(number).zfill(width) + tail for tail in _expand_one(rest))
    return names


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``gpu[01-03,07],login1``) as names, in Slurm's order;
    what ``scontrol show hostnames`` prints, without a process per task."""
    names: list[str] = []
    for item in _split_top(text):
        names.extend(_expand_one(item))
    return names


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for item in _split_top(text):
        match = re.match(r"^(\d+)(?:\(x(\d+)\))?$", item)
        if not match:
            raise SlurmEnvError(f"tasks per node {text!r}: {item!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _need(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = env.get(name)
        if value:
            return value
    raise SlurmEnvError(f"{' or '.join(names)} is not set: this is not a task started by srun")


def contract(env: Mapping[str, str], port: int, addresses: Mapping[str, str]) -> dict[str, str]:
    """The variables a rank needs, from a task's Slurm environment.

    ``MASTER_ADDR`` is the step's first node, where rank 0 runs: its address when the node's
    name is not its host name (``addresses``: NodeName -> NodeAddr, from ``scontrol``).
    """
    nodes = expand_hostlist(_need(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
    node_index = int(env.get("SLURM_NODEID", "0"))
    per_node = tasks_per_node(_need(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    local_world = per_node[node_index] if node_index < len(per_node) else per_node[-1]
    first = nodes[0]
    oneflow = {}
    if "ONEFLOW_TEST_NODE_NUM" in env:  # the parent saw OneFlow: its test helpers' view of the step
        oneflow = {"ONEFLOW_TEST_NODE_NUM": str(len(nodes)), "ONEFLOW_TEST_DEVICE_NUM": str(local_world)}
    return {
        **oneflow,
        "RANK": _need(env, "SLURM_PROCID"),
        "LOCAL_RANK": _need(env, "SLURM_LOCALID"),
        "WORLD_SIZE": _need(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node_index),
        "NODE_RANK": str(node_index),
        "MASTER_ADDR": addresses.get(first, first),
        "MASTER_PORT": str(port),
    }


def parse_addresses(text: str) -> dict[str, str]:
    """``n1=10.0.0.1,n2=10.0.0.2`` -> a dict (the form the parent passes to the task shim)."""
    pairs = {}
    for item in text.split(","):
        if item:
            name, _, addr = item.partition("=")
            pairs[name] = addr
    return pairs


def format_addresses(addresses: Mapping[str, str]) -> str:
    return ",".join(f"{name}={addr}" for name, addr in sorted(addresses.items()))
