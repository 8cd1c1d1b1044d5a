"""The ``GPUMEM_*`` variables the parent sets in a rank's environment and the rank reads
(``rankside.rank``): named here, below both, so that each side imports them from one place."""

WORKDIR_ENV = "GPUMEM_WORKDIR"
LAUNCH_ID_ENV = "GPUMEM_LAUNCH_ID"
SNAPSHOT_ENV = "GPUMEM_TORCH_SNAPSHOT"
# Rank-side switches, declared in settings.OPTIONS (gpumem_boxing, gpumem_fast_exit): the user's
# session resolves them and sets them in the ranks' environment as "1" or "0".
BOXING_ENV = "GPUMEM_BOXING"  # off: no OneFlow nn.Graph boxing audit
FAST_EXIT_ENV = "GPUMEM_FAST_EXIT"  # off: ranks end through the interpreter's full teardown
# Set by the driver for each launch (settings.OPTIONS: gpumem_track_host): "0" where the figure will be GPU memory.
TRACK_ENV = "GPUMEM_TRACK_ALLOCATIONS"  # off: no allocation tracking; host figures fall back to VmHWM
GPU_IN_RANK_ENV = "GPUMEM_GPU_IN_RANK"  # "1": the rank samples its own GPU figure (set by the parent)
GPU_INTERVAL_ENV = "GPUMEM_GPU_INTERVAL_S"
SITES_ENV = "GPUMEM_SITES"  # 0: no peak sites (no memray site read-back, no torch allocator history)
PYTHON_ALLOCATIONS_ENV = "GPUMEM_PYTHON_ALLOCATIONS"  # "arenas": Python's objects counted by pymalloc's arenas
HISTORY_ENV = "GPUMEM_GPU_HISTORY"  # 1: record torch's CUDA allocator history for the GPU sites (set by the parent)
ROOTDIR_ENV = "GPUMEM_ROOTDIR"  # sites are named relative to it (set by the parent)
# Which rank-<slot>.* files this process writes: its RANK, except in a simulated world, where the
# launch's processes stand for ranks picked out of a larger one (rankside.simulate).
SLOT_ENV = "GPUMEM_SLOT"
# Where the host tracker starts in a pytest rank (set by the parent, launching.startups):
# unset: at the rank's start, one capture; "probe": at the start, and the rank ends where its test's
# setup begins, reporting its start-up's live and peak MiB; "0=LIVE/PEAK;1=...": at the setup, the
# start-up's figures (by rank) measured by a probe.
STARTUP_ENV = "GPUMEM_STARTUP"
