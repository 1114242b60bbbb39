"""What a run records: the run log written by the lead, TensorBoard scalars, per-round weight snapshots."""
