"""The assert-test harness: runs a program and its test (HumanEval's `check(candidate)`, MBPP's
assert lines) in one sandboxed interpreter, and reports a verdict the program cannot forge.

The boot program (`boot.py`) executes this source in a private namespace (pristine builtins,
nothing the program can reach) and calls `run(raw)` with the job read from stdin (JSON:
"nonce", "test", "setup", "entry_point"). Standard library only; nothing happens on import.

What a program could try, and why it fails (tests/envs/test_code_asserts.py plays each one):

- exit before the asserts (`exit(0)`, `sys.exit`, `os._exit(0)`): the pass line is written
  by the harness after the test returns; a program that ends the process first leaves none,
  and `SystemExit` raised by the program is caught like any exception.
- print the pass marker: the marker holds a nonce the runner drew for this run, read from
  stdin (then replaced by /dev/null) before the program starts. It lives in the main thread's
  frames only; the program runs in a worker thread (its frames lead nowhere), and while it
  can run, the audit hook refuses every way to another thread's frames or to memory: frame
  access in the main thread (`sys._getframe`, `tb_frame`, `gi_frame`, ...),
  `sys._current_frames`, `gc`, trace and profile hooks, new audit hooks, `ctypes`, `signal`
  (a handler receives the main thread's frame), opening /proc, /sys or /dev files, symlinks,
  a second copy of a built-in module, extension modules from outside the standard library.
- an object whose `__eq__` (or `__bool__`, `__sub__`, ...) always agrees: every value the
  program returns must be made of exact built-in types (int, float, str, list, dict, ...,
  no subclasses); anything else fails the test ("returned a <type>"), so the test's own
  comparisons run on values whose operators are Python's.
- redefine or patch what the test uses (`builtins.abs`, `isinstance`, `len`, `print`,
  `AssertionError`, `sys.exit`, `math.fabs`, `sys.modules[...]`): the test runs with a copy of
  the builtins taken before the program started, and every module the test can reach must be
  as it was after each call and at the end, as must the classes they define at the end; the
  harness itself uses functions captured before the program started. The test's reach is
  every module loaded before the harness seals `_imp` (the interpreter's, the boot program's,
  the harness's, and the test's and setup's imports with theirs, loaded first): the same
  modules for every build of one Python, so a program gets the same grade on every machine
  and in every sandbox mode. A module only the program loads, or a built-in one loaded only to
  seal `_imp` (which ones are built in differs between builds: Debian's python3 compiles in
  `math`), is the program's to change; a test that uses it imports it, which puts it in
  reach. A helper the test calls besides the entry point (HumanEval's `poly`) comes from
  `setup` (HumanEval's prompt), run in the test's namespace, not from the program.
- a thread left running to tamper between calls: after each call only the harness's worker
  may be alive.

An audit hook is not a security boundary for hostile native code; the sandbox's process
limits, uid and namespaces still bound what the program can do to the host.
"""

import _imp
import ast
import builtins
import json
import os
import sys
import time
import _thread

# Modules whose import is refused while the program can run (see the module docstring).
HIDDEN = frozenset(["gc", "signal", "_signal", "ctypes", "_ctypes", "_testcapi",
                    "_testinternalcapi", "_xxsubinterpreters", "_posixsubprocess"])
ALWAYS_REFUSED = frozenset(["sys._current_frames", "gc.get_objects", "gc.get_referrers",
                            "gc.get_referents", "sys.settrace", "sys.setprofile",
                            "sys.addaudithook", "os.symlink", "os.link",
                            "sys._settraceallthreads", "sys._setprofileallthreads"])
# Paths never opened while a test runs (the process's memory and descriptors, the wrappers'
# stdin), but the devices a program may read.
CLOSED = ("/proc", "/sys", "/dev")
OPEN_DEVICES = frozenset(["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"])
FRAME_ATTRS = frozenset(["tb_frame", "gi_frame", "cr_frame", "ag_frame"])
PLAIN = (int, float, bool, str, bytes, complex, type(None), list, tuple, dict, set, frozenset)
CONTAINERS = (list, tuple, set, frozenset)


class Tampered(BaseException):  # not an Exception: a test's `except Exception` cannot hide it
  """The program changed what the test relies on, or returned a value not made of plain
  built-in types."""


class CandidateRaised(Exception):
  """The program raised an exception of a class that is not a built-in one."""


def imported_names(sources):
  """The top-level module names the sources import (to load them before the program)."""
  names = []
  for source in sources:
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, ast.Import):
        names += [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names.append(node.module)
  return names


def normal_path(path, cwd):
  """`path` made absolute and normalised with string operations only (no module code that a
  program could have patched)."""
  if not path.startswith("/"):
    path = cwd + "/" + path
  parts = []
  for part in path.split("/"):
    if part in ("", "."):
      continue
    if part == "..":
      if parts:
        parts.pop()
      continue
    parts.append(part)
  return "/" + "/".join(parts)


def make_hook(main_thread, get_ident, getcwd):
  """The audit hook of the test run (see the module docstring)."""

  def hook(event, args):
    if event in ALWAYS_REFUSED:
      raise PermissionError(f"{event}: not allowed while a test runs")
    if event == "import" and args[0] in HIDDEN:
      raise PermissionError(f"import {args[0]}: not allowed while a test runs")
    if event == "open" and type(args[0]) is not int:
      path = args[0]
      if type(path) is bytes:
        path = path.decode("utf-8", "surrogateescape")
      if type(path) is not str:
        raise PermissionError("open: only str and bytes paths while a test runs")
      path = normal_path(path, getcwd())
      if any(path == p or path.startswith(p + "/") for p in CLOSED) and \
          path not in OPEN_DEVICES:
        raise PermissionError(f"open({path!r}): not allowed while a test runs")
    if get_ident() == main_thread and (
        event == "sys._getframe" or
        (event == "object.__getattr__" and args[1] in FRAME_ATTRS)):
      raise PermissionError(f"{event}: not allowed in the test's thread")

  return hook


def snapshot(modules, reach):
  """[(name, module, its dict, a copy of its dict)] of the loaded modules named in `reach`,
  but `__main__`."""
  return [(name, module, vars(module), dict(vars(module))) for name, module in
          list(modules.items()) if name != "__main__" and name in reach]


def class_snapshot(modules):
  """[(class, a copy of its __dict__)] of the classes the snapshot's modules define."""
  out, seen = [], set()
  for _, _, _, saved in modules:
    for value in saved.values():
      if isinstance(value, type) and id(value) not in seen:
        seen.add(id(value))
        out.append((value, dict(value.__dict__)))
  return out


def changed(modules, classes, loaded, builtin_names):
  """The first thing that differs from the snapshots, in words, or ""."""
  for name, module, now, saved in modules:
    if loaded.get(name) is not module:
      return f"sys.modules[{name!r}] was replaced"
    if len(now) != len(saved):
      for key in now:
        if key not in saved and (key in builtin_names and type(now[key]) is not type(sys)):
          return f"{name}.{key} was added"
    for key, value in saved.items():
      if now.get(key, Tampered) is not value:
        return f"{name}.{key} was changed"
  for cls, saved in classes:
    now = cls.__dict__
    for key, value in saved.items():
      if now.get(key, Tampered) is not value:
        return f"{cls.__module__}.{cls.__qualname__}.{key} was changed"
  return ""


def plain(value, depth=0, seen=None):
  """Whether `value` is made of exact built-in types only (no subclasses, no cycles past
  depth 100), so that comparing it runs no code of the program's."""
  kind = type(value)
  if kind not in PLAIN or depth > 100:
    return False
  if kind is dict:
    return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
  if kind in CONTAINERS:
    return all(plain(v, depth + 1) for v in value)
  return True


LOADERS = '''
def make(create_dynamic, namespace, hidden, dynload, normal_path, getcwd):
  """_imp's module makers while a test runs (their globals are their own): every built-in
  module was loaded before, so a new one is refused (`_imp.create_builtin` would make a
  second `_signal` or `gc`, unlisted in sys.modules); an extension module must be the
  standard library's (no numpy or cffi reading memory by address) and not a hidden one.
  The spec is copied into a plain namespace first, so it cannot change between check and use."""

  def create_builtin(spec):
    raise ImportError("no new built-in module while a test runs")

  def dynamic(spec, file=None):
    name, origin = spec.name, spec.origin
    if type(name) is not str or type(origin) is not str:
      raise ImportError("an extension module needs a str name and origin")
    if name.partition(".")[0] in hidden or not normal_path(origin, getcwd()).startswith(
        dynload + "/"):
      raise ImportError(f"extension module {name} ({origin}): not allowed while a test runs")
    copy = namespace(name=name, origin=origin)
    return create_dynamic(copy) if file is None else create_dynamic(copy, file)

  return create_builtin, dynamic
'''


def guard_loaders(pristine):
  """Loads every built-in module, then puts `LOADERS`' makers into `_imp` (see there)."""
  import types  # pylint: disable=import-outside-toplevel
  for name in sys.builtin_module_names:
    if name not in HIDDEN:
      __import__(name)
  dynload = [normal_path(p, "/") for p in sys.path if p.endswith("lib-dynload")]
  scope = {"__builtins__": dict(pristine)}
  exec(LOADERS, scope)  # pylint: disable=exec-used
  _imp.create_builtin, _imp.create_dynamic = scope["make"](
      _imp.create_dynamic, types.SimpleNamespace, HIDDEN, dynload[0] if dynload else "/nowhere",
      normal_path, os.getcwd)


WORKER = '''
def serve(code, scope, entry, inbox, outbox, trash):
  """Runs the program, then calls its function on each request, in this thread."""
  try:
    exec(code, scope)
    fn = scope.get(entry)
    if fn is None and isinstance(scope.get("Solution"), type):
      fn = getattr(scope["Solution"](), entry, None)
  except BaseException as e:
    trash.append(e)
    outbox.put(("raised", type(e)))
    return
  if not callable(fn):
    outbox.put(("missing", None))
    return
  outbox.put(("ready", None))
  while True:
    args, kwargs = inbox.get()
    try:
      value = fn(*args, **kwargs)
    except BaseException as e:
      trash.append(e)
      outbox.put(("raised", type(e)))
      continue
    outbox.put(("returned", value))
'''


def run(raw):
  """Runs the job (JSON bytes `raw`) and writes `<nonce> <verdict> <detail>` to stdout, then
  ends the process: verdict "passed", "wrong" or "runtime_error"."""
  job = json.loads(raw)
  nonce, entry = job["nonce"], job["entry_point"]
  write, exit_now, sleep, count = os.write, os._exit, time.sleep, _thread._count
  flushes = (sys.stdout.flush, sys.stderr.flush)  # the streams' own (C) methods
  out = os.dup(1)
  os.dup2(2, 1)  # the program's prints go to stderr

  def report(verdict, detail=""):
    try:
      for flush in flushes:  # the prints so far, to stderr (os._exit drops buffers)
        try:
          flush()
        except Exception:  # pylint: disable=broad-except  # a stream the program closed
          pass
      write(out, f"{nonce} {verdict} {detail}".replace("\n", " ")[:500].encode() + b"\n")
    finally:
      exit_now(0)

  try:
    with open("main.py", encoding="utf-8") as f:
      program = compile(f.read(), "main.py", "exec")
  except (SyntaxError, ValueError) as e:
    report("runtime_error", f"{type(e).__name__}: {e}")
  setup = compile(job["setup"], "setup.py", "exec")
  test = compile(job["test"], "test.py", "exec")
  for name in imported_names([job["setup"], job["test"]]) + ["queue"]:
    try:
      __import__(name)
    except Exception:  # pylint: disable=broad-except  # the test will fail on it, as it should
      pass
  del job, raw
  reach = frozenset(sys.modules)  # before guard_loaders: see the module docstring
  pristine = dict(vars(builtins))
  guard_loaders(pristine)
  builtin_names = frozenset(pristine)
  exceptions = frozenset(v for v in pristine.values()
                         if type(v) is type and issubclass(v, BaseException))
  loaded = sys.modules
  for name in HIDDEN:  # the program would have to import them anew, which the hook refuses
    loaded.pop(name, None)
  main_module = loaded.get("__main__")
  if main_module is not None:  # the boot module's own reference
    vars(main_module).pop("signal", None)
  modules = snapshot(loaded, reach)
  classes = class_snapshot(modules)
  import queue  # pylint: disable=import-outside-toplevel  # C SimpleQueue: no code to patch
  inbox, outbox, trash, received, ours = queue.SimpleQueue(), queue.SimpleQueue(), [], [], []
  tampering = []
  worker_scope = {"__builtins__": dict(pristine)}
  exec(WORKER, worker_scope)  # pylint: disable=exec-used  # its globals are its own
  scope = {"__name__": "solution", "__builtins__": builtins}
  threads = count() + 1  # and the worker
  sys.addaudithook(make_hook(_thread.get_ident(), _thread.get_ident, os.getcwd))
  _thread.start_new_thread(worker_scope["serve"], (program, scope, entry, inbox, outbox, trash))

  def reply():
    message = outbox.get()
    received.append(message)  # kept: nothing of the program's is ever freed in this thread
    if type(message) is not tuple or len(message) != 2:
      raise Tampered("the worker was tampered with")
    return message

  def after_call():
    for _ in range(100):  # a thread the program joined may take a moment to be counted out
      if count() <= threads:
        break
      sleep(0.002)
    else:
      raise Tampered("the program left a thread running")
    what = changed(modules, (), loaded, builtin_names)
    if what:
      raise Tampered(f"the program changed what the test uses: {what}")

  def candidate(*args, **kwargs):
    inbox.put((args, kwargs))
    try:
      kind_, value_ = reply()
      after_call()
      if kind_ != "raised" and not plain(value_):
        raise Tampered(f"the program returned a {_name(type(value_))}, not a plain value")
    except Tampered as e:
      tampering.append(str(e))  # fails the run even if the test swallows the exception
      raise
    if kind_ == "raised":
      if type(value_) is type and value_ in exceptions:
        error = value_("raised by the program")
        ours.append(error)
        raise error
      raise CandidateRaised(f"the program raised {_name(value_)}")
    return value_

  kind, value = reply()
  if kind == "missing":
    report("runtime_error", f"the program defines no function {entry!r}")
  if kind != "ready":
    report("runtime_error", f"the program raised {_name(value)}")
  try:
    after_call()
  except Tampered as e:
    report("wrong", str(e))
  namespace = {"__name__": "__test__", "__builtins__": dict(pristine)}
  try:
    exec(setup, namespace)  # pylint: disable=exec-used  # trusted: the data set's own code
    namespace[entry] = candidate
    exec(test, namespace)  # pylint: disable=exec-used  # MBPP: the asserts run here
    check = namespace.get("check")
    if type(check) is type(run):
      check(candidate)
    what = changed(modules, classes, loaded, builtin_names)
    if what:
      raise Tampered(f"the program changed what the test uses: {what}")
    if tampering:
      raise Tampered(tampering[0])
  except AssertionError as e:
    report("wrong", f"an assert failed (test.py line {_innermost_line(e)})")
  except Tampered as e:
    report("wrong", str(e))
  except CandidateRaised as e:
    report("runtime_error", str(e))
  except BaseException as e:  # pylint: disable=broad-except  # an error is not a pass
    if any(e is error for error in ours):
      report("runtime_error", f"the program raised {_name(type(e))}")
    report("wrong", f"{_name(type(e))} in the test")
  report("passed")


def _name(cls):
  """A class's name without running any code of the program's (no metaclass lookups)."""
  if type(cls) is not type and not isinstance(cls, type):
    return "?"
  name = type.__dict__["__name__"].__get__(cls, type)
  return name if type(name) is str else "?"


def _innermost_line(error):
  """The line where the assert failed (tb_lineno; no frame is read)."""
  tb, line = error.__traceback__, "?"
  while tb is not None:
    line, tb = tb.tb_lineno, tb.tb_next
  return line
