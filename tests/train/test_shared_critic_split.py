"""The shared critic of a team split over two backbones (issue 41, `train.shared_critic`).

The team of test_backbones: the planner on "smol" (SmolLM2's GGUF tokenizer), the checker and
the solver on "main" (the tiny BPE); one shared critic on "smol" (`critic.backbone`).
References: each turn's state built again from the texts its role may see, in the critic's
chat template and vocabulary; the critic's own forward over those tokens; a position rule
written from its definition (the longest critic prefix whose text the policy had produced
before the decided token); test_dag_credit's NumPy backups.
"""

import codecs
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import envs
from marft_jax.models import tiny
from marft_jax.rollout import context
from marft_jax.train import backbones, loop, shared_critic
from marft_jax.train.build import learner as learner_lib
from marft_jax.train import run as run_lib
from marft_jax.train.build import team as team_lib
from marft_jax.train import checkpoint as checkpoint_lib
from marft_jax.train import config as config_lib
from marft_jax.train import critic as critic_lib
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train.update import LossConfig
from tests.train.test_backbones import smol_tokenizer  # noqa: F401 (a fixture, found by name)
from tests.train.test_backbones import (HOPS, _trainer_models, assert_chain_backups,
                                        assert_resumes_bit_for_bit, split_config)


# --- the position rule --------------------------------------------------------------------------


def test_a_decision_is_valued_at_the_last_critic_token_ending_before_it():
  """Reply "abcdef": policy tokens "ab" "c" "def" start at 0, 2, 3; critic tokens "a" "bcd"
  "ef" end at 1, 4, 6. After a 5-token critic prompt: decision 0 at the prompt's last token
  (4); decisions 1 and 2 after "a" (5): "bcd" straddles both starts."""
  u = shared_critic.value_positions(5, np.array([0, 2, 3]), np.array([1, 4, 6]))
  np.testing.assert_array_equal(u, [4, 5, 5])
  # Boundaries that agree: each critic token ending at a start counts.
  np.testing.assert_array_equal(
      shared_critic.value_positions(3, np.array([0, 2, 3]), np.array([2, 3, 6])), [2, 3, 4])


def test_written_and_reached_lengths_count_a_character_split_between_tokens_whole(smol_tokenizer):
  """"é" is two bytes: a prefix ending between them has not written it (1 character), but
  reaches into it (2)."""
  text = "aé b"
  byte_ids = [smol_tokenizer.convert_tokens_to_ids(t) for t in ("a", "Ã", "©", "Ġb")]
  assert smol_tokenizer.decode(byte_ids) == text
  prefixes = [byte_ids[:i] for i in range(5)]
  np.testing.assert_array_equal(shared_critic.written_lengths(smol_tokenizer, prefixes, text),
                                [0, 1, 1, 2, 4])
  ends, aligned = shared_critic.reached_lengths(smol_tokenizer, prefixes, text)
  np.testing.assert_array_equal(ends, [0, 1, 2, 2, 4])
  assert aligned


def _byte_decoder():
  """GPT-2's byte-level alphabet, inverted: the character a vocabulary writes for each byte."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def _token_bytes(tokenizer, ids, spell_special: bool = False) -> list[bytes]:
  """Each id's bytes; a special token's none (a reply's text drops it), or with
  `spell_special` those of its string (what a critic state holds in its place)."""
  alphabet, special = _byte_decoder(), set(tokenizer.all_special_ids)
  return [b"" if i in special and not spell_special else bytes(alphabet[ch] for ch in piece)
          for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids)))]


def _written(tokenizer, ids, text) -> np.ndarray:
  """[n + 1] the characters of `text` the policy's ids[:j] had written, j = 0..n: those
  Python's incremental UTF-8 decoder has given out for its bytes so far, whatever bytes come
  next (it holds back a character begun, and bytes a later one may still complete)."""
  decoder = codecs.getincrementaldecoder("utf-8")("replace")
  out, chars = [0], ""
  for piece in _token_bytes(tokenizer, ids):
    chars += decoder.decode(piece)
    out.append(len(chars))
  assert chars + decoder.decode(b"", final=True) == text
  return np.asarray(out)


def _byte_ends(tokenizer, ids) -> np.ndarray:
  """[n + 1] how many bytes ids[:i] write, i = 0..n (from the vocabulary's byte alphabet)."""
  decoder = _byte_decoder()
  pieces = tokenizer.convert_ids_to_tokens(list(ids))
  assert all(ch in decoder for t in pieces for ch in t)
  return np.concatenate([[0], np.cumsum([len(t) for t in pieces])]).astype(int)


def test_positions_follow_the_rule_in_bytes_on_drawn_texts(smol_tokenizer):
  """Texts drawn from ASCII and 2- to 4-byte characters, tokenized by either vocabulary as the
  policy's and re-tokenized by the other as the critic's: u_j from `written_lengths`,
  `reached_lengths` and `value_positions` equals the rule computed on the tokens' bytes
  (whole characters the policy wrote before token j; characters each critic prefix touches),
  and no critic state holds a byte the policy had not written."""
  vocabularies = (tiny.tiny_tokenizer(), smol_tokenizer)
  alphabet = list("abcdefghij klmnop 0123456789 .,!?\n") + ["é", "ß", "中", "文", "😀", "→"]
  rng = np.random.default_rng(0)
  checked = 0
  for _ in range(60):
    text = "".join(rng.choice(alphabet, rng.integers(1, 30)))
    starts_b = [len(text[:k].encode()) for k in range(len(text))]
    ends_b = [len(text[:k + 1].encode()) for k in range(len(text))]
    for policy, critic in (vocabularies, vocabularies[::-1]):
      p = policy(text, add_special_tokens=False)["input_ids"]
      c = critic(text, add_special_tokens=False)["input_ids"]
      p_bytes, c_bytes = _byte_ends(policy, p), _byte_ends(critic, c)
      assert p_bytes[-1] == len(text.encode()) == c_bytes[-1]
      starts = shared_critic.written_lengths(policy, [p[:j] for j in range(len(p))], text)
      ends, aligned = shared_critic.reached_lengths(critic, [c[:i + 1] for i in range(len(c))],
                                                    text)
      assert aligned
      u = shared_critic.value_positions(1, starts, ends)  # a 1-token prompt: u_j = count
      touched = [sum(s < c_bytes[i + 1] for s in starts_b) for i in range(len(c))]
      for j in range(len(p)):
        whole = sum(end <= p_bytes[j] for end in ends_b)
        assert u[j] == sum(t <= whole for t in touched), (text, j)
        assert c_bytes[u[j]] <= p_bytes[j]  # no byte of token j or later
        checked += 1
  assert checked > 1000


# --- a trained split team with a shared critic -----------------------------------------------


def shared_config(algorithm="marft_t", **changes):
  roles = (config_lib.RoleSection("planner", "Say it.", "Says.", backbone="smol"),
           config_lib.RoleSection("checker", "Check it.", "Checks."),
           config_lib.RoleSection("solver", "Repeat it.", "Repeats.", graded=True))
  base = split_config(algorithm)
  sections = dict(
      rollout=dataclasses.replace(base.rollout, num_envs=4), checkpoint_every=1, iterations=2,
      team=dataclasses.replace(base.team, roles=roles, order="planner,checker,solver",
                               num_roles=0),
      critic=dataclasses.replace(base.critic, mode="shared", backbone="smol"),
      advantage=dataclasses.replace(config_lib.TrainConfig().advantage, normalize=False,
                                    **HOPS))
  sections.update(changes)
  return split_config(algorithm, **sections)


@pytest.fixture(scope="module")
def trained(smol_tokenizer, tmp_path_factory):
  """2 iterations of token-level MARFT with a checkpoint after each and a held-out
  evaluation before each and at the end; iteration 0's team batch, episodes, advantages and
  critic batch recorded, and the policies each evaluation scored."""
  models = _trainer_models(smol_tokenizer)
  config = shared_config(eval_every=1, eval_episodes=4)
  seen, rows, targets, evaluated = [], [], [], []
  real_advantages, real_rows = backbones.compute_advantages, shared_critic.critic_batch
  real_targets, real_evaluate = shared_critic.with_targets, evaluate_lib.evaluate

  def record(batch, episodes, *args, **kwargs):
    seen.append((batch, episodes, real_advantages(batch, episodes, *args, **kwargs)))
    return seen[-1][2]

  def record_rows(*args, **kwargs):
    rows.append(real_rows(*args, **kwargs))
    return rows[-1]

  def record_targets(*args, **kwargs):
    targets.append(real_targets(*args, **kwargs))
    return targets[-1]

  def record_evaluation(config, model, policy, **kwargs):
    evaluated.append((policy, real_evaluate(config, model, policy, **kwargs)))
    return evaluated[-1][1]

  workdir = str(tmp_path_factory.mktemp("shared"))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(backbones, "compute_advantages", record)
    patch.setattr(shared_critic, "critic_batch", record_rows)
    patch.setattr(shared_critic, "with_targets", record_targets)
    patch.setattr(evaluate_lib, "evaluate", record_evaluation)
    metrics = loop.train(config, workdir, model=models, progress=False)
  return dict(config=config, models=models, workdir=workdir, metrics=metrics, seen=seen,
              rows=rows, targets=targets, evaluated=evaluated)


def _team(config):
  return team_lib.build_team(config)[0]


def _reference_states(trained, episode):
  """Per row of `episode`: (the critic's tokens of its state and reply, built from the texts
  its role may see; its prompt's length)."""
  smol = trained["models"]["smol"].tokenizer
  team = _team(trained["config"])
  observation = envs.Observation(task=episode.task)
  out = []
  for k, (turn, sequence) in enumerate(zip(episode.turns, episode.sequences)):
    if k == 0:  # the planner, on the critic's backbone: its sampled ids
      span = sequence.spans[0]
      out.append((list(sequence.tokens), span.start))
      continue
    visible = [(a, t.reply) for a, t in enumerate(episode.turns[:k])]
    prompt = context.per_agent_prompt(smol, team[k], team, observation, [], visible)
    out.append((prompt + smol(turn.reply, add_special_tokens=False)["input_ids"], len(prompt)))
  return out


def test_the_critic_reads_each_turn_as_its_text_in_the_critics_tokens(trained):
  batch, episodes, _ = trained["seen"][0]
  critic_rows = trained["rows"][0]
  r = 0
  for episode in episodes:
    assert [t.role for t in episode.turns] == ["planner", "checker", "solver"]
    for tokens, _ in _reference_states(trained, episode):
      n = int(critic_rows.mask[r].sum())
      np.testing.assert_array_equal(critic_rows.tokens[r, :n], tokens)
      assert critic_rows.mask[r, :n].all()
      r += 1
  assert not critic_rows.mask[r:].any()
  main = trained["models"]["main"].tokenizer
  assert (critic_rows.tokens[:r].max() >= len(main))  # the checker's text in SmolLM2 ids


def _reference_positions(policy_tokenizer, critic_tokenizer, reply_ids, critic_ids,
                         prompt_len, text):
  """u_j from the definition: the critic prompt's last token, plus the most critic reply
  tokens whose text (special tokens spelled out) is a prefix of the whole characters the
  policy had written before its token j (`_written`: a character begun, or bytes a later
  token may still complete, left out)."""
  written = _written(policy_tokenizer, reply_ids, text)
  out = []
  for j in range(len(reply_ids)):
    before = text[:written[j]]
    count = 0
    for i in range(1, len(critic_ids) + 1):
      if before.startswith(critic_tokenizer.decode(critic_ids[:i], skip_special_tokens=False)):
        count = i
    out.append(prompt_len - 1 + count)
  return out


def _reference_values(trained, batch, episodes):
  """[B, T] the values the advantages should read: the initial critic's forward over each
  reference state, at each decision's reference position."""
  config, models = trained["config"], trained["models"]
  critic = run_lib.new_state(config, models)["smol"].critic
  smol = models["smol"]
  want = np.zeros_like(np.asarray(batch.act_old_value))
  r = 0
  for episode in episodes:
    for k, ((tokens, prompt_len), sequence) in enumerate(zip(
        _reference_states(trained, episode), episode.sequences)):
      span = sequence.spans[0]
      padded = np.zeros((1, -(-len(tokens) // 64) * 64), np.int32)  # few shapes to compile
      padded[0, :len(tokens)] = tokens
      v = np.asarray(critic_lib.values(critic, smol.params, jnp.asarray(padded), smol.config,
                                       learner_lib.critic_config(config),
                                       mask=jnp.asarray(np.arange(padded.shape[1])[None]
                                                        < len(tokens))))[0]
      decisions = np.arange(span.start - 1, span.end - 1)
      if k == 0:
        u = decisions
      else:
        policy = models["main"].tokenizer
        reply = list(sequence.tokens[span.start:span.end])
        u = _reference_positions(policy, smol.tokenizer, reply, tokens[prompt_len:],
                                 prompt_len, episode.turns[k].reply)
      want[r, decisions] = v[u]
      r += 1
  return want


def test_the_values_the_advantages_read_are_the_critics_at_each_decisions_state(trained):
  batch, episodes, out = trained["seen"][0]
  want = _reference_values(trained, batch, episodes)
  np.testing.assert_allclose(out.act_old_value, want, atol=1e-5)
  assert np.abs(want[batch.act_mask]).min() > 0  # every decision valued


def test_a_turn_longer_than_the_critics_positions_is_refused_naming_the_key(trained):
  batch, episodes, _ = trained["seen"][0]
  config, models = trained["config"], trained["models"]
  split = backbones.split_team(config, _team(config))
  smol = models["smol"]
  short = dataclasses.replace(smol, config=smol.config.replace(max_position_embeddings=40))
  critic = shared_critic.SharedCritic(
      name="smol", index=1, model=short, tokenizers=(models["main"].tokenizer, smol.tokenizer),
      hidden=None, values=None, update=None, num_rows=16, pad_id=0, row_length_step=32,
      minibatches=1)
  with pytest.raises(ValueError, match=r"critic.backbone='smol': a turn re-tokenized .* "
                                       r"more than its model's 40 positions"):
    critic.batch(episodes, batch, backbones.row_backbones(episodes, split))


def test_the_token_level_backups_match_the_numpy_reference(trained):
  """A turn's last token bootstraps from its successor's first-token value: the shared
  critic's at the successor's prompt, on whichever backbone the successor samples."""
  batch, episodes, out = trained["seen"][0]
  assert_chain_backups(batch, episodes, out, _reference_values(trained, batch, episodes))


def test_the_critic_trains_on_every_turns_decisions_toward_their_returns(trained):
  """Its value loss covers every decision of every role's turn (token level), each toward
  its return (unwhitened here: advantage + value, from the references above), at rollout
  values as the clip's centre; its padding rows weigh nothing."""
  batch, episodes, out = trained["seen"][0]
  filled = trained["targets"][0]
  values = _reference_values(trained, batch, episodes)
  B = batch.tokens.shape[0]
  np.testing.assert_array_equal(filled.value_valid[:B], batch.act_mask)
  assert not filled.value_valid[B:].any()
  decided = batch.act_mask
  np.testing.assert_allclose(filled.old_value[:B][decided], values[decided], atol=1e-5)
  np.testing.assert_allclose(filled.returns[:B][decided],
                             out.act_advantage[decided] + values[decided], atol=1e-4)


def test_the_critic_trains_on_its_backbone_alone_and_resumes_bit_for_bit(trained, tmp_path):
  template, restored = assert_resumes_bit_for_bit(trained, tmp_path)
  assert template["main"].critic is None and template["smol"].critic is not None
  assert restored[0]["main"].critic is None
  moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(template["smol"].critic), jax.tree.leaves(restored[0]["smol"].critic))]
  assert all(moved)
  assert trained["metrics"]["value_loss"] > 0 and trained["metrics"]["critic_grad_norm"] > 0
  # every turn of the last iteration read to its end (`critic/unaligned_turns`)
  assert not trained["rows"][-1].unaligned.any()
  assert trained["metrics"]["critic/unaligned_turns"] == 0


def test_held_out_evaluation_scores_the_split_teams_policy_of_each_iteration(trained):
  """eval_every on a split team: before iteration 0 (the fresh adapters), before iteration 1
  (those of checkpoint 1) and at the end (checkpoint 2), each backbone's adapters; the final
  scores are the run's heldout/ metrics."""
  config, models, workdir = trained["config"], trained["models"], trained["workdir"]
  template = run_lib.new_state(config, models)
  with checkpoint_lib.Checkpointer(workdir) as checkpointer:
    states = [template] + [checkpointer.restore(template, step=s)[0] for s in (1, 2)]
  assert len(trained["evaluated"]) == 3
  for (policy, _), state in zip(trained["evaluated"], states):
    assert set(policy) == {"main", "smol"}
    for name in policy:
      for a, b in zip(jax.tree.leaves(policy[name]), jax.tree.leaves(state[name].policy)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  final = trained["evaluated"][-1][1]
  assert final["episodes"] == 4
  assert {k: trained["metrics"][f"heldout/{k}"] for k in final} == pytest.approx(final)
  # launch.eval's restore of the checkpoint (the critic on smol alone) gives the same adapters
  policies, step = evaluate_lib.restore_policy(config, models, workdir)
  assert step == 2
  for name in policies:
    for a, b in zip(jax.tree.leaves(policies[name]), jax.tree.leaves(states[2][name].policy)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_critic_update_fits_its_targets_at_the_value_positions(smol_tokenizer):
  """The shared critic's own update, repeated on one batch of two rows: its value loss at
  the decisions' positions falls toward the targets; positions not valid pull nothing."""
  model = _trainer_models(smol_tokenizer)["smol"]
  critic_config = critic_lib.CriticConfig(mode="shared", hidden=(16,))
  loss = LossConfig(value_clip=None, huber_delta=None)
  import optax
  optimizer = optax.adam(1e-2)
  update = shared_critic.make_critic_update(model.config, critic_config, loss, optimizer,
                                            epochs=1, minibatches=1)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 300, (2, 16)).astype(np.int32)
  value_pos = np.tile(np.arange(16, dtype=np.int32), (2, 1))
  valid = np.zeros((2, 16), bool)
  valid[:, [3, 7, 11]] = True
  batch = shared_critic.CriticBatch(
      tokens=tokens, mask=np.ones((2, 16), bool), act_agent=np.full((2, 16), -1, np.int32),
      value_pos=value_pos, value_valid=valid, old_value=np.zeros((2, 16), np.float32),
      returns=np.where(valid, 1.5, -100.0).astype(np.float32), unaligned=np.zeros(2, bool))
  critic = critic_lib.init_critic(critic_config, model.config, 1, jax.random.key(0))
  opt = optimizer.init(critic)
  h = critic_lib.critic_hidden_states(critic, model.params, jnp.asarray(tokens), model.config,
                                      critic_config)
  extras = shared_critic.CriticExtras(critic_hidden=h)
  losses = []
  for _ in range(30):
    critic, opt, metrics = update(critic, opt, model.params, batch, extras, jax.random.key(1))
    losses.append(float(metrics["value_loss"]))
  v = np.asarray(critic_lib.values_from_hidden(critic["head"], h, None, "shared"))
  want = np.mean((np.zeros(6) - 1.5) ** 2) * 0.5  # 0.5 (v - R)^2 at the start (v ≈ 0)
  assert losses[0] == pytest.approx(want, rel=0.05)
  assert losses[-1] < 0.05 * losses[0]
  np.testing.assert_allclose(v[valid], 1.5, atol=0.3)  # -100 elsewhere never pulled them


def test_at_the_action_level_the_default_critic_values_each_turn_at_its_prompt(
    smol_tokenizer, tmp_path):
  """MARFT-A, critic.backbone unset, a critic LoRA: the critic lives on the roles' first
  backbone ("main", the tiny BPE), reads the planner's SmolLM2 turns as text in its own
  vocabulary, and each turn's value is its value at the last token of the turn's prompt
  there; its LoRA trains."""
  models = _trainer_models(smol_tokenizer)
  base = shared_config()
  config = shared_config(
      algorithm="marft_a", iterations=1,
      critic=dataclasses.replace(base.critic, backbone="", lora_rank=4),
      loss=config_lib.TrainConfig().loss, checkpoint_every=1,
      advantage=dataclasses.replace(config_lib.TrainConfig().advantage, normalize=False))
  assert config.critic_backbone == "main" and config.advantage.level == "action"
  seen = []
  real = backbones.compute_advantages

  def record(batch, episodes, *args, **kwargs):
    seen.append((batch, episodes))
    return real(batch, episodes, *args, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(backbones, "compute_advantages", record)
    metrics = loop.train(config, str(tmp_path), model=models, progress=False)
  batch, episodes = seen[0]
  critic = run_lib.new_state(config, models)["main"].critic
  main, team = models["main"], _team(config)
  r = 0
  for episode in episodes:
    for k, (turn, sequence) in enumerate(zip(episode.turns, episode.sequences)):
      visible = [(a, t.reply) for a, t in enumerate(episode.turns[:k])]
      prompt = context.per_agent_prompt(main.tokenizer, team[k], team,
                                        envs.Observation(task=episode.task), [], visible)
      own = list(sequence.tokens[:sequence.spans[0].start])
      assert (prompt == own) == (k > 0)  # the planner's own prompt is in SmolLM2 ids
      padded = np.zeros((1, 128), np.int32)
      padded[0, :len(prompt)] = prompt
      v = critic_lib.values(critic, main.params, jnp.asarray(padded), main.config,
                            learner_lib.critic_config(config),
                            mask=jnp.asarray(np.arange(128)[None] < len(prompt)))
      assert batch.act_old_value[r, batch.turn_value_pos[r, 0]] == pytest.approx(
          float(v[0, len(prompt) - 1]), abs=1e-5)
      r += 1
  assert metrics["value_loss"] > 0
  with checkpoint_lib.Checkpointer(str(tmp_path)) as checkpointer:
    after = checkpointer.restore(run_lib.new_state(config, models), step=1)[0]
  assert after["smol"].critic is None
  assert np.abs(np.asarray(jax.tree.leaves(after["main"].critic["lora"].layers)[1])).max() > 0
