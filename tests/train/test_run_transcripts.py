"""The trainer's transcripts stay a rolling pair of files however many iterations run (a soak
wrote one file an iteration: 19,151 files, 151 MB), and a resume keeps each iteration once."""

import os

import pytest

from marft_jax.rollout import read_transcripts, transcripts
from marft_jax.train import loop
from tests.train.echo_config import echo_config, tiny_trainer_model


@pytest.fixture(scope="module")
def model():
  return tiny_trainer_model()


def test_transcripts_roll_over_two_files_and_a_resume_plays_an_iteration_once(
    model, tmp_path, monkeypatch):
  """A 1-byte cap rolls the files at every iteration: 3 iterations leave the last two, one
  file each. The interrupted run had written iteration 3 after the checkpoint of step 3;
  the resumed run drops it, plays it again, and the pair holds iterations 2 and 3 once."""
  monkeypatch.setattr(transcripts, "MAX_FILE_BYTES", 1)
  workdir = str(tmp_path / "run")
  folder = os.path.join(workdir, "transcripts")
  loop.train(echo_config(num_envs=2, iterations=3), workdir, model=model, progress=False)
  assert sorted(os.listdir(folder)) == ["transcripts.1.jsonl", "transcripts.jsonl"]
  assert [r["iteration"] for r in read_transcripts(folder)] == [1, 1, 2, 2]
  with open(os.path.join(folder, "transcripts.jsonl"), "a") as f:  # the interrupted run's
    f.write('{"iteration": 3, "env_index": 0, "task": "stale"}\n')
  loop.train(echo_config(num_envs=2, iterations=4), workdir, model=model, progress=False)
  records = read_transcripts(folder)
  assert [r["iteration"] for r in records] == [2, 2, 3, 3]
  assert "stale" not in {r["task"] for r in records}
  assert [r["env_index"] for r in read_transcripts(folder, 3)] == [0, 1]
