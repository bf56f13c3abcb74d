"""Plain loops for the backups, written from the formulas in the docstrings and docs/references.md.

They index nested (step, agent, token) loops and search forward for the next state instead of
composing hops in one flat reverse scan, so they share no structure with `marft_jax.ppo`.
"""

import numpy as np


def np_masked_gae(r, discount, lam, v, mask, v_bootstrap):
  """For each state p, find the next state q by a forward search and compose the hops."""
  T = len(r)
  lam = np.broadcast_to(lam, (T,))
  states = [t for t in range(T) if mask[t]]
  adv = np.zeros(T)
  next_v, next_adv = v_bootstrap, 0.0
  for p in reversed(states):
    later = [q for q in states if q > p]
    q_end = later[0] if later else T
    r_pq, g, gl = 0.0, 1.0, 1.0
    for s in range(p, q_end):
      r_pq += g * r[s]
      g, gl = g * discount[s], gl * discount[s] * lam[s]
    next_v = v[q_end] if later else v_bootstrap
    next_adv = adv[q_end] if later else 0.0
    adv[p] = r_pq + g * next_v - v[p] + gl * next_adv
  return adv


def np_action_level(r, v, done, v_boot, gamma, lam, gamma_a, lam_a):
  """Agent-chain GAE, done flag only on the hop between env steps (defect D4 fixed).

  Defect labels: docs/references.md.
  """
  T, N = r.shape
  adv, gae = np.zeros((T, N)), 0.0
  for t in reversed(range(T)):
    for i in reversed(range(N)):
      if i == N - 1:
        not_done = 1.0 - done[t]
        next_v = (v[t + 1, 0] if t + 1 < T else v_boot) * not_done
        gae = r[t, i] + gamma * next_v - v[t, i] + gamma * lam * not_done * gae
      else:
        gae = r[t, i] + gamma_a * v[t, i + 1] - v[t, i] + gamma_a * lam_a * gae
      adv[t, i] = gae
  return adv


def np_action_level_original(r, v, done, v_boot, gamma, lam):
  """The original buffer's loop, mask bug D4 included: m[t] = 1 − done[t−1].

  Transcribed from the original MARFT's ActionBuffer (defect D4, docs/references.md).
  """
  T, N = r.shape
  m = np.ones(T + 1)
  m[1:] = 1.0 - done
  V = np.concatenate([v, np.full((1, N), v_boot)])
  adv, gae = np.zeros((T, N)), 0.0
  for t in reversed(range(T)):
    for i in reversed(range(N)):
      t_next, i_next = (t + 1, 0) if i == N - 1 else (t, i + 1)
      delta = r[t, i] + gamma * V[t_next, i_next] * m[t_next] - V[t, i]
      gae = delta + gamma * lam * m[t_next] * gae
      adv[t, i] = gae
  return adv


def np_token_level(r, v, mask, done, v_boot, g, lam, g_tok, lam_tok, g_a, lam_a):
  """The token-level backup (`token_level_advantages` docstring) as nested loops.

  'Next' means the next valid token, found by searching forward.
  """
  T, N, K = v.shape
  order = [(t, i, k) for t in range(T) for i in range(N) for k in range(K) if mask[t, i, k]]
  adv = np.zeros((T, N, K))

  def agent_hop(t, i):  # (discount, lambda) of the hop leaving agent i's action at step t
    if i < N - 1:
      return g_a, lam_a
    return g * (1.0 - done[t]), lam

  for pos in reversed(range(len(order))):
    t, i, k = order[pos]
    later = [kk for kk in range(k + 1, K) if mask[t, i, kk]]
    if later:
      kk = later[0]
      adv[t, i, k] = g_tok * v[t, i, kk] - v[t, i, k] + g_tok * lam_tok * adv[t, i, kk]
      continue
    # Last token of the action: hop agent by agent, collecting rewards of empty actions.
    r_acc, disc, trace, (tt, ii) = 0.0, 1.0, 1.0, (t, i)
    while True:
      hop_g, hop_l = agent_hop(tt, ii)
      r_acc += disc * r[tt, ii]
      disc, trace = disc * hop_g, trace * hop_g * hop_l
      tt, ii = (tt + 1, 0) if ii == N - 1 else (tt, ii + 1)
      if tt == T or mask[tt, ii].any():
        break
    if tt == T:
      next_v, next_adv = v_boot, 0.0
    else:
      k0 = int(np.argmax(mask[tt, ii]))
      next_v, next_adv = v[tt, ii, k0], adv[tt, ii, k0]
    adv[t, i, k] = r_acc + disc * next_v - v[t, i, k] + trace * next_adv
  return adv
