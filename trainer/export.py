"""`python -m trainer.export --workdir RUN --out DIR`: a run's checkpoint as a Hugging Face
LLaMA (the command; trainer/tools/hf_export.py does the work)."""

from trainer.tools import hf_export

if __name__ == "__main__":
  hf_export.run()
