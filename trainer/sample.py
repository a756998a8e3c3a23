"""`python -m trainer.sample --workdir RUN --prompt TEXT`: text from a run's checkpoint or a
Hugging Face one (the command; trainer/tools/sample.py does the work)."""

import sys

from trainer.tools import sample

if __name__ == "__main__":
  sample.main(sys.argv)
