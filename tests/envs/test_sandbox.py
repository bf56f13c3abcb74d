"""The sandbox contains hostile programs and reports how each ended, in every mode here.

Each test runs in plain mode and, where bubblewrap is installed (and MARFT_TEST_SANDBOX_MODE
is not "plain", below), in bwrap mode. Limits are small (1-2 s, 256 MiB) so that the whole
file stays fast. After a run, no process that the sandbox started may be left: every
sandboxed interpreter carries the boot code, and so the start mark, on its command line
(`_leftovers`).
"""

import ast
import concurrent.futures
import dataclasses
import functools
import glob
import json
import os
import pwd
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

from marft_jax.envs.code_env import CodeEnv, CodeProblem, CodeTest
from marft_jax.envs.sandbox import Job, Limits, Plan, Sandbox, Status, boot, isolation

LIMITS = Limits(wall_s=2.0, memory_mb=256, processes=4, file_mb=1, stdout_bytes=10_000,
                stderr_bytes=2_000)
MODES = ["plain", "bwrap"]
# MARFT_TEST_SANDBOX_MODE=plain runs the tests as on a host without bubblewrap even where it
# is installed (CI's second run, .ci/run): the "strongest mode here" sandboxes of the test
# files take `AUTO_MODE`, and every bwrap run skips. Read here, by the tests, only: the
# library's own way to ask for a mode is `Sandbox(mode=...)` (`task.sandbox.mode`).
AUTO_MODE = os.environ.get("MARFT_TEST_SANDBOX_MODE", "auto")
if AUTO_MODE not in ("auto", "plain"):
  raise ValueError(f"MARFT_TEST_SANDBOX_MODE={AUTO_MODE!r}: must be 'auto' or 'plain'")
FORK_BOMB = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
# Forks sleeping children until fork fails; prints how many it got.
COUNT_CHILDREN = ("import os, time\nn = 0\nfor _ in range(50):\n  try:\n    pid = os.fork()\n"
                  "  except OSError:\n    break\n  if pid == 0:\n    time.sleep(30)\n"
                  "    os._exit(0)\n  n += 1\nprint(n)\n")


@functools.lru_cache(maxsize=None)
def bwrap_works() -> bool:
  """Whether bwrap can make namespaces here, asked of bwrap itself (not of the sandbox, so
  that a broken sandbox fails its tests instead of skipping them)."""
  if shutil.which("bwrap") is None:
    return False
  argv = ["bwrap", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "true"]
  return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def sandbox_or_skip(mode, limits=LIMITS, **kwargs):
  if mode == "bwrap" and AUTO_MODE == "plain":
    pytest.skip("MARFT_TEST_SANDBOX_MODE=plain: the bwrap runs skip, as without bubblewrap")
  if mode == "bwrap" and not bwrap_works():
    pytest.skip("bubblewrap is not installed (apt-get install bubblewrap) or cannot make "
                "namespaces here")
  return Sandbox(limits, mode=mode, **kwargs)


_EXTRA = []  # sandboxes made inside a test, closed after it


def _sandbox(mode, limits=LIMITS, **kwargs):
  sandbox = sandbox_or_skip(mode, limits, **kwargs)
  _EXTRA.append(sandbox)
  return sandbox


@pytest.fixture(autouse=True)
def _close_extra_sandboxes():
  yield
  while _EXTRA:
    _EXTRA.pop().close()


@pytest.fixture(scope="module", params=MODES)
def box(request):
  sandbox = sandbox_or_skip(request.param)
  yield sandbox
  sandbox.close()


def _leftovers():
  """Live processes whose command line holds the sandbox's boot code."""
  pids = []
  for path in glob.glob("/proc/[0-9]*/cmdline"):
    try:
      with open(path, "rb") as f:
        if b"marft-sandbox-started" in f.read():
          pids.append(int(path.split("/")[2]))
    except OSError:
      pass  # exited meanwhile
  return pids


def assert_no_leftovers():
  until = time.monotonic() + 2.0
  while _leftovers() and time.monotonic() < until:
    time.sleep(0.05)
  assert _leftovers() == []


# --- ordinary programs ---

def test_program_reads_stdin(box):
  result = box.run("import sys\nprint(sys.stdin.read().strip()[::-1])", "abc\n")
  assert (result.status, result.stdout, result.exit_code) == (Status.OK, "cba\n", 0)


def test_call_returns_json_and_keeps_prints_apart(box):
  result = box.call("def add(a, b):\n  print('noise')\n  return a + b", "add", [2, 3])
  assert result.status == Status.OK, result
  assert json.loads(result.stdout) == 5
  assert "noise" in result.stderr


def test_call_finds_a_solution_class(box):
  source = "class Solution:\n  def twice(self, xs):\n    return xs + xs\n"
  assert json.loads(box.call(source, "twice", [[1, 2]]).stdout) == [1, 2, 1, 2]


@pytest.mark.parametrize("source, needle", [
    ("raise ValueError('boom')", "ValueError: boom"),
    ("def f(:\n  pass", "SyntaxError"),
    ("import sys\nsys.exit(3)", ""),
])
def test_errors_are_runtime_errors(box, source, needle):
  result = box.run(source)
  assert result.status == Status.RUNTIME_ERROR and result.exit_code != 0
  assert needle in result.stderr


def test_call_of_a_missing_function(box):
  result = box.call("x = 1", "solve", [])
  assert result.status == Status.RUNTIME_ERROR and "NameError" in result.stderr


def test_environment_holds_none_of_the_trainers_paths(box):
  source = ("import json, os, sys\n"
            "try:\n  import marft_jax\n  found = True\nexcept ImportError:\n  found = False\n"
            "print(json.dumps([sorted(os.environ), sys.path, os.getcwd(), os.environ['HOME'],"
            " found, sys.flags.isolated, sys.flags.no_site]))")
  result = box.run(source)
  assert result.status == Status.OK, result
  env, path, cwd, home, found, isolated, no_site = json.loads(result.stdout)
  # PWD: bwrap sets it to the work directory; LC_CTYPE: Python may set it from LANG.
  assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PWD"}
  assert not any("site-packages" in p for p in path)
  assert cwd == home and not found and isolated and no_site


def test_work_directory_is_writable_and_removed(box):
  before = set(glob.glob(os.path.join(tempfile.gettempdir(), "marft-sandbox-*")))
  source = ("import os\nopen('note.txt', 'w').write('kept')\nos.mkdir('locked')\n"
            "open('locked/x', 'w').write('x')\nos.chmod('locked', 0)\n"
            "print(open('note.txt').read())")
  result = box.run(source)
  assert (result.status, result.stdout) == (Status.OK, "kept\n"), result
  after = set(glob.glob(os.path.join(tempfile.gettempdir(), "marft-sandbox-*")))
  assert after <= before


# --- hostile programs: each ends within its limits, reported as what it was ---

@pytest.mark.parametrize("source", ["while True:\n  pass", "import time\ntime.sleep(60)"])
def test_infinite_loop_and_sleep_time_out(box, source):
  start = time.monotonic()
  result = box.run(source, timeout_s=1.0)
  assert result.status == Status.TIMEOUT and "wall-clock" in result.detail
  assert time.monotonic() - start < 3.0
  assert result.stderr == ""  # the program wrote none, and the stop made the wrapper write none
  assert_no_leftovers()


@pytest.mark.parametrize("source, ends_after_s", [
    ("while True:\n  pass", 1),  # SIGXCPU at 1 s
    ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n  pass",
     2),  # SIGKILL at the hard limit, a second later
])
def test_cpu_limit_is_a_timeout(box, source, ends_after_s):
  sandbox = _sandbox(box.mode, dataclasses.replace(LIMITS, wall_s=6.0, cpu_s=1))
  start = time.monotonic()
  result = sandbox.run(source)
  assert result.status == Status.TIMEOUT and result.detail == "CPU limit 1s", result
  assert time.monotonic() - start >= ends_after_s  # CPU seconds never outrun wall seconds


def test_a_signal_ends_the_program_and_is_named(box):
  # In plain mode the program would be PID 1 of its namespace without the boot code's init,
  # and a PID 1 ignores SIGTERM: it would sleep on into the wall-clock limit.
  result = box.run("import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\n"
                   "time.sleep(5)")
  assert result.status == Status.RUNTIME_ERROR and result.detail == "killed by signal 15"


def test_fork_bomb_is_contained(box):
  start = time.monotonic()
  result = box.run(FORK_BOMB, timeout_s=1.5)
  assert result.status == Status.TIMEOUT
  assert time.monotonic() - start < 4.0
  assert_no_leftovers()


def _counts_only_the_program(plan):
  """Whether RLIMIT_NPROC counts the program's processes alone: with an own uid (as root),
  or in a user namespace (not root). As root without an own uid it does not apply."""
  return plan.drop_uid or (plan.namespaces and os.geteuid() != 0)


def test_process_count_is_limited(box):
  if os.geteuid() == 0 and not box.plan.drop_uid:
    pytest.skip("RLIMIT_NPROC does not apply to root (see guarantees)")
  result = box.run(COUNT_CHILDREN)
  assert result.status == Status.OK, result
  if _counts_only_the_program(box.plan):
    assert int(result.stdout) == LIMITS.processes
  else:  # the user's other processes count too
    assert int(result.stdout) <= LIMITS.processes
  assert_no_leftovers()  # the sleeping children were killed


def test_a_fork_bomb_leaves_the_next_run_its_whole_allowance(box):
  if not _counts_only_the_program(box.plan):
    pytest.skip("RLIMIT_NPROC also counts other processes of the uid, or does not apply")
  sandbox = _sandbox(box.mode, max_parallel=1)  # as root, one uid: the bomb's
  assert sandbox.run(FORK_BOMB, timeout_s=1.0).status == Status.TIMEOUT
  for _ in range(3):
    result = sandbox.run(COUNT_CHILDREN)
    assert (result.status, result.stdout) == (Status.OK, f"{LIMITS.processes}\n"), result


def test_descendants_that_leave_the_group_are_killed(box):
  if not (box.plan.namespaces or box.plan.drop_uid):
    pytest.skip("this plan cannot reach processes that leave the group (see guarantees)")
  source = ("import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(30)\n"
            "  os._exit(0)\nprint('parent done')\n")
  result = box.run(source)
  assert result.status == Status.OK
  assert_no_leftovers()


@pytest.mark.parametrize("source", ["x = bytearray(10 * 1024 ** 3)",
                                    "xs = []\nwhile True:\n  xs.append(bytearray(10 ** 7))"])
def test_huge_allocations_fail_inside(box, source):
  # The loop writes the whole allowance (256 MiB) before the limit stops it: on a host short
  # of memory that took CI past the 2 s wall. The limit under test is the address space, so
  # the wall is wide; a program the limit fails to stop still ends, as TIMEOUT.
  result = box.run(source, timeout_s=30.0)
  assert result.status == Status.RUNTIME_ERROR and "MemoryError" in result.stderr


def test_stdout_flood_stops_at_the_cap(box):
  start = time.monotonic()
  result = box.run("while True:\n  print('y' * 1000)")
  assert result.status == Status.OUTPUT_LIMIT
  assert len(result.stdout) <= LIMITS.stdout_bytes
  assert time.monotonic() - start < LIMITS.wall_s


def test_stderr_flood_keeps_only_the_tail(box):
  result = box.run("import sys\nwhile True:\n  sys.stderr.write('e' * 1000)", timeout_s=1.0)
  assert result.status == Status.TIMEOUT and len(result.stderr) <= LIMITS.stderr_bytes


def test_file_size_limit(box):
  result = box.run("open('big', 'wb').write(b'x' * (2 << 20))")
  assert result.status == Status.RUNTIME_ERROR and "File too large" in result.stderr


@pytest.mark.parametrize("guard", [True, False])
def test_no_network(box, guard):
  if not guard and box.plan.mode == "plain" and not box.plan.namespaces:
    pytest.skip("without namespaces only the audit hook guards the network")
  sandbox = box if guard else _sandbox(box.mode, guard=False)
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.3)
    port = server.getsockname()[1]
    result = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)\n"
                         "print('connected')")
    assert result.status == Status.RUNTIME_ERROR and "connected" not in result.stdout
    with pytest.raises(socket.timeout):
      server.accept()


@pytest.mark.parametrize("guard", [True, False])
def test_no_writes_outside_the_work_directory(box, tmp_path, guard):
  if not guard and not (box.plan.drop_uid or box.plan.mode == "bwrap"):
    pytest.skip("without an own uid or bwrap only the audit hook guards the files")
  sandbox = box if guard else _sandbox(box.mode, guard=False)
  target = tmp_path / "trainer_file.txt"
  for source in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))"):
    result = sandbox.run(source)
    assert result.status == Status.RUNTIME_ERROR, result
    assert not target.exists()


def test_bwrap_shows_no_host_files(tmp_path):
  sandbox = _sandbox("bwrap")
  secret = tmp_path / "secret.txt"
  secret.write_text("x")
  for path in (str(secret), "/etc/passwd", os.path.expanduser("~/.bashrc")):
    result = sandbox.run(f"print(open({path!r}).read())")
    assert result.status == Status.RUNTIME_ERROR and "FileNotFoundError" in result.stderr
  unguarded = _sandbox("bwrap", guard=False)
  for path in ("/usr/pwned", "/pwned", "/tmp/pwned", "/proc/pwned"):
    result = unguarded.run(f"open({path!r}, 'w')")
    assert result.status == Status.RUNTIME_ERROR and "Error" in result.stderr, path


# --- batches, budgets, failures of the sandbox itself ---

def _most_at_once(intervals):
  """The largest number of (start, end) intervals that contain one instant."""
  return max(sum(s <= start < e for s, e in intervals) for start, _ in intervals)


def test_run_many_runs_in_parallel(box):
  # Each job reports when it ran, so the test reads the overlap itself rather than the
  # batch's wall time (which a loaded host stretches).
  jobs = [Job("import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())")] * 4
  results = box.run_many(jobs)
  assert [r.status for r in results] == [Status.OK] * 4
  intervals = [tuple(map(float, r.stdout.split())) for r in results]
  assert _most_at_once(intervals) == box.max_parallel == 2


_TIMED = Job("import time\nstart = time.time()\ntime.sleep(1.5)\nprint(start, time.time())")


def _intervals(results):
  assert [r.status for r in results] == [Status.OK] * len(results), results
  return [tuple(map(float, r.stdout.split())) for r in results]


def test_run_many_parallel_bounds_one_call_and_calls_share_the_sandbox(box):
  """`parallel=k`: at most k of the call's jobs at once; two calls of 2 from two threads on a
  sandbox of 4 each run 2 at once, and the sandbox 4 (as each call would alone)."""
  four = _sandbox(box.mode, max_parallel=4)
  assert _most_at_once(_intervals(four.run_many([_TIMED] * 4, parallel=1))) == 1
  assert _most_at_once(_intervals(four.run_many([_TIMED] * 4, parallel=2))) == 2
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    calls = list(pool.map(lambda _: _intervals(four.run_many([_TIMED] * 2, parallel=2)),
                          range(2)))
  assert [_most_at_once(c) for c in calls] == [2, 2]
  assert _most_at_once(calls[0] + calls[1]) == 4
  with pytest.raises(ValueError, match=r"run_many parallel=0: must be a positive int"):
    four.run_many([_TIMED], parallel=0)


def test_run_many_budget_bounds_the_batch(box):
  start = time.monotonic()
  results = box.run_many([Job("import time\ntime.sleep(30)")] * 5, budget_s=1.0)
  assert [r.status for r in results] == [Status.TIMEOUT] * 5
  assert time.monotonic() - start < 3.0
  assert_no_leftovers()


def test_a_sandbox_that_cannot_start_the_program_says_so(box):
  sandbox = _sandbox(box.mode, dataclasses.replace(LIMITS, memory_mb=1))
  result = sandbox.run("print(1)")
  assert result.status == Status.SANDBOX_ERROR and result.detail


def test_no_working_plan_raises():
  with pytest.raises(RuntimeError, match="no sandbox plan works"):
    Sandbox(LIMITS, mode="plain", python="/nonexistent/python3").run("print(1)")


@pytest.mark.parametrize("kwargs, key", [
    (dict(wall_s=0), "wall_s"), (dict(memory_mb=0), "memory_mb"), (dict(cpu_s=-1), "cpu_s"),
    (dict(processes=1.5), "processes"), (dict(open_files=8), "open_files")])
def test_limits_refuse_bad_values_by_name(kwargs, key):
  with pytest.raises(ValueError, match=key):
    Limits(**kwargs)


def test_sandbox_refuses_bad_arguments_by_name():
  with pytest.raises(ValueError, match="mode"):
    Sandbox(mode="docker")
  with pytest.raises(ValueError, match="max_parallel"):
    Sandbox(max_parallel=0)


def test_guarantees_name_the_mode(box):
  assert box.guarantees[0] == f"mode={box.plan.mode}"
  assert box.plan.mode == box.mode


def test_auto_mode_prefers_bwrap():
  sandbox = _sandbox("auto")
  assert sandbox.plan.mode == ("bwrap" if bwrap_works() else "plain")


def test_the_trainer_never_forks_with_python_code_in_the_child(box):
  # JAX warns at every fork of its (multithreaded) process once its backend is up, through
  # os.register_at_fork, which runs only where Python code runs in the child (a preexec_fn).
  import jax  # pylint: disable=import-outside-toplevel
  jax.devices()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    subprocess.run(["true"], preexec_fn=lambda: None, check=True)  # the detector works
    assert any("fork" in str(w.message) for w in caught)
    caught.clear()
    assert box.run("print(1)").status == Status.OK
    assert box.run_many([Job("print(2)")] * 2)[1].stdout == "2\n"
  assert [str(w.message) for w in caught] == []


# --- the boot program, a module of its own ---

@pytest.mark.parametrize("name", ["boot", "kill_uid"])
def test_helper_programs_use_the_standard_library_only(name):
  """They run in `python -I -S`, as another uid or inside bwrap: no site-packages, and
  this package's folder may be invisible there."""
  tree = ast.parse(isolation.program_source(name))
  imported = {alias.name.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.Import) for alias in node.names}
  imported |= {node.module.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom)}
  assert imported and imported <= set(sys.stdlib_module_names), imported


@pytest.mark.skipif(os.geteuid() != 0, reason="the sweep switches uid: root only")
def test_the_uid_sweep_works_where_the_uid_cannot_read_the_trainers_python(caplog):
  """The sweeper starts as root with the trainer's interpreter, whose library the uid may not
  read (here, a Python under /root) and so imports nothing after the switch (was: a codec for
  /proc's files, a LookupError, and so no sweep after a run without a PID namespace)."""
  sandbox = _sandbox("plain")
  uid = next(u for u in range(sandbox.uid_base + 4095, sandbox.uid_base, -1)
             if u not in {entry.pw_uid for entry in pwd.getpwall()})
  with caplog.at_level("WARNING", logger="marft_jax.envs.sandbox"):
    sandbox._kill_uid(uid)  # pylint: disable=protected-access
  assert not caplog.records, caplog.records[0].getMessage()


@pytest.mark.parametrize("event, args", [
    ("socket.connect", (None, ("example.com", 80))), ("subprocess.Popen", ("ls", [], None, None)),
    ("os.exec", ("/bin/sh", [], None)), ("ctypes.dlopen", ("libc.so.6",)),
    ("os.kill", (1, 9)), ("open", ("/etc/passwd", "w", 0)),
    ("open", ("/etc/passwd", None, os.O_WRONLY)), ("os.remove", ("/etc/passwd", None)),
    ("os.rename", ("inside.txt", "/tmp/outside.txt", None, None))])
def test_guard_refuses(tmp_path, event, args):
  guard = boot.Guard(str(tmp_path))
  cwd = os.getcwd()
  os.chdir(tmp_path)  # relative paths are the work directory's
  try:
    with pytest.raises(PermissionError):
      guard(event, args)
  finally:
    os.chdir(cwd)


@pytest.mark.parametrize("event, args", [
    ("open", ("/etc/passwd", "r", os.O_RDONLY)), ("open", ("out.txt", "w", 0)),
    ("open", (os.devnull, "w", 0)), ("open", (3, "w", 0)), ("os.kill", (0, 15)),
    ("os.mkdir", ("sub", 0o777, None)), ("import", ("json", None, [], [], []))])
def test_guard_allows(tmp_path, event, args):
  if event == "os.kill":
    args = (os.getpid(), args[1])
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    boot.Guard(str(tmp_path))(event, args)
  finally:
    os.chdir(cwd)


def test_a_link_out_of_the_work_directory_is_outside(tmp_path):
  os.symlink("/etc", tmp_path / "escape")
  assert boot.inside(str(tmp_path / "file"), str(tmp_path))
  assert not boot.inside(str(tmp_path / "escape" / "passwd"), str(tmp_path))
  assert not boot.inside(str(tmp_path) + "-sibling", str(tmp_path))


def test_set_limits_stays_under_the_hard_ceiling(monkeypatch):
  ceilings = {resource.RLIMIT_AS: (100, 100), resource.RLIMIT_CPU: (5, resource.RLIM_INFINITY)}
  calls = {}
  monkeypatch.setattr(boot.resource, "getrlimit", lambda which: ceilings[which])
  monkeypatch.setattr(boot.resource, "setrlimit", lambda which, pair: calls.update({which: pair}))
  boot.set_limits([("RLIMIT_AS", 50, 500), ("RLIMIT_CPU", 3, 4)])
  assert calls == {resource.RLIMIT_AS: (50, 100), resource.RLIMIT_CPU: (3, 4)}


def _boot_from_its_file(tmp_path, source, function=None, stdin=""):
  (tmp_path / "main.py").write_text(source)
  config = dict(rlimits=[["RLIMIT_CORE", 0, 0]], uid=None, init=False, guard=True,
                function=function)
  return subprocess.run([sys.executable, "-I", "-S", "-B", boot.__file__, json.dumps(config)],
                        cwd=tmp_path, input=stdin.encode(), capture_output=True, timeout=30,
                        check=False)


def test_boot_runs_a_program_from_its_file(tmp_path):
  done = _boot_from_its_file(tmp_path, "print(input()[::-1])", stdin="abc\n")
  assert done.returncode == 0 and done.stdout == b"cba\n"
  assert done.stderr.startswith(boot.MARK)
  called = _boot_from_its_file(tmp_path, "def f(a, b):\n  print('noise')\n  return [a, b]",
                               function="f", stdin="[1, 2]")
  assert called.stdout == b"[1, 2]" and called.stderr == boot.MARK + b"noise\n"
  refused = _boot_from_its_file(tmp_path, "open('/tmp/x-marft-boot-test', 'w')")
  assert refused.returncode == 1 and b"PermissionError" in refused.stderr
  assert not os.path.exists("/tmp/x-marft-boot-test")


# --- falling back to a weaker mode ---

def test_fallback_names_what_a_weaker_plan_loses():
  root = os.geteuid() == 0
  python = "/usr/bin/python3"
  assert isolation.fallback("plain", Plan("plain", python, root, True)) is None
  assert isolation.fallback("bwrap", Plan("bwrap", python, root, True)) is None
  weaker = isolation.fallback("plain", Plan("plain", python, root, False),
                              [(Plan("plain", python, root, True), "sandbox_error boom")])
  assert "no network or PID namespace" in weaker and "boom" in weaker
  assert "bwrap" in isolation.fallback("auto", Plan("plain", python, root, True))


def test_a_fallback_is_a_warning_and_a_metric(monkeypatch, caplog):
  which = shutil.which
  monkeypatch.setattr(isolation.shutil, "which",
                      lambda name, **kw: None if name == "bwrap" else which(name, **kw))
  sandbox = _sandbox("auto")
  with caplog.at_level("INFO", logger="marft_jax.envs.sandbox"):
    assert sandbox.run("print(1)").stdout == "1\n"
  warnings_ = [r for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings_) == 1 and "bwrap is not installed" in warnings_[0].getMessage()
  assert sandbox.plan.mode == "plain" and "bwrap" in sandbox.fallback
  problem = CodeProblem("one", "Print 1.", (CodeTest(output="1\n"),))
  env = CodeEnv([problem], sandbox=sandbox, test_timeout_s=2.0)
  env.reset(0)
  step = env.step({"coder": "```python\nprint(1)\n```"})
  assert step.rewards["coder"] == 1.0 and step.info["metrics"]["code_sandbox_fallback"] == 1.0
