"""The objective is the unit of extension: no module outside lm_jax/objectives/ branches on an objective's name,
and an objective defined here, in a test file, trains through the unchanged trainer."""
import ast
import pathlib
import pickle

import jax.numpy as jnp
import numpy as np

from lm_jax import models, objectives, train
from lm_jax.data import packing, rows
from lm_jax.objectives import losses
from lm_jax.obs import metrics_log
from conftest import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]


def _mentions_objective(node, names) -> bool:
  """Whether an AST node is an objective name, or `<something>.objective`."""
  return ((isinstance(node, ast.Constant) and node.value in names)
          or (isinstance(node, ast.Attribute) and node.attr == "objective")
          or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_mentions_objective(e, names) for e in node.elts)))


def test_no_module_outside_objectives_branches_on_an_objective_name():
  names = set(objectives.names())
  assert names >= {"mlm", "clm", "span_corruption"}
  files = [p for p in (REPO / "lm_jax").rglob("*.py") if "objectives" not in p.parts] + list((REPO / "bench").glob("*.py"))
  found = []
  for path in files:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Compare) and any(_mentions_objective(n, names) for n in [node.left, *node.comparators]):
        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
      if isinstance(node, ast.Dict) and any(k is not None and _mentions_objective(k, names) for k in node.keys):
        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
  assert not found, f"objective-name branching outside lm_jax/objectives/: {found}"
  # The check itself catches what it is meant to catch.
  assert _mentions_objective(ast.parse("config.objective == 'x'").body[0].value.left, names)
  assert _mentions_objective(ast.parse("'span_corruption'").body[0].value, names)


# ---------------------------------------------------------------------------------- a toy objective, here only
def _copy_rows(config, tokenizer):
  """Plain chunks of the document stream, padded at the epoch's end."""
  seq_len, pad = config.data.seq_len, tokenizer.pad_id
  return rows.Stream(width=seq_len, separator=tokenizer.eos_id,
                     build=lambda tokens, docs: {"input_ids": packing.chunk_rows(tokens, seq_len, pad_id=pad)})


def _copy_transform(config, tokenizer):
  pad = tokenizer.pad_id
  return lambda batch_rows, rng: dict(batch_rows, weights=(batch_rows["input_ids"] != pad).astype(np.float32))


def _copy_loss(config, params, batch, den, *, rng=None, train=False):
  """Predict the current token (a causal model can learn it from its own input: the loss falls fast)."""
  out = models.apply(config.model, params, {"input_ids": batch["input_ids"]}, rng=rng, train=train)
  ce = losses.cross_entropy(out["logits"], batch["input_ids"], batch["weights"])
  loss = ce["loss"] / den["tokens"]
  return loss, dict(loss=loss, copy_accuracy=ce["correct"] / den["tokens"], token_loss=ce["nll"] / den["tokens"])


COPY = objectives.Objective(
    name="copy_token", layouts=("decoder",), check=lambda config: None,
    lengths=lambda config: objectives.Lengths(inputs=config.data.seq_len, targets=0, scored=config.data.seq_len),
    rows=_copy_rows, transform=_copy_transform,
    features=lambda config: {"input_ids": ((config.data.seq_len,), np.int32),
                             "weights": ((config.data.seq_len,), np.float32)},
    denominators=lambda batch: {"tokens": jnp.maximum(jnp.sum(batch["weights"]), 1.0)},
    loss=_copy_loss)


def test_a_toy_objective_trains_through_the_real_trainer(shared_data, tmp_path, monkeypatch):
  monkeypatch.setattr(objectives.registry, "_REGISTRY", dict(objectives.registry._REGISTRY))  # this test only
  objectives.register(COPY)
  config = load_config("clm", shared_data, objective="copy_token", total_steps=30, log_every=10, eval_every=30,
                       checkpoint_every=30, **{"optimizer.lr": 1e-2, "optimizer.warmup_steps": 0})
  result = train.train(config, str(tmp_path))
  log = metrics_log.read(tmp_path / "metrics.jsonl")
  losses_ = [r["loss"] for r in log if "loss" in r]
  assert losses_[0] > 4.0 and losses_[-1] < 0.5 * losses_[0], losses_
  assert result["train"]["copy_accuracy"] > 0.5 and result["eval"]["eval_copy_accuracy"] > 0.5
  # tokens per example come from the objective: seq_len tokens, no decoder
  assert result["train"]["tokens_per_sec"] > 0
  assert (tmp_path / "checkpoints" / "30").is_dir()


def test_every_objective_pickles_as_its_registry_entry():
  """lm_jax.prepare hands the objective to a spawned pool; some objectives' functions are lambdas."""
  for name in objectives.names():
    assert pickle.loads(pickle.dumps(objectives.get(name))) is objectives.get(name)
