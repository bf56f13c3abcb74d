"""Math answer grading: pull the final answer out of a reply, compare it with the gold answer.

Extraction (`extract_answer`), in order of preference, the last occurrence of each:
  1. `\\boxed{...}` (braces matched)                         -> how="boxed"
  2. `#### <answer>` (GSM8K style, to the end of the line)   -> how="hash"
  3. `answer is <answer>` / `answer: <answer>`                -> how="answer_is"
     (a `$...$` or `\\(...\\)` right after the marker, else a leading number, else the text
     up to the end of the sentence)
  4. the last number in the reply                             -> how="last_number"
  otherwise no prediction                                     -> how="none"
Forms 1-3 count as a well-formatted final answer; 4 is a fallback that still gets graded.

Comparison (`Grader.grade`) runs in two tiers, because a trainer grades thousands of short
integer answers on a couple of cores:
  - in-process: when gold and prediction are both plain numbers (`42`, `-3`, `1,200`, `$12`,
    `0.75`), they are compared exactly as fractions; equal means correct, and unequal means
    wrong when both have at most 6 decimals (math-verify rounds to 6, so it would agree).
  - otherwise `math_verify.verify(parse(gold), parse(pred))` (gold first: it is asymmetric),
    both wrapped as `$...$`, in a worker process. math-verify guards itself with
    `signal.alarm`, which only works in a main thread, so it runs in the main thread of a
    persistent spawned child with its own timeouts off and one `setitimer` alarm around the
    whole grade instead. If the child does not answer within `timeout_s + kill_grace_s`
    (a signal that cannot interrupt C code, a crash), the parent kills it and starts a new
    one on the next call. Timeouts and worker errors score 0 and are reported apart from
    wrong answers (`Grade.status`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import pickle
import re
import signal
import threading
from fractions import Fraction
from typing import Callable, Optional, Sequence

from marft_jax.envs.problems import last_boxed, normalize_number

_HASH = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is\b|:)\s*:?\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_LEADING_NUMBER = re.compile(r"\\?\$?(-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)(?![\w^])")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.(\d+))?")
# The most decimals at which math-verify (float_rounding=6) and exact comparison agree.
_EXACT_DECIMALS = 6

FORMATTED = ("boxed", "hash", "answer_is")


def _clean(text: str) -> str:
  """Strips spaces, a trailing full stop and enclosing `$`/`\\(\\)` from an extracted answer."""
  text = text.strip().rstrip(".").strip()
  for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
      text = text[len(left):-len(right)].strip()
  return text


def _after_answer_marker(rest: str) -> str:
  """The answer following "answer is": a math span, a leading number, or the sentence."""
  rest = rest.split("\n", 1)[0].strip()
  for left, right in (("$", "$"), ("\\(", "\\)")):
    end = rest.find(right, len(left))
    if rest.startswith(left) and end > 0:
      return rest[:end + len(right)]
  number = _LEADING_NUMBER.match(rest)
  if number:
    return number.group(1).rstrip(",")
  return re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0]


def extract_answer(reply: str) -> tuple[Optional[str], str]:
  """(prediction or None, how) for one reply; see the module docstring for the order."""
  boxed = last_boxed(reply)
  if boxed:
    return _clean(boxed), "boxed"
  hashes = [m.group(1) for m in _HASH.finditer(reply) if _clean(m.group(1))]
  if hashes:
    return _clean(hashes[-1]), "hash"
  markers = list(_ANSWER_IS.finditer(reply))
  if markers:
    found = _clean(_after_answer_marker(reply[markers[-1].end():]))
    if found:
      return found, "answer_is"
  numbers = _NUMBER.findall(reply)
  if numbers:
    return numbers[-1].rstrip(","), "last_number"
  return None, "none"


def _plain_number(text: str) -> Optional[tuple[Fraction, int]]:
  """(value, number of decimals) of a plain decimal number, or None for anything else."""
  text = normalize_number(text.strip().lstrip("\\").lstrip("$").strip())
  match = _PLAIN_NUMBER.fullmatch(text)
  if not match:
    return None
  return Fraction(text), len(match.group(1) or "")


def vote_key(prediction: str) -> tuple:
  """The key under which maj@n counts an extracted answer (`evaluate.majority_correct`): a
  plain number by its exact value (`1,200`, `1200` and `1200.0` vote together), any other
  answer by its text without spaces (`\\frac{1}{2}` and `0.5` vote apart: no grader runs)."""
  number = _plain_number(prediction)
  if number is not None:
    return ("number", number[0])
  return ("text", "".join(prediction.split()))


def compare_numbers(gold: str, pred: str) -> Optional[bool]:
  """The in-process tier: True/False when both are plain numbers and the answer is certain,
  None when math-verify must decide."""
  g, p = _plain_number(gold), _plain_number(pred)
  if g is None or p is None:
    return None
  if g[0] == p[0]:
    return True
  return False if max(g[1], p[1]) <= _EXACT_DECIMALS else None


def math_verify_equal(gold: str, pred: str) -> bool:
  """`verify(parse(gold), parse(pred))` with math-verify's own signal timeouts off (the
  grader's worker bounds the whole call). Runs in the worker process."""
  from math_verify import parse, verify  # imported in the worker only

  gold_parsed = parse(f"${_clean(gold)}$", parsing_timeout=None)
  pred_parsed = parse(f"${_clean(pred)}$", parsing_timeout=None)
  return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


@dataclasses.dataclass(frozen=True)
class Grade:
  """One graded answer.

  correct: scores 1 if True, else 0.
  status: "ok" (graded), "no_answer" (nothing to grade), "timeout" (the comparison ran past
    its time), "error" (the comparison raised or the worker died).
  detail: the error text for "error", else "".
  """

  correct: bool
  status: str
  detail: str = ""


class _GradeTimeout(BaseException):
  """Raised by the worker's alarm; a BaseException so math-verify's `except Exception`
  handlers let it through."""


def _raise_timeout(signum, frame):
  raise _GradeTimeout()


def _worker_main(conn, compare: Callable[[str, str], bool], preload: tuple[str, ...]) -> None:
  """The worker loop: says ("ready", None) once `preload` is imported, then answers
  (gold, pred, seconds) with ("ok", bool) | ("timeout", None) | ("error", text), until None
  or a closed pipe."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  signal.signal(signal.SIGALRM, _raise_timeout)
  for module in preload:  # imports never count against a grade's time
    importlib.import_module(module)
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeouts are yours" warnings
  conn.send(("ready", None))
  while True:
    try:
      request = conn.recv()
    except (EOFError, OSError):
      return
    if request is None:
      return
    gold, pred, seconds = request
    try:
      signal.setitimer(signal.ITIMER_REAL, seconds)
      reply = ("ok", bool(compare(gold, pred)))
    except _GradeTimeout:
      reply = ("timeout", None)
    except Exception as e:  # noqa: BLE001 - any failure of the comparison is reported back
      reply = ("error", f"{type(e).__name__}: {e}")
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    conn.send(reply)


class Grader:
  """Grades predictions against gold answers; owns one lazily started worker process.

  compare: `(gold, pred) -> bool`, run in the worker; a module-level function (it is pickled
    by reference). Tests inject slow or failing ones.
  timeout_s: the alarm around one comparison in the worker.
  kill_grace_s: how much longer the parent waits before it kills an unresponsive worker.
  startup_timeout_s: how long a new worker may take to start and import `preload` (this is
    not counted against any grade).
  preload: modules the worker imports before its first grade.

  Thread-safe (one comparison at a time). Share one Grader between many environments; call
  `close()` (or use it as a context manager) to stop the worker.
  """

  def __init__(self, compare: Callable[[str, str], bool] = math_verify_equal,
               timeout_s: float = 5.0, kill_grace_s: float = 2.0,
               startup_timeout_s: float = 120.0, preload: Sequence[str] = ("math_verify",)):
    for name, value in (("timeout_s", timeout_s), ("kill_grace_s", kill_grace_s),
                        ("startup_timeout_s", startup_timeout_s)):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}: must be a number > 0")
    try:
      pickle.dumps(compare)
    except Exception as e:  # noqa: BLE001 - lambdas, closures, bound methods of odd objects
      raise ValueError(f"compare={compare!r}: must be picklable (a module-level function), "
                       f"it is sent to the worker process ({e})") from None
    self.compare = compare
    self.timeout_s = float(timeout_s)
    self.kill_grace_s = float(kill_grace_s)
    self.startup_timeout_s = float(startup_timeout_s)
    self.preload = tuple(preload)
    self._lock = threading.Lock()
    self._process = None
    self._conn = None

  def grade(self, gold: str, pred: Optional[str]) -> Grade:
    """Grades one prediction (None: no answer was found). Never raises for a bad answer."""
    if pred is None or not pred.strip():
      return Grade(False, "no_answer")
    decided = compare_numbers(gold, pred)
    if decided is not None:
      return Grade(decided, "ok")
    with self._lock:
      return self._grade_in_worker(gold, pred)

  def _grade_in_worker(self, gold: str, pred: str) -> Grade:
    try:
      self._start()
      self._conn.send((gold, pred, self.timeout_s))
      if not self._conn.poll(self.timeout_s + self.kill_grace_s):
        self._stop(kill=True)
        return Grade(False, "timeout", "worker killed after no answer")
      status, value = self._conn.recv()
    except (EOFError, OSError) as e:
      self._stop(kill=True)
      return Grade(False, "error", f"grading worker died: {type(e).__name__}: {e}")
    if status == "ok":
      return Grade(value, "ok")
    return Grade(False, status, value or "")

  @property
  def worker_pid(self) -> Optional[int]:
    """The running worker's process id (None before the first worker-side grade)."""
    return self._process.pid if self._process is not None else None

  def _start(self) -> None:
    if self._process is not None and self._process.is_alive():
      return
    self._stop(kill=True)
    context = multiprocessing.get_context("spawn")  # no fork of a JAX-threaded parent
    self._conn, child_conn = context.Pipe()
    self._process = context.Process(target=_worker_main,
                                    args=(child_conn, self.compare, self.preload),
                                    daemon=True, name="math-grader")
    self._process.start()
    child_conn.close()
    if not self._conn.poll(self.startup_timeout_s):
      self._stop(kill=True)
      raise OSError(f"grading worker did not start within {self.startup_timeout_s} s")
    self._conn.recv()  # ("ready", None); EOFError if the worker died while starting

  def _stop(self, kill: bool) -> None:
    process, conn = self._process, self._conn
    self._process = self._conn = None
    if conn is not None:
      if not kill:
        try:
          conn.send(None)
        except OSError:
          pass
      conn.close()
    if process is not None:
      if kill:
        process.kill()
      process.join(timeout=5)
      if process.is_alive():  # did not take the polite stop
        process.kill()
        process.join()

  def close(self) -> None:
    """Stops the worker (a later grade starts a new one)."""
    with self._lock:
      self._stop(kill=False)

  def __enter__(self) -> "Grader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
