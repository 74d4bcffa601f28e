"""FLOPs per example come from the family for the objective's lengths: the vocabulary head only on the scored
positions, a classifier run counting its classifier (and BERT's pooler) and no MLM head. Hand counts of the matmuls,
and the same counts read off the real models' jaxprs."""
import jax
import jax.numpy as jnp
import pytest

from lm_jax import config_lib, flops, models, objectives
from lm_jax.models import layers
from test_scaling import _matmul_flops


def _layer(L, d, f):
  """One post-LN layer's matmuls on L positions: Q, K, V, out projections, Q K^T and A V, the FFN's two."""
  return 2 * L * d * d * 3 + 2 * L * d * d + 2 * L * L * d + 2 * L * L * d + 2 * L * d * f + 2 * L * f * d


def test_minilm_sst2_counts_its_classifier_and_no_mlm_head():
  config = config_lib.load("configs/finetune/bert.py:minilm_sst2")
  L, d, f, n, V, k = 48, 384, 1536, 6, 30522, 2    # all-MiniLM-L6-v2 at seq 48, two SST-2 classes
  assert (config.data.seq_len, config.model.d_model, config.model.d_ff, config.model.num_layers,
          config.model.vocab_size, config.model.num_labels) == (L, d, f, n, V, k)
  pooler, classifier = 2 * d * d, 2 * d * k         # on [CLS] only
  want = 3 * (n * _layer(L, d, f) + pooler + classifier)
  assert objectives.get("classify").flops_per_example(config) == want
  # the MLM head over the vocabulary on every position, which the count charged before, is a third of this
  assert 3 * 2 * L * d * V > want / 3


def test_gpt_classify_counts_its_lm_head_and_classifier_on_every_position():
  config = config_lib.load("configs/finetune/gpt1.py:sst2")
  L, d, f, n, V, k = 128, 768, 3072, 12, 40478, 2   # GPT-1 at seq 128, one row per SST-2 example
  assert (config.data.seq_len, config.model.d_model, config.model.d_ff, config.model.num_layers,
          config.model.vocab_size, config.model.num_labels) == (L, d, f, n, V, k)
  lm_head = 2 * L * d * V        # the auxiliary LM loss (task.lm_coef) reads every position
  classifier = 2 * L * d * k     # the task head runs on every position; the loss reads the extract token's
  assert objectives.get("gpt_classify").flops_per_example(config) == 3 * (n * _layer(L, d, f) + lm_head + classifier)


@pytest.mark.parametrize("file,outputs", [("bert", ("logits",)), ("gpt1", ("logits", "scores"))])
def test_classifier_counts_match_the_real_models(file, outputs):
  """The family's count with num_labels > 0 = every matmul in the forward pass that produces what the loss reads."""
  m = layers.replace(config_lib.load(f"configs/{file}.py:tiny").model, num_labels=3)
  L = 32
  ids = jax.ShapeDtypeStruct((2, L), jnp.int32)
  forward = lambda p, b: [out[key] for out in [models.apply(m, p, b)] for key in outputs]
  counted = _matmul_flops(jax.make_jaxpr(forward)(models.abstract_params(m), dict(input_ids=ids)).jaxpr)
  scored = L if "scores" in outputs else 0
  assert 2 * models.forward_flops(m, flops.Lengths(L, 0, scored)) == counted   # 2 rows
