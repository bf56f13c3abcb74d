"""pass@k and sampled evaluation (issue 40): the estimator against a direct count over every
k-subset of the samples, the per-role summary against per-problem counts, and `play`'s n
samples of a problem decoded together in one group of one rollout."""

import dataclasses
import json
import itertools
import math
import types

import numpy as np
import pytest

from marft_jax.rollout.episode import Episode
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import run as run_lib
from tests.train.test_evaluate import ANSWER_1, _config, scripted_model


def _direct(n, c, k):
  """The share of the k-subsets of n samples (c of them passing) that hold a pass."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(samples, k))
  return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      assert evaluate_lib.pass_at_k(n, c, k) == pytest.approx(_direct(n, c, k), abs=1e-12)


def test_pass_at_k_for_large_n_and_bad_arguments():
  # n = 200, c = 3, k = 100: 1 - C(197, 100) / C(200, 100), by exact integers.
  exact = 1 - math.comb(197, 100) / math.comb(200, 100)
  assert evaluate_lib.pass_at_k(200, 3, 100) == pytest.approx(exact, rel=1e-12)
  assert evaluate_lib.pass_at_k(20, 0, 10) == 0.0 and evaluate_lib.pass_at_k(20, 11, 10) == 1.0
  for n, c, k in [(5, 6, 1), (5, 2, 6), (5, 2, 0)]:
    with pytest.raises(ValueError, match="needs 0 <= c <= n and 1 <= k <= n"):
      evaluate_lib.pass_at_k(n, c, k)


def _episode(seed, correct, dropped=None):
  return Episode(env_index=0, seed=seed, task="t", policy_version=0, rewards=[[0.0]],
                 infos=[{"correct": correct}], dropped=dropped)


def test_summarize_samples_reports_pass_at_k_per_graded_role():
  team, _ = evaluate_lib.greedy_team(dataclasses.replace(_config()))
  role = [p.role for p in team if p.graded][0]
  rng = np.random.default_rng(40)
  passes = {seed: rng.random(5) < rng.random() for seed in range(7)}  # 7 problems, n = 5
  episodes = [_episode(seed, {role: bool(p)}) for seed, ps in passes.items() for p in ps]
  episodes[3] = dataclasses.replace(episodes[3], dropped="env_error: x")  # counts as failed
  passes[0][3] = False
  out = evaluate_lib.summarize_samples(episodes, team, 5, 0.8, ks=(1, 2, 5))
  for k in (1, 2, 5):
    expected = np.mean([_direct(5, int(ps.sum()), k) for ps in passes.values()])
    assert out[f"pass@{k}/{role}"] == pytest.approx(expected)
  assert out["decoding"] == "n=5 T=0.8" and out["problems"] == 7 and out["episodes"] == 35
  with pytest.raises(ValueError, match=r"k=\[6\]: k must be between 1 and the 5 samples"):
    evaluate_lib.summarize_samples(episodes, team, 5, 0.8, ks=(1, 6))
  greedy = evaluate_lib.summarize_samples(episodes[:1], team, 1, 0.0)
  assert greedy["decoding"] == "greedy" and greedy[f"pass@1/{role}"] == 1.0


def test_the_samples_of_a_problem_are_one_group_of_one_rollout(monkeypatch):
  model, config = scripted_model(ANSWER_1), _config()
  calls = []
  real = run_lib.rollout

  def counting(envs, team, *args, **kwargs):
    calls.append((len(envs), envs.group_size, [p.sampling.temperature for p in team]))
    return real(envs, team, *args, **kwargs)

  monkeypatch.setattr(run_lib, "rollout", counting)
  episodes = evaluate_lib.play(config, model, num_problems=3, batch_size=32, samples=4,
                               temperature=0.05)
  assert calls == [(12, 4, [0.05, 0.05])]  # 3 problems x 4 samples, one call
  assert len(episodes) == 12
  tasks = [e.task for e in episodes]
  assert all(len(set(tasks[i:i + 4])) == 1 for i in range(0, 12, 4))
  assert len({e.seed for e in episodes}) == 3
  with pytest.raises(ValueError, match="greedy samples are all the same"):
    evaluate_lib.play(config, model, num_problems=3, samples=2)


# --- maj@n (math): the majority answer over a problem's n samples -----------------------------

def test_majority_vote_by_hand():
  # 7 and 12 tie at two votes each (12.0 is 12; None does not vote): 7 came first, and is wrong.
  predictions = ["7", "12", None, "12.0", "7", "x"]
  correct = [False, True, False, True, False, False]
  assert not evaluate_lib.majority_correct(predictions, correct)
  assert evaluate_lib.majority_correct(predictions + ["12"], correct + [True])
  assert evaluate_lib.majority_correct(["1,200", "1200", "5", "5"], [True, True, False, False])
  assert not evaluate_lib.majority_correct([None, None], [False, False])
  assert evaluate_lib.majority_correct([r"\frac{1}{2}", "0.5", r"\frac {1}{2}"],
                                       [True, True, True])


_FORMS = (lambda v: str(v), lambda v: f"{v}.0", lambda v: f" {v * 1000:,} " if v else "0",
          lambda v: f"${v}")


def _reference_majority(values, gold):
  """From the values themselves (not their text): np.bincount's most voted value, ties to
  the value drawn first; right when it is the gold one."""
  voted = [v for v in values if v is not None]
  if not voted:
    return False
  counts = np.bincount(voted)
  tied = set(np.flatnonzero(counts == counts.max()))
  return next(v for v in voted if v in tied) == gold


def _rendered(values, forms):
  """Each value as text in its drawn form (x 1000 for the grouped form), None kept."""
  return [None if v is None else _FORMS[f](v) for v, f in zip(values, forms)]


def _scaled(values, forms):
  return [None if v is None else v * (1000 if f == 2 else 1) for v, f in zip(values, forms)]


def test_majority_vote_matches_a_count_over_the_values():
  rng = np.random.default_rng(4040)
  for _ in range(300):
    n = int(rng.integers(1, 12))
    values = [None if rng.random() < 0.2 else int(rng.integers(0, 4)) for _ in range(n)]
    forms = [int(f) for f in rng.integers(0, len(_FORMS), n)]
    gold = int(rng.integers(0, 4)) * 1000 if rng.random() < 0.5 else int(rng.integers(0, 4))
    true_values = _scaled(values, forms)
    correct = [v == gold for v in true_values]
    assert evaluate_lib.majority_correct(_rendered(values, forms), correct) == \
        _reference_majority(true_values, gold), (values, forms, gold)


def _math_episode(seed, role, value, gold, dropped=None):
  info = {"correct": {role: value == gold}, "prediction": {role: None if value is None
                                                                  else str(value)}}
  return Episode(env_index=0, seed=seed, task="t", policy_version=0, rewards=[[0.0]],
                 infos=[info], dropped=dropped)


def test_summarize_samples_reports_maj_at_n_beside_the_mean_accuracy():
  team, _ = evaluate_lib.greedy_team(_config())
  role = [p.role for p in team if p.graded][0]
  rng = np.random.default_rng(41)
  golds = {seed: int(rng.integers(0, 3)) for seed in range(9)}  # 10 problems, n = 5
  values = {seed: [None if rng.random() < 0.2 else int(rng.integers(0, 3)) for _ in range(5)]
            for seed in golds}
  golds[9], values[9] = 4, [1, 4, 2, 4, 3]  # the right answer is the plurality, not a majority
  episodes = [_math_episode(seed, role, v, golds[seed]) for seed in golds for v in values[seed]]
  episodes[7] = dataclasses.replace(episodes[7], dropped="env_error: x")  # no vote, wrong
  values[1][2] = None
  out = evaluate_lib.summarize_samples(episodes, team, 5, 0.8)
  right = [v == golds[seed] for seed in golds for v in values[seed]]
  assert out[f"accuracy/{role}"] == pytest.approx(np.mean(right))
  assert out[f"maj@5/{role}"] == pytest.approx(
      np.mean([_reference_majority(values[s], golds[s]) for s in golds]))
  assert out["decoding"] == "n=5 T=0.8"
  assert f"maj@1/{role}" not in evaluate_lib.summarize_samples(episodes[:1], team, 1, 0.0)
  code = [_episode(seed, {role: True}) for seed in range(2) for _ in range(3)]  # no predictions
  assert not any(k.startswith("maj@") for k in evaluate_lib.summarize_samples(code, team, 3, 0.8))


def _problem_file(tmp_path, count):
  path = tmp_path / "test.jsonl"
  path.write_text("".join(json.dumps({"question": f"What is {n} + 0?", "answer": f"#### {n}"})
                          + "\n" for n in range(count)))
  return _config(name="math_jsonl", test_path=str(path))


@pytest.fixture
def starting_rollout(monkeypatch):
  """A stand-in rollout that only starts each environment's episode (no model: the batching
  is `play`'s); returns the list of its calls' sizes."""
  calls = []

  def starting(envs, *args, **kwargs):
    calls.append(len(envs))
    started = [(i, *envs.reset(i)) for i in range(len(envs))]
    return types.SimpleNamespace(episodes=[
        Episode(env_index=i, seed=seed, task=observation.task, policy_version=0, rewards=[],
                infos=[]) for i, seed, observation in started])

  monkeypatch.setattr(run_lib, "rollout", starting)
  return calls


def _play_file(config, problems, batch, samples=2):
  return evaluate_lib.play(config, types.SimpleNamespace(tokenizer=None),
                           num_problems=problems, batch_size=batch, samples=samples,
                           temperature=0.8, rollout_weights=(None, None))


def test_eval_batch_puts_several_problems_samples_in_one_call_with_the_same_problems(
    tmp_path, starting_rollout):
  """--eval_batch: a call holds at most batch // n problems' groups (whole groups), spread
  evenly over the fewest calls; a problem file's problems and their order do not depend on
  it."""
  config, calls = _problem_file(tmp_path, 5), starting_rollout
  played = {}
  # batch 9, n = 2: at most 4 problems a call; 5 problems take 2 calls, so 3 each (calls of
  # 4 would play 8 problems, 3 of them padding).
  for batch, expected_calls in ((3, [2] * 5), (9, [6, 6]), (40, [10])):
    calls.clear()
    episodes = _play_file(config, 5, batch)
    assert calls == expected_calls and len(episodes) == 10, (batch, calls)
    played[batch] = [e.task for e in episodes]
  assert played[3] == played[9] == played[40]
  assert len(set(played[3])) == 5 and all(played[3][i] == played[3][i + 1]
                                          for i in range(0, 10, 2))


def test_a_file_smaller_than_asked_is_spread_over_its_own_problems(tmp_path, starting_rollout):
  """HumanEval's case: 300 problems asked (task.eval_problems), the file holds fewer: the
  calls are sized for the file's count, not the count asked for. 41 problems at most 10 a
  call: 5 calls of 9 (4 extra), not 5 calls of 10 (9 extra); greedy and n = 2."""
  config, calls = _problem_file(tmp_path, 41), starting_rollout
  for samples in (1, 2):
    calls.clear()
    episodes = _play_file(config, 300, 10 * samples, samples)
    assert calls == [9 * samples] * 5 and len(episodes) == 41 * samples
    assert len({e.task for e in episodes}) == 41


def test_problems_per_call_takes_the_fewest_calls_then_the_least_padding():
  """Against a search over every size a call may have, for every count up to 170 problems
  and up to 60 a call: fewest calls first, then fewest problems played beyond those asked."""
  calls = lambda problems, size: -(-problems // size)
  for most in range(1, 61):
    for problems in range(1, 171):
      best = min(range(1, most + 1), key=lambda size: (
          calls(problems, size), calls(problems, size) * size - problems))
      assert evaluate_lib.problems_per_call(problems, most) == best, (problems, most)
  assert evaluate_lib.problems_per_call(164, 40) == 33  # 5 calls, 1 extra (not 36)
  assert evaluate_lib.problems_per_call(164, 2) == 2  # n = 20 at 40 episodes a call: none
