r"""Chat with a model, or with a trained agent through its exported adapter, from the command line.

  python -m launch.generate                                   # SmolLM2, default prompt
  python -m launch.generate --config.prompt="What is 12 * 7?" --config.sampling.temperature=0
  python -m launch.generate --config.model=/path/to/hf_folder_or_file.gguf
  python -m launch.generate --config.adapter=runs/default/exports/step_16/actor   # an adapter
  python -m launch.generate --workdir=runs/default --role=reasoner   # a trained run's agent

Loads the model from local files (nothing is downloaded), prints the answer, and streams the
progress of the jitted sampler with a tqdm bar on stderr. With --workdir, the run's checkpoint
(--step, default the latest) is restored (`marft_jax.restore`): its base model, and --role's
adapter and system prompt (default: the last graded role), prompted as the team prompts it
with --config.prompt as the task; the model, adapter, dtype, precision and system prompt then
come from the run, and setting them is refused. `marft-generate` (installed with the package)
is the same program, from any folder.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import jax
import numpy as np
from absl import flags
from tqdm import tqdm

from launch import cli
from launch.configs.generate import GenerateConfig
from marft_jax import lora
from marft_jax.architecture import precision
from marft_jax.models import layout, loading, sampler
from marft_jax.train.build import team as team_lib
from marft_jax.train import restore as restore_lib

_CONFIG = cli.define_config_flag("generate.py")
_WORKDIR = flags.DEFINE_string("workdir", "", "a training run's folder: answer as one of its "
                               "agents (its checkpoint restored); empty: --config.model")
_ROLE = flags.DEFINE_string("role", "", "with --workdir: the agent that answers (empty: the "
                            "team's last graded role)")
_STEP = flags.DEFINE_integer("step", None, "with --workdir: the checkpoint's step (default: "
                             "the latest)", lower_bound=0)
# Read from the run with --workdir (a value set here would be ignored, so it is refused).
_FROM_THE_RUN = ("model", "adapter", "param_dtype", "matmul_precision", "system_prompt")


def chat(config: GenerateConfig) -> str:
  """Loads the model (and adapter), answers `config.prompt`, and returns the answer text."""
  # A model or adapter file that does not load is one line; the bar is closed before it is
  # printed. The adapter folder is checked before the model loads.
  if config.adapter:
    with cli.one_line_errors(OSError, ValueError):
      lora.check_peft_folder(config.adapter)
  with cli.one_line_errors(OSError, ValueError), tqdm(
      total=2, desc=f"loading {config.model}", unit="step", file=sys.stderr) as bar:
    params, model_config, tokenizer = loading.load_model(
        config.model, param_dtype=config.param_dtype, compute_dtype=config.param_dtype)
    # An agent's adapter, routed to the one row (the sampler folds it into the f32 weights).
    adapter = (dict(lora=lora.load_peft_adapters([config.adapter], model_config),
                    adapter_ids=[0]) if config.adapter else {})
    bar.update()
    messages = [{"role": "system", "content": config.system_prompt},
                {"role": "user", "content": config.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    room = model_config.max_position_embeddings - len(prompt_ids)
    if config.sampling.max_new_tokens > room:  # before anything compiles; printed once the
      raise ValueError(                          # bar is closed (`one_line_errors`)
          f"config.sampling.max_new_tokens={config.sampling.max_new_tokens}: the prompt "
          f"takes {len(prompt_ids)} of the model's {model_config.max_position_embeddings} "
          f"positions, leaving {max(room, 0)}")
    fast = model_config.replace(layout=layout.decoding())  # the sampler's fast layout
    params = layout.convert_params(params, model_config.layout, fast.layout)
    bar.update()

  s = config.sampling
  with precision.scope(config.matmul_precision, config.param_dtype), tqdm(
      total=s.max_new_tokens, desc="generating (first step compiles)", unit="tok",
      file=sys.stderr) as bar:
    start = time.perf_counter()
    out = sampler.generate(
        params, np.asarray([prompt_ids]), fast, rng=jax.random.key(config.seed),
        eos_ids=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id or 0,
        on_step=lambda step: bar.update(int(step) - bar.n), **adapter, **s.generate_kwargs())
    n = int(out.lengths[0])
    bar.update(n - bar.n)
    bar.set_postfix_str(f"{n / (time.perf_counter() - start):.1f} tok/s incl. compile")
  return tokenizer.decode(np.asarray(out.tokens[0, :n]), skip_special_tokens=True)


def run_agent(config: GenerateConfig, workdir: str, role: str = "",
              step: Optional[int] = None) -> str:
  """A trained run's agent (`restore`d) answers `config.prompt` as the task: `role`'s reply
  (`Restored.reply`, with `config.sampling` and `config.seed`)."""
  with cli.one_line_errors(OSError, ValueError):
    saved, _ = restore_lib.saved_config(workdir, step)  # the role, before the model loads
    team = team_lib.build_team(saved)[0]
    role = role or [p.role for p in team if p.graded][-1]  # the last graded: its answer counts
    if role not in [p.role for p in team]:
      raise ValueError(f"--role={role}: not a role of the run in {workdir} (its roles: "
                       f"{', '.join(p.role for p in team)})")
  with cli.one_line_errors(OSError, ValueError), tqdm(
      total=1, desc=f"loading {workdir}", unit="step", file=sys.stderr) as bar:
    run = restore_lib.restore(workdir, step)
    bar.update()
  s = config.sampling
  with tqdm(total=s.max_new_tokens, desc="generating (first step compiles)", unit="tok",
            file=sys.stderr) as bar:
    try:
      answer = run.reply(role, config.prompt, sampling=s, seed=config.seed,
                         on_step=lambda step: bar.update(int(step) - bar.n))
    except ValueError as e:
      bar.close()
      cli.fail(f"config.sampling.{e}")
  return answer


def _check_flags(config: GenerateConfig) -> None:
  """With --workdir: refuses the keys the run decides; without: --role and --step."""
  if not _WORKDIR.value:
    for flag in (_ROLE, _STEP):
      if flag.present:
        cli.fail(f"--{flag.name}: read with --workdir only (a trained run's agent)")
    return
  if config.adapter:
    cli.fail("--config.adapter: --workdir answers with the run's own adapter (--role's)")
  default = GenerateConfig()
  for key in _FROM_THE_RUN:
    if getattr(config, key) != getattr(default, key):
      cli.fail(f"--config.{key}={getattr(config, key)!r}: with --workdir it is the run's "
               "(leave it unset)")


def main(config: GenerateConfig) -> None:
  _check_flags(config)
  print(f"user: {config.prompt}")
  answer = (run_agent(config, _WORKDIR.value, _ROLE.value, _STEP.value) if _WORKDIR.value
            else chat(config))
  print(f"assistant: {answer}")


def run() -> None:
  """The `marft-generate` console script; `python -m launch.generate` runs it too."""
  cli.run(main, _CONFIG, GenerateConfig)


if __name__ == "__main__":
  run()
