"""What every launch script shares: its config flag, `--help`, one-line config errors, quiet logs.

    CONFIG = cli.define_config_flag("generate.py")
    def main(config: GenerateConfig): ...
    if __name__ == "__main__":
      cli.run(main, CONFIG, GenerateConfig)

`cli.run` parses the flags itself so that
  * `--config` takes a file or a shipped config's name (`--config=code_2agents`; also
    `launch.configs.code_2agents`, and `launch/configs/code_2agents.py` from any folder), so
    the console scripts (`marft-train`, ...) of an installed package find them from anywhere;
    an unknown name is one line listing the shipped ones;
  * `--help` prints the script's docstring, every config field with its value and its
    documentation (`launch.reference`, which writes docs/config.md from the same comments)
    and every flag the script takes, then exits 0 (absl's own `--help` exits 1 and knows
    nothing of the fields);
  * a bad override (`--config.xyz=1`, `--config.seed=abc`) or a value the typed config refuses
    is one line naming the key, and exit status 2, instead of a traceback;
  * INFO logs (e.g. JAX's "Unable to initialize backend 'tpu'") stay off the progress bars;
    `--verbosity=0` brings them back; a damaged checkpoint's error is not buried under the
    reports of tensorstore's reads still in flight (`sys.unraisablehook`, asyncio's log);
  * `--compilation_cache=DIR` keeps XLA's compiled programs in DIR (JAX's persistent cache), so
    a relaunch (a resume, an eval after training) loads them instead of compiling again.
  * `--retain_host_memory` keeps freed host memory in the process (`marft_jax.host_allocator`):
    large updates stop page-faulting their buffers anew at every step; off by default.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging as std_logging
import os
import sys
import textwrap
from typing import Any, Callable, Optional

from absl import app, flags, logging
from ml_collections import config_flags

from launch import reference
from marft_jax import host_allocator
from marft_jax.configs import from_config_dict

# Without torch (the library never needs it) transformers advises on import that "PyTorch was
# not found", in the middle of the progress bar.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", "", "a folder for JAX's persistent cache of compiled programs, shared "
    "by later launches (a resume, an eval); empty: off")
_RETAIN_HOST_MEMORY = flags.DEFINE_bool(
    "retain_host_memory", False, "keep freed host memory in the process (one glibc heap, never "
    "trimmed): big updates stop page-faulting their buffers anew at every step, compiles get "
    "slower; see marft_jax/host_allocator.py for when it pays")
_HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull", "-?")
_default_config_path = ""  # set by define_config_flag


def define_config_flag(file_name: str) -> flags.FlagHolder:
  """`--config`, defaulting to `launch/configs/<file_name>`, overridable as `--config.a.b=v`.

  A `--config=<name>` of `sys.argv` is rewritten there as the shipped file's path (what
  ml_collections reads), or is one line listing the shipped names (exit 2). ml_collections
  reads the `--config.` overrides of `sys.argv` right here, so an unknown key is reported
  (one line, exit 2) before it can raise from inside the flag definition.
  """
  global _default_config_path
  _default_config_path = os.path.join(CONFIG_DIR, file_name)
  for i, arg in enumerate(sys.argv[1:], 1):
    if arg.startswith("--config="):
      sys.argv[i] = "--config=" + config_file(arg.split("=", 1)[1])
  if not any(arg in _HELP_FLAGS for arg in sys.argv[1:]):
    unknown = _unknown_override(sys.argv)
    if unknown:
      fail(unknown)
  return config_flags.DEFINE_config_file(
      "config", _default_config_path,
      "Config file (see --help for its fields); override fields as --config.<key>=<value>.",
      lock_config=True)


def run(main: Callable[[Any], None], config_flag: flags.FlagHolder, config_cls: type,
        resolve: Optional[Callable[[Any], Any]] = None) -> None:
  """`app.run` that hands `main` the typed config (a `config_cls`) instead of argv.

  `resolve`: applied to the typed config before `main` (e.g. `config.resolve.resolve`, which fills
  the algorithm's keys); its ValueError is one line and exit status 2, like a bad key's."""
  def parse(argv: list[str]) -> list[str]:
    if any(arg in _HELP_FLAGS for arg in argv[1:]):
      # The script's docstring: its module's, whether it runs as `__main__` or a console script.
      try:
        print(_help_text(argv, config_cls, main.__globals__.get("__doc__"), main.__globals__),
              flush=True)
      except BrokenPipeError:  # `--help | head`: the reader stopped early, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      sys.exit(0)
    try:
      return flags.FLAGS(argv)
    except Exception as e:  # flags errors and ConfigDict's AttributeError/KeyError/TypeError
      fail(_unknown_override(argv) or _last_line(e))

  def typed_main(argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    sys.unraisablehook = _drop_closed_event_loop_reports
    std_logging.getLogger("asyncio").addFilter(_drop_failed_read_task_reports)
    if len(argv) > 1:
      fail(f"unexpected arguments: {' '.join(argv[1:])}")
    if _RETAIN_HOST_MEMORY.value:
      host_allocator.retain_freed_memory()
    if _COMPILATION_CACHE.value:
      enable_compilation_cache(_COMPILATION_CACHE.value)
    try:
      config = from_config_dict(config_cls, config_flag.value)
    except (ValueError, OSError) as e:  # OSError: the config file failed to load
      fail(_last_line(e))
    if resolve is not None:
      try:
        config = resolve(config)
      except ValueError as e:
        fail(f"config.{_last_line(e)}")
    main(config)

  app.run(typed_main, flags_parser=parse)


def _drop_closed_event_loop_reports(unraisable) -> None:
  """After a failed Orbax read (a damaged checkpoint) the reads still in flight finish on
  tensorstore's threads and each reports "Event loop is closed" here, a dozen tracebacks around
  the one error that says what is wrong. Those alone are dropped; anything else is printed."""
  error = unraisable.exc_value
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return
  sys.__unraisablehook__(unraisable)


def _drop_failed_read_task_reports(record: std_logging.LogRecord) -> bool:
  """The same reads still in flight, seen from asyncio: when one of their failed tasks is
  collected (at exit, or earlier: it depends on the garbage collector), asyncio logs "Task
  exception was never retrieved" with its traceback, the read error the one-line message
  already gave. Those alone (a tensorstore error, which names its spec) are dropped."""
  error = record.exc_info[1] if record.exc_info else None
  return not ("exception was never retrieved" in record.getMessage()
              and isinstance(error, (OSError, ValueError)) and "tensorstore_spec" in str(error))


def enable_compilation_cache(folder: str) -> None:
  """JAX's persistent compilation cache in `folder` (made if missing). JAX keeps only programs
  that took longer than `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` (default 1 s) to compile:
  the model's, not the many small eager ones."""
  make_folder("--compilation_cache", folder)
  import jax  # here: importing jax early would start its logging before absl's flags
  jax.config.update("jax_compilation_cache_dir", folder)


def make_folder(flag: str, folder: str) -> None:
  """Makes the folder a flag names (if missing) before anything slow, or one line naming the
  flag and why it cannot."""
  if os.path.exists(folder) and not os.path.isdir(folder):
    fail(f"{flag}={folder}: a file, not a folder")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    fail(f"{flag}={folder}: {e.strerror}")


@contextlib.contextmanager
def one_line_errors(*types: type):
  """Bad input found while the block runs (a missing or malformed problem file, model file
  or folder: the library's errors name the file, line, key or tensor) is one line, exit
  status 2, instead of a traceback. `--verbosity=1` logs the traceback too: a bug inside a
  loader raises the same types."""
  try:
    yield
  except types as e:
    logging.debug("the traceback of the error below", exc_info=True)
    fail(_last_line(e))


def shipped_configs() -> list[str]:
  """The names of the config files of launch/configs/, as `--config=<name>` takes them."""
  return sorted(name[:-3] for name in os.listdir(CONFIG_DIR)
                if name.endswith(".py") and name != "__init__.py")


def config_file(value: str) -> str:
  """The file `--config=<value>` reads: `value` where that is a file, else the shipped config
  it names as `grpo`, `launch.configs.grpo` or (a file of the repository, from a folder that
  has none) `launch/configs/grpo.py`; else one line listing the shipped names (exit 2)."""
  if os.path.isfile(value):
    return value
  name = value.removeprefix("launch.configs.")
  if os.path.normpath(value).startswith(os.path.join("launch", "configs", "")):
    name = os.path.basename(value).removesuffix(".py")
  if name in shipped_configs():
    return os.path.join(CONFIG_DIR, f"{name}.py")
  fail(f"--config={value}: no such config file, nor a shipped config's name (one of "
       f"{', '.join(shipped_configs())})")


def fail(message: str) -> None:
  """Prints `error: message` and exits with status 2 (a usage error, not a traceback)."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


# --- --help ----------------------------------------------------------------------------------


def _help_text(argv: list[str], config_cls: type, doc: Optional[str],
               script: dict[str, Any]) -> str:
  """The script's docstring, every key of the config file read (`launch.reference`: its value
  and documentation), then every flag the script takes. `script`: its module's globals."""
  path = _config_path(argv)
  lines = [(doc or "").strip(), ""]
  lines += _wrap(f"Config fields ({_config_name(path)}; override as --config.<key>=<value>; "
                 "docs/config.md lists each key's default):")
  lines += reference.help_lines(config_cls, _load_config_file(path))
  lines += ["", "Flags (override as --<flag>=<value>):"]
  lines += _flag_lines(script)
  return "\n".join(lines)


def _wrap(text: str, indent: str = "") -> list[str]:
  return textwrap.wrap(text, width=reference.WIDTH, initial_indent=indent,
                       subsequent_indent=indent, break_long_words=False,
                       break_on_hyphens=False)


def _flag_lines(script: dict[str, Any]) -> list[str]:
  """Every flag of absl's registry: the script's own (the flags its module defines), this
  module's and --verbosity with their defaults and help, then the names of the rest (absl's
  and the libraries')."""
  holders = [v for v in script.values() if isinstance(v, flags.FlagHolder)]
  holders += [_COMPILATION_CACHE, _RETAIN_HOST_MEMORY]
  lines, shown = [], set()
  for name in dict.fromkeys(h.name for h in holders):
    flag = flags.FLAGS[name]
    if name == "config":
      default = os.path.basename(_default_config_path).removesuffix(".py")
      text = (f"a shipped config: {', '.join(shipped_configs())}; or a config file (.py). Its "
              "fields, above, are overridden as --config.<key>=<value>.")
    else:
      default, text = _flag_default(flag.default), flag.help
    lines += reference.flag_lines(name, default, text)
    shown.add(name)
  lines += reference.flag_lines("verbosity", str(flags.FLAGS["verbosity"].default), _VERBOSITY)
  shown.add("verbosity")
  module_of = {flag.name: module for module, module_flags in
               flags.FLAGS.flags_by_module_dict().items() for flag in module_flags}
  rest = sorted({flags.FLAGS[name].name for name in flags.FLAGS} - shown)
  libraries = sorted({module_of.get(name, "absl").split(".")[0] for name in rest})
  lines += _wrap(f"Also taken ({' and '.join(lib + chr(39) + 's' for lib in libraries)}): "
                 + ", ".join(f"--{name}" for name in rest) + ".", indent="  ")
  return lines


_VERBOSITY = ("-1: warnings and errors only (INFO logs would break into the progress bars); "
              "0: INFO logs too; 1: also the traceback of a one-line error")


def _flag_default(value: Any) -> Optional[str]:
  """A flag's default as the command line writes it (None: no default, the flag is unset)."""
  if value is None:
    return None
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, str):
    return value if value and " " not in value else repr(value)
  return str(value)


def _config_name(path: str) -> str:
  """How --help names the config: a shipped one by its name and place in the package."""
  folder, file_name = os.path.split(os.path.abspath(path))
  if folder == os.path.abspath(CONFIG_DIR) and file_name[:-3] in shipped_configs():
    return f"{file_name[:-3]}, launch/configs/{file_name}"
  return f"file {os.path.relpath(path)}"


# --- flag errors -------------------------------------------------------------------------------


def _config_path(argv: list[str]) -> str:
  for arg in argv[1:]:
    if arg.startswith("--config="):
      return config_file(arg.split("=", 1)[1])
  return _default_config_path


def _load_config_file(path: str) -> Any:
  spec = importlib.util.spec_from_file_location("_launch_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _unknown_override(argv: list[str]) -> str:
  """'' if every `--config.a.b=v` names a field of the config file, else a one-line error."""
  config = None
  for arg in argv[1:]:
    if not arg.startswith("--config.") or "=" not in arg:
      continue
    config = _load_config_file(_config_path(argv)) if config is None else config
    key = arg[len("--config."):].split("=", 1)[0]
    node, walked = config, "config"
    for part in key.split("."):
      if not hasattr(node, "keys") or part not in node:
        allowed = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "(no fields)"
        return f"--config.{key}: unknown key {part!r} in {walked}; allowed: {allowed}"
      node, walked = node[part], f"{walked}.{part}"
  return ""


def _last_line(error: Exception) -> str:
  lines = str(error).strip().splitlines()
  return lines[-1] if lines else type(error).__name__
