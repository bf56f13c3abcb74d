"""A stopped evaluation resumes from its finished calls (`eval_progress`, `evaluate.play`'s
`calls_dir`), and equals the uninterrupted one.

The reference is the same evaluation played through without stopping: a random tiny model
sampling at T = 1, so every call's replies depend on its key and on the problems it is dealt,
and a resume that replayed a call with another key or from another data cursor shows in the
transcripts.
"""

import os

import pytest

from marft_jax.rollout.episode import Episode
from marft_jax.train import eval_progress
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import run as run_lib
from tests.train.echo_config import tiny_trainer_model
from tests.train.test_evaluate import _config

# 5 problems, 2 samples each, at most 2 problems a call: 3 calls of 4 episodes.
PLAY = dict(num_problems=5, batch_size=4, samples=2, temperature=1.0)
SETTINGS = {"checkpoint_step": 7, "untuned": True}
_ROLLOUT = run_lib.rollout


@pytest.fixture(scope="module")
def model():
  return tiny_trainer_model()


def _record(episodes):
  """What an evaluation reports of each episode: its problem, replies, rewards and verdicts."""
  return [(e.env_index, e.seed, e.task, [(t.role, t.reply) for t in e.turns], e.rewards,
           e.infos, e.dropped) for e in episodes]


def _stopping_at(monkeypatch, call):
  """`run_lib.rollout` that raises KeyboardInterrupt (a Ctrl-C) when call `call` starts;
  returns the list of calls made (their first episode's count of earlier episodes)."""
  made, real = [], _ROLLOUT

  def rollout(envs, *args, **kwargs):
    if len(made) == call:
      raise KeyboardInterrupt
    made.append(len(envs))
    return real(envs, *args, **kwargs)

  monkeypatch.setattr(run_lib, "rollout", rollout)
  return made


@pytest.mark.exactness
@pytest.mark.parametrize("stop_at", [1, 2])
def test_a_stopped_evaluation_resumes_with_only_the_calls_left_and_equals_the_whole(
    model, tmp_path, monkeypatch, stop_at):
  config = _config()
  whole = evaluate_lib.play(config, model, **PLAY)
  assert len(whole) == 10 and len({tuple(r[3]) for r in _record(whole)}) > 1  # sampled
  folder = str(tmp_path / "eval_n2_t1.calls")
  made = _stopping_at(monkeypatch, stop_at)
  with pytest.raises(KeyboardInterrupt):
    evaluate_lib.play(config, model, **PLAY, calls_dir=folder, calls_settings=SETTINGS)
  assert sorted(os.listdir(folder)) == [f"call_{i:05d}.pkl" for i in range(stop_at)] + [
      "settings.json"]
  made = _stopping_at(monkeypatch, None)
  resumed = evaluate_lib.play(config, model, **PLAY, calls_dir=folder, calls_settings=SETTINGS)
  assert made == [4] * (3 - stop_at)  # only the calls left
  assert _record(resumed) == _record(whole)
  assert all(e.sequences == [] for e in resumed[:4 * stop_at])  # read back: scores, not tokens
  # Finished: every call is in the folder; the same command again plays nothing.
  made.clear()
  again = evaluate_lib.play(config, model, **PLAY, calls_dir=folder, calls_settings=SETTINGS)
  assert made == [] and _record(again) == _record(whole)


def test_calls_of_other_settings_or_unreadable_ones_are_refused_by_name(model, tmp_path,
                                                                        monkeypatch):
  config = _config()
  folder = str(tmp_path / "calls")
  _stopping_at(monkeypatch, 2)
  with pytest.raises(KeyboardInterrupt):
    evaluate_lib.play(config, model, **PLAY, calls_dir=folder, calls_settings=SETTINGS)
  made = _stopping_at(monkeypatch, None)
  for changes, settings, differ in (
      ({"temperature": 0.9}, SETTINGS, "temperature"),
      ({"batch_size": 6}, SETTINGS, "envs_per_call"),
      ({}, {**SETTINGS, "checkpoint_step": 8}, "checkpoint_step"),
      ({}, {**SETTINGS, "untuned": False}, "untuned")):
    with pytest.raises(eval_progress.UnusableCalls, match=f"{folder}: .*\\({differ} differ"):
      evaluate_lib.play(config, model, **{**PLAY, **changes}, calls_dir=folder,
                        calls_settings=settings)
  assert made == []  # nothing was played over them
  first, second = (os.path.join(folder, f"call_{i:05d}.pkl") for i in (0, 1))
  with open(second, "wb") as f:
    f.write(b"\x80\x04 cut short")
  with pytest.raises(eval_progress.UnusableCalls, match=f"{second}: unreadable"):
    evaluate_lib.play(config, model, **PLAY, calls_dir=folder, calls_settings=SETTINGS)
  os.remove(first)
  with pytest.raises(eval_progress.UnusableCalls, match=f"{second}: expected call_00000.pkl"):
    evaluate_lib.play(config, model, **PLAY, calls_dir=folder, calls_settings=SETTINGS)


def test_a_call_file_is_whole_or_absent(tmp_path, monkeypatch):
  """A crash while a call is written leaves the earlier file as it was and no partial one
  under a call's name (`metrics.write_atomically`: a temporary name, then a rename); a
  temporary file a killed process left behind is not read as a call."""
  log = eval_progress.CallLog(str(tmp_path / "calls"), {"k": 1})
  episode = Episode(env_index=0, seed=3, task="What is 1?", policy_version=0, rewards=[[1.0]],
                    infos=[{"correct": {"actor": True}}])
  log.record(0, [episode], {"episodes": [1]})
  real_replace = os.replace
  monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("killed")))
  with pytest.raises(OSError, match="killed"):  # the process dies before the rename
    log.record(1, [episode], {"episodes": [2]})
  monkeypatch.setattr(os, "replace", real_replace)
  assert sorted(os.listdir(log.folder)) == ["call_00000.pkl", "settings.json"]
  with open(os.path.join(log.folder, ".call_00001.pkl.tmp-0123abcd"), "wb") as f:
    f.write(b"\x80\x04 cut short")  # what SIGKILL mid-write leaves
  played = log.played()
  assert len(played) == 1 and played[0][1] == {"episodes": [1]}
  assert played[0][0][0].task == episode.task and played[0][0][0].infos == episode.infos
