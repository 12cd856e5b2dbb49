"""One room per outside system. Side effects live here and nowhere else."""
