"""The tools that read a run: the sampler, the needle eval and the Hugging Face exporter."""
