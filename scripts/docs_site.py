"""MkDocs hooks of the manual (`mkdocs.yml`, `make docs`): the config reference, generated from
the comments of `configs/base.py` so that the defaults and their meaning have one source, and
the files of `results/`, which the manual's pages link to where they cite a figure (as
`../results/...`, which a code host resolves too).

`python scripts/docs_site.py` prints the reference's Markdown.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_CONFIG = os.path.join(ROOT, "configs", "base.py")
REFERENCE_PAGE = "config-reference.md"
RESULTS = "results"
# A default longer than this, or of several lines, is shown below its group's table.
INLINE_DEFAULT_CHARS = 40


@dataclasses.dataclass
class Field:
  name: str  # dotted, without "config.": model.rope_scaling.type
  default: str  # the source text of the value
  comment: str  # the comment block above it and the comment after it, joined


def _dotted(node: ast.expr) -> str | None:
  """`config.model.window` -> "model.window"; None for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not (isinstance(node, ast.Name) and node.id == "config") or not parts:
    return None
  return ".".join(reversed(parts))


def _is_group(value: ast.expr) -> bool:
  return isinstance(value, ast.Call) and ast.unparse(value.func).endswith("ConfigDict")


def _comments(source: str) -> dict[int, tuple[str, bool]]:
  """Line number -> (comment text, whether the comment is the whole line)."""
  found = {}
  lines = source.splitlines()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      row, col = token.start
      whole = not lines[row - 1][:col].strip()
      found[row] = (token.string.lstrip("#").strip(), whole)
  return found


def _joined(lines: list[str]) -> str:
  """Comment lines as one table cell: a line that starts "- " starts a line of its own."""
  return " ".join(line if not line.startswith("- ") else "<br>" + line for line in lines)


def parse(path: str = BASE_CONFIG) -> tuple[list[str], dict[str, str], list[Field]]:
  """The groups in order, each group's own comment, and every field of `get_config`."""
  source = open(path).read()
  comments = _comments(source)
  get_config = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == "get_config")
  groups, group_comments, fields = [], {}, []
  for statement in get_config.body:
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
      continue
    name = _dotted(statement.targets[0])
    if name is None:
      continue
    above = []
    row = statement.lineno - 1
    while row in comments and comments[row][1]:
      above.insert(0, comments[row][0])
      row -= 1
    after = comments.get(statement.lineno)
    text = _joined(above + ([after[0]] if after and not after[1] else []))
    if _is_group(statement.value):
      groups.append(name)
      group_comments[name] = text
    else:
      fields.append(Field(name, ast.get_source_segment(source, statement.value), text))
  return groups, group_comments, fields


def _group_of(name: str) -> str:
  """"model.rope_scaling.type" -> "model.rope_scaling"; a top-level field's is ""."""
  return name.rpartition(".")[0]


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def reference_markdown(path: str = BASE_CONFIG) -> str:
  """The config reference page: one table per group, in `configs/base.py`'s order."""
  groups, group_comments, fields = parse(path)
  out = ["# Config reference", "",
         "Every field of the trainer's config, its default and what it means, generated from",
         "the comments of `configs/base.py` when the manual is built (`scripts/docs_site.py`).",
         "Override any field on the command line with `--config.<group>.<field>=value`;",
         "[Running a config](running.md) says how a config is checked. The named configs",
         "under `configs/` start from these defaults.", ""]
  for group in [""] + groups:  # "": the top level's fields
    members = [f for f in fields if _group_of(f.name) == group]
    if not members:
      continue
    out += [f"## `{group}`" if group else "## Top level", ""]
    if group_comments.get(group):
      out += [group_comments[group], ""]
    out += ["| field | default | meaning |", "| --- | --- | --- |"]
    long_defaults = []
    for field in members:
      default = field.default
      if "\n" in default or len(default) > INLINE_DEFAULT_CHARS:
        long_defaults.append(field)
        default_cell = "(below)"
      else:
        default_cell = f"`{_cell(default)}`"
      out.append(f"| `{field.name}` | {default_cell} | {_cell(field.comment)} |")
    out.append("")
    for field in long_defaults:
      out += [f"`{field.name}` defaults to:", "", "```python", field.default, "```", ""]
  return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
  """MkDocs hook: the pages link to `../results/...`, as the files lie beside docs/ on a code
  host; on the site results/ sits beside the pages."""
  return markdown.replace("](../results/", "](results/")


def on_files(files, config):
  """MkDocs hook: adds the generated reference and the files under results/."""
  from mkdocs.structure.files import File  # pylint: disable=g-import-not-at-top
  files.append(File.generated(config, REFERENCE_PAGE, content=reference_markdown()))
  results = os.path.join(ROOT, RESULTS)
  for folder, _, names in os.walk(results):
    for name in sorted(names):
      relative = os.path.relpath(os.path.join(folder, name), ROOT)
      files.append(File(relative, ROOT, config["site_dir"], config["use_directory_urls"]))
  return files


if __name__ == "__main__":
  print(reference_markdown())
