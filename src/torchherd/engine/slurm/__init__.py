"""SLURM as the second backend (``backend.SlurmBackend``, named in ``engine.schedulers``):
the batch script (``batch``), SLURM's commands and their answers (``commands``), the run
directory followed (``files``), the attached run (``job``), the detached operations
(``detached``), a detached run's record kept by its background controller (``recorder``)
and ``check`` inside an allocation (``check``).
"""
