"""Cluster launchers for ``nemo-lw-fp8 pretrain`` (SLURM sbatch scripts and nemo-run)."""
