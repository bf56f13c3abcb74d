"""marft_jax.ppo: the RL maths of MARFT as pure JAX functions of arrays.

Importable on its own: nothing here sees a model or a config object. Every function takes
unbatched arrays (one sequence or trajectory) or arrays of any shape, and works under
`jax.jit`, `jax.vmap` and `jax.grad`.

- chains: a multi-agent episode's turns (sequential, DAG, orchestrator calls) as one
  backup: successors (each turn's first descendant: the earliest later turn whose prompt
  holds its reply), hops, per-token expansion (what the trainer runs).
- credit: token frame → action frame, and where each turn's reward lands (`turn_credit`).
- returns: `masked_gae`, `successor_gae`, `turn_chain_advantages` (the trainer's),
  `action_level_advantages` (MARFT-A), `token_level_advantages` (MARFT-T).
- logprobs: token log-probabilities and entropies (the trainer's), action log-probabilities.
- policy_loss / value_loss / kl: PPO-family losses, critic losses, KL estimators.
- normalize: reward shaping and batch / agent-within-group normalisation.
- masked: masked reductions.

Bad input is refused by name, never turned into a wrong number. An array of the wrong rank
or shape raises `ValueError("v_t: shape (2,) differs from r_t's (3,)")`, at call or trace
time (shapes are static). Scalars (γ, λ, ε, δ, temperatures, eps) and ids (group, agent,
step) given as Python numbers or concrete arrays are checked when the function is called
(or traced, for values closed over by `jit`), and a bad one raises
`ValueError("gamma=1.5: must be in [0, 1]")`. Traced values cannot be read at trace time;
each docstring says what a bad one does. The same checks run inside the computation under
`jax.experimental.checkify` when it is traced inside `marft_jax.validation.traced_checks()`
(outside, they add nothing to the program):

    from jax.experimental import checkify
    from marft_jax import validation
    with validation.traced_checks():
      checked = checkify.checkify(jax.jit(loss_fn), errors=checkify.user_checks)
      err, loss = checked(params, batch)
    err.throw()  # JaxRuntimeError: "gamma=1.5: must be in [0, 1]"

Masked positions are selected away before any arithmetic, so padding that holds NaN or
inf contributes exactly 0 to every loss and to its gradient.

The arithmetic is float32 or wider whatever the inputs: bfloat16 and float16 arrays are cast
up first and the results are float32 (`masked.at_least_float32`; the module says what bf16
arithmetic got wrong). Log-probs, values and rewards may therefore come straight from a
bf16 model.

Defect labels (D3, D4, …) and notes (A1, …) cited in the docstrings are explained in
docs/references.md, with the papers behind the formulas.
"""

from marft_jax.ppo.chains import (
    expand_turns,
    hops_to_sink,
    layer_sees,
    turn_hops,
    turn_successors,
)
from marft_jax.ppo.credit import CREDITS, token_to_action_frame, turn_credit
from marft_jax.ppo.kl import (
    KLEstimator,
    approx_kl,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    kl_reward,
)
from marft_jax.ppo.logprobs import (
    action_log_prob,
    action_log_prob_per_token,
    logprobs_and_entropy,
)
from marft_jax.ppo.masked import masked_count, masked_mean, masked_sum
from marft_jax.ppo.normalize import (
    agent_group_normalize,
    normalize,
    shape_rewards,
)
from marft_jax.ppo.policy_loss import (
    clip_fraction,
    clipped_surrogate,
    decoupled_ppo_loss,
    ppo_clip_loss,
)
from marft_jax.ppo.returns import (
    action_level_advantages,
    masked_gae,
    successor_gae,
    token_level_advantages,
    turn_chain_advantages,
)
from marft_jax.ppo.value_loss import (
    clipped_huber_value_loss,
    clipped_value_loss,
    huber_loss,
)
