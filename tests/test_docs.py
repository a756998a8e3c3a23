"""The manual: its strict build (every link, anchor and nav entry resolves, no warning), the
config reference covering every field of `configs/base.py`, and the README's links."""

import os
import re
import subprocess
import sys

from configs import base
from trainer.config.fields import flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import docs_site  # noqa: E402


def test_the_config_reference_has_every_field_of_base_with_its_meaning():
  _, _, fields = docs_site.parse()
  assert sorted(f.name for f in fields) == sorted(flatten(base.get_config().to_dict()))
  assert [f.name for f in fields if not f.comment] == []
  page = docs_site.reference_markdown()
  assert all(f"`{f.name}`" in page for f in fields)


def test_the_site_builds_strictly_without_a_warning(tmp_path):
  done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                         str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
  output = done.stdout + done.stderr
  assert done.returncode == 0, output[-4000:]
  assert "WARNING" not in output, output
  reference = (tmp_path / "site" / "config-reference" / "index.html").read_text()
  assert "model.rope_scaling.type" in reference


def test_the_readme_links_only_to_files_that_exist():
  readme = open(os.path.join(ROOT, "README.md")).read()
  targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
  local = [t for t in targets if "://" not in t]
  assert local, "the README links to the manual"
  assert [t for t in local if not os.path.exists(os.path.join(ROOT, t))] == []
