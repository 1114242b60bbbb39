"""Post-hoc inspection of run directories; reads the results layout only (no torch, no MPI)."""
