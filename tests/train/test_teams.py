"""Teams in the config (train/config/teams.py): shipped teams as data, overrides by role name, DAG
and orchestrator graphs, adapters, the anonymous ablation, refusals naming the key, and the
concepts page's 3-role DAG file launched on the tiny model."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from launch.cli import CONFIG_DIR, _load_config_file
from marft_jax import envs
from marft_jax.rollout import read_transcripts
from marft_jax.train import run as run_lib
from marft_jax.train import teams
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import model as model_lib
from marft_jax.train.build import team as team_lib
from marft_jax.train.config import RoleSection, TeamSection, TrainConfig
from tests.compile_flags import FAST_COMPILE
from tests.train.echo_config import resolved

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _file(name, **overrides):
  """A shipped config file with `--config.<key>=<value>` overrides, typed and resolved."""
  return resolved(_load_config_file(os.path.join(CONFIG_DIR, name)), overrides)


# What the shipped teams were before they became config data (profiles.math_team & co).
SHIPPED = {("arithmetic", 1): ["solver"], ("arithmetic", 2): ["reasoner", "actor"],
           ("math_jsonl", 3): ["reasoner", "actor", "verifier"],
           ("math_jsonl", 4): ["analyst", "planner", "solver", "verifier"],
           ("code", 2): ["planner", "coder"], ("code", 3): ["planner", "coder", "reviewer"],
           ("echo", 2): ["helper0", "repeater"]}


@pytest.mark.parametrize("task,size", sorted(SHIPPED))
def test_shipped_teams(task, size):
  team = TeamSection(**teams.shipped(task, size))
  profiles, structure = teams.build_team(team, task)
  assert [p.role for p in profiles] == SHIPPED[task, size] and structure is None
  assert [p.graded for p in profiles] == [False] * (size - 1) + [True]
  assert [p.adapter for p in profiles] == list(range(size))
  # The library's default (no roles: the task's shipped team of num_roles) is the same team.
  assert teams.build_team(TeamSection(num_roles=size), task) == (profiles, structure)


def test_a_role_override_by_name_changes_that_role_only():
  base = teams.build_team(_file("train.py").team, "arithmetic")[0]
  changed = teams.build_team(_file("train.py", **{
      "team.roles.reasoner.temperature": 0.9, "team.roles.actor.max_new_tokens": 5,
      "team.roles.reasoner.system_prompt": "Think."}).team, "arithmetic")[0]
  assert changed[0].sampling.temperature == 0.9 and changed[0].system_prompt == "Think."
  assert changed[1].sampling.temperature == base[1].sampling.temperature == 0.3
  assert changed[1].sampling.max_new_tokens == 5 and base[1].sampling.max_new_tokens == 16
  assert changed[0].sampling.max_new_tokens == base[0].sampling.max_new_tokens == 48


def test_team_wide_sampling_reaches_the_roles_that_inherit_it():
  profiles = teams.build_team(_file("train.py", **{"team.max_new_tokens": 8,
                                                    "team.last_max_new_tokens": 4,
                                                    "team.temperature": 0.6}).team,
                              "arithmetic")[0]
  assert [p.sampling.max_new_tokens for p in profiles] == [8, 4]
  assert [p.sampling.temperature for p in profiles] == [0.6, 0.6]


@pytest.mark.parametrize("overrides,key", [
    ({"team.graph": "dag", "team.edges": "reasoner>judge"}, "edges"),
    ({"team.graph": "orchestrator", "team.menu": "reasoner,oracle"}, "menu"),
    ({"team.order": "reasoner,reasoner"}, "order"),
    ({"team.graph": "dag"}, "edges"),
    ({"team.graph": "dag", "team.edges": "reasoner>actor, actor>reasoner"}, "edges"),
    ({"team.edges": "reasoner>actor"}, "edges"),
    ({"team.roles.actor.adapter": "mine"}, "roles.actor"),
])
def test_a_wrong_team_is_refused_naming_the_key(overrides, key):
  with pytest.raises(ValueError, match=re.escape(key)):
    _file("train.py", **overrides)


@pytest.mark.parametrize("edges", ["planner>coder, coder>reviewer, reviewer>planner",
                                   "coder>coder"])
def test_a_dag_cycle_is_refused_with_the_config_naming_the_edges(edges):
  """With the team's roles declared, before anything is built (the launch script's one-line
  error, before the model loads): it once passed the config and failed when the team was
  built, after the model had loaded, as a traceback."""
  with pytest.raises(ValueError, match=r"edges=.*cycle among \[.*'coder'"):
    TeamSection(**teams.shipped("code", 3), graph="dag", edges=edges)


@pytest.mark.parametrize("changes, message", [
    (dict(graph="dag", edges="reasoner>actor, actor>reasoner"),
     r"team\.edges='reasoner>actor, actor>reasoner': graph has a cycle among"),
    (dict(graph="dag", edges="reasoner>judge"),
     r"team\.edges='reasoner>judge': unknown role\(s\) \['judge'\]; roles: \['reasoner', 'actor'\]"),
    (dict(graph="orchestrator", menu="oracle"),
     r"team\.menu='oracle': unknown role\(s\) \['oracle'\]"),
])
def test_a_shipped_teams_graph_is_checked_when_it_is_built(changes, message):
  """Without declared roles the names are the task's shipped team's, known when the team is
  built: an unknown one was a bare KeyError ('judge')."""
  team = TeamSection(num_roles=2, **changes)
  with pytest.raises(ValueError, match=message):
    teams.build_team(team, "arithmetic")


def test_the_dag_file_runs_its_branches_in_one_layer():
  config = _file("dag_3agents.py")
  profiles, graph = teams.build_team(config.team, "arithmetic")
  assert graph.layers() == (("calculator", "estimator"), ("judge",))
  # The trainer's who-sees-whom: the judge both branches, a branch nothing of the step.
  assert envs.agent_sees(graph, profiles) == ((False,) * 3, (False,) * 3, (True, True, False))
  assert graph.ancestors("judge") == {"calculator", "estimator"}
  assert not graph.ancestors("estimator")
  assert [p.sampling.temperature for p in profiles] == [0.3, 0.7, 0.3]
  assert [p.sampling.max_new_tokens for p in profiles] == [32, 32, 16]


@pytest.mark.parametrize("file, overrides, heads", [
    ("train.py", {}, 2),
    ("dag_3agents.py", {}, 3),
    ("dag_3agents.py", {"team.graph": "orchestrator", "team.edges": ""}, 4),
])
def test_the_critic_has_a_value_per_agent_that_acts(file, overrides, heads):
  """A per-agent critic has one head per role, and one for an orchestrator's routing turns;
  a DAG adds no agent (it once added a head no turn reads)."""
  from marft_jax.models import tiny
  config = _file(file, **{"critic.mode": "per_agent_head", **overrides})
  assert team_lib.num_agents(*team_lib.build_team(config)) == heads
  state = run_lib.new_state(config, model_lib.Model(*tiny.tiny_model()))
  assert [kernel.shape[0] for kernel in state.critic["head"]] == [heads] * len(
      config.critic.hidden + (1,))


def test_adapters_own_shared_and_base():
  roles = (RoleSection("a", adapter="shared"), RoleSection("b", adapter="base"),
           RoleSection("c"), RoleSection("d", adapter="shared", graded=True))
  team = TeamSection(roles=roles, order="a,b,c,d", graph="orchestrator")
  profiles, orchestrator = teams.build_team(team, "arithmetic")
  # c owns adapter 0, the shared roles run adapter 1, b runs the base, the orchestrator 2.
  assert [p.adapter for p in profiles] == [1, envs.profiles.NO_ADAPTER, 0, 1]
  assert orchestrator.profile.adapter == 2
  assert teams.adapter_names(team, "arithmetic") == ["c", "shared", "orchestrator"]
  assert TrainConfig(team=team).num_adapters == 3
  shared = dataclasses.replace(team, shared_adapter=True)
  assert [p.adapter for p in teams.build_team(shared, "arithmetic")[0]] == [0, 0, 0, 0]
  assert TrainConfig(team=shared).num_adapters == 1


def test_the_orchestrator_calls_only_its_menu():
  team = TeamSection(**teams.shipped("code", 3), graph="orchestrator", menu="coder,reviewer")
  profiles, orchestrator = teams.build_team(team, "code")
  assert orchestrator.menu == ("coder", "reviewer")
  assert "planner" not in orchestrator.profile.system_prompt
  schedule = envs.Schedule(orchestrator, profiles)
  assert schedule.next_turn() == (3,)
  schedule.record(3, "<call>reviewer</call>")
  assert schedule.next_turn() == (2,)
  schedule.record(2, "done")
  schedule.record(3, "<call>planner</call>")  # off the menu: unparseable, ends the step
  assert schedule.next_turn() == ()


def test_anonymous_is_the_same_team_without_names_or_prompts():
  named = teams.build_team(_file("math_3agents.py").team, "math_jsonl")[0]
  anonymous = teams.build_team(_file("math_3agents.py", **{"team.anonymous": True}).team,
                               "math_jsonl")[0]
  assert [p.role for p in anonymous] == ["agent1", "agent2", "agent3"]
  assert all(p.system_prompt == "" for p in anonymous)
  for a, n in zip(anonymous, named):
    assert (a.graded, a.adapter, a.sampling) == (n.graded, n.adapter, n.sampling)
    assert n.role not in a.description


def test_ppo_refuses_a_declared_team_of_two_naming_both_keys():
  with pytest.raises(ValueError, match=r"team\.order=.*algorithm='ppo'"):
    _file("train.py", algorithm="ppo")


def _dag_file() -> str:
  with open(os.path.join(CONFIG_DIR, "dag_3agents.py")) as f:
    return f.read()


def test_the_concepts_page_shows_the_shipped_dag_file():
  with open(os.path.join(ROOT, "docs", "concepts.md")) as f:
    assert "```{literalinclude} ../launch/configs/dag_3agents.py" in f.read()


def test_the_dag_file_trains_on_the_tiny_model(tmp_path):
  """The shipped DAG file of the concepts page, launched as the page says (tiny model, one
  short iteration): the judge saw both branches, each branch only the task."""
  from marft_jax.models import tiny
  config_file = tmp_path / "dag.py"
  config_file.write_text(_dag_file())
  model = tiny.save_tiny_model(tmp_path / "model")
  command = [sys.executable, "-m", "launch.train", f"--config={config_file}",
             f"--workdir={tmp_path / 'run'}", f"--config.model.source={model}",
             "--config.iterations=1", "--config.rollout.num_envs=2", "--config.eval_every=0",
             "--config.team.max_new_tokens=4", "--config.team.roles.judge.max_new_tokens=4",
             "--config.rollout.max_context=512", "--config.team.roles.estimator.temperature=0.5"]
  run = lambda *extra: subprocess.run(
      command + list(extra), capture_output=True, text=True, cwd=ROOT, timeout=600,
      env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))  # one device, as on a user's CPU
  out = run()
  assert out.returncode == 0, out.stderr[-3000:]
  # The same command again: the run is finished, so it says so and prints the same summary,
  # before reading the model (now gone: it printed "reward=nan" after loading it before).
  shutil.rmtree(model)
  again = run()
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout == out.stdout and "reward=nan" not in out.stdout
  assert "its latest checkpoint is iteration 1 and config.iterations=1: nothing left to " \
      "train" in again.stderr
  episode = read_transcripts(str(tmp_path / "run" / "transcripts"), 0)[0]
  turns = episode["turns"]
  assert [t["role"] for t in turns] == ["calculator", "estimator", "judge"]
  calculator, estimator, judge = turns
  assert "Calculator:" not in estimator["prompt"] and "Estimator:" not in calculator["prompt"]
  assert "Calculator:" in judge["prompt"] and "Estimator:" in judge["prompt"]
  with open(tmp_path / "run" / "config.json") as f:
    recorded = json.load(f)
  assert recorded["team"]["graph"] == "dag"
  assert recorded["team"]["roles"]["estimator"]["temperature"] == 0.5


def test_the_transition_wording_reaches_the_shared_stream(tmp_path):
  """team.transition words the shared stream's hand-over; a bad format string is refused."""
  from marft_jax.rollout import context
  config = _file("train.py", **{"algorithm": "shared_stream_ppo",
                                "team.transition": "Over to you, {role}."})
  settings = envs_build.rollout_settings(config)
  assert settings.transition == "Over to you, {role}."
  profiles = teams.build_team(config.team, "arithmetic")[0]
  text = context.transition_text(profiles[1], wording=settings.transition)
  assert text.startswith("Over to you, Actor. You are the Actor")
  assert envs_build.rollout_settings(_file("train.py")).transition == context.TRANSITION
  with pytest.raises(ValueError, match=r"team: transition="):
    _file("train.py", **{"team.transition": "Now {speaker}."})


def test_launch_refuses_a_shipped_teams_unknown_edge_before_loading_the_model(tmp_path):
  """The model source does not exist: an error about it would mean it was read first."""
  config_file = tmp_path / "shipped_dag.py"
  config_file.write_text(
      "from launch.configs import train\n\n"
      "def get_config():\n"
      "  config = train.get_config()\n"
      "  config.team.roles, config.team.order, config.team.num_roles = {}, '', 2\n"
      "  config.team.graph, config.team.edges = 'dag', 'reasoner>judge'\n"
      "  return config\n")
  workdir = tmp_path / "never_written"
  out = subprocess.run([sys.executable, "-m", "launch.train", f"--config={config_file}",
                        "--config.model.source=/nonexistent", f"--workdir={workdir}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))
  assert out.returncode == 2, out
  assert out.stderr.strip() == ("error: team.edges='reasoner>judge': unknown role(s) "
                                "['judge']; roles: ['reasoner', 'actor']"), out.stderr
  assert not workdir.exists()


@pytest.mark.parametrize("overrides, agent", [
    ({"team.max_new_tokens": 64}, "reasoner"),
    ({"team.roles.actor.max_new_tokens": 64}, "actor"),
    ({"team.graph": "orchestrator", "team.orchestrator_max_new_tokens": 64}, "orchestrator"),
])
def test_a_reply_budget_that_fills_max_context_is_refused_with_the_team(overrides, agent):
  """`team_lib.build_team` (which launch.train runs before the model loads) checks each
  agent's budget against rollout.max_context: one that fills it would overflow every turn."""
  config = _file("train.py", **{"rollout.max_context": 64, **overrides})
  with pytest.raises(ValueError, match=rf"agent '{agent}': max_new_tokens=\d+ leaves no "
                                       r"position for its prompt within max_context=64"):
    team_lib.build_team(config)
  team_lib.build_team(_file("train.py", **{"rollout.max_context": 65, **overrides}))


def test_train_checks_the_team_before_the_model_loads(tmp_path):
  """`loop.train` (the library's entry point) refuses a team that cannot play before it
  reads the model: the source does not exist, so an error about it would mean it was read."""
  from marft_jax.train import loop  # noqa: PLC0415
  from marft_jax.train.config import ModelSection  # noqa: PLC0415
  from tests.train.echo_config import echo_config  # noqa: PLC0415
  base = echo_config()
  config = echo_config(model=ModelSection(source=str(tmp_path / "missing")),
                       team=dataclasses.replace(base.team, graph="dag", edges="helper0>nobody"))
  with pytest.raises(ValueError, match=r"team\.edges='helper0>nobody': unknown role\(s\) "
                                       r"\['nobody'\]"):
    loop.train(config, str(tmp_path / "run"))
