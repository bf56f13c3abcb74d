"""Rollout: a batch of environments run env step by env step, turn by turn, through the sampler.

One `rollout` call plays one episode in each environment of an `EnvBatch`. Within an env
step, each environment's `Schedule` (chain, DAG layer or orchestrator) says which agents act;
every turn is one batched `sampler.generate` call over all environments (rows), each row with
its agent's adapter, system prompt and sampling settings (temperature, top-p and max new
tokens per row; top-k is static in the sampler, so a team shares one). Rows with nothing to
do (their episode is over, or their env step is) take adapter id -1 and sample nothing.

Context modes (`context.py`): "per_agent" builds each turn's prompt afresh, showing each role
its own view of the problem where the observation gives one (`Observation.role_views`; the
turn records it, `Turn.view`); "shared_stream"
keeps one KV cache per environment and appends each transition to it, so agent k+1 continues
agent k's cache instead of re-encoding the episode (`reencode=True` re-encodes instead: the
reference the cache continuation is tested against). A shared stream refuses an observation
with role views (every later role would read them).

Several processes (`rows`, a `multihost.ProcessRows`): each process plays only the block of
environments it owns (`EnvBatch.owned`, the envs whose sampler rows live on its devices),
builds only those rows of every sampler call and reads only those back. The processes make
the same sampler calls in the same order (each turn is a collective): a process whose
environments are all done, or have nothing to say this turn, still takes part with rows that
sit out, until no process has anything left. The episodes come back per process; the metrics
and `RolloutResult.all_episodes` (the transcript records, without token sequences) are
gathered from every process, so they equal a single-process rollout's.

`cancel` (a `threading.Event`; one process): once set (by a signal handler, or by another
thread), the rollout stops before its next sampler call or env step with `RolloutCancelled`,
and the episodes played so far are dropped with it (the trainer, stopped by SIGTERM or Ctrl-C,
checkpoints the iteration before, and a resume plays them again).

A turn whose prompt plus max new tokens would pass `max_context` positions ends its episode
cleanly (`Episode.dropped = "context_overflow"`, counted in the metrics); so does an
environment that raises (`"env_error: ..."`). The run goes on.

Shapes stay few, so the sampler compiles a handful of times per run, all in its first
iteration: the batch is always the batch of environments (× the widest graph layer in the
per-agent view), the number of new tokens is bucketed once for the team, a per-agent prompt
is bucketed from its length had every earlier reply of its episode used its whole
max_new_tokens (so reply lengths never change its shapes; `sampler.generate(prompt_width=)`),
and the sampler reuses or compiles ahead the neighbouring buckets. A shared stream's cache
starts at its first call's size and grows to the next quarter octave (`sampler_plan.bucket`)
when a turn would not fit (slots are not reserved up front: every decode step attends over all
of a cache's slots, so a cache sized for `max_context` would make every turn pay for the
longest possible episode); its growth still follows the replies' lengths.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Optional, Sequence, Union

import jax
import numpy as np

from marft_jax import multihost
from marft_jax.envs.batch import EnvBatch
from marft_jax.envs.graph import AgentGraph, Orchestrator, Schedule, acting_profiles
from marft_jax.envs.profiles import AgentProfile, adapter_index, check_team
from marft_jax.lora.routing import Adapters
from marft_jax.models import sampler, sampler_plan
from marft_jax.models.config import ModelConfig
from marft_jax.rollout import context
from marft_jax.rollout.episode import Episode, TokenSequence, Turn

CONTEXT_MODES = ("per_agent", "shared_stream")


class RolloutCancelled(Exception):
  """A rollout stopped by its `cancel` event, between two sampler calls or env steps."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How episodes are played (the team and graph are passed separately).

  context_mode: "per_agent" or "shared_stream" (see `context.py`).
  horizon: env steps per episode at most (the environment may end it earlier).
  max_context: positions a sequence may reach (prompt + replies); beyond it the episode ends
    as a context overflow. At most the model's max_position_embeddings; None: all of them.
  reencode: shared stream only: re-encode the whole stream every turn instead of continuing
    the KV cache (a reference for tests and benchmarks; slower).
  transition: shared stream only: the hand-over to the next agent, {role} its name
    (`context.TRANSITION`).
  share_group_prompts: per-agent view, one process: the rows of one agent in the envs of one
    group (`EnvBatch.group_size`: an evaluation's n samples of a problem, GRPO's group)
    encode the prompt tokens they share once (`sampler.generate`'s `prefix_groups`): the
    whole prompt of a first agent, the task and the earlier turns up to the first reply
    they differ in for a later one. Same samples to f32 rounding (so off for training,
    whose checkpoints resume bit for bit).
  """

  context_mode: str = "per_agent"
  horizon: int = 1
  max_context: Optional[int] = None
  reencode: bool = False
  transition: str = context.TRANSITION
  share_group_prompts: bool = False

  def __post_init__(self):
    if self.context_mode not in CONTEXT_MODES:
      raise ValueError(f"context_mode={self.context_mode!r}: use one of {CONTEXT_MODES}")
    for key in ("horizon", "max_context"):
      value = getattr(self, key)
      if key == "max_context" and value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: use an int >= 1")


@dataclasses.dataclass
class RolloutResult:
  """episodes: this process's episodes (all of them on one process), in env order.
  metrics: the whole batch's (summed or averaged over every process's episodes).
  all_episodes: every process's episodes in env order, for transcripts; in a multi-process
    rollout they are copies without their token sequences (`episodes` is the same list on one
    process)."""

  episodes: list
  metrics: dict
  all_episodes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Backbone:
  """One base model a team runs on (`rollout_backbones`): its weights (any layout), config,
  tokenizer (with a chat template and an EOS token), and the stacked adapters of its agents
  (None: they all speak as the base)."""

  params: Any
  model_config: ModelConfig
  tokenizer: Any
  lora: Optional[Adapters] = None


class _Agents:
  """The team plus an orchestrator (if any), indexed by agent id."""

  def __init__(self, team: Sequence[AgentProfile], structure):
    self.team = tuple(team)
    self.profiles = acting_profiles(team, structure)

  def adapter(self, agent: int) -> int:
    if agent < len(self.team):
      return adapter_index(self.team, agent)
    own = self.profiles[agent].adapter
    return agent if own is None else own


def reply_budgets(team: Sequence[AgentProfile],
                  structure: Union[AgentGraph, Orchestrator, None]) -> tuple[int, ...]:
  """Each agent's max_new_tokens, by the agent ids episodes record (the team, then an
  orchestrator): the budgets `batching.make_batch` buckets the update's shapes from."""
  return tuple(p.sampling.max_new_tokens for p in _Agents(team, structure).profiles)


def check_reply_budgets(team: Sequence[AgentProfile],
                        structure: Union[AgentGraph, Orchestrator, None],
                        max_context: int) -> None:
  """Refuses an agent whose max_new_tokens leaves no position for a prompt within
  `max_context`: every turn of it would end its episode as a context overflow, and a run
  would train on nothing, iteration after iteration."""
  for profile in _Agents(team, structure).profiles:
    if profile.sampling.max_new_tokens >= max_context:
      raise ValueError(f"agent {profile.role!r}: max_new_tokens="
                       f"{profile.sampling.max_new_tokens} leaves no position for its prompt "
                       f"within max_context={max_context}: each of its turns would end its "
                       "episode as a context overflow")


def rollout(envs: EnvBatch, team: Sequence[AgentProfile],
            structure: Union[AgentGraph, Orchestrator, None], params: Any, model_config: ModelConfig,
            tokenizer, rng: jax.Array, *, lora: Optional[Adapters] = None,
            config: RolloutConfig = RolloutConfig(), policy_version: int = 0,
            rows: Optional[multihost.ProcessRows] = None,
            cancel: Optional[threading.Event] = None) -> RolloutResult:
  """Plays one episode in every environment of `envs`; returns the records and metrics.

  Args:
    envs: the environments; each starts its next task (auto-reset).
    team: the agents, in their default speaking order.
    structure: an `AgentGraph`, an `Orchestrator`, or None for the sequential chain.
    params, model_config: the base model (any layout; `layout.decoding()` is the fast one).
    tokenizer: with a chat template and an EOS token.
    rng: PRNG key; the same key (and tasks) give the same episodes.
    lora: the stacked adapters the profiles index into (None: every agent is the base model).
    config: context mode, horizon, context limit.
    policy_version: recorded on every episode (the learner's version that sampled it).
    rows: a multi-process job's row layout: this process plays `envs.owned` only (see the
      module docstring). Every process must call `rollout` with the same arguments otherwise.
    cancel: once set, the rollout raises `RolloutCancelled` before its next sampler call or
      env step (one process only: the processes' calls are collectives).
  """
  structure = AgentGraph.chain([p.role for p in team]) if structure is None else structure
  agents = _Agents(team, structure)
  check_team(team, None if lora is None else lora.num_adapters)
  config = _checked(agents, structure, config, model_config)
  if cancel is not None and rows is not None:
    raise ValueError("cancel: one process only (every process must make the same sampler "
                     "calls, and one process's event would stop only its own)")
  runner = _Runner(envs, agents, structure, [Backbone(params, model_config, tokenizer, lora)],
                   rng, config, policy_version, rows, cancel=cancel)
  return runner.run()


def rollout_backbones(envs: EnvBatch, team: Sequence[AgentProfile],
                      structure: Union[AgentGraph, None], backbones: Sequence[Backbone],
                      agent_backbone: Sequence[int], adapter_local: Sequence[int],
                      rng: jax.Array, *, config: RolloutConfig = RolloutConfig(),
                      policy_version: int = 0,
                      cancel: Optional[threading.Event] = None) -> RolloutResult:
  """`rollout` of a team whose agents run on different base models.

  Text is the interface between backbones: each turn's prompt is built as text from what the
  agent may see and tokenized with its own backbone's tokenizer and chat template; its reply
  passes on as text; each turn's sequence keeps the token ids its backbone sampled, with the
  team-wide agent and adapter ids. Every turn is one sampler call per backbone with an agent
  acting (the other backbones' rows sit out), so agents on one backbone share its routed pass.
  One process; the per-agent view only (a shared stream holds one vocabulary).

  Args:
    backbones: the base models; `agent_backbone[agent]` indexes it for each agent id.
    adapter_local: each team-wide adapter id's index in its backbone's stacked adapters.
    cancel: as `rollout`'s.
  """
  structure = AgentGraph.chain([p.role for p in team]) if structure is None else structure
  agents = _Agents(team, structure)
  check_team(team, len(adapter_local))
  if len(agent_backbone) != len(agents.profiles):
    raise ValueError(f"agent_backbone={tuple(agent_backbone)}: one backbone index per agent "
                     f"({len(agents.profiles)})")
  if config.context_mode != "per_agent":
    raise ValueError(f"context_mode={config.context_mode!r}: a team on several backbones "
                     "plays in the per-agent view (one stream holds one vocabulary)")
  smallest = min((b.model_config for b in backbones),
                 key=lambda c: c.max_position_embeddings)
  config = _checked(agents, structure, config, smallest)
  runner = _Runner(envs, agents, structure, list(backbones), rng, config, policy_version,
                   agent_backbone=tuple(agent_backbone), adapter_local=tuple(adapter_local),
                   cancel=cancel)
  return runner.run()


def _checked(agents: _Agents, structure, config: RolloutConfig,
             model_config: ModelConfig) -> RolloutConfig:
  """`config` with `max_context` decided (the model's positions), after refusing what the
  rollout cannot play."""
  if config.context_mode == "shared_stream" and isinstance(structure, AgentGraph) and \
      not structure.is_sequential():
    raise ValueError("shared_stream needs a sequential schedule (a chain or an orchestrator): "
                     "parallel graph branches each see only their ancestors, which one stream "
                     "cannot show; use context_mode='per_agent' for this graph")
  top_ks = {p.sampling.top_k for p in agents.profiles}
  if len(top_ks) > 1:
    raise ValueError(f"the team's profiles use different top_k {sorted(top_ks)}: the sampler "
                     "takes one top_k per call; give every profile the same")
  if config.max_context is None:
    config = dataclasses.replace(config, max_context=model_config.max_position_embeddings)
  if config.max_context > model_config.max_position_embeddings:
    raise ValueError(f"max_context={config.max_context} exceeds the model's "
                     f"max_position_embeddings={model_config.max_position_embeddings}")
  check_reply_budgets(agents.team, structure, config.max_context)
  return config


class _Runner:
  """The state of one rollout call (host side). `backbones`: the base models; each agent
  runs on `backbones[agent_backbone[agent]]` (default: the first) with its adapter's index
  there (`adapter_local`, default: its own)."""

  def __init__(self, envs, agents, structure, backbones, rng, config, policy_version,
               rows=None, agent_backbone=None, adapter_local=None, cancel=None):
    self.envs, self.agents, self.structure = envs, agents, structure
    self.cancel = cancel
    self.backbones = backbones
    self.agent_backbone = agent_backbone or (0,) * len(agents.profiles)
    self.adapter_local = adapter_local
    self.tokenizer = backbones[0].tokenizer  # the shared stream's (one backbone)
    self.rng, self.config = rng, config
    self.policy_version = int(policy_version)
    self.num_new = sampler_plan.bucket(
        max(p.sampling.max_new_tokens for p in agents.profiles),
        sampler_plan.MIN_NEW_TOKENS_BUCKET)
    self.top_k = agents.profiles[0].sampling.top_k or None
    width = 1
    if isinstance(structure, AgentGraph):
      width = max(len(layer) for layer in structure.layers())
    # This process's environments are envs.owned: local index i is env `first + i`.
    self.first, self.num_envs = envs.owned.start, len(envs.owned)
    self.layout = rows  # None: one process
    self.rows = self.num_envs * (width if config.context_mode == "per_agent" else 1)
    self.calls = 0
    self.metrics = {"generated_tokens": 0, "prompt_tokens": 0, "sampler_s": 0.0, "env_s": 0.0,
                    "context_overflow": 0, "env_error": 0, "turns": 0}
    self.episodes: list[Episode] = []
    self.streams: list[Optional[TokenSequence]] = []
    self.cache = None

  # --- the episode loop ---------------------------------------------------------------------

  def run(self) -> RolloutResult:
    start = time.perf_counter()
    observations = []
    for index in self.envs.owned:
      episode = Episode(env_index=index,
                        seed=self.envs.episode_seed(index, self.envs.episodes[index]),
                        task="", policy_version=self.policy_version)
      self.episodes.append(episode)
      observations.append(self._env_call(episode, lambda i=index: self.envs.reset(i)[1]))
      if observations[-1] is not None:
        episode.task = observations[-1].task
        episode.role_views = dict(observations[-1].role_views)
    self.streams = [None] * self.num_envs
    history: list[list[list[tuple[int, str]]]] = [[] for _ in range(self.num_envs)]
    for env_step in range(self.config.horizon):
      live = [i for i, ep in enumerate(self.episodes)
              if ep.dropped is None and observations[i] is not None
              and not (ep.dones and ep.dones[-1])]
      if not self._anywhere(bool(live)):
        break
      schedules = {i: Schedule(self.structure, self.agents.team) for i in live}
      self._play_env_step(env_step, schedules, observations, history)
      stepping = {}  # env -> the roles' replies of this env step
      for i in live:
        if self.episodes[i].dropped is None:
          replies = schedules[i].replies
          history[i].append(replies)
          actions = {p.role: "" for p in self.agents.team}
          for agent, text in replies:  # each role's last reply of this env step
            if agent < len(self.agents.team):
              actions[self.agents.team[agent].role] = text
          stepping[i] = actions
      for i, step in zip(stepping, self._step_envs(stepping)):
        episode = self.episodes[i]
        if step is None:
          continue
        episode.rewards.append([float(step.rewards.get(p.role, 0.0)) for p in self.agents.team])
        episode.dones.append(bool(step.done) or env_step == self.config.horizon - 1)
        episode.infos.append(dict(step.info, orchestrator_calls=schedules[i].calls))
        observations[i] = step.observation
    for i, episode in enumerate(self.episodes):
      if self.streams[i] is not None and len(self.streams[i]):
        episode.sequences.append(self.streams[i])
    self.metrics["rollout_s"] = time.perf_counter() - start
    if self.layout is None:
      return RolloutResult(self.episodes, _summary(self.episodes, self.metrics, self.agents),
                           self.episodes)
    # Transcript records and counters of every process (small: text and numbers; the
    # token sequences stay with the process that trains on them).
    light = [dataclasses.replace(e, sequences=[]) for e in self.episodes]
    parts = multihost.gather_objects((light, self.metrics))
    everyone = [e for episodes, _ in parts for e in episodes]
    counters = dict(self.metrics)  # times: this process's own
    for key in _COUNTERS:
      counters[key] = sum(metrics[key] for _, metrics in parts)
    return RolloutResult(self.episodes, _summary(everyone, counters, self.agents), everyone)

  def _anywhere(self, flag: bool) -> bool:
    """`flag` on any process (every process runs a turn while any has one to run)."""
    return flag if self.layout is None else multihost.any_process(flag)

  def _step_envs(self, stepping: dict) -> list:
    """Each env's `Step` for its actions (`stepping`: env -> actions), stepped together
    (`EnvBatch.step_many`: a code task's tests run for several envs at once); an env that
    raised has its episode dropped (counted) and None."""
    start = time.perf_counter()
    self._stop_if_cancelled()
    results = self.envs.step_many([(self.first + i, a) for i, a in stepping.items()])
    self.metrics["env_s"] += time.perf_counter() - start
    steps = []
    for i, result in zip(stepping, results):
      if isinstance(result, Exception):
        self._drop_for_env_error(self.episodes[i], result)
        result = None
      steps.append(result)
    return steps

  def _stop_if_cancelled(self) -> None:
    if self.cancel is not None and self.cancel.is_set():
      raise RolloutCancelled(f"rollout cancelled after {self.calls} sampler calls")

  def _drop_for_env_error(self, episode: Episode, error: Exception) -> None:
    episode.dropped = f"env_error: {type(error).__name__}: {error}"
    self.metrics["env_error"] += 1

  def _env_call(self, episode: Episode, fn):
    """Runs an environment method; an exception drops the episode (counted) and returns None."""
    start = time.perf_counter()
    try:
      return fn()
    except Exception as e:  # an environment's failure must not stop the run
      self._drop_for_env_error(episode, e)
      return None
    finally:
      self.metrics["env_s"] += time.perf_counter() - start

  def _play_env_step(self, env_step, schedules, observations, history):
    """Turn after turn until every live environment's schedule is over."""
    while True:
      jobs = []  # (env index, agent)
      for i, schedule in schedules.items():
        if self.episodes[i].dropped is None:
          jobs += [(i, agent) for agent in schedule.next_turn()]
      if not self._anywhere(bool(jobs)):
        return
      if self.config.context_mode == "per_agent":
        texts = self._per_agent_turn(jobs, env_step, schedules, observations, history)
      else:
        texts = self._stream_turn(jobs, env_step, observations)
      for (i, agent), text in zip(jobs, texts):
        schedules[i].record(agent, "" if text is None else text)

  # --- one batched sampler call ---------------------------------------------------------------

  def _eos(self, backbone: int) -> int:
    return int(self.backbones[backbone].tokenizer.eos_token_id)

  def _pad(self, backbone: int) -> int:
    pad = self.backbones[backbone].tokenizer.pad_token_id
    return self._eos(backbone) if pad is None else int(pad)

  def _adapter(self, agent: int) -> int:
    """The agent's adapter among its backbone's stacked adapters (-1: the base)."""
    adapter = self.agents.adapter(agent)
    return adapter if self.adapter_local is None or adapter < 0 else self.adapter_local[adapter]

  def _generate(self, prompts, agents_per_row, cache=None, prompt_adapters=None,
                prompt_width=None, backbone=0, prefix_groups=None):
    """One sampler call on `backbone`. prompts: per row a token list (or None: the row sits
    out); prompt_adapters: optional per row per-token adapter ids of the prompt; prompt_width: a
    bound on the prompts' length from the budgets; prefix_groups: rows whose shared prompt
    prefix is encoded once (both `sampler.generate`'s).

    Returns ((tokens [B, N], logprobs [B, N], lengths [B]) of this process's rows, the new
    cache), or None (no call) when no row of any process samples."""
    self._stop_if_cancelled()
    weights = self.backbones[backbone]
    rows = len(prompts)
    width = max([len(p) for p in prompts if p] + [1])
    tokens = np.full((rows, width), self._pad(backbone), np.int32)
    lens = np.zeros((rows,), np.int32)
    max_new = np.zeros((rows,), np.int32)
    temperature = np.ones((rows,), np.float32)
    top_p = np.ones((rows,), np.float32)
    adapter_ids = np.full((rows,), -1, np.int32)
    token_adapters = None if prompt_adapters is None else np.full((rows, width), -1, np.int32)
    for r, (prompt, agent) in enumerate(zip(prompts, agents_per_row)):
      if not prompt:
        continue
      tokens[r, :len(prompt)], lens[r] = prompt, len(prompt)
      if token_adapters is not None:
        token_adapters[r, :len(prompt)] = prompt_adapters[r]
      s = self.agents.profiles[agent].sampling
      max_new[r], temperature[r], top_p[r] = s.max_new_tokens, s.temperature, s.top_p
      adapter_ids[r] = self._adapter(agent)
    use_top_p = not np.all(top_p >= 1)
    if self.layout is None:
      if not any(prompts):
        return None
    else:  # one collective: whether any process samples, and whether any row uses top-p
      anything, use_top_p = (bool(v) for v in multihost.max_over_processes(
          [any(bool(p) for p in prompts), use_top_p]))
      if not anything:
        return None
    key = jax.random.fold_in(self.rng, self.calls)
    self.calls += 1
    start = time.perf_counter()
    out = sampler.generate(
        weights.params, tokens, weights.model_config, rng=key, max_new_tokens=max_new,
        prompt_lens=lens, cache=cache,
        lora=weights.lora,
        adapter_ids=adapter_ids if weights.lora is not None else None,
        prompt_adapter_ids=token_adapters if weights.lora is not None else None,
        temperature=temperature,
        top_k=self.top_k, top_p=top_p if use_top_p else None, eos_ids=self._eos(backbone),
        pad_id=self._pad(backbone), max_new_tokens_bucket=self.num_new, rows=self.layout,
        prompt_width=prompt_width, compile_ahead=True,  # a run calls with every length
        prefix_groups=prefix_groups)
    read = multihost.to_host if self.layout is None else self.layout.get  # only its own rows
    result = tuple(read(x) for x in (out.tokens, out.logprobs, out.lengths))
    self.metrics["sampler_s"] += time.perf_counter() - start
    self.metrics["generated_tokens"] += int(result[2].sum())
    self.metrics["prompt_tokens"] += int(lens.sum())
    self.metrics["turns"] += int((max_new > 0).sum())
    return result, out.cache

  def _tokenizer(self, agent: int):
    return self.backbones[self.agent_backbone[agent]].tokenizer

  # --- the per-agent view ---------------------------------------------------------------------

  def _per_agent_turn(self, jobs, env_step, schedules, observations, history):
    prompts, agents, texts = [None] * self.rows, [0] * self.rows, [None] * len(jobs)
    shown = [()] * self.rows  # each row's prompt messages
    placed = []  # (job index, row)
    next_row = {}
    for j, (i, agent) in enumerate(jobs):
      profile = self.agents.profiles[agent]
      messages = context.per_agent_messages(profile, self.agents.team, observations[i],
                                            history[i], schedules[i].visible(agent))
      prompt = context.chat_prompt(self._tokenizer(agent), messages)
      if len(prompt) + profile.sampling.max_new_tokens > self.config.max_context:
        self._overflow(i)
        continue
      row = i * (self.rows // self.num_envs) + next_row.get(i, 0)
      next_row[i] = next_row.get(i, 0) + 1
      prompts[row], agents[row], shown[row] = prompt, agent, messages
      placed.append((j, row))
    sampled = {}  # row -> (tokens [N], logprobs [N], length) its backbone's call sampled
    for b in range(len(self.backbones)):  # one call per backbone with a row to sample
      on_b = [(j, row) for j, row in placed if self.agent_backbone[jobs[j][1]] == b]
      if not on_b and (b > 0 or placed):
        continue
      rows_b = {row for _, row in on_b}
      bounds = [self._prompt_bound(jobs[j][0], len(prompts[row])) for j, row in on_b]
      generated = self._generate([p if r in rows_b else None for r, p in enumerate(prompts)],
                                 agents, prompt_width=max(bounds, default=None), backbone=b,
                                 prefix_groups=self._prefix_groups(agents))
      if generated is not None:
        (tokens, logprobs, lengths), _ = generated
        sampled.update({row: (tokens[row], logprobs[row], int(lengths[row])) for row in rows_b})
    for j, row in placed:
      i, agent = jobs[j]
      tokens, logprobs, n = sampled[row]
      sequence = TokenSequence()
      adapter = self.agents.adapter(agent)  # the team-wide id (the batch maps it back)
      sequence.add_context(prompts[row], adapter)
      sequence.add_reply(tokens[:n], logprobs[:n], agent, adapter,
                         self.agents.profiles[agent].sampling.temperature,
                         len(self.episodes[i].turns), env_step)
      self.episodes[i].sequences.append(sequence)
      texts[j] = self._record_turn(i, agent, env_step, prompts[row], tokens[:n], shown[row],
                                   observations[i].role_views.get(self.agents.profiles[agent].role))
    return texts

  def _prefix_groups(self, agents) -> Optional[np.ndarray]:
    """[rows] each row's (env group, agent) as one id, with `share_group_prompts` on one
    process; else None."""
    if not self.config.share_group_prompts or self.layout is not None:
      return None
    per_env = self.rows // self.num_envs
    groups = np.asarray([self.envs.group(self.first + r // per_env) for r in range(self.rows)])
    return groups * len(self.agents.profiles) + np.asarray(agents)

  def _prompt_bound(self, i: int, length: int) -> int:
    """A per-agent prompt of env i as long as it would be had every earlier reply of its
    episode used its whole max_new_tokens (up to re-tokenisation of the replies' text): the
    prompt width the sampler buckets, so that reply lengths never change its shapes."""
    unused = sum(self.agents.profiles[t.agent].sampling.max_new_tokens - t.num_tokens
                 for t in self.episodes[i].turns)
    return length + max(unused, 0)

  def _record_turn(self, i, agent, env_step, prompt, reply, messages=(), view=None) -> str:
    tokenizer = self._tokenizer(agent)
    text = tokenizer.decode(reply, skip_special_tokens=True)
    stopped = len(reply) > 0 and int(reply[-1]) == self._eos(self.agent_backbone[agent])
    self.episodes[i].turns.append(Turn(env_step=env_step, agent=agent,
                                       role=self.agents.profiles[agent].role,
                                       prompt=tokenizer.decode(prompt), reply=text,
                                       num_tokens=len(reply), stopped=stopped,
                                       messages=tuple(messages), view=view))
    return text

  def _overflow(self, i):
    if self.episodes[i].dropped is None:
      self.episodes[i].dropped = "context_overflow"
      self.metrics["context_overflow"] += 1

  # --- the shared stream ----------------------------------------------------------------------

  def _stream_turn(self, jobs, env_step, observations):
    chunks, agents, texts = [None] * self.rows, [0] * self.rows, [None] * len(jobs)
    for j, (i, agent) in enumerate(jobs):
      profile = self.agents.profiles[agent]
      if observations[i].role_views:
        raise ValueError(f"context_mode='shared_stream': env {self.first + i}'s observation "
                         f"gives the roles {sorted(observations[i].role_views)} views of their "
                         "own, which one stream would show to every later role; use "
                         "context_mode='per_agent'")
      stream = self.streams[i]
      if stream is None:
        chunk = context.stream_start(self.tokenizer, observations[i].task, profile,
                                     self.config.transition)
      else:
        last = self.episodes[i].turns[-1] if self.episodes[i].turns else None
        stopped = last is None or last.stopped
        new_step = last is not None and last.env_step != env_step
        feedback = observations[i].feedback[-1] if new_step and observations[i].feedback else ""
        chunk = context.stream_transition(self.tokenizer, profile, stopped, feedback,
                                          self.config.transition)
      used = 0 if stream is None else len(stream)
      if used + len(chunk) + profile.sampling.max_new_tokens > self.config.max_context:
        self._overflow(i)
        continue
      chunks[i], agents[i] = chunk, agent
    prompt_adapters = None
    if self.config.reencode:  # the whole stream, each token through its first adapter
      prompts, cache = self._full_streams(chunks), None
      prompt_adapters = self._full_stream_adapters(chunks, agents)
    else:
      prompts, cache = chunks, self.cache  # None: the sampler sizes a fresh one, later grows it
    generated = self._generate(prompts, agents, cache=cache, prompt_adapters=prompt_adapters)
    if generated is None:
      return texts
    (tokens, logprobs, lengths), self.cache = generated
    if self.config.reencode:
      self.cache = None
    for j, (i, agent) in enumerate(jobs):
      if chunks[i] is None:
        continue
      if self.streams[i] is None:
        self.streams[i] = TokenSequence()
      adapter = self.agents.adapter(agent)
      n = int(lengths[i])
      self.streams[i].add_context(chunks[i], adapter)
      self.streams[i].add_reply(tokens[i, :n], logprobs[i, :n], agent, adapter,
                                self.agents.profiles[agent].sampling.temperature,
                                len(self.episodes[i].turns), env_step)
      texts[j] = self._record_turn(i, agent, env_step, chunks[i], tokens[i, :n])
    return texts

  def _full_streams(self, chunks):
    """Each row's whole stream so far plus its new chunk (re-encoding, or a first call)."""
    full = []
    for i, chunk in enumerate(chunks):
      if chunk is None:
        full.append(None)
      else:
        before = [] if self.streams[i] is None else list(self.streams[i].tokens)
        full.append(before + list(chunk))
    return full

  def _full_stream_adapters(self, chunks, agents):
    out = []
    for i, chunk in enumerate(chunks):
      if chunk is None:
        out.append(None)
        continue
      before = [] if self.streams[i] is None else list(self.streams[i].adapter_ids)
      out.append(before + [self._adapter(agents[i])] * len(chunk))
    return out


# --- metrics ------------------------------------------------------------------------------------

# Counts summed over the processes of a multi-process rollout (the times stay per process).
_COUNTERS = ("generated_tokens", "prompt_tokens", "context_overflow", "env_error", "turns")


def _summary(episodes, counters: dict, agents: _Agents) -> dict:
  """The rollout's metrics from all its episodes (env order) and its counters."""
  m = dict(counters)
  m["episodes"] = len(episodes)
  m["dropped"] = sum(e.dropped is not None for e in episodes)
  kept = [e for e in episodes if e.dropped is None]
  m["reward"] = float(np.mean([e.episodic_return for e in kept])) if kept else 0.0
  m["rollout_tok_s"] = m["generated_tokens"] / max(m["rollout_s"], 1e-9)
  for agent, profile in enumerate(agents.profiles):
    lengths = [t.num_tokens for e in episodes for t in e.turns if t.agent == agent]
    m[f"agent/{profile.role}/reply_tokens"] = float(np.mean(lengths)) if lengths else 0.0
  for agent, profile in enumerate(agents.team):
    rewards = [r[agent] for e in kept for r in e.rewards]
    m[f"agent/{profile.role}/reward"] = float(np.mean(rewards)) if rewards else 0.0
  infos = [info.get("metrics", {}) for e in episodes for info in e.infos]
  for name in sorted({k for info in infos for k in info}):
    m[f"env/{name}"] = float(np.mean([info[name] for info in infos if name in info]))
  return m
