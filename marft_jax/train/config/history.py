"""What each config key meant before it existed: how a checkpoint's saved config is read.

A checkpoint's meta holds the config of the run that wrote it, as that version of the
library recorded it. A key added since is missing from it, and today's default for the key
("auto" above all) may not be what that run did: a bf16 run saved before
`loss.behaviour_correction` existed trained without the correction, which "auto" turns on;
an f32 run saved before `model.matmul_precision` ran its matmuls at the platform's default
precision (TF32 on NVIDIA), which "auto" makes exact f32. So every key added since the first
checkpoint format (2026-11-24, bf55a8c) is listed in `ADDED` with the value that reproduces
the code before it, the commit that added it and why; `fill_missing` puts those values in.
A resumed run then compares the filled-in config with its own (`config.saved.read_for_resume`),
and a behaviour change is refused naming the key.

Some old behaviour no value of today's keys reproduces (the task's prompts were reworded;
a file task trained on every problem before a part was held out). `unreproducible` names
the key and says why, and a resume is refused. The era of a saved config is read from the
keys it lacks: a config without key K was written before K's commit. Where two commits of
one key era behaved otherwise (df0626f), the time Orbax recorded for the checkpoint decides:
code that did not exist yet cannot have written it.

The list was made from the repository's history (`git log -p` of the config, update, loss
and team files, and each commit's `TrainConfig()` and shipped teams compared with the
next); the fixtures in tests/fixtures/old_checkpoints are checkpoints of earlier commits
that resume bit for bit, or are refused, by this reading.

Adding a key that changes behaviour: give it a value that keeps the old behaviour, or add it
here with the value that does. Changing behaviour without a key: add it to `CHANGED` with
the test of the configs it alters. A change of rounding is a change here too: df0626f
jitted the advantage whitening, whose fused reductions round f32 advantages about 1e-7
apart, so `advantage.jit_whitening` keeps the op-by-op whitening for the checkpoints before
it (tests/train/test_old_checkpoints.py resumes them bit for bit).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from marft_jax.envs.graph import AgentGraph
from marft_jax.rollout.rewards import DEFAULT_PROMPT as _JUDGE_PROMPT

_FILE_TASKS = ("math_jsonl", "code")


@dataclasses.dataclass(frozen=True)
class Added:
  """`key` (dotted) was added by `commit` at `date` (UTC); before it the code behaved as
  `before` does today (a value, or a function of the flat saved config and the checkpoint's
  write time, None if unknown, giving one)."""

  key: str
  before: Union[Any, Callable[[Mapping[str, Any]], Any]]
  commit: str
  date: str
  why: str


def _lacks(saved: Mapping[str, Any], key: str) -> bool:
  return key not in saved


# The shipped teams' prompts changed in place (no key marks it): a config that does not spell
# its team out (team.roles missing, or {} before 3821d0b wrote the team out) trained with the
# team of its day. Days told apart by the keys the config lacks; where today's shipped team
# is not that team, or the day cannot be told, the team cannot be reproduced.
def _shipped_team_changed(saved: Mapping[str, Any]) -> Optional[str]:
  spelt_out = saved.get("team.roles") not in (None, {}) or not _lacks(saved, "lora.dropout_rate")
  if spelt_out:
    return None
  task = saved.get("task.name")
  if task == "echo":
    return ("the echo task's wording and its team's prompts changed on 2026-11-26 (62ffd2f, "
            "'Repeat: 7'), after this checkpoint")
  if (task in ("arithmetic", "math_jsonl") and saved.get("team.num_roles") in (1, 2, 3)
      and _lacks(saved, "mesh.data")):
    return ("the math teams' prompts of 1 to 3 roles changed on 2026-11-25 (7c334e9), at or "
            "after this checkpoint")
  if task == "math_jsonl" and _lacks(saved, "model.matmul_precision"):
    return ("the math_jsonl team's prompts changed on 2026-11-26 (a3d4de7, word-problem "
            "roles), maybe after this checkpoint")
  return None


def _held_out_split(saved: Mapping[str, Any]) -> Optional[str]:
  if saved.get("task.name") in _FILE_TASKS and _lacks(saved, "task.test_path"):
    return ("it trained on every problem of task.path; since 2026-11-26 (3ba9c2c) a seeded "
            "10 % of them is held out and never trained on")
  return None


def _orchestrator_sampling(saved: Mapping[str, Any]) -> Optional[str]:
  if (saved.get("team.graph") == "orchestrator" and saved.get("team.top_p", 1.0) != 1.0
      and _lacks(saved, "team.orchestrator_max_new_tokens")):
    return ("its orchestrator sampled at top_p=1 whatever team.top_p; since 2026-11-24 "
            "(19d683f) it samples at team.top_p")
  return None

# df0626f's commit time: no code that jitted the whitening existed before it.
WHITENING_JITTED = datetime.datetime(2026, 11, 26, 22, 35, 40, tzinfo=datetime.timezone.utc)


def _whitening_before(saved: Mapping[str, Any],
                      written_at: Optional[datetime.datetime]) -> bool:
  # df0626f fell between 3821d0b (16:45, lora.dropout_rate) and the next key (8880145,
  # 2026-11-28): a config without lora.dropout_rate predates it (op by op). One with it was
  # written in those 39 hours, 6 of them before df0626f; the keys cannot tell them apart, the
  # checkpoint's write time can. Written after it (or at an unknown time) reads as jitted: a
  # run of code older than df0626f written after it (a checkout not yet updated) is the one
  # case misread (its resume differs by rounding, ~1e-7; set advantage.jit_whitening=False).
  if _lacks(saved, "lora.dropout_rate"):
    return False
  return written_at is None or written_at >= WHITENING_JITTED


ADDED: tuple[Added, ...] = (
    Added("task.echo_high", 10, "72fe3f6", "2026-11-24 15:11", "the echo task drew from [0, 10)"),
    Added("team.orchestrator_max_new_tokens",  # read (and so refused otherwise) by one only
          lambda saved, _: 64 if saved.get("team.graph") == "orchestrator" else 32,
          "19d683f", "2026-11-24 15:28", "the orchestrator's routing turns had 64 tokens"),
    Added("mesh.data", 1, "511a526", "2026-11-25 08:22", "one device"),
    Added("mesh.fsdp", 1, "511a526", "2026-11-25 08:22", "one device"),
    Added("mesh.tensor", 1, "511a526", "2026-11-25 08:22", "one device"),
    Added("model.remat", False, "94213ee", "2026-11-25 09:24", "activations were stored"),
    Added("loss.behaviour_correction", "off", "f8b2341", "2026-11-26 07:24",
          "the ratio was taken against the learner's own log-probs, for bf16 models too"),
    Added("loss.dual_clip", None, "f8b2341", "2026-11-26 07:24", "no dual clip"),
    Added("loss.imp_weight_cap", 5.0, "f8b2341", "2026-11-26 07:24",
          "read only with the correction on (off before)"),
    Added("loss.kl_estimator", "k3", "f8b2341", "2026-11-26 07:24",
          "loss.kl_coef's penalty used k3"),
    Added("task.test_path", "", "3ba9c2c", "2026-11-26 07:33", "no held-out file"),
    Added("team.roles", {}, "c2905d9", "2026-11-26 07:48", "the task's shipped team"),
    Added("team.order", "", "c2905d9", "2026-11-26 07:48", "the shipped team's order"),
    Added("team.edges", "", "c2905d9", "2026-11-26 07:48", "no DAG"),
    Added("team.menu", "", "c2905d9", "2026-11-26 07:48", "the orchestrator called any role"),
    Added("team.anonymous", False, "c2905d9", "2026-11-26 07:48", "roles had their names"),
    Added("reward.judge", False, "c9e4528", "2026-11-26 07:56", "no judge"),
    Added("reward.judge_model", "", "c9e4528", "2026-11-26 07:56", "no judge"),
    Added("reward.judge_adapter", "", "c9e4528", "2026-11-26 07:56", "no judge"),
    Added("reward.judge_max_new_tokens", 16, "c9e4528", "2026-11-26 07:56", "no judge"),
    Added("reward.judge_weight", 1.0, "c9e4528", "2026-11-26 07:56", "no judge"),
    Added("reward.judge_prompt", _JUDGE_PROMPT, "c9e4528", "2026-11-26 07:56", "no judge"),
    Added("reward.fn", "", "c9e4528", "2026-11-26 07:56", "no reward function"),
    Added("advantage.reward_scale", 1.0, "5cdea36", "2026-11-26 08:01", "rewards unshaped"),
    Added("advantage.reward_bias", 0.0, "5cdea36", "2026-11-26 08:01", "rewards unshaped"),
    Added("advantage.reward_clip", None, "5cdea36", "2026-11-26 08:01", "rewards unclipped"),
    Added("advantage.kl_reward_coef", 0.0, "5972959", "2026-11-26 08:23", "no KL in the reward"),
    Added("advantage.kl_reward_estimator", "k3", "5972959", "2026-11-26 08:23",
          "no KL in the reward"),
    Added("team.transition", "", "adbc259", "2026-11-26 08:47",
          "the hand-over was \"It is now the {role}'s turn.\", today's default"),
    Added("model.matmul_precision", "default", "34148a1", "2026-11-26 13:18",
          "matmuls ran at the platform's default precision (TF32 for f32 on NVIDIA)"),
    Added("lora.dropout_rate", 0.0, "3821d0b", "2026-11-26 16:45", "no LoRA dropout"),
    Added("lora.use_rslora", False, "3821d0b", "2026-11-26 16:45", "scale alpha / rank"),
    Added("task.sandbox.mode", "auto", "8880145", "2026-11-28 08:07",
          "the code task's sandbox chose its isolation ('auto')"),
    Added("task.sandbox.wall_s", 5.0, "8880145", "2026-11-28 08:07", "5 s a test, hard-coded"),
    Added("task.sandbox.memory_mb", 1024, "8880145", "2026-11-28 08:07",
          "sandbox.Limits' default"),
    Added("task.sandbox.processes", 4, "8880145", "2026-11-28 08:07", "sandbox.Limits' default"),
    Added("task.sandbox.file_mb", 16, "8880145", "2026-11-28 08:07", "sandbox.Limits' default"),
    Added("loss.old_logp", "recompute", "32f9e21", "2026-11-28 09:00",
          "π_old was the learner's forward before the update (\"auto\" reads it from the "
          "rollout in f32: the same numbers to ~1e-4 nats, but not the same bits)"),
    Added("advantage.jit_whitening", _whitening_before, "583b3f2", "2026-11-28 10:49",
          "the whitening ran op by op before df0626f (2026-11-26 22:35), jitted since"),
    Added("rollout.max_staleness", 0, "fdcca56", "2026-11-28 10:56",
          "the synchronous loop: each iteration sampled with the policy it updated"),
    Added("mesh.sampler_devices", 0, "fdcca56", "2026-11-28 10:56",
          "the sampler shared the learner's mesh"),
    Added("model.backbones", {}, "23fc851", "2026-11-28 11:15",
          "one base model (model.source), every role on it"),
    Added("optimizer.row_length_step", 64, "5e545ff", "2026-11-28 11:20",
          "the update's rows were padded to a multiple of 64 tokens up to 256 (32 pads less, "
          "and the padding changes the f32 rounding of the real tokens' activations)"),
    Added("critic.backbone", "", "fdc6a02", "2026-11-28 13:38",
          "the critic lived on the roles' first backbone (a split team's could not be shared)"),
    Added("task.sandbox.parallel", 2, "a131ce0", "2026-11-28 19:59",
          "the sandbox ran 2 programs at once, and the rollout stepped its envs one by one"),
    Added("model.lora_update_f32", False, "19ac84b", "2026-11-29 03:49",
          "a bf16 routed LoRA layer (the CPU sampler's, the learner's under dropout) rounded "
          "its factors, x @ a and the update to bf16 and added them to a bf16 base output (the "
          "fused path added its update in f32)"),
    Added("team.profiles", "", "8098e15", "2026-12-01 21:47",
          "no profile files: a team was its team.roles (a run from a profile file records the "
          "roles it gave and an empty team.profiles)"),
    Added("task.options", {}, "ccbe152", "2026-12-01 22:17",
          "no tasks of your own: a task read no free-form options"),
)

# (key named in the refusal, the test of a flat saved config: why it cannot be reproduced)
UNREPRODUCIBLE: tuple[tuple[str, Callable[[Mapping[str, Any]], Optional[str]]], ...] = (
    ("team.roles", _shipped_team_changed),
    ("task.test_path", _held_out_split),
    ("team.top_p", _orchestrator_sampling),
)


# Changes of behaviour without a key after the last key above, in the order they reached
# main: a checkpoint records how many it knew (meta["changes_known"], written since this list
# exists); one without the record may predate every change here. (name, key named, why)
CHANGED: tuple[tuple[str, str, str], ...] = (
    ("dag_credit", "team.edges",
     "DAG credit follows what each turn's reply reaches (f308e3d, 2026-11-28): a turn hops "
     "to its first descendant, no longer to the first turn of the next layer"),
    ("untrained_roles", "team.roles",
     "turns of a role not trained (a 'base' role; under the agent-by-agent schedule, the "
     "adapters not trained that iteration) leave the advantage whitening and the policy "
     "loss and metrics (25d1793, 2026-11-28)"),
    ("mesh_minibatches", "mesh.data",
     "on several batch shards (mesh.data x mesh.fsdp) the minibatches are those of one device "
     "(2026-11-28): a mesh that padded the batch beyond one device's rows, or several "
     "processes' blocks, no longer change which rows train together"),
)
CHANGES_KNOWN = len(CHANGED)  # what this version records


def layer_successors(order: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[int]:
  """The turn each role's turn of one env step hopped to before `dag_credit` (its index in
  execution order; len(order) for the next step): the first turn of the next Kahn layer."""
  layers = _layers(order, edges)
  turns = [role for layer in layers for role in layer]
  starts = [sum(len(layer) for layer in layers[:i + 1]) for i in range(len(layers))]
  return [starts[i] if i + 1 < len(layers) else len(turns)
          for i, layer in enumerate(layers) for _ in layer]


def reach_successors(order: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[int]:
  """The same with `dag_credit`: the earliest later turn whose prompt holds the turn's reply
  (a descendant), else the next step."""
  turns = [role for layer in _layers(order, edges) for role in layer]
  children = {role: {b for a, b in edges if a == role} for role in order}
  below = {}
  for role in reversed(turns):  # descendants, from the last layer up
    below[role] = set(children[role]).union(*(below[c] for c in children[role]))
  return [next((j for j in range(k + 1, len(turns)) if turns[j] in below[turns[k]]),
               len(turns)) for k in range(len(turns))]


def _layers(order: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[tuple[str, ...]]:
  """The DAG's Kahn layers, its execution order (`envs.AgentGraph.layers`)."""
  return list(AgentGraph(tuple(order), tuple(edges)).layers())


def changed_since(known: Optional[int], config) -> list[tuple[str, str]]:
  """(key, why) for each change of `CHANGED` a checkpoint did not know (`known`: its
  meta["changes_known"]; None: written before the record) that alters the training of
  `config` (the `TrainConfig` its saved config reads as)."""
  team = config.team
  untrained = (not team.shared_adapter and
               (any(r.adapter == "base" for r in team.roles) or
                (config.optimizer.agent_iteration_interval > 0 and config.num_adapters > 1)))
  alters = {"dag_credit": team.graph == "dag" and layer_successors(
                team.role_order, team.edge_pairs) != reach_successors(team.role_order,
                                                                      team.edge_pairs),
            "untrained_roles": untrained,
            "mesh_minibatches": config.mesh.data * config.mesh.fsdp != 1}  # -1: every device
  return [(key, f"{why}; this checkpoint may predate it, and its run trains otherwise now")
          for name, key, why in CHANGED[known or 0:] if alters[name]]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a.b": 1}; `team.roles` stays one value (a mapping of roles)."""
  flat = {}
  for key, value in tree.items():
    dotted = f"{prefix}.{key}" if prefix else str(key)
    if isinstance(value, Mapping) and value and dotted != "team.roles":
      flat.update(flatten(value, dotted))
    else:
      flat[dotted] = value
  return flat


def fill_missing(saved: Mapping[str, Any],
                 written_at: Optional[datetime.datetime] = None) -> dict:
  """`saved` (a nested saved config) with every key of `ADDED` it lacks set to the value that
  reproduces the behaviour of the code that wrote it (`written_at`: when its checkpoint was
  written, UTC, if known). Keys not listed keep their absence (the reader fills today's
  default)."""
  flat = flatten(saved)
  filled = copy.deepcopy(dict(saved))
  for entry in ADDED:
    if entry.key in flat or any(k.startswith(entry.key + ".") for k in flat):  # a section's
      continue
    value = entry.before(flat, written_at) if callable(entry.before) else entry.before
    *sections, field = entry.key.split(".")
    node = filled
    for section in sections:
      node = node.setdefault(section, {})
    node[field] = copy.deepcopy(value)
  return filled


def unreproducible(saved: Mapping[str, Any]) -> list[tuple[str, str]]:
  """(key, why) for each behaviour of the run that wrote `saved` that no value of today's
  keys reproduces ([] for a config written by this version)."""
  flat = flatten(saved)
  return [(key, why) for key, test in UNREPRODUCIBLE for why in [test(flat)] if why]
