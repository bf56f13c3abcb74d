"""`team.profiles`: the original MARFT's profile files (train/config/profile_files.py).

The fixtures (tests/fixtures/profiles/math_{dual,trio,quartet,octet}.json) have the shapes of
the original's four math profiles, with prompts written here. Each builds the team a config
file declaring the same roles in team.roles builds, records the same config, and a malformed
file is one line naming the file, the entry and the field."""

import json
import logging
import os
import subprocess
import sys

import pytest

from marft_jax.configs import to_config_dict
from marft_jax.train.config import profile_files
from marft_jax.train.config import saved as saved_config
from marft_jax.train.build import team as team_lib
from marft_jax.train.checkpoint import config_fingerprint
from tests.train.echo_config import from_default_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "profiles")
# name: (roles in order, the with_answer ones), as the original's files have them
SHAPES = {
    "math_dual": (("reasoner", "actor"), ("actor",)),
    "math_trio": (("reasoner", "actor", "verifier"), ("actor",)),
    "math_quartet": (("problem_decomposer", "planner", "executor", "verifier"), ("executor",)),
    "math_octet": (("input_parser", "subproblem_generator", "method_selector", "step_solver",
                    "numeric_evaluator", "symbolic_manipulator", "result_verifier",
                    "aggregator_explainer"), ("aggregator_explainer",)),
}

# The default config file (launch/configs/train.py) with a profile file's team declared in
# team.roles, written out by hand (the reader's mapping, independently: role -> name, prompt ->
# system_prompt, with_answer -> graded, every other key at its default).
_EXPLICIT = '''
from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TeamSection, TrainConfig

def get_config():
  roles = tuple(RoleSection(p["role"], system_prompt=p["prompt"], graded=p["with_answer"])
                for p in {entries!r})
  return to_config_dict(TrainConfig(algorithm="marft_a", team=TeamSection(
      roles=roles, order=",".join(r.name for r in roles)), eval_every=8, eval_episodes=64))
'''


def _fixture(name):
  return os.path.join(FIXTURES, f"{name}.json")


def _explicit_config(tmp_path, entries, overrides):
  from launch.cli import _load_config_file
  from tests.train.echo_config import resolved
  path = tmp_path / "explicit.py"
  path.write_text(_EXPLICIT.format(entries=[
      {k: v for k, v in e.items() if k != "device"} for e in entries]))
  return resolved(_load_config_file(str(path)), overrides)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_profile_file_builds_the_team_of_the_equivalent_config_file(name, tmp_path):
  with open(_fixture(name)) as f:
    entries = json.load(f)
  overrides = {"team.max_new_tokens": 32, "task.name": "math_jsonl"}
  # `--config.team.profiles=<file>` on the default config file (whose reasoner -> actor team
  # the file replaces), and a config file spelling the same roles out.
  from_file = from_default_file({**overrides, "team.profiles": _fixture(name)})
  explicit = _explicit_config(tmp_path, entries, overrides)
  assert from_file == explicit
  assert from_file.team.profiles == ""  # read once: the roles are the record
  recorded = [to_config_dict(saved_config.as_recorded(c)).to_dict() for c in (from_file, explicit)]
  assert recorded[0] == recorded[1]
  assert config_fingerprint(recorded[0]) == config_fingerprint(recorded[1])
  team, structure = team_lib.build_team(from_file)
  assert (team, structure) == team_lib.build_team(explicit)
  order, answering = SHAPES[name]
  assert tuple(p.role for p in team) == order and from_file.team.num_roles == len(order)
  assert tuple(p.role for p in team if p.graded) == answering
  assert [p.system_prompt for p in team] == [e["prompt"] for e in entries]
  assert all(p.sampling.max_new_tokens == (16 if p is team[-1] else 32) for p in team)
  assert from_file.num_adapters == len(order)  # one "own" adapter a role


def test_every_with_answer_role_is_graded(tmp_path):
  """The original scores the mean over with_answer agents; so do the environments here over
  graded roles (envs.MathEnv, tests/envs/test_math_env.py)."""
  path = tmp_path / "two.json"
  path.write_text(json.dumps([{"role": "a", "prompt": "A.", "with_answer": True},
                              {"role": "b", "prompt": "B.", "with_answer": False},
                              {"role": "c", "prompt": "C.", "with_answer": True}]))
  roles = profile_files.read_profiles(str(path))
  assert [(r.name, r.graded) for r in roles] == [("a", True), ("b", False), ("c", True)]


def test_device_is_ignored_with_one_warning_naming_the_file(caplog):
  with caplog.at_level(logging.WARNING):
    profile_files.read_profiles(_fixture("math_dual"))
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warned == [f"team.profiles={_fixture('math_dual')!r}: 'device' is ignored (entries "
                    "0, 1): mesh.* places the models"]
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    profile_files.read_profiles(_fixture("math_trio"))  # no device field: nothing to say
  assert not [r for r in caplog.records if r.levelno == logging.WARNING]


_GOOD = {"role": "actor", "prompt": "Answer.", "with_answer": True}


@pytest.mark.parametrize("content,message", [
    ("[", "not a JSON file (Expecting value: line 1 column 2 (char 1))"),
    ("{}", "a profile file is a non-empty JSON list of agent profiles (role, prompt, "
     "with_answer), got an object"),
    ("[]", "a profile file is a non-empty JSON list of agent profiles (role, prompt, "
     "with_answer), got an empty list"),
    ([_GOOD, "actor"], "entry 1: an agent profile is a JSON object, got \"actor\""),
    ([_GOOD, {"role": "b", "with_answer": False}], "entry 1: field 'prompt' is missing"),
    ([{**_GOOD, "with_answer": "yes"}], "entry 0: field 'with_answer' must be a JSON boolean, "
     "got \"yes\""),
    ([{**_GOOD, "role": 3}], "entry 0: field 'role' must be a JSON string, got 3"),
    ([{**_GOOD, "with_answers": True}], "entry 0: field 'with_answers' is not a profile field "
     "(one of role, prompt, with_answer, device)"),
    ([{**_GOOD, "role": "the actor"}], "entry 0: field 'role': 'the actor': a role name uses "
     "letters, digits, '-' or '_'"),
    ([_GOOD, _GOOD], "entry 1: field 'role': 'actor' is also entry 0's (role names are unique "
     "in a team)"),
    ([{**_GOOD, "with_answer": False}], "no entry has with_answer true (mark the role(s) whose "
     "answer the environment scores)"),
])
def test_a_malformed_file_names_the_file_the_entry_and_the_field(content, message, tmp_path):
  path = tmp_path / "team.json"
  path.write_text(content if isinstance(content, str) else json.dumps(content))
  with pytest.raises(ValueError) as info:
    from_default_file({"team.profiles": str(path)})
  assert str(info.value) == f"team.profiles={str(path)!r}: {message}"


def test_a_missing_file_and_a_team_the_other_keys_refuse_name_the_key(tmp_path):
  missing = str(tmp_path / "none.json")
  with pytest.raises(ValueError, match=rf"^team.profiles='{missing}': No such file"):
    from_default_file({"team.profiles": missing})
  with pytest.raises(ValueError, match=r"^team.profiles='.*math_trio.json': num_roles=2 but "
                                       r"order='reasoner,actor,verifier' has 3 roles"):
    from_default_file({"team.profiles": _fixture("math_trio"), "team.num_roles": 2})


def test_the_launch_shows_a_malformed_file_as_one_line(tmp_path):
  path = tmp_path / "team.json"
  path.write_text(json.dumps([_GOOD, {"role": "b", "prompt": "B.", "with_answer": 1}]))
  out = subprocess.run([sys.executable, "-m", "launch.train", f"--workdir={tmp_path / 'run'}",
                        f"--config.team.profiles={path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 2 and out.stderr.strip() == (
      f"error: config.team.profiles={str(path)!r}: entry 1: field 'with_answer' must be a "
      "JSON boolean, got 1"), out.stderr
  assert not os.path.exists(tmp_path / "run")  # refused before the workdir is made
