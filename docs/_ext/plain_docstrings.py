"""Reads marft_jax's docstrings as the plain text they are written in.

The docstrings follow Google style for their sections (Args:, Returns:, Raises:, read by
napoleon) and plain text elsewhere: aligned tables and equations indented under a line that
ends with ":", `name: description` lists with indented continuations, `lambda_` and `|x|`.
reStructuredText reads some of that as markup (a reference to "lambda", a substitution, a
block quote that ends without a blank line). This hook runs after napoleon and rewrites
each docstring's lines so that they mean in reST what they mean as text:

- an indented block under a line ending with ":" is a literal block (the line ends "::");
- a line directly followed by a more indented one starts a definition (a blank line is put
  before it), and a blank line closes every indented block;
- outside `code` spans and literal blocks, a word's trailing "_" and "|" are escaped, and a
  span that runs on to the next line is closed and reopened there.

Nothing is reworded: the text on the page is the docstring's.
"""

import re

_CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")
_TRAILING_UNDERSCORE = re.compile(r"(?<=\w)_(?=\W|$)")
_FIELD = re.compile(r"^:[\w ,\\*]+:")  # napoleon's output (:param x:, :returns:, ...)


def _indent(line):
  return len(line) - len(line.lstrip(" "))


def _escape(line):
  parts = _CODE_SPAN.split(line)
  for i in range(0, len(parts), 2):  # the even parts lie outside code spans
    parts[i] = _TRAILING_UNDERSCORE.sub(r"\\_", parts[i].replace("|", r"\|"))
    if i and parts[i][:1].isalnum():  # `name`s: reST ends a span only before a non-letter
      parts[i] = "\\ " + parts[i]
  return "".join(parts)


def _raises(line):
  """":raises ValueError naming `x` ...:" (a Raises: entry not of the form `Type: text`, which
  napoleon reads as a type) as ":raises: ValueError naming `x` ..."."""
  m = re.match(r"^(\s*):raises ([^:]*\s[^:]*.*?):?$", line)
  return f"{m.group(1)}:raises: {m.group(2)}" if m else line


def _close_spans(lines):
  """A `code` span that runs on to the next line, closed at the line's end and reopened."""
  lines = list(lines)
  for i in range(len(lines) - 1):
    if lines[i].replace("``", "").count("`") % 2:
      lines[i] += "`"
      nxt = lines[i + 1]  # reopened after its indent, or after napoleon's ":raises "
      at = re.match(r" *(:raises:? )?", nxt).end()
      lines[i + 1] = nxt[:at] + "`" + nxt[at:]
  return lines


def rewrite(lines):
  """The docstring `lines` (napoleon's output) as reST that reads as their text."""
  lines = _close_spans([_raises(line) for line in lines])
  out, literal_at = [], None  # literal_at: the indent a literal block's lines exceed
  for i, line in enumerate(lines):
    blank = not line.strip()
    if literal_at is not None and (blank or _indent(line) > literal_at):
      out.append(line)  # inside a literal block: as written
      continue
    literal_at = None
    prev = out[-1] if out else ""
    if not blank and prev.strip() and _indent(line) < _indent(prev):
      out.append("")  # an indented block ends: close it with a blank line
    elif not blank and prev.strip() and _indent(line) > _indent(prev) \
        and not _FIELD.match(prev.lstrip()) and not prev.rstrip().endswith("::"):
      if prev.rstrip().endswith(":"):  # a display under its introducing line
        out[-1] = prev.rstrip() + ":"
        out.append("")
        out.append(line)
        literal_at = _indent(prev)
        continue
      if len(out) >= 2 and out[-2].strip() and _indent(out[-2]) == _indent(prev):
        out.insert(len(out) - 1, "")  # the term of a definition starts a block
    nxt = next((l for l in lines[i + 1:] if l.strip()), None)
    if blank and prev.rstrip().endswith(":") and not prev.rstrip().endswith("::") \
        and nxt is not None and _indent(nxt) > _indent(prev) \
        and not _FIELD.match(prev.lstrip()) and not nxt.lstrip().startswith(">>>"):
      out[-1] = prev.rstrip() + ":"  # "text:\n\n    display" -> a literal display
      literal_at = _indent(prev)
      out.append(line)
      continue
    out.append(line if blank else _escape(line))
  return out


def _process(app, what, name, obj, options, lines):
  lines[:] = rewrite(list(lines))


def setup(app):
  app.connect("autodoc-process-docstring", _process, priority=600)  # after napoleon's 500
  return {"parallel_read_safe": True, "parallel_write_safe": True}
