"""Test helpers that are not tests: MPI launchers, user functions the engine loads by ``module:function``,
synthetic run directories, the SLURM cluster fixture, scripts run under mpiexec, and the golden runs."""
