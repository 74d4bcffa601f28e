"""Qwen3 (lm_jax/models/qwen3.py, lm_jax/hf/qwen3.py, configs/qwen3.py): Llama's model with QK-norm and a head_dim
set apart from d_model / num_heads. Qwen3-0.6B's parameter count as transformers has it, logits within 1e-4 of
transformers both ways with a decoupled head_dim and GQA, and greedy and beam generate token-identical to
transformers' (the rest of the machinery is Llama's: tests/test_llama.py)."""
import pytest

from test_llama import check_both_ways, check_generate, hf_random
from lm_jax import config_lib, models
from lm_jax import hf as hf_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
  """(transformers' Qwen3: 4 heads of 12 on a width of 32 over 2 kv heads, tied head; our config and params)."""
  hf = hf_random(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=12, tie_word_embeddings=True)
  path, out = (str(tmp_path_factory.mktemp(name)) for name in ("hf", "ours"))
  hf.save_pretrained(path)
  m, p = check_both_ways(hf, transformers.Qwen3ForCausalLM, path, out)
  return hf, m, p


def test_parameter_count_equals_hf():
  m = config_lib.load("configs/qwen3.py:0_6b", {"model.scan_layers": True}).model
  assert models.count(models.abstract_params(m)) == 596_049_920
  hf_config = {k: v for k, v in hf_lib.family_module(m).hf_config(m).items() if k != "architectures"}
  with torch.device("meta"):
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
  assert type(hf).__name__ == "Qwen3ForCausalLM" and sum(t.numel() for t in hf.parameters()) == 596_049_920


def test_decoupled_head_dim_and_qk_norm_both_ways(qwen3):
  _, m, p = qwen3
  assert (m.family, m.head_dim, m.num_kv_heads, m.qk_norm) == ("qwen3", 12, 2, True)
  attention = p["layers_0"]["attention"]
  assert attention["query"]["kernel"].shape == (32, 4, 12) and attention["key_norm"]["scale"].shape == (12,)


def test_generate_matches_transformers(qwen3):
  hf, m, p = qwen3
  check_generate(m, p, hf)
