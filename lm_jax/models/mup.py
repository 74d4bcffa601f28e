"""µP, the Maximal Update Parametrization (Tensor Programs V, Yang et al. 2022, arXiv 2203.03466), as the `mup`
package (microsoft/mup) and its GPT-2 / BERT layouts (microsoft/mutransformers) apply it: the best learning rate and
init found on a narrow model hold for a wide one.

model.mup_base_width = B > 0 makes this config the width-d_model member of a family whose base model has d_model
B; 0 is the standard parametrization (SP). The base model is this one with every width dimension (d_model, d_ff,
head_dim; heads and kv heads kept) divided by m = d_model / B, so each width axis has the same multiplier m. With
B = d_model every factor below is 1 and the model is the standard one, bit for bit.

A parameter's role comes from its logical axis names: width axes are 'embed', 'mlp' and the attention heads
('heads' x 'kv' is one width dimension, H * Dh in torch's layout). A tensor spanning two width dimensions is
matrix-like (mup's infshape.ninf() == 2: the hidden Dense kernels); every other one is vector-like (embeddings
(vocab, embed), position tables, norms, biases, readouts (embed, vocab | labels)). Then, as mup does:
  - init: matrix-like params are drawn with std / sqrt(m) (mup.init.normal_), the rest as in SP;
  - Adam-family lr: matrix-like params get lr / m and weight decay * m, so lr * wd is unchanged (mup.MuAdam), the
    rest lr (lm_jax.optim.adam's lr_scales);
  - attention: logits q.k * sqrt(Dh_base) / Dh, 1/d scaling equal to 1/sqrt(Dh) at the base width (mutransformers'
    attn_mult = sqrt(base head dim));
  - readouts (the LM head, tied or not, and task heads): input multiplied by 1/m (MuReadout's output_mult / width_mult
    with output_mult 1), weights with the SP init (mutransformers re-inits the readout at constant std).
Muon (not built here) would orthogonalise each matrix-like update, whose spectral norm is then width-independent:
hidden matrices take lr * sqrt(fan_out / fan_in) (= lr when both scale by m, so no 1/m), and the vector-like params
stay on Adam with the factors above (Bernstein et al.'s spectral condition, arXiv 2310.17813).
Zero-init of the readout / query (mup's optional extras) and depth scaling are not applied.
"""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lm_jax.models import layers

WIDTH_AXES = {"embed": "embed", "mlp": "mlp", "heads": "attention", "kv": "attention"}   # axis -> width dimension


def base_width(cfg) -> int:
  return cfg.get("mup_base_width", 0)


def width_mult(cfg) -> float:
  """m = d_model / mup_base_width (1.0 under SP)."""
  return cfg.d_model / base_width(cfg) if base_width(cfg) else 1.0


def check(cfg) -> None:
  """One-line ValueError for a model.mup_base_width no base model has."""
  base = cfg.get("mup_base_width", 0)
  if not isinstance(base, int) or isinstance(base, bool) or base < 0:
    raise ValueError(f"model.mup_base_width must be a non-negative integer (0 = standard parametrization), got "
                     f"{base!r}")
  if base and not cfg.get("head_dim", 0) and base % cfg.num_heads:
    raise ValueError(f"model.mup_base_width={base} is not divisible by model.num_heads={cfg.num_heads}: the base "
                     "model's heads need a whole head_dim")


def attention_scale(cfg) -> float | None:
  """The attention logits' scale: None (1/sqrt(head_dim)) under SP or at the base width, else sqrt(Dh_base) / Dh."""
  m = width_mult(cfg)
  return None if m == 1.0 else (layers.head_dim(cfg) * m) ** -0.5


def readout(cfg, x: jax.Array) -> jax.Array:
  """A readout's input: x / m (MuReadout)."""
  m = width_mult(cfg)
  return x if m == 1.0 else x * jnp.asarray(1 / m, x.dtype)


def matrix_like(spec: PartitionSpec) -> bool:
  """Spans two width dimensions (mup's ninf() == 2)."""
  return len({WIDTH_AXES[a] for a in spec if a in WIDTH_AXES}) >= 2


def _per_param(logical_axes, matrix: float):
  return jax.tree.map(lambda spec: matrix if matrix_like(spec) else 1.0, logical_axes,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def init_scales(cfg, logical_axes):
  """Factor on each param's SP init: 1/sqrt(m) matrix-like, else 1 (a tree like logical_axes)."""
  return _per_param(logical_axes, width_mult(cfg) ** -0.5)


def lr_scales(cfg, logical_axes):
  """Adam lr factor of each param: 1/m matrix-like, else 1 (a tree like logical_axes)."""
  return _per_param(logical_axes, 1 / width_mult(cfg))


def rescale_init(cfg, params: dict, logical_axes) -> dict:
  """SP-initialised params -> µP's (unchanged under SP)."""
  if width_mult(cfg) == 1.0:
    return params
  return jax.tree.map(lambda p, k: p if k == 1.0 else (p * k).astype(p.dtype), params, init_scales(cfg, logical_axes))
