"""Bad arguments are refused with a message naming them; under jit, checkify catches them.

The inputs here are arbitrary small arrays (zeros, ones, aranges): only whether a call is
refused, and with which name, is tested, not the numbers it returns.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from marft_jax import ppo, validation

T, N, K, V = 4, 2, 3, 5
NAN, INF = math.nan, math.inf


def _r(*shape):
  return np.zeros(shape, np.float32)


def _m(*shape):
  return np.ones(shape, bool)


DONE = np.array([0, 0, 0, 1])
STEPS, LAYERS = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
SEES = np.tril(np.ones((T, T), bool), -1)  # each turn sees every earlier one
NEXT = np.array([1, 2, 3, 4])  # their successors: the next turn
LOGITS = np.arange(T * V, dtype=np.float32).reshape(T, V) / 10.0

# name of the bad argument -> [(call taking the bad value, bad values)]
CALLS = {
    "gamma": [
        (lambda x: ppo.action_level_advantages(_r(T, N), _r(T, N), DONE, 0.0, x, 0.9),
         [-0.1, 1.01, NAN, INF, "0.9"]),
        (lambda x: ppo.token_level_advantages(_r(T, N), _r(T, N, K), _m(T, N, K), DONE, 0.0,
                                              x, 0.9), [1.5, NAN]),
    ],
    "lambda_": [
        (lambda x: ppo.action_level_advantages(_r(T, N), _r(T, N), DONE, 0.0, 0.9, x),
         [-0.1, 1.5, NAN]),
    ],
    "gamma_agent": [
        (lambda x: ppo.action_level_advantages(_r(T, N), _r(T, N), DONE, 0.0, 0.9, 0.9, x),
         [1.2, NAN]),
    ],
    "lambda_agent": [
        (lambda x: ppo.action_level_advantages(_r(T, N), _r(T, N), DONE, 0.0, 0.9, 0.9,
                                               lambda_agent=x), [-0.5, NAN]),
    ],
    "gamma_token": [
        (lambda x: ppo.token_level_advantages(_r(T, N), _r(T, N, K), _m(T, N, K), DONE, 0.0,
                                              0.9, 0.9, gamma_token=x), [1.1, NAN]),
    ],
    "lambda_token": [
        (lambda x: ppo.token_level_advantages(_r(T, N), _r(T, N, K), _m(T, N, K), DONE, 0.0,
                                              0.9, 0.9, lambda_token=x), [-0.1, NAN]),
    ],
    "discount_t": [
        (lambda x: ppo.masked_gae(_r(T), np.full(T, x, np.float32), 0.9, _r(T), _m(T), 0.0),
         [1.5, -0.1, NAN]),
    ],
    "lambda_t": [
        (lambda x: ppo.masked_gae(_r(T), np.ones(T, np.float32), x, _r(T), _m(T), 0.0),
         [1.5, NAN]),
    ],
    "gamma_c": [
        (lambda x: ppo.turn_credit(_r(T), _r(T), STEPS, NEXT, _m(T), "step_discount", x),
         [1.5, -0.1, NAN]),
    ],
    "credit": [
        (lambda x: ppo.turn_credit(_r(T), _r(T), STEPS, NEXT, _m(T), x), ["team", None]),
    ],
    "epsilon": [
        (lambda x: ppo.clipped_surrogate(_r(T) + 1, _r(T), x), [-0.1, NAN]),
        (lambda x: ppo.ppo_clip_loss(_r(T), _r(T), _r(T), _m(T), x), [-0.1, NAN]),
        (lambda x: ppo.decoupled_ppo_loss(_r(T), _r(T), _r(T), _r(T), _m(T), x), [-1.0]),
        (lambda x: ppo.clip_fraction(_r(T), _r(T), _m(T), x), [-0.2]),
    ],
    "epsilon_high": [
        (lambda x: ppo.ppo_clip_loss(_r(T), _r(T), _r(T), _m(T), 0.2, x), [-0.1, NAN]),
    ],
    "dual_clip": [
        (lambda x: ppo.clipped_surrogate(_r(T) + 1, _r(T), 0.2, dual_clip=x), [1.0, 0.5, NAN]),
        (lambda x: ppo.ppo_clip_loss(_r(T), _r(T), _r(T), _m(T), 0.2, dual_clip=x), [1.0]),
    ],
    "imp_weight_cap": [
        (lambda x: ppo.decoupled_ppo_loss(_r(T), _r(T), _r(T), _r(T), _m(T), 0.2,
                                          imp_weight_cap=x), [0.0, -1.0, NAN]),
    ],
    "delta": [
        (lambda x: ppo.huber_loss(_r(T), x), [0.0, -1.0, NAN, INF]),
        (lambda x: ppo.clipped_huber_value_loss(_r(T), _r(T), _r(T), _m(T), x), [0.0, NAN]),
    ],
    "clip_eps": [
        (lambda x: ppo.clipped_value_loss(_r(T), _r(T), _r(T), _m(T), x), [-0.1, NAN]),
        (lambda x: ppo.clipped_huber_value_loss(_r(T), _r(T), _r(T), _m(T), 10.0, x), [-0.1]),
    ],
    "kl_coef": [
        (lambda x: ppo.kl_reward(_r(T), _r(T), _m(T), x), [NAN, -0.1, INF]),
    ],
    "eps": [
        (lambda x: ppo.normalize(_r(T), _m(T), eps=x), [0.0, -1e-5, NAN, INF]),
        (lambda x: ppo.agent_group_normalize(_r(T), _m(T), np.zeros(T, int), np.zeros(T, int),
                                             1, 1, eps=x), [NAN]),
    ],
    "num_groups": [
        (lambda x: ppo.agent_group_normalize(_r(T), _m(T), np.zeros(T, int), np.zeros(T, int),
                                             x, 1), [0, 2.0]),
    ],
    "num_agents": [
        (lambda x: ppo.agent_group_normalize(_r(T), _m(T), np.zeros(T, int), np.zeros(T, int),
                                             1, x), [0]),
    ],
    "scale": [(lambda x: ppo.shape_rewards(_r(T), scale=x), [NAN, INF])],
    "bias": [(lambda x: ppo.shape_rewards(_r(T), bias=x), [NAN, -INF])],
    "clip": [(lambda x: ppo.shape_rewards(_r(T), clip=x), [0.0, -1.0, NAN])],
    "temperature": [
        (lambda x: ppo.logprobs_and_entropy(LOGITS, np.arange(T), x), [0.0, -1.0, NAN, INF]),
        (lambda x: ppo.logprobs_and_entropy(LOGITS, np.arange(T), np.full(T, 1.0) * x),
         [0.0, -0.5, NAN, INF]),  # per position: one bad entry is enough
        (lambda x: ppo.logprobs_and_entropy(LOGITS, np.arange(T), np.array([1.0, 0.5, 2.0, x]),
                                            with_entropy=False), [0.0, NAN]),
    ],
}

CASES = [(name, i, bad) for name, calls in CALLS.items()
         for i, (_, values) in enumerate(calls) for bad in values]


def _raises_naming(name):
  return pytest.raises(ValueError, match=rf"^{re.escape(name)}[=:]")


@pytest.mark.parametrize("name,index,bad", CASES)
def test_bad_python_number_is_refused_by_name(name, index, bad):
  call = CALLS[name][index][0]
  with _raises_naming(name):
    call(bad)


NAN_CASES = [(name, i, bad) for name, i, bad in CASES
             if isinstance(bad, float) and math.isnan(bad)]


@pytest.mark.parametrize("name,index,bad", NAN_CASES)
def test_nan_is_refused_as_nan(name, index, bad):
  """NaN fails every range, but "epsilon=nan: must be >= 0" read as if it were negative."""
  with pytest.raises(ValueError, match=rf"^{re.escape(name)}(=nan: must be .+, not NaN$|: "
                     rf"\d+ entr(y is|ies are) NaN; each must be )"):
    CALLS[name][index][0](bad)


def test_nan_messages_say_the_range():
  cases = [
      (lambda: ppo.ppo_clip_loss(_r(T), _r(T), _r(T), _m(T), NAN),
       "epsilon=nan: must be >= 0, not NaN"),
      (lambda: ppo.masked_gae(_r(T), _r(T), NAN, _r(T), _m(T), 0.0),
       "lambda_t=nan: must be in [0, 1], not NaN"),
      (lambda: ppo.huber_loss(_r(T), np.float32(NAN)),
       "delta=nan: must be finite and > 0, not NaN"),
      (lambda: ppo.masked_gae(_r(T), np.array([1.0, NAN, 0.5, NAN]), 0.9, _r(T), _m(T), 0.0),
       "discount_t: 2 entries are NaN; each must be in [0, 1]"),
  ]
  for call, message in cases:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
      call()


@pytest.mark.parametrize("name", ["gamma", "epsilon", "delta", "temperature", "eps"])
def test_bad_concrete_0d_array_is_refused_by_name(name):
  call, values = CALLS[name][0]
  bad = values[0]
  with _raises_naming(name):
    call(np.float32(bad))
  with _raises_naming(name):
    call(jnp.asarray(bad, jnp.float32))


def test_edge_values_are_accepted():
  for g in (0.0, 1.0, np.float32(1.0), jnp.asarray(0.5)):
    ppo.action_level_advantages(_r(T, N), _r(T, N), DONE, 0.0, g, g, g, g)
    ppo.token_level_advantages(_r(T, N), _r(T, N, K), _m(T, N, K), DONE, 0.0, g, g, g, g, g,
                               g)
    ppo.turn_credit(_r(T), _r(T), STEPS, NEXT, _m(T), "step_discount", g)
  ppo.ppo_clip_loss(_r(T), _r(T), _r(T), _m(T), 0.0, INF, 1.0 + 1e-6)
  ppo.decoupled_ppo_loss(_r(T), _r(T), _r(T), _r(T), _m(T), 0.2, imp_weight_cap=INF)
  ppo.clipped_value_loss(_r(T), _r(T), _r(T), _m(T), 0.0)
  ppo.clipped_huber_value_loss(_r(T), _r(T), _r(T), _m(T), 1e-3, INF)
  ppo.kl_reward(_r(T), _r(T), _m(T), 0.0)
  ppo.shape_rewards(_r(T), clip=INF)
  ppo.logprobs_and_entropy(LOGITS, np.arange(T), 1e-3)
  ppo.logprobs_and_entropy(LOGITS, np.arange(T), np.full(T, 1e-3, np.float32))


def test_bad_value_closed_over_by_jit_is_refused_at_trace_time():
  fn = jax.jit(lambda r, v: ppo.action_level_advantages(r, v, DONE, 0.0, 1.5, 0.9))
  with _raises_naming("gamma"):
    fn(_r(T, N), _r(T, N))


# --- Ids ------------------------------------------------------------------------------------

def _ids_cases(ids_of):
  """ids_of(array) wraps a test array as NumPy or as a concrete JAX array."""
  x, mask = _r(6), np.array([1, 1, 1, 1, 0, 0], bool)
  groups, agents = np.array([0, 1, 0, 1, 7, -1]), np.array([0, 0, 1, 1, -1, 9])
  return {
      "group_ids": [
          lambda: ppo.agent_group_normalize(x, mask, ids_of(np.array([0, 1, 2, 1, 0, 0])),
                                            ids_of(agents), 2, 2),
          lambda: ppo.agent_group_normalize(x, mask, ids_of(np.array([0, -1, 0, 1, 0, 0])),
                                            ids_of(agents), 2, 2),
      ],
      "agent_ids": [
          lambda: ppo.agent_group_normalize(x, mask, ids_of(groups),
                                            ids_of(np.array([0, 2, 1, 1, 0, 0])), 2, 2),
          lambda: ppo.agent_group_normalize(x, mask, ids_of(groups),
                                            ids_of(np.array([0, -1, 1, 1, 0, 0])), 2, 2),
      ],
  }


@pytest.mark.parametrize("as_jax", [False, True])
def test_ids_out_of_range_are_refused_by_name(as_jax):
  for name, calls in _ids_cases(jnp.asarray if as_jax else np.asarray).items():
    for call in calls:
      with _raises_naming(name):
        call()


def test_ids_out_of_range_on_masked_elements_are_fine():
  # Masked elements may hold any id (7, −1, 9 above).
  x, mask = _r(6), np.array([1, 1, 1, 1, 0, 0], bool)
  groups, agents = np.array([0, 1, 0, 1, 7, -1]), np.array([0, 0, 1, 1, -1, 9])
  ppo.agent_group_normalize(x, mask, groups, agents, 2, 2)


# --- Traced values: unchecked under plain jit, caught by checkify ---------------------------

TRACED = {
    "gamma": (lambda g: ppo.action_level_advantages(_r(T, N), _r(T, N), DONE, 0.0, g, 0.9)[0],
              np.float32(1.5)),
    "epsilon": (lambda e: ppo.ppo_clip_loss(_r(T), _r(T), _r(T), _m(T), e), np.float32(-0.1)),
    "delta": (lambda d: ppo.huber_loss(_r(T), d), np.float32(0.0)),
    "temperature": (lambda t: ppo.logprobs_and_entropy(LOGITS, np.arange(T), t)[0],
                    np.float32(0.0)),
    "gamma_c": (lambda g: ppo.turn_credit(_r(T), _r(T), STEPS, NEXT, _m(T), "step_discount",
                                          g), np.float32(1.5)),
    "group_ids": (lambda g: ppo.agent_group_normalize(_r(T), _m(T), g, np.zeros(T, int), 2, 1),
                  np.array([0, 1, 2, 0])),
    "agent_ids": (lambda a: ppo.agent_group_normalize(_r(T), _m(T), np.zeros(T, int), a, 1, 2),
                  np.array([0, -1, 1, 0])),
}


@pytest.mark.parametrize("name", sorted(TRACED))
def test_traced_bad_value_is_caught_by_checkify(name):
  fn, bad = TRACED[name]
  jax.jit(fn)(bad)  # unchecked without checkify (documented per function)
  err, _ = checkify.checkify(jax.jit(fn), errors=checkify.user_checks)(bad)
  assert err.get() is None  # traced outside traced_checks(): no check in the program
  with validation.traced_checks():
    err, _ = checkify.checkify(jax.jit(fn), errors=checkify.user_checks)(bad)
  assert err.get() is not None and err.get().startswith(name)
  with pytest.raises(checkify.JaxRuntimeError, match=re.escape(name)):
    err.throw()


def test_checkify_passes_good_traced_values_and_vmap():
  fn, _ = TRACED["gamma"]
  with validation.traced_checks():
    err, _ = checkify.checkify(jax.jit(fn), errors=checkify.user_checks)(np.float32(0.9))
    assert err.get() is None
    batched = checkify.checkify(jax.jit(jax.vmap(fn)), errors=checkify.user_checks)
    err, _ = batched(np.array([0.9, 1.5], np.float32))
  assert "gamma" in err.get()


def test_a_retraced_function_is_the_same_program_unless_traced_checks_are_on():
  """What makes JAX's persistent compilation cache hit on a retrace: checkify numbers each
  check it traces from a process-wide counter, a constant of the program."""
  fn, _ = TRACED["gamma"]
  lowered = lambda: jax.jit(lambda g: fn(g)).lower(np.float32(0.9)).as_text()  # a new closure
  assert lowered() == lowered()
  with validation.traced_checks():
    assert lowered() != lowered()


# (call with one argument of the wrong shape, the message naming it): one per module.
SHAPE_CASES = [
    (lambda: ppo.masked_gae(_r(T), _r(T), 0.9, _r(T - 1), _m(T), 0.0),
     "v_t: shape (3,) differs from r_t's (4,)"),
    (lambda: ppo.successor_gae(_r(T), _r(T), 0.9, _r(T), _m(T), np.arange(T + 1)),
     "next_t: shape (5,) differs from r_t's (4,)"),
    (lambda: ppo.action_level_advantages(_r(T), _r(T, N), DONE, 0.0, 0.9, 0.9),
     "r_t: shape (4,) has rank 1, expected 2"),
    (lambda: ppo.token_level_advantages(_r(T, N), _r(T, N, K), _m(T, N, K), DONE[:3], 0.0,
                                        0.9, 0.9),
     "done_t: shape (3,) differs from r_t's (4, 2) in its first axis"),
    (lambda: ppo.token_level_advantages(_r(T, N + 1), _r(T, N, K), _m(T, N, K), DONE, 0.0,
                                        0.9, 0.9),
     "v_t: shape (4, 2, 3) differs from r_t's (4, 3) in its first 2 axes"),
    (lambda: ppo.ppo_clip_loss(_r(T), _r(T, 1), _r(T), _m(T), 0.2),
     "old_logp_t: shape (4, 1) differs from logp_t's (4,)"),
    (lambda: ppo.decoupled_ppo_loss(_r(T), _r(T), _r(T), _r(T), _m(T - 1), 0.2),
     "mask_t: shape (3,) differs from logp_t's (4,)"),
    (lambda: ppo.clipped_value_loss(_r(T), _r(T), _r(T + 1), _m(T)),
     "returns_t: shape (5,) differs from v_t's (4,)"),
    (lambda: ppo.kl_penalty(_r(T), _r(T + 2), _m(T)),
     "ref_logp_t: shape (6,) differs from logp_t's (4,)"),
    (lambda: ppo.logprobs_and_entropy(LOGITS, np.zeros((T + 1,), np.int32)),
     "tokens: shape (5,) differs from logits' (4, 5) in its first axis"),
    (lambda: ppo.logprobs_and_entropy(LOGITS, np.zeros((T, 1), np.int32)),
     "tokens: shape (4, 1) has rank 2, expected 1"),
    (lambda: ppo.action_log_prob(_r(T, 1), _m(T, 1)),
     "logp_t: shape (4, 1) has rank 2, expected 1"),
    (lambda: ppo.masked_sum(_r(T), _m(T + 1)), "mask: shape (5,) differs from x's (4,)"),
    (lambda: ppo.agent_group_normalize(_r(T), _m(T), np.zeros(T, np.int32),
                                       np.zeros(T - 1, np.int32), 1, 1),
     "agent_ids: shape (3,) differs from x's (4,)"),
    (lambda: ppo.turn_successors(STEPS, SEES[:3], _m(T)),
     "sees_kk: shape (3, 4) is not (n, n) for the n=4 turns of step_k"),
    (lambda: ppo.turn_successors(STEPS, SEES[0], _m(T)),
     "sees_kk: shape (4,) has rank 1, expected 2"),
    (lambda: ppo.layer_sees(STEPS, LAYERS[:3], _m(T)),
     "layer_k: shape (3,) differs from step_k's (4,)"),
    (lambda: ppo.turn_credit(_r(T), _r(T), STEPS, NEXT, _m(T, 1), "equal"),
     "valid_k: shape (4, 1) has rank 2, expected 1"),
    (lambda: ppo.turn_credit(_r(T), _r(T - 1), STEPS, NEXT, _m(T), "per_step"),
     "own_reward_k: shape (3,) differs from team_reward_k's (4,)"),
    (lambda: ppo.token_to_action_frame(_r(T, 2), 0.0), "x_t: shape (4, 2) has rank 2, expected 1"),
]


# One episode of two turns, one position each: `turn_chain_advantages`' arrays but v_t.
TWO = np.array([0, 0])
TWO_TURNS = (TWO, ppo.layer_sees(TWO, np.array([0, 1]), _m(2)), _m(2), np.ones(2, np.int32),
             _r(2), _r(2), np.array([0, 1]))
CHAIN = dict(credit="equal", gamma=0.9, lambda_=0.9)

# A v_bootstrap of one value per sequence: today's rank check, before `lax.scan` met it as a
# carry of the wrong shape (TypeError) or `.at[T].set` failed to broadcast it.
BOOTSTRAP_CASES = [
    (lambda: ppo.masked_gae(_r(T), _r(T), 0.9, _r(T), _m(T), _r(2))),
    (lambda: ppo.successor_gae(_r(T), _r(T), 0.9, _r(T), _m(T), NEXT, _r(2))),
    (lambda: ppo.action_level_advantages(_r(T, N), _r(T, N), DONE, _r(T), 0.9, 0.9)),
    (lambda: ppo.token_level_advantages(_r(T, N), _r(T, N, K), _m(T, N, K), DONE, _r(1), 0.9,
                                        0.9)),
    (lambda: ppo.turn_chain_advantages(*TWO_TURNS, _r(2), v_bootstrap=_r(2), **CHAIN)),
    (lambda: jax.jit(ppo.masked_gae)(_r(T), _r(T), 0.9, _r(T), _m(T), jnp.zeros(2))),
]


@pytest.mark.parametrize("index", range(len(BOOTSTRAP_CASES)))
def test_a_v_bootstrap_that_is_not_a_scalar_is_refused_by_name(index):
  # No `$`: under jit, JAX appends a note on its filtered traceback to the message.
  with pytest.raises(ValueError, match=r"^v_bootstrap: shape \((1|2|4),\) has rank 1, "
                     r"expected 0"):
    BOOTSTRAP_CASES[index]()


def test_turn_chain_v_t_must_fit_its_turns():
  # Width 3 for two one-position turns: the third value was dropped without a word.
  with pytest.raises(ValueError, match=re.escape(
      "v_t[2]=0.5: past the 2 positions that length_k fills, where v_t is padding and must be "
      "0 (width 3)")):
    ppo.turn_chain_advantages(*TWO_TURNS, np.array([0.5, 0.5, 0.5], np.float32), **CHAIN)
  with pytest.raises(ValueError, match=re.escape(
      "v_t: width 1 holds fewer positions than the 2 that length_k fills")):
    ppo.turn_chain_advantages(*TWO_TURNS, np.array([0.5], np.float32), **CHAIN)
  with pytest.raises(ValueError, match=re.escape(
      "kl_reward_t: shape (2,) differs from v_t's (3,)")):
    ppo.turn_chain_advantages(*TWO_TURNS, _r(3), kl_reward_t=_r(2), **CHAIN)
  # Zero padding is the layout of a batch of episodes (vmapped: not checked, traced).
  adv, _ = ppo.turn_chain_advantages(*TWO_TURNS, np.array([0.5, 0.5, 0.0], np.float32),
                                     **CHAIN)
  assert adv.shape == (3,) and adv[2] == 0.0


def test_a_wrong_shape_is_refused_naming_the_argument_under_jit():
  loss = jax.jit(ppo.ppo_clip_loss, static_argnums=4)
  with pytest.raises(ValueError, match=re.escape("adv_t: shape (3,) differs from logp_t's (4,)")):
    loss(_r(T), _r(T), _r(T - 1), _m(T), 0.2)


# (call with one bad pointer, order or length, the message naming it). JAX's indexing would
# wrap -1 to the end and clamp a pointer past it, and a pointer back reads an entry the
# backward pass has not computed yet: each would be a wrong advantage, silently.
ORDER_CASES = [
    (lambda: ppo.successor_gae(_r(T), _r(T), 0.9, _r(T), _m(T), np.array([1, 2, 3, -1])),
     "next_t[3]=-1: must be in (3, 4]"),
    (lambda: ppo.successor_gae(_r(T), _r(T), 0.9, _r(T), _m(T), np.array([1, 0, 3, 4])),
     "next_t[1]=0: must be in (1, 4]"),
    (lambda: ppo.successor_gae(_r(T), _r(T), 0.9, _r(T), _m(T), np.array([1, 2, 9, 4])),
     "next_t[2]=9: must be in (2, 4]"),
    (lambda: ppo.expand_turns(_r(2), _r(2), _r(2), np.array([1, -1]), np.array([2, 3]), 8),
     "next_k[1]=-1: must be in (1, 2]"),
    (lambda: ppo.expand_turns(_r(2), _r(2), _r(2), np.array([1, 2]), np.array([2, -3]), 8),
     "length_k: entry -3 must be >= 0"),
    (lambda: ppo.expand_turns(_r(2), _r(2), _r(2), np.array([1, 2]), np.array([5, 6]), 8),
     "length_k: the turns fill 11 positions, more than width=8"),
    (lambda: ppo.turn_hops(STEPS, np.array([1, 0, 3, 4]), DONE, 0.9, 0.9),
     "next_k[1]=0: must be in (1, 4]"),
    (lambda: ppo.turn_successors(STEPS, SEES, np.array([1, 0, 1, 0])),
     "valid_k[2]: a real turn after a padding one"),
    (lambda: ppo.turn_successors(np.array([0, 1, 0, 1]), SEES, _m(T)),
     "step_k: turn 2 (step 0) after a turn of step 1 (turns come in execution order)"),
    (lambda: ppo.layer_sees(np.array([0, 0, 0, 1]), np.array([0, 1, 0, 0]), _m(T)),
     "step_k, layer_k: turn 2 (step 0, layer 0) is apart from the earlier turns of its group"),
    (lambda: ppo.turn_credit(_r(T), _r(T), STEPS, np.array([1, 0, 3, 4]), _m(T), "equal"),
     "next_k[1]=0: must be in (1, 4]"),
    (lambda: ppo.hops_to_sink(STEPS, np.array([1, 2, 5, 4])), "next_k[2]=5: must be in (2, 4]"),
]


@pytest.mark.parametrize("call,message", SHAPE_CASES + ORDER_CASES, ids=[
    m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(SHAPE_CASES + ORDER_CASES)])
def test_a_bad_array_is_refused_naming_it(call, message):
  """A wrong shape, or a pointer, order or length that the maths would misread."""
  with pytest.raises(ValueError, match=re.escape(message)):
    call()


def test_a_traced_pointer_back_is_caught_by_checkify():
  def gae(next_t):
    return ppo.successor_gae(_r(T), _r(T), 0.9, _r(T), _m(T), next_t)

  with validation.traced_checks():
    checked = checkify.checkify(jax.jit(gae), errors=checkify.user_checks)
    err, _ = checked(jnp.array([1, 0, 3, 4]))
    with pytest.raises(Exception, match=re.escape("next_t: an entry i is outside (i, 4]")):
      err.throw()
    err, _ = checked(jnp.array([1, 2, 3, 4]))
  err.throw()  # a good one passes
