"""pass@k and sampled evaluation (issue 40): the estimator against a direct count over every
k-subset of the samples, the per-role summary against per-problem counts, and `play`'s n
samples of a problem decoded together in one group of one rollout."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from marft_jax.rollout.episode import Episode
from marft_jax.train import evaluate as evaluate_lib
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
  real = evaluate_lib.rollout

  def counting(envs, team, *args, **kwargs):
    calls.append((len(envs), envs.group_size, [p.sampling.temperature for p in team]))
    return real(envs, team, *args, **kwargs)

  monkeypatch.setattr(evaluate_lib, "rollout", counting)
  episodes = evaluate_lib.play(config, model, num_problems=3, batch_size=32, samples=4,
                               temperature=0.05)
  assert calls == [(12, 4, [0.05, 0.05])]  # 3 problems x 4 samples, one call
  assert len(episodes) == 12
  tasks = [e.task for e in episodes]
  assert all(len(set(tasks[i:i + 4])) == 1 for i in range(0, 12, 4))
  assert len({e.seed for e in episodes}) == 3
  with pytest.raises(ValueError, match="greedy samples are all the same"):
    evaluate_lib.play(config, model, num_problems=3, samples=2)
