"""marft_jax.rollout: agent teams playing environments through the jitted sampler.

  episode      TokenSequence / Episode records: exactly what was sampled, per token.
  context      the per-agent view and the shared stream: what each agent is conditioned on.
  runner       rollout(envs, team, graph, params, ...): one episode per environment;
               rollout_backbones: a team whose agents run on several base models.
  transcripts  JSONL records of every episode's turns, for people: one file, or a training
               run's rolling pair.
"""

from marft_jax.rollout.episode import ActionSpan, Episode, TokenSequence, Turn
from marft_jax.rollout.runner import (CONTEXT_MODES, Backbone, RolloutCancelled, RolloutConfig,
                                     RolloutResult, check_reply_budgets, reply_budgets, rollout,
                                     rollout_backbones)
from marft_jax.rollout.transcripts import (append_transcripts, cut_transcripts, episode_record,
                                           read_transcripts, write_transcripts)
