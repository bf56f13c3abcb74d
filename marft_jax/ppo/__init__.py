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

Three calls composed: MARFT-T's token advantages of one reply (4 tokens, reward 1 at the
end, every value 0.5, γ = 1, λ = 0.5: A halves back from the last token), the clipped
loss on them, and its gradient. At ρ = 1 it is −A_t / 4 in each token's log-prob.

    >>> import jax, jax.numpy as jnp
    >>> from marft_jax import ppo
    >>> r, v, mask = jnp.array([[1.0]]), jnp.full((1, 1, 4), 0.5), jnp.ones((1, 1, 4))
    >>> adv, _ = ppo.token_level_advantages(r, v, mask, jnp.array([1]), 0.0, gamma=1.0,
    ...                                     lambda_=0.5)
    >>> print(adv[0, 0])  # [T, N, K] -> the K tokens of env step 0, agent 0
    [0.0625 0.125  0.25   0.5   ]
    >>> old_logp = jnp.log(jnp.full(4, 0.5))
    >>> loss = lambda logp: ppo.ppo_clip_loss(logp, old_logp, adv[0, 0], mask[0, 0], 0.2)
    >>> print(jax.grad(loss)(old_logp))
    [-0.015625 -0.03125  -0.0625   -0.125   ]

Every public function's docstring has such an example, with numbers to check by hand
(`tests/ppo/test_doctests.py` runs them). Inside a module's docstrings the examples call
its functions by their bare names, with `jnp` imported as the module imports it.

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
    importance_weights,
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
