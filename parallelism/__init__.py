"""Mesh, logical axis rules, sequence layouts, the static ring schedule, sequence-parallel
attention (ring, all-gather, Ulysses, hybrid) and the sampler's decode attention over a
sharded KV cache (see docs/architecture.md)."""

from parallelism.decoding import CACHE_NAMES, cache_positions, decode_attention, decode_rules
from parallelism.kernel_cudnn import (dense_attention as cudnn_dense_attention,
                                      dense_reason as cudnn_dense_reason)
from parallelism.kernels import (AUTO as AUTO_KERNEL, KERNELS, describe as describe_kernel,
                                 resolve as resolve_kernel)
from parallelism import masks
from parallelism.layouts import LAYOUTS, check_seq_len, permute, unpermute
from parallelism.masks import Mask, MaskSpec, Side
from parallelism.mesh import (MESH_AXES, SEQUENCE_AXES, batch_sharding, batch_shards, check_rules,
                              logical_to_spec, make_mesh, resolve_mesh_shape)
from parallelism.ring_attention import SAVED_NAMES, ring_attention
from parallelism.schedule import RingSchedule, compare_layouts, ring_schedule
from parallelism.split import (Names, block_tile, length_unit, shortest_ring_length,
                               split_attention)
from parallelism.strategies import STRATEGIES, ULYSSES, kv_repeat
from parallelism.target import compiling_for
from parallelism.whole_row import per_query
