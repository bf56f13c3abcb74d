"""A training run's transcripts: a rolling pair of JSONL files, bounded however long the run,
read back in order, and cut back on resume so each iteration appears once."""

import json
import os

from marft_jax.rollout import Episode, Turn
from marft_jax.rollout import transcripts


def _episodes(iteration: int, n: int = 3, reply_chars: int = 100) -> list:
  """`n` one-turn episodes whose reply names `iteration` (and pads to `reply_chars`)."""
  return [Episode(env_index=i, seed=iteration * 10 + i, task=f"task {i}", policy_version=0,
                  turns=[Turn(0, 0, "actor", "Repeat: 0", f"{iteration}".ljust(reply_chars),
                              2, True)],
                  rewards=[[1.0]], dones=[True], infos=[{}]) for i in range(n)]


def _files(folder) -> list:
  return sorted(os.listdir(folder))


def test_iterations_are_appended_to_one_file_led_by_their_iteration(tmp_path):
  folder = str(tmp_path / "transcripts")
  for iteration in range(4):
    transcripts.append_transcripts(folder, iteration, _episodes(iteration))
  assert _files(folder) == ["transcripts.jsonl"]
  with open(os.path.join(folder, "transcripts.jsonl")) as f:
    first = f.readline()
  assert first.startswith('{"iteration": 0, "env_index": 0,')  # grep-able by iteration
  records = transcripts.read_transcripts(folder)
  assert [(r["iteration"], r["env_index"]) for r in records] == \
      [(k, i) for k in range(4) for i in range(3)]
  assert [r["turns"][0]["reply"].strip() for r in transcripts.read_transcripts(folder, 2)] == \
      ["2"] * 3


def test_a_long_run_keeps_two_files_and_the_latest_iterations(tmp_path):
  """200 iterations of ~0.6 KB with a 2 KB cap: never more than two files nor 2 caps plus one
  iteration, the last iterations all there, in order (the one-file-per-iteration layout
  held 200 files here)."""
  folder, cap = str(tmp_path / "transcripts"), 2048
  one_iteration = 0
  for iteration in range(200):
    path = transcripts.append_transcripts(folder, iteration, _episodes(iteration), max_bytes=cap)
    one_iteration = one_iteration or os.path.getsize(path)
    sizes = [os.path.getsize(os.path.join(folder, n)) for n in _files(folder)]
    assert len(sizes) <= 2 and sum(sizes) <= 2 * cap + 2 * one_iteration, (iteration, sizes)
  assert _files(folder) == ["transcripts.1.jsonl", "transcripts.jsonl"]
  kept = sorted({r["iteration"] for r in transcripts.read_transcripts(folder)})
  assert kept == list(range(kept[0], 200)) and len(kept) >= cap // one_iteration
  assert [r["iteration"] for r in transcripts.read_transcripts(folder)] == \
      [k for k in kept for _ in range(3)]


def test_a_resume_drops_the_iterations_it_plays_again_and_a_torn_line(tmp_path):
  folder, cap = str(tmp_path / "transcripts"), 2048
  for iteration in range(10):
    transcripts.append_transcripts(folder, iteration, _episodes(iteration), max_bytes=cap)
  with open(os.path.join(folder, "transcripts.jsonl"), "a") as f:
    f.write('{"iteration": 10, "env_ind')  # killed while writing iteration 10
  transcripts.cut_transcripts(folder, 8)  # the checkpoint after iteration 7
  assert {r["iteration"] for r in transcripts.read_transcripts(folder)} <= set(range(8))
  assert max(r["iteration"] for r in transcripts.read_transcripts(folder)) == 7
  transcripts.append_transcripts(folder, 8, _episodes(8), max_bytes=cap)
  assert [r["iteration"] for r in transcripts.read_transcripts(folder)][-3:] == [8] * 3
  # Nothing to drop: the files are left as they are.
  before = {n: os.path.getmtime(os.path.join(folder, n)) for n in _files(folder)}
  transcripts.cut_transcripts(folder, 9)
  assert before == {n: os.path.getmtime(os.path.join(folder, n)) for n in _files(folder)}


def test_a_resume_cuts_the_one_file_per_iteration_layout_of_an_older_run(tmp_path):
  """An older run's iteration_<k>.jsonl files before the resumed step stay where they were;
  the later ones (played again into the pair) go."""
  folder = tmp_path / "transcripts"
  folder.mkdir()
  for k in range(5):
    (folder / f"iteration_{k:05d}.jsonl").write_text(json.dumps({"task": k}) + "\n")
  transcripts.cut_transcripts(str(folder), 3)
  assert _files(folder) == ["iteration_00000.jsonl", "iteration_00001.jsonl",
                            "iteration_00002.jsonl"]
  transcripts.cut_transcripts(str(tmp_path / "absent"), 0)  # a fresh run: nothing there
