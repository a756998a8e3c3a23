"""The config as the trainer reads it: field checks and their errors, stages, hardware figures
(peak FLOPs, memory), the needle grid's syntax, the run directory (lock, atomic writes) and
what it keeps there: the config (`config.json`) and the span plan (`head_spans.json`)."""
