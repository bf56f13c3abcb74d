"""Seeded arithmetic word problems with exact integer answers: the embedded default math task.

A problem is a short story: a starting amount, then one to four steps that change it (add,
take away, add or remove equal groups, multiply, and optionally a final equal sharing; each
kind of step at most once), then a question. Eight settings (stickers, shopping, a road trip,
baking, a library, a farm, a garden, a train) each word every step in a few ways.

Levels (`LEVELS`): 1 = one addition or subtraction on numbers from 2 to 20; 2 = one step of any
kind, numbers up to 100; 3 = two steps up to 100; 4 = three steps up to 1000; 5 = four steps
up to 5000. Every intermediate amount stays a positive integer and sharing always divides
evenly.

Reproducibility: `generate_problems(n, level, seed, split)` draws from
`random.Random("marft_jax.arithmetic/<split>/<level>/<seed>")` using only `random()` (the one
stream Python promises to keep across versions), so the same arguments give the same problems
on any machine.

Splits never overlap: a problem's *arithmetic* (level, start, and each step's operation and
numbers, not the names or wording) is hashed with SHA-256, and a tenth of all such
signatures belong to "test", the rest to "train"; the generator discards draws of the other
split. So a held-out problem never has the same sums as a training problem, however it is
worded, and the same question text can never be in both splits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Sequence

from marft_jax.envs.problems import Problem, check_seed

SPLITS = ("train", "test")
TEST_BUCKETS = 1  # of 10 hash buckets belong to "test"


@dataclasses.dataclass(frozen=True)
class Level:
  """How hard a problem is.

  steps: operations applied to the starting amount.
  start: (low, high) range of the starting amount.
  operand: (low, high) range of added/removed amounts and group sizes.
  factor: (low, high) range of multipliers, group counts and sharing divisors.
  ops: the operations allowed (names in `_OPS`).
  cap: no intermediate amount may exceed this.
  """

  steps: int
  start: tuple[int, int]
  operand: tuple[int, int]
  factor: tuple[int, int]
  ops: tuple[str, ...]
  cap: int


_ALL_OPS = ("add", "sub", "add_groups", "sub_groups", "times", "share")
LEVELS = {
    1: Level(1, (2, 20), (2, 20), (2, 5), ("add", "sub"), 40),
    2: Level(1, (10, 100), (2, 20), (2, 9), _ALL_OPS, 1000),
    3: Level(2, (10, 100), (2, 50), (2, 9), _ALL_OPS, 1000),
    4: Level(3, (50, 1000), (5, 200), (2, 12), _ALL_OPS, 10_000),
    5: Level(4, (100, 5000), (10, 999), (2, 12), _ALL_OPS, 100_000),
}


@dataclasses.dataclass(frozen=True)
class _Story:
  """A setting: how each step is worded. `{N}` name, `{P}`/`{p}` pronoun, `{pos}` possessive,
  `{obj}` object pronoun; `{V}`/`{X}` formatted amounts, `{x}`/`{k}` raw numbers."""

  amount: str  # formats an amount: "{n} stickers", "${n}"
  setup: tuple[str, ...]
  add: tuple[str, ...]
  sub: tuple[str, ...]
  add_groups: tuple[str, ...]
  sub_groups: tuple[str, ...]
  times: tuple[str, ...]
  share: tuple[str, ...]
  ask: tuple[str, ...]
  ask_share: str


_STORIES = (
    _Story(
        amount="{n} stickers",
        setup=("{N} has {V}.", "{N} keeps {V} in an album."),
        add=("{P} gets another {X} from a friend.", "{P} finds {X} in an old drawer."),
        sub=("{P} trades away {X}.", "{P} gives {X} to {pos} cousin."),
        add_groups=("{P} buys {k} packs with {x} stickers in each.",
                    "{k} friends each give {obj} {x} stickers."),
        sub_groups=("{P} gives {x} stickers to each of {k} classmates.",),
        times=("After a swap day, {pos} collection is {k} times as big as before.",),
        share=("{N} then shares all of {pos} stickers equally among {k} friends.",),
        ask=("How many stickers does {N} have now?",
             "How many stickers are in the collection now?"),
        ask_share="How many stickers does each friend get?"),
    _Story(
        amount="${n}",
        setup=("{N} has {V} in {pos} wallet.", "{N} starts the week with {V}."),
        add=("{P} earns {X} walking a neighbour's dog.", "{P} is given {X} for {pos} birthday."),
        sub=("{P} spends {X} on a book.", "{P} pays {X} for a new bike."),
        add_groups=("{P} sells {k} old games for ${x} each.",),
        sub_groups=("{P} buys {k} notebooks that cost ${x} each.",
                    "{P} pays for {k} bus tickets at ${x} each."),
        times=("{pos_cap} aunt tops it up until {p} has {k} times as much as before.",),
        share=("{N} then splits all of the money equally into {k} envelopes.",),
        ask=("How many dollars does {N} have now?",),
        ask_share="How many dollars go into each envelope?"),
    _Story(
        amount="{n} km",
        setup=("{N} has {V} left to drive to the coast.",),
        add=("A closed road adds a detour of {X}.", "{P} misses an exit, which adds {X}."),
        sub=("{P} drives {X} before lunch.", "{P} covers {X} in the morning."),
        add_groups=("{P} decides to add {k} side trips of {x} km each.",),
        sub_groups=("{P} drives {k} stretches of {x} km each.",),
        times=("{P} checks the map: the true distance left is {k} times what {p} thought.",),
        share=("{P} wants to drive the rest in {k} days, the same distance each day.",),
        ask=("How many km does {N} still have to drive?",),
        ask_share="How many km does {N} drive each day?"),
    _Story(
        amount="{n} cookies",
        setup=("{N} bakes {V} for a school fair.",),
        add=("{P} bakes another {X}.", "A friend brings {X} to add to the stall."),
        sub=("{P} sells {X} in the first hour.", "{P} drops a plate and {x} cookies break."),
        add_groups=("{P} bakes {k} more trays of {x} cookies each.",),
        sub_groups=("{k} customers buy {x} cookies each.",),
        times=("By noon the stall holds {k} times as many cookies as before.",),
        share=("{N} packs all the cookies equally into {k} boxes.",),
        ask=("How many cookies does {N} have now?", "How many cookies are on the stall now?"),
        ask_share="How many cookies are in each box?"),
    _Story(
        amount="{n} books",
        setup=("The library at {N}'s school has {V}.",),
        add=("It receives {X} as a donation.", "The librarian orders another {X}."),
        sub=("Pupils borrow {X} and have not returned them.", "{X} are too worn and removed."),
        add_groups=("It buys {k} boxes with {x} books in each.",),
        sub_groups=("It lends {x} books to each of {k} other schools.",),
        times=("After a book drive, the collection is {k} times as large.",),
        share=("The books are then put equally on {k} shelves.",),
        ask=("How many books does the library have now?",),
        ask_share="How many books are on each shelf?"),
    _Story(
        amount="{n} eggs",
        setup=("{N}, a farmer, collects {V} in the morning.",),
        add=("{P} collects another {X} in the afternoon.",),
        sub=("{P} uses {X} to make cakes.", "{P} drops a tray and loses {X}."),
        add_groups=("{k} neighbours each bring {obj} {x} eggs.",),
        sub_groups=("{P} sells {k} cartons of {x} eggs.",),
        times=("By the end of the week {p} has {k} times as many eggs.",),
        share=("{P} packs all the eggs equally into {k} baskets.",),
        ask=("How many eggs does {N} have now?",),
        ask_share="How many eggs are in each basket?"),
    _Story(
        amount="{n} tulip bulbs",
        setup=("{N} has {V} in {pos} shed.",),
        add=("{P} buys another {X}.", "A neighbour gives {obj} {X}."),
        sub=("{P} plants {X} by the fence.", "Squirrels steal {X}."),
        add_groups=("{P} buys {k} bags with {x} bulbs in each.",),
        sub_groups=("{P} plants {k} rows of {x} bulbs.",),
        times=("A bulb swap leaves {obj} with {k} times as many bulbs as before.",),
        share=("{P} divides all the bulbs equally among {k} flower beds.",),
        ask=("How many bulbs are in {N}'s shed now?",),
        ask_share="How many bulbs go into each flower bed?"),
    _Story(
        amount="{n} passengers",
        setup=("A train driven by {N} leaves the first station with {V}.",),
        add=("At the next stop {x} people get on.",),
        sub=("At the next stop {x} people get off.",),
        add_groups=("{k} groups of {x} tourists get on.",),
        sub_groups=("{k} families of {x} people get off.",),
        times=("At the big city stop, the number on board becomes {k} times as large.",),
        share=("At the last station everyone splits equally into {k} buses.",),
        ask=("How many passengers are on the train now?",),
        ask_share="How many passengers ride in each bus?"),
)

_NAMES = (("Maya", "she"), ("Omar", "he"), ("Lena", "she"), ("Tariq", "he"), ("Ines", "she"),
          ("Kofi", "he"), ("Priya", "she"), ("Jonas", "he"), ("Aiko", "she"), ("Mateo", "he"),
          ("Zara", "she"), ("Felix", "he"), ("Noor", "she"), ("Ravi", "he"), ("Elena", "she"),
          ("Sami", "he"))


def _randint(rng: random.Random, low: int, high: int) -> int:
  """Uniform in [low, high], from `rng.random()` only (stable across Python versions)."""
  return low + int(rng.random() * (high - low + 1))


def _choice(rng: random.Random, options: Sequence):
  return options[int(rng.random() * len(options))]


def _apply(rng: random.Random, op: str, v: int, level: Level, last: bool):
  """One step on amount `v`: (new amount, numbers for the signature and the wording) or None
  when `op` cannot apply here (it would go negative, past the cap, or not divide evenly)."""
  x_lo, x_hi = level.operand
  k_lo, k_hi = level.factor
  if op == "add":
    x = _randint(rng, x_lo, x_hi)
    return (v + x, {"x": x}) if v + x <= level.cap else None
  if op == "sub":
    if v - 1 < x_lo:
      return None
    x = _randint(rng, x_lo, min(x_hi, v - 1))
    return v - x, {"x": x}
  if op in ("add_groups", "sub_groups"):
    k, x = _randint(rng, k_lo, k_hi), _randint(rng, x_lo, min(x_hi, 50))
    new = v + k * x if op == "add_groups" else v - k * x
    return (new, {"k": k, "x": x}) if 0 < new <= level.cap else None
  if op == "times":
    k = _randint(rng, k_lo, min(k_hi, 5))
    return (v * k, {"k": k}) if v * k <= level.cap else None
  if op == "share":
    divisors = [k for k in range(k_lo, k_hi + 1) if v % k == 0 and v // k > 1]
    if not last or not divisors:
      return None
    k = _choice(rng, divisors)
    return v // k, {"k": k}
  raise ValueError(f"unknown arithmetic op {op!r}; known: {_ALL_OPS}")


_SYMBOL = {"add": "+", "sub": "-", "add_groups": "+", "sub_groups": "-", "times": "*",
           "share": "/"}


def _expression(expr: str, op: str, nums: dict) -> str:
  """Extends the Python expression of the amount by one step (kept in Problem.meta)."""
  if op in ("add_groups", "sub_groups"):
    return f"({expr} {_SYMBOL[op]} {nums['k']} * {nums['x']})"
  return f"({expr} {_SYMBOL[op]} {nums.get('x', nums.get('k'))})"


def _draw(rng: random.Random, level: int):
  """One candidate problem: (question, answer, signature, expression)."""
  spec = LEVELS[level]
  story = _choice(rng, _STORIES)
  name, pronoun = _choice(rng, _NAMES)
  words = {"N": name, "p": pronoun, "P": pronoun.capitalize(),
           "pos": {"she": "her", "he": "his"}[pronoun],
           "obj": {"she": "her", "he": "him"}[pronoun]}
  words["pos_cap"] = words["pos"].capitalize()
  amount = lambda n: story.amount.format(n=n)  # noqa: E731
  v = _randint(rng, *spec.start)
  sentences = [_choice(rng, story.setup).format(V=amount(v), **words)]
  signature, expr, ask = [level, v], str(v), _choice(rng, story.ask)
  used = set()  # each kind of step at most once per problem (reads better, bounds sizes)
  for step in range(spec.steps):
    last = step == spec.steps - 1
    for _ in range(100):  # another op when this one cannot apply to v
      op = _choice(rng, [o for o in spec.ops if o not in used])
      result = _apply(rng, op, v, spec, last)
      if result is not None:
        break
    else:
      raise RuntimeError(f"level {level}: no applicable step for amount {v}")
    used.add(op)
    v, nums = result
    fields = dict(words, X=amount(nums.get("x")), x=nums.get("x"), k=nums.get("k"))
    sentences.append(_choice(rng, getattr(story, op)).format(**fields))
    signature.append((op, tuple(sorted(nums.items()))))
    expr = _expression(expr, op, nums)
    if op == "share":
      ask = story.ask_share
  sentences.append(ask.format(**words))
  return " ".join(sentences), v, tuple(signature), expr


def split_of(signature: tuple) -> str:
  """"test" for a tenth of arithmetic signatures (SHA-256 bucket), "train" for the rest."""
  digest = hashlib.sha256(repr(signature).encode()).digest()
  return "test" if int.from_bytes(digest[:8], "big") % 10 < TEST_BUCKETS else "train"


def generate_problems(n: int, level: int, seed: int, split: str = "train") -> list[Problem]:
  """`n` problems of `level` (1-5) from `split` ("train" or "test"); the same arguments
  always give the same list.

  Returns Problems with `answer` a decimal integer string and meta
  `{"level", "split", "expression"}`, where `expression` is the computation as Python
  (`((12 + 5) * 3)`; `/` always divides evenly).
  """
  if level not in LEVELS:
    raise ValueError(f"level={level!r}: must be one of {sorted(LEVELS)}")
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: must be one of {SPLITS}")
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ValueError(f"n={n!r}: must be a non-negative int")
  rng = random.Random(f"marft_jax.arithmetic/{split}/{level}/{seed}")
  problems = []
  while len(problems) < n:
    question, answer, signature, expr = _draw(rng, level)
    if split_of(signature) != split:
      continue
    problems.append(Problem(
        question=question, answer=str(answer), id=f"arith-L{level}-{split}-s{seed}-{len(problems)}",
        meta={"level": level, "split": split, "expression": expr}))
  return problems


class ArithmeticProblems:
  """An endless problem source for `MathEnv`: seed s gives the first problem of
  `generate_problems(1, levels[s % len(levels)], s, split)`.

  levels: the difficulty levels to cycle through (a curriculum can pass one level at a time).
  split: "train" or "test" (disjoint, see the module docstring).
  """

  def __init__(self, levels: Sequence[int] = (1, 2, 3), split: str = "train"):
    self.levels = tuple(levels)
    if not self.levels or any(level not in LEVELS for level in self.levels):
      raise ValueError(f"levels={levels!r}: must be a non-empty list from {sorted(LEVELS)}")
    if split not in SPLITS:
      raise ValueError(f"split={split!r}: must be one of {SPLITS}")
    self.split = split

  def __repr__(self) -> str:
    return f"ArithmeticProblems(levels={self.levels}, split={self.split!r})"

  def problem_for_seed(self, seed: int) -> Problem:
    seed = check_seed(seed)
    return generate_problems(1, self.levels[seed % len(self.levels)], seed, self.split)[0]
