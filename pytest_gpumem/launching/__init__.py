"""The parent side of a launch: start the ranks through a launcher (local or Slurm), hand out GPUs,
watch the ranks while they run, end every process, and collect what each rank reported."""
