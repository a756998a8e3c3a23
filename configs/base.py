"""Every default of the trainer, one comment each. Other config files start from this one.

    python -m trainer --config configs/base.py --config.train.steps=10

runs the tiny defaults below; the named configs (`tiny_cpu.py`, `1b_32k_*.py`,
`7b_256k_*.py`) override model, data, mesh and schedule for their purpose.
"""

import ml_collections


def get_config(arg=None) -> ml_collections.ConfigDict:
  del arg  # No variants of the base config.
  config = ml_collections.ConfigDict()
  config.seed = 0  # Seeds parameter init and data shuffling (training draws no randomness).
  config.cpu_devices = 0  # Simulated CPU devices when JAX runs on the CPU; 0 keeps JAX's default.

  config.model = ml_collections.ConfigDict()
  config.model.num_layers = 2  # Decoder blocks.
  config.model.d_model = 128  # Residual stream width.
  config.model.num_heads = 4  # Query heads.
  config.model.num_kv_heads = 4  # Key/value heads (GQA when fewer than num_heads).
  config.model.head_dim = 0  # Per-head width; 0 means d_model // num_heads.
  config.model.d_ff = 344  # SwiGLU hidden width.
  config.model.vocab_size = 512  # Embedding rows; must be >= the tokenizer's vocabulary.
  config.model.rope_theta = 10000.0  # RoPE base; long-context runs raise it.
  # Rescaled RoPE frequencies for a context longer than the pretrained one, as `transformers`
  # defines them (model/rope.py). Imported from a Hugging Face checkpoint's config.json.
  config.model.rope_scaling = ml_collections.ConfigDict()
  config.model.rope_scaling.type = "default"  # default, linear, llama3 or yarn.
  config.model.rope_scaling.factor = 1.0  # Context growth: frequencies divided by up to this.
  config.model.rope_scaling.original_max_len = 0  # llama3, yarn: the pretrained context length.
  config.model.rope_scaling.low_freq_factor = 1.0  # llama3: band edge original_max_len / this.
  config.model.rope_scaling.high_freq_factor = 4.0  # llama3: band edge original_max_len / this.
  config.model.rope_scaling.beta_fast = 32.0  # yarn: rotations where interpolation stops.
  config.model.rope_scaling.beta_slow = 1.0  # yarn: rotations where it is complete.
  config.model.rope_scaling.attention_factor = 0.0  # yarn: logit temperature; 0: 0.1 ln(factor) + 1.
  config.model.rope_scaling.truncate = True  # yarn: round the ramp's ends to whole dimensions.
  # Local attention (sliding windows): a local layer's query sees the `window` keys up to
  # itself (HF sliding_window; flash-attn window_size=(window - 1, 0)); 0: no local layers.
  config.model.window = 0
  # L (local) and G (global) per layer, repeated over the layers: 'LG' as Gemma 2, 'LLLLLG'
  # as Gemma 3. Empty: every layer local when window is set (Mistral), else every one global.
  config.model.layer_pattern = ""
  # RoPE base of local layers, unscaled (Gemma 3: 10k); 0: the global layers' RoPE.
  config.model.local_rope_theta = 0.0
  # Attention logits capped at c * tanh(logit / c) in every layer (Gemma 2: 50); 0: none.
  config.model.attention_softcap = 0.0
  # A JSON plan of per-(layer, query head) spans, MoA's alpha + beta * data.seq_len
  # (model/spans.py); it decides which layers are local. Empty: none.
  config.model.head_spans = ""
  # Sink tokens: local layers also see the first k positions of each document, however far
  # back (StreamingLLM / MoA's "first k tokens", per packed document); 0: none.
  config.model.sink_tokens = 0
  # Run-time sparse attention, decided per token at run time; exact masked attention in every
  # layout and strategy (xla kernel, which skips tiles at run time), decoded exactly by
  # sampling and needle evals. One of:
  # - "none";
  # - "hash" (SCFA's hash attention): per layer and head, q and k fall in one of hash_buckets
  #   buckets by argmax([xR, -xR]) of a fixed random projection R, and a query sees only the
  #   earlier keys of its document and bucket (model/hashing.py);
  # - "qk_drop" (SCFA's QK-dropping): per layer and head, each chunk of 64 consecutive
  #   positions keeps floor((1 - rate) * 64 + 1/2) queries and as many keys, by a fixed seeded
  #   hash of (layer, head, position), the same in every layout, in training and eval; a kept
  #   query sees the earlier kept keys of its document, a dropped one gives 0
  #   (model/dropping.py);
  # - "sparsek" (SparseK, Lou et al. 2024): a learned score per token and kv head (u = x W, a
  #   weight of each layer) and per query the soft top-k mask clip(u - tau, 0, 1) over its
  #   document's keys at least sparsek_window back, summing to sparsek_k; the sparsek_window
  #   keys up to itself are always seen (model/sparsek.py). Ring strategy only.
  config.model.sparse = "none"
  config.model.hash_buckets = 0  # hash: buckets, even, 2 to 2 x head size; 0 without it.
  config.model.qk_drop_rate = 0.0  # qk_drop: share of queries and keys dropped, in (0, 1).
  config.model.sparsek_k = 0  # sparsek: keys the soft top-k mask keeps per query, >= 1.
  config.model.sparsek_window = 0  # sparsek: keys up to itself a query always sees; 0: none.
  config.model.norm_eps = 1e-5  # RMSNorm epsilon.
  config.model.tie_embeddings = False  # Share the input embedding with the output projection.
  config.model.init_std = 0.02  # Std of the normal initialiser of every matrix.
  config.model.attention = "dense"  # One of dense, ring, striped, zigzag.
  # How attention splits the sequence over devices (parallelism/strategies.py): ring (K/V
  # blocks pass around mesh.sequence), allgather (one all-gather of K/V over mesh.sequence),
  # ulysses (all-to-all over mesh.ulysses: whole sequence, a shard of the heads) or hybrid
  # (Ulysses over mesh.ulysses inside a ring over mesh.sequence). Every layout works with each.
  config.model.sequence_parallel = "ring"
  # Block kernel of ring layouts (parallelism/kernels.py): auto (cudnn on GPUs, splash on
  # TPUs, else xla), xla, pallas, cudnn (CUDA GPUs) or splash (TPUs; interpreted elsewhere).
  # Dense attention is cuDNN's on CUDA GPUs, else plain.
  # The loop prints the one it runs; config.json records it.
  config.model.kernel = "auto"
  config.model.attention_tile = 512  # Query/key tile of the blockwise kernels (tile skipping).
  config.model.dtype = "bfloat16"  # Compute dtype of activations and matmuls.
  config.model.param_dtype = "float32"  # Dtype of parameters (master weights).

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1  # Pure data parallelism (replicated parameters).
  config.mesh.fsdp = -1  # Data parallelism with sharded parameters; -1 takes the remaining devices.
  config.mesh.sequence = 1  # Ring size: the sequence splits over sequence x ulysses devices.
  config.mesh.ulysses = 1  # Ulysses degree (sequence_parallel ulysses or hybrid): heads split over.
  config.mesh.tensor = 1  # Tensor parallelism over heads and MLP width.
  # Logical axis name -> mesh axes. Parameters use the plain names, activations the
  # `activation_*` ones; a mesh axis may appear once per array (checked at start-up). Ring
  # attention shards its operands by the same names; activation_seq is its ring (then Ulysses).
  config.mesh.rules = (
      ("layers", None),
      ("embed", ("fsdp", "sequence", "ulysses")),  # ZeRO-3 over the sequence: 7B fits 8 devices.
      ("vocab", "tensor"),
      ("heads", "tensor"),
      ("kv_heads", "tensor"),
      ("mlp", "tensor"),
      ("head_dim", None),
      ("norm", None),
      ("activation_batch", ("data", "fsdp")),
      ("activation_seq", ("sequence", "ulysses")),  # The ring's axis, then Ulysses'.
      ("activation_embed", None),
      ("activation_heads", "tensor"),
      ("activation_kv_heads", "tensor"),
      ("activation_mlp", "tensor"),
      ("activation_vocab", "tensor"),
  )

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "synthetic_longrange"  # synthetic_longrange, text_files, or a TFDS name.
  config.data.seq_len = 256  # Tokens per packed row.
  config.data.tokenizer = ""  # Path to a SentencePiece model; empty trains one at preparation.
  config.data.tokenizer_vocab_size = 512  # Vocabulary of a tokenizer trained at preparation.
  config.data.tokenizer_type = "bpe"  # SentencePiece model trained at preparation: bpe or unigram.
  config.data.data_dir = ".data"  # Where prepared datasets and tokenizers are cached.
  config.data.path = ""  # Directory of .txt/.jsonl files for the text_files dataset.
  config.data.text_field = "text"  # JSON field holding a document in .jsonl files.
  config.data.train_split = "train"  # Split the trainer reads.
  config.data.eval_split = "validation"  # Held-out split for evals.
  config.data.cross_document_attention = False  # Let packed documents attend to each other.
  config.data.num_documents = 2000  # Documents in the synthetic corpus's train split.
  config.data.num_eval_documents = 200  # Documents in the synthetic corpus's validation split.
  config.data.max_document_tokens = 1024  # Longest synthetic document (may exceed seq_len).
  config.data.corpus_seed = 0  # Seed the synthetic corpus is generated from.
  config.data.on_bad_file = "skip"  # text_files: skip (and count) or fail on unreadable files.
  config.data.prefetch = 2  # Batches prepared ahead in the background.

  # Where the parameters start.
  config.init = ml_collections.ConfigDict()
  # A Hugging Face LLaMA checkpoint directory (config.json, *.safetensors, tokenizer.model):
  # it sets the model's shape, RoPE and tokenizer from its files and starts step 0 from its
  # weights; empty starts from random weights (seed).
  config.init.from_hf = ""

  config.train = ml_collections.ConfigDict()
  config.train.steps = 100  # Optimizer steps.
  config.train.batch_size = 8  # Global batch in rows; divisible by data * fsdp.
  config.train.micro_batches = 1  # Gradient accumulation: batch_size is split into this many slices.
  config.train.lr = 3e-3  # Peak learning rate.
  config.train.schedule_steps = 0  # Length of the warmup + cosine schedule; 0 means train.steps.
  config.train.min_lr_ratio = 0.1  # Cosine decays to lr * min_lr_ratio.
  config.train.warmup_steps = 10  # Linear warmup from 0 to lr.
  config.train.weight_decay = 0.1  # AdamW decoupled weight decay (matrices only).
  config.train.b1 = 0.9  # AdamW beta1.
  config.train.b2 = 0.95  # AdamW beta2.
  config.train.grad_clip = 1.0  # Global-norm clipping threshold; 0 disables.
  # Activation checkpointing: none, full, save_dots, save_attention (keeps attention's
  # output and lse, so the backward does not run the ring forward again), or offload (full,
  # with each layer's input kept in pinned host memory instead of on the device; on the CPU
  # it runs as full).
  config.train.remat = "none"
  # Tokens per device whose output logits the loss computes at once (model/loss.py): the
  # whole sequence's float32 logits are never held. Rounded down to divide the local length.
  config.train.loss_chunk = 2048
  config.train.on_nonfinite = "stop"  # NaN/Inf loss or gradient: stop, or skip the update.
  config.train.log_every = 10  # Steps between metric lines.
  config.train.eval_every = 50  # Steps between evals; 0 disables.
  config.train.eval_steps = 2  # Batches per eval.
  # Needle in a haystack at every eval (trainer/tools/needle.py, scripts/eval_needle.py): prompt
  # lengths such as "256,1k" sampled greedily through the run's attention; "" disables.
  config.train.eval_needle_lengths = ""
  config.train.eval_needle_depths = "0,0.5,1"  # Where the fact sits: 0 starts the filler.
  config.train.eval_needle_trials = 1  # Needles per (length, depth) cell.

  # Staged context extension (trainer/config/stages.py): a tuple of configs.stages.stage(...), each
  # setting its own sequence length, RoPE, steps and learning rate, trained in order in one
  # workdir, each from the previous stage's final weights. () trains the config as one stage.
  # With stages, train.steps is unused: each stage's own steps count. Override one on the
  # command line by index: --config.stages[1].train.steps=500.
  config.stages = ()

  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 50  # Steps between checkpoints; 0 saves none (benchmarks).
  config.checkpoint.keep = 3  # Newest checkpoints kept, and the newest one a finite step followed.
  config.checkpoint.async_save = True  # Write checkpoints in the background.

  config.wandb = ml_collections.ConfigDict()
  config.wandb.project = "long-context"  # W&B project.
  config.wandb.mode = "auto"  # auto (online with an API key, else offline), online, offline, disabled.
  config.wandb.entity = ""  # W&B entity (team); empty uses the default.
  config.wandb.name = ""  # Run name; empty derives one from model size, seq_len and attention.
  config.wandb.group = ""  # Run group; empty groups by model size and seq_len.
  config.wandb.tags = ""  # Extra comma-separated tags; the attention layout is always a tag.
  config.wandb.workspace = ""  # Links to all runs, for wandb leet; empty: wandb/ beside workdir.

  config.accelerator = ""  # Peak-FLOPs table entry for MFU (h100, a100, tpu_v4...); empty guesses.
  config.peak_flops_per_device = 0.0  # Peak FLOP/s of one device for MFU; 0 uses the table.
  return config
