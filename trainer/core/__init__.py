"""The pure core: train state and its sharded init, the train and eval step, the optimizer,
and building them for a config on a mesh (imports model, data and parallelism only)."""
