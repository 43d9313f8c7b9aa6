"""`shoalrun`: launch a Shoal job through the mpiexec of the MPI Shoal was built with."""
