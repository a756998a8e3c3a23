"""The kernels part's causal and strictly causal `cudnn` rows at 8k and 16k, alone: run once
on the device tool after the strictly causal block became one aligned T x T call (run as
below from the repo root, `.gpu_wheels` carried; its rows say `"run": "strict"`).

  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu_wheels/*.whl
  PYTHONPATH=/tmp/site OUT=$OUT python3 results/gpu_check/20261127T165417Z/strictly_causal_rows.py
"""
import functools, sys, os
sys.path.insert(0, "scripts")  # run from the repo root
import gpu_check_parts as g
import jax, jax.numpy as jnp
smoke = jax.default_backend() == "cpu"
rec = g.Recorder(os.environ["OUT"], "kernels", "strict", jax.devices()[0].device_kind)
names = {"cudnn": "xla" if smoke else "cudnn"}
H, D = (1, 32) if smoke else (32, 128)
base = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                         implementation="xla" if smoke else "cudnn")
for S in ([64] if smoke else [8192, 16384]):
  q, k, v, dout = g.bench_kernel.normals(jax.random.key(S), [(1, S, H, D)] * 4, jnp.bfloat16)
  flops = g._flops(S, H, D)
  bf = jax.jit(lambda q, k, v, dout: jax.vjp(base, q, k, v)[1](dout))
  cud = dict(cudnn_fwd_tflops=flops / g.bench_kernel.median_time(jax.jit(base), q, k, v) / 1e12,
             cudnn_fwd_bwd_tflops=3.5 * flops / g.bench_kernel.median_time(bf, q, k, v, dout) / 1e12)
  for shape, block in (("causal", g.bench_kernel.causal_block(S)),
                       ("strictly_causal", g.bench_kernel.strictly_causal_block(S))):
    sch, pair = block
    g._block_rows(rec, sch, pair, (q, k, v, dout), None, g._reference(sch, pair, (q, k, v, dout), None),
                  names, flops, dict(seq_len=S, shape=shape, **cud))
