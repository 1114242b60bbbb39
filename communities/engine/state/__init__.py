"""What survives the process: the run directory, checkpoints, and recovery from a lost rank."""
