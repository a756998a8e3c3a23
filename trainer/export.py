"""`python -m trainer.export --workdir RUN --out DIR`: a run's checkpoint as a Hugging Face
LLaMA (the command; trainer/tools/hf_export.py does the work)."""

from trainer.track import console  # Light: no JAX, so Ctrl-C is handled during the imports.

console.exit_at_ctrl_c()

from trainer.tools import hf_export  # noqa: E402  (seconds of JAX and Orbax)

if __name__ == "__main__":
  hf_export.run()
