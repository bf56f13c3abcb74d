"""A training run restored in Python: `marft_jax.restore(workdir, step=None)`.

    import marft_jax
    run = marft_jax.restore("runs/default")          # the latest checkpoint
    run.config.team.order                            # 'reasoner,actor'
    run.reply("reasoner", "What is 3 + 4?")          # one role's greedy reply
    episodes = run.play(num_problems=8)              # held-out episodes, as launch.eval plays
    run.evaluate(num_problems=8)["accuracy"]         # ... and launch.eval's metrics

Everything comes from the workdir: the config is the run's own (its checkpoint's saved config,
read as a resume reads it: `evaluate.saved_config`), the base model the one it names
(`run.load_models`), and the adapters and critic are read into a state of that config
(`evaluate.restore_state`, the reading `launch.eval` uses). Nothing is written to the workdir,
which a run may still be training in.

The PEFT exports beside the checkpoints (`<workdir>/exports/step_<N>/<adapter name>/`, one
folder per adapter: `config.teams.adapter_names`) load into Hugging Face PEFT on the base model's
transformers checkpoint (`PeftModel.from_pretrained(model, folder)`), or back into this
library with `lora.load_peft_adapters([folder], model_config)`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from marft_jax.architecture import precision
from marft_jax.envs.base import Observation
from marft_jax.models import sampler
from marft_jax.models.sampling import SamplingConfig
from marft_jax.rollout import context
from marft_jax.train import run as run_lib
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import trained_problems
from marft_jax.train.build.learner import pad_id
from marft_jax.train.build.team import build_team
from marft_jax.train.checkpoint import Checkpointer
from marft_jax.train.config.schema import TrainConfig


@dataclasses.dataclass(frozen=True)
class Restored:
  """One checkpoint of a run, ready to generate or evaluate (made by `restore`).

  config: the run's resolved `TrainConfig`, as it trained (its roles written out).
  team: its `AgentProfile`s in order (`build.team.build_team`: prompts, adapters, sampling).
  structure: None (a chain), an `AgentGraph` (a DAG) or an `Orchestrator`.
  model: the base (`build.model.Model`: params, config, tokenizer), or {backbone: Model} for a
    team on several backbones.
  policy: the stacked LoRA adapters (`lora.Adapters`), one per adapter id
    (`config.teams.adapter_names(config.team, config.task.name)` names them), or {backbone: Adapters}.
  critic: the critic's parameters (None for an algorithm without one), or {backbone: ...}.
  step: the checkpoint's step (its iteration count).
  workdir: the run's folder.
  trained_problems: {fingerprint: id} of the problems the checkpoint trained on, which `play`
    leaves out of the held-out problems, as launch.eval does.

    run = restore("runs/default", step=8)
    run.reply("actor", "What is 3 + 4?", replies=[("reasoner", "3 + 4 = 7")])
    from marft_jax.train import evaluate
    evaluate.play(run.config, run.model, run.policy, num_problems=4)   # what `play` calls
  """

  config: TrainConfig
  team: tuple
  structure: Any
  model: Any
  policy: Any
  critic: Any
  step: int
  workdir: str
  trained_problems: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)

  @functools.cached_property
  def rollout_weights(self):
    """The sampler's copy of the base (`run.rollout_weights`), made once: (params, model
    config), or {backbone: (params, model config)}."""
    return run_lib.rollout_weights(self.config, self.model)

  def play(self, num_problems: Optional[int] = None, batch_size: int = 40, **kwargs) -> list:
    """The `Episode`s of `num_problems` held-out problems (default the config's
    task.eval_problems), every agent greedy: `evaluate.play` under the run's own config, with
    the problems the checkpoint trained on left out. `batch_size` is launch.eval's
    --eval_batch (its default: the same episodes, to the token); `kwargs` go to
    `evaluate.play` (samples, temperature, progress, ...)."""
    kwargs.setdefault("trained", self.trained_problems)
    return evaluate_lib.play(self.config, self.model, self.policy, num_problems, batch_size,
                             rollout_weights=self.rollout_weights, **kwargs)

  def evaluate(self, num_problems: Optional[int] = None, batch_size: int = 40) -> dict:
    """launch.eval's greedy metrics (accuracy, accuracy/<role>, pass@1/<role>, ...) of
    `play`'s episodes."""
    episodes = self.play(num_problems, batch_size)
    return evaluate_lib.summarize_samples(episodes, self.team, 1, 0.0)

  def reply(self, role: str, task: str, replies: Sequence[tuple[str, str]] = (), *,
            sampling: Optional[SamplingConfig] = None, seed: int = 0,
            on_step: Optional[Callable[[jax.Array], None]] = None) -> str:
    """`role`'s reply to `task`, with its adapter, prompted as the per-agent view prompts it
    in the first env step (`context.per_agent_messages`: its system prompt, then the task
    and the earlier `replies` it sees, [(role, text)] in speaking order).

    sampling: default the role's own budget (its max_new_tokens), decoded greedily.
    seed: the sampler's key. on_step: `sampler.generate`'s progress callback.
    Raises:
      ValueError: an unknown role, or a prompt that leaves the model fewer positions than
        max_new_tokens.
    """
    agent = self._agent(role)
    profile = self.team[agent]
    visible = tuple((self._agent(r), text) for r, text in replies)
    messages = context.per_agent_messages(profile, self.team, Observation(task), (), visible)
    sampling = sampling or dataclasses.replace(profile.sampling, temperature=0.0)
    model, lora, adapter, weights = self._role_policy(agent)
    ids = context.chat_prompt(model.tokenizer, messages)
    room = model.config.max_position_embeddings - len(ids)
    if sampling.max_new_tokens > room:
      raise ValueError(f"max_new_tokens={sampling.max_new_tokens}: the prompt takes "
                       f"{len(ids)} of the model's {model.config.max_position_embeddings} "
                       f"positions, leaving {max(room, 0)}")
    routed = dict(lora=lora, adapter_ids=[adapter]) if adapter >= 0 else {}
    params, fast = weights
    with precision.scope(self.config.model.matmul_precision, self.config.run_dtype):
      out = sampler.generate(params, np.asarray([ids]), fast, rng=jax.random.key(seed),
                             eos_ids=model.tokenizer.eos_token_id,
                             pad_id=pad_id(model.tokenizer), on_step=on_step,
                             **routed, **sampling.generate_kwargs())
    tokens = np.asarray(out.tokens[0, :int(out.lengths[0])])
    return model.tokenizer.decode(tokens, skip_special_tokens=True)

  def _agent(self, role: str) -> int:
    roles = [p.role for p in self.team]
    if role not in roles:
      raise ValueError(f"role {role!r}: not a role of the run in {self.workdir} (its roles: "
                       f"{', '.join(roles)})")
    return roles.index(role)

  def _role_policy(self, agent: int):
    """(base, adapters, adapter index among them or -1, sampler weights) of `agent`."""
    return run_lib.role_policy(self.config, self.team, self.model, self.policy,
                               self.rollout_weights, agent)


def saved_config(workdir: str, step: Optional[int] = None) -> tuple[TrainConfig, int]:
  """(the run's config as saved with `step`, default the latest, as this version reads it;
  that step), without loading a model. Errors as `restore`'s."""
  with _checkpoints(workdir) as checkpointer:
    step = _step(checkpointer, step)
    return evaluate_lib.saved_config(checkpointer.read_meta(step), f"{workdir}: step {step}"), step


def restore(workdir: Union[str, os.PathLike], step: Optional[int] = None,
            model: Any = None) -> Restored:
  """The run in `workdir` at checkpoint `step` (default: the latest), ready to generate or
  evaluate: its config, team, base model, adapters and critic (see `Restored`).

  model: its base if already loaded (a `build.model.Model`, or {backbone: Model}); default:
    loaded from the saved config's model section (model.source: "smollm2", a .gguf file or
    a Hugging Face folder).
  Raises:
    FileNotFoundError: `workdir` holds no checkpoint, or none of `step` (naming the folder
      and the steps it holds).
    UnreadableCheckpointError: the step's files cannot be read (naming its folder).
    CheckpointMismatchError: its saved config does not load, or `model` is not its base.
  """
  workdir = os.fspath(workdir)
  with _checkpoints(workdir) as checkpointer:
    step = _step(checkpointer, step)
    meta = checkpointer.read_meta(step)
    config = evaluate_lib.saved_config(meta, f"{workdir}: step {step}")
    if model is None:
      model = run_lib.load_models(config)
    state = evaluate_lib.restore_state(checkpointer, config, model, step)
  trained = (trained_problems.fingerprints(meta[trained_problems.KEY])
             if trained_problems.KEY in meta else trained_problems.of_checkpoint(workdir))
  team, structure = build_team(config)
  return Restored(config=config, team=team, structure=structure, model=model,
                  policy=run_lib.policy(config, state), critic=run_lib.critic(config, state), step=step, workdir=workdir,
                  trained_problems=trained)


def _checkpoints(workdir: str) -> Checkpointer:
  """The workdir's checkpoints, read only (nothing is created where there are none)."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{directory}: no checkpoint to restore (train first)")
  return Checkpointer(workdir, read_only=True)


def _step(checkpointer: Checkpointer, step: Optional[int]) -> int:
  """`step`, or the latest; a workdir without checkpoints is the Checkpointer's error."""
  if step is not None:
    return step  # a missing one: `read_meta`'s error names the steps present
  latest = checkpointer.latest_step()
  if latest is None:
    raise FileNotFoundError(f"{checkpointer.directory}: no checkpoint to restore (train "
                            "first)")
  return latest
