"""Published scaling laws with their papers' constants, and compute-optimal allocation.

Loss in nats/token. Kaplan et al. 2020 (WebText2; N = non-embedding params); Hoffmann et al. 2022
(Chinchilla, Approach 3, App. D.2 eq. 10); Besiroglu et al. 2024 (Epoch AI refit of the same data).
Constants and sources: docs/reference.md#scaling-laws. C in FLOPs everywhere; Kaplan's PF-day constants are converted.
"""
import dataclasses

import numpy as np
from scipy import optimize

from lm_jax.flops import PF_DAY

# Kaplan et al. 2020 (eqs. 1.1-1.8, Tables 2 and 6).
KAPLAN_N = dict(alpha=0.076, n_c=8.8e13)                      # L(N) = (N_c/N)^alpha_N
KAPLAN_D = dict(alpha=0.095, d_c=5.4e13)                      # L(D) = (D_c/D)^alpha_D
KAPLAN_C_MIN = dict(alpha=0.050, c_c=3.1e8 * PF_DAY)          # L(C_min) = (C_c/C_min)^alpha_C
KAPLAN_ND = dict(alpha_n=0.076, alpha_d=0.103, n_c=6.4e13, d_c=1.8e13)  # Table 2 fit of L(N, D)
KAPLAN_ALLOC = dict(n_e=1.3e9, exponent=0.73)                 # N_opt = 1.3e9 (C_min / PF-day)^0.73


def kaplan_loss_n(n):
  return (KAPLAN_N["n_c"] / np.asarray(n, float)) ** KAPLAN_N["alpha"]


def kaplan_loss_d(d):
  return (KAPLAN_D["d_c"] / np.asarray(d, float)) ** KAPLAN_D["alpha"]


def kaplan_loss_nd(n, d):
  """L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D."""
  k = KAPLAN_ND
  n, d = np.asarray(n, float), np.asarray(d, float)
  return ((k["n_c"] / n) ** (k["alpha_n"] / k["alpha_d"]) + k["d_c"] / d) ** k["alpha_d"]


def kaplan_loss_c_min(c):
  return (KAPLAN_C_MIN["c_c"] / np.asarray(c, float)) ** KAPLAN_C_MIN["alpha"]


@dataclasses.dataclass(frozen=True)
class Chinchilla:
  """L(N, D) = E + A / N^alpha + B / D^beta."""
  E: float
  A: float
  B: float
  alpha: float
  beta: float

  def loss(self, n, d):
    n, d = np.asarray(n, float), np.asarray(d, float)
    return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

  @property
  def a(self):
    """N_opt ~ C^a."""
    return self.beta / (self.alpha + self.beta)

  @property
  def b(self):
    """D_opt ~ C^b."""
    return self.alpha / (self.alpha + self.beta)

  @property
  def G(self):
    return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

  def allocate(self, c):
    """Closed form under C = 6ND: N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b."""
    c = np.asarray(c, float)
    return self.G * (c / 6) ** self.a, (c / 6) ** self.b / self.G

  def to_dict(self):
    return dict(E=self.E, A=self.A, B=self.B, alpha=self.alpha, beta=self.beta, a=self.a, b=self.b, G=self.G)


CHINCHILLA = Chinchilla(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
EPOCH = Chinchilla(E=1.817, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)
PRESETS = {"chinchilla": CHINCHILLA, "epoch": EPOCH}
LAWS = ("chinchilla", "epoch", "kaplan")


def isoflop_minimum(law, c):
  """Numeric IsoFLOP minimum: argmin over N of L(N, C/6N) (checks the closed form)."""
  f = lambda log_n: float(law.loss(np.exp(log_n), c / (6 * np.exp(log_n))))
  hi = np.log(c / 6)                      # N <= C/6 keeps D >= 1 token
  res = optimize.minimize_scalar(f, bounds=(0.0, hi), method="bounded", options=dict(xatol=1e-10))
  n = float(np.exp(res.x))
  return n, c / (6 * n)


def kaplan_allocate(c):
  """Kaplan's compute-efficient frontier N_opt = 1.3e9 (C/PF-day)^0.73, D = C / 6N (so D ~ C^0.27)."""
  c = np.asarray(c, float)
  n = KAPLAN_ALLOC["n_e"] * (c / PF_DAY) ** KAPLAN_ALLOC["exponent"]
  return n, c / (6 * n)


def allocate(c, law="chinchilla"):
  """Compute-optimal N, D and predicted loss for a FLOP budget under a named law."""
  _check(law)
  if law == "kaplan":
    n, d = kaplan_allocate(c)
    return dict(law=law, flops=float(c), N_opt=float(n), D_opt=float(d), loss=float(kaplan_loss_nd(n, d)),
                loss_c_min=float(kaplan_loss_c_min(c)), tokens_per_param=float(d / n))
  n, d = get_law(law).allocate(c)
  return dict(law=law, flops=float(c), N_opt=float(n), D_opt=float(d), loss=float(get_law(law).loss(n, d)),
              tokens_per_param=float(d / n))


def predict(n, d, law="chinchilla"):
  """Predicted loss (nats/token) for N params trained on D tokens."""
  _check(law)
  loss = kaplan_loss_nd(n, d) if law == "kaplan" else get_law(law).loss(n, d)
  return dict(law=law, N=float(n), D=float(d), flops=6.0 * n * d, loss=float(loss))


def _check(law):
  if law not in LAWS:
    raise ValueError(f"unknown scaling law {law!r}; known: {', '.join(LAWS)}")


def get_law(name):
  """A Chinchilla-form preset ('kaplan' has another form: use allocate/predict)."""
  if name not in PRESETS:
    raise ValueError(f"no parametric preset {name!r}; known: {', '.join(PRESETS)}")
  return PRESETS[name]
