"""A small planning task in the spirit of Plan-Path: find a way through a grid with walls.

A problem is a grid of at most 5 × 5 cells drawn row by row, `S` the start, `G` the goal,
`#` a wall, `.` a free cell, with a way from S to G (checked by breadth-first search; the
shortest takes at least two moves). Every role sees the grid. The team's first role writes
the moves; the last (graded) role writes the final path in a graded form: move letters
U (up), D (down), L (left), R (right) in `\\boxed{}` (`\\boxed{RRD}`) or after "Path:"
(`The path from S to G is R R D.`).

Knobs (calibrated for the untuned SmolLM2-135M team, docs/team_tasks.md): `ROWS` × `COLS`
cells, `WALLS` walls, S and G anywhere or in opposite corners (`CORNERS`), the task's last
line `ASK`, and `CANDIDATES` candidate paths listed after it (one of them the shortest way,
the others failing): the untuned model never wrote a way of its own on any grid tried, but
it does copy a candidate.

Grading is exact and accepts any way, not only the shortest. The graded reply's moves are
its last `\\boxed{}`'s (move letters only, either case; spaces, commas, hyphens or arrows
between them are ignored), else the run of move letters right after its last "Path:" or
"path (from S to G) is" (the forms a small model writes: `Path: R D`, `Path: RRD`, `The path
from S to G is R D.`; words of move letters, each one letter of either case or several in
upper case, separated by spaces, hyphens or arrows: a comma ends the run, and a word such as
"Right" or "dull" is no move). The moves from S must stay on the grid, never enter a wall
and end on G.
Anything else scores 0: neither form ("none"), a box with other text or a path's words
without letters ("malformed"), a way off the grid or into a wall, or one that stops elsewhere
("boxed" or "path", wrong).

Splits: a problem's signature is its grid; see `team_tasks`.
"""

from __future__ import annotations

import collections
import re
from typing import Optional, Sequence

from marft_jax.envs import arithmetic
from marft_jax.envs.base import Observation
from marft_jax.envs.problems import Problem, last_boxed
from marft_jax.envs.team_tasks import randint, rng_for

NAME = "grid_path"
ROWS, COLS = 3, 3
WALLS = 2
CORNERS = False  # True: S always in the top left corner, G in the bottom right one
ASK = "Find a way from S to G. Moves: U up, D down, L left, R right."  # the task's last line
# > 0: the task lists this many candidate paths of the shortest way's length, one of them that
# way (in a random place), the others failing (into a wall, off the grid or not ending on G)
CANDIDATES = 3
FORMATTED = ("boxed", "path")
MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_SEPARATORS = re.compile(r"[\s,;\-–>→]+")
# "Path:" or "path (from S to G) is", then a run of move words: one move letter of either case,
# or several in upper case ("RRD"; a lower-case word of them is English: "dull")
_PATH = re.compile(r"\bpath(?:\s+from\s+S\s+to\s+G)?\s*(?::|\bis\b)", re.IGNORECASE)
_MOVE_WORD = r"(?:[UDLR]{2,}|[UDLRudlr])(?![A-Za-z])"
_MOVE_RUN = re.compile(rf"\s*{_MOVE_WORD}(?:[ \t\-–>→]*{_MOVE_WORD})*")


def shortest(rows: Sequence[str]) -> Optional[str]:
  """The moves of a shortest way from S to G in `rows` (breadth-first, moves tried in
  U, D, L, R order), or None where there is none."""
  cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
  start = next(p for p, ch in cells.items() if ch == "S")
  seen, queue = {start: ""}, collections.deque([start])
  while queue:
    p = queue.popleft()
    if cells[p] == "G":
      return seen[p]
    for move, (dr, dc) in MOVES.items():
      q = (p[0] + dr, p[1] + dc)
      if cells.get(q, "#") != "#" and q not in seen:
        seen[q] = seen[p] + move
        queue.append(q)
  return None


def _draw(rng):
  free = [(r, c) for r in range(ROWS) for c in range(COLS)]
  picks = []
  if CORNERS:  # S top left, G bottom right
    picks = [free.pop(0), free.pop()]
  for _ in range(WALLS + 2 - len(picks)):  # S, G, then the walls: distinct cells
    picks.append(free.pop(randint(rng, 0, len(free) - 1)))
  grid = [["."] * COLS for _ in range(ROWS)]
  (sr, sc), (gr, gc) = picks[:2]
  grid[sr][sc], grid[gr][gc] = "S", "G"
  for r, c in picks[2:]:
    grid[r][c] = "#"
  rows = tuple("".join(row) for row in grid)
  path = shortest(rows)
  if path is None or len(path) < 2:
    return None
  return rows, path


def candidates(rng, rows: Sequence[str], path: str) -> list[str]:
  """`CANDIDATES` distinct paths as long as `path`: `path` and failing ones, in a random
  order (random letters, redrawn until they fail)."""
  out = [path]
  while len(out) < CANDIDATES:
    moves = "".join("UDLR"[randint(rng, 0, 3)] for _ in path)
    if moves not in out and not follow(rows, moves):
      out.append(moves)
  out.insert(randint(rng, 0, len(out) - 1), out.pop(0))
  return out


def render(rows: Sequence[str]) -> str:
  """The grid as the roles see it: one line per row, cells separated by spaces."""
  return "\n".join(" ".join(row) for row in rows)


def generate_problems(n: int, seed: int, split: str = "train") -> list[Problem]:
  """`n` problems of `split`; the same arguments always give the same list. `answer` is a
  shortest path (one of several the grader accepts); meta: `rows` (the grid), `kind` (how
  long its shortest paths are: "2_moves", "3_moves", "4+_moves"), `candidates` (the paths the
  task lists, in its order; none when `CANDIDATES` is 0), `split`."""
  rng = rng_for(NAME, split, seed)
  problems = []
  while len(problems) < n:
    drawn = _draw(rng)
    if drawn is None or arithmetic.split_of((NAME,) + drawn[0]) != split:
      continue
    rows, path = drawn
    question = (f"Grid ({ROWS} rows, {COLS} columns; S start, G goal, # wall, . free):\n"
                f"{render(rows)}\n{ASK}")
    listed = candidates(rng, rows, path) if CANDIDATES else []
    if listed:
      question += f"\nCandidate paths: {', '.join(' '.join(c) for c in listed)}."
    problems.append(Problem(question=question, answer=path,
                            id=f"{NAME}-{split}-s{seed}-{len(problems)}",
                            meta={"rows": list(rows), "kind": path_kind(path),
                                  "candidates": listed, "split": split}))
  return problems


def path_kind(path: str) -> str:
  """A problem's kind by its shortest path's length (2 to 3 moves, or 4 and more)."""
  return f"{len(path)}_moves" if len(path) < 4 else "4+_moves"


def read_path(reply: str) -> tuple[Optional[str], str]:
  """(the reply's moves, upper case, or None; how they were given: "boxed" (the last
  `\\boxed{}`), "path" (no box: the run of move letters right after the last "Path:" or
  "path (from S to G) is"), "malformed" (a box with other text than move letters, or no
  letters after the path's words) or "none" (neither))."""
  boxed = last_boxed(reply)
  if boxed is not None:
    moves = _SEPARATORS.sub("", boxed).upper()
    if not moves or set(moves) - set(MOVES):
      return None, "malformed"
    return moves, "boxed"
  starts = list(_PATH.finditer(reply))
  if not starts:
    return None, "none"
  run = _MOVE_RUN.match(reply, starts[-1].end())
  if run is None:
    return None, "malformed"
  return _SEPARATORS.sub("", run.group()).upper(), "path"


def follow(rows: Sequence[str], moves: str) -> bool:
  """Whether `moves` from S stay on the grid, never enter a wall, and end on G."""
  cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
  p = next(q for q, ch in cells.items() if ch == "S")
  for move in moves:
    p = (p[0] + MOVES[move][0], p[1] + MOVES[move][1])
    if cells.get(p, "#") == "#":
      return False
  return cells[p] == "G"


def grade(reply: str, problem: Problem) -> tuple[bool, Optional[str], str]:
  moves, how = read_path(reply)
  return moves is not None and follow(problem.meta["rows"], moves), moves, how


def check_roles(roles: Sequence[str]) -> None:
  if not roles:
    raise ValueError("grid_path: a team of at least one role")


def observation(problem: Problem, roles: Sequence[str]) -> Observation:
  """Every role sees the grid."""
  return Observation(task=problem.question)
