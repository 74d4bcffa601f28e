"""Fitting scaling laws to (N, D, loss) runs the way Hoffmann et al. 2022 did.

Approach 3 (App. D.2): minimise sum_i Huber_delta(LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i),
delta = 1e-3, with L-BFGS from the paper's grid of initialisations, keep the best; A, B, E = exp(a, b, e).
The grid (alpha, beta in {0, .5, .., 2}, e in {-1, -.5, .., 1}, a, b in {0, 5, .., 25}) has 5*5*5*6*6 = 4500
starts. L-BFGS runs on all starts at once (one jitted, batched JAX program: two-loop recursion and a line
search over a fixed grid of step sizes, so no start waits on another) in float32; the best few distinct
minima are then refined in float64 the same way. (scipy's L-BFGS-B reaches the same optimum, see the tests,
but one start at a time, far slower over 4500 starts: bench/README.md.)
Bootstrap: resample runs with replacement, as multinomial weights on the runs, and refit every resample
at once from the full fit's optimum (plus a few perturbed starts): its optimum sits next to the full-data
one, so the 4500-start grid is not needed there, which keeps hundreds of resamples cheap.
Approach 2 (§3.2): a parabola in log N per IsoFLOP budget gives N_opt(C); a line in log-log gives a, b.
"""
import csv
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lm_jax.scaling.laws import Chinchilla

DELTA = 1e-3
PARAMS = ("E", "A", "B", "alpha", "beta", "a", "b")


def init_grid():
  """Hoffmann et al.'s initialisations as rows (a, b, e, alpha, beta)."""
  ab, e, exps = np.arange(0, 26, 5.0), np.arange(-1, 1.01, 0.5), np.arange(0, 2.01, 0.5)
  return np.array([(a, b, e_, al, be) for a, b, e_, al, be in itertools.product(ab, ab, e, exps, exps)])


def _objective(p, x, w):
  """Weighted Huber loss of LSE(a - alpha log N, b - beta log D, e) against log L, for a batch of parameter
  rows p (..., 5) with weights w (..., n); x = (log N, log D, log L) of shape (3, n)."""
  a, b, e, alpha, beta = (p[..., i:i + 1] for i in range(5))
  lse = jnp.logaddexp(jnp.logaddexp(a - alpha * x[0], b - beta * x[1]), e)
  return jnp.sum(w * optax.losses.huber_loss(lse, x[2], delta=DELTA), axis=-1)


STEPS = 4.0 ** np.arange(1, -9, -1)  # line-search grid 4 .. 4^-8, tried all at once


@functools.partial(jax.jit, static_argnames=("iters", "memory"))
def _lbfgs_batch(starts, x, weights, iters=60, memory=8):
  """L-BFGS on every row of starts (K, 5) at once, row k weighting the runs by weights[k] (K, n).

  The direction is the usual two-loop recursion; the step is the best of STEPS (an exact line search on a
  grid, evaluated for all rows in one batch), so no row waits on another's while loop. Returns (params, values).
  """
  value_and_grad = jax.vmap(jax.value_and_grad(_objective), in_axes=(0, None, 0))
  dot = lambda u, v: jnp.sum(u * v, axis=-1)

  def direction(g, s_hist, y_hist, rho):
    q, alphas = g, []
    for i in range(memory):                                   # newest first
      alpha = rho[:, i] * dot(s_hist[:, i], q)
      q = q - alpha[:, None] * y_hist[:, i]
      alphas.append(alpha)
    sy, yy = dot(s_hist[:, 0], y_hist[:, 0]), dot(y_hist[:, 0], y_hist[:, 0])
    r = q * jnp.where(rho[:, 0] > 0, sy / jnp.maximum(yy, 1e-30), 1.0)[:, None]
    for i in reversed(range(memory)):
      beta = rho[:, i] * dot(y_hist[:, i], r)
      r = r + s_hist[:, i] * (alphas[i] - beta)[:, None]
    d = -r
    return jnp.where((dot(d, g) < 0)[:, None], d, -g)

  def step(carry, _):
    p, f, g, s_hist, y_hist, rho = carry
    d = direction(g, s_hist, y_hist, rho)
    trial = p[:, None] + jnp.asarray(STEPS, p.dtype)[None, :, None] * d[:, None]  # (K, steps, 5)
    f_trial = _objective(trial, x, weights[:, None])
    best = jnp.argmin(jnp.where(jnp.isfinite(f_trial), f_trial, jnp.inf), axis=1)
    p_new = jnp.take_along_axis(trial, best[:, None, None], axis=1)[:, 0]
    f_new, g_new = value_and_grad(p_new, x, weights)
    ok = (f_new < f) & jnp.isfinite(f_new)
    p_new, f_new, g_new = (jnp.where(ok[:, None], p_new, p), jnp.where(ok, f_new, f),
                           jnp.where(ok[:, None], g_new, g))
    s, y = p_new - p, g_new - g
    sy = dot(s, y)
    push = ok & (sy > 1e-12)
    s_hist = jnp.where(push[:, None, None], jnp.concatenate([s[:, None], s_hist[:, :-1]], 1), s_hist)
    y_hist = jnp.where(push[:, None, None], jnp.concatenate([y[:, None], y_hist[:, :-1]], 1), y_hist)
    rho = jnp.where(push[:, None], jnp.concatenate([1 / jnp.where(push, sy, 1.0)[:, None], rho[:, :-1]], 1), rho)
    return (p_new, f_new, g_new, s_hist, y_hist, rho), None

  k = starts.shape[0]
  f0, g0 = value_and_grad(starts, x, weights)
  zeros = jnp.zeros((k, memory, 5), starts.dtype)
  carry = (starts, f0, g0, zeros, zeros, jnp.zeros((k, memory), starts.dtype))
  (p, f, *_), _ = jax.lax.scan(step, carry, None, length=iters)
  return p, f


def _minimize(starts, x, weights, iters, dtype):
  """Batched L-BFGS in dtype; numpy (params, values), non-finite values -> inf."""
  with jax.enable_x64(dtype == np.float64):
    p, f = _lbfgs_batch(jnp.asarray(starts, dtype), jnp.asarray(x, dtype), jnp.asarray(weights, dtype),
                        iters=iters)
    p, f = np.asarray(p, float), np.asarray(f, float)
  return p, np.where(np.isfinite(f), f, np.inf)


def _distinct_best(params, values, k):
  """The k lowest-loss finite results whose parameters differ (rounded), best first."""
  out, seen = [], set()
  for i in np.argsort(values)[:np.isfinite(values).sum()]:
    key = tuple(np.round(params[i], 2))
    if key not in seen:
      seen.add(key)
      out.append(params[i])
    if len(out) == k:
      break
  return np.array(out)


def _as_law(p):
  a, b, e, alpha, beta = (float(v) for v in p)
  return Chinchilla(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta)


def _data(n, d, loss):
  n, d, loss = (np.asarray(v, float) for v in (n, d, loss))
  if len(n) < 2:
    raise ValueError(f"fit: need at least 2 runs, got {len(n)}")
  if np.any(n <= 0) or np.any(d <= 0) or np.any(loss <= 0):
    raise ValueError("fit: N, D and loss must all be positive")
  return np.stack([np.log(n), np.log(d), np.log(loss)])


def fit_approach3(n, d, loss, *, starts=None, iters=60, refine=4, refine_iters=200):
  """Hoffmann Approach 3: the best fit over all starts. Returns (Chinchilla law, Huber objective)."""
  x = _data(n, d, loss)
  starts = init_grid() if starts is None else np.asarray(starts, float)
  params, values = _minimize(starts, x, np.ones((len(starts), x.shape[1])), iters, np.float32)
  best = _distinct_best(params, values, refine)
  params, values = _minimize(best, x, np.ones((len(best), x.shape[1])), refine_iters, np.float64)
  i = int(np.argmin(values))
  return _as_law(params[i]), float(values[i])


def bootstrap(n, d, loss, *, num=200, seed=0, level=0.95, law=None, iters=200):
  """Bootstrap over runs: percentile CIs {param: [lo, hi]} for E, A, B, alpha, beta, a, b, and the
  resampled fits (num, 7) in PARAMS order."""
  x = _data(n, d, loss)
  if law is None:
    law, _ = fit_approach3(n, d, loss)
  runs = x.shape[1]
  weights = np.random.default_rng(seed).multinomial(runs, np.full(runs, 1 / runs), size=num).astype(float)
  center = np.array([np.log(law.A), np.log(law.B), np.log(law.E), law.alpha, law.beta])
  init = center + np.array([[0, 0, 0, 0, 0], [1, 1, 0.1, 0.05, 0.05], [-1, -1, -0.1, -0.05, -0.05]])
  params, values = _minimize(np.tile(init, (num, 1)), x, np.repeat(weights, len(init), 0), iters, np.float64)
  best = np.argmin(values.reshape(num, len(init)), axis=1)
  params = params.reshape(num, len(init), 5)[np.arange(num), best]
  fits = np.array([[getattr(_as_law(p), k) for k in PARAMS] for p in params])
  tail = 100 * (1 - level) / 2
  lo, hi = np.percentile(fits, [tail, 100 - tail], axis=0)
  return {k: [float(l), float(h)] for k, l, h in zip(PARAMS, lo, hi)}, fits


def fit_approach2(n, d, loss, c=None, rel_tol=0.05):
  """Hoffmann Approach 2: per IsoFLOP budget (>= 3 sizes) fit loss = p(log N) quadratic; N_opt at its vertex;
  then log N_opt = a log C + const and D_opt = C / 6 N_opt gives b. Returns None with < 2 usable budgets."""
  n, d, loss = (np.asarray(v, float) for v in (n, d, loss))
  c = 6 * n * d if c is None else np.asarray(c, float)
  budgets = group_budgets(c, rel_tol)
  rows = []
  for budget, idx in budgets:
    if len(np.unique(n[idx])) < 3:
      continue
    q = np.polyfit(np.log(n[idx]), loss[idx], 2)
    if q[0] <= 0:                       # no minimum: the profile is not convex
      continue
    log_n = -q[1] / (2 * q[0])
    rows.append(dict(C=budget, N_opt=float(np.exp(log_n)), D_opt=float(budget / (6 * np.exp(log_n))),
                     loss_opt=float(np.polyval(q, log_n)), parabola=q.tolist()))
  if len(rows) < 2:
    return None
  cs = np.log([r["C"] for r in rows])
  a, log_k_n = np.polyfit(cs, np.log([r["N_opt"] for r in rows]), 1)
  b, log_k_d = np.polyfit(cs, np.log([r["D_opt"] for r in rows]), 1)
  return dict(a=float(a), b=float(b), k_n=float(np.exp(log_k_n)), k_d=float(np.exp(log_k_d)), budgets=rows)


def group_budgets(c, rel_tol=0.05):
  """Group runs whose compute agrees within rel_tol: [(mean C, indices)], ascending."""
  order = np.argsort(c)
  groups = []
  for i in order:
    if groups and c[i] <= groups[-1][0] * (1 + rel_tol):
      groups[-1][1].append(i)
    else:
      groups.append((c[i], [i]))
  return [(float(np.mean(c[idx])), np.array(idx)) for _, idx in groups]


def read_runs(path):
  """CSV with columns N, loss and D (tokens) or C (= 6ND); an optional `budget` column groups IsoFLOP runs.
  Returns dict of float arrays N, D, loss, C (the budget when given, else 6ND)."""
  try:
    with open(path, newline="") as f:
      rows = list(csv.DictReader(f))
  except FileNotFoundError:
    raise FileNotFoundError(f"--runs: no such file {path}") from None
  columns = set(rows[0]) if rows else set()
  missing = [k for k in ("N", "loss") if k not in columns] + ([] if columns & {"D", "C"} else ["D or C"])
  if missing:
    raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; need N, D (or C = 6ND), loss")
  try:
    col = lambda k: np.array([float(r[k]) for r in rows])
    n, loss = col("N"), col("loss")
    d = col("D") if "D" in columns else col("C") / (6 * n)
    c = col("budget") if "budget" in columns else 6 * n * d
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  return dict(N=n, D=d, loss=loss, C=c)
