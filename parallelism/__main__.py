"""`python -m parallelism --layout striped --seq_len 32768 --shards 8 [--tile 512]`: prints
the static ring schedule of a layout and its critical path (`parallelism.schedule`)."""

from parallelism.schedule import main

main()
