"""The configuration reference, from one source: the comments of the config dataclasses' fields.

A field's documentation is the block of comment lines right above its declaration (no blank
line between) followed by the comment after it, as written in the dataclass's module:

    # "auto": the algorithm's; or "shared", "per_agent_lora", "per_agent_head", "none"
    mode: str = "auto"
    lr: float = 1e-4  # the critic's peak learning rate, > 0

`--help` (launch/cli.py) prints each field with the config file's value and this text, and
docs/config.md lists each with its default and this text, so the two cannot disagree; a test
(tests/test_config_reference.py) fails when a field has none, when a line of it is wider than
100 columns, or when it cites history (commits, dates, issues: those go to
`marft_jax.train.config.history` and CHANGELOG.md). After changing a field or its comment:

    python -m launch.reference     # rewrites docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
import typing
from typing import Any, Iterator, Optional

from marft_jax.configs import to_config_dict

WIDTH = 100  # columns of --help
_INDENT = "      "  # a field's help lines after its first
PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "config.md")
REGENERATE = "python -m launch.reference"
# What user help must not cite (it belongs to config_history and the CHANGELOG): a commit
# hash (hex with a digit and a letter), a date, an issue number.
HISTORY = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
                     r"|\b\d{4}-\d{2}-\d{2}\b|\bissue\s*#?\d+", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One key a config file sets, as `--config.<key>=<value>` overrides it."""

  key: str  # dotted: "team.roles.actor.temperature"
  value: Any  # the config file's
  default: Any  # the dataclass's; `NO_DEFAULT` for a field of a named entry (a role)
  help: str  # the field's comment ("" if it has none)


NO_DEFAULT = object()


@functools.lru_cache(maxsize=None)
def field_help(cls: type) -> dict[str, str]:
  """Field name -> its documentation: the comment lines right above its declaration in the
  class source, then the comment after it, joined into one paragraph ('' for neither)."""
  source = textwrap.dedent(inspect.getsource(cls))
  comments, alone = {}, set()  # line -> comment text; lines that hold only a comment
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      row, col = token.start
      comments[row] = token.string.lstrip("#").strip()
      if not token.line[:col].strip():
        alone.add(row)
  lines = source.splitlines()
  out = {}
  for node in ast.parse(source).body[0].body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    above, row = [], node.lineno - 1
    while row in alone and lines[row - 1].strip().startswith("#"):
      above.insert(0, comments[row])
      row -= 1
    after = [comments[r] for r in range(node.lineno, node.end_lineno + 1)
             if r in comments and r not in alone]
    out[node.target.id] = " ".join(t for t in above + after if t)
  return out


def class_doc(cls: type) -> str:
  """The class docstring's first paragraph, on one line ('' where it has none: a dataclass
  without one gets its signature as `__doc__`)."""
  doc = cls.__dict__.get("__doc__") or ""
  if doc.startswith(cls.__name__ + "("):
    return ""
  return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def named_entry_class(hint: Any) -> Optional[type]:
  """The section class of a `tuple[Section, ...]` field whose entries are named (`name`), as a
  config file writes them: a mapping from each entry's name to its other fields."""
  args = typing.get_args(hint)
  if (typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis
      and dataclasses.is_dataclass(args[0])
      and "name" in {f.name for f in dataclasses.fields(args[0])}):
    return args[0]
  return None


def sections(cls: type, prefix: str = "") -> Iterator[tuple[str, type]]:
  """(dotted prefix, class) of `cls` and every section below it, depth first; a named entry's
  prefix ends in `<name>.` (`team.roles.<name>.`)."""
  yield prefix, cls
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    hint = hints[field.name]
    if dataclasses.is_dataclass(hint):
      yield from sections(hint, f"{prefix}{field.name}.")
    elif named_entry_class(hint) is not None:
      yield from sections(named_entry_class(hint), f"{prefix}{field.name}.<name>.")


def documented_keys(root: type) -> dict[str, str]:
  """Every key of `root` and its sections (a named entry's as `team.roles.<name>.<key>`, its
  `name` too) -> its documentation ('' where it has none)."""
  out = {}
  for prefix, cls in sections(root):
    hints, docs = typing.get_type_hints(cls), field_help(cls)
    for field in dataclasses.fields(cls):
      if not dataclasses.is_dataclass(hints[field.name]):
        out[prefix + field.name] = docs.get(field.name, "")
  return out


def undocumented(root: type) -> list[str]:
  """The keys of `root` (and of its sections) whose field has no comment."""
  return [key for key, text in documented_keys(root).items() if not text.strip()]


def entries(cls: type, values: Any, defaults: Any = None, prefix: str = "",
            skip: tuple[str, ...] = ()) -> list[Entry]:
  """Every key of config file `values` (a `ConfigDict` of dataclass `cls`), in field order:
  a section's keys under its name, each named entry's (a role's) under its name, a section of
  named entries with none declared as one key ({}). `defaults`: `cls()`'s, where it has them."""
  if defaults is None and not any(f.name == "name" for f in dataclasses.fields(cls)):
    defaults = to_config_dict(cls())
  hints, docs, out = typing.get_type_hints(cls), field_help(cls), []
  for field in dataclasses.fields(cls):
    if field.name in skip:
      continue
    value, hint = values[field.name], hints[field.name]
    default = NO_DEFAULT if defaults is None else defaults[field.name]
    key = f"{prefix}{field.name}"
    if dataclasses.is_dataclass(hint):
      out += entries(hint, value, None if defaults is None else default, key + ".")
      continue
    entry_cls = named_entry_class(hint)
    if entry_cls is not None and value:
      for name in sorted(value):
        out += entries(entry_cls, value[name], None, f"{key}.{name}.", skip=("name",))
      continue
    if entry_cls is not None:  # none declared: an empty ConfigDict
      value = default = {}
    if hasattr(value, "to_dict"):  # a free-form mapping (task.options): as a dict
      value, default = value.to_dict(), getattr(default, "to_dict", lambda: default)()
    out.append(Entry(key, value, default, docs.get(field.name, "")))
  return out


# --- --help ----------------------------------------------------------------------------------


def help_lines(cls: type, values: Any, width: int = WIDTH) -> list[str]:
  """`  team.temperature = 0.3  # help ...` for every key of config file `values`, the help
  wrapped within `width` columns; `(default: x)` after a value that is not the dataclass's."""
  lines = []
  for entry in entries(cls, values):
    lines += _entry_lines(entry, width)
  return lines


def flag_lines(name: str, shown: Optional[str], text: str, width: int = WIDTH) -> list[str]:
  """`  --workdir=runs/default  # help ...` wrapped within `width` columns (`shown` None: a
  flag without a default, printed bare)."""
  head = f"  --{name}" + ("" if shown is None else f"={shown}")
  return _wrap(head, text, width)


def _entry_lines(entry: Entry, width: int) -> list[str]:
  head = f"  {entry.key} = "
  shown = _fit(repr(entry.value), width - len(head))
  head += shown
  if entry.default is not NO_DEFAULT and entry.default != entry.value:
    note = f"  (default: {_fit(repr(entry.default), 40)})"
    head += note if len(head) + len(note) <= width else ""
  return _wrap(head, entry.help, width)


def _fit(text: str, room: int) -> str:
  return text if len(text) <= room else text[:room - 3] + "..."


def _wrap(head: str, text: str, width: int) -> list[str]:
  if not text:
    return [head]
  wrap = functools.partial(textwrap.wrap, width=width, subsequent_indent=_INDENT,
                           break_long_words=False, break_on_hyphens=False)
  lines = wrap(text, initial_indent=head + "  # ")
  if len(lines[0]) > width:  # the head leaves no room for the first word
    lines = [head] + wrap(text, initial_indent=_INDENT)
  return lines


# --- docs/config.md --------------------------------------------------------------------------


def markdown() -> str:
  """docs/config.md: a table per section of `TrainConfig` (launch.train, launch.eval) and of
  `GenerateConfig` (launch.generate): each key, its default and its documentation."""
  from launch.configs.generate import GenerateConfig  # noqa: PLC0415
  from marft_jax.train.config import TrainConfig  # noqa: PLC0415
  out = [
      "# Configuration reference", "",
      f"Generated by `{REGENERATE}` from the comments of the config dataclasses' fields;",
      "edit those comments (and regenerate), not this page. `--help` prints the same text",
      "beside the values of the config file it reads, and the other flags of the script.",
      "Every key is overridden on the command line as `--config.<key>=<value>`, e.g.",
      "`python -m launch.train --config.optimizer.lr=3e-5`.", "",
      "## Training and evaluation: `TrainConfig`", "",
      "Read by `launch.train` and `launch.eval` (`marft_jax/train/config/`).", ""]
  out += _tables(TrainConfig, level=3)
  out += ["## Chat: `GenerateConfig`", "",
          "Read by `launch.generate` (`launch/configs/generate.py`).", ""]
  out += _tables(GenerateConfig, level=3)
  return "\n".join(out).rstrip("\n") + "\n"


def _tables(root: type, level: int) -> list[str]:
  out = []
  defaults = to_config_dict(root())
  for prefix, cls in sections(root):
    rows = list(_rows(cls, prefix, defaults))
    if not rows:
      continue
    title = f"`{prefix.rstrip('.')}`" if prefix else f"`{root.__name__}`'s own keys"
    out += ["#" * level + " " + title, ""]
    doc = class_doc(cls)
    if prefix.endswith("<name>."):
      name_help = field_help(cls).get("name", "")
      doc += f" `<name>`: {name_help}" if name_help else ""
    if doc.strip():
      out += textwrap.wrap(_escape(doc.strip()), width=WIDTH, break_long_words=False,
                           break_on_hyphens=False) + [""]
    out += ["| Key | Default | Description |", "| --- | --- | --- |"]
    out += [f"| `{key}` | {_code(default)} | {_escape(_sentence(text))} |"
            for key, default, text in rows]
    out.append("")
  return out


def _rows(cls: type, prefix: str, root_defaults: Any) -> Iterator[tuple[str, Any, str]]:
  """(key, default, help) of `cls`'s own leaves (not its sections'); a named entry's defaults
  are its class's field defaults, a section's those of the root config (`root_defaults`)."""
  hints, docs = typing.get_type_hints(cls), field_help(cls)
  defaults = root_defaults
  for part in prefix.rstrip(".").split(".") if prefix else ():
    defaults = None if part == "<name>" or defaults is None else defaults[part]
  for field in dataclasses.fields(cls):
    hint = hints[field.name]
    if dataclasses.is_dataclass(hint) or (prefix.endswith("<name>.") and field.name == "name"):
      continue
    if named_entry_class(hint) is not None:
      default: Any = {}
    elif defaults is not None:
      default = defaults[field.name]
      default = default.to_dict() if hasattr(default, "to_dict") else default  # task.options
    else:
      default = (field.default if field.default is not dataclasses.MISSING
                 else field.default_factory())  # type: ignore[misc]
    yield prefix + field.name, default, docs.get(field.name, "")


def _sentence(text: str) -> str:
  """`text` with its first word capitalised where it is a plain lowercase word (not a
  variable such as `w` or `rollout.num_envs`): a table cell reads as a sentence."""
  word = re.match(r"(?:a|[a-z][a-z'-]+)(?=[\s,:;(])", text)
  return text[0].upper() + text[1:] if word else text


def _code(value: Any) -> str:
  text = repr(value).replace("|", "\\|")
  tick = "``" if "`" in text else "`"
  return f"{tick}{text}{tick}"


def _escape(text: str) -> str:
  """`text` as the cell of a Markdown table (MyST, GitHub): `|` escaped everywhere, and outside
  code spans the characters Markdown would read as HTML or emphasis."""
  parts = re.split(r"(`[^`]*`)", text)
  for i, part in enumerate(parts):
    if i % 2 == 0:
      part = part.replace("\\", "\\\\").replace("<", "&lt;").replace("*", "\\*")
      part = re.sub(r"(?<![\w])_|_(?![\w])", r"\\_", part)
    parts[i] = part.replace("|", "\\|")
  return "".join(parts)


def main(argv: list[str]) -> int:
  """Writes docs/config.md (`--check`: exits 1 instead where the page is not up to date)."""
  text = markdown()
  current = ""
  if os.path.exists(PAGE):
    with open(PAGE, encoding="utf-8") as f:
      current = f.read()
  if "--check" in argv[1:]:
    if current != text:
      print(f"{PAGE} is out of date: run `{REGENERATE}`", file=sys.stderr)
      return 1
    return 0
  with open(PAGE, "w", encoding="utf-8") as f:
    f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
