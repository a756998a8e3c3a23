"""The config as the trainer reads it: field checks and their errors, stages, hardware figures
(peak FLOPs, memory), the needle grid's syntax, the run directory (lock, atomic writes) and
the config it stores there (`config.json`)."""
