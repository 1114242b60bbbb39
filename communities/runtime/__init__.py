"""The MPI layer (``comm``), set-up collectives, and stop flags: the only place that talks to mpi4py."""
