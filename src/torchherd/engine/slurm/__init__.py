"""SLURM as the second backend (``engine.backend.SlurmBackend``): the batch script
(``batch``), SLURM's commands and their answers (``commands``), the run directory
followed (``files``), the attached run (``job``), the detached operations
(``detached``) and ``check`` inside an allocation (``check``).
"""
