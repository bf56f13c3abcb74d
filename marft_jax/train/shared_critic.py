"""The shared (centralised) critic of a team split over several backbones.

One critic (`critic.mode='shared'`: a value head and, with critic.lora_rank, a critic LoRA,
as on one backbone) lives on the backbone `critic.backbone` names and values every role's
turns, whatever backbone a role samples on. Text is the interface between backbones, so the
critic reads each turn's state as text in its own vocabulary:

  state     a turn's prompt messages (`Turn.messages`) in the critic backbone's chat template,
            then its reply's text (`Turn.reply`, what the next agents read), each tokenized on
            its own, as a turn's own row is its prompt's ids then its reply's. A turn of a role
            on the critic's backbone keeps its sampled ids (its row exactly: the reply's text
            re-tokenized may be split otherwise than it was sampled).
  values    the critic's value at its position u is V(tokens[:u+1]) (`critic.values`' action
            frame). The policy's decision j of a reply (it emits reply token j) is valued at
            the state before token j: the prompt, then the reply's text up to c_j, the whole
            characters decode(reply[:j]) gives. Its critic position is the last one whose
            text ends there or before:

                u_j = prompt_len − 1 + #{i : e_i ≤ c_j}

            with e_i the characters the critic's reply tokens up to i reach
            (`value_positions`, `written_lengths`, `reached_lengths`). A critic token that
            straddles c_j is left out: the value of a decision must not read any of the token
            being decided (a baseline that sees the action is biased); its state then holds a
            few characters less than the policy's. Characters are counted whole: a multi-byte
            character split between tokens counts in c_j only once the policy has written all
            of it (a U+FFFD, invalid UTF-8, once no byte after it could still complete a
            character), and in e_i as soon as a critic token holds any byte of it. e_i is
            known only while the critic's tokens spell the reply's text, their special tokens
            spelled out (a literal "<|im_end|>" in a reply is one token to the critic) and
            characters its vocabulary has no ids for skipped. Where they stop spelling it, e_i
            and every later one count as past the end: each later decision is valued at the
            last critic token before that point, never at one that may hold text the policy
            had not written, and the turn is counted in `critic/unaligned_turns`. Decision 0,
            the turn's action-level value, sits on the critic prompt's last token, so a
            successor's first-token value, which its predecessors bootstrap from, is the
            critic's at the successor's own prompt in the critic's tokens.
  training  the value loss over every role's turns (`CriticBatch`, one row per turn of the
            team batch, in its order), each decision's target at its u_j: several decisions
            on one critic position each pull it toward their own return (least squares:
            their mean). It is the critic backbone's own update (`make_critic_update`:
            epochs × minibatches as the policy's), its loss `update.LossConfig`'s value loss.

A turn of a role on the critic's backbone is valued exactly as on one backbone (u_j = its
own position), so a team on one backbone never comes here (`loop` runs it as before). Where a
re-tokenized turn differs from what one backbone would read: docs/shared_critic.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from marft_jax import sharding
from marft_jax.rollout.context import chat_prompt
from marft_jax.train.build import learner as learner_lib
from marft_jax.train import critic as critic_lib
from marft_jax.train.batching import TrainBatch, row_length
from marft_jax.train.update import (LossConfig, all_finite, critic_step, minibatch_slots,
                                    value_objective)

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a character


@struct.dataclass
class CriticBatch:
  """The team's turns as the shared critic reads them: B rows (a team batch's, in its order,
  then padding), T critic tokens, P = the team batch's T."""

  tokens: np.ndarray  # [B, T] int32: the critic's tokens of each turn's state and reply
  mask: np.ndarray  # [B, T] bool
  act_agent: np.ndarray  # [B, T] int32, -1: the shared critic routes no agent
  value_pos: np.ndarray  # [B, P] int32: u of each decision of the team row (0 elsewhere)
  value_valid: np.ndarray  # [B, P] bool: decisions the value loss trains on
  old_value: np.ndarray  # [B, P] f32: the values at rollout time (the clip's centre)
  returns: np.ndarray  # [B, P] f32: the value targets
  # [B] bool: re-tokenized turns whose critic tokens stop spelling the reply's text (each later
  # decision valued at the last critic token before where they stop; `critic/unaligned_turns`)
  unaligned: np.ndarray


@struct.dataclass
class CriticExtras:
  critic_hidden: Any  # [B, T, D] the frozen base's hidden states (no critic LoRA), or None


# --- the critic's view of each turn (host) ------------------------------------------------------


def written_lengths(tokenizer, prefixes: Sequence[Sequence[int]], text: str) -> np.ndarray:
  """[n] c_j: the whole characters of `text` (the policy's decoded reply) each prefix of its
  sampled ids had written, non-decreasing.

  A prefix's decoding agrees with `text` on its first k characters. A U+FFFD it ends on may
  be a character's first bytes, which the next token decides (continued, a character;
  broken off, U+FFFD in `text` too): it counts only where no continuation byte after it
  (`_continuations`) decodes otherwise; in a vocabulary without byte tokens to try, none of
  the U+FFFDs it ends on counts."""
  decoded = tokenizer.batch_decode([list(p) for p in prefixes], skip_special_tokens=True)
  continuations = _continuations(tokenizer)
  lengths = []
  for p, d in zip(prefixes, decoded):
    k = len(os.path.commonprefix([d, text]))
    if k == len(d) and d.endswith(_REPLACEMENT):
      if not continuations:  # how many of its U+FFFDs may be bytes still open: all
        k = len(d.rstrip(_REPLACEMENT))
      elif not _broken_off(tokenizer, list(p), d, continuations):
        k -= 1  # one (a byte-level vocabulary decodes what is open as one U+FFFD)
    lengths.append(k)
  return _running_max(lengths)


def reached_lengths(tokenizer, prefixes: Sequence[Sequence[int]], text: str
                    ) -> tuple[np.ndarray, bool]:
  """([n] e_i: how many characters of `text` each prefix of the critic's ids of `text`
  reaches, non-decreasing; whether every prefix is accounted for).

  A prefix reaches k where it decodes to text[:k] (special tokens spelled out: the critic's
  tokenizer reads a reply's literal "<|im_end|>" as its special token), k + 1 where it
  decodes to text[:k] then U+FFFD, fewer than character k has bytes (those bytes so far).
  Characters the tokenizer gives no ids for (`_unencoded`: SmolLM2's GGUF vocabulary has no
  token for bytes 0x04, 0x13, ...) may be skipped: a prefix that spells `text` without them
  reaches up to its last character. Where both readings fit, the farther counts. A prefix
  that neither fits reaches past the whole text (len(text) + 1), and so does every later
  one: no decision is valued at it, each at the last prefix known to end before it
  (`value_positions`)."""
  decoded = tokenizer.batch_decode([list(p) for p in prefixes], skip_special_tokens=False)
  dropped = _unencoded(tokenizer, text)
  kept = [i for i, ch in enumerate(text) if ch not in dropped]
  spelled = "".join(text[i] for i in kept)
  lengths = []
  for d in decoded:
    reach = [_reach(d, text)]
    if dropped:
      k = _reach(d, spelled)
      reach.append(None if k is None else kept[k - 1] + 1 if k else 0)
    known = [k for k in reach if k is not None]
    lengths.append(max(known) if known else len(text) + 1)
  ends = _running_max(lengths)
  return ends, bool(np.all(ends <= len(text)))


def _reach(decoded: str, text: str) -> Optional[int]:
  """k where `decoded` is text[:k]; k + 1 where it is text[:k] then U+FFFD, fewer than
  character k's bytes in UTF-8 (those of it so far); None otherwise."""
  k = len(os.path.commonprefix([decoded, text]))
  tail = decoded[k:]
  if not tail:
    return k
  if (k < len(text) and len(tail) < len(text[k].encode("utf-8"))
      and not tail.strip(_REPLACEMENT)):
    return k + 1
  return None


def _continuations(tokenizer) -> list[list[int]]:
  """Ids of byte strings that continue any character's first bytes (0x80, 0x90 or 0xA0, then
  0x80s: one of them fits each lead byte) in a byte-level vocabulary's alphabet, checked
  to do so (0xC3 0x80 is "À"); none for another vocabulary."""
  # Here, not at the top: a tokenizer has loaded transformers by now; importers of this module
  # that never tokenize need not.
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  spelling = bytes_to_unicode()
  ids = {b: tokenizer.convert_tokens_to_ids(spelling[b]) for b in (0xC3, 0x80, 0x90, 0xA0)}
  if any(i is None or i == tokenizer.unk_token_id for i in ids.values()) or \
      tokenizer.decode([ids[0xC3], ids[0x80]]) != "\u00c0":
    return []
  return [[ids[first]] + [ids[0x80]] * n for first in (0x80, 0x90, 0xA0) for n in range(3)]


def _broken_off(tokenizer, prefix: list[int], decoded: str, continuations) -> bool:
  """Whether the U+FFFD `prefix` decodes to at its end (`decoded`) stays, whatever follows:
  no continuation decodes otherwise."""
  tried = tokenizer.batch_decode([prefix + c for c in continuations], skip_special_tokens=True)
  return all(t.startswith(decoded) for t in tried)


def _unencoded(tokenizer, text: str) -> frozenset:
  """The characters of `text` that `tokenizer` gives no ids for, each on its own."""
  chars = sorted(set(text))
  ids = tokenizer(chars, add_special_tokens=False)["input_ids"] if chars else []
  return frozenset(ch for ch, i in zip(chars, ids) if not i)


def _running_max(lengths: Sequence[int]) -> np.ndarray:
  return np.maximum.accumulate(np.asarray(lengths, np.int64)) if len(lengths) else \
      np.zeros((0,), np.int64)


def value_positions(prompt_len: int, reply_starts: np.ndarray, critic_ends: np.ndarray
                    ) -> np.ndarray:
  """u_j = prompt_len − 1 + #{i : critic_ends[i] ≤ reply_starts[j]} (module docstring).

  Args:
    prompt_len: the critic's prompt tokens (≥ 1).
    reply_starts: [n] c_j, the whole characters of the reply text the policy wrote before its
      token j (`written_lengths`).
    critic_ends: [m] e_i, the characters the critic's reply tokens up to i reach
      (`reached_lengths`; non-decreasing, len(text) + 1 past where they stop agreeing).
  Returns:
    [n] int32 critic positions.
  """
  return (prompt_len - 1 + np.searchsorted(critic_ends, reply_starts, side="right")
          ).astype(np.int32)


def critic_row(turn, reply_ids: Sequence[int], policy_tokenizer, tokenizer
               ) -> tuple[list[int], np.ndarray, bool]:
  """(the critic's tokens of a turn of another backbone: its prompt messages in `tokenizer`'s
  chat template, then its reply's text; [n] u_j of each of its n sampled `reply_ids`;
  whether the critic's tokens of the reply spell its text to the end, `reached_lengths`)."""
  if not turn.messages:
    raise ValueError(f"the {turn.role!r} turn has no prompt messages to re-tokenize (a "
                     "per-agent view turn records them)")
  prompt = chat_prompt(tokenizer, turn.messages)
  reply = tokenizer(turn.reply, add_special_tokens=False)["input_ids"]
  starts = written_lengths(policy_tokenizer, [reply_ids[:j] for j in range(len(reply_ids))],
                           turn.reply)
  ends, aligned = reached_lengths(tokenizer, [reply[:i + 1] for i in range(len(reply))],
                                  turn.reply)
  return list(prompt) + list(reply), value_positions(len(prompt), starts, ends), aligned


def critic_batch(episodes, batch: TrainBatch, owner: np.ndarray, critic_index: int,
                 tokenizers: Sequence, num_rows: int, pad_id: int, row_length_step: int
                 ) -> CriticBatch:
  """The shared critic's batch of the team `batch` (`make_batch(episodes)`, per-agent view:
  one turn a row; `owner` [R] each row's backbone, `tokenizers` each backbone's, the critic's
  at `critic_index`), padded to `num_rows` rows; targets zero until `with_targets`."""
  tokenizer = tokenizers[critic_index]
  rows, positions, unaligned = [], [], []
  for episode in episodes:
    for sequence in episode.sequences:
      if len(sequence.spans) != 1:  # `config.resolve.check_backbones` refuses the shared stream
        raise ValueError("the shared critic of a split team reads one turn a row (the "
                         f"per-agent view); a row holds {len(sequence.spans)}")
      r, span = len(rows), sequence.spans[0]
      ids = np.asarray(sequence.tokens, np.int32)
      if owner[r] == critic_index:
        rows.append(ids)
        positions.append(np.arange(span.start - 1, span.end - 1, dtype=np.int32))
        unaligned.append(False)
      else:
        tokens, u, aligned = critic_row(episode.turns[span.step], ids[span.start:span.end],
                                        tokenizers[owner[r]], tokenizer)
        rows.append(np.asarray(tokens, np.int32))
        positions.append(u)
        unaligned.append(not aligned)
  if len(rows) > num_rows:
    raise ValueError(f"{len(rows)} turns for a critic batch of {num_rows} rows")
  T, P = row_length(max(len(r) for r in rows), row_length_step), batch.tokens.shape[1]
  tokens = np.full((num_rows, T), pad_id, np.int32)
  mask = np.zeros((num_rows, T), bool)
  value_pos = np.zeros((num_rows, P), np.int32)
  for r, (ids, u) in enumerate(zip(rows, positions)):
    tokens[r, :len(ids)], mask[r, :len(ids)] = ids, True
    value_pos[r, np.flatnonzero(batch.act_mask[r])] = u
  zeros = np.zeros((num_rows, P), np.float32)
  flags = np.zeros((num_rows,), bool)
  flags[:len(unaligned)] = unaligned
  return CriticBatch(tokens=tokens, mask=mask, act_agent=np.full((num_rows, T), -1, np.int32),
                     value_pos=value_pos, value_valid=np.zeros((num_rows, P), bool),
                     old_value=zeros, returns=zeros, unaligned=flags)


def team_values(values: np.ndarray, critic: CriticBatch, batch: TrainBatch) -> np.ndarray:
  """[B, P] the team batch's `act_old_value`: the critic's [B', T] `values` at each
  decision's u_j (0 where no decision)."""
  B = batch.tokens.shape[0]
  picked = np.take_along_axis(np.asarray(values)[:B], critic.value_pos[:B], axis=1)
  return np.where(batch.act_mask, picked, 0.0).astype(np.float32)


def with_targets(critic: CriticBatch, batch: TrainBatch, token_level: bool) -> CriticBatch:
  """`critic` with the value loss's targets from the team `batch` (advantages computed): each
  decision's return and rollout value (token level), or each turn's at its first decision
  (action level: the turn's value position)."""
  B, P = batch.act_mask.shape
  valid = np.asarray(batch.act_mask, bool)
  if not token_level:
    first = np.zeros_like(valid)
    rows, turns = np.nonzero(batch.turn_valid)
    first[rows, batch.turn_value_pos[rows, turns]] = True
    valid = first
  pad = lambda x, fill: np.concatenate([x, np.full((critic.tokens.shape[0] - B, P), fill,
                                                   x.dtype)])
  return critic.replace(value_valid=pad(valid, False),
                        old_value=pad(np.asarray(batch.act_old_value, np.float32), 0.0),
                        returns=pad(np.asarray(batch.act_return, np.float32), 0.0))


# --- its learner ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SharedCritic:
  """The shared critic's learner, on backbone `name` (index `index` among the split's)."""

  name: str
  index: int
  model: Any  # `build.model.Model` (training layout)
  tokenizers: tuple  # every backbone's, in the split's order
  hidden: Any  # `critic.value_fns`' hidden (frozen base), or None
  values: Any  # `critic.batch_values_fn`: [B, T] values at rollout time
  update: Any  # `make_critic_update`'s
  num_rows: int
  pad_id: int
  row_length_step: int
  minibatches: int

  def batch(self, episodes, batch: TrainBatch, owner: np.ndarray) -> CriticBatch:
    """`critic_batch`, refused (naming critic.backbone) where a re-tokenized turn is longer
    than the critic's model reads."""
    rows = critic_batch(episodes, batch, owner, self.index, self.tokenizers, self.num_rows,
                        self.pad_id, self.row_length_step)
    longest, limit = int(rows.mask.sum(axis=1).max()), self.model.config.max_position_embeddings
    if longest > limit:
      raise ValueError(f"critic.backbone={self.name!r}: a turn re-tokenized in its vocabulary "
                       f"is {longest} tokens, more than its model's {limit} positions; put the "
                       "critic on another backbone, or shorten the turns")
    return rows

  def extras(self, critic, placed: CriticBatch) -> CriticExtras:
    """The frozen base's hidden states, once a batch (None with a critic LoRA)."""
    return CriticExtras(None if self.hidden is None else self.hidden(
        critic, self.model.params, placed, chunks=self.minibatches))


def make_critic_update(model_config, critic_config: critic_lib.CriticConfig, loss: LossConfig,
                       critic_optimizer, epochs: int, minibatches: int,
                       out_shardings: Any = None, logical_rows: Optional[int] = None):
  """The jitted `update(critic, critic_opt, params, batch, extras, rng)` of the shared
  critic alone: epochs × minibatches steps (`update.minibatch_slots`) of value_coef × the value
  loss (`update.LossConfig`: clipped, Huber or squared) at `CriticBatch.value_pos`, its gradient
  clipped to critic_max_grad_norm; a minibatch of padding alone, or with a loss or gradient
  not finite, changes nothing. `logical_rows`: the batch's rows on one device
  (`minibatch_slots`: the mesh does not change which rows train together). Returns (critic,
  critic_opt, metrics: value_loss and critic_grad_norm averaged over the trained minibatches,
  critic_nonfinite counted)."""
  values, _ = critic_lib.value_fns(critic_config, model_config)

  def value_loss(critic, params, batch: CriticBatch, extras: CriticExtras):
    v = values(critic, params, batch, extras, batch.value_pos)  # [B, P]
    raw = value_objective(v, batch.old_value, batch.returns, batch.value_valid, loss)
    return loss.value_coef * raw, raw

  grad_fn = jax.value_and_grad(value_loss, has_aux=True)

  def update(critic, critic_opt, params, batch, extras, rng):
    indices, taken = minibatch_slots(rng, jnp.any(batch.mask, axis=1), epochs, minibatches,
                                     logical_rows)

    def step(carry, xs):
      critic, opt = carry
      rows, take = xs

      def gradients(critic):
        mb, ex = jax.tree.map(lambda x: x[rows], (batch, extras))
        (_, raw), grads = grad_fn(critic, params, mb, ex)
        return raw, grads

      no_gradients = lambda c: (jnp.zeros(()), jax.tree.map(jnp.zeros_like, c))
      raw, grads = jax.lax.cond(take, gradients, no_gradients, critic)
      finite = jnp.isfinite(raw) & all_finite(grads)
      critic, opt, norm = critic_step(critic_optimizer, grads, critic, opt,
                                      loss.critic_max_grad_norm, finite & take)
      return (critic, opt), (raw, norm, take & ~finite)

    (critic, critic_opt), (raw, norm, bad) = jax.lax.scan(step, (critic, critic_opt),
                                                          (indices, taken))
    steps = jnp.maximum(jnp.sum(taken), 1)
    metrics = {"value_loss": jnp.sum(jnp.where(taken, raw, 0.0)) / steps,
               "critic_grad_norm": jnp.sum(jnp.where(taken, norm, 0.0)) / steps,
               "critic_nonfinite": jnp.sum(bad).astype(jnp.float32)}
    return critic, critic_opt, metrics

  return jax.jit(update, out_shardings=out_shardings)


def make_shared_critic(config, split, models, mesh, critic_optimizer, rows: int,
                       state_sharding) -> Optional[SharedCritic]:
  """The `SharedCritic` of a split team whose critic is shared (None otherwise): on
  `config.critic_backbone`, over batches of `rows` turns (rounded up so every minibatch splits
  over the shards); its update keeps `state_sharding`'s critic and critic_opt shardings."""
  critic_config = learner_lib.critic_config(config)
  if critic_config is None or critic_config.mode != "shared" or len(split.names) == 1:
    return None
  name = config.critic_backbone
  model = models[name]
  o = config.optimizer
  values, hidden = critic_lib.value_fns(critic_config, model.config)
  one_device, num_rows = learner_lib.update_rows(rows, o.minibatches, mesh)
  update = make_critic_update(
      model.config, critic_config, config.loss, critic_optimizer, o.epochs, o.minibatches,
      out_shardings=(state_sharding.critic, state_sharding.critic_opt,
                     sharding.replicated(mesh)),
      logical_rows=one_device)
  return SharedCritic(
      name=name, index=split.names.index(name), model=model,
      tokenizers=tuple(models[n].tokenizer for n in split.names), hidden=hidden,
      values=critic_lib.batch_values_fn(values, o.minibatches), update=update,
      num_rows=num_rows, pad_id=learner_lib.pad_id(model.tokenizer),
      row_length_step=o.row_length_step, minibatches=o.minibatches)
