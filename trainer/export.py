"""`python -m trainer.export --workdir RUN --out DIR`: a run's checkpoint as a Hugging Face
LLaMA (the command; trainer/tools/export.py does the work)."""

from trainer.tools import export

if __name__ == "__main__":
  export.run()
