"""One PNG summarising a fit: IsoFLOP profiles, the compute-optimal frontier, and loss vs compute."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lm_jax.obs import plot as obs_plot  # noqa: E402
from lm_jax.scaling import fit as fitting  # noqa: E402


def plot_fit(runs, law, approach2, path):
  """runs: dict of arrays N, D, loss, C (budget). law: the fitted Chinchilla; approach2: fit_approach2's dict."""
  n, loss, c = (np.asarray(runs[k], float) for k in ("N", "loss", "C"))
  budgets = fitting.group_budgets(c)
  colors = plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))
  fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))

  n_grid = np.geomspace(n.min() / 2, n.max() * 2, 200)
  for (budget, idx), color in zip(budgets, colors):
    ax1.scatter(n[idx], loss[idx], color=color, label=f"C = {budget:.2g}")
    ax1.plot(n_grid, law.loss(n_grid, budget / (6 * n_grid)), color=color, lw=1)
    n_opt, d_opt = law.allocate(budget)
    ax1.scatter([n_opt], [law.loss(n_opt, d_opt)], color=color, marker="*", s=150, edgecolor="k", zorder=3)
  for row in (approach2 or {}).get("budgets", []):
    ax1.scatter([row["N_opt"]], [row["loss_opt"]], marker="x", color="r", s=60, zorder=4)
  ax1.set(xscale="log", xlim=(n_grid[0], n_grid[-1]), xlabel="parameters N", ylabel="final eval loss (nats/token)",
          title="IsoFLOP profiles (lines: fit, *: fit optimum, x: parabola min)")
  lo, hi = np.nanpercentile(loss, [0, 100])
  ax1.set_ylim(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo))
  ax1.legend(fontsize=8)

  c_grid = np.geomspace(c.min() / 3, c.max() * 3, 100)
  n_fit, d_fit = law.allocate(c_grid)
  ax2.plot(c_grid, n_fit, "b-", label=f"N_opt (fit, a = {law.a:.3f})")
  ax2.plot(c_grid, d_fit, "g-", label=f"D_opt (fit, b = {law.b:.3f})")
  best = [idx[np.argmin(loss[idx])] for _, idx in budgets]
  ax2.scatter(c[best], n[best], color="b", marker="o", label="best run's N per budget")
  if approach2:
    cs = [r["C"] for r in approach2["budgets"]]
    ax2.scatter(cs, [r["N_opt"] for r in approach2["budgets"]], color="r", marker="x",
                label=f"Approach 2 N_opt (a = {approach2['a']:.3f})")
  ax2.set(xscale="log", yscale="log", xlabel="compute C = 6ND (FLOPs)", ylabel="N or D",
          title="Compute-optimal frontier")
  ax2.legend(fontsize=8)

  ax3.scatter(c, loss, c=np.log10(n), cmap="plasma", label="runs (colour: log10 N)")
  ax3.plot(c_grid, law.loss(n_fit, d_fit), "k-", label="fit on the frontier")
  ax3.axhline(law.E, color="gray", ls="--", lw=1, label=f"E = {law.E:.3f}")
  ax3.set(xscale="log", xlabel="compute C (FLOPs)", ylabel="final eval loss", title="Loss vs compute")
  ax3.legend(fontsize=8)
  fig.suptitle(f"L(N, D) = {law.E:.3f} + {law.A:.4g}/N^{law.alpha:.3f} + {law.B:.4g}/D^{law.beta:.3f}")
  fig.tight_layout()
  obs_plot.save(fig, path, dpi=110)   # never through a link placed at path
  plt.close(fig)
